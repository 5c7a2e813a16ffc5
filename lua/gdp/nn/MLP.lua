-- gdp.nn.MLP: the SwiGLU feed-forward block, y = W_down (silu(W_gate x) * (W_up x)).
--
--   local mlp = nn.MLP{dim = 64, hidden = 256, dtype = "f64"}
--   local y = mlp:forward(x)                  -- x [..., 64] -> y [..., 64]
--   local dx = mlp:backward(x, dy)
--
-- Parameters (in this order): w_gate [hidden, dim], w_up [hidden, dim], w_down [dim,
-- hidden], and with bias = true b_gate, b_up [hidden], b_down [dim].  Options: dim,
-- hidden (4 * dim), bias (false), init (as nn.Linear: "uniform", torch's default, or a
-- standard deviation), dtype, device, seed.  The gate is one fused op
-- (gdp_nn_silu_mul_*); the products go through gdp.matmul as in nn.Linear.
local tensor = require("gdp.tensor")
local Module = require("gdp.nn.Module")
local Linear = require("gdp.nn.Linear")
local F = require("gdp.nn.functional")

local argerror = tensor.argerror

local MLP = Module.class("MLP")
local FN = MLP.FN

local keys = { dim = true, hidden = true, bias = true, init = true, dtype = true, device = true,
               seed = true }

function MLP.new(cfg)
  cfg = Module.options(FN, cfg, keys)
  local self = setmetatable({}, MLP)
  self.dim = Module.int_opt(FN, cfg, "dim", nil, 1)
  self.hidden = Module.int_opt(FN, cfg, "hidden", 4 * self.dim, 1)
  self.has_bias = cfg.bias == true
  self.dtype, self.device = Module.dtype_device(FN, cfg)
  self.device_name = tensor.get_ctx(FN, self.device):name()
  local init = cfg.init or "uniform"
  if init ~= "uniform" and (type(init) ~= "number" or not (init >= 0)) then
    argerror(FN, "init: expected \"uniform\" or a standard deviation >= 0, got " .. tostring(init))
  end
  local opts = { dtype = self.dtype, device = self.device }
  local function weight(out, inp)
    local w = tensor.empty({ out, inp }, opts)
    if init == "uniform" then return w:uniform_(-1 / math.sqrt(inp), 1 / math.sqrt(inp)) end
    return w:normal_(0, init)
  end
  local function bias(n, inp)
    local b = tensor.zeros({ n }, opts)
    if init == "uniform" then b:uniform_(-1 / math.sqrt(inp), 1 / math.sqrt(inp)) end
    return b
  end
  Module.with_seed(FN, self.device, cfg.seed, function()
    Module.add_parameter(self, "w_gate", weight(self.hidden, self.dim))
    Module.add_parameter(self, "w_up", weight(self.hidden, self.dim))
    Module.add_parameter(self, "w_down", weight(self.dim, self.hidden))
    if self.has_bias then
      Module.add_parameter(self, "b_gate", bias(self.hidden, self.dim))
      Module.add_parameter(self, "b_up", bias(self.hidden, self.dim))
      Module.add_parameter(self, "b_down", bias(self.dim, self.hidden))
    end
  end)
  return self
end

function MLP:forward(x)
  Module.check_float_input(self, FN .. ":forward", x, "x", self.dim)
  local p = self.params
  local x2 = x:reshape(x:numel() / self.dim, self.dim)
  local gate = Linear.affine(self, x2, p.w_gate, p.b_gate)
  local up = Linear.affine(self, x2, p.w_up, p.b_up)
  local h = F.silu_mul(gate, up)
  self.output = Linear.affine(self, h, p.w_down, p.b_down):view(x:shape())
  Module.set_cache(self, x, nil, { x2 = x2, gate = gate, up = up, h = h })
  return self.output
end

-- dx for the loss sum(y * dy); accumulates the gradients.  Reuses the last forward
-- when it ran on this x (same object, unwritten since), else runs it again.
function MLP:backward(x, dy)
  local fn = FN .. ":backward"
  Module.check_float_input(self, fn, x, "x", self.dim)
  local c = Module.cache_for(self, x, nil)
  if c == nil then
    self:forward(x)
    c = self.cache
  end
  Module.check_grad_output(fn, dy, self.output)
  local p, g = self.params, self.grads
  local dy2 = dy:reshape(dy:numel() / self.dim, self.dim)
  local dh = Linear.affine_backward(self, c.h, dy2, p.w_down, g.w_down, g.b_down, true)
  local dgate, dup = F.silu_mul_backward(c.gate, c.up, dh)
  local dx2 = Linear.affine_backward(self, c.x2, dgate, p.w_gate, g.w_gate, g.b_gate, true)
  dx2:add_(Linear.affine_backward(self, c.x2, dup, p.w_up, g.w_up, g.b_up, true))
  self.grad_input = dx2:view(x:shape())
  return self.grad_input
end

function MLP:__tostring()
  return string.format("nn.MLP(SwiGLU %d -> %d -> %d%s, %s, %s)", self.dim, self.hidden, self.dim,
                       self.has_bias and ", bias" or "", self.dtype, self.device)
end

return MLP
