-- gdp: Gated DeltaProduct research core, LuaJIT bindings.
--
--   local gdp = require("gdp")
--   gdp.manual_seed(1)
--   local q = gdp.randn({1, 128, 4, 64})            -- f32 on cpu by default
--   print(q)                                       -- gdp.Tensor<f32, cpu>[1x128x4x64] ...
--   local o, ht = gdp.ops.chunk_gated_delta_product{q = q, k = k, v = v, g = g, beta = beta}
--
-- Dims and indices are 1-based (torch7 style); see gdp/tensor.lua.  Errors from the C
-- library are raised as tables whose tostring reads
-- "file:line: gdp.<fn>: GDP_ERR_<NAME>: <message>" (gdp.is_error(e) tells them apart).
local ffi = require("ffi")
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")
local ops = require("gdp.ops")
local gio = require("gdp.io")

local gdp = {}

-- Tensors and contexts.
for _, name in ipairs({
  "tensor", "empty", "zeros", "ones", "full", "rand", "randn", "arange", "empty_like",
  "device", "devices", "has_cuda", "manual_seed", "initial_seed",
  "set_default_dtype", "get_default_dtype", "is_tensor", "is_error", "rel_error", "matmul",
  "sumsq_many", "set_memory_soft_limit", "memory_live_bytes", "Error",
}) do
  gdp[name] = tensor[name]
end
gdp.Tensor = tensor.methods -- the method table: extend it to add tensor methods

gdp.ops = ops
-- Tuning of the default contexts (see gdp/ops.lua): gdp.set_tuning{value_block = 32}.
gdp.set_tuning = ops.set_tuning
gdp.get_tuning = ops.get_tuning
gdp.load = gio.load
gdp.save = gio.save
gdp.lib = lib

gdp.version = ffi.string(lib.gdp_version())
gdp.abi_version = lib.gdp_abi_version()

-- The library's multi-line "key: value" build description.
function gdp.build_info()
  return ffi.string(lib.gdp_build_info())
end

-- The same as a table key -> value.
function gdp.build_info_table()
  local out = {}
  for line in gdp.build_info():gmatch("[^\n]+") do
    local k, v = line:match("^%s*([^:]+):%s*(.-)%s*$")
    if k then out[k] = v end
  end
  return out
end

-- Monotonic wall clock in seconds.
function gdp.time()
  return lib.gdp_time_now()
end

-- Waits for the queued work of a device's default context ("cpu", "cuda:0", or a
-- context; default "cpu").
function gdp.sync(dev)
  tensor.get_ctx("sync", dev or "cpu"):sync()
end

-- gdp.nn (layers), gdp.cp (context parallelism), gdp.data (synthetic tasks), gdp.optim,
-- gdp.train and gdp.interchange load on first use, so that `require "gdp"` stays light
-- and a module's load error surfaces where it is used.
setmetatable(gdp, {
  __index = function(t, key)
    if key == "nn" or key == "cp" or key == "comm" or key == "sweep" or key == "data"
        or key == "optim" or key == "train" or key == "interchange" then
      local mod = require("gdp." .. key)
      rawset(t, key, mod)
      return mod
    end
  end,
})

return gdp
