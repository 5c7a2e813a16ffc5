-- The Gated DeltaProduct mixer layer (gdp.nn.GatedDeltaProduct) and its ops
-- (gdp.nn.functional): golden Megatron-semantics cases, finite differences of the
-- whole layer, packing, parameters, save/load, initialisation and errors.
local gdp = require("gdp")
local nn = require("gdp.nn")
local F = nn.functional
local H = gdp_test


local golden = require("gdp.nn.golden")

describe("nn.GatedDeltaProduct golden cases", function()
  local files = H.list_files(H.golden_dir, "^mixer_.*%.safetensors$")

  it("finds the mixer cases", function()
    assert.is_true(#files >= 2, "expected the mixer_*.safetensors cases in " .. H.golden_dir)
  end)

  for _, path in ipairs(files) do
    for _, dtype in ipairs({ "f64", "f32" }) do
      it(path:match("[^/]+$") .. " " .. dtype .. ": out, grad.x and every grad.<param>", function()
        local t, meta = gdp.load(path)
        local m = golden.module_for(meta, dtype)
        assert.is_true(math.abs(m.scale - tonumber(meta.scale)) <= 1e-15 * m.scale)
        local rows = golden.check_case(t, meta, { dtype = dtype })
        local names = {}
        for _, r in ipairs(rows) do
          names[r.name] = true
          assert.is_true(r.ok, string.format("%s %s: %s relative error %.3g > %.0e",
                                             path, dtype, r.name, r.err, r.tol))
        end
        -- every parameter of the module is checked, and so are out and grad.x
        assert.is_true(names.out and names["grad.x"])
        for _, name in ipairs(m:parameter_names()) do assert.is_true(names["grad." .. name], name) end
      end)
    end
  end
end)

describe("gdp.nn.golden storage floor", function()
  local path = H.golden_dir .. "/mixer_m3_packed_bias_neg.safetensors"
  local function holder(dtype)
    return { dtype = dtype,
             param_dtype = function(_, name)
               return dtype == "bf16" and (name == "A_log" or name == "dt_bias") and "f32" or dtype
             end }
  end
  it("is the rounded-input reference itself when nothing is rounded (f64 storage)", function()
    local t, meta = gdp.load(path)
    local exact = golden.storage_floor_reference(t, meta, holder("f64"))
    local again = golden.storage_floor_reference(t, meta, holder("f64"))
    for name, v in pairs(exact) do assert.tensor_near(again[name], v, 0, name) end
    local ref = golden.module_for(meta, "f64")
    ref:set_parameters(t, false)
    assert.tensor_near(exact.out, ref:forward(t.x, t.cu_seqlens), 1e-15, "out")
    assert.tensor_near(exact["grad.x"], ref:backward(t.x, t.dy, t.cu_seqlens), 1e-15, "grad.x")
  end)
  it("moves out and every gradient by bf16 storage, and grad.A_log past 1e-2 on this case", function()
    local t, meta = gdp.load(path)
    local exact = golden.storage_floor_reference(t, meta, holder("f64"))
    local floor = golden.storage_floor_reference(t, meta, holder("bf16"))
    for name, v in pairs(exact) do
      local e = gdp.rel_error(floor[name], v)
      assert.is_true(e > 1e-4 and e < 5e-2, string.format("%s: storage floor %.3g", name, e))
    end
    assert.is_true(gdp.rel_error(floor["grad.A_log"], exact["grad.A_log"]) > 1e-2)
  end)
end)

local fd_error = H.fd_error

local function randomize(m, scale)
  -- larger-than-init random parameters so that every path carries signal
  -- (in parameter_names() order: pairs() order, and with it the draws, changes between
  -- processes)
  local p = m:parameters()
  for _, name in ipairs(m:parameter_names()) do
    local t = p[name]
    if name == "A_log" then t:uniform_(-1, 1)
    elseif name == "dt_bias" then t:uniform_(-1, 1)
    elseif name == "norm.weight" or name == "D" then t:uniform_(0.5, 1.5)
    else t:normal_(0, scale) end
  end
end

describe("nn.GatedDeltaProduct finite differences (f64)", function()
  local configs = {
    { label = "M=1, ng=nh, no D, B=2", T = 6, B = 2,
      cfg = { hidden_size = 6, num_heads = 2, head_dim = 3, num_groups = 2, state_dim = 4,
              num_householder = 1 } },
    { label = "M=2, ng<nh, D head, packed short + empty", T = 9, B = 1, cu = { 0, 1, 1, 5, 9, 9 },
      cfg = { hidden_size = 5, num_heads = 4, head_dim = 2, num_groups = 2, state_dim = 3,
              num_householder = 2, D = "head" } },
    { label = "M=3, ng=1, D channel, neg eigval, no conv bias, packed", T = 8, B = 1,
      cu = { 0, 3, 3, 8 },
      cfg = { hidden_size = 7, num_heads = 2, head_dim = 3, num_groups = 1, state_dim = 4,
              num_householder = 3, D = "channel", allow_neg_eigval = true, conv_bias = false } },
    { label = "M=2, ng=nh=3, W=3, B=2", T = 5, B = 2,
      cfg = { hidden_size = 4, num_heads = 3, head_dim = 2, num_groups = 3, state_dim = 2,
              num_householder = 2, conv_width = 3 } },
    -- fla's switches (the DeltaProduct state-tracking setup turns all three off)
    { label = "no conv, no output gate, no forget gate, M=2, neg eigval, B=2", T = 7, B = 2,
      cfg = { hidden_size = 6, num_heads = 2, head_dim = 3, num_groups = 2, state_dim = 3,
              num_householder = 2, allow_neg_eigval = true, use_short_conv = false,
              use_output_gate = false, use_forget_gate = false } },
    { label = "no conv, M=1, D head, packed", T = 8, B = 1, cu = { 0, 3, 3, 8 },
      cfg = { hidden_size = 5, num_heads = 2, head_dim = 2, num_groups = 1, state_dim = 3,
              num_householder = 1, D = "head", use_short_conv = false } },
    { label = "no output gate, M=3, ng<nh, D channel", T = 6, B = 1,
      cfg = { hidden_size = 5, num_heads = 4, head_dim = 2, num_groups = 2, state_dim = 2,
              num_householder = 3, D = "channel", use_output_gate = false } },
    { label = "no forget gate, M=2, W=3, packed with an empty sequence", T = 7, B = 1,
      cu = { 0, 4, 4, 7 },
      cfg = { hidden_size = 4, num_heads = 2, head_dim = 2, num_groups = 2, state_dim = 3,
              num_householder = 2, conv_width = 3, use_forget_gate = false } },
  }
  for ci, c in ipairs(configs) do
    it(c.label, function()
      H.reseed(100 + ci)
      math.randomseed(H.seed + ci)
      local cfg = {}
      for k, v in pairs(c.cfg) do cfg[k] = v end
      cfg.dtype, cfg.seed = "f64", H.seed + ci
      local m = nn.GatedDeltaProduct(cfg)
      randomize(m, 0.5)
      local x = gdp.randn({ c.T, c.B, cfg.hidden_size }, { dtype = "f64" })
      local dy = gdp.randn({ c.T, c.B, cfg.hidden_size }, { dtype = "f64" })
      m:zero_grad()
      m:forward(x, c.cu)
      local dx = m:backward(x, dy, c.cu)
      local function loss() return m:forward(x, c.cu):dot(dy) end
      local worst, worst_name = 0, nil
      local function check(name, p, g)
        local e = fd_error(loss, p, g, 12)
        assert.is_true(e <= 1e-6, string.format("%s: finite differences vs backward: %.3e", name, e))
        if e > worst then worst, worst_name = e, name end
      end
      local verbose = os.getenv("GDP_TEST_VERBOSE")
      check("x", x, dx)
      for _, name in ipairs(m:parameter_names()) do
        check(name, m:parameters()[name], m:gradients()[name])
      end
      if verbose then
        io.stderr:write(string.format("  %s: worst finite-difference error %.2e (%s)\n", c.label,
                                      worst, worst_name))
      end
      -- the gradients are not all zero (the check above would pass vacuously)
      local first_gate = m:gradients()["A_log"] or m:gradients()["in_proj.weight"]
      assert.is_true(first_gate:norm() > 0 and dx:norm() > 0)
    end)
  end
end)

-- The layer with fla's three switches off, written out with plain float64 host loops
-- (SiLU, sigmoid, RMSNorm) around matmuls and the operator's float64 recurrence:
--   out = out_proj(RMSNorm_groups(GDP(q = silu(Q x), k = silu(K x), v = silu(V x),
--                                     beta = s * sigmoid(b x), g = none)) * norm.weight)
describe("nn.GatedDeltaProduct without short conv, output gate and forget gate", function()
  local cfg = { hidden_size = 6, num_heads = 4, head_dim = 3, num_groups = 2, state_dim = 4,
                num_householder = 2, allow_neg_eigval = true, use_short_conv = false,
                use_output_gate = false, use_forget_gate = false, dtype = "f64", seed = 11 }

  local function map(t, f)
    local flat = t:flat()
    for i = 1, #flat do flat[i] = f(flat[i]) end
    return gdp.tensor(flat, t:shape(), { dtype = "f64" })
  end
  local function sigmoid(v) return 1 / (1 + math.exp(-v)) end

  it("has only the parameters it uses", function()
    local m = nn.GatedDeltaProduct(cfg)
    assert.are.same({ "in_proj.weight", "norm.weight", "out_proj.weight" }, m:parameter_names())
    -- in_proj: V (M d_inner) + K (M ng N) + Q (ng N) + b (M nh), no z, no a
    assert.are.same({ 2 * 12 + 2 * 2 * 4 + 2 * 4 + 2 * 4, 6 }, m:parameters()["in_proj.weight"]:shape())
    local g = m:gradients()
    assert.is_nil(g["conv1d.weight"] or g["A_log"] or g["dt_bias"])
    local m2 = nn.GatedDeltaProduct{ hidden_size = 6, num_heads = 2, head_dim = 3, state_dim = 4,
                                     use_short_conv = false, conv_bias = true }
    assert.are.same({ "in_proj.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight" },
                    m2:parameter_names())
    assert.is_truthy(tostring(m):find("no conv, no output gate, no forget gate", 1, true), tostring(m))
  end)

  it("computes fla's ungated, ungated-norm, conv-free layer", function()
    H.reseed(140)
    local m = nn.GatedDeltaProduct(cfg)
    for _, name in ipairs(m:parameter_names()) do m:parameters()[name]:normal_(0, 0.5) end
    local T, B, nh, P, ng, N, M = 9, 2, 4, 3, 2, 4, 2
    local x = gdp.randn({ T, B, 6 }, { dtype = "f64" })
    local zx = gdp.matmul(x:reshape(T * B, 6), m:parameters()["in_proj.weight"], { trans_b = true })
                  :view(T, B, -1)
    local V = map(zx:narrow(3, 1, M * nh * P), function(v) return v * sigmoid(v) end):view(T, B, M, nh, P)
    local K = map(zx:narrow(3, 1 + M * nh * P, M * ng * N), function(v) return v * sigmoid(v) end)
                :view(T, B, M, ng, N)
    local Q = map(zx:narrow(3, 1 + M * nh * P + M * ng * N, ng * N), function(v) return v * sigmoid(v) end)
                :view(T, B, ng, N)
    local beta = map(zx:narrow(3, 1 + M * nh * P + M * ng * N + ng * N, M * nh),
                     function(v) return 2 * sigmoid(v) end):view(T, B, M, nh)
    -- heads h = 2j, 2j+1 read group j
    local function heads(t4) -- [..., ng, N] -> [..., nh, N]
      local shape = t4:shape()
      shape[#shape - 1] = nh
      local out = gdp.empty(shape, { dtype = "f64" })
      for h = 1, nh do out:select(#shape - 1, h):copy(t4:select(#shape - 1, math.floor((h - 1) / 2) + 1)) end
      return out
    end
    local o = gdp.ops.chunk_gated_delta_product{
      q = heads(Q):permute(2, 1, 3, 4):contiguous(),
      k = heads(K):permute(2, 1, 3, 4, 5):reshape(B, T * M, nh, N),
      v = V:permute(2, 1, 3, 4, 5):reshape(B, T * M, nh, P),
      beta = beta:permute(2, 1, 3, 4):reshape(B, T * M, nh),
      num_householder = M, scale = N ^ -0.5, use_qk_l2norm_in_kernel = true,
      algorithm = "recurrent" }
    -- RMSNorm over groups of d_inner / ng = 6 channels, then the weight
    local y = o:permute(2, 1, 3, 4):reshape(T * B, nh * P):totable()
    local w = m:parameters()["norm.weight"]:flat()
    for r = 1, T * B do
      for g0 = 0, nh * P - 1, 6 do
        local ss = 0
        for c = 1, 6 do ss = ss + y[r][g0 + c] ^ 2 end
        local rstd = 1 / math.sqrt(ss / 6 + 1e-5)
        for c = 1, 6 do y[r][g0 + c] = y[r][g0 + c] * rstd * w[g0 + c] end
      end
    end
    local ref = gdp.matmul(gdp.tensor(y, { dtype = "f64" }), m:parameters()["out_proj.weight"],
                           { trans_b = true }):view(T, B, 6)
    assert.tensor_near(m:forward(x), ref, 1e-12, "out")
  end)

  it("refuses context parallelism and non-boolean switches", function()
    local ok, err = pcall(nn.GatedDeltaProduct, { hidden_size = 4, num_heads = 2, head_dim = 2,
                                                 state_dim = 2, use_output_gate = "no" })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("use_output_gate: expected true or false, got no", 1, true), tostring(err))
    local c = {}
    for k, v in pairs(cfg) do c[k] = v end
    c.cp_mode, c.cp_group = "chunkwise", gdp.comm.self()
    ok, err = pcall(nn.GatedDeltaProduct, c)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("context parallelism needs use_short_conv", 1, true), tostring(err))
  end)
end)

describe("nn.GatedDeltaProduct packing", function()
  local cfg = { hidden_size = 8, num_heads = 4, head_dim = 3, num_groups = 2, state_dim = 4,
                num_householder = 2, D = "head", dtype = "f64", seed = 7 }

  it("a packed batch equals its sequences run one by one (no leak across starts)", function()
    H.reseed(11)
    local m = nn.GatedDeltaProduct(cfg)
    local cu = { 0, 3, 3, 8, 9, 14 }
    local x = gdp.randn({ 14, 1, 8 }, { dtype = "f64" })
    local packed = m:forward(x, cu)
    for s = 1, #cu - 1 do
      local len = cu[s + 1] - cu[s]
      if len > 0 then
        local xs = x:narrow(1, cu[s] + 1, len):contiguous()
        local alone = m:forward(xs)
        assert.tensor_near(packed:narrow(1, cu[s] + 1, len):contiguous(), alone, 1e-12)
      end
    end
  end)

  it("B columns equal the same sequences packed", function()
    H.reseed(12)
    local m = nn.GatedDeltaProduct(cfg)
    local T = 6
    local x = gdp.randn({ T, 2, 8 }, { dtype = "f64" })
    local dy = gdp.randn({ T, 2, 8 }, { dtype = "f64" })
    local out = m:forward(x)
    m:zero_grad()
    local dx = m:backward(x, dy)
    local g_unpacked = m:gradients()["in_proj.weight"]:clone()
    -- pack: [T,2,D] -> columns one after the other [2T,1,D]
    local xp = gdp.zeros({ 2 * T, 1, 8 }, { dtype = "f64" })
    local dyp = gdp.zeros({ 2 * T, 1, 8 }, { dtype = "f64" })
    for b = 1, 2 do
      xp:narrow(1, (b - 1) * T + 1, T):select(2, 1):copy(x:select(2, b))
      dyp:narrow(1, (b - 1) * T + 1, T):select(2, 1):copy(dy:select(2, b))
    end
    local cu = { 0, T, 2 * T }
    local outp = m:forward(xp, cu)
    m:zero_grad()
    local dxp = m:backward(xp, dyp, cu)
    for b = 1, 2 do
      assert.tensor_near(outp:narrow(1, (b - 1) * T + 1, T):select(2, 1):contiguous(),
                         out:select(2, b):contiguous(), 1e-12)
      assert.tensor_near(dxp:narrow(1, (b - 1) * T + 1, T):select(2, 1):contiguous(),
                         dx:select(2, b):contiguous(), 1e-12)
    end
    assert.tensor_near(m:gradients()["in_proj.weight"], g_unpacked, 1e-12)
  end)
end)

describe("nn.GatedDeltaProduct parameters", function()
  local base = { hidden_size = 16, num_heads = 4, head_dim = 8, num_groups = 2, state_dim = 8,
                 num_householder = 3, D = "channel", seed = 3 }

  it("has Megatron's names and shapes", function()
    local m = nn.GatedDeltaProduct(base)
    local d_inner, C = 32, 3 * 32 + 3 * 2 * 8 + 2 * 8
    local want = {
      ["in_proj.weight"] = { d_inner + C + 3 * 4 + 4, 16 },
      ["conv1d.weight"] = { C, 1, 4 }, ["conv1d.bias"] = { C },
      dt_bias = { 4 }, A_log = { 4 }, D = { d_inner }, ["norm.weight"] = { d_inner },
      ["out_proj.weight"] = { 16, d_inner },
    }
    local n = 0
    for name, t in pairs(m:parameters()) do
      n = n + 1
      assert.are.same(want[name], t:shape(), name)
      assert.are.same(want[name], m:gradients()[name]:shape(), "grad " .. name)
      assert.are.equal("f64", t:dtype())
    end
    assert.are.equal(8, n)
    assert.are.same({ "in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                      "norm.weight", "out_proj.weight" }, m:parameter_names())
    local m2 = nn.GatedDeltaProduct{ hidden_size = 8, num_heads = 2, head_dim = 4, state_dim = 4,
                                     conv_bias = false, D = "head", dtype = "f32" }
    assert.is_nil(m2:parameters()["conv1d.bias"])
    assert.are.same({ 2 }, m2:parameters().D:shape())
    assert.are.equal("f32", m2:parameters()["in_proj.weight"]:dtype())
  end)

  it("initialises like Megatron and is reproducible from its seed", function()
    gdp.manual_seed(5)
    local before = gdp.randn({ 4 }, { dtype = "f64" }):flat()
    gdp.manual_seed(5)
    local m = nn.GatedDeltaProduct(base)
    local after = gdp.randn({ 4 }, { dtype = "f64" }):flat()
    assert.are.same(before, after) -- a seeded module leaves the global stream alone
    local m_again = nn.GatedDeltaProduct(base)
    for name, t in pairs(m:parameters()) do
      assert.are.equal(0, gdp.rel_error(m_again:parameters()[name], t), name)
    end
    local p = m:parameters()
    for _, a in ipairs(p.A_log:flat()) do
      assert.is_true(math.exp(a) > 0 and math.exp(a) < 16)
    end
    for _, b in ipairs(p.dt_bias:flat()) do
      local dt = b > 20 and b or math.log(1 + math.exp(b)) -- softplus(dt_bias) = dt
      assert.is_true(dt >= 1e-3 * (1 - 1e-9) and dt <= 1e-1 * (1 + 1e-9), "dt " .. dt)
    end
    assert.are.equal(32, p["norm.weight"]:sum())
    assert.are.equal(32, p.D:sum())
    assert.is_true(p["conv1d.weight"]:max_abs() <= 0.5 and p["conv1d.bias"]:max_abs() <= 0.5)
    local w = p["in_proj.weight"]
    local std = w:norm() / math.sqrt(w:numel())
    assert.is_true(std > 0.018 and std < 0.022, "in_proj std " .. std)
    local wo = p["out_proj.weight"]
    local std_o = wo:norm() / math.sqrt(wo:numel())
    assert.is_true(std_o > 0.012 and std_o < 0.016, "out_proj std " .. std_o)
  end)

  it("accumulates gradients until zero_grad", function()
    H.reseed(21)
    local m = nn.GatedDeltaProduct(base)
    local x = gdp.randn({ 5, 2, 16 }, { dtype = "f64" })
    local dy = gdp.randn({ 5, 2, 16 }, { dtype = "f64" })
    m:forward(x)
    m:backward(x, dy)
    local once = {}
    for name, g in pairs(m:gradients()) do once[name] = g:clone() end
    m:backward(x, dy)
    for name, g in pairs(m:gradients()) do
      assert.tensor_near(g, once[name] * 2, 1e-14)
    end
    m:zero_grad()
    for name, g in pairs(m:gradients()) do assert.are.equal(0, g:max_abs(), name) end
  end)

  it("saves and loads safetensors under Megatron's names", function()
    local m = nn.GatedDeltaProduct(base)
    local path = os.tmpname()
    m:save(path)
    local t, meta = gdp.load(path)
    assert.are.equal("GatedDeltaProduct", meta.layer)
    assert.are.equal("channel", meta.D)
    for _, name in ipairs(m:parameter_names()) do assert.is_not_nil(t[name], name) end
    local other = nn.GatedDeltaProduct{ hidden_size = 16, num_heads = 4, head_dim = 8,
                                        num_groups = 2, state_dim = 8, num_householder = 3,
                                        D = "channel", seed = 99, dtype = "f32" }
    other:load(path)
    for name, p in pairs(m:parameters()) do
      assert.tensor_near(other:parameters()[name], p, 1e-7)
    end
    -- a file of another configuration is refused with the parameter's name
    local small = nn.GatedDeltaProduct{ hidden_size = 8, num_heads = 2, head_dim = 4, state_dim = 4 }
    H.expect_error(function() small:load(path) end, "in_proj.weight", "expected shape")
    os.remove(path)
  end)
end)

describe("nn.GatedDeltaProduct errors", function()
  it("checks its options", function()
    H.expect_error(function() nn.GatedDeltaProduct{ hidden_size = 8, num_heads = 3, head_dim = 2,
                                                    num_groups = 2, state_dim = 4 } end,
                   "num_groups: expected a divisor of num_heads = 3, got 2")
    H.expect_error(function() nn.GatedDeltaProduct{ hidden_size = 8, num_heads = 2, head_dim = 2,
                                                    state_dim = 4, D = "yes" } end,
                   "D: expected false, \"head\" or \"channel\"")
    H.expect_error(function() nn.GatedDeltaProduct{ hidden_size = 8, num_heads = 2, head_dim = 2,
                                                    state_dim = 4, num_housholder = 2 } end,
                   "unknown option 'num_housholder'")
    H.expect_error(function() nn.GatedDeltaProduct{ num_heads = 2, head_dim = 2, state_dim = 4 } end,
                   "hidden_size must be an integer >= 1")
  end)

  it("checks x", function()
    local m = nn.GatedDeltaProduct{ hidden_size = 8, num_heads = 2, head_dim = 2, state_dim = 4 }
    H.expect_error(function() m:forward(gdp.zeros({ 4, 1, 7 }, { dtype = "f64" })) end,
                   "x: expected [T,B,8]", "got [4x1x7]")
    H.expect_error(function() m:forward(gdp.zeros({ 4, 1, 8 }, { dtype = "f32" })) end,
                   "x: expected dtype f64 (the module's), got f32")
    H.expect_error(function() m:forward(gdp.zeros({ 4, 2, 8 }, { dtype = "f64" }), { 0, 4 }) end,
                   "packed sequences need B = 1")
    H.expect_error(function() m:forward(gdp.zeros({ 4, 1, 8 }, { dtype = "f64" }), { 0, 3 }) end,
                   "expected the last entry = T = 4")
    local x = gdp.randn({ 4, 1, 8 }, { dtype = "f64" })
    H.expect_error(function() m:backward(x, gdp.zeros({ 4, 1, 7 }, { dtype = "f64" })) end,
                   "dy: expected the shape of x")
    H.assert_alive()
  end)
end)

describe("nn.functional", function()
  it("conv1d: restarts, halo, and the C library's shape errors", function()
    H.reseed(31)
    local x = gdp.randn({ 7, 1, 3 }, { dtype = "f64" })
    local w = gdp.randn({ 3, 1, 4 }, { dtype = "f64" })
    local halo = gdp.randn({ 3, 1, 3 }, { dtype = "f64" })
    local y = F.conv1d(x, w, nil, { activation = "silu", cu_seqlens = { 0, 2, 7 }, halo = halo })
    -- the second sequence sees neither the first one nor the halo
    local alone = F.conv1d(x:narrow(1, 3, 5):contiguous(), w, nil, { activation = "silu" })
    assert.tensor_near(y:narrow(1, 3, 5):contiguous(), alone, 1e-15)
    -- the first one continues the halo: same as convolving [halo; x] and dropping the halo
    local joined = gdp.zeros({ 5, 1, 3 }, { dtype = "f64" })
    joined:narrow(1, 1, 3):copy(halo)
    joined:narrow(1, 4, 2):copy(x:narrow(1, 1, 2))
    local ref = F.conv1d(joined, w, nil, { activation = "silu" }):narrow(1, 4, 2):contiguous()
    assert.tensor_near(y:narrow(1, 1, 2):contiguous(), ref, 1e-15)
    local g = F.conv1d_backward(x, w, nil, gdp.randn({ 7, 1, 3 }, { dtype = "f64" }),
                                { activation = "silu", cu_seqlens = { 0, 2, 7 }, halo = halo })
    assert.are.same({ 3, 1, 3 }, g.dhalo:shape())
    assert.are.same({ 3, 1, 4 }, g.dweight:shape())
    assert.is_nil(g.dbias)
    -- dx into a destination whose rows are not evenly spaced (staged), and into f32
    local d_out = gdp.randn({ 7, 2, 3 }, { dtype = "f64" })
    local x2 = gdp.randn({ 7, 2, 3 }, { dtype = "f64" })
    local plain = F.conv1d_backward(x2, w, nil, d_out, { activation = "silu" }).dx
    local odd = gdp.empty({ 2, 7, 3 }, { dtype = "f64" }):permute(2, 1, 3)
    assert.are.equal(odd, F.conv1d_backward(x2, w, nil, d_out, { activation = "silu", dx = odd }).dx)
    assert.tensor_near(odd, plain, 1e-15)
    local low = gdp.empty({ 7, 2, 3 }, { dtype = "f32" })
    F.conv1d_backward(x2, w, nil, d_out, { activation = "silu", dx = low })
    assert.tensor_near(low, plain, 1e-6)
    -- x read in place from wider rows, dx written into a slice: as the contiguous ones
    local wide = gdp.randn({ 7, 2, 8 }, { dtype = "f64" })
    wide:narrow(3, 4, 3):copy(x2)
    local xs, dxs = wide:narrow(3, 4, 3), gdp.zeros({ 7, 2, 8 }, { dtype = "f64" }):narrow(3, 2, 3)
    local gs = F.conv1d_backward(xs, w, nil, d_out, { activation = "silu", dx = dxs, cu_seqlens = nil })
    local gc = F.conv1d_backward(x2, w, nil, d_out, { activation = "silu" })
    assert.tensor_near(F.conv1d(xs, w, nil, { activation = "silu" }), F.conv1d(x2, w, nil, { activation = "silu" }), 1e-15)
    assert.tensor_near(dxs, gc.dx, 1e-15)
    assert.tensor_near(gs.dweight, gc.dweight, 1e-15)
    H.expect_error(function() F.conv1d_backward(x2, w, nil, d_out, { dx = gdp.empty({ 7, 2, 4 }, { dtype = "f64" }) }) end,
                   "dx: expected the shape of x [T,B,C], [7x2x3], got [7x2x4]")
    H.expect_error(function() F.conv1d(x, gdp.zeros({ 4, 4 }, { dtype = "f64" })) end,
                   "GDP_ERR_SHAPE", "weight: expected [C,W] or [C,1,W] with C = 3")
    H.expect_error(function() F.conv1d(x, w, nil, { activation = "relu" }) end,
                   "activation: expected \"none\" or \"silu\"")
  end)

  it("gates, norm, repeat_heads and D skip round-trip shapes", function()
    H.reseed(32)
    local b = gdp.randn({ 5, 2, 6 }, { dtype = "f32" })
    local beta = F.beta(b, 2)
    assert.is_true(beta:max_abs() < 2)
    local a = gdp.randn({ 5, 2, 3 }, { dtype = "f32" })
    local A_log = gdp.zeros({ 3 }, { dtype = "f32" })
    local g = F.decay(a, A_log, nil)
    assert.is_true(g:max_abs() > 0)
    for _, v in ipairs(g:flat()) do assert.is_true(v <= 0) end
    local q = gdp.randn({ 5, 2, 2, 4 }, { dtype = "f64" })
    local rep = F.repeat_heads(q, 6)
    assert.are.same({ 5, 2, 6, 4 }, rep:shape())
    assert.tensor_near(F.repeat_heads_backward(rep, 2), q * 3, 1e-15)
    H.expect_error(function() F.repeat_heads(q, 5) end, "num_heads: expected a multiple of the group count G = 2")
    local y = gdp.randn({ 4, 3, 5 }, { dtype = "f64" })
    local out = F.gated_rmsnorm(y, nil, gdp.ones({ 5 }, { dtype = "f64" }), 5, 0)
    for r = 1, 4 do
      local ms = 0
      for c = 1, 5 do ms = ms + out:get(r, 1, c) ^ 2 end
      assert.is_true(math.abs(ms / 5 - 1) < 1e-12)
    end
    H.expect_error(function() F.dskip(y, y, gdp.ones({ 4 }, { dtype = "f64" })) end,
                   "D: expected H = 3 values (per head) or H*P = 15 (per channel)")
  end)
end)

-- spec/helper.lua's check of A_log and dt_bias against their summed per-token terms
-- (the bf16 cuda specs use it): it passes a correct float32 layer and fails a gradient
-- off by 1% of the terms of one head.
describe("the gate-parameter gradients against their summed terms", function()
  it("pass a float32 layer against float64 and catch a wrong one", function()
    gdp_test.reseed(5)
    local function cfg(dtype)
      return { hidden_size = 32, num_heads = 4, head_dim = 8, num_groups = 2, state_dim = 16,
               num_householder = 2, dtype = dtype, seed = 3 }
    end
    local ref, m = nn.GatedDeltaProduct(cfg("f64")), nn.GatedDeltaProduct(cfg("f32"))
    m:set_parameters(ref:parameters())
    ref:set_parameters(m:parameters())
    local cu = { 0, 11, 40 }
    local x = gdp.randn({ 40, 1, 32 }, { dtype = "f64" }):to("f32")
    local dy = gdp.randn({ 40, 1, 32 }, { dtype = "f64" }):to("f32")
    local rec = gdp_test.record_mixer_grads(ref)
    m:backward(x, dy, cu)
    ref:backward(x:to("f64"), dy:to("f64"), cu)
    gdp_test.assert_model_grads_near(m:gradients(), ref:gradients(), m:parameter_names(), 1e-4, rec, true)
    local S = gdp_test.gate_term_scales(ref, rec[""].dy)
    local v = m:gradients()["dt_bias"]:flat()
    v[2] = v[2] + 0.01 * S.dt_bias[2]
    local bad = gdp.tensor(v, { #v }, { dtype = "f32" })
    assert.has_error(function()
      gdp_test.assert_gate_sum_near(bad, ref:gradients()["dt_bias"], S.dt_bias, 1e-3, "dt_bias")
    end)
  end)
end)
