-- gdp.nn.Block: the pre-norm residual block of a GDP language model,
--
--   h = x + mixer(mixer_norm(x)),   y = h + mlp(mlp_norm(h))
--
--   local blk = nn.Block{mixer = nn.GatedDeltaProduct{hidden_size = 64, ...},
--                        mlp = nn.MLP{dim = 64}}
--   local y = blk:forward(x, cu_seqlens)      -- x in the mixer's layout ([T,B,D] for GDP)
--   local dx = blk:backward(x, dy, cu_seqlens)
--
-- The arguments after x (cu_seqlens for the GDP mixer) go to the mixer; mlp may be nil
-- (no second half).  Parameter names: mixer_norm.weight, mixer.<...>, mlp_norm.weight,
-- mlp.<...>.  Options: mixer, mlp, dim (the mixer's hidden_size or the mlp's dim),
-- norm_eps (1e-5); the norms take the mixer's dtype and device.
local tensor = require("gdp.tensor")
local Module = require("gdp.nn.Module")
local RMSNorm = require("gdp.nn.RMSNorm")

local argerror = tensor.argerror

local Block = Module.class("Block")
local FN = Block.FN

local keys = { mixer = true, mlp = true, dim = true, norm_eps = true }

local function is_module(m)
  return type(m) == "table" and type(m.forward) == "function" and type(m.backward) == "function"
         and type(m.parameter_names) == "function"
end

function Block.new(cfg)
  cfg = Module.options(FN, cfg, keys)
  if not is_module(cfg.mixer) then
    argerror(FN, "mixer: expected a module (forward, backward, parameter_names), got " .. tostring(cfg.mixer))
  end
  if cfg.mlp ~= nil and not is_module(cfg.mlp) then
    argerror(FN, "mlp: expected a module or nil, got " .. tostring(cfg.mlp))
  end
  local self = setmetatable({}, Block)
  self.mixer, self.mlp = cfg.mixer, cfg.mlp
  self.dim = cfg.dim or self.mixer.hidden_size or (self.mlp and self.mlp.dim)
  self.dim = Module.int_opt(FN, { dim = self.dim }, "dim", nil, 1)
  if self.mlp and self.mlp.dim and self.mlp.dim ~= self.dim then
    argerror(FN, string.format("mlp: expected dim %d (the mixer's), got %d", self.dim, self.mlp.dim))
  end
  self.dtype, self.device = self.mixer.dtype, self.mixer.device
  if self.mlp and (self.mlp.dtype ~= self.dtype or self.mlp.device ~= self.device) then
    argerror(FN, string.format("mlp: expected dtype %s on %s (the mixer's), got %s on %s",
                               self.dtype, self.device, tostring(self.mlp.dtype), tostring(self.mlp.device)))
  end
  local eps = Module.num_opt(FN, cfg, "norm_eps", 1e-5, 0)
  local norm = { dim = self.dim, eps = eps, dtype = self.dtype, device = self.device }
  self.mixer_norm = RMSNorm(norm)
  self.children = { { "mixer_norm", self.mixer_norm }, { "mixer", self.mixer } }
  if self.mlp then
    self.mlp_norm = RMSNorm(norm)
    self.children[3] = { "mlp_norm", self.mlp_norm }
    self.children[4] = { "mlp", self.mlp }
  end
  return self
end

function Block:forward(x, ...)
  local c = {}
  c.u1 = self.mixer_norm:forward(x)
  c.h = x:add(self.mixer:forward(c.u1, ...))
  local y = c.h
  if self.mlp then
    c.u2 = self.mlp_norm:forward(c.h)
    y = c.h:add(self.mlp:forward(c.u2))
  end
  Module.set_cache(self, x, Module.packing_key((...)), c)
  self.output = y
  return y
end

-- dx for the loss sum(y * dy); reuses the last forward when it ran on this x with the
-- same mixer arguments, else runs it again.
function Block:backward(x, dy, ...)
  local fn = FN .. ":backward"
  tensor.tensor_arg(x, fn, "x")
  local c = Module.cache_for(self, x, Module.packing_key((...)))
  if c == nil then
    self:forward(x, ...)
    c = self.cache
  end
  Module.check_grad_output(fn, dy, self.output)
  local dh = dy
  if self.mlp then
    dh = dy:add(self.mlp_norm:backward(c.h, self.mlp:backward(c.u2, dy)))
  end
  local dx = dh:add(self.mixer_norm:backward(x, self.mixer:backward(c.u1, dh, ...)))
  self.grad_input = dx
  return dx
end

function Block:__tostring()
  return string.format("nn.Block(%s%s)", tostring(self.mixer), self.mlp and (", " .. tostring(self.mlp)) or "")
end

return Block
