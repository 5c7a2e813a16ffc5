-- safetensors save/load through the bindings: round trips of every dtype, views,
-- odd shapes, metadata; truncated and damaged files fail cleanly.
local gdp = require("gdp")
local H = gdp_test

local function read_all(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function write_all(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

describe("safetensors", function()
  local tmp
  before_each(function()
    tmp = os.tmpname()
    H.reseed(21)
  end)
  after_each(function() os.remove(tmp) end)

  it("round-trips tensors of every dtype and odd shapes, and views", function()
    local base = gdp.randn({ 3, 5, 7 }, { dtype = "f64" })
    local tensors = {
      a_f64 = base,
      b_f32 = gdp.randn({ 1, 9 }, { dtype = "f32" }),
      c_bf16 = gdp.randn({ 4, 3 }, { dtype = "bf16" }),
      d_i32 = gdp.tensor({ -5, 0, 2147483647 }, { dtype = "i32" }),
      e_i64 = gdp.tensor({ 0, 3, 3, 2 ^ 40 }, { dtype = "i64" }),
      f_scalar = gdp.tensor(1.25, { dtype = "f64" }),
      g_empty = gdp.zeros({ 0, 4 }, { dtype = "f32" }),
      h_view = base:transpose(1, 3):narrow(2, 2, 3), -- non-contiguous
    }
    gdp.save(tmp, tensors)
    local loaded, meta, names = gdp.load(tmp)
    assert.are.same({}, meta)
    local expected_names = {}
    for name in pairs(tensors) do expected_names[#expected_names + 1] = name end
    table.sort(expected_names)
    local got_names = {}
    for i, name in ipairs(names) do got_names[i] = name end
    table.sort(got_names)
    assert.are.same(expected_names, got_names)
    for name, t in pairs(tensors) do
      local l = loaded[name]
      assert.are.equal(t:dtype(), l:dtype(), name)
      assert.are.same(t:shape(), l:shape(), name)
      assert.is_true(l:is_contiguous(), name)
      assert.are.same(t:totable(), l:totable(), name) -- bit-exact
    end
  end)

  it("round-trips metadata", function()
    local meta = { num_householder = 3, scale = 0.1767766952966369, gated = true,
                   note = 'quotes " and \\ and unicode \u{00e9} and , commas' }
    gdp.save(tmp, { x = gdp.zeros(2) }, meta)
    local _, got = gdp.load(tmp)
    assert.are.same({ num_householder = "3", scale = "0.1767766952966369", gated = "true",
                      note = meta.note }, got)
    assert.are.equal(0.1767766952966369, tonumber(got.scale))
  end)

  it("saves what it loads (an empty metadata key) and refuses NUL rather than cutting it", function()
    gdp.save(tmp, { x = gdp.zeros(2) }, { [""] = "empty key" })
    local _, got = gdp.load(tmp)
    assert.are.same({ [""] = "empty key" }, got)
    assert.has_error(function() gdp.save(tmp, { ["a\0b"] = gdp.zeros(2) }) end)
    assert.has_error(function() gdp.save(tmp, { x = gdp.zeros(2) }, { k = "x\0y" }) end)
    assert.has_error(function() gdp.save(tmp, { x = gdp.zeros(2) }, { ["k\0"] = "v" }) end)
    local ok, err = pcall(gdp.save, tmp, { x = gdp.zeros(2) }, { k = "x\0y" })
    assert.is_false(ok)
    assert.matches("NUL", tostring(err))
  end)

  it("writes the same bytes for the same tensors", function()
    local t = { q = gdp.randn({ 2, 3 }, { dtype = "f64" }), k = gdp.randn({ 4 }, { dtype = "f32" }) }
    gdp.save(tmp, t, { a = "1" })
    local first = read_all(tmp)
    gdp.save(tmp, t, { a = "1" })
    assert.are.equal(first, read_all(tmp))
  end)

  it("reads the golden files' layout: names, dtypes and metadata", function()
    local files = H.list_files(H.golden_dir, "^gdp_.*%.safetensors$")
    if #files == 0 then
      pending("no golden fixtures in " .. H.golden_dir)
      return
    end
    local t, meta = gdp.load(files[1])
    assert.is_not_nil(t.q)
    assert.are.equal("f64", t.q:dtype())
    assert.is_not_nil(tonumber(meta.num_householder))
  end)

  it("fails cleanly on every truncation and on damaged headers", function()
    gdp.save(tmp, { x = gdp.randn({ 3, 4 }, { dtype = "f32" }), y = gdp.randn({ 5 }, { dtype = "f64" }) },
             { k = "v" })
    local good = read_all(tmp)
    local header_len = good:byte(1) + 256 * good:byte(2)
    local cuts = { 0, 4, 8, 9, 8 + header_len - 1, 8 + header_len, #good - 1 }
    for _, cut in ipairs(cuts) do
      write_all(tmp, good:sub(1, cut))
      local _, err = H.expect_error(function() return gdp.load(tmp) end, "gdp.load")
      assert.is_true(gdp.is_error(err), "cut " .. cut .. ": " .. tostring(err))
      assert.are.equal("GDP_ERR_IO", err.name, "cut " .. cut .. ": " .. tostring(err))
    end
    -- damage the JSON: replace the first '{' of the header
    write_all(tmp, good:sub(1, 8) .. "[" .. good:sub(10))
    H.expect_error(function() return gdp.load(tmp) end, "GDP_ERR_IO")
    -- an unknown dtype
    local damaged = good:gsub('"F32"', '"F8X"', 1)
    write_all(tmp, damaged)
    local _, err = H.expect_error(function() return gdp.load(tmp) end, "gdp.load")
    assert.truthy(err.name == "GDP_ERR_UNSUPPORTED" or err.name == "GDP_ERR_IO", tostring(err))
    H.assert_alive()
  end)
end)
