-- gdp.nn.Module: what the model modules share (docs/design.md section 3.1).
--
-- The contract every module keeps (GatedDeltaProduct too):
--   m:forward(x, ...)          -> output; caches what backward needs
--   m:backward(x, dy, ...)     -> dx (nil for integer inputs); ACCUMULATES parameter
--                                 gradients (m:zero_grad() resets them)
--   m:parameter_names()        -> ordered list; containers prefix their children's
--                                 names ("layers.0.mixer.A_log")
--   m:parameters()             -> name -> live tensor (the compute tensors: bf16 in a
--                                 bf16 model)
--   m:gradients()              -> name -> gradient (parameter's shape; float32 for bf16
--                                 parameters)
--   m:zero_grad(), m:set_parameters(t, strict), m:clear_state(), m.dtype, m.device
--
-- A leaf keeps self.params and self.grads (name -> tensor) and self.param_order; a
-- container keeps self.children, an ordered list of {name, module}.  Module.class
-- makes a class that has these methods and is called as nn.Name{options}.
local tensor = require("gdp.tensor")
local util = require("gdp.util")

local argerror = tensor.argerror

local Module = {}

local methods = {}

-- A new class `name` (nn.<name>): Class{...} calls Class.new(cfg).
function Module.class(name)
  local cls = {}
  cls.__index = cls
  cls.__name = name
  cls.FN = "nn." .. name
  for k, f in pairs(methods) do cls[k] = f end
  return setmetatable(cls, { __call = function(c, cfg) return c.new(cfg) end })
end

------------------------------------------------------------------------------- options

function Module.options(fn, cfg, keys)
  if cfg == nil then cfg = {} end
  if type(cfg) ~= "table" then argerror(fn, "expected an options table, got " .. type(cfg)) end
  return tensor.check_opts(fn, cfg, keys)
end

Module.int_opt, Module.num_opt = util.int_option, util.num_option

-- The module's dtype and device from cfg: f64 (default) or f32 on the cpu, f32
-- (default) or bf16 on cuda.
function Module.dtype_device(fn, cfg)
  local device = cfg.device or "cpu"
  if type(device) ~= "string" then
    argerror(fn, "device: expected \"cpu\", \"cuda\" or \"cuda:<i>\", got " .. tostring(device))
  end
  local on_cuda = device:match("^cuda") ~= nil
  local dtype = cfg.dtype or (on_cuda and "f32" or "f64")
  local allowed = on_cuda and { f32 = true, bf16 = true } or { f64 = true, f32 = true }
  if not allowed[dtype] then
    argerror(fn, string.format("dtype: expected %s on %s%s, got %s",
                               on_cuda and "\"f32\" or \"bf16\"" or "\"f64\" or \"f32\"", device,
                               dtype == "bf16" and " (bf16 models run on cuda)" or "",
                               tostring(dtype)))
  end
  return dtype, device
end

-- Runs fn() with the device's RNG seeded by `seed` (nil: the current stream, left as
-- fn leaves it), then puts the stream back where it was.
function Module.with_seed(fn_name, device, seed, fn)
  if seed == nil then return fn() end
  if type(seed) ~= "number" or seed < 0 or seed ~= math.floor(seed) then
    argerror(fn_name, "seed: expected an integer >= 0, got " .. tostring(seed))
  end
  local ctx = tensor.get_ctx(fn_name, device)
  local saved_seed, saved_offset = ctx:seed(), ctx:rng_offset()
  ctx:manual_seed(seed)
  local ok, res = pcall(fn)
  ctx:manual_seed(saved_seed)
  ctx:set_rng_offset(saved_offset)
  if not ok then error(res, 0) end
  return res
end

------------------------------------------------------------------------------- leaves

-- The gradient dtype of a parameter of dtype `dtype`: float32 for bf16.
function Module.grad_dtype(dtype)
  return dtype == "bf16" and "f32" or dtype
end

-- Registers parameter `name` of a leaf (its order is the registration order) with a
-- zero gradient.
function Module.add_parameter(self, name, t)
  self.params = self.params or {}
  self.grads = self.grads or {}
  self.param_order = self.param_order or {}
  self.params[name] = t
  self.grads[name] = tensor.zeros(t:shape(), { dtype = Module.grad_dtype(t:dtype()),
                                               device = self.device })
  self.param_order[#self.param_order + 1] = name
end

-- Adds `delta` into gradient tensor `grad`, converted to its dtype first where a kernel
-- gave another (a bf16 parameter's gradient is float32; some kernels return bf16).
function Module.accumulate(grad, delta)
  if delta:dtype() ~= grad:dtype() then delta = delta:to({ dtype = grad:dtype() }) end
  grad:add_(delta)
end

------------------------------------------------------------------------------- inputs

-- Checks a float input x: a tensor of the module's dtype on its device whose last dim is
-- `dim` (nil: any); `what` names it.
function Module.check_float_input(self, fn, x, what, dim)
  tensor.tensor_arg(x, fn, what)
  if x:dtype() ~= self.dtype then
    argerror(fn, string.format("%s: expected dtype %s (the module's), got %s", what, self.dtype,
                               x:dtype()))
  end
  if x:device() ~= self.device_name then
    argerror(fn, string.format("%s: expected a tensor on %s (the module's device), got %s", what,
                               self.device_name, x:device()))
  end
  if dim ~= nil and (x:dim() < 1 or x:size(-1) ~= dim) then
    argerror(fn, string.format("%s: expected [..., %d] (last dim %d), got %s", what, dim, dim,
                               tensor.shape_str(x:shape())))
  end
end

-- Checks that dy has the shape, dtype and device of the output `like`.
function Module.check_grad_output(fn, dy, like)
  tensor.tensor_arg(dy, fn, "dy")
  if tensor.shape_str(dy:shape()) ~= tensor.shape_str(like:shape()) then
    argerror(fn, string.format("dy: expected the output's shape %s, got %s",
                               tensor.shape_str(like:shape()), tensor.shape_str(dy:shape())))
  end
  if dy:dtype() ~= like:dtype() then
    argerror(fn, string.format("dy: expected dtype %s (the output's), got %s", like:dtype(),
                               dy:dtype()))
  end
end

-- Cache keys are nil, a string, or a list compared item by item with rawequal: a
-- tensor by its object (never its values: reading a cuda tensor's would wait on the
-- device), next to its write count.  The cache holds the key, so its tensors stay alive
-- and no other tensor takes their place.
function Module.same_key(a, b)
  if type(a) ~= "table" or type(b) ~= "table" then return a == b end
  if #a ~= #b then return false end
  for i = 1, #a do
    if not rawequal(a[i], b[i]) then return false end
  end
  return true
end

-- The forward cache of self when it was computed from exactly this input object, not
-- written since (x:version()), with the same extra key (e.g. the packing); nil
-- otherwise, and backward then runs the forward again.
function Module.cache_for(self, x, key)
  local c = self.cache
  if c == nil or not rawequal(c.input, x) or c.input_version ~= x:version() then return nil end
  if not Module.same_key(c.key, key) then return nil end
  return c
end

function Module.set_cache(self, x, key, cache)
  cache.input, cache.input_version, cache.key = x, x:version(), key
  self.cache = cache
  return cache
end

-- The cache key of a packing argument: nil, a table of offsets (by its values: it may
-- be changed in place) or an int tensor (by its object and write count).
function Module.packing_key(cu)
  if cu == nil then return "unpacked" end
  if tensor.is_tensor(cu) then return { cu, cu:version() } end
  if type(cu) ~= "table" then return "?" .. tostring(cu) end
  local parts = {}
  for i = 1, #cu do parts[i] = tostring(cu[i]) end
  return "{" .. table.concat(parts, ",") .. "}"
end

------------------------------------------------------------------------------- methods

-- Ordered parameter names.
function methods:parameter_names()
  if self.children == nil then
    local out = {}
    for i, name in ipairs(self.param_order or {}) do out[i] = name end
    return out
  end
  local out = {}
  for _, child in ipairs(self.children) do
    for _, name in ipairs(child[2]:parameter_names()) do out[#out + 1] = child[1] .. "." .. name end
  end
  return out
end

local function collect(self, getter)
  if self.children == nil then return self[getter == "parameters" and "params" or "grads"] or {} end
  local out = {}
  for _, child in ipairs(self.children) do
    local sub = child[2][getter](child[2])
    for _, name in ipairs(child[2]:parameter_names()) do out[child[1] .. "." .. name] = sub[name] end
  end
  return out
end

function methods:parameters() return collect(self, "parameters") end

function methods:gradients() return collect(self, "gradients") end

function methods:zero_grad()
  if self.children == nil then
    for _, g in pairs(self.grads or {}) do g:zero() end
  else
    for _, child in ipairs(self.children) do child[2]:zero_grad() end
  end
  return self
end

-- Copies values (any dtype) from a table name -> tensor into the parameters.  Every
-- parameter must be present with its shape; with strict (default) no other name may be.
function methods:set_parameters(tensors, strict)
  local fn = self.FN .. ":set_parameters"
  if strict == nil then strict = true end
  if type(tensors) ~= "table" then argerror(fn, "expected a table {name = tensor}, got " .. type(tensors)) end
  local params = self:parameters()
  for _, name in ipairs(self:parameter_names()) do
    local src = tensors[name]
    if src == nil then argerror(fn, "missing parameter '" .. name .. "'") end
    tensor.tensor_arg(src, fn, name)
    local dst = params[name]
    if tensor.shape_str(src:shape()) ~= tensor.shape_str(dst:shape()) then
      argerror(fn, string.format("%s: expected shape %s, got %s", name,
                                 tensor.shape_str(dst:shape()), tensor.shape_str(src:shape())))
    end
  end
  if strict then
    for name in pairs(tensors) do
      if params[name] == nil then
        argerror(fn, "unexpected tensor '" .. tostring(name) ..
                     "' (not a parameter of this module; pass strict = false to ignore)")
      end
    end
  end
  for _, name in ipairs(self:parameter_names()) do params[name]:copy(tensors[name]) end
  self:clear_state()
  return self
end

function methods:clear_state()
  self.cache, self.output, self.grad_input = nil, nil, nil
  for _, child in ipairs(self.children or {}) do child[2]:clear_state() end
  return self
end

-- The child module called `name`.
function methods:child(name)
  for _, c in ipairs(self.children or {}) do
    if c[1] == name then return c[2] end
  end
  return nil
end

return Module
