-- gdp.nn.Embedding: rows of a [num_embeddings, dim] table looked up by token id.
--
--   local emb = nn.Embedding{num_embeddings = 256, dim = 64, dtype = "f64"}
--   local x = emb:forward(tokens)             -- tokens i32/i64 [B,T] or [T] -> [..., 64]
--   emb:backward(tokens, dx)                  -- returns nil; accumulates weight's gradient
--
-- Token ids are values in [0, num_embeddings) (0-based, as every tokenizer writes
-- them); the token tensor may live on the cpu or on the module's device.  The backward
-- sums each row's gradients in token order on every device (gdp.h,
-- gdp_nn_embedding_backward), so it repeats bit for bit.  Options: num_embeddings,
-- dim, init_std (0.02: weight ~ N(0, init_std)), dtype, device, seed.
local tensor = require("gdp.tensor")
local Module = require("gdp.nn.Module")
local F = require("gdp.nn.functional")

local argerror = tensor.argerror

local Embedding = Module.class("Embedding")
local FN = Embedding.FN

local keys = { num_embeddings = true, dim = true, init_std = true, dtype = true, device = true,
               seed = true }

function Embedding.new(cfg)
  cfg = Module.options(FN, cfg, keys)
  local self = setmetatable({}, Embedding)
  self.num_embeddings = Module.int_opt(FN, cfg, "num_embeddings", nil, 1)
  self.dim = Module.int_opt(FN, cfg, "dim", nil, 1)
  local std = Module.num_opt(FN, cfg, "init_std", 0.02, 0)
  self.dtype, self.device = Module.dtype_device(FN, cfg)
  self.device_name = tensor.get_ctx(FN, self.device):name()
  Module.with_seed(FN, self.device, cfg.seed, function()
    Module.add_parameter(self, "weight",
      tensor.empty({ self.num_embeddings, self.dim }, { dtype = self.dtype, device = self.device })
            :normal_(0, std))
  end)
  return self
end

local function check_tokens(fn, tokens)
  tensor.tensor_arg(tokens, fn, "tokens")
  local dt = tokens:dtype()
  if dt ~= "i32" and dt ~= "i64" then
    argerror(fn, "tokens: expected dtype i32 or i64 (token ids), got " .. dt)
  end
end

function Embedding:forward(tokens)
  check_tokens(FN .. ":forward", tokens)
  self.output = F.embedding(self.params.weight, tokens)
  return self.output
end

-- Accumulates weight's gradient from dy [tokens' shape..., dim]; returns nil (the
-- input is integer).
function Embedding:backward(tokens, dy)
  local fn = FN .. ":backward"
  check_tokens(fn, tokens)
  Module.check_float_input(self, fn, dy, "dy", self.dim)
  Module.accumulate(self.grads.weight, F.embedding_backward(tokens, dy, self.num_embeddings))
  return nil
end

function Embedding:__tostring()
  return string.format("nn.Embedding(%d x %d, %s, %s)", self.num_embeddings, self.dim,
                       self.dtype, self.device)
end

return Embedding
