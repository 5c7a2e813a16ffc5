-- The mixer's output norm (F.out_norm, gdp_mixer_out_norm_*): the D skip fused into the
-- gated grouped RMSNorm, reading the operator's [B,T,H,P] output and strided views of
-- x_v and z in place.  On the cpu in float64 against the composed ops (F.dskip, then
-- F.gated_rmsnorm on the permuted copy), on random odd sizes: several groups per head,
-- groups spanning heads, one group; with and without z; no D, D per head, D per
-- channel.  #gpu: cuda f32 and bf16 against the cpu's float64 run of the same inputs,
-- on sizes that take the 16-byte vector path and the element path, teams of a part of
-- a warp, a warp and several warps, and enough tokens for several backward chunks.
local gdp = require("gdp")
local F = require("gdp.nn.functional")
local H = gdp_test

-- Inputs as the layer has them: o [B,T,H,P] contiguous, x_v the m = 1 slice of a
-- [T,B,2,H,P] tensor, z a narrow of a wider [T,B,H*P+pad] tensor (pad 0: contiguous).
local function make_inputs(c)
  local B, T, nh, P = c.B, c.T, c.H, c.P
  local d = nh * P
  local f64 = { dtype = "f64" }
  local r = {
    o = gdp.randn({ B, T, nh, P }, f64),
    w = gdp.empty({ d }, f64):uniform_(0.5, 1.5),
    d_out = gdp.randn({ T, B, d }, f64),
  }
  if c.D then
    r.xv_big = gdp.randn({ T, B, 2, nh, P }, f64)
    r.D = gdp.empty({ c.D == "channel" and d or nh }, f64):uniform_(0.5, 1.5)
  end
  if c.z then r.z_big = gdp.randn({ T, B, d + (c.z_pad or 0) }, f64) end
  return r
end

local function views(a, c)
  local x_v = a.xv_big and a.xv_big:select(3, 2) or nil
  local z = a.z_big and a.z_big:narrow(3, (c.z_pad or 0) + 1, c.H * c.P) or nil
  return x_v, z
end

local function fused(a, c)
  local x_v, z = views(a, c)
  local out = F.out_norm(a.o, x_v, a.D, z, a.w, c.gs, 1e-5)
  local g = F.out_norm_backward(a.o, x_v, a.D, z, a.w, c.gs, 1e-5, a.d_out)
  return { out = out, d_o = g.d_o, dz = g.dz, dx_v = g.dx_v, dD = g.dD, dweight = g.dweight }
end

local function composed(a, c)
  local x_v, z = views(a, c)
  local T, B, d = a.o:size(2), a.o:size(1), c.H * c.P
  local y = a.o:permute(2, 1, 3, 4)
  if a.D then y = F.dskip(y, x_v, a.D) end
  local y3 = y:reshape(T, B, d)
  local out = F.gated_rmsnorm(y3, z, a.w, c.gs, 1e-5)
  local dy3, dz, dw = F.gated_rmsnorm_backward(y3, z, a.w, c.gs, 1e-5, a.d_out)
  local dy4 = dy3:view(T, B, c.H, c.P)
  local r = { out = out, d_o = dy4:permute(2, 1, 3, 4):contiguous(), dz = dz, dweight = dw }
  if a.D then r.dx_v, r.dD = F.dskip_backward(x_v, a.D, dy4) end
  return r
end

local function on(a, dtype, device)
  local r = {}
  for k, t in pairs(a) do r[k] = t:to({ dtype = dtype, device = device, copy = true }) end
  return r
end

local function expect_results(got, ref, c, tol)
  local want = { "out", "d_o", "dweight" }
  if c.z then want[#want + 1] = "dz" end
  if c.D then
    want[#want + 1] = "dx_v"
    want[#want + 1] = "dD"
  end
  for _, name in ipairs(want) do
    assert.is_not_nil(got[name], name)
    assert.is_true(ref[name]:norm() > 0, name .. " of the reference is zero")
    assert.tensor_near(got[name], ref[name], tol, name)
  end
  if not c.z then assert.is_nil(got.dz, "dz without z") end
  if not c.D then
    assert.is_nil(got.dx_v, "dx_v without D")
    assert.is_nil(got.dD, "dD without D")
  end
end

-- dz written into the z section of a wider [T,B,pad+H*P+pad] buffer (the in_proj
-- gradient's layout) equals dz of its own tensor; the padding stays untouched.
local function expect_dz_into(a, c, dtype, device, tol, pad)
  local b = on(a, dtype, device)
  local x_v, z = views(b, c)
  local d = c.H * c.P
  local big = gdp.full({ c.T, c.B, d + 2 * pad }, 7, { dtype = dtype, device = device })
  local into = big:narrow(3, pad + 1, d)
  local g = F.out_norm_backward(b.o, x_v, b.D, z, b.w, c.gs, 1e-5, b.d_out, into)
  local ref = F.out_norm_backward(b.o, x_v, b.D, z, b.w, c.gs, 1e-5, b.d_out)
  assert.tensor_near(g.dz, ref.dz, tol, "dz returned")
  assert.tensor_near(into, ref.dz, tol, "dz in dz_into")
  assert.tensor_near(g.d_o, ref.d_o, tol, "d_o beside dz_into")
  for _, edge in ipairs({ big:narrow(3, 1, pad), big:narrow(3, pad + d + 1, pad) }) do
    assert.are.equal(0, (edge - 7):max_abs(), "padding around dz_into")
  end
end

local CPU_CASES = {
  { label = "3 groups per head, z, D per head", B = 2, T = 7, H = 3, P = 12, gs = 4, z = true, D = "head", z_pad = 5 },
  { label = "groups of 2 heads, z, D per channel", B = 3, T = 5, H = 4, P = 5, gs = 10, z = true, D = "channel", z_pad = 3 },
  { label = "one group, z, no D", B = 1, T = 9, H = 3, P = 7, gs = 21, z = true },
  { label = "one group per head, no z, D per head", B = 2, T = 6, H = 5, P = 3, gs = 3, D = "head" },
  { label = "no z, no D, 2 groups", B = 2, T = 3, H = 2, P = 9, gs = 9 },
  { label = "no z, D per channel, contiguous z-less", B = 1, T = 11, H = 2, P = 6, gs = 4, D = "channel" },
}

describe("out_norm on the cpu", function()
  for i, c in ipairs(CPU_CASES) do
    it("equals dskip then gated_rmsnorm in float64: " .. c.label, function()
      H.reseed(4100 + i)
      local a = make_inputs(c)
      expect_results(fused(a, c), composed(a, c), c, 1e-12)
    end)
    it("f32 against the float64 run: " .. c.label, function()
      H.reseed(4200 + i)
      local a = make_inputs(c)
      local got = fused(on(a, "f32", "cpu"), c)
      for name, t in pairs(got) do assert.are.equal("f32", t:dtype(), name) end
      expect_results(got, fused(a, c), c, gdp.ops.TOLERANCE.f32)
    end)
  end

  it("reads o, x_v and z in place: results do not depend on the views' padding", function()
    H.reseed(4300)
    local c = { B = 2, T = 4, H = 2, P = 6, gs = 6, z = true, D = "head", z_pad = 7 }
    local a = make_inputs(c)
    local x_v, z = views(a, c)
    local got = fused(a, c)
    local b = { o = a.o:permute(2, 1, 3, 4):contiguous():permute(2, 1, 3, 4), w = a.w, D = a.D,
                d_out = a.d_out }
    local cz, cx = z:contiguous(), x_v:contiguous()
    local out = F.out_norm(b.o, cx, b.D, cz, b.w, c.gs, 1e-5)
    local g = F.out_norm_backward(b.o, cx, b.D, cz, b.w, c.gs, 1e-5, b.d_out)
    assert.tensor_near(out, got.out, 1e-14, "out")
    assert.tensor_near(g.d_o, got.d_o, 1e-14, "d_o")
    assert.tensor_near(g.dD, got.dD, 1e-14, "dD")
  end)

  it("writes dz into dz_into: a strided section in place, another dtype staged", function()
    H.reseed(4310)
    local c = { B = 2, T = 5, H = 2, P = 6, gs = 4, z = true, D = "head", z_pad = 3 }
    expect_dz_into(make_inputs(c), c, "f64", "cpu", 1e-14, 5)
    local a = make_inputs(c)
    local x_v, z = views(a, c)
    local into = gdp.zeros({ c.T, c.B, c.H * c.P }, { dtype = "f32" })
    local g = F.out_norm_backward(a.o, x_v, a.D, z, a.w, c.gs, 1e-5, a.d_out, into)
    assert.are.equal("f32", g.dz:dtype())
    assert.tensor_near(into, fused(a, c).dz, gdp.ops.TOLERANCE.f32, "dz staged into f32")
  end)

  it("names the argument, expected and actual value on bad input", function()
    local f64 = { dtype = "f64" }
    local o = gdp.randn({ 2, 3, 4, 5 }, f64)
    local w = gdp.ones({ 20 }, f64)
    local xv = gdp.randn({ 3, 2, 4, 5 }, f64)
    H.expect_error(function() F.out_norm(o:view(6, 4, 5), nil, nil, nil, w, 5) end, "o", "[B,T,H,P]")
    H.expect_error(function() F.out_norm(o, xv, nil, nil, w, 5) end, "D", "x_v")
    H.expect_error(function() F.out_norm(o, nil, gdp.ones({ 4 }, f64), nil, w, 5) end, "x_v", "D")
    H.expect_error(function() F.out_norm(o, xv, gdp.ones({ 3 }, f64), nil, w, 5) end, "D", "[4]", "[20]", "[3]")
    H.expect_error(function() F.out_norm(o, o, gdp.ones({ 4 }, f64), nil, w, 5) end, "x_v", "[T,B,H,P]")
    H.expect_error(function() F.out_norm(o, nil, nil, gdp.randn({ 2, 3, 20 }, f64), w, 5) end, "z", "[3x2x20]")
    H.expect_error(function() F.out_norm(o, nil, nil, nil, gdp.ones({ 21 }, f64), 5) end, "weight")
    H.expect_error(function() F.out_norm(o, nil, nil, nil, w, 3) end, "group_size", "divisor", "20")
    H.expect_error(function() F.out_norm_backward(o, nil, nil, nil, w, 5, 1e-5, gdp.randn({ 3, 2, 19 }, f64)) end,
                   "d_out", "[3x2x20]")
    local d_out = gdp.randn({ 3, 2, 20 }, f64)
    H.expect_error(function() F.out_norm_backward(o, nil, nil, nil, w, 5, 1e-5, d_out, gdp.zeros({ 3, 2, 20 }, f64)) end,
                   "dz_into", "without z")
    H.expect_error(function()
      F.out_norm_backward(o, nil, nil, gdp.randn({ 3, 2, 20 }, f64), w, 5, 1e-5, d_out, gdp.zeros({ 3, 2, 21 }, f64))
    end, "dz_into", "[3x2x20]", "[3x2x21]")
  end)
end)

-- Sizes for the cuda kernels' paths (bf16 vectors are 8 elements, f32 ones 4):
local GPU_CASES = {
  { label = "the layer's shape class: vectors, a warp per group, D per head",
    B = 2, T = 37, H = 8, P = 64, gs = 256, z = true, D = "head", z_pad = 16 },
  { label = "half-warp teams, D per channel, groups inside a head",
    B = 3, T = 29, H = 4, P = 32, gs = 16, z = true, D = "channel", z_pad = 8 },
  { label = "element path (odd P, unaligned z), several groups per head",
    B = 2, T = 23, H = 3, P = 15, gs = 5, z = true, D = "head", z_pad = 3 },
  { label = "multi-warp teams (one group of 4096), no D",
    B = 1, T = 13, H = 32, P = 128, gs = 4096, z = true },
  { label = "many tokens: several backward chunks, no z, D per channel",
    B = 4, T = 700, H = 2, P = 24, gs = 48, D = "channel" },
}

describe("out_norm on cuda #gpu", function()
  for i, c in ipairs(GPU_CASES) do
    for _, dtype in ipairs({ "f32", "bf16" }) do
      it(dtype .. " against the cpu float64 run: " .. c.label, function()
        if not H.need_device("cuda") then return end
        H.reseed(4400 + i)
        local a = make_inputs(c)
        local ref = fused(a, c)
        local got = fused(on(a, dtype, "cuda"), c)
        for name, t in pairs(got) do
          assert.are.equal(dtype, t:dtype(), name)
          assert.truthy(t:device():find("^cuda"), name)
        end
        expect_results(got, ref, c, gdp.ops.TOLERANCE[dtype])
      end)
    end
  end

  it("writes dz into a strided dz_into in place (f32, bf16; aligned and not)", function()
    if not H.need_device("cuda") then return end
    H.reseed(4450)
    local c = GPU_CASES[1]
    for _, dtype in ipairs({ "f32", "bf16" }) do
      for _, pad in ipairs({ 8, 3 }) do -- the 16-byte vector path, the element path
        expect_dz_into(make_inputs(c), c, dtype, "cuda", gdp.ops.TOLERANCE[dtype], pad)
      end
    end
  end)

  it("dD and dweight repeat bit for bit (partials per block, no atomics)", function()
    if not H.need_device("cuda") then return end
    H.reseed(4500)
    local c = GPU_CASES[1]
    local a = on(make_inputs(c), "f32", "cuda")
    local g1, g2 = fused(a, c), fused(a, c)
    assert.are.equal(0, (g1.dD - g2.dD):max_abs())
    assert.are.equal(0, (g1.dweight - g2.dweight):max_abs())
  end)
end)
