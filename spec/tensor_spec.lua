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

  it("sumsq_many: each tensor's sum of squares, the bits norm() squares", function()
    H.reseed(47)
    local list = { gdp.randn({ 7, 5 }, { dtype = "f64" }), gdp.randn({ 300 }, { dtype = "f32" }),
                   gdp.empty({ 0, 3 }, { dtype = "f32" }), gdp.randn({ 9, 4 }, { dtype = "f64" }):transpose(1, 2),
                   gdp.tensor({ 1, 0 / 0 }, { dtype = "f64" }) }
    local s = gdp.sumsq_many(list)
    assert.are.equal(#list, #s)
    for i = 1, 4 do
      local want = 0
      for _, v in ipairs(list[i]:contiguous():flat()) do want = want + v * v end
      assert.is_true(math.abs(s[i] - want) <= 1e-13 * math.max(want, 1), ("tensor %d: %g vs %g"):format(i, s[i], want))
      assert.are.equal(math.sqrt(s[i]), list[i]:norm())
    end
    assert.are.equal(0, s[3])
    assert.is_true(s[5] ~= s[5])
    assert.are.same({}, gdp.sumsq_many({}))
    H.expect_error(function() gdp.sumsq_many(list[1]) end, "list", "expected a table of tensors")
    H.expect_error(function() gdp.sumsq_many({ list[1], 3 }) end, "list[2]", "expected a gdp tensor")
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

  -- Batched products against the 2-D path run per batch entry in float64 on the cpu.
  -- a, b: operands (2-D or 3-D, any device and dtype); o: matmul's options, with
  -- out0 the values out held before the call.
  local function batched_ref(a, b, o, out0)
    local a64 = a:to({ dtype = "f64", device = "cpu" })
    local b64 = b:to({ dtype = "f64", device = "cpu" })
    local x = a64:dim() == 3 and a64 or b64
    local M = a64:size(a64:dim() - (o.trans_a and 0 or 1))
    local N = b64:size(b64:dim() - (o.trans_b and 1 or 0))
    local ref = out0 and out0:to({ dtype = "f64", device = "cpu", copy = true })
                or gdp.zeros({ x:size(1), M, N }, { dtype = "f64" })
    for i = 1, x:size(1) do
      gdp.matmul(a64:dim() == 3 and a64:select(1, i) or a64, b64:dim() == 3 and b64:select(1, i) or b64,
                 { trans_a = o.trans_a, trans_b = o.trans_b, alpha = o.alpha, beta = o.beta,
                   out = ref:select(1, i) })
    end
    return ref
  end

  -- [Bt, r, c] operands in several layouts, all views of bigger tensors: "contig", a
  -- select of a 4-D tensor ("select": batch stride 4 r c), an interleaved batch
  -- ("interleaved": [r, Bt, c] transposed, batch stride c, like [T, H, K] per head), a
  -- column-major matrix ("colmajor"), padded rows ("narrow") and no unit stride ("strided").
  local LAYOUTS = { "contig", "select", "interleaved", "colmajor", "narrow", "strided" }
  -- The shape of the bigger tensor and the view of it that is the operand.
  local function layout_of(Bt, r, c, layout)
    if layout == "contig" then return { Bt, r, c }, function(x) return x end end
    if layout == "select" then return { Bt, 4, r, c }, function(x) return x:select(2, 3) end end
    if layout == "interleaved" then
      return { 2, r, Bt, c }, function(x) return x:select(1, 2):transpose(1, 2) end
    end
    if layout == "colmajor" then return { Bt, c, r }, function(x) return x:transpose(2, 3) end end
    if layout == "narrow" then return { Bt, r, c + 3 }, function(x) return x:narrow(3, 2, c) end end
    return { Bt, r, c, 2 }, function(x) return x:select(4, 2) end
  end
  local function batched_operand(Bt, r, c, layout, opts)
    local shape, view = layout_of(Bt, r, c, layout)
    return view(gdp.randn(shape, opts))
  end

  it("batched: strided batch views, transposes, alpha and beta, against the 2-D path per entry", function()
    H.reseed(71)
    local checked = 0
    for _, dt in ipairs({ "f64", "f32" }) do
      local tol = dt == "f64" and 1e-14 or 1e-6
      for ci, case in ipairs({ { 3, 5, 7, 3 }, { 1, 1, 4, 6 }, { 4, 9, 2, 1 } }) do
        local Bt, M, K, N = case[1], case[2], case[3], case[4]
        for tr = 0, 3 do
          local ta, tb = tr % 2 == 1, tr >= 2
          for li, la in ipairs(LAYOUTS) do
            local lb, lo = LAYOUTS[li % #LAYOUTS + 1], LAYOUTS[(li + 1) % #LAYOUTS + 1]
            local o = { dtype = dt }
            local a = ta and batched_operand(Bt, K, M, la, o) or batched_operand(Bt, M, K, la, o)
            local b = tb and batched_operand(Bt, N, K, lb, o) or batched_operand(Bt, K, N, lb, o)
            local with_out = (li + tr + ci) % 2 == 0
            local opts = { trans_a = ta, trans_b = tb, alpha = with_out and 1.5 or nil }
            local out0
            if with_out then
              opts.out = batched_operand(Bt, M, N, lo, o)
              opts.beta = (li + ci) % 4 == 0 and 0 or -0.5
              if opts.beta == 0 then opts.out:fill(0 / 0) end -- beta = 0 never reads out
              out0 = opts.beta ~= 0 and opts.out:clone() or nil
            end
            local c = gdp.matmul(a, b, opts)
            if with_out then assert.are.equal(opts.out, c) end
            assert.are.same({ Bt, M, N }, c:shape())
            local what = string.format("%s Bt=%d M=%d K=%d N=%d ta=%s tb=%s a %s b %s out %s",
                                       dt, Bt, M, K, N, tostring(ta), tostring(tb), la, lb,
                                       with_out and lo or "new")
            assert.tensor_near(c:double(), batched_ref(a, b, opts, out0), tol, what)
            checked = checked + 1
          end
        end
      end
    end
    assert.are.equal(2 * 3 * 4 * #LAYOUTS, checked)
  end)

  it("batched: matches a naive product at odd sizes", function()
    local Bt, M, K, N = 3, 5, 7, 2
    local xa, xb = random_nested({ Bt, M, K }), random_nested({ Bt, K, N })
    local c = gdp.matmul(gdp.tensor(xa, { dtype = "f64" }), gdp.tensor(xb, { dtype = "f64" }))
    for i = 1, Bt do
      assert.tensor_near(c:select(1, i), gdp.tensor(naive(xa[i], xb[i]), { dtype = "f64" }), 1e-14)
    end
  end)

  it("batched: a 2-D operand is the same matrix for every batch entry", function()
    H.reseed(72)
    local a3 = batched_operand(4, 3, 5, "interleaved", { dtype = "f64" })
    local b2 = gdp.randn({ 2, 5 }, { dtype = "f64" })
    local c = gdp.matmul(a3, b2, { trans_b = true })
    assert.are.same({ 4, 3, 2 }, c:shape())
    assert.tensor_near(c, batched_ref(a3, b2, { trans_b = true }), 1e-14)
    local a2 = gdp.randn({ 5, 3 }, { dtype = "f64" })
    local b3 = batched_operand(4, 5, 6, "colmajor", { dtype = "f64" })
    local out = gdp.randn({ 4, 3, 6 }, { dtype = "f64" })
    local out0 = out:clone()
    gdp.matmul(a2, b3, { trans_a = true, out = out, alpha = 2, beta = 1 })
    assert.tensor_near(out, batched_ref(a2, b3, { trans_a = true, alpha = 2, beta = 1 }, out0), 1e-14)
  end)

  it("batched: empty batches and K = 0", function()
    local c = gdp.matmul(gdp.zeros({ 0, 3, 4 }), gdp.zeros({ 0, 4, 2 }))
    assert.are.same({ 0, 3, 2 }, c:shape())
    local out = gdp.full({ 2, 3, 2 }, 2, { dtype = "f64" })
    gdp.matmul(gdp.zeros({ 2, 3, 0 }, { dtype = "f64" }), gdp.zeros({ 2, 0, 2 }, { dtype = "f64" }),
               { out = out, beta = 0.25 })
    assert.are.equal(6, out:sum())
  end)

  it("batched: checks its arguments", function()
    local f = { dtype = "f64" }
    H.expect_error(function() return gdp.matmul(gdp.zeros({ 2, 3, 4 }, f), gdp.zeros({ 3, 4, 5 }, f)) end,
                   "gdp.matmul", "b: expected a batch of 2 (a is [2x3x4]), got [3x4x5]")
    H.expect_error(function() return gdp.matmul(gdp.zeros({ 2, 2, 3, 4 }, f), gdp.zeros({ 4, 5 }, f)) end,
                   "gdp.matmul", "expected 2-D tensors or 3-D [batch,.,.] ones, got a [2x2x3x4] and b [4x5]")
    H.expect_error(function() return gdp.matmul(gdp.zeros({ 2, 3, 4 }, f), gdp.zeros({ 2, 5, 4 }, f)) end,
                   "GDP_ERR_SHAPE", "inner dims differ: op(a) is [3x4] (a [2x3x4], trans_a 0), "
                   .. "op(b) is [5x4] (b [2x5x4], trans_b 0)")
    local a, b = gdp.zeros({ 2, 3, 4 }, f), gdp.zeros({ 2, 4, 5 }, f)
    H.expect_error(function() return gdp.matmul(a, b, { out = gdp.zeros({ 3, 3, 5 }, f) }) end,
                   "GDP_ERR_SHAPE", "a: expected a batch of 3 (out is [3x3x5]), got [2x3x4]")
    H.expect_error(function() return gdp.matmul(a, b, { out = gdp.zeros({ 2, 3, 4 }, f) }) end,
                   "GDP_ERR_SHAPE", "out: expected [2x3x5] for op(a) [2x3x4] @ op(b) [2x4x5], got [2x3x4]")
    H.expect_error(function() return gdp.matmul(a, b, { out = gdp.zeros({ 3, 5 }, f) }) end,
                   "GDP_ERR_SHAPE", "a: expected a 2-D tensor (out is 2-D; a batched product takes a 3-D out), "
                   .. "got 3 dims [2x3x4]")
    H.expect_error(function()
      return gdp.matmul(gdp.zeros({ 3, 4 }, f), gdp.zeros({ 4, 5 }, f), { out = gdp.zeros({ 2, 3, 5 }, f) })
    end, "GDP_ERR_SHAPE", "a and b: expected at least one 3-D [batch,.,.] operand (out is [2x3x5]), got a [3x4] and b [4x5]")
    H.expect_error(function() return gdp.matmul(a, b, { out = gdp.zeros({ 1, 2, 3, 5 }, f) }) end,
                   "GDP_ERR_SHAPE", "out: expected a 2-D [M,N] or 3-D [batch,M,N] tensor, got 4 dims [1x2x3x5]")
    H.expect_error(function() return gdp.matmul(a, gdp.zeros({ 2, 4, 5 }, { dtype = "f32" })) end,
                   "GDP_ERR_DTYPE", "out and b must have the same dtype, got f64 and f32")
    local big = gdp.zeros({ 2, 4, 5 }, f)
    H.expect_error(function() return gdp.matmul(a, big, { out = big:narrow(3, 1, 5):narrow(2, 1, 3) }) end,
                   "GDP_ERR_INVALID_ARG", "out must not alias b")
    H.assert_alive()
  end)

  -- The same batched inputs, in the same layouts, on cuda (one strided-batched cuBLAS
  -- call, or a copy first where cuBLAS cannot read the layout) and on the cpu.
  it("batched on cuda matches the cpu #gpu", function()
    if not H.need_device("cuda") then return end
    H.reseed(73)
    -- the operand on the cpu and the same view of a device copy of its base
    local function pair(Bt, r, c, layout, dt)
      local shape, view = layout_of(Bt, r, c, layout)
      local base = gdp.randn(shape, { dtype = dt })
      return view(base), view(base:cuda())
    end
    local Bt, M, K, N = 5, 37, 29, 17
    for _, dt in ipairs({ "f64", "f32" }) do
      local tol = dt == "f64" and 1e-12 or 1e-5
      for tr = 0, 3 do
        local ta, tb = tr % 2 == 1, tr >= 2
        for li, la in ipairs(LAYOUTS) do
          local lb, lo = LAYOUTS[li % #LAYOUTS + 1], LAYOUTS[(li + 1) % #LAYOUTS + 1]
          local a, da = pair(Bt, ta and K or M, ta and M or K, la, dt)
          local b, db = pair(Bt, tb and N or K, tb and K or N, lb, dt)
          local out, dout = pair(Bt, M, N, lo, dt)
          local beta = (tr + li) % 2 == 0 and 0.5 or 0
          if beta == 0 then dout:fill(0 / 0) end -- beta = 0 never reads out
          local want = batched_ref(a, b, { trans_a = ta, trans_b = tb, alpha = 0.75, beta = beta }, out)
          gdp.matmul(a, b, { trans_a = ta, trans_b = tb, alpha = 0.75, beta = beta, out = out })
          gdp.matmul(da, db, { trans_a = ta, trans_b = tb, alpha = 0.75, beta = beta, out = dout })
          local what = string.format("%s ta=%s tb=%s a %s b %s out %s", dt, tostring(ta), tostring(tb),
                                     la, lb, lo)
          assert.tensor_near(dout:cpu(), out, tol, what .. " (cuda vs cpu)")
          assert.tensor_near(dout:cpu():double(), want, tol, what .. " (cuda vs float64)")
        end
      end
    end
    -- bf16 operands, float32 accumulation, into float32 and bf16 results; against
    -- float64 products of the same bf16 values
    for _, odt in ipairs({ "f32", "bf16" }) do
      local a = gdp.randn({ 2, M, Bt, K }, { dtype = "bf16", device = "cuda" }):select(1, 2):transpose(1, 2)
      local b = gdp.randn({ Bt, N, K }, { dtype = "bf16", device = "cuda" })
      local out = gdp.empty({ Bt, M, N }, { dtype = odt, device = "cuda" })
      gdp.matmul(a, b, { trans_b = true, out = out })
      assert.tensor_near(out:cpu():double(), batched_ref(a, b, { trans_b = true }),
                         odt == "f32" and 1e-5 or 4e-3, "bf16 into " .. odt)
    end
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
