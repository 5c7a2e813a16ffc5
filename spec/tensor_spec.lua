-- Tensors through the Lua bindings: creation, views, conversions, printing, table
-- round trips, arithmetic, reductions, matmul, free and GC.
local gdp = require("gdp")
local H = gdp_test

-- Deterministic host values (independent of the library's RNG).
local lcg_state = 12345
local function host_random()
  lcg_state = (lcg_state * 1103515245 + 12345) % 2147483648
  return lcg_state / 2147483648 * 2 - 1
end

local function random_nested(shape, d)
  d = d or 1
  local out = {}
  for i = 1, shape[d] do
    out[i] = d == #shape and host_random() or random_nested(shape, d + 1)
  end
  return out
end

local function flatten(x, out)
  out = out or {}
  if type(x) == "table" then
    for _, v in ipairs(x) do flatten(v, out) end
  else
    out[#out + 1] = x
  end
  return out
end

local function assert_values(t, expected, tol)
  local got = t:flat()
  local want = flatten(expected)
  assert.are.equal(#want, #got)
  for i = 1, #want do
    assert.is_true(math.abs(got[i] - want[i]) <= (tol or 0),
                   string.format("element %d: got %.17g, want %.17g", i, got[i], want[i]))
  end
end

describe("tensor creation", function()
  before_each(function() H.reseed(1) end)

  it("makes tensors from nested tables, flat tables with a shape, and numbers", function()
    local t = gdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = "f64" })
    assert.are.same({ 2, 3 }, t:shape())
    assert.are.equal("f64", t:dtype())
    assert.are.equal("cpu", t:device())
    assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, t:totable())
    local u = gdp.tensor({ 1, 2, 3, 4, 5, 6 }, { 3, 2 }, { dtype = "i64" })
    assert.are.same({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, u:totable())
    local s = gdp.tensor(2.5, { dtype = "f64" })
    assert.are.equal(0, s:dim())
    assert.are.equal(1, s:numel())
    assert.are.equal(2.5, s:totable())
    assert.are.equal(2.5, s:get())
  end)

  it("uses f32 by default and honours set_default_dtype", function()
    assert.are.equal("f32", gdp.tensor({ 1 }):dtype())
    gdp.set_default_dtype("f64")
    assert.are.equal("f64", gdp.zeros(2):dtype())
    gdp.set_default_dtype("f32")
    assert.are.equal("f32", gdp.zeros(2):dtype())
  end)

  it("makes empty/zeros/ones/full of every dtype, with sizes as varargs or a table", function()
    for _, dt in ipairs({ "f64", "f32", "bf16", "i32", "i64" }) do
      local z = gdp.zeros(3, 5, { dtype = dt })
      assert.are.same({ 3, 5 }, z:shape())
      assert.are.equal(dt, z:dtype())
      assert.are.equal(0, z:sum())
      local o = gdp.ones({ 2, 7 }, { dtype = dt })
      assert.are.equal(14, o:sum())
      local f = gdp.full({ 4 }, 3, { dtype = dt })
      assert.are.same({ 3, 3, 3, 3 }, f:totable())
      assert.are.same({ 1, 2 }, gdp.empty({ 1, 2 }, { dtype = dt }):shape())
    end
    assert.are.same({ 0, 4 }, gdp.zeros({ 0, 4 }):shape())
    assert.are.equal(0, gdp.zeros({ 0, 4 }):numel())
  end)

  it("draws rand in [0, 1) and randn with mean 0 and std 1, reproducibly per seed", function()
    local r = gdp.rand({ 1000 }, { dtype = "f64" })
    local v = r:flat()
    for i = 1, #v do assert.is_true(v[i] >= 0 and v[i] < 1) end
    local n = gdp.randn({ 20000 }, { dtype = "f64" })
    local mean = n:sum() / 20000
    local std = math.sqrt(n:dot(n) / 20000 - mean * mean)
    assert.is_true(math.abs(mean) < 0.05, "mean " .. mean)
    assert.is_true(math.abs(std - 1) < 0.05, "std " .. std)
    gdp.manual_seed(77)
    local a = gdp.randn({ 5, 3 }, { dtype = "f64" }):flat()
    gdp.manual_seed(77)
    local b = gdp.randn({ 5, 3 }, { dtype = "f64" }):flat()
    gdp.manual_seed(78)
    local c = gdp.randn({ 5, 3 }, { dtype = "f64" }):flat()
    assert.are.same(a, b)
    assert.are_not.same(a, c)
  end)

  it("rejects ragged nested tables, also when the first row is empty", function()
    -- the shape is read along the first entries: {{}, {1, 2}} looks like [2x0]
    assert.has_error(function() gdp.tensor({ {}, { 1, 2 } }) end)
    assert.has_error(function() gdp.tensor({ { {} }, { { 3 } } }) end)
    assert.are.same({ 2, 0 }, gdp.tensor({ {}, {} }):shape())
    assert.are.same({ 0 }, gdp.tensor({}):shape())
  end)

  it("makes aranges", function()
    assert.are.same({ 0, 1, 2, 3 }, gdp.arange(4, { dtype = "f64" }):totable())
    assert.are.same({ 2, 4, 6 }, gdp.arange(2, 8, 2, { dtype = "i64" }):totable())
  end)
end)

describe("tensor metadata", function()
  it("reports shape, size, dim, numel, #, stride and contiguity (1-based dims)", function()
    local t = gdp.zeros(2, 3, 5)
    assert.are.same({ 2, 3, 5 }, t:shape())
    assert.are.same({ 2, 3, 5 }, t:size())
    assert.are.equal(3, t:size(2))
    assert.are.equal(5, t:size(-1))
    assert.are.equal(3, t:dim())
    assert.are.equal(30, t:numel())
    assert.are.equal(2, #t)
    assert.are.same({ 15, 5, 1 }, t:stride())
    assert.are.equal(5, t:stride(2))
    assert.is_true(t:is_contiguous())
    assert.is_false(t:is_view())
    assert.is_false(t:transpose(1, 3):is_contiguous())
  end)
end)

describe("write versions", function()
  it("every write through gdp's API raises the storage's count, reads do not", function()
    local base = gdp.zeros({ 4, 6 })
    local t = base:narrow(1, 2, 2)
    local v = base:version()
    assert.are.equal(v, t:version())
    local writes = {
      function() t:fill(1) end,
      function() t:zero() end,
      function() t:copy(gdp.ones({ 2, 6 })) end,
      function() t:set(7, 1, 2) end,
      function() t:uniform_() end,
      function() t:normal_() end,
      function() t:add_(gdp.ones({ 2, 6 })) end,
      function() t:mul_(2) end,
      function() t:mul_(gdp.ones({ 2, 6 })) end,
      function() t:scale_(0.5) end,
      function() t:transpose(1, 2):fill(3) end,
    }
    for i, write in ipairs(writes) do
      write()
      assert.is_true(base:version() > v, "write " .. i)
      assert.are.equal(base:version(), t:version(), "write " .. i)
      v = base:version()
    end
    local reads = { t:sum(), t:norm(), t:clone(), t:contiguous(), t:add(1), t:mul(t), t:totable(),
                    t:get(1, 1), t:transpose(1, 2):contiguous(), t:to({ dtype = "f64" }) }
    assert.are.equal(v, base:version(), "reads and allocating ops")
    assert.are.equal(#reads, 10)
    assert.are.equal(0, t:clone():version())
  end)
end)

describe("views", function()
  local t
  before_each(function()
    t = gdp.tensor(random_nested({ 4, 3, 5 }), { dtype = "f64" })
  end)

  it("share storage with their base", function()
    local v = t:view(12, 5)
    assert.is_true(v:is_view())
    v:set(42, 2, 3)
    assert.are.equal(42, t:get(1, 2, 3))
    local n = t:narrow(3, 2, 2)
    n:fill(-1)
    assert.are.equal(-1, t:get(4, 3, 3))
    assert.are.equal(-1, t:get(1, 1, 2))
    assert.are_not.equal(-1, t:get(1, 1, 1))
    assert.are_not.equal(-1, t:get(1, 1, 4))
  end)

  it("narrow, select, transpose and permute pick the right elements", function()
    local x = t:totable()
    local n = t:narrow(1, 2, 2)
    assert.are.same({ 2, 3, 5 }, n:shape())
    assert.are.same({ x[2], x[3] }, n:totable())
    local s = t:select(2, 3)
    assert.are.same({ 4, 5 }, s:shape())
    for i = 1, 4 do for k = 1, 5 do assert.are.equal(x[i][3][k], s:get(i, k)) end end
    local tr = t:transpose(1, 3)
    assert.are.same({ 5, 3, 4 }, tr:shape())
    local p = t:permute(3, 1, 2)
    assert.are.same({ 5, 4, 3 }, p:shape())
    for i = 1, 4 do for j = 1, 3 do for k = 1, 5 do
      assert.are.equal(x[i][j][k], tr:get(k, j, i))
      assert.are.equal(x[i][j][k], p:get(k, i, j))
    end end end
    local c = p:contiguous()
    assert.is_true(c:is_contiguous())
    assert.are.same(p:totable(), c:totable())
  end)

  it("reshape copies when a view cannot express it; view refuses", function()
    local tr = t:transpose(1, 2)
    local ok = pcall(function() return tr:view(60) end)
    assert.is_false(ok)
    local r = tr:reshape(-1)
    assert.are.same({ 60 }, r:shape())
    assert.are.same(flatten(tr:totable()), r:totable())
  end)

  it("clone is an independent copy", function()
    local c = t:clone()
    c:fill(0)
    assert.are_not.equal(0, t:norm())
    assert.are.equal(0, c:norm())
  end)
end)

describe("conversions", function()
  it("round-trip values through dtypes", function()
    local vals = random_nested({ 3, 7 })
    local d = gdp.tensor(vals, { dtype = "f64" })
    assert_values(d:float():double(), vals, 1e-7)
    assert_values(d:bf16():double(), vals, 1e-2)
    local ints = gdp.tensor({ -3, 0, 7, 2147483647 }, { dtype = "f64" })
    assert.are.same({ -3, 0, 7, 2147483647 }, ints:to("i32"):totable())
    assert.are.same({ -3, 0, 7, 2147483647 }, ints:to("i64"):totable())
    assert.are.equal("i64", gdp.tensor({ 2 ^ 40 }, { dtype = "i64" }):dtype())
    assert.are.same({ 2 ^ 40 }, gdp.tensor({ 2 ^ 40 }, { dtype = "i64" }):totable())
  end)

  it("to an integer dtype: NaN, inf and out-of-range values are errors naming the value", function()
    local function fails(t, dt, needle)
      local ok, err = pcall(t.to, t, dt)
      assert.is_false(ok, "converting to " .. dt .. " should fail")
      assert.matches("convert", tostring(err))
      assert.matches(needle, tostring(err), 1, true)
    end
    for _, src in ipairs({ "f64", "f32", "bf16" }) do
      for _, dt in ipairs({ "i32", "i64" }) do
        fails(gdp.tensor({ 1, 0 / 0, 2 }, { dtype = src }), dt, "element 2")
        fails(gdp.tensor({ 1, 2, math.huge }, { dtype = src }), dt, "inf")
        fails(gdp.tensor({ -math.huge }, { dtype = src }), dt, "-inf")
      end
    end
    fails(gdp.tensor({ 0, 2 ^ 31 }, { dtype = "f64" }), "i32", "2147483648")
    fails(gdp.tensor({ -2 ^ 31 - 1 }, { dtype = "f64" }), "i32", "-2147483649")
    fails(gdp.tensor({ 2 ^ 63 }, { dtype = "f64" }), "i64", "9.2233720368547758e+18")
    fails(gdp.tensor({ 2 ^ 40 }, { dtype = "i64" }), "i32", "1099511627776")
    -- strided sources report the row-major position
    fails(gdp.tensor({ { 1, 2 }, { 0 / 0, 4 } }, { dtype = "f32" }):transpose(1, 2), "i32", "element 2")
    -- the edges that do have a value truncate toward zero
    assert.are.same({ 2147483647, -2147483648, -2 },
                    gdp.tensor({ 2147483647.9, -2147483648.9, -2.7 }, { dtype = "f64" }):to("i32"):totable())
    assert.has_error(function() gdp.full({ 2 }, 0 / 0, { dtype = "i32" }) end)
    assert.has_error(function() gdp.full({ 2 }, 2 ^ 31, { dtype = "i32" }) end)
    -- elementwise results stored into integer tensors follow the same rule
    local big = gdp.tensor({ 1, 2 ^ 30 }, { dtype = "i32" })
    local ok, err = pcall(function() return big + big end)
    assert.is_false(ok)
    assert.matches("element 2 (row-major, counting from 1) is 2147483648", tostring(err), 1, true)
    assert.has_error(function() gdp.tensor({ 1, 2 }, { dtype = "i64" }):scale_(0 / 0) end)
    assert.are.same({ 2, 2 ^ 31 - 2 }, (gdp.tensor({ 1, 2 ^ 30 - 1 }, { dtype = "i32" }) * 2):totable())
  end)

  it("to an integer dtype on cuda: NaN, inf and out-of-range values are errors, as on the cpu #gpu", function()
    if not H.need_device("cuda") then return end
    local function fails(values, src, dt, element)
      local t = gdp.tensor(values, { dtype = src }):cuda()
      local ok, err = pcall(t.to, t, dt)
      assert.is_false(ok, "converting " .. src .. " to " .. dt .. " on cuda should fail")
      assert.matches("no value in " .. dt, tostring(err), 1, true)
      assert.matches(element, tostring(err), 1, true)
    end
    for _, src in ipairs({ "f64", "f32", "bf16" }) do
      for _, dt in ipairs({ "i32", "i64" }) do
        fails({ 1, 0 / 0, 2 }, src, dt, "element 2")
        fails({ 1, 2, math.huge }, src, dt, "element 3")
        fails({ -math.huge }, src, dt, "element 1")
      end
    end
    fails({ 0, 2 ^ 31 }, "f64", "i32", "element 2")
    fails({ 2 ^ 63 }, "f64", "i64", "element 1")
    fails({ 2 ^ 40 }, "i64", "i32", "element 1")
    -- strided sources report the row-major position; the lowest bad element wins
    local t = gdp.tensor({ { 1, 0 / 0 }, { 0 / 0, 4 } }, { dtype = "f32" }):cuda():transpose(1, 2)
    local ok, err = pcall(t.to, t, "i32")
    assert.is_false(ok)
    assert.matches("element 2", tostring(err), 1, true)
    -- values that fit convert as on the cpu; the device is usable after an error
    assert.are.same({ 2147483647, -2147483648, -2 },
                    gdp.tensor({ 2147483647.9, -2147483648.9, -2.7 }, { dtype = "f64" }):cuda():to("i32"):totable())
    assert.has_error(function() gdp.full({ 2 }, 0 / 0, { dtype = "i32", device = "cuda" }) end)
    local big = gdp.tensor({ 1, 2 ^ 30 }, { dtype = "i32" }):cuda()
    local ok2, err2 = pcall(function() return big + big end)
    assert.is_false(ok2)
    assert.matches("element 2 (row-major, counting from 1) has no value in i32", tostring(err2), 1, true)
    assert.are.same({ 2, 2 ^ 31 - 2 }, (gdp.tensor({ 1, 2 ^ 30 - 1 }, { dtype = "i32" }):cuda() * 2):totable())
  end)

  it("rounds bf16 to nearest even", function()
    -- 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
    local t = gdp.tensor({ 1 + 2 ^ -8, 1 + 3 * 2 ^ -8, 1 + 2 ^ -7 }, { dtype = "f64" })
    assert.are.same({ 1, 1 + 2 ^ -6, 1 + 2 ^ -7 }, t:bf16():totable())
  end)

  it("to() returns the tensor itself when nothing changes, a copy with copy = true", function()
    local t = gdp.zeros(3, { dtype = "f32" })
    assert.are.equal(t, t:to("f32"))
    assert.are.equal(t, t:to("cpu"))
    local c = t:to({ dtype = "f32", copy = true })
    assert.are_not.equal(t, c)
    c:fill(1)
    assert.are.equal(0, t:sum())
    assert.are.equal("f64", t:to({ dtype = "float64" }):dtype())
  end)

  it("copy() converts dtypes and honours strides", function()
    local src = gdp.tensor(random_nested({ 3, 4 }), { dtype = "f64" })
    local dst = gdp.zeros(4, 3, { dtype = "f32" })
    dst:copy(src:transpose(1, 2))
    assert.tensor_near(dst:double(), src:transpose(1, 2):contiguous(), 1e-7)
  end)
end)

describe("table round trips", function()
  it("totable(tensor(x)) == x for odd shapes", function()
    for _, shape in ipairs({ { 1 }, { 7 }, { 3, 1 }, { 2, 3, 5 }, { 1, 4, 1, 3 } }) do
      local x = random_nested(shape)
      local t = gdp.tensor(x, { dtype = "f64" })
      assert.are.same(shape, t:shape())
      assert.are.same(x, t:totable())
      assert.are.same(flatten(x), t:flat())
    end
  end)

  it("get/set use 1-based indices", function()
    local t = gdp.zeros(2, 3, { dtype = "f64" })
    t:set(5, 2, 3)
    assert.are.equal(5, t:get(2, 3))
    assert.are.same({ { 0, 0, 0 }, { 0, 0, 5 } }, t:totable())
    H.expect_error(function() return t:get(0, 1) end, "gdp.get", "index 1", "[1, 2]", "got 0")
    H.expect_error(function() return t:get(1, 4) end, "index 2", "[1, 3]", "got 4")
    H.expect_error(function() return t:get(1) end, "expected 2 indices")
  end)
end)

describe("printing", function()
  it("shows dtype, device, shape and view, then values", function()
    local t = gdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = "f64" })
    local s = tostring(t)
    assert.are.equal("gdp.Tensor<f64, cpu>[2x3]", s:match("^[^\n]*"))
    assert.truthy(s:find(" 1 2 3\n 4 5 6", 1, true))
    assert.are.equal("gdp.Tensor<f64, cpu>[3x2] view", tostring(t:transpose(1, 2)):match("^[^\n]*"))
    assert.are.equal("gdp.Tensor<f32, cpu>[0x4]", tostring(gdp.zeros(0, 4)))
    assert.truthy(tostring(gdp.tensor({ 0.5, -1.25 }, { dtype = "f64" })):find("0.5000 -1.2500", 1, true))
  end)

  it("elides large tensors", function()
    local s = tostring(gdp.arange(5000, { dtype = "f64" }):view(50, 100))
    assert.truthy(s:find("...", 1, true))
    assert.truthy(s:find("4999", 1, true))
    assert.is_nil(s:find("2500", 1, true))
    local lines = 0
    for _ in s:gmatch("\n") do lines = lines + 1 end
    assert.is_true(lines < 12)
  end)

  it("prints nan and inf", function()
    local t = gdp.tensor({ 0 / 0, math.huge, -math.huge, 1.5 }, { dtype = "f64" })
    local s = tostring(t)
    assert.truthy(s:find("nan", 1, true))
    assert.truthy(s:find("-inf", 1, true))
  end)
end)

describe("arithmetic", function()
  local a, b, xa, xb
  before_each(function()
    xa, xb = random_nested({ 3, 5 }), random_nested({ 3, 5 })
    a, b = gdp.tensor(xa, { dtype = "f64" }), gdp.tensor(xb, { dtype = "f64" })
  end)

  local function map2(x, y, f)
    local out = {}
    for i = 1, #x do
      out[i] = {}
      for j = 1, #x[i] do out[i][j] = f(x[i][j], y and y[i][j]) end
    end
    return out
  end

  it("updates in place from a view of itself in another layout (t:add_(t^T), shifted copy)", function()
    local n = 20 + math.random(0, 9)
    local t = gdp.randn({ n, n }, { dtype = "f64" })
    local x = t:totable()
    t:add_(t:transpose(1, 2))
    local bad = 0
    for i = 1, n do
      for j = 1, n do
        if t:get(i, j) ~= x[i][j] + x[j][i] then bad = bad + 1 end
      end
    end
    assert.are.equal(0, bad)
    local u = gdp.randn({ n, 3 }, { dtype = "f64" })
    local y = u:totable()
    local ut = u:transpose(1, 2)
    ut:narrow(2, 2, n - 1):copy(ut:narrow(2, 1, n - 1))
    bad = 0
    for i = 2, n do
      for j = 1, 3 do
        if u:get(i, j) ~= y[i - 1][j] then bad = bad + 1 end
      end
    end
    assert.are.equal(0, bad)
  end)

  it("adds, subtracts, multiplies and divides tensors and numbers", function()
    assert_values(a + b, map2(xa, xb, function(p, q) return p + q end), 1e-15)
    assert_values(a - b, map2(xa, xb, function(p, q) return p - q end), 1e-15)
    assert_values(a * b, map2(xa, xb, function(p, q) return p * q end), 1e-15)
    assert_values(a * 3, map2(xa, nil, function(p) return 3 * p end), 1e-15)
    assert_values(3 * a, map2(xa, nil, function(p) return 3 * p end), 1e-15)
    assert_values(a + 2, map2(xa, nil, function(p) return p + 2 end), 1e-15)
    assert_values(2 + a, map2(xa, nil, function(p) return p + 2 end), 1e-15)
    assert_values(a - 2, map2(xa, nil, function(p) return p - 2 end), 1e-15)
    assert_values(2 - a, map2(xa, nil, function(p) return 2 - p end), 1e-15)
    assert_values(a / 4, map2(xa, nil, function(p) return p / 4 end), 1e-15)
    assert_values(-a, map2(xa, nil, function(p) return -p end), 0)
    -- the operands are unchanged
    assert.are.same(xa, a:totable())
  end)

  it("works in place and on views", function()
    local c = a:clone()
    c:add_(b, 2)
    assert_values(c, map2(xa, xb, function(p, q) return p + 2 * q end), 1e-15)
    c = a:clone():mul_(b)
    assert_values(c, map2(xa, xb, function(p, q) return p * q end), 1e-15)
    local at = a:transpose(1, 2)
    local s = at + at
    assert.are.same({ 5, 3 }, s:shape())
    assert_values(s:transpose(1, 2), map2(xa, nil, function(p) return 2 * p end), 1e-15)
  end)

  it("rejects mismatched shapes and division by tensors", function()
    H.expect_error(function() return a + gdp.zeros(5, 3, { dtype = "f64" }) end, "GDP_ERR_SHAPE")
    H.expect_error(function() return a / b end, "gdp.div", "only division by a number")
    H.assert_alive()
  end)

  it("does not overload ==", function()
    assert.is_false(a == a:clone())
    assert.is_true(a == a)
  end)
end)

describe("reductions", function()
  it("sum, dot, norm, max_abs, count_nonfinite, rel_error", function()
    local x = { 3, -4, 1.5, 0.25 }
    local t = gdp.tensor(x, { dtype = "f64" })
    assert.are.equal(0.75, t:sum())
    assert.are.equal(9 + 16 + 2.25 + 0.0625, t:dot(t))
    assert.is_true(math.abs(t:norm() - math.sqrt(27.3125)) < 1e-14)
    assert.are.equal(4, t:max_abs())
    assert.are.equal(0, t:count_nonfinite())
    local bad = gdp.tensor({ 1, 0 / 0, math.huge, 2 }, { dtype = "f32" })
    assert.are.equal(2, bad:count_nonfinite())
    local ref = gdp.tensor({ 3, 4 }, { dtype = "f64" })
    local near = gdp.tensor({ 3, 4.5 }, { dtype = "f64" })
    assert.is_true(math.abs(gdp.rel_error(near, ref) - 0.1) < 1e-15)
    local nan = gdp.tensor({ 0 / 0, 4 }, { dtype = "f64" })
    local e = gdp.rel_error(nan, ref)
    assert.is_true(e ~= e)
    assert.has_error(function() assert.tensor_near(nan, ref, 1) end)
    assert.tensor_near(near, ref, 0.11)
    assert.has_error(function() assert.tensor_near(near, ref, 0.09) end)
  end)
end)

describe("matmul", function()
  local function naive(a, b, ta, tb)
    local M = ta and #a[1] or #a
    local K = ta and #a or #a[1]
    local N = tb and #b or #b[1]
    local out = {}
    for i = 1, M do
      out[i] = {}
      for j = 1, N do
        local s = 0
        for k = 1, K do
          s = s + (ta and a[k][i] or a[i][k]) * (tb and b[j][k] or b[k][j])
        end
        out[i][j] = s
      end
    end
    return out
  end

  it("matches a naive product at odd sizes, with transposes", function()
    for _, case in ipairs({ { 5, 7, 3, false, false }, { 1, 9, 4, true, false },
                            { 6, 2, 11, false, true }, { 3, 3, 3, true, true } }) do
      local M, K, N, ta, tb = case[1], case[2], case[3], case[4], case[5]
      local xa = random_nested(ta and { K, M } or { M, K })
      local xb = random_nested(tb and { N, K } or { K, N })
      for _, dt in ipairs({ "f64", "f32" }) do
        local a, b = gdp.tensor(xa, { dtype = dt }), gdp.tensor(xb, { dtype = dt })
        local c = gdp.matmul(a, b, { trans_a = ta, trans_b = tb })
        assert.are.same({ M, N }, c:shape())
        assert.tensor_near(c:double(), gdp.tensor(naive(xa, xb, ta, tb), { dtype = "f64" }),
                           dt == "f64" and 1e-14 or 1e-6)
      end
    end
  end)

  it("checks its arguments", function()
    H.expect_error(function() return gdp.matmul(gdp.zeros(2, 3), gdp.zeros(4, 2)) end, "GDP_ERR_SHAPE")
    H.expect_error(function() return gdp.matmul(gdp.zeros(2), gdp.zeros(2, 2)) end,
                   "gdp.matmul", "expected 2-D tensors")
    H.expect_error(function() return gdp.matmul(gdp.zeros(2, 2), nil) end, "b: expected a gdp tensor")
    H.assert_alive()
  end)
end)

describe("free and GC", function()
  it("free is idempotent and later use raises a clear error", function()
    local t = gdp.zeros(4, { dtype = "f64" })
    t:free()
    t:free()
    assert.is_true(t:is_freed())
    H.expect_error(function() return t:numel() end, "gdp.numel", "freed")
    H.expect_error(function() return t + 1 end, "freed")
    H.expect_error(function() return gdp.zeros(4, { dtype = "f64" }):copy(t) end, "src", "freed")
    assert.are.equal("gdp.Tensor<freed>", tostring(t))
    H.assert_alive()
  end)

  it("a view outlives its freed base", function()
    local base = gdp.tensor({ 1, 2, 3, 4 }, { dtype = "f64" })
    local v = base:narrow(1, 2, 2)
    base:free()
    collectgarbage("collect")
    assert.are.same({ 2, 3 }, v:totable())
  end)

  it("returns memory to the library when tensors are collected", function()
    collectgarbage("collect")
    collectgarbage("collect")
    local before = gdp.memory_live_bytes("cpu")
    do
      local keep = {}
      for i = 1, 10 do keep[i] = gdp.zeros(1000, { dtype = "f64" }) end
      assert.is_true(gdp.memory_live_bytes("cpu") >= before + 80000)
    end
    collectgarbage("collect")
    collectgarbage("collect")
    assert.are.equal(before, gdp.memory_live_bytes("cpu"))
  end)

  it("collects garbage tensors when live memory passes the soft limit", function()
    collectgarbage("collect")
    local before = gdp.memory_live_bytes("cpu")
    gdp.set_memory_soft_limit("cpu", before + 4 * 1024 * 1024)
    collectgarbage("stop") -- only the soft limit may collect now
    local peak = 0
    for _ = 1, 64 do
      local _ = gdp.zeros(128 * 1024, { dtype = "f64" }) -- 1 MiB of garbage each
      peak = math.max(peak, gdp.memory_live_bytes("cpu") - before)
    end
    collectgarbage("restart")
    gdp.set_memory_soft_limit("cpu", 1024 * 1024 * 1024)
    assert.is_true(peak <= 6 * 1024 * 1024, "peak live bytes above base: " .. peak)
  end)
end)
