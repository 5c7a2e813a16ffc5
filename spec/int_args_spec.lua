-- Integer arguments at every entry of the Lua API go through one checker
-- (gdp.util.int_arg): a string, NaN, +-inf, a fraction or a value beyond the C type is
-- an error naming the argument (1-based), what it must be and what it got, never a
-- number that reaches C as INT64_MIN or wraps.
local H = gdp_test
local gdp = require("gdp")
local util = require("gdp.util")

local function op_args()
  return gdp.ops.random_inputs { T = 4, K = 4, V = 4, H = 1, dtype = "f64" }
end

local function mixer(cfg)
  local base = { hidden_size = 16, num_heads = 2, head_dim = 8, num_groups = 1, state_dim = 8,
                 num_householder = 2, dtype = "f64" }
  for key, val in pairs(cfg) do base[key] = val end
  return gdp.nn.GatedDeltaProduct(base)
end

-- {entry, the argument's name in the message, function(v) that passes v there, the
-- C type's upper limit (int64 when nil), a value it takes (1 when nil)}
local ENTRIES = {
  { "gdp.empty", "size of dim 1", function(v) return gdp.empty({ v }) end },
  { "gdp.zeros", "size of dim 2", function(v) return gdp.zeros({ 2, v }) end },
  { "gdp.ones", "size of dim 1", function(v) return gdp.ones({ v }) end },
  { "gdp.rand", "size of dim 1", function(v) return gdp.rand({ v }) end },
  { "gdp.randn", "size of dim 1", function(v) return gdp.randn({ v }) end },
  { "gdp.full", "size of dim 1", function(v) return gdp.full({ v }, 1) end },
  { "gdp.view", "size of dim 2", function(v) return gdp.zeros({ 2 }):view(2, v) end },
  { "gdp.reshape", "size of dim 1", function(v) return gdp.zeros({ 1 }):reshape({ v }) end },
  { "gdp.narrow", "start (1-based)", function(v) return gdp.zeros({ 4 }):narrow(1, v, 1) end },
  { "gdp.narrow", "length", function(v) return gdp.zeros({ 4 }):narrow(1, 1, v) end },
  { "gdp.select", "index into dim 1", function(v) return gdp.zeros({ 4 }):select(1, v) end, 4 },
  { "gdp.get", "index 2 (into dim 2", function(v) return gdp.zeros({ 2, 3 }):get(1, v) end, 3 },
  { "gdp.set", "index 1 (into dim 1", function(v) return gdp.zeros({ 2 }):set(1, v) end, 2 },
  { "gdp.manual_seed", "seed", function(v) gdp.manual_seed(v) end },
  { "gdp.manual_seed", "seed", function(v) gdp.device("cpu"):manual_seed(v) end },
  { "gdp.set_rng_offset", "offset", function(v) gdp.device("cpu"):set_rng_offset(v) end },
  { "gdp.set_num_threads", "threads", function(v) gdp.device("cpu"):set_num_threads(v) end, util.INT_MAX },
  { "gdp.set_tuning", "value_block", function(v) gdp.set_tuning { value_block = v } end, util.INT_MAX, 16 },
  { "gdp.chunk_gated_delta_product", "num_householder", function(v)
      local a = op_args(); a.num_householder = v; return gdp.ops.chunk_gated_delta_product(a) end },
  { "gdp.chunk_gated_delta_product", "chunk_size", function(v)
      local a = op_args(); a.chunk_size = v; return gdp.ops.chunk_gated_delta_product(a) end },
  { "gdp.chunk_gated_delta_product", "value_block", function(v)
      local a = op_args(); a.value_block = v; return gdp.ops.chunk_gated_delta_product(a) end, util.INT_MAX, 16 },
  { "gdp.chunk_gated_delta_product_backward", "cu_seqlens[2]", function(v)
      local a = op_args(); a["do"] = gdp.randn({ 1, 4, 1, 4 }, { dtype = "f64" }); a.cu_seqlens = { 0, v, 4 }
      return gdp.ops.chunk_gated_delta_product_backward(a) end, 2 ^ 53 - 1 },
  { "gdp.nn.GatedDeltaProduct", "hidden_size", function(v) return mixer { hidden_size = v } end },
  { "gdp.nn.GatedDeltaProduct", "num_householder", function(v) return mixer { num_householder = v } end },
  { "gdp.nn.GatedDeltaProduct", "seed", function(v) return mixer { seed = v } end },
  { "gdp.nn.functional.repeat_heads", "num_heads", function(v)
      return gdp.nn.functional.repeat_heads(gdp.zeros({ 1, 4 }), v) end },
  { "gdp.nn.functional.ssm_inputs", "num_householder", function(v)
      -- xBC [1,1,M+2]: one head of dim 1, one group of state dim 1, M = v copies
      local M = v == 1 and 1 or 0
      return gdp.nn.functional.ssm_inputs(gdp.zeros({ 1, 1, M + 2 }), gdp.zeros({ 1, 1, M }), nil, nil, nil,
        { num_heads = 1, head_dim = 1, num_groups = 1, state_dim = 1, num_householder = v }) end },
  { "gdp.cp.shard.split", "cp", function(v) return gdp.cp.shard.split(gdp.zeros({ 4, 1 }), v, 0) end, util.INT_MAX },
  { "gdp.cp.shard.split", "rank", function(v) return gdp.cp.shard.split(gdp.zeros({ 4, 1 }), 2, v) end, 1 },
  { "gdp.data.state_tracking", "length", function(v)
      return gdp.data.state_tracking { task = "S3", batch = 1, length = v, seed = 1 } end },
  { "gdp.data.state_tracking", "seed", function(v)
      return gdp.data.state_tracking { task = "S3", batch = 1, length = 1, seed = v } end },
  { "gdp.comm.broadcast", "root", function(v) gdp.comm.self():broadcast(gdp.zeros({ 2 }), v) end, 0, 0 },
  { "gdp.comm.split", "color", function(v) gdp.comm.self():split(v) end, util.INT_MAX },
}

-- Bad values and how the message shows them.
local function bad_values(max)
  local beyond = max and (max + 1) or 2 ^ 63
  return {
    { "2", 'the string "2"' }, { 0 / 0, "nan" }, { math.huge, "inf" }, { -math.huge, "-inf" },
    { 2.5, "2.5" }, { beyond, string.format("%.0f", beyond) },
  }
end

describe("integer arguments", function()
  it("the probes are right: each entry takes a good value", function()
    finally(function() gdp.manual_seed(H.seed); gdp.set_tuning { value_block = 0 } end)
    for _, e in ipairs(ENTRIES) do
      local ok, err = pcall(e[3], e[5] or 1)
      assert(ok, e[1] .. " " .. e[2] .. " rejects " .. (e[5] or 1) .. ": " .. tostring(err))
    end
  end)

  for _, e in ipairs(ENTRIES) do
    local entry, name, call, max = e[1], e[2], e[3], e[4]
    it(entry .. ": " .. name .. " rejects strings, NaN, +-inf, fractions and values beyond its C type", function()
      for _, bad in ipairs(bad_values(max)) do
        H.expect_error(function() call(bad[1]) end, entry, name, "must be an integer", "got " .. bad[2])
      end
      gdp.manual_seed(H.seed)
      H.assert_alive()
    end)
  end

  it("util.int_arg names the range it wants", function()
    H.expect_error(function() util.int_arg("f", "n", 5, 0, 3) end, "gdp.f: n must be an integer in [0, 3], got 5")
    H.expect_error(function() util.int_arg("f", "n", -1, 0) end, "gdp.f: n must be an integer >= 0, got -1")
    H.expect_error(function() util.int_arg("f", "n", nil) end, "gdp.f: n must be an integer, got nil")
    assert.are.equal(7, util.int_arg("f", "n", 7, 0, 7))
    assert.is_nil(util.int_opt("f", "n", nil, 0))
  end)
end)
