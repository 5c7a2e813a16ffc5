-- gdp.nn.CausalLM: a GDP language model: token embedding, N pre-norm blocks (GDP mixer
-- + SwiGLU MLP), a final RMSNorm and the vocabulary head.
--
--   local lm = nn.CausalLM{vocab = 256, hidden = 64, layers = 2,
--                          mixer = {num_heads = 4, head_dim = 16, state_dim = 16,
--                                   num_householder = 2, allow_neg_eigval = true},
--                          mlp_ratio = 4, tie_embeddings = true, dtype = "f64", seed = 1}
--   local logits = lm:forward(tokens, cu_seqlens)   -- tokens [B,T] or [T] -> [..., vocab]
--   local loss, dlogits = nn.functional.cross_entropy(logits, targets)
--   lm:backward(tokens, dlogits, cu_seqlens)        -- returns nil; accumulates gradients
--
-- Options: vocab, hidden, layers (1), mixer (nn.GatedDeltaProduct's options without
-- hidden_size, dtype, device, seed and num_layers, which the model sets), mlp_ratio (4:
-- hidden x 4 SwiGLU), mlp_bias (false), tie_embeddings (false: the head has its own
-- weight), norm_eps (1e-5), init_std (0.02: the embedding, and the untied head's
-- weight, ~ N(0, init_std)), dtype, device, seed (nil: the device's current stream).
--
-- Parameter names: embed.weight, layers.<i>.mixer_norm.weight, layers.<i>.mixer.<...>
-- (Megatron's mixer names), layers.<i>.mlp_norm.weight, layers.<i>.mlp.w_gate / w_up /
-- w_down, norm.weight, lm_head.weight (absent when tied: the head then reads and adds
-- into embed.weight).
--
-- Layout.  The mixer is sequence-major, so the model runs on [T,B,D] inside: tokens
-- [B,T] are read through a transposed view (the embedding reads ids on the host
-- anyway), and the logits come back as a [B,T,vocab] view of the [T,B,vocab] result
-- (contiguous when B = 1, the packed case).  cu_seqlens (packed sequences) needs
-- tokens [T] or [1,T].  A token out of [0, vocab) is an error naming its position in
-- that view and in the tokens passed ("at [t,b] (a permuted view: [b,t] in the tensor
-- it views)").
local tensor = require("gdp.tensor")
local Module = require("gdp.nn.Module")
local Embedding = require("gdp.nn.Embedding")
local Linear = require("gdp.nn.Linear")
local RMSNorm = require("gdp.nn.RMSNorm")
local MLP = require("gdp.nn.MLP")
local Block = require("gdp.nn.Block")
local Sequential = require("gdp.nn.Sequential")
local GatedDeltaProduct = require("gdp.nn.GatedDeltaProduct")

local argerror = tensor.argerror

local CausalLM = Module.class("CausalLM")
local FN = CausalLM.FN

local keys = { vocab = true, hidden = true, layers = true, mixer = true, mlp_ratio = true,
               mlp_bias = true, tie_embeddings = true, norm_eps = true, init_std = true,
               dtype = true, device = true, seed = true }

local MODEL_SET = { hidden_size = true, dtype = true, device = true, seed = true, num_layers = true }

local function mixer_config(self, cfg)
  if type(cfg) ~= "table" then
    argerror(FN, "mixer: expected a table of nn.GatedDeltaProduct options, got " .. tostring(cfg))
  end
  local out = {}
  for k, v in pairs(cfg) do
    if MODEL_SET[k] then
      argerror(FN, "mixer." .. tostring(k) .. ": set by the model (hidden, dtype, device, seed, layers); leave it out")
    end
    out[k] = v
  end
  out.hidden_size, out.dtype, out.device, out.num_layers = self.hidden, self.dtype, self.device, self.num_layers
  return out
end

function CausalLM.new(cfg)
  cfg = Module.options(FN, cfg, keys)
  local self = setmetatable({}, CausalLM)
  self.vocab = Module.int_opt(FN, cfg, "vocab", nil, 1)
  self.hidden = Module.int_opt(FN, cfg, "hidden", nil, 1)
  self.num_layers = Module.int_opt(FN, cfg, "layers", 1, 0)
  local ratio = Module.num_opt(FN, cfg, "mlp_ratio", 4, 0)
  self.mlp_hidden = math.floor(ratio * self.hidden + 0.5)
  self.tied = cfg.tie_embeddings == true
  local eps = Module.num_opt(FN, cfg, "norm_eps", 1e-5, 0)
  local std = Module.num_opt(FN, cfg, "init_std", 0.02, 0)
  self.dtype, self.device = Module.dtype_device(FN, cfg)
  self.device_name = tensor.get_ctx(FN, self.device):name()
  local mixer_cfg = mixer_config(self, cfg.mixer or {})
  local dd = { dtype = self.dtype, device = self.device }
  Module.with_seed(FN, self.device, cfg.seed, function()
    self.embed = Embedding{ num_embeddings = self.vocab, dim = self.hidden, init_std = std,
                            dtype = self.dtype, device = self.device }
    self.layers = Sequential()
    for _ = 1, self.num_layers do
      local mlp
      if self.mlp_hidden > 0 then
        mlp = MLP{ dim = self.hidden, hidden = self.mlp_hidden, bias = cfg.mlp_bias == true,
                   dtype = self.dtype, device = self.device }
      end
      self.layers:add(Block{ mixer = GatedDeltaProduct(mixer_cfg), mlp = mlp, norm_eps = eps })
    end
    self.layers.dtype, self.layers.device = self.dtype, self.device
    self.norm = RMSNorm{ dim = self.hidden, eps = eps, dtype = self.dtype, device = self.device }
    if self.tied then
      self.lm_head = Linear{ tied_to = self.embed, bias = false, dtype = self.dtype, device = self.device }
    else
      self.lm_head = Linear{ in_features = self.hidden, out_features = self.vocab, bias = false,
                             init = std, dtype = dd.dtype, device = dd.device }
    end
  end)
  self.children = { { "embed", self.embed }, { "layers", self.layers }, { "norm", self.norm },
                    { "lm_head", self.lm_head } }
  return self
end

local function check_tokens(fn, tokens, cu_seqlens)
  tensor.tensor_arg(tokens, fn, "tokens")
  if tokens:dtype() ~= "i32" and tokens:dtype() ~= "i64" then
    argerror(fn, "tokens: expected dtype i32 or i64 (token ids), got " .. tokens:dtype())
  end
  if tokens:dim() ~= 1 and tokens:dim() ~= 2 then
    argerror(fn, "tokens: expected [B,T] or [T], got " .. tensor.shape_str(tokens:shape()))
  end
  if cu_seqlens ~= nil and tokens:dim() == 2 and tokens:size(1) ~= 1 then
    argerror(fn, "tokens: expected [T] or [1,T] with cu_seqlens (packed sequences), got " ..
                 tensor.shape_str(tokens:shape()))
  end
end

-- tokens as [T,B] (a view).
local function sequence_major(tokens)
  if tokens:dim() == 1 then return tokens:view(tokens:size(1), 1) end
  return tokens:transpose(1, 2)
end

-- logits [T,B,V] back in the tokens' layout (a view), and the inverse for gradients.
local function batch_major(tokens, x)
  if tokens:dim() == 1 then return x:select(2, 1) end
  return x:transpose(1, 2)
end
local function from_batch_major(tokens, d)
  if tokens:dim() == 1 then return d:view(d:size(1), 1, d:size(2)) end
  return d:transpose(1, 2)
end

local function cache_key(tokens, cu_seqlens)
  return Module.packing_key(cu_seqlens)
end

function CausalLM:forward(tokens, cu_seqlens)
  check_tokens(FN .. ":forward", tokens, cu_seqlens)
  local c = { tok = sequence_major(tokens) }
  c.h0 = self.embed:forward(c.tok)
  c.hL = self.layers:forward(c.h0, cu_seqlens)
  c.hn = self.norm:forward(c.hL)
  local logits = batch_major(tokens, self.lm_head:forward(c.hn))
  Module.set_cache(self, tokens, cache_key(tokens, cu_seqlens), c)
  self.output = logits
  return logits
end

-- Accumulates every parameter's gradient for the loss sum(logits * dlogits); returns
-- nil (the input is tokens).  Reuses the last forward when it ran on these tokens and
-- packing, else runs it again.
function CausalLM:backward(tokens, dlogits, cu_seqlens)
  local fn = FN .. ":backward"
  check_tokens(fn, tokens, cu_seqlens)
  local c = Module.cache_for(self, tokens, cache_key(tokens, cu_seqlens))
  if c == nil then
    self:forward(tokens, cu_seqlens)
    c = self.cache
  end
  Module.check_grad_output(fn, dlogits, self.output)
  local dhn = self.lm_head:backward(c.hn, from_batch_major(tokens, dlogits))
  local dhL = self.norm:backward(c.hL, dhn)
  local dh0 = self.layers:backward(c.h0, dhL, cu_seqlens)
  self.embed:backward(c.tok, dh0)
  return nil
end

function CausalLM:__tostring()
  return string.format("nn.CausalLM(vocab %d, hidden %d, %d layers, mlp %d%s, %s, %s)",
                       self.vocab, self.hidden, self.num_layers, self.mlp_hidden,
                       self.tied and ", tied embeddings" or "", self.dtype, self.device)
end

return CausalLM
