-- The mixer ops' case table (op_cases.lua: conv1d + SiLU, SiLU, the beta and decay gates,
-- gated RMSNorm, the D skip, repeat_heads) on every device: each result in each dtype
-- against the float64 cpu run of the same case, within ops.TOLERANCE.  A device whose
-- backend has no mixer kernels yet answers GDP_ERR_UNSUPPORTED: its cases are pending,
-- with that reason.  cuda parts are tagged #gpu; there the cases run in f32 and bf16
-- (the cuda kernels' I/O dtypes), plus larger cases sized to cross the cuda kernels'
-- tiles: several channel tiles and token chunks of the conv backward, several row
-- chunks of the two-pass parameter-gradient sums, norm groups wider than a block.
local gdp = require("gdp")
local F = require("gdp.nn.functional")
local H = gdp_test
local cases = require("op_cases")

local function randn(shape) return gdp.randn(shape, { dtype = "f64" }) end
local function uniform(shape, lo, hi) return gdp.empty(shape, { dtype = "f64" }):uniform_(lo, hi) end

-- o.pad = {before, after}: x is a channel slice of wider rows (the layer's xBC inside the
-- in_proj output), read in place, and dx is written into the same slice of a new tensor
-- of x's shape (the in_proj gradient).
local function conv_case(name, T, B, C, W, o)
  local pad = o.pad or { 0, 0 }
  return {
    name = string.format("conv1d %s [T=%d B=%d C=%d W=%d]", name, T, B, C, W),
    inputs = function()
      return { x = randn({ T, B, pad[1] + C + pad[2] }), weight = randn({ C, 1, W }),
               bias = o.bias and randn({ C }) or nil, halo = o.halo and randn({ o.halo, B, C }) or nil,
               d_out = randn({ T, B, C }) }
    end,
    run = function(a)
      local x = a.x:narrow(3, pad[1] + 1, C)
      local opts = { activation = o.activation, cu_seqlens = o.cu, halo = a.halo }
      local out = F.conv1d(x, a.weight, a.bias, opts)
      if o.pad then
        opts.dx = gdp.empty(a.x:shape(), { dtype = a.x:dtype(), device = a.x:device() }):narrow(3, pad[1] + 1, C)
      end
      local g = F.conv1d_backward(x, a.weight, a.bias, a.d_out, opts)
      if o.pad then assert.are.equal(opts.dx, g.dx) end
      return { out = out, dx = g.dx, dweight = g.dweight, dbias = g.dbias, dhalo = g.dhalo }
    end,
  }
end

-- Larger cases (every device: the cpu's f32 run checks the cases themselves).
local tiled = {
  conv_case("tiles: 2 channel tiles, 3 token chunks, bias, SiLU", 300, 2, 200, 4,
            { bias = true, activation = "silu" }),
  conv_case("tiles: one sequence after a halo of 3, B = 2, 5 token chunks", 600, 2, 128, 4,
            { bias = true, activation = "silu", halo = 3 }),
  -- the cuda backward's blocks take 512 tokens: sequences starting on either side of one
  conv_case("tiles: packed across the backward's block chunks, halo 3", 1100, 1, 64, 4,
            { bias = true, activation = "silu", cu = { 0, 511, 513, 1024, 1100 }, halo = 3 }),
  conv_case("tiles: packed with empty sequences, halo 3, SiLU", 300, 1, 130, 4,
            { bias = true, activation = "silu", cu = { 0, 0, 100, 101, 101, 129, 300, 300 }, halo = 3 }),
  conv_case("tiles: W = 6 (the wide kernel), packed, halo 5", 140, 1, 40, 6,
            { bias = true, activation = "silu", cu = { 0, 2, 2, 140 }, halo = 5 }),
  -- cuda: rows 16 wide packs apart (bf16 and f32 take 16-byte packs), then misaligned ones
  conv_case("strided x: a slice of rows 136 wide, packed, halo 3", 150, 1, 96, 4,
            { bias = true, activation = "silu", cu = { 0, 70, 150 }, halo = 3, pad = { 16, 24 } }),
  conv_case("strided x: a slice at channel 3 of rows 101 wide, B = 2", 90, 2, 96, 4,
            { bias = true, activation = "silu", pad = { 3, 2 } }),
  { name = "beta x2, 70000 elements",
    inputs = function() return { b = randn({ 7000, 2, 5 }), d = randn({ 7000, 2, 5 }) } end,
    run = function(a) return { beta = F.beta(a.b, 2), db = F.beta_backward(a.b, 2, a.d) } end },
  { name = "SiLU, 70000 elements",
    inputs = function() return { x = randn({ 7000, 2, 5 }), d = randn({ 7000, 2, 5 }) } end,
    run = function(a) return { out = F.silu(a.x), dx = F.silu_backward(a.x, a.d) } end },
  -- cuda: rows 8-element packs apart (16-byte packs), then misaligned ones; dx written
  -- into a slice of a wider buffer (the in_proj gradient of a mixer without short conv)
  { name = "SiLU, x and dx slices of rows 200 wide at channel 16",
    inputs = function() return { x = randn({ 90, 2, 200 }), d = randn({ 90, 2, 96 }) } end,
    run = function(a)
      local x = a.x:narrow(3, 17, 96)
      local into = gdp.zeros(a.x:shape(), { dtype = a.x:dtype(), device = a.x:device() })
      F.silu_backward(x, a.d, into:narrow(3, 17, 96))
      return { out = F.silu(x), dx = into }
    end },
  { name = "SiLU, x and dx slices at channel 3 of rows 101 wide",
    inputs = function() return { x = randn({ 40, 3, 101 }), d = randn({ 40, 3, 90 }) } end,
    run = function(a)
      local x = a.x:narrow(3, 4, 90)
      local into = gdp.zeros(a.x:shape(), { dtype = a.x:dtype(), device = a.x:device() })
      local dx = F.silu_backward(x, a.d, into:narrow(3, 4, 90))
      return { out = F.silu(x), dx = into, dx_returned = dx }
    end },
  { name = "SiLU, 1-D of a prime size and 2-D transposed",
    inputs = function() return { x = randn({ 7919 }), y = randn({ 33, 70 }), d = randn({ 70, 33 }) } end,
    run = function(a)
      local yt = a.y:transpose(1, 2)
      return { out = F.silu(a.x), dx = F.silu_backward(a.x, a.x), out_t = F.silu(yt),
               dx_t = F.silu_backward(yt, a.d) }
    end },
  { name = "decay, 600 rows (several chunks of the sums)",
    inputs = function()
      return { a = randn({ 300, 2, 5 }), A_log = uniform({ 5 }, -1, 1), dt_bias = uniform({ 5 }, -1, 1),
               d = randn({ 300, 2, 5 }) }
    end,
    run = function(a)
      local da, dA, ddt = F.decay_backward(a.a, a.A_log, a.dt_bias, a.d)
      return { g = F.decay(a.a, a.A_log, a.dt_bias), da = da, dA_log = dA, ddt_bias = ddt }
    end },
  { name = "gated RMSNorm, 2 groups of 300, 150 rows",
    inputs = function()
      return { y = randn({ 75, 2, 600 }), z = randn({ 75, 2, 600 }), w = uniform({ 600 }, 0.5, 1.5),
               d = randn({ 75, 2, 600 }) }
    end,
    run = function(a)
      local dy, dz, dw = F.gated_rmsnorm_backward(a.y, a.z, a.w, 300, 1e-5, a.d)
      return { out = F.gated_rmsnorm(a.y, a.z, a.w, 300, 1e-5), dy = dy, dz = dz, dweight = dw }
    end },
  { name = "D skip per head, 260 rows",
    inputs = function()
      return { y = randn({ 130, 2, 3, 40 }), x = randn({ 130, 2, 3, 40 }), D = uniform({ 3 }, 0.5, 1.5),
               d = randn({ 130, 2, 3, 40 }) }
    end,
    run = function(a)
      local dx, dD = F.dskip_backward(a.x, a.D, a.d)
      return { out = F.dskip(a.y, a.x, a.D), dx_v = dx, dD = dD }
    end },
  { name = "D skip per channel, 260 rows",
    inputs = function()
      return { y = randn({ 130, 2, 3, 40 }), x = randn({ 130, 2, 3, 40 }), D = uniform({ 120 }, 0.5, 1.5),
               d = randn({ 130, 2, 3, 40 }) }
    end,
    run = function(a)
      local dx, dD = F.dskip_backward(a.x, a.D, a.d)
      return { out = F.dskip(a.y, a.x, a.D), dx_v = dx, dD = dD }
    end },
}
for i, case in ipairs(tiled) do case.salt = 3500 + i end

local all = {}
for _, c in ipairs(cases.mixer) do all[#all + 1] = c end
for _, c in ipairs(tiled) do all[#all + 1] = c end

-- The cuda kernels take bf16 as well (float32 math inside).
local DTYPES = { cpu = cases.MIXER_DTYPES.cpu, cuda = { "f32", "bf16" } }

for _, dev in ipairs(H.DEVICES) do
  local device = dev.name
  describe("mixer op case table on " .. device .. dev.tag, function()
    for _, case in ipairs(all) do
      for _, dtype in ipairs(DTYPES[device]) do
        it(case.name .. " " .. dtype, function()
          if not H.need_device(device) then return end
          H.reseed(case.salt)
          local inputs = case.inputs()
          local ref = case.run(inputs)
          local ok, got = pcall(case.run, cases.convert(inputs, dtype, device))
          if not ok and type(got) == "table" and got.name == "GDP_ERR_UNSUPPORTED" and device ~= "cpu" then
            pending(tostring(got))
            return
          end
          assert(ok, tostring(got))
          local n = 0
          for name, r in pairs(ref) do
            n = n + 1
            assert.is_not_nil(got[name], name)
            assert.are.equal(dtype, got[name]:dtype(), name)
            assert.truthy(got[name]:device():find("^" .. device), name)
            assert.is_true(r:norm() > 0, name .. " of the float64 run is zero")
            assert.tensor_near(got[name], r, gdp.ops.TOLERANCE[dtype], name)
          end
          for name in pairs(got) do assert.is_not_nil(ref[name], name) end
          assert.is_true(n >= 2)
        end)
      end
    end
  end)
end

describe("cuda mixer ops #gpu", function()
  it("parameter gradients repeat bit for bit (two-pass sums, no atomics)", function()
    if not H.need_device("cuda") then return end
    H.reseed(3600)
    local x = gdp.randn({ 700, 1, 96 }, { device = "cuda", dtype = "f32" })
    local w = gdp.randn({ 96, 1, 4 }, { device = "cuda", dtype = "f32" })
    local b = gdp.randn({ 96 }, { device = "cuda", dtype = "f32" })
    local d = gdp.randn({ 700, 1, 96 }, { device = "cuda", dtype = "f32" })
    local opts = { activation = "silu", cu_seqlens = { 0, 250, 250, 700 } }
    local g1 = F.conv1d_backward(x, w, b, d, opts)
    local g2 = F.conv1d_backward(x, w, b, d, opts)
    assert.are.equal(0, (g1.dweight - g2.dweight):max_abs())
    assert.are.equal(0, (g1.dbias - g2.dbias):max_abs())
    local y, z = x:view(700, 96), d:view(700, 96)
    local nw = gdp.ones({ 96 }, { device = "cuda", dtype = "f32" })
    local _, _, w1 = F.gated_rmsnorm_backward(y, z, nw, 32, 1e-5, z)
    local _, _, w2 = F.gated_rmsnorm_backward(y, z, nw, 32, 1e-5, z)
    assert.are.equal(0, (w1 - w2):max_abs())
  end)

  it("mixed devices and bad dtypes get the cpu path's errors", function()
    if not H.need_device("cuda") then return end
    local x = gdp.randn({ 5, 1, 4 }, { device = "cuda", dtype = "f32" })
    local w = gdp.randn({ 4, 1, 4 }, { dtype = "f32" })
    local ok, err = pcall(F.conv1d, x, w, nil, { activation = "silu" })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("weight: expected a tensor on cuda:0", 1, true), tostring(err))
    ok, err = pcall(F.beta, gdp.zeros({ 3 }, { device = "cuda", dtype = "i32" }), 2)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("b: expected dtype f64 or f32", 1, true), tostring(err))
    ok, err = pcall(F.gated_rmsnorm, x:view(5, 4), nil, gdp.ones({ 4 }, { device = "cuda" }), 3)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("group_size: expected a divisor of d = 4", 1, true), tostring(err))
  end)
end)

describe("bf16 mixer ops off cuda", function()
  it("are refused on the cpu with a message naming cuda", function()
    local b = gdp.zeros({ 3 }, { dtype = "bf16" })
    local ok, err = pcall(F.beta, b, 2)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("bf16 mixer kernels: cuda only", 1, true), tostring(err))
  end)
end)

describe("nn.functional.silu (f64) against its formula", function()
  it("forward x / (1 + exp(-x)), backward by central differences, odd shape", function()
    H.reseed(3600)
    local x = gdp.randn({ 7, 3, 5 }, { dtype = "f64" }) * 4
    local d = gdp.randn({ 7, 3, 5 }, { dtype = "f64" })
    local xs, out = x:flat(), F.silu(x):flat()
    for i = 1, #xs do
      local want = xs[i] / (1 + math.exp(-xs[i]))
      assert.is_true(math.abs(out[i] - want) <= 1e-15 * (1 + math.abs(want)), "silu at " .. i)
    end
    local h = 1e-6
    local fd = (F.silu(x + h) - F.silu(x - h)) * (1 / (2 * h))
    assert.tensor_near(F.silu_backward(x, d), fd:mul(d), 1e-8, "dx")
  end)
  it("checks its arguments", function()
    local ok, err = pcall(F.silu_backward, gdp.zeros({ 2, 3 }, { dtype = "f64" }), gdp.zeros({ 3, 2 }, { dtype = "f64" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("d_out: expected the shape of x", 1, true), tostring(err))
    ok, err = pcall(F.silu_backward, gdp.zeros({ 2, 3 }, { dtype = "f64" }), gdp.zeros({ 2, 3 }, { dtype = "f64" }),
                    gdp.zeros({ 3, 2 }, { dtype = "f64" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("into: expected the shape of x", 1, true), tostring(err))
    ok, err = pcall(F.silu_backward, gdp.zeros({ 2, 3 }, { dtype = "f64" }), gdp.zeros({ 2, 3 }, { dtype = "f64" }),
                    gdp.zeros({ 2, 3 }, { dtype = "f32" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("into: expected dtype f64 (x's), got f32", 1, true), tostring(err))
    ok, err = pcall(F.silu, gdp.zeros({ 2 }, { dtype = "i32" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("x: expected dtype f64 or f32", 1, true), tostring(err))
  end)
end)
