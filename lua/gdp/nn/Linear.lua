-- gdp.nn.Linear: y = x W^T + b over the last dim, through gdp.matmul.
--
--   local lin = nn.Linear{in_features = 64, out_features = 32, bias = true, dtype = "f64"}
--   local y = lin:forward(x)                  -- x [..., 64] -> y [..., 32]
--   local dx = lin:backward(x, dy)            -- accumulates weight [32,64] and bias [32]
--   nn.Linear{tied_to = embedding}            -- uses embedding's weight [V,D] as W
--
-- Options: in_features, out_features (in and out are accepted too), bias (true),
-- tied_to (a module whose parameter "weight" [out,in] this layer shares: the parameter
-- stays the owner's, not listed here, and this layer's weight gradient is added into
-- the owner's), init ("uniform": torch's U(-1/sqrt(in), 1/sqrt(in)) for weight and
-- bias; or a number: N(0, init) for the weight and zero bias), dtype, device, seed.
-- bf16 (cuda): the products take bf16 operands with float32 accumulation, and the
-- weight and bias gradients are float32 results of them (never rounded to bf16).
local tensor = require("gdp.tensor")
local Module = require("gdp.nn.Module")

local argerror = tensor.argerror

local Linear = Module.class("Linear")
local FN = Linear.FN

local keys = { in_features = true, out_features = true, ["in"] = true, out = true, bias = true,
               tied_to = true, init = true, dtype = true, device = true, seed = true }

-- A cached [n, 1] column of ones (bias broadcasts and sums as matrix products).
local function ones(self, n, dtype)
  self.ones_cache = self.ones_cache or {}
  local key = dtype .. ":" .. n
  local t = self.ones_cache[key]
  if t == nil then
    t = tensor.ones({ n, 1 }, { dtype = dtype, device = self.device })
    self.ones_cache[key] = t
  end
  return t
end

-- grad += op(a) @ op(b): one product into the gradient, also a float32 gradient of
-- bf16 operands (float32 accumulation and result on cuda).
local function accumulate(grad, a, b, opts)
  opts.out, opts.beta = grad, 1
  tensor.matmul(a, b, opts)
end

-- Shared by the layers that hold their weights themselves (nn.MLP): y2 [N,out] from
-- x2 [N,in], weight [out,in], bias [out] or nil.  `holder` keeps the ones column.
function Linear.affine(holder, x2, weight, bias)
  local y2 = tensor.matmul(x2, weight, { trans_b = true })
  if bias ~= nil then
    tensor.matmul(ones(holder, x2:size(1), x2:dtype()), bias:view(1, bias:size(1)),
                  { out = y2, beta = 1 })
  end
  return y2
end

-- Backward of affine for dy2 [N,out]: accumulates gweight (and gbias when given);
-- returns dx2 [N,in] when want_dx.
function Linear.affine_backward(holder, x2, dy2, weight, gweight, gbias, want_dx)
  accumulate(gweight, dy2, x2, { trans_a = true })
  if gbias ~= nil then
    local col = ones(holder, dy2:size(1), dy2:dtype())
    accumulate(gbias:view(1, gbias:size(1)), col, dy2, { trans_a = true })
  end
  if want_dx then return tensor.matmul(dy2, weight) end
  return nil
end

function Linear.new(cfg)
  cfg = Module.options(FN, cfg, keys)
  local self = setmetatable({}, Linear)
  self.dtype, self.device = Module.dtype_device(FN, cfg)
  self.device_name = tensor.get_ctx(FN, self.device):name()
  local tied = cfg.tied_to
  if tied ~= nil then
    local w = type(tied) == "table" and type(tied.parameters) == "function" and tied:parameters().weight
    if not w then
      argerror(FN, "tied_to: expected a module with a parameter 'weight' (e.g. an nn.Embedding), got " ..
                   tostring(tied))
    end
    if w:dtype() ~= self.dtype or w:device() ~= self.device_name then
      argerror(FN, string.format("tied_to: expected a weight of dtype %s on %s (this layer's), got %s on %s",
                                 self.dtype, self.device_name, w:dtype(), w:device()))
    end
    self.tied_to = tied
    self.out_features, self.in_features = w:size(1), w:size(2)
    for _, k in ipairs({ "in_features", "in", "out_features", "out" }) do
      local v = cfg[k]
      local want = (k == "in_features" or k == "in") and self.in_features or self.out_features
      if v ~= nil and v ~= want then
        argerror(FN, string.format("%s: expected %d (the tied weight's %s), got %s", k, want,
                                   tensor.shape_str(w:shape()), tostring(v)))
      end
    end
  else
    self.in_features = Module.int_opt(FN, cfg, cfg["in"] ~= nil and "in" or "in_features", nil, 1)
    self.out_features = Module.int_opt(FN, cfg, cfg.out ~= nil and "out" or "out_features", nil, 1)
  end
  self.has_bias = cfg.bias ~= false
  local init = cfg.init or "uniform"
  if init ~= "uniform" and (type(init) ~= "number" or not (init >= 0)) then
    argerror(FN, "init: expected \"uniform\" or a standard deviation >= 0, got " .. tostring(init))
  end
  local opts = { dtype = self.dtype, device = self.device }
  local bound = 1 / math.sqrt(self.in_features)
  Module.with_seed(FN, self.device, cfg.seed, function()
    if not tied then
      local w = tensor.empty({ self.out_features, self.in_features }, opts)
      if init == "uniform" then w:uniform_(-bound, bound) else w:normal_(0, init) end
      Module.add_parameter(self, "weight", w)
    end
    if self.has_bias then
      local b = tensor.zeros({ self.out_features }, opts)
      if init == "uniform" then b:uniform_(-bound, bound) end
      Module.add_parameter(self, "bias", b)
    end
  end)
  self.params, self.grads, self.param_order = self.params or {}, self.grads or {}, self.param_order or {}
  return self
end

function Linear:weight()
  if self.tied_to then return self.tied_to:parameters().weight end
  return self.params.weight
end

function Linear:weight_grad()
  if self.tied_to then return self.tied_to:gradients().weight end
  return self.grads.weight
end

local function flat(x, n)
  return x:reshape(x:numel() / n, n)
end

local function out_shape(x, n)
  local s = x:shape()
  s[#s] = n
  return s
end

function Linear:forward(x)
  Module.check_float_input(self, FN .. ":forward", x, "x", self.in_features)
  local y2 = Linear.affine(self, flat(x, self.in_features), self:weight(), self.params.bias)
  self.output = y2:view(out_shape(x, self.out_features))
  return self.output
end

-- dx for the loss sum(y * dy); accumulates the weight (the owner's when tied) and bias
-- gradients.  Needs no cache: the input is all it reads.
function Linear:backward(x, dy)
  local fn = FN .. ":backward"
  Module.check_float_input(self, fn, x, "x", self.in_features)
  tensor.tensor_arg(dy, fn, "dy")
  if tensor.shape_str(dy:shape()) ~= tensor.shape_str(out_shape(x, self.out_features)) then
    argerror(fn, string.format("dy: expected %s (x's shape with last dim %d), got %s",
                               tensor.shape_str(out_shape(x, self.out_features)), self.out_features,
                               tensor.shape_str(dy:shape())))
  end
  Module.check_float_input(self, fn, dy, "dy")
  local dx2 = Linear.affine_backward(self, flat(x, self.in_features), flat(dy, self.out_features),
                                     self:weight(), self:weight_grad(), self.grads.bias, true)
  self.grad_input = dx2:view(x:shape())
  return self.grad_input
end

function Linear:__tostring()
  return string.format("nn.Linear(%d -> %d%s%s, %s, %s)", self.in_features, self.out_features,
                       self.has_bias and ", bias" or "", self.tied_to and ", tied" or "",
                       self.dtype, self.device)
end

return Linear
