-- Tuning (gdp.h, gdp_tuning): gdp.set_tuning / gdp.get_tuning on the default contexts
-- and per device, the per-call value_block of the operator, the library's checks of the
-- values, and the record in a run's meta.json.  On the cpu the knob changes nothing:
-- the operator's results keep their bits.
local ffi = require("ffi")
local gdp = require("gdp")
local results = require("gdp.results")
local util = require("gdp.util")
local lib = gdp.lib
local H = gdp_test

local function read_all(path)
  local f = assert(io.open(path, "r"))
  local s = f:read("*a")
  f:close()
  return s
end

local function same_bits(a, b)
  assert.are.same(a:shape(), b:shape())
  assert.are.equal(a:dtype(), b:dtype())
  local n = a:numel() * ({ f64 = 8, f32 = 4, bf16 = 2 })[a:dtype()]
  local ca, cb = a:contiguous(), b:contiguous()
  return ffi.string(ca:data(), n) == ffi.string(cb:data(), n)
end

describe("tuning", function()
  after_each(function() gdp.set_tuning { value_block = 0 } end)

  it("starts at the backends' own choices and round-trips through set/get", function()
    assert.are.same({ value_block = 0 }, gdp.get_tuning())
    assert.are.same({ value_block = 0 }, gdp.get_tuning("cpu"))
    for _, vb in ipairs({ 16, 32, 64, 0 }) do
      gdp.set_tuning { value_block = vb }
      assert.are.same({ value_block = vb }, gdp.get_tuning())
      assert.are.same({ value_block = vb }, gdp.get_tuning("cpu"))
      assert.are.same({ value_block = vb }, gdp.get_tuning(gdp.device("cpu")))
    end
    -- one device's context only: the default (what set_tuning without a device set) stays
    gdp.set_tuning({ value_block = 32 }, "cpu")
    assert.are.same({ value_block = 32 }, gdp.get_tuning("cpu"))
    assert.are.same({ value_block = 0 }, gdp.get_tuning())
    -- a table without the key keeps the value
    gdp.set_tuning({}, "cpu")
    assert.are.same({ value_block = 32 }, gdp.get_tuning("cpu"))
  end)

  it("rejects bad values with the field, what it takes and what it got, changing nothing", function()
    gdp.set_tuning { value_block = 16 }
    H.expect_error(function() gdp.set_tuning { value_block = 48 } end,
                   "gdp.set_tuning", "GDP_ERR_INVALID_ARG",
                   "value_block: expected 0 (the backend's own), 16, 32 or 64, got 48")
    H.expect_error(function() gdp.set_tuning({ value_block = -16 }, "cpu") end,
                   "value_block: expected 0 (the backend's own), 16, 32 or 64, got -16")
    assert.are.same({ value_block = 16 }, gdp.get_tuning())
    assert.are.same({ value_block = 16 }, gdp.get_tuning("cpu"))
    H.expect_error(function() gdp.set_tuning { value_block = 2.5 } end,
                   "gdp.set_tuning: value_block must be an integer", "got 2.5")
    H.expect_error(function() gdp.set_tuning { value_block = "32" } end,
                   "value_block must be an integer", "got the string \"32\"")
    H.expect_error(function() gdp.set_tuning { value_blok = 32 } end,
                   "gdp.set_tuning: unknown option 'value_blok'", "value_block")
    H.expect_error(function() gdp.set_tuning(32) end,
                   "gdp.set_tuning: expected a table such as {value_block = 32}, got number")
    H.assert_alive()
  end)

  it("the C entry points check their arguments", function()
    local t = ffi.new("gdp_tuning[1]")
    lib.gdp_tuning_init(t)
    t[0].value_block = 8
    assert.are_not.equal(0, lib.gdp_ctx_set_tuning(gdp.device("cpu"), t))
    assert.truthy(ffi.string(lib.gdp_last_error()):find("value_block: expected 0", 1, true))
    assert.are.equal(lib.GDP_ERR_INVALID_ARG, lib.gdp_ctx_set_tuning(nil, t))
    assert.are.equal(lib.GDP_ERR_INVALID_ARG, lib.gdp_ctx_get_tuning(gdp.device("cpu"), nil))
  end)

  it("the operator takes value_block per call, checks it, and keeps the cpu's bits", function()
    H.reseed(41)
    local args = gdp.ops.random_inputs { B = 1, T = 20, H = 2, K = 8, V = 8, n = 2, dtype = "f32",
                                         grads = true }
    local o0 = gdp.ops.chunk_gated_delta_product(args)
    local g0 = gdp.ops.chunk_gated_delta_product_backward(args)
    gdp.set_tuning { value_block = 64 }
    args.value_block = 32
    local o1 = gdp.ops.chunk_gated_delta_product(args)
    local g1 = gdp.ops.chunk_gated_delta_product_backward(args)
    assert.is_true(same_bits(o0, o1))
    for _, name in ipairs({ "dq", "dk", "dv", "dbeta", "dg" }) do
      assert.is_true(same_bits(g0[name], g1[name]), name)
    end
    args.value_block = 24
    H.expect_error(function() gdp.ops.chunk_gated_delta_product(args) end,
                   "GDP_ERR_INVALID_ARG",
                   "opts->value_block: expected 0 (the context's), 16, 32 or 64, got 24")
    H.expect_error(function() gdp.ops.chunk_gated_delta_product_backward(args) end,
                   "opts->value_block: expected 0 (the context's), 16, 32 or 64, got 24")
    args.value_block = 1.5
    H.expect_error(function() gdp.ops.chunk_gated_delta_product(args) end,
                   "gdp.chunk_gated_delta_product: value_block must be an integer")
    H.assert_alive()
  end)

  it("chunk_size nil is the backend's own: on the cpu the same bits as 64", function()
    H.reseed(42)
    local args = gdp.ops.random_inputs { B = 1, T = 100, H = 1, K = 8, V = 8, n = 2, dtype = "f64" }
    local o_nil = gdp.ops.chunk_gated_delta_product(args)
    args.chunk_size = 64
    local o_64 = gdp.ops.chunk_gated_delta_product(args)
    args.chunk_size = 16
    local o_16 = gdp.ops.chunk_gated_delta_product(args)
    assert.is_true(same_bits(o_nil, o_64))
    assert.is_false(same_bits(o_nil, o_16)) -- the option reaches the kernel
    args.chunk_size = 0
    H.expect_error(function() gdp.ops.chunk_gated_delta_product(args) end,
                   "chunk_size must be an integer >= 1")
  end)

  describe("in meta.json", function()
    local dir
    before_each(function()
      dir = os.tmpname()
      os.remove(dir)
    end)
    after_each(function() os.execute("rm -rf " .. util.shell_quote(dir)) end)

    it("records the default and every default context's tuning, and a change by the end", function()
      gdp.set_tuning { value_block = 32 }
      local run = results.new_run("tuning", { root = dir })
      local meta = util.json_decode(read_all(run.dir .. "/meta.json"))
      assert.are.same({ value_block = 32 }, meta.gdp.tuning.default)
      assert.are.same({ value_block = 32 }, meta.gdp.tuning.contexts.cpu)
      gdp.set_tuning({ value_block = 64 }, "cpu")
      run:finish()
      meta = util.json_decode(read_all(run.dir .. "/meta.json"))
      assert.are.same({ value_block = 32 }, meta.gdp.tuning.contexts.cpu)
      assert.are.same({ value_block = 64 }, meta.gdp.tuning_end.contexts.cpu)
    end)

    it("has no tuning_end when nothing changed", function()
      local run = results.new_run("tuning", { root = dir })
      run:finish()
      local meta = util.json_decode(read_all(run.dir .. "/meta.json"))
      assert.are.same({ value_block = 0 }, meta.gdp.tuning.default)
      assert.is_nil(meta.gdp.tuning_end)
    end)
  end)
end)
