-- The fused input stage of the mixer (F.ssm_inputs / F.ssm_inputs_backward,
-- gdp_mixer_ssm_inputs_*): on the cpu in float64 against the composed ops it replaces
-- (views and permutes, F.repeat_heads, F.beta, F.decay: the layer's former path) on odd
-- sizes (ng < nh and ng = nh, M = 1, 2, 3, with and without the forget gate, beta_scale 1
-- and 2, with and without the D skip's dx_v), with inputs and outputs as strided views
-- into an in_proj-like tensor and a destination that takes the staged path; float32
-- against float64; and on cuda (#gpu) f32 and bf16 against the cpu's float64 on the same
-- inputs, at sizes that take the 16-byte packs and sizes that do not, with repeatable
-- parameter gradient sums.  silu cases: the stage applies SiLU to xBC itself (a layer
-- without short conv), against F.silu and F.silu_backward around the composed ops.
local gdp = require("gdp")
local F = require("gdp.nn.functional")
local H = gdp_test

local CASES = {
  { name = "ng < nh, M = 2, gate, beta x2, dx_v", T = 5, B = 3, nh = 6, P = 3, ng = 2, N = 5, M = 2,
    gate = true, scale = 2, dx_v = true },
  { name = "ng = nh, M = 1, no gate", T = 7, B = 2, nh = 3, P = 5, ng = 3, N = 3, M = 1,
    gate = false, scale = 1, dx_v = false },
  { name = "one group, M = 3, gate, dx_v", T = 3, B = 1, nh = 5, P = 7, ng = 1, N = 3, M = 3,
    gate = true, scale = 1, dx_v = true },
  { name = "ng < nh, M = 3, no gate, beta x2", T = 9, B = 2, nh = 4, P = 3, ng = 2, N = 7, M = 3,
    gate = false, scale = 2, dx_v = true },
  { name = "SiLU fused, ng < nh, M = 2, gate, beta x2, dx_v", T = 6, B = 2, nh = 4, P = 3, ng = 2, N = 5,
    M = 2, gate = true, scale = 2, dx_v = true, silu = true },
}

local function dims_of(c)
  return { num_heads = c.nh, head_dim = c.P, num_groups = c.ng, state_dim = c.N,
           num_householder = c.M, beta_scale = c.scale }
end

local function conv_dim(c) return c.M * c.nh * c.P + (c.M + 1) * c.ng * c.N end

-- Random float64 cpu inputs of a case: the forward's and the backward's.
local function case_inputs(c)
  local T, B, nh, P, N, M = c.T, c.B, c.nh, c.P, c.N, c.M
  local r = function(shape) return gdp.randn(shape, { dtype = "f64" }) end
  local u = function(shape, lo, hi) return gdp.empty(shape, { dtype = "f64" }):uniform_(lo, hi) end
  local x = {
    xBC = r({ T, B, conv_dim(c) }), b = r({ T, B, M * nh }),
    -- a spread over the softplus threshold (20) as well
    a = c.gate and u({ T, B, nh }, -4, 24) or nil,
    A_log = c.gate and u({ nh }, -1, 1) or nil, dt_bias = c.gate and u({ nh }, -1, 1) or nil,
    dq = r({ B, T, nh, N }), dk = r({ B, T * M, nh, N }), dv = r({ B, T * M, nh, P }),
    dbeta = r({ B, T * M, nh }), dg = c.gate and r({ B, T, nh }) or nil,
    dx_v = c.dx_v and r({ T, B, nh, P }) or nil,
  }
  return x
end

-- The layer's former input stage, composed of the separate ops, on contiguous inputs.
local function composed(c, x)
  local T, B, nh, P, ng, N, M = c.T, c.B, c.nh, c.P, c.ng, c.N, c.M
  local vd, kd, qd = M * nh * P, M * ng * N, ng * N
  local xBC = c.silu and F.silu(x.xBC) or x.xBC
  local V5 = xBC:narrow(3, 1, vd):view(T, B, M, nh, P)
  local K5 = xBC:narrow(3, vd + 1, kd):view(T, B, M, ng, N)
  local Q4 = xBC:narrow(3, vd + kd + 1, qd):view(T, B, ng, N)
  local r = {
    v = V5:permute(2, 1, 3, 4, 5):reshape(B, T * M, nh, P),
    k = F.repeat_heads(K5:permute(2, 1, 3, 4, 5), nh):view(B, T * M, nh, N),
    q = F.repeat_heads(Q4:permute(2, 1, 3, 4), nh),
    beta = F.beta(x.b, c.scale):view(T, B, M, nh):permute(2, 1, 3, 4):reshape(B, T * M, nh),
  }
  if c.gate then r.g = F.decay(x.a, x.A_log, x.dt_bias):permute(2, 1, 3):contiguous() end
  local dxBC = gdp.zeros({ T, B, conv_dim(c) }, { dtype = "f64" })
  local dV5 = dxBC:narrow(3, 1, vd):view(T, B, M, nh, P)
  dV5:copy(x.dv:view(B, T, M, nh, P):permute(2, 1, 3, 4, 5))
  if x.dx_v then dV5:select(3, 1):add_(x.dx_v) end
  dxBC:narrow(3, vd + 1, kd):view(T, B, M, ng, N)
      :copy(F.repeat_heads_backward(x.dk:view(B, T, M, nh, N):permute(2, 1, 3, 4, 5), ng))
  dxBC:narrow(3, vd + kd + 1, qd):view(T, B, ng, N)
      :copy(F.repeat_heads_backward(x.dq:permute(2, 1, 3, 4), ng))
  r.dxBC = c.silu and F.silu_backward(x.xBC, dxBC) or dxBC
  r.db = F.beta_backward(x.b:view(T, B, M, nh), c.scale, x.dbeta:view(B, T, M, nh):permute(2, 1, 3, 4))
           :view(T, B, M * nh)
  if c.gate then
    r.da, r.dA_log, r.ddt_bias = F.decay_backward(x.a, x.A_log, x.dt_bias, x.dg:permute(2, 1, 3))
  end
  return r
end

-- The fused op on x (any dtype and device); strided = true reads xBC, b and a from and
-- writes db and da into [T,B,wide] tensors laid out like the in_proj output.
local function fused(c, x, strided)
  local T, B = c.T, c.B
  local xBC, b, a = x.xBC, x.b, x.a
  local out
  if strided then
    local cd, bd, ad = conv_dim(c), c.M * c.nh, c.gate and c.nh or 0
    local opts = { dtype = x.b:dtype(), device = x.b:device() }
    local zx = gdp.randn({ T, B, 3 + cd + bd + ad }, opts)
    zx:narrow(3, 4, cd):copy(xBC)
    zx:narrow(3, 4 + cd, bd):copy(b)
    xBC, b = zx:narrow(3, 4, cd), zx:narrow(3, 4 + cd, bd)
    if a then
      zx:narrow(3, 4 + cd + bd, ad):copy(a)
      a = zx:narrow(3, 4 + cd + bd, ad)
    end
    local dzx = gdp.empty({ T, B, 2 + cd + bd + ad }, opts)
    out = { dxBC = dzx:narrow(3, 3, cd), db = dzx:narrow(3, 3 + cd, bd),
            da = a and dzx:narrow(3, 3 + cd + bd, ad) or nil }
  end
  local r = F.ssm_inputs(xBC, b, a, x.A_log, x.dt_bias, dims_of(c), { silu = c.silu })
  local g = F.ssm_inputs_backward(b, a, x.A_log, x.dt_bias, dims_of(c),
                                  { dq = x.dq, dk = x.dk, dv = x.dv, dbeta = x.dbeta, dg = x.dg,
                                    dx_v = x.dx_v }, out, { silu_input = c.silu and xBC or nil })
  if out then
    assert.are.equal(out.dxBC, g.dxBC)
    assert.are.equal(out.db, g.db)
    assert.are.equal(out.da, g.da)
  end
  for k, v in pairs(g) do r[k] = v end
  return r
end

local function compare(got, ref, tol, dtype, device)
  local n = 0
  for name, r in pairs(ref) do
    n = n + 1
    assert.is_not_nil(got[name], name)
    local want = dtype
    if dtype == "bf16" and (name == "g" or name == "dA_log" or name == "ddt_bias") then want = "f32" end
    assert.are.equal(want, got[name]:dtype(), name)
    assert.truthy(got[name]:device():find("^" .. device), name)
    assert.is_true(r:norm() > 0, name .. " of the reference is zero")
    assert.tensor_near(got[name], r, tol, name)
  end
  for name in pairs(got) do assert.is_not_nil(ref[name], name) end
  return n
end

local function convert(x, dtype, device)
  local out = {}
  for k, t in pairs(x) do
    -- the gate parameters and dg stay float32 in a bf16 layer
    local dt = (dtype == "bf16" and (k == "A_log" or k == "dt_bias" or k == "dg")) and "f32" or dtype
    out[k] = t:to({ dtype = dt, device = device, copy = true })
  end
  return out
end

describe("fused mixer input stage on the cpu", function()
  for i, c in ipairs(CASES) do
    it(c.name .. ": float64 equals the composed ops", function()
      H.reseed(4100 + i)
      local x = case_inputs(c)
      local ref = composed(c, x)
      assert.is_true(compare(fused(c, x), ref, 1e-15, "f64", "cpu") >= 6)
      compare(fused(c, x, true), ref, 1e-15, "f64", "cpu")
    end)
    it(c.name .. ": float32 against float64", function()
      H.reseed(4100 + i)
      local x = case_inputs(c)
      compare(fused(c, convert(x, "f32", "cpu"), true), composed(c, x), gdp.ops.TOLERANCE.f32, "f32", "cpu")
    end)
  end

  it("writes a destination without row layout through a staged copy", function()
    local c = CASES[1]
    H.reseed(4150)
    local x = case_inputs(c)
    local ref = composed(c, x)
    -- [T,B,M*nh] as a permute of a [B,T,M*nh] tensor: rows are not evenly spaced
    local db = gdp.empty({ c.B, c.T, c.M * c.nh }, { dtype = "f64" }):permute(2, 1, 3)
    local da = gdp.empty({ c.T, c.B, c.nh }, { dtype = "f32" })
    local dxBC = gdp.empty({ c.B, c.T, conv_dim(c) }, { dtype = "f64" }):permute(2, 1, 3)
    local g = F.ssm_inputs_backward(x.b, x.a, x.A_log, x.dt_bias, dims_of(c),
                                    { dq = x.dq, dk = x.dk, dv = x.dv, dbeta = x.dbeta, dg = x.dg,
                                      dx_v = x.dx_v }, { dxBC = dxBC, db = db, da = da })
    assert.tensor_near(db, ref.db, 1e-15, "db")
    assert.tensor_near(dxBC, ref.dxBC, 1e-15, "dxBC")
    assert.tensor_near(da, ref.da, 1e-6, "da (float32 destination)")
    assert.are.equal(db, g.db)
  end)

  it("checks its arguments", function()
    local c = CASES[1]
    H.reseed(4160)
    local x = case_inputs(c)
    local d = dims_of(c)
    H.expect_error(function() F.ssm_inputs(x.xBC, x.b, x.a, x.A_log, x.dt_bias, { num_heads = 6 }) end,
                   "head_dim")
    local bad = dims_of(c)
    bad.num_groups = 4
    H.expect_error(function() F.ssm_inputs(x.xBC, x.b, x.a, x.A_log, x.dt_bias, bad) end,
                   "num_groups: expected a divisor of num_heads = 6, got 4")
    H.expect_error(function() F.ssm_inputs(x.xBC:narrow(3, 1, 10), x.b, x.a, x.A_log, x.dt_bias, d) end,
                   "xBC: expected [T,B,M*nh*P + M*ng*N + ng*N] (b's T, B) = [5x3x" .. conv_dim(c) .. "]")
    H.expect_error(function() F.ssm_inputs(x.xBC, x.b:narrow(3, 1, 5), x.a, x.A_log, x.dt_bias, d) end,
                   "b: expected [T,B,M*nh] with M*nh = 12")
    H.expect_error(function() F.ssm_inputs(x.xBC, x.b, x.a, nil, x.dt_bias, d) end,
                   "A_log: expected a tensor, got NULL")
    H.expect_error(function() F.ssm_inputs(x.xBC, x.b, nil, x.A_log, nil, d) end,
                   "A_log: expected NULL without a (no forget gate)")
    H.expect_error(function()
      F.ssm_inputs_backward(x.b, x.a, x.A_log, x.dt_bias, d,
                            { dq = x.dq, dk = x.dv, dv = x.dv, dbeta = x.dbeta, dg = x.dg })
    end, "dk: expected [B,T*M,nh,N]")
    H.expect_error(function()
      F.ssm_inputs_backward(x.b, x.a, x.A_log, x.dt_bias, d,
                            { dq = x.dq, dk = x.dk, dv = x.dv, dbeta = x.dbeta })
    end, "dg: expected a tensor, got NULL")
    H.expect_error(function()
      F.ssm_inputs_backward(x.b, x.a, x.A_log, x.dt_bias, d, { dq = x.dq, dk = x.dk, dv = x.dv, dbeta = x.dbeta,
                                                               dg = x.dg, dx = x.dx_v })
    end, "unknown option 'dx'")
    H.expect_error(function() F.ssm_inputs(x.xBC, x.b, x.a, x.A_log, x.dt_bias, d, { silu = 1 }) end,
                   "opts.silu: expected a boolean, got number")
    H.expect_error(function()
      F.ssm_inputs_backward(x.b, x.a, x.A_log, x.dt_bias, d, { dq = x.dq, dk = x.dk, dv = x.dv, dbeta = x.dbeta,
                                                               dg = x.dg }, nil, { silu_input = x.b })
    end, "xBC: expected [T,B,M*nh*P + M*ng*N + ng*N] (b's T, B)")
  end)
end)

-- cuda: P and N multiples of 8 take the 16-byte packs (bf16: 8 elements, f32: 4); the
-- odd cases take packs of one element.
local GPU_CASES = {
  CASES[1], CASES[2], CASES[3],
  { name = "packs: nh 6 x 16, ng 2 x 8, M = 2, gate, dx_v", T = 37, B = 3, nh = 6, P = 16, ng = 2, N = 8,
    M = 2, gate = true, scale = 2, dx_v = true },
  { name = "packs: 300 rows (several chunks of the sums), nh = ng = 4 x 8, M = 3", T = 150, B = 2, nh = 4,
    P = 8, ng = 4, N = 8, M = 3, gate = true, scale = 1, dx_v = false },
  CASES[5],
  { name = "packs: SiLU fused, nh = ng = 8 x 32, M = 4, no gate (the state-tracking layer)", T = 33, B = 2,
    nh = 8, P = 32, ng = 8, N = 32, M = 4, gate = false, scale = 2, dx_v = true, silu = true },
}

describe("fused mixer input stage on cuda #gpu", function()
  for i, c in ipairs(GPU_CASES) do
    for _, dtype in ipairs({ "f32", "bf16" }) do
      for _, strided in ipairs({ false, true }) do
        it(string.format("%s, %s%s against the cpu's float64", c.name, dtype, strided and ", strided" or ""),
           function()
             if not H.need_device("cuda") then return end
             H.reseed(4200 + i)
             local x = case_inputs(c)
             local ref = composed(c, x)
             compare(fused(c, convert(x, dtype, "cuda"), strided), ref, gdp.ops.TOLERANCE[dtype], dtype, "cuda")
           end)
      end
    end
  end

  it("repeats its parameter gradient sums bit for bit", function()
    if not H.need_device("cuda") then return end
    local c = GPU_CASES[5]
    H.reseed(4300)
    local x = convert(case_inputs(c), "bf16", "cuda")
    local g1 = fused(c, x)
    local g2 = fused(c, x)
    assert.are.equal(0, (g1.dA_log - g2.dA_log):max_abs())
    assert.are.equal(0, (g1.ddt_bias - g2.ddt_bias):max_abs())
    assert.are.equal(0, (g1.dxBC:to("f32") - g2.dxBC:to("f32")):max_abs())
  end)
end)
