-- gdp.nn: layers in the style of torch's nn (forward / backward, parameters and
-- accumulated gradients by name), built from the mixer ops of gdp.nn.functional.
--
--   local nn = require("gdp.nn")
--   local m = nn.GatedDeltaProduct{hidden_size = 64, num_heads = 4, head_dim = 16,
--                                  state_dim = 16, num_householder = 2}
local nn = {}

nn.functional = require("gdp.nn.functional")
nn.GatedDeltaProduct = require("gdp.nn.GatedDeltaProduct")

return nn
