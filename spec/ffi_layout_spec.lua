-- The FFI's view of the public non-opaque structs matches the C compiler's
-- (ljsyscall's layout test): sizeof and every field offset of gdp_gdp_options.
local ffi = require("ffi")
local gdp = require("gdp")
local lib = gdp.lib

describe("ffi layout", function()
  it("gdp_gdp_options matches gdp_gdp_options_layout()", function()
    local fields = { "num_householder", "scale", "chunk_size", "use_qk_l2norm",
                     "output_final_state", "algorithm", "reserved" }
    local offsets = ffi.new("size_t[7]")
    local size = tonumber(lib.gdp_gdp_options_layout(offsets))
    assert.are.equal(size, ffi.sizeof("gdp_gdp_options"))
    for i, name in ipairs(fields) do
      assert.are.equal(tonumber(offsets[i - 1]), ffi.offsetof("gdp_gdp_options", name), name)
    end
  end)

  it("gdp_gdp_options_init fills the documented defaults", function()
    local o = ffi.new("gdp_gdp_options")
    o.reserved = 7
    lib.gdp_gdp_options_init(o)
    assert.are.equal(1, tonumber(o.num_householder))
    assert.are.equal(0, o.scale)
    assert.is_true(tonumber(o.chunk_size) == 64 or tonumber(o.chunk_size) == 0)
    assert.are.equal(0, o.use_qk_l2norm)
    assert.are.equal(0, o.output_final_state)
    assert.are.equal(lib.GDP_ALGO_AUTO, o.algorithm)
    assert.are.equal(0, o.reserved)
  end)

  it("the ABI version is the one the bindings were written for", function()
    assert.are.equal(1, lib.gdp_abi_version())
    assert.are.equal(1, gdp.abi_version)
    assert.is_string(gdp.version)
    assert.truthy(gdp.build_info():find("\n", 1, true))
  end)
end)
