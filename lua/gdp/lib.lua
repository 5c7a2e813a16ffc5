-- gdp.lib: loads libgdp once and returns its FFI namespace.
--
-- The declarations come from gdp.cdef, generated from core/include/gdp.h by the build
-- (build/lua/gdp/cdef.lua); it is the only ffi.cdef in the tree.  The library is
-- found through $GDP_LIB (a path, set by ./gdp) or the system search path ("gdp").
--
-- Callers write lib.gdp_fn(...) at every call: the namespace lives in this module's
-- upvalue so that the JIT folds the lookup, and C functions are never cached in
-- locals (a cached function keeps a stale cdata and defeats that folding).
local ffi = require("ffi")

-- The ABI this Lua code was written for (gdp_abi_version() in gdp.h).
local ABI_VERSION = 1

local INSTALL_HINT = "run ./gdp build (it builds libgdp and generates build/lua/gdp/cdef.lua), " ..
  "or set GDP_LIB to the path of libgdp.so and put <build dir>/lua on LUA_PATH"

local ok_cdef, cdef = pcall(require, "gdp.cdef")
if not ok_cdef then
  error("gdp: cannot find the generated FFI declarations gdp.cdef: " .. INSTALL_HINT ..
        "\n" .. tostring(cdef), 0)
end
ffi.cdef(cdef)

local libname = os.getenv("GDP_LIB")
if libname == "" then libname = nil end
local ok_load, lib = pcall(ffi.load, libname or "gdp")
if not ok_load then
  error(string.format("gdp: cannot load libgdp (%s): %s\n%s",
                      libname and ("GDP_LIB=" .. libname) or "GDP_LIB unset, searched for libgdp.so",
                      INSTALL_HINT, tostring(lib)), 0)
end

local ok_abi, abi = pcall(function() return lib.gdp_abi_version() end)
if not ok_abi then
  error("gdp: " .. (libname or "libgdp") .. " has no gdp_abi_version(): not a gdp library? " ..
        INSTALL_HINT, 0)
end
if abi ~= ABI_VERSION then
  error(string.format("gdp: libgdp ABI version %d, but these Lua bindings need %d: " ..
                      "rebuild the library and the bindings together (%s)",
                      abi, ABI_VERSION, INSTALL_HINT), 0)
end

return lib
