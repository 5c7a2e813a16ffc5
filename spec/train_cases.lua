-- What the optimiser, training-loop and checkpoint specs share: a small module of the
-- gdp.nn contract (y = x W^T + b, a parameter "norm.weight" that scales x first) and a
-- mean-squared-error criterion, both written plainly from tensor ops, plus float64
-- reference optimisers written element by element on host tables.
local gdp = require("gdp")

local C = {}

------------------------------------------------------------------------------- module

local Affine = {}
Affine.__index = Affine

-- cfg: in_dim, out_dim, dtype ("f64"), device ("cpu"), grad_dtype (default the dtype).
-- A bf16 module computes in float32 from its bf16 parameters (inputs f32, gradients f32
-- unless grad_dtype says otherwise).
function C.Affine(cfg)
  local self = setmetatable({ dtype = cfg.dtype or "f64", device = cfg.device or "cpu" }, Affine)
  self.compute_dtype = self.dtype == "bf16" and "f32" or self.dtype
  local opts = { dtype = self.dtype, device = self.device }
  self.in_dim, self.out_dim = cfg.in_dim, cfg.out_dim
  self.params = {
    ["proj.weight"] = gdp.randn({ cfg.out_dim, cfg.in_dim }, opts):scale_(0.5),
    ["proj.bias"] = gdp.randn({ cfg.out_dim }, opts):scale_(0.1),
    ["norm.weight"] = gdp.ones({ cfg.in_dim }, opts),
  }
  local gopts = { dtype = cfg.grad_dtype or self.dtype, device = self.device }
  self.grads = {}
  for name, p in pairs(self.params) do self.grads[name] = gdp.zeros(p:shape(), gopts) end
  return self
end

function Affine:parameter_names() return { "norm.weight", "proj.weight", "proj.bias" } end
function Affine:parameters() return self.params end
function Affine:gradients() return self.grads end
function Affine:zero_grad() for _, g in pairs(self.grads) do g:zero() end end
function Affine:clear_state() self.xs = nil end

function Affine:set_parameters(t)
  for _, name in ipairs(self:parameter_names()) do self.params[name]:copy(t[name]) end
end

local function row_sum(x) -- [N, D] -> [D]
  local ones = gdp.ones({ 1, x:size(1) }, { dtype = x:dtype(), device = x:device() })
  return gdp.matmul(ones, x):view(x:size(2))
end

-- A parameter in the compute dtype.
function Affine:param(name) return self.params[name]:to(self.compute_dtype) end

-- x [N, in_dim] of the compute dtype.
function Affine:forward(x)
  local w = self:param("norm.weight"):view(1, self.in_dim)
  local ones = gdp.ones({ x:size(1), 1 }, { dtype = x:dtype(), device = x:device() })
  self.xs = x:mul(gdp.matmul(ones, w))
  local y = gdp.matmul(self.xs, self:param("proj.weight"), { trans_b = true })
  local b = gdp.matmul(ones, self:param("proj.bias"):view(1, self.out_dim))
  return y:add(b)
end

function Affine:backward(x, dy)
  local W = self:param("proj.weight")
  local gw = gdp.matmul(dy, self.xs, { trans_a = true })
  self.grads["proj.weight"]:add_(gw:to(self.grads["proj.weight"]:dtype()))
  self.grads["proj.bias"]:add_(row_sum(dy):to(self.grads["proj.bias"]:dtype()))
  local dxs = gdp.matmul(dy, W)
  self.grads["norm.weight"]:add_(row_sum(dxs:mul(x)):to(self.grads["norm.weight"]:dtype()))
  local w = self:param("norm.weight"):view(1, self.in_dim)
  local ones = gdp.ones({ x:size(1), 1 }, { dtype = x:dtype(), device = x:device() })
  return dxs:mul(gdp.matmul(ones, w))
end

-- 0.5 * mean over rows of ||out - target||^2.
local MSE = {}
MSE.__index = MSE
function C.MSE() return setmetatable({}, MSE) end
function MSE:forward(out, target)
  local d = out:sub(target)
  local n = d:norm()
  return 0.5 * n * n / out:size(1)
end
function MSE:backward(out, target)
  return out:sub(target):scale_(1 / out:size(1))
end

------------------------------------------------------------------------------- references

-- Host copies (float64 Lua numbers) of a table name -> tensor.
function C.host(tensors)
  local out = {}
  for name, t in pairs(tensors) do out[name] = t:double():flat() end
  return out
end

-- One AdamW step on host arrays p, m, v with gradient g (textbook form: bias-corrected
-- moments m_hat, v_hat).
function C.adamw_ref(p, g, m, v, h, t)
  local wd = h.weight_decay or 0
  for i = 1, #p do
    p[i] = p[i] * (1 - h.lr * wd)
    m[i] = h.beta1 * m[i] + (1 - h.beta1) * g[i]
    v[i] = h.beta2 * v[i] + (1 - h.beta2) * g[i] * g[i]
    local mhat = m[i] / (1 - h.beta1 ^ t)
    local vhat = v[i] / (1 - h.beta2 ^ t)
    p[i] = p[i] - h.lr * mhat / (math.sqrt(vhat) + h.eps)
  end
end

-- One SGD step (torch's definition) on host arrays p, buf with gradient g.
function C.sgd_ref(p, g, buf, h, t)
  local wd, mom, damp = h.weight_decay or 0, h.momentum or 0, h.dampening or 0
  for i = 1, #p do
    local d = g[i] + wd * p[i]
    if mom > 0 then
      buf[i] = t == 1 and d or mom * buf[i] + (1 - damp) * d
      d = h.nesterov and d + mom * buf[i] or buf[i]
    end
    p[i] = p[i] - h.lr * d
  end
end

function C.max_rel(a, ref)
  local num, den = 0, 0
  for i = 1, #ref do
    num = num + (a[i] - ref[i]) ^ 2
    den = den + ref[i] ^ 2
  end
  return math.sqrt(num) / math.sqrt(den)
end

-- True when two tensors hold the same bits (same dtype and values; NaN never equal).
function C.bitwise_equal(a, b)
  if a:dtype() ~= b:dtype() or table.concat(a:shape(), "x") ~= table.concat(b:shape(), "x") then
    return false
  end
  local x, y = a:double():flat(), b:double():flat()
  for i = 1, #x do
    if x[i] ~= y[i] then return false end
  end
  return true
end

return C
