-- No silent wrong answer: a backward never reuses a forward that belongs to other
-- inputs, conversions never drop data, and bad arguments are named.
local gdp = require("gdp")
local nn = require("gdp.nn")
local H = gdp_test

local cfg = { hidden_size = 8, num_heads = 4, head_dim = 3, num_groups = 2, state_dim = 4,
              num_householder = 2, D = "head", dtype = "f64", seed = 7 }

-- dx and the in_proj gradient of a fresh module (its backward runs its own forward).
local function fresh_backward(x, dy, cu)
  local m = nn.GatedDeltaProduct(cfg)
  local dx = m:backward(x, dy, cu)
  return dx, m:gradients()["in_proj.weight"]:clone()
end

local function expect_same(m, dx, x, dy, cu)
  local want_dx, want_g = fresh_backward(x, dy, cu)
  assert.tensor_near(dx, want_dx, 1e-13)
  assert.tensor_near(m:gradients()["in_proj.weight"], want_g, 1e-13)
end

describe("nn.GatedDeltaProduct backward never reuses a stale forward", function()
  it("backward without the forward's cu_seqlens is the unpacked problem", function()
    H.reseed(101)
    local m = nn.GatedDeltaProduct(cfg)
    local x = gdp.randn({ 6, 1, 8 }, { dtype = "f64" })
    local dy = gdp.randn({ 6, 1, 8 }, { dtype = "f64" })
    m:forward(x, { 0, 2, 6 })
    local dx = m:backward(x, dy)
    expect_same(m, dx, x, dy, nil)
  end)

  it("cu_seqlens changed in place between forward and backward", function()
    H.reseed(102)
    local m = nn.GatedDeltaProduct(cfg)
    local x = gdp.randn({ 6, 1, 8 }, { dtype = "f64" })
    local dy = gdp.randn({ 6, 1, 8 }, { dtype = "f64" })
    local cu = { 0, 2, 6 }
    m:forward(x, cu)
    cu[2] = 4
    local dx = m:backward(x, dy, cu)
    expect_same(m, dx, x, dy, { 0, 4, 6 })
  end)

  it("x written in place between forward and backward", function()
    H.reseed(103)
    local m = nn.GatedDeltaProduct(cfg)
    local x = gdp.randn({ 5, 2, 8 }, { dtype = "f64" })
    local dy = gdp.randn({ 5, 2, 8 }, { dtype = "f64" })
    m:forward(x)
    x:narrow(1, 3, 1):fill(0.5)
    local dx = m:backward(x, dy)
    expect_same(m, dx, x, dy, nil)
  end)

  -- The layer sees writes through gdp's API only (x:version()): a write through the raw
  -- x:data() pointer keeps the count and would reuse the stale forward.
  it("x written through a view of another shape, or a cu_seqlens tensor set in place", function()
    H.reseed(105)
    local m = nn.GatedDeltaProduct(cfg)
    local x = gdp.randn({ 6, 1, 8 }, { dtype = "f64" })
    local dy = gdp.randn({ 6, 1, 8 }, { dtype = "f64" })
    m:forward(x)
    x:view(48):narrow(1, 20, 4):copy(gdp.randn({ 4 }, { dtype = "f64" }))
    expect_same(m, m:backward(x, dy), x, dy, nil)
    local cu = gdp.tensor({ 0, 2, 6 }, { dtype = "i32" })
    m = nn.GatedDeltaProduct(cfg)
    m:forward(x, cu)
    cu:set(4, 2)
    expect_same(m, m:backward(x, dy, cu), x, dy, { 0, 4, 6 })
  end)

  it("still reuses the forward on the same inputs", function()
    H.reseed(104)
    local m = nn.GatedDeltaProduct(cfg)
    local x = gdp.randn({ 5, 1, 8 }, { dtype = "f64" })
    local dy = gdp.randn({ 5, 1, 8 }, { dtype = "f64" })
    m:forward(x, { 0, 3, 5 })
    local cache = m.cache
    m:backward(x, dy, { 0, 3, 5 })
    assert.are.equal(cache, m.cache)
    local cu = gdp.tensor({ 0, 3, 5 }, { dtype = "i64" })
    m:forward(x, cu)
    cache = m.cache
    x:sum()
    cu:get(2)
    m:backward(x, dy, cu)
    assert.are.equal(cache, m.cache)
  end)

  it("names dy's dtype and device", function()
    local m = nn.GatedDeltaProduct(cfg)
    local x = gdp.randn({ 5, 1, 8 }, { dtype = "f64" })
    H.expect_error(function() m:backward(x, gdp.zeros({ 5, 1, 8 }, { dtype = "f32" })) end,
                   "dy: expected dtype f64 (the module's), got f32")
  end)
end)

describe("conversions never drop data silently", function()
  it("tables with non-array keys, holes or themselves inside are errors", function()
    H.expect_error(function() gdp.tensor({ a = 1 }) end, "expected an array (keys 1..n), got the key \"a\"")
    H.expect_error(function() gdp.tensor({ 1, 2, x = 3 }) end, "got the key \"x\"")
    H.expect_error(function() gdp.tensor({ { 1 }, { 2, n = 1 } }) end, "data[2]: expected an array")
    local t = {}
    t[1] = t
    H.expect_error(function() gdp.tensor(t) end, "does the table contain itself?")
  end)

  it("integer dtypes reject NaN, fractions and values out of range", function()
    H.expect_error(function() gdp.tensor({ 0 / 0 }, { dtype = "i32" }) end, "expected an integer", "got nan")
    H.expect_error(function() gdp.tensor({ 1, 2 ^ 31 }, { dtype = "i32" }) end, "data[2]", "2147483648")
    H.expect_error(function() gdp.tensor({ 2.5 }, { dtype = "i64" }) end, "got 2.5")
    assert.are.same({ -2 ^ 31, 2 ^ 31 - 1 }, gdp.tensor({ -2 ^ 31, 2 ^ 31 - 1 }, { dtype = "i32" }):totable())
  end)
end)

describe("no hang, a clear message", function()
  it("arange to infinity", function()
    H.expect_error(function() gdp.arange(0, math.huge) end, "gdp.arange", "finite")
    H.expect_error(function() gdp.arange(0, 0 / 0) end, "gdp.arange")
  end)

  it("sizes that are not integers (inf, strings) are named, 1-based", function()
    H.expect_error(function() gdp.empty({ math.huge }) end, "size of dim 1 must be an integer >= 0, got inf")
    H.expect_error(function() gdp.empty({ 2, "3" }) end, "size of dim 2", "the string \"3\"")
  end)
end)

describe("raw FFI errors do not reach the user", function()
  it("a missing tensor method and a missing scale_ argument are named", function()
    local t = gdp.zeros({ 2 })
    H.expect_error(function() return t:mean() end, "no method or field 'mean'")
    H.expect_error(function() t:scale_() end, "alpha: expected a number, got nil")
  end)
end)

describe("nn.GatedDeltaProduct:set_parameters", function()
  it("names a parameter that is not a tensor", function()
    local m = nn.GatedDeltaProduct(cfg)
    local p = {}
    for name, t in pairs(m:parameters()) do p[name] = t end
    p.A_log = 5
    H.expect_error(function() m:set_parameters(p) end, "A_log: expected a gdp tensor, got number")
  end)
end)

describe("util.format_table", function()
  it("takes cells over 99 characters", function()
    local long = string.rep("x", 150)
    local out = require("gdp.util").format_table({ "a", "b" }, { { long, 1 } })
    assert.truthy(out:find(long, 1, true), out)
  end)
end)
