-- gdp.nn: layers in the style of torch's nn (forward / backward, parameters and
-- accumulated gradients by name; the contract is in gdp/nn/Module.lua), built from the
-- ops of gdp.nn.functional.
--
--   local nn = require("gdp.nn")
--   local m = nn.GatedDeltaProduct{hidden_size = 64, num_heads = 4, head_dim = 16,
--                                  state_dim = 16, num_householder = 2}
--   local lm = nn.CausalLM{vocab = 256, hidden = 64, layers = 2, mixer = {...}}
local nn = {}

nn.functional = require("gdp.nn.functional")
nn.Module = require("gdp.nn.Module")
nn.GatedDeltaProduct = require("gdp.nn.GatedDeltaProduct")
nn.Embedding = require("gdp.nn.Embedding")
nn.Linear = require("gdp.nn.Linear")
nn.RMSNorm = require("gdp.nn.RMSNorm")
nn.MLP = require("gdp.nn.MLP")
nn.Block = require("gdp.nn.Block")
nn.Sequential = require("gdp.nn.Sequential")
nn.CausalLM = require("gdp.nn.CausalLM")
nn.CrossEntropy = require("gdp.nn.CrossEntropy")

return nn
