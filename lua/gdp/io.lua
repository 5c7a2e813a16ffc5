-- gdp.io: safetensors files.
--
--   local tensors, metadata, names = gdp.load("case.safetensors", {device = "cuda"})
--   -- tensors: name -> tensor (dtypes kept), metadata: key -> string,
--   -- names: the tensor names in file order
--   gdp.save("out.safetensors", {q = q, k = k}, {num_householder = 2})
--   -- metadata values may be strings, numbers or booleans (stored as strings)
local ffi = require("ffi")
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")

local argerror, check, call_outputs = tensor.argerror, tensor.check, tensor.call_outputs

local M = {}

local load_opts = { device = true }

function M.load(path, opts)
  if type(path) ~= "string" then
    argerror("load", "path: expected a string, got " .. type(path))
  end
  opts = tensor.check_opts("load", opts, load_opts)
  local ctx = tensor.get_ctx("load", opts.device)
  local box = ffi.new("gdp_st_file *[1]")
  -- Released by the GC if anything below fails, explicitly at the end otherwise.
  local f = call_outputs("load", "gdp_safetensors_load", { { box, lib.gdp_st_free } }, ctx, path, box)
  local tensors, names, metadata = {}, {}, {}
  for i = 0, tonumber(lib.gdp_st_count(f)) - 1 do
    local name = ffi.string(lib.gdp_st_name(f, i))
    local tbox = ffi.new("gdp_tensor *[1]")
    tensors[name] = call_outputs("load", "gdp_st_tensor", { tbox }, f, i, tbox)
    names[#names + 1] = name
  end
  for i = 0, tonumber(lib.gdp_st_meta_count(f)) - 1 do
    metadata[ffi.string(lib.gdp_st_meta_key(f, i))] = ffi.string(lib.gdp_st_meta_value(f, i))
  end
  lib.gdp_st_free(ffi.gc(f, nil))
  return tensors, metadata, names
end

function M.save(path, tensors, metadata)
  if type(path) ~= "string" then
    argerror("save", "path: expected a string, got " .. type(path))
  end
  if type(tensors) ~= "table" then
    argerror("save", "tensors: expected a table name -> tensor, got " .. type(tensors))
  end
  local names = {}
  for name, t in pairs(tensors) do
    if type(name) ~= "string" or name == "" then
      argerror("save", "tensors: expected non-empty string names, got " .. tostring(name))
    end
    if name:find("\0", 1, true) then -- C would cut the name short at the NUL
      argerror("save", string.format("tensors: name %q holds a NUL byte, which names cannot hold", name))
    end
    tensor.tensor_arg(t, "save", "tensors." .. name)
    names[#names + 1] = name
  end
  table.sort(names) -- a deterministic file for the same tensors
  local count = #names
  local cnames = ffi.new("const char *[?]", math.max(count, 1))
  local ctensors = ffi.new("const gdp_tensor *[?]", math.max(count, 1))
  for i, name in ipairs(names) do
    cnames[i - 1] = name -- `names` keeps the Lua strings alive during the call
    ctensors[i - 1] = tensors[name]
  end
  local keys, values = {}, {}
  if metadata ~= nil then
    if type(metadata) ~= "table" then
      argerror("save", "metadata: expected a table key -> string, got " .. type(metadata))
    end
    for key in pairs(metadata) do
      if type(key) ~= "string" then
        argerror("save", "metadata: expected string keys, got " .. type(key))
      end
      keys[#keys + 1] = key
    end
    table.sort(keys)
    for i, key in ipairs(keys) do
      local val = metadata[key]
      local ty = type(val)
      if ty ~= "string" and ty ~= "number" and ty ~= "boolean" then
        argerror("save", string.format("metadata.%s: expected a string, number or boolean, got %s",
                                       key, ty))
      end
      if ty == "number" then
        local s -- the shortest text that reads back as the same double
        for _, f in ipairs({ "%.15g", "%.16g", "%.17g" }) do
          s = string.format(f, val)
          if tonumber(s) == val then break end
        end
        val = s
      end
      values[i] = tostring(val)
      if key:find("\0", 1, true) or values[i]:find("\0", 1, true) then
        argerror("save", string.format("metadata.%s: keys and values cannot hold a NUL byte", key))
      end
    end
  end
  local mcount = #keys
  local ckeys = ffi.new("const char *[?]", math.max(mcount, 1))
  local cvalues = ffi.new("const char *[?]", math.max(mcount, 1))
  for i = 1, mcount do
    ckeys[i - 1] = keys[i]
    cvalues[i - 1] = values[i]
  end
  check(lib.gdp_safetensors_save(path, count, cnames, ctensors, mcount, ckeys, cvalues), "save")
end

return M
