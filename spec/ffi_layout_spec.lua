-- The FFI's view of the public non-opaque structs matches the C compiler's
-- (ljsyscall's layout test): sizeof and every field offset of gdp_delta_product_options, and of
-- gdp_tuning.
local ffi = require("ffi")
local gdp = require("gdp")
local lib = gdp.lib

describe("ffi layout", function()
  it("gdp_delta_product_options matches gdp_delta_product_options_layout()", function()
    local fields = { "num_householder", "scale", "chunk_size", "use_qk_l2norm",
                     "output_final_state", "algorithm", "value_block", "reserved" }
    local offsets = ffi.new("size_t[8]")
    local size = tonumber(lib.gdp_delta_product_options_layout(offsets))
    assert.are.equal(size, ffi.sizeof("gdp_delta_product_options"))
    for i, name in ipairs(fields) do
      assert.are.equal(tonumber(offsets[i - 1]), ffi.offsetof("gdp_delta_product_options", name), name)
    end
  end)

  it("gdp_delta_product_options_init fills the documented defaults", function()
    local o = ffi.new("gdp_delta_product_options")
    o.reserved = 7
    lib.gdp_delta_product_options_init(o)
    assert.are.equal(1, tonumber(o.num_householder))
    assert.are.equal(0, o.scale)
    assert.are.equal(0, tonumber(o.chunk_size)) -- the backend's own
    assert.are.equal(0, o.value_block)          -- the context's
    assert.are.equal(0, o.use_qk_l2norm)
    assert.are.equal(0, o.output_final_state)
    assert.are.equal(lib.GDP_ALGO_AUTO, o.algorithm)
    assert.are.equal(0, o.reserved)
  end)

  it("gdp_tuning is one int32 per knob, zeroed by gdp_tuning_init", function()
    assert.are.equal(4, ffi.sizeof("gdp_tuning"))
    assert.are.equal(0, ffi.offsetof("gdp_tuning", "value_block"))
    local t = ffi.new("gdp_tuning")
    t.value_block = 99
    lib.gdp_tuning_init(t)
    assert.are.equal(0, t.value_block)
  end)

  it("the ABI version is the one the bindings were written for", function()
    assert.are.equal(1, lib.gdp_abi_version())
    assert.are.equal(1, gdp.abi_version)
    assert.is_string(gdp.version)
    assert.truthy(gdp.build_info():find("\n", 1, true))
  end)
end)
