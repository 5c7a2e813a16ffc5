-- gdp.nn.RMSNorm: y = x (mean(x^2) + eps)^-1/2 * weight over the last dim.
--
--   local norm = nn.RMSNorm{dim = 64, eps = 1e-5, dtype = "f64"}
--   local y = norm:forward(x)                 -- x [..., 64]
--   local dx = norm:backward(x, dy)           -- accumulates weight [64]
--
-- The mixer's gated RMSNorm without its gate (gdp.h, gdp_mixer_gated_rmsnorm_*): the
-- statistics are float32 for bf16 inputs, the row sums float64 on the cpu.  weight
-- starts at ones.  Options: dim, eps (1e-5), dtype, device.
local tensor = require("gdp.tensor")
local Module = require("gdp.nn.Module")
local F = require("gdp.nn.functional")

local RMSNorm = Module.class("RMSNorm")
local FN = RMSNorm.FN

local keys = { dim = true, eps = true, dtype = true, device = true }

function RMSNorm.new(cfg)
  cfg = Module.options(FN, cfg, keys)
  local self = setmetatable({}, RMSNorm)
  self.dim = Module.int_opt(FN, cfg, "dim", nil, 1)
  self.eps = Module.num_opt(FN, cfg, "eps", 1e-5, 0)
  self.dtype, self.device = Module.dtype_device(FN, cfg)
  self.device_name = tensor.get_ctx(FN, self.device):name()
  Module.add_parameter(self, "weight", tensor.ones({ self.dim }, { dtype = self.dtype, device = self.device }))
  return self
end

function RMSNorm:forward(x)
  Module.check_float_input(self, FN .. ":forward", x, "x", self.dim)
  self.output = F.rms_norm(x, self.params.weight, self.eps)
  return self.output
end

-- Needs no cache: the statistics are recomputed from x.
function RMSNorm:backward(x, dy)
  local fn = FN .. ":backward"
  Module.check_float_input(self, fn, x, "x", self.dim)
  Module.check_float_input(self, fn, dy, "dy", self.dim)
  local dx, dw = F.rms_norm_backward(x, self.params.weight, self.eps, dy)
  Module.accumulate(self.grads.weight, dw)
  self.grad_input = dx
  return dx
end

function RMSNorm:__tostring()
  return string.format("nn.RMSNorm(%d, eps %g, %s, %s)", self.dim, self.eps, self.dtype, self.device)
end

return RMSNorm
