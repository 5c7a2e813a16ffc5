-- gdp.tensor: tensors, contexts and errors on top of libgdp's C API.
--
-- Indexing convention: dims and element indices are 1-based in Lua (torch7 style):
-- t:size(1) is the first dimension, t:get(1, 1) the first element, t:narrow(2, 1, 4)
-- the first four columns.  Negative dims count from the end (-1 is the last).  This
-- file is the only place that converts to the C library's 0-based indices.
--
-- Ownership: every handle made here carries ffi.gc(handle, lib.gdp_tensor_free).
-- t:free() releases it at once and is idempotent; any other use of a freed handle
-- raises an error instead of touching freed memory.  Views keep their storage alive
-- in C, so free order never matters.
--
-- Errors: a failing C call raises a gdp error table (see M.check) whose tostring is
-- "file:line: gdp.<fn>: GDP_ERR_SHAPE: <C message>"; Lua-side argument checks raise
-- string errors "gdp.<fn>: <what>, got <value>" positioned at the caller's line.
local ffi = require("ffi")
local lib = require("gdp.lib")
local util = require("gdp.util")

local M = {}

local Tensor_ptr = ffi.typeof("gdp_tensor *")
local Ctx_ptr = ffi.typeof("gdp_ctx *")
local tensor_box = ffi.typeof("gdp_tensor *[1]")
local ctx_box = ffi.typeof("gdp_ctx *[1]")
local i64_array = ffi.typeof("int64_t[?]")
local int_array = ffi.typeof("int[?]")
local f64_array = ffi.typeof("double[?]")
local f64_box = ffi.typeof("double[1]")
local i64_box = ffi.typeof("int64_t[1]")

local MAX_DIMS = lib.GDP_MAX_DIMS

------------------------------------------------------------------------------- errors

-- Errors are positioned at the user's line, skipping gdp's own frames (gdp.util).
local user_where, argerror, int_arg = util.user_where, util.argerror, util.int_arg
M.argerror = argerror

local Error = {}
Error.__index = Error
Error.__tostring = function(e)
  return string.format("%s: gdp.%s: %s: %s", e.where, e.fn, e.name, e.msg)
end
M.Error = Error

function M.is_error(x)
  return getmetatable(x) == Error
end

-- Raises the C library's last error as a gdp error table when rc is not GDP_OK.
-- Fields: code (number), name ("GDP_ERR_SHAPE"), msg (gdp_last_error()), fn (the Lua
-- function, e.g. "matmul"), where ("file:line" of the user's call).
-- (Enum results arrive as cdata: compare them with numbers, use tonumber() for keys.)
local function check(rc, fn)
  if rc == 0 then return end
  if rc == lib.GDP_ERR_INTERRUPTED then lib.gdp_interrupt_clear() end -- reported: consumed
  local e = setmetatable({
    code = tonumber(rc),
    name = ffi.string(lib.gdp_status_name(rc)),
    msg = ffi.string(lib.gdp_last_error()),
    fn = fn,
    where = user_where(),
  }, Error)
  error(e, 0)
end
M.check = check

local function typename(x)
  if type(x) == "cdata" then return tostring(ffi.typeof(x)) end
  return type(x)
end

-- Rejects unknown option keys (typo protection: {dtpye = "f64"} must not be ignored).
local function check_opts(fn, opts, allowed)
  if opts == nil then return {} end
  if type(opts) ~= "table" then argerror(fn, "options: expected a table, got " .. typename(opts)) end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for a in pairs(allowed) do names[#names + 1] = a end
      table.sort(names)
      argerror(fn, string.format("unknown option '%s' (expected one of: %s)", tostring(k),
                                 table.concat(names, ", ")))
    end
  end
  return opts
end
M.check_opts = check_opts

------------------------------------------------------------------------------- dtypes

local dtype_cache = {}

-- gdp_dtype enum from a name ("f32", "float32", "float", ...) or an enum value.
local function to_dtype(x, fn)
  if type(x) == "number" and x >= 0 and x < lib.GDP_DTYPE_COUNT and x == math.floor(x) then
    return x
  end
  if type(x) == "string" then
    local d = dtype_cache[x]
    if d then return d end
    local box = ffi.new("gdp_dtype[1]")
    if lib.gdp_dtype_from_name(x, box) == 0 then
      d = tonumber(box[0])
      dtype_cache[x] = d
      return d
    end
    lib.gdp_clear_error()
  end
  argerror(fn or "dtype", "dtype: expected one of f64, f32, bf16, i32, i64, got " ..
           (type(x) == "string" and ("'" .. x .. "'") or typename(x)))
end
M.to_dtype = to_dtype

local function dtype_name(d)
  return ffi.string(lib.gdp_dtype_name(d))
end
M.dtype_name = dtype_name

function M.is_dtype_name(s)
  if type(s) ~= "string" then return false end
  if dtype_cache[s] then return true end
  local box = ffi.new("gdp_dtype[1]")
  local ok = lib.gdp_dtype_from_name(s, box) == 0
  if not ok then lib.gdp_clear_error() end
  return ok
end

local default_dtype = lib.GDP_DTYPE_F32
function M.set_default_dtype(d) default_dtype = to_dtype(d, "set_default_dtype") end
function M.get_default_dtype() return dtype_name(default_dtype) end

------------------------------------------------------------------------------- memory

-- Lua's GC sees an 8-byte cdata per tensor, not the megabytes behind it, so it would
-- let garbage tensors pile up.  After each allocation compare the library's live
-- bytes with a soft limit and collect when above it (torch's heap tracking, without a
-- C callback).  When a collection frees little, the threshold rises so that a program
-- that really holds that much memory does not collect on every allocation.
local GiB = 1024 * 1024 * 1024
local soft_limit = {
  [lib.GDP_DEVICE_CPU] = tonumber(os.getenv("GDP_CPU_SOFT_LIMIT")) or 1 * GiB,
  [lib.GDP_DEVICE_CUDA] = tonumber(os.getenv("GDP_CUDA_SOFT_LIMIT")) or 16 * GiB,
}
local collect_threshold = { [0] = soft_limit[0], [1] = soft_limit[1] }

local function full_collect()
  collectgarbage("collect")
  collectgarbage("collect") -- the second pass frees what the first pass's finalizers released
end

local function after_alloc(devtype)
  local live = tonumber(lib.gdp_mem_live_bytes(devtype))
  if live > collect_threshold[devtype] then
    full_collect()
    live = tonumber(lib.gdp_mem_live_bytes(devtype))
    collect_threshold[devtype] = math.max(soft_limit[devtype], 1.5 * live)
  end
end

M.after_alloc = after_alloc -- for other owners of device memory (gdp.ops' saved forwards)

-- Sets the soft limit (bytes) for "cpu" or "cuda".
function M.set_memory_soft_limit(devtype, bytes)
  local ty = devtype == "cuda" and lib.GDP_DEVICE_CUDA or lib.GDP_DEVICE_CPU
  soft_limit[ty] = bytes
  collect_threshold[ty] = bytes
end

function M.memory_live_bytes(devtype)
  local ty = devtype == "cuda" and lib.GDP_DEVICE_CUDA or lib.GDP_DEVICE_CPU
  return tonumber(lib.gdp_mem_live_bytes(ty))
end

------------------------------------------------------------------------------- handles

local freed = setmetatable({}, { __mode = "k" })

local function interrupted_error(fn)
  lib.gdp_interrupt_clear()
  return setmetatable({
    code = tonumber(lib.GDP_ERR_INTERRUPTED), name = "GDP_ERR_INTERRUPTED",
    msg = "interrupted (Ctrl-C)", fn = fn, where = user_where(),
  }, Error)
end

-- The owned handle in an output box: a tensor box (gdp_tensor *[1]) or {box, free_fn}.
local function own(out)
  if ffi.istype(tensor_box, out) then
    local h = out[0]
    return h ~= nil and ffi.gc(h, lib.gdp_tensor_free) or nil
  end
  local h = out[1][0]
  return h ~= nil and ffi.gc(h, out[2]) or nil
end

-- The one way a C call's outputs reach Lua: calls lib[cname](...), whose outputs land
-- in the boxes `outs` (passed among its arguments too), and returns every output as a
-- GC-owned handle, in order (nil for an empty box).  Out of memory: once more after a
-- full collection.  The outputs are owned before anything can raise: during the call
-- and the wrapping a Ctrl-C (gdp.repl's handler, gdp_interrupt_install) only sets the
-- library's interrupt flag, which the kernels poll and which is checked here once the
-- outputs are owned, so an interrupt never leaks them.
local function call_outputs(fn, cname, outs, ...)
  lib.gdp_interrupt_defer(1)
  local ok, rc = pcall(lib[cname], ...)
  if ok and rc == lib.GDP_ERR_OOM then
    full_collect()
    ok, rc = pcall(lib[cname], ...)
  end
  local res, n = {}, #outs
  for i = 1, n do res[i] = own(outs[i]) end
  lib.gdp_interrupt_defer(-1)
  if not ok then error(rc, 0) end
  check(rc, fn)
  if lib.gdp_interrupt_requested() ~= 0 then error(interrupted_error(fn), 0) end
  for i = 1, n do
    if ffi.istype(Tensor_ptr, res[i]) then after_alloc(tonumber(lib.gdp_tensor_device_type(res[i]))) end
  end
  return unpack(res, 1, n)
end
M.call_outputs = call_outputs

local function is_tensor(x)
  return ffi.istype(Tensor_ptr, x) and not freed[x]
end
M.is_tensor = is_tensor

-- Checks that x is a live tensor; `what` names the argument in the message.
local function tensor_arg(x, fn, what)
  if not ffi.istype(Tensor_ptr, x) then
    argerror(fn, string.format("%s: expected a gdp tensor, got %s", what, typename(x)))
  end
  if freed[x] then
    argerror(fn, string.format("%s: tensor was freed with :free() and cannot be used", what))
  end
  return x
end
M.tensor_arg = tensor_arg

------------------------------------------------------------------------------- contexts

local ctx_mt = { __index = {} }
local ctx_methods = ctx_mt.__index

local function ctx_name(c)
  local ty = lib.gdp_ctx_device_type(c)
  if ty == lib.GDP_DEVICE_CPU then return "cpu" end
  return ffi.string(lib.gdp_device_type_name(ty)) .. ":" .. lib.gdp_ctx_device_index(c)
end

ctx_mt.__tostring = function(c) return "gdp.Context<" .. ctx_name(c) .. ">" end
function ctx_methods.name(c) return ctx_name(c) end
function ctx_methods.type(c) return ffi.string(lib.gdp_device_type_name(lib.gdp_ctx_device_type(c))) end
function ctx_methods.index(c) return lib.gdp_ctx_device_index(c) end
function ctx_methods.sync(c) check(lib.gdp_ctx_sync(c), "sync") end
-- Device timing of queued work (gdp_ctx_timer_start / _stop in gdp.h): timer_start holds
-- the stream with a spin of hold_ms, timer_stop returns the device's milliseconds since
-- the spin ended.  cuda only (a gdp error on the cpu).
function ctx_methods.timer_start(c, hold_ms)
  if type(hold_ms) ~= "number" then
    argerror("timer_start", "hold_ms: expected a number of milliseconds, got " .. type(hold_ms))
  end
  check(lib.gdp_ctx_timer_start(c, hold_ms), "timer_start")
end
function ctx_methods.timer_stop(c)
  local ms = ffi.new("double[1]")
  check(lib.gdp_ctx_timer_stop(c, ms), "timer_stop")
  return ms[0]
end
function ctx_methods.manual_seed(c, seed) lib.gdp_ctx_manual_seed(c, int_arg("manual_seed", "seed", seed, 0)) end
function ctx_methods.seed(c) return tonumber(lib.gdp_ctx_seed(c)) end
function ctx_methods.rng_offset(c) return tonumber(lib.gdp_ctx_rng_offset(c)) end
function ctx_methods.set_rng_offset(c, off)
  lib.gdp_ctx_set_rng_offset(c, int_arg("set_rng_offset", "offset", off, 0))
end
function ctx_methods.num_threads(c) return lib.gdp_ctx_num_threads(c) end
-- n worker threads for this context's CPU ops; 0: the default again (GDP_NUM_THREADS,
-- else the cores).
function ctx_methods.set_num_threads(c, n)
  lib.gdp_ctx_set_num_threads(c, int_arg("set_num_threads", "threads", n, 0, util.INT_MAX))
end
-- op: "copy", "elementwise", "reduce", "rng", "gdp_forward", "gdp_backward", "matmul"
-- (or the enum); dtype: a dtype name.
function ctx_methods.supports(c, op, dtype)
  if type(op) == "string" then
    local v = lib["GDP_OP_" .. op:upper()]
    op = v
  end
  return lib.gdp_ctx_supports(c, op, to_dtype(dtype, "supports")) == 1
end
ffi.metatype("struct gdp_ctx", ctx_mt)

local ctx_cache = {}
local global_seed = nil

-- Functions called with each default context as it is created (gdp.set_tuning applies
-- the tuning set for every device this way).
M.ctx_created_hooks = {}

-- Parses "cpu", "cuda", "cuda:1", ("cuda", 1), a context, or nil (cpu).
local function parse_device(fn, dev, index)
  if dev == nil then return lib.GDP_DEVICE_CPU, 0 end
  if type(dev) ~= "string" then
    argerror(fn, "device: expected \"cpu\", \"cuda\", \"cuda:<i>\" or a context, got " .. typename(dev))
  end
  local name, idx = dev:match("^(%a+):(%d+)$")
  if not name then name = dev end
  idx = tonumber(idx) or index or 0
  if name == "cpu" then
    if idx ~= 0 then argerror(fn, "device: cpu has only index 0, got " .. tostring(idx)) end
    return lib.GDP_DEVICE_CPU, 0
  elseif name == "cuda" then
    if type(idx) ~= "number" or idx < 0 or idx ~= math.floor(idx) then
      argerror(fn, "device index: expected an integer >= 0, got " .. tostring(idx))
    end
    return lib.GDP_DEVICE_CUDA, idx
  end
  argerror(fn, "device: expected \"cpu\", \"cuda\" or \"cuda:<i>\", got '" .. dev .. "'")
end

-- The default context of a device, created on first use and kept for the process.
local function get_ctx(fn, dev, index)
  if ffi.istype(Ctx_ptr, dev) then return dev end
  local ty, idx = parse_device(fn, dev, index)
  local key = ty * 65536 + idx
  local c = ctx_cache[key]
  if c then return c end
  local box = ctx_box()
  check(lib.gdp_ctx_new(ty, idx, box), fn)
  c = ffi.gc(box[0], lib.gdp_ctx_free)
  if global_seed ~= nil then lib.gdp_ctx_manual_seed(c, global_seed) end
  for _, hook in ipairs(M.ctx_created_hooks) do hook(c) end
  ctx_cache[key] = c
  return c
end
M.get_ctx = get_ctx

-- The default contexts created so far (in no particular order).
function M.default_contexts()
  local out = {}
  for _, c in pairs(ctx_cache) do out[#out + 1] = c end
  return out
end

-- gdp.device("cpu"), gdp.device("cuda", 0), gdp.device("cuda:1"): the device's context.
function M.device(dev, index)
  return get_ctx("device", dev, index)
end

-- Names of the devices usable now: {"cpu", "cuda:0", ...}.
function M.devices()
  local out = { "cpu" }
  for i = 0, lib.gdp_device_count(lib.GDP_DEVICE_CUDA) - 1 do
    out[#out + 1] = "cuda:" .. i
  end
  return out
end

function M.has_cuda()
  return lib.gdp_device_count(lib.GDP_DEVICE_CUDA) > 0
end

-- Seeds every default context, present and future, with the same seed.
function M.manual_seed(seed)
  int_arg("manual_seed", "seed", seed, 0)
  global_seed = seed
  for _, c in pairs(ctx_cache) do lib.gdp_ctx_manual_seed(c, seed) end
end

function M.initial_seed() return global_seed end

------------------------------------------------------------------------------- shapes

local function numel_of(shape)
  local n = 1
  for i = 1, #shape do n = n * shape[i] end
  return n
end

-- Checks a shape table and returns ndim, int64_t[ndim]; allow_infer accepts one -1.
local function shape_array(fn, shape, allow_infer)
  if type(shape) ~= "table" then
    argerror(fn, "shape: expected a table of sizes, got " .. typename(shape))
  end
  local nd = #shape
  if nd > MAX_DIMS then
    argerror(fn, string.format("shape: at most %d dims, got %d", MAX_DIMS, nd))
  end
  local arr = i64_array(math.max(nd, 1))
  for i = 1, nd do
    local s = shape[i]
    if not (allow_infer and s == -1) then
      int_arg(fn, "size of dim " .. i .. (allow_infer and " (or -1 to infer it)" or ""), s, 0)
    end
    arr[i - 1] = s
  end
  return nd, arr
end

local function shape_of(t)
  local nd = lib.gdp_tensor_ndim(t)
  local s = {}
  for i = 1, nd do s[i] = tonumber(lib.gdp_tensor_size(t, i - 1)) end
  return s
end

local function shape_str(shape)
  return "[" .. table.concat(shape, "x") .. "]"
end
M.shape_str = shape_str

-- Accepts (2, 3, opts), ({2, 3}, opts) or ({2, 3}): returns shape, opts.
local function split_shape(fn, ...)
  local a1 = ...
  if type(a1) == "table" then
    return a1, select(2, ...)
  end
  local shape, n = {}, select("#", ...)
  for i = 1, n do
    local a = select(i, ...)
    if type(a) == "number" then
      shape[i] = a
    else
      if i ~= n or (a ~= nil and type(a) ~= "table") then
        argerror(fn, string.format("argument %d: expected a size or an options table, got %s",
                                   i, typename(a)))
      end
      return shape, a
    end
  end
  return shape, nil
end

-- 1-based (negative: from the end) dim -> 0-based.
local function dim0(t, d, fn, what)
  local nd = lib.gdp_tensor_ndim(t)
  if type(d) == "number" and d == math.floor(d) then
    if d >= 1 and d <= nd then return d - 1 end
    if d <= -1 and d >= -nd then return nd + d end
  end
  argerror(fn, string.format("%s: expected an integer in 1..%d (or -%d..-1) for a %d-dim tensor, got %s",
                             what or "dim", nd, nd, nd, util.describe(d)))
end

------------------------------------------------------------------------------- creation

local create_opts = { dtype = true, device = true }

local function ctx_dtype(fn, opts)
  opts = check_opts(fn, opts, create_opts)
  local dt = opts.dtype ~= nil and to_dtype(opts.dtype, fn) or default_dtype
  return get_ctx(fn, opts.device), dt
end

local function make(fn, cname, shape, opts)
  local c, dt = ctx_dtype(fn, opts)
  local nd, arr = shape_array(fn, shape)
  local box = tensor_box()
  return call_outputs(fn, cname, { box }, c, dt, nd, arr, box)
end

function M.empty(...)
  local shape, opts = split_shape("empty", ...)
  return make("empty", "gdp_tensor_empty", shape, opts)
end

function M.zeros(...)
  local shape, opts = split_shape("zeros", ...)
  return make("zeros", "gdp_tensor_zeros", shape, opts)
end

function M.full(shape, value, opts)
  if type(value) ~= "number" then
    argerror("full", "value: expected a number, got " .. typename(value))
  end
  local t = make("full", "gdp_tensor_empty", shape, opts)
  check(lib.gdp_tensor_fill(t, value), "full")
  return t
end

function M.ones(...)
  local shape, opts = split_shape("ones", ...)
  local t = make("ones", "gdp_tensor_empty", shape, opts)
  check(lib.gdp_tensor_fill(t, 1), "ones")
  return t
end

-- Uniform in [0, 1) from the device context's Philox RNG (gdp.manual_seed).
function M.rand(...)
  local shape, opts = split_shape("rand", ...)
  local t = make("rand", "gdp_tensor_empty", shape, opts)
  check(lib.gdp_tensor_uniform(t, 0, 1), "rand")
  return t
end

-- Standard normal from the device context's Philox RNG.
function M.randn(...)
  local shape, opts = split_shape("randn", ...)
  local t = make("randn", "gdp_tensor_empty", shape, opts)
  check(lib.gdp_tensor_normal(t, 0, 1), "randn")
  return t
end

-- An array's entries are x[1..#x] only: a table with other keys ({a = 1}, holes)
-- would silently lose them.
local function check_array(fn, x, path)
  local n, count = #x, 0
  for k in pairs(x) do
    count = count + 1
    if type(k) ~= "number" or k ~= math.floor(k) or k < 1 or k > n then
      argerror(fn, string.format("data%s: expected an array (keys 1..n), got the key %s", path,
                                 type(k) == "string" and string.format("%q", k) or tostring(k)))
    end
  end
  if count ~= n then argerror(fn, string.format("data%s: expected an array without holes", path)) end
end

-- Flattens nested tables into `flat`, checking that they are rectangular.
local function flatten(fn, x, shape, depth, flat, path)
  check_array(fn, x, path)
  local size = shape[depth]
  if #x ~= size then
    argerror(fn, string.format("data%s: expected %d entries (a rectangular nested table), got %d",
                               path, size, #x))
  end
  if depth == #shape then
    for i = 1, size do
      local v = x[i]
      if type(v) ~= "number" then
        argerror(fn, string.format("data%s[%d]: expected a number, got %s", path, i, typename(v)))
      end
      flat[#flat + 1] = v
    end
  else
    for i = 1, size do
      local v = x[i]
      if type(v) ~= "table" then
        argerror(fn, string.format("data%s[%d]: expected a table, got %s", path, i, typename(v)))
      end
      flatten(fn, v, shape, depth + 1, flat, path .. "[" .. i .. "]")
    end
  end
end

local function from_flat(fn, flat, shape, opts)
  local c, dt = ctx_dtype(fn, opts)
  local nd, arr = shape_array(fn, shape)
  local n = numel_of(shape)
  if #flat ~= n then
    argerror(fn, string.format("data: expected %d values for shape %s, got %d", n,
                               shape_str(shape), #flat))
  end
  local buf = f64_array(math.max(n, 1))
  -- integer dtypes: every value must be an integer in range (NaN, 2.5 or 2^31 in an
  -- i32 would otherwise be stored as 0, 2 or 2^31 - 1)
  local lo, hi
  if dt == lib.GDP_DTYPE_I32 then lo, hi = -2 ^ 31, 2 ^ 31 - 1
  elseif dt == lib.GDP_DTYPE_I64 then lo, hi = -2 ^ 53, 2 ^ 53 end -- exact in the f64 buffer
  for i = 1, n do
    local v = flat[i]
    if type(v) ~= "number" then
      argerror(fn, string.format("data[%d]: expected a number, got %s", i, typename(v)))
    end
    if lo and (v ~= math.floor(v) or v < lo or v > hi) then
      argerror(fn, string.format("data[%d]: expected an integer in [%.0f, %.0f] for dtype %s, got %s", i,
                                 lo, hi, dt == lib.GDP_DTYPE_I32 and "i32" or "i64", tostring(v)))
    end
    buf[i - 1] = v
  end
  local box = tensor_box()
  return call_outputs(fn, "gdp_tensor_from_host", { box }, c, dt, nd, arr, lib.GDP_DTYPE_F64, buf, n * 8, box)
end

-- gdp.tensor({{1, 2}, {3, 4}}), gdp.tensor({1, 2, 3, 4}, {2, 2}), gdp.tensor(3.5),
-- each with an optional trailing {dtype =, device =}.
function M.tensor(data, a2, a3)
  local shape, opts
  if type(a2) == "table" and (a2[1] ~= nil or a3 ~= nil) then
    shape, opts = a2, a3
  elseif type(a2) == "table" and next(a2) == nil and a3 == nil then
    opts = nil -- an empty second table: no options
  else
    opts = a2
  end
  if type(data) == "number" then
    return from_flat("tensor", { data }, shape or {}, opts)
  end
  if type(data) ~= "table" then
    argerror("tensor", "data: expected a (nested) table of numbers or a number, got " .. typename(data))
  end
  if shape then
    check_array("tensor", data, "")
    return from_flat("tensor", data, shape, opts)
  end
  shape = {}
  local x = data
  while type(x) == "table" do
    if #shape == MAX_DIMS then
      argerror("tensor", string.format("data: nested deeper than %d levels (the most dims a tensor " ..
                                       "has); does the table contain itself?", MAX_DIMS))
    end
    shape[#shape + 1] = #x
    x = x[1]
  end
  local flat = {}
  -- always walk the whole table: a shape ending in 0 (read from an empty first row)
  -- must still be checked against the other rows, e.g. {{}, {1, 2}}
  flatten("tensor", data, shape, 1, flat, "")
  return from_flat("tensor", flat, shape, opts)
end

-- gdp.arange(n) = 0..n-1; gdp.arange(start, stop[, step]) = start, start+step, ... < stop
-- (values, PyTorch's convention; an optional trailing options table).
function M.arange(a, b, c, d)
  local start, stop, step, opts
  if type(b) ~= "number" then start, stop, step, opts = 0, a, 1, b
  elseif type(c) ~= "number" then start, stop, step, opts = a, b, 1, c
  else start, stop, step, opts = a, b, c, d end
  if type(start) ~= "number" or type(stop) ~= "number" or type(step) ~= "number" or step == 0 or
     step ~= step then
    argerror("arange", "expected numbers start, stop and a non-zero step")
  end
  local count = math.ceil((stop - start) / step)
  if start ~= start or stop ~= stop or math.abs(start) == math.huge or math.abs(stop) == math.huge or
     count >= 2 ^ 31 then
    argerror("arange", string.format("expected finite start and stop and fewer than 2^31 values, " ..
                                     "got start %s, stop %s, step %s", tostring(start), tostring(stop),
                                     tostring(step)))
  end
  local vals = {}
  local x = start
  while (step > 0 and x < stop) or (step < 0 and x > stop) do
    vals[#vals + 1] = x
    x = start + #vals * step
  end
  return from_flat("arange", vals, { #vals }, opts)
end

------------------------------------------------------------------------------- methods

local T = {}        -- methods
-- A missing method is named as such (not as FFI's "'struct gdp_tensor' has no member").
local mt = {
  __index = function(_, k)
    local f = T[k]
    if f == nil then
      argerror("Tensor", string.format("no method or field %s (methods: gdp.tensor.methods)",
                                           type(k) == "string" and ("'" .. k .. "'") or tostring(k)))
    end
    return f
  end,
}
M.methods = T

local function live(t, fn)
  if freed[t] then
    argerror(fn, "tensor was freed with :free() and cannot be used")
  end
  return t
end

function T.free(t)
  if freed[t] then return end
  freed[t] = true
  lib.gdp_tensor_free(ffi.gc(t, nil))
end

function T.is_freed(t) return freed[t] == true end

function T.shape(t) return shape_of(live(t, "shape")) end

-- t:size() is the shape table; t:size(d) the size of dim d (1-based, negative from the end).
function T.size(t, d)
  live(t, "size")
  if d == nil then return shape_of(t) end
  return tonumber(lib.gdp_tensor_size(t, dim0(t, d, "size")))
end

function T.stride(t, d)
  live(t, "stride")
  if d ~= nil then return tonumber(lib.gdp_tensor_stride(t, dim0(t, d, "stride"))) end
  local s = {}
  for i = 1, lib.gdp_tensor_ndim(t) do s[i] = tonumber(lib.gdp_tensor_stride(t, i - 1)) end
  return s
end

function T.dim(t) return lib.gdp_tensor_ndim(live(t, "dim")) end
T.ndim = T.dim
function T.numel(t) return tonumber(lib.gdp_tensor_numel(live(t, "numel"))) end
T.nelement = T.numel
function T.storage_offset(t) return tonumber(lib.gdp_tensor_offset(live(t, "storage_offset"))) end
function T.dtype(t) return dtype_name(lib.gdp_tensor_dtype(live(t, "dtype"))) end
function T.is_contiguous(t) return lib.gdp_tensor_is_contiguous(live(t, "is_contiguous")) == 1 end
function T.is_view(t) return lib.gdp_tensor_is_view(live(t, "is_view")) == 1 end
-- Write counter of t's storage (gdp_tensor_version, PyTorch's _version): raised by every
-- gdp call that writes into t or a view sharing its storage (copy_, fill, set, random
-- fills, in-place arithmetic, matmul's out, the collectives' outputs); writes through
-- the raw t:data() pointer are not seen.  Compare two values: equal means no such write.
function T.version(t) return tonumber(lib.gdp_tensor_version(live(t, "version"))) end
function T.ctx(t) return lib.gdp_tensor_ctx(live(t, "ctx")) end

local function device_name(t)
  local ty = lib.gdp_tensor_device_type(t)
  if ty == lib.GDP_DEVICE_CPU then return "cpu" end
  return ffi.string(lib.gdp_device_type_name(ty)) .. ":" .. lib.gdp_tensor_device_index(t)
end
function T.device(t) return device_name(live(t, "device")) end
function T.is_cuda(t) return lib.gdp_tensor_device_type(live(t, "is_cuda")) == lib.GDP_DEVICE_CUDA end
-- Raw address of the first element (a device address for cuda tensors).
function T.data(t) return lib.gdp_tensor_data(live(t, "data")) end

-- The context that owns t's storage (a default context when t was made here).
local function tensor_ctx(t)
  return lib.gdp_tensor_ctx(t)
end

-- Accepts (2, 3), ({2, 3}): returns a table.
local function vararg_shape(fn, ...)
  local a1 = ...
  if type(a1) == "table" then return a1 end
  return { ... }
end

function T.view(t, ...)
  live(t, "view")
  local nd, arr = shape_array("view", vararg_shape("view", ...), true)
  local box = tensor_box()
  return call_outputs("view", "gdp_tensor_view", { box }, t, nd, arr, box)
end

function T.reshape(t, ...)
  live(t, "reshape")
  local nd, arr = shape_array("reshape", vararg_shape("reshape", ...), true)
  local box = tensor_box()
  return call_outputs("reshape", "gdp_tensor_reshape", { box }, t, nd, arr, box)
end

-- t:narrow(dim, start, length): `length` entries of dim from `start` (1-based).
function T.narrow(t, d, start, length)
  live(t, "narrow")
  local d0 = dim0(t, d, "narrow")
  int_arg("narrow", "start (1-based)", start, 1)
  int_arg("narrow", "length", length, 0)
  local size = tonumber(lib.gdp_tensor_size(t, d0))
  if start < 1 or start - 1 + length > size then
    argerror("narrow", string.format("start %d, length %d: out of range for dim %d of size %d " ..
                                     "(1-based: start >= 1, start + length - 1 <= %d)",
                                     start, length, d, size, size))
  end
  local box = tensor_box()
  return call_outputs("narrow", "gdp_tensor_narrow", { box }, t, d0, start - 1, length, box)
end

-- t:select(dim, i): the slice at index i (1-based) of dim, which is removed.
function T.select(t, d, i)
  live(t, "select")
  local d0 = dim0(t, d, "select")
  local size = tonumber(lib.gdp_tensor_size(t, d0))
  int_arg("select", string.format("index into dim %d (of size %d)", d, size), i, 1, size)
  local box = tensor_box()
  return call_outputs("select", "gdp_tensor_select", { box }, t, d0, i - 1, box)
end

function T.transpose(t, d1, d2)
  live(t, "transpose")
  local a, b = dim0(t, d1 or 1, "transpose", "dim1"), dim0(t, d2 or 2, "transpose", "dim2")
  local box = tensor_box()
  return call_outputs("transpose", "gdp_tensor_transpose", { box }, t, a, b, box)
end

-- t:permute(3, 1, 2) or t:permute({3, 1, 2}): out:size(i) = t:size(perm[i]) (1-based).
function T.permute(t, ...)
  live(t, "permute")
  local perm = vararg_shape("permute", ...)
  local nd = lib.gdp_tensor_ndim(t)
  if #perm ~= nd then
    argerror("permute", string.format("perm: expected %d dims, got %d", nd, #perm))
  end
  local arr = int_array(math.max(nd, 1))
  for i = 1, nd do arr[i - 1] = dim0(t, perm[i], "permute", "perm[" .. i .. "]") end
  local box = tensor_box()
  return call_outputs("permute", "gdp_tensor_permute", { box }, t, nd, arr, box)
end

function T.contiguous(t)
  live(t, "contiguous")
  local box = tensor_box()
  return call_outputs("contiguous", "gdp_tensor_contiguous", { box }, t, box)
end

function T.clone(t)
  live(t, "clone")
  local box = tensor_box()
  return call_outputs("clone", "gdp_tensor_clone", { box }, t, box)
end

local function same_device(t, c)
  return tonumber(lib.gdp_tensor_device_type(t)) == tonumber(lib.gdp_ctx_device_type(c))
     and lib.gdp_tensor_device_index(t) == lib.gdp_ctx_device_index(c)
end

local to_opts = { dtype = true, device = true, copy = true }

-- t:to("f64"), t:to("cuda"), t:to("cuda:1", "bf16"), t:to(ctx), t:to{dtype=, device=, copy=}.
-- Returns t itself when nothing changes (unless copy = true), like torch.
function T.to(t, a, b)
  live(t, "to")
  local dev, dt, copy
  local function take(x)
    if x == nil then return end
    if ffi.istype(Ctx_ptr, x) then dev = x
    elseif type(x) == "table" then
      check_opts("to", x, to_opts)
      if x.device ~= nil then dev = x.device end
      if x.dtype ~= nil then dt = x.dtype end
      copy = x.copy
    elseif type(x) == "string" and (x == "cpu" or x:match("^cuda")) then dev = x
    elseif type(x) == "string" or type(x) == "number" then dt = x
    else argerror("to", "expected a dtype, a device, a context or an options table, got " .. typename(x)) end
  end
  take(a); take(b)
  local c = dev ~= nil and get_ctx("to", dev) or tensor_ctx(t)
  local d = dt ~= nil and to_dtype(dt, "to") or tonumber(lib.gdp_tensor_dtype(t))
  if not copy and d == tonumber(lib.gdp_tensor_dtype(t)) and same_device(t, c) then
    return t
  end
  local box = tensor_box()
  return call_outputs("to", "gdp_tensor_to", { box }, c, t, d, box)
end

function T.float(t) return T.to(t, "f32") end
function T.double(t) return T.to(t, "f64") end
function T.bf16(t) return T.to(t, "bf16") end
function T.cpu(t) return T.to(t, "cpu") end
function T.cuda(t, i) return T.to(t, "cuda:" .. (i or 0)) end

-- Row-major host copy as a double[numel] (int64_t[numel] for i64), and numel.
local function host_values(t, fn)
  local n = tonumber(lib.gdp_tensor_numel(t))
  if lib.gdp_tensor_dtype(t) == lib.GDP_DTYPE_I64 then
    local buf = i64_array(math.max(n, 1))
    check(lib.gdp_tensor_to_host(t, lib.GDP_DTYPE_I64, buf, n * 8), fn)
    return buf, n, true
  end
  local buf = f64_array(math.max(n, 1))
  check(lib.gdp_tensor_to_host(t, lib.GDP_DTYPE_F64, buf, n * 8), fn)
  return buf, n, false
end

-- All values as a flat Lua table (row-major).
function T.flat(t)
  live(t, "flat")
  local buf, n, is_int = host_values(t, "flat")
  local out = {}
  for i = 1, n do out[i] = is_int and tonumber(buf[i - 1]) or buf[i - 1] end
  return out
end

-- Values as nested Lua tables of t's shape (a number for a 0-dim tensor).
function T.totable(t)
  live(t, "totable")
  local buf, _, is_int = host_values(t, "totable")
  local shape = shape_of(t)
  local nd = #shape
  if nd == 0 then return is_int and tonumber(buf[0]) or buf[0] end
  local pos = 0
  local function build(d)
    local out = {}
    if d == nd then
      for i = 1, shape[d] do
        out[i] = is_int and tonumber(buf[pos]) or buf[pos]
        pos = pos + 1
      end
    else
      for i = 1, shape[d] do out[i] = build(d + 1) end
    end
    return out
  end
  return build(1)
end

function T.fill(t, v)
  live(t, "fill")
  if type(v) ~= "number" then argerror("fill", "value: expected a number, got " .. typename(v)) end
  check(lib.gdp_tensor_fill(t, v), "fill")
  return t
end

function T.zero(t) return T.fill(t, 0) end

-- In-place copy of src's values (same shape; any dtypes and devices).
function T.copy(t, src)
  live(t, "copy")
  tensor_arg(src, "copy", "src")
  check(lib.gdp_tensor_copy(nil, t, src), "copy")
  return t
end

function T.uniform_(t, lo, hi)
  live(t, "uniform_")
  check(lib.gdp_tensor_uniform(t, lo or 0, hi or 1), "uniform_")
  return t
end

function T.normal_(t, mean, std)
  live(t, "normal_")
  check(lib.gdp_tensor_normal(t, mean or 0, std or 1), "normal_")
  return t
end

-- Element index array from 1-based indices.
local function index_array(t, fn, first, ...)
  local nd = lib.gdp_tensor_ndim(t)
  local n = select("#", ...) + (first ~= nil and 1 or 0)
  local idx = { first, ... }
  if type(first) == "table" then idx = first; n = #first end
  if n ~= nd then
    argerror(fn, string.format("expected %d indices for a %d-dim tensor, got %d", nd, nd, n))
  end
  local arr = i64_array(math.max(nd, 1))
  for d = 1, nd do
    local i = idx[d]
    local size = tonumber(lib.gdp_tensor_size(t, d - 1))
    int_arg(fn, string.format("index %d (into dim %d, of size %d)", d, d, size), i, 1, size)
    arr[d - 1] = i - 1
  end
  return arr
end

-- t:get(i, j, ...) (1-based) -> number.
function T.get(t, ...)
  live(t, "get")
  local arr = index_array(t, "get", ...)
  local out = f64_box()
  check(lib.gdp_tensor_get(t, arr, out), "get")
  return out[0]
end

-- t:set(v, i, j, ...) (1-based).
function T.set(t, v, ...)
  live(t, "set")
  if type(v) ~= "number" then argerror("set", "value: expected a number, got " .. typename(v)) end
  local arr = index_array(t, "set", ...)
  check(lib.gdp_tensor_set(t, arr, v), "set")
  return t
end

local function empty_like(t, fn)
  local nd = lib.gdp_tensor_ndim(t)
  local arr = i64_array(math.max(nd, 1))
  for i = 0, nd - 1 do arr[i] = lib.gdp_tensor_size(t, i) end
  local box = tensor_box()
  return call_outputs(fn, "gdp_tensor_empty", { box }, tensor_ctx(t), lib.gdp_tensor_dtype(t), nd, arr, box)
end
M.empty_like = function(t) return empty_like(tensor_arg(t, "empty_like", "t"), "empty_like") end

-- Elementwise (no broadcasting: same shapes).
function T.add(a, b, alpha)
  live(a, "add")
  if type(b) == "number" then
    local out = empty_like(a, "add")
    check(lib.gdp_tensor_fill(out, b * (alpha or 1)), "add")
    check(lib.gdp_tensor_add(out, a, out, 1), "add")
    return out
  end
  tensor_arg(b, "add", "other")
  local out = empty_like(a, "add")
  check(lib.gdp_tensor_add(out, a, b, alpha or 1), "add")
  return out
end

function T.sub(a, b) return T.add(a, b, -1) end

function T.mul(a, b)
  live(a, "mul")
  local out = empty_like(a, "mul")
  if type(b) == "number" then
    check(lib.gdp_tensor_scale(out, a, b), "mul")
  else
    tensor_arg(b, "mul", "other")
    check(lib.gdp_tensor_mul(out, a, b), "mul")
  end
  return out
end

-- In place: t = t + alpha * u; t = t * u; t = alpha * t.
function T.add_(t, u, alpha)
  live(t, "add_")
  tensor_arg(u, "add_", "other")
  check(lib.gdp_tensor_add(t, t, u, alpha or 1), "add_")
  return t
end

function T.mul_(t, u)
  live(t, "mul_")
  if type(u) == "number" then
    check(lib.gdp_tensor_scale(t, t, u), "mul_")
  else
    tensor_arg(u, "mul_", "other")
    check(lib.gdp_tensor_mul(t, t, u), "mul_")
  end
  return t
end

function T.scale_(t, alpha)
  live(t, "scale_")
  if type(alpha) ~= "number" then
    argerror("scale_", "alpha: expected a number, got " .. typename(alpha))
  end
  check(lib.gdp_tensor_scale(t, t, alpha), "scale_")
  return t
end

local function reduce(cname, fn)
  return function(t)
    live(t, fn)
    local out = f64_box()
    check(lib[cname](t, out), fn)
    return out[0]
  end
end
T.sum = reduce("gdp_tensor_sum", "sum")
T.norm = reduce("gdp_tensor_norm", "norm")
T.max_abs = reduce("gdp_tensor_max_abs", "max_abs")

function T.count_nonfinite(t)
  live(t, "count_nonfinite")
  local out = i64_box()
  check(lib.gdp_tensor_count_nonfinite(t, out), "count_nonfinite")
  return tonumber(out[0])
end

function T.dot(a, b)
  live(a, "dot")
  tensor_arg(b, "dot", "other")
  local out = f64_box()
  check(lib.gdp_tensor_dot(a, b, out), "dot")
  return out[0]
end

-- gdp.sumsq_many(list): {sum of squares of list[i]} (float64 numbers, the bits that
-- t:norm() squares) for a list of tensors of one device, read back together: one wait
-- on cuda where a norm per tensor would wait once each.
function M.sumsq_many(list)
  local fn = "sumsq_many"
  if type(list) ~= "table" then argerror(fn, "list: expected a table of tensors, got " .. typename(list)) end
  local n = #list
  local ts = ffi.new("const gdp_tensor *[?]", math.max(n, 1))
  for i = 1, n do ts[i - 1] = tensor_arg(list[i], fn, "list[" .. i .. "]") end
  local out = ffi.new("double[?]", math.max(n, 1))
  check(lib.gdp_tensor_sumsq_many(n, ts, out), fn)
  local r = {}
  for i = 1, n do r[i] = out[i - 1] end
  return r
end

-- ||a - ref|| / ||ref|| in float64 (NaN when either holds a non-finite value).
local function rel_error(a, ref)
  tensor_arg(a, "rel_error", "a")
  tensor_arg(ref, "rel_error", "ref")
  local out = f64_box()
  check(lib.gdp_tensor_rel_error(a, ref, out), "rel_error")
  return out[0]
end
M.rel_error = rel_error
T.rel_error = rel_error

local matmul_opts = { trans_a = true, trans_b = true, alpha = true, beta = true, out = true }

-- gdp.matmul(a, b, {trans_a =, trans_b =, alpha =, beta =, out =}): alpha*op(a)@op(b)
-- (+ beta*out when out is given) for f32/f64 tensors (bf16 on cuda): 2-D, or batched,
-- a [Bt,M,K] and b [Bt,K,N] giving [Bt,M,N] (dim 1 of any stride; one of a, b may be
-- 2-D, the same matrix for every batch entry); trans_a/trans_b transpose the last two dims.
function M.matmul(a, b, opts)
  tensor_arg(a, "matmul", "a")
  tensor_arg(b, "matmul", "b")
  opts = check_opts("matmul", opts, matmul_opts)
  local na, nb = lib.gdp_tensor_ndim(a), lib.gdp_tensor_ndim(b)
  if (na ~= 2 and na ~= 3) or (nb ~= 2 and nb ~= 3) then
    argerror("matmul", string.format("expected 2-D tensors or 3-D [batch,.,.] ones, got a %s and b %s",
                                     shape_str(shape_of(a)), shape_str(shape_of(b))))
  end
  if na == 3 and nb == 3 and lib.gdp_tensor_size(a, 0) ~= lib.gdp_tensor_size(b, 0) then
    argerror("matmul", string.format("b: expected a batch of %d (a is %s), got %s",
                                     tonumber(lib.gdp_tensor_size(a, 0)), shape_str(shape_of(a)),
                                     shape_str(shape_of(b))))
  end
  local ta, tb = opts.trans_a and 1 or 0, opts.trans_b and 1 or 0
  local out = opts.out
  if out == nil then
    local m = lib.gdp_tensor_size(a, na - 2 + ta)
    local n = lib.gdp_tensor_size(b, nb - 1 - tb)
    local arr, nd = i64_array(3), 2
    if na == 3 or nb == 3 then
      arr[0], arr[1], arr[2], nd = lib.gdp_tensor_size(na == 3 and a or b, 0), m, n, 3
    else
      arr[0], arr[1] = m, n
    end
    local box = tensor_box()
    out = call_outputs("matmul", "gdp_tensor_empty", { box }, tensor_ctx(a), lib.gdp_tensor_dtype(a), nd, arr, box)
  else
    tensor_arg(out, "matmul", "out")
  end
  check(lib.gdp_tensor_matmul(out, a, b, ta, tb, opts.alpha or 1, opts.out and (opts.beta or 0) or 0),
        "matmul")
  return out
end

------------------------------------------------------------------------------- printing

local PRINT_ALL_BELOW = 1000 -- torch's threshold: summarize larger tensors
local EDGE_ITEMS = 3
local HOST_COPY_BELOW = 4096 -- copy the whole tensor for the preview below this size

local function fmt_number_factory(values)
  local ints, maxabs, minabs = true, 0, math.huge
  for _, v in ipairs(values) do
    if v == v and v ~= math.huge and v ~= -math.huge then
      local a = math.abs(v)
      if a > maxabs then maxabs = a end
      if a > 0 and a < minabs then minabs = a end
      if v ~= math.floor(v) or a >= 1e15 then ints = false end
    end
  end
  local fmt
  if ints then fmt = "%.0f"
  elseif maxabs < 1e5 and (minabs >= 1e-4 or minabs == math.huge) then fmt = "%.4f"
  else fmt = "%.4e" end
  return function(v)
    if v ~= v then return "nan" end
    if v == math.huge then return "inf" end
    if v == -math.huge then return "-inf" end
    return string.format(fmt, v)
  end
end

local function preview(t)
  local shape = shape_of(t)
  local nd = #shape
  local n = numel_of(shape)
  if n == 0 then return "" end
  local summarize = n > PRINT_ALL_BELOW
  -- Shown indices per dim (0-based), with false marking an elision.
  local shown = {}
  for d = 1, nd do
    local s, list = shape[d], {}
    if summarize and s > 2 * EDGE_ITEMS then
      for i = 0, EDGE_ITEMS - 1 do list[#list + 1] = i end
      list[#list + 1] = false
      for i = s - EDGE_ITEMS, s - 1 do list[#list + 1] = i end
    else
      for i = 0, s - 1 do list[#list + 1] = i end
    end
    shown[d] = list
  end
  local value
  if n <= HOST_COPY_BELOW then
    local buf, _, is_int = host_values(t, "tostring")
    local strides = {}
    local acc = 1
    for d = nd, 1, -1 do strides[d] = acc; acc = acc * shape[d] end
    value = function(idx)
      local lin = 0
      for d = 1, nd do lin = lin + idx[d] * strides[d] end
      return is_int and tonumber(buf[lin]) or buf[lin]
    end
  else
    local arr = i64_array(math.max(nd, 1))
    local out = f64_box()
    value = function(idx)
      for d = 1, nd do arr[d - 1] = idx[d] end
      check(lib.gdp_tensor_get(t, arr, out), "tostring")
      return out[0]
    end
  end
  if nd == 0 then
    local v = value({})
    return fmt_number_factory({ v })(v)
  end
  -- Gather the shown values in order, then format them with one width.
  local rows = {} -- each: {prefix = "(1,2,.,.)" or nil, cells = {...}} or {ellipsis = true}
  local all = {}
  local idx = {}
  local function walk(d, prefix_parts)
    if d >= nd - 1 then
      -- the last one (1-D) or two (2-D) dims form a matrix
      local row_list = nd >= 2 and shown[nd - 1] or { 0 }
      local header = nil
      if nd > 2 then header = "(" .. table.concat(prefix_parts, ",") .. ",.,.) =" end
      if header then rows[#rows + 1] = { header = header } end
      for _, r in ipairs(row_list) do
        if r == false then
          rows[#rows + 1] = { ellipsis = true }
        else
          if nd >= 2 then idx[nd - 1] = r end
          local cells = {}
          for _, c in ipairs(shown[nd]) do
            if c == false then
              cells[#cells + 1] = false
            else
              idx[nd] = c
              local v = value(idx)
              cells[#cells + 1] = v
              all[#all + 1] = v
            end
          end
          rows[#rows + 1] = { cells = cells }
        end
      end
      if header then rows[#rows + 1] = { blank = true } end
      return
    end
    for _, i in ipairs(shown[d]) do
      if i == false then
        rows[#rows + 1] = { ellipsis = true, outer = true }
      else
        idx[d] = i
        prefix_parts[d] = tostring(i + 1)
        walk(d + 1, prefix_parts)
      end
    end
  end
  walk(1, {})
  local fmt = fmt_number_factory(all)
  local width = 1
  for _, v in ipairs(all) do width = math.max(width, #fmt(v)) end
  local lines = {}
  for _, r in ipairs(rows) do
    if r.header then lines[#lines + 1] = r.header
    elseif r.blank then lines[#lines + 1] = ""
    elseif r.ellipsis and r.outer then
      lines[#lines + 1] = "..."
      lines[#lines + 1] = ""
    elseif r.ellipsis then lines[#lines + 1] = " ..."
    else
      local parts = {}
      for _, v in ipairs(r.cells) do
        parts[#parts + 1] = v == false and "..." or string.format("%" .. width .. "s", fmt(v))
      end
      lines[#lines + 1] = " " .. table.concat(parts, " ")
    end
  end
  while lines[#lines] == "" do lines[#lines] = nil end
  return table.concat(lines, "\n")
end

local function header(t)
  return string.format("gdp.Tensor<%s, %s>%s%s", dtype_name(lib.gdp_tensor_dtype(t)),
                       device_name(t), shape_str(shape_of(t)),
                       lib.gdp_tensor_is_view(t) == 1 and " view" or "")
end

-- First line "gdp.Tensor<f32, cpu>[2x3] view", then a preview of the values.
mt.__tostring = function(t)
  if freed[t] then return "gdp.Tensor<freed>" end
  local p = preview(t)
  if p == "" then return header(t) end
  return header(t) .. "\n" .. p
end

-- The header line only.
function T.description(t) return header(live(t, "description")) end

mt.__len = function(t)
  live(t, "len")
  if lib.gdp_tensor_ndim(t) == 0 then argerror("len", "# of a 0-dim tensor") end
  return tonumber(lib.gdp_tensor_size(t, 0))
end

-- Arithmetic: tensors of one shape, or a tensor and a number.  == is pointer identity.
mt.__add = function(a, b)
  if type(a) == "number" then a, b = b, a end
  return T.add(a, b)
end

mt.__sub = function(a, b)
  if type(a) == "number" then
    local out = T.mul(b, -1)
    return T.add(out, a)
  end
  return T.add(a, b, -1)
end

mt.__mul = function(a, b)
  if type(a) == "number" then a, b = b, a end
  return T.mul(a, b)
end

mt.__div = function(a, b)
  if type(b) ~= "number" then
    argerror("div", "only division by a number is supported, got " .. typename(b))
  end
  return T.mul(a, 1 / b)
end

mt.__unm = function(a) return T.mul(a, -1) end

ffi.metatype("struct gdp_tensor", mt)

return M
