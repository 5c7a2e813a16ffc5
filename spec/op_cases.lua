-- The operator case tables (ggml's test-backend-ops idea): every case is listed once
-- and run on every device the library has (gdp_op_spec.lua) against the float64 oracle
-- -- algorithm = "recurrent" in float64 on the cpu, on the inputs rounded to the run's
-- dtype -- within ops.TOLERANCE[dtype].  Not a spec file (no _spec suffix): the specs
-- require it.
local gdp = require("gdp")
local ops = gdp.ops

local M = {}

M.GRADS = { "dq", "dk", "dv", "dbeta", "dg", "dh0" }

-- Token dtypes each device runs by default (cuda has no float64 operator).
M.DTYPES = { cpu = { "f64", "f32", "bf16" }, cuda = { "f32", "bf16" } }

-- The shapes the CUDA fast path takes (kernels/cuda; README's support matrix): bf16,
-- n = 1..8, K <= 256, V <= 256 (the kernels' instances are K, V in {32, 64, 128} and
-- K = 256 with V = 128 at n = 2; other widths run zero-padded to the next, other n as
-- tokens of fewer steps, V = 256 as two halves).  Elsewhere cuda runs the recurrent
-- kernels.
function M.fast_path(case, dtype)
  return dtype == "bf16" and case.n >= 1 and case.n <= 8 and case.K <= 256 and case.V <= 256
end

-- The GDP operator.  Fields: B, T, H, K, V, n; gated (true), initial_state (false),
-- cu_seqlens (nil; then B = 1), beta_max (1: beta in (0,1); 2: (0,2), negative
-- eigenvalues), g_min/g_max (log decays, -0.2..-0.01), l2norm (true; false: keys are
-- normalised on the host, so the recurrence stays contractive), chunk_sizes (cpu:
-- extra float64 chunk runs at these sizes), dtypes = {cpu = ..., cuda = ...} (default
-- M.DTYPES).  Each case also runs its backward plain and from a saved forward.
M.gdp = {
  -- small and odd: every algorithm the cpu has; on cuda all fall to the recurrent kernels
  { name = "gated n=2 with h0", B = 2, T = 37, H = 3, K = 12, V = 10, n = 2, initial_state = true,
    chunk_sizes = { 16, 37 } },
  { name = "Gated DeltaNet n=1", B = 1, T = 70, H = 2, K = 16, V = 8, n = 1 },
  { name = "ungated n=3", B = 2, T = 29, H = 2, K = 8, V = 12, n = 3, gated = false },
  { name = "n=4, beta in (0,2), with h0", B = 1, T = 33, H = 2, K = 10, V = 6, n = 4, beta_max = 2,
    initial_state = true },
  { name = "packed with empty sequences (first, inside, last)", B = 1, T = 61, H = 2, K = 12, V = 9,
    n = 2, cu_seqlens = { 0, 0, 17, 17, 50, 61, 61 }, initial_state = true },
  { name = "strong decay", B = 1, T = 40, H = 1, K = 8, V = 8, n = 2, g_min = -3, g_max = -0.5 },
  { name = "no in-kernel L2 norm (unit-norm keys)", B = 1, T = 31, H = 2, K = 8, V = 5, n = 2,
    l2norm = false },
  -- chunk sizes that do not divide T*n, of one step, and far past any sequence (the cpu
  -- workspaces are sized by the steps a chunk can hold, not by chunk_size)
  { name = "odd chunk sizes, packed", B = 1, T = 45, H = 2, K = 8, V = 8, n = 3, initial_state = true,
    beta_max = 2, cu_seqlens = { 0, 5, 5, 45 }, chunk_sizes = { 1, 16, 32, 64, 100000, 2 ^ 40 },
    dtypes = { cpu = { "f64" }, cuda = { "f32", "bf16" } } },

  -- the CUDA fast path's instance shapes (bf16, n = 1..8, K, V in {32, 64, 128}), packed with an
  -- empty sequence and odd lengths; f32 on cuda and every dtype on the cpu run them too
  { name = "fast path K=V=64 n=1", B = 1, T = 150, H = 2, K = 64, V = 64, n = 1, initial_state = true,
    cu_seqlens = { 0, 40, 40, 150 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=V=64 n=2", B = 1, T = 150, H = 2, K = 64, V = 64, n = 2, initial_state = true,
    cu_seqlens = { 0, 40, 40, 150 }, dtypes = { cpu = { "bf16" } } },
  { name = "fast path K=64 V=128 n=3", B = 1, T = 150, H = 2, K = 64, V = 128, n = 3, initial_state = true,
    cu_seqlens = { 0, 40, 40, 150 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=128 V=64 n=1, B=2", B = 2, T = 77, H = 2, K = 128, V = 64, n = 1, initial_state = true,
    dtypes = { cpu = { "bf16" } } },
  { name = "fast path K=V=128 n=2, about 300 tokens", B = 1, T = 300, H = 2, K = 128, V = 128, n = 2,
    initial_state = true, cu_seqlens = { 0, 130, 130, 300 }, dtypes = { cpu = { "f64" } } },
  { name = "fast path K=V=64 n=3, ungated, beta in (0,2), no h0, no L2 norm", B = 1, T = 97, H = 2,
    K = 64, V = 64, n = 3, gated = false, beta_max = 2, l2norm = false, dtypes = { cpu = { "f32" } } },
  -- n = 4 (C = 64 steps, 16 tokens a chunk) and K or V = 32 (the width-32 instances)
  { name = "fast path K=V=32 n=4 H=8 (DeltaProduct state tracking), packed, beta in (0,2)", B = 1, T = 150,
    H = 8, K = 32, V = 32, n = 4, beta_max = 2, initial_state = true, cu_seqlens = { 0, 0, 37, 37, 150 },
    dtypes = { cpu = { "f32" } } },
  { name = "fast path K=32 V=64 n=2, ungated, odd lengths", B = 1, T = 97, H = 2, K = 32, V = 64, n = 2,
    gated = false, cu_seqlens = { 0, 33, 33, 97 }, dtypes = { cpu = { "bf16" } } },
  { name = "fast path K=64 V=32 n=1, no L2 norm, with h0", B = 2, T = 45, H = 2, K = 64, V = 32, n = 1,
    l2norm = false, initial_state = true, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=V=128 n=4, packed, with h0", B = 1, T = 83, H = 2, K = 128, V = 128, n = 4,
    initial_state = true, cu_seqlens = { 0, 19, 19, 83 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=128 V=32 n=4, ungated, beta in (0,2)", B = 1, T = 70, H = 2, K = 128, V = 32, n = 4,
    gated = false, beta_max = 2, cu_seqlens = { 0, 41, 70 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=V=64 n=4, about 200 tokens", B = 1, T = 200, H = 2, K = 64, V = 64, n = 4,
    initial_state = true, cu_seqlens = { 0, 131, 131, 200 }, dtypes = { cpu = { "bf16" } } },
  -- n = 5..8: padded to 6 or 8 steps, run as 2 tokens of 3 or 4 (8 tokens a chunk)
  { name = "fast path K=V=64 n=5, packed, with h0", B = 1, T = 61, H = 2, K = 64, V = 64, n = 5,
    initial_state = true, cu_seqlens = { 0, 23, 23, 61 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=V=32 n=6 H=8, ungated, beta in (0,2)", B = 1, T = 45, H = 8, K = 32, V = 32, n = 6,
    gated = false, beta_max = 2, cu_seqlens = { 0, 0, 19, 45 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=128 V=64 n=7, B=2", B = 2, T = 29, H = 2, K = 128, V = 64, n = 7,
    initial_state = true, dtypes = { cpu = { "bf16" } } },
  { name = "fast path K=V=32 n=7 H=8, beta in (0,2)", B = 1, T = 40, H = 8, K = 32, V = 32, n = 7,
    beta_max = 2, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=V=32 n=5 H=8, packed, odd lengths, h0", B = 1, T = 41, H = 8, K = 32, V = 32, n = 5,
    initial_state = true, beta_max = 2, cu_seqlens = { 0, 13, 13, 41 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=V=32 n=8, packed, no L2 norm", B = 1, T = 50, H = 2, K = 32, V = 32, n = 8,
    l2norm = false, initial_state = true, cu_seqlens = { 0, 17, 17, 50 }, dtypes = { cpu = { "f32" } } },
  -- V = 256: the plain forward in one prep and one state pass over all columns, the
  -- saving forward and the backward as two problems of V = 128 on the column halves
  { name = "fast path K=64 V=256 n=2, packed, with h0", B = 1, T = 70, H = 2, K = 64, V = 256, n = 2,
    initial_state = true, cu_seqlens = { 0, 29, 29, 70 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=128 V=256 n=2 B=2, with h0 (chunkwise CP's local run and transition)", B = 2, T = 45,
    H = 3, K = 128, V = 256, n = 2, initial_state = true, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=32 V=256 n=6, ungated", B = 1, T = 40, H = 2, K = 32, V = 256, n = 6, gated = false,
    initial_state = true, dtypes = { cpu = { "f32" } } },

  -- K = 256: its one instance (n = 2, V = 128; 16-token chunks), the others through it:
  -- V < 128 padded to 128, V = 256 by halves, K between 128 and 256 padded, and every
  -- other n padded to 2, 4 or 8 steps and run as 1, 2 or 4 tokens of 2
  { name = "fast path K=256 V=128 n=2, packed with empty sequences, with h0", B = 1, T = 75, H = 2, K = 256,
    V = 128, n = 2, initial_state = true, cu_seqlens = { 0, 0, 33, 33, 75 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=256 V=128 n=1 (2 steps a token), beta in (0,2)", B = 2, T = 40, H = 2, K = 256, V = 128,
    n = 1, beta_max = 2, initial_state = true, dtypes = { cpu = { "bf16" } } },
  { name = "fast path K=256 V=64 n=4, ungated, packed", B = 1, T = 45, H = 2, K = 256, V = 64, n = 4,
    gated = false, cu_seqlens = { 0, 17, 45 }, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=200 V=128 n=5 (K padded, 4 tokens of 2 steps), with h0", B = 1, T = 30, H = 2, K = 200,
    V = 128, n = 5, beta_max = 2, initial_state = true, dtypes = { cpu = { "f32" } } },
  { name = "fast path K=144 V=96 n=2 (padded to 256 x 128), no L2 norm", B = 1, T = 50, H = 2, K = 144, V = 96,
    n = 2, l2norm = false, initial_state = true, cu_seqlens = { 0, 21, 50 }, dtypes = { cpu = { "f32" } } },

  -- widths between the instances' (zero-padded to the next on the cuda fast path:
  -- K=48 V=96, K=32 V=16, K=100 V=200, K=256 V=40) and past the fast path (n = 9: the
  -- recurrent kernels on cuda)
  { name = "K=48 V=96 n=2 (padded to 64 x 128)", B = 1, T = 150, H = 2, K = 48, V = 96, n = 2,
    initial_state = true, cu_seqlens = { 0, 40, 40, 150 }, dtypes = { cpu = { "f32" } } },
  { name = "K=32 V=16 n=4 (V padded to 32)", B = 1, T = 150, H = 2, K = 32, V = 16, n = 4, initial_state = true,
    cu_seqlens = { 0, 40, 40, 150 }, dtypes = { cpu = { "f32" } } },
  { name = "K=V=256 n=2", B = 1, T = 60, H = 1, K = 256, V = 256, n = 2, initial_state = true,
    dtypes = { cpu = { "f32" } } },
  { name = "K=256 V=40 n=3", B = 1, T = 50, H = 2, K = 256, V = 40, n = 3, initial_state = true,
    cu_seqlens = { 0, 20, 20, 50 }, dtypes = { cpu = { "bf16" } } },
  { name = "K=100 V=200 n=1 (padded to 128 x 256, then halves)", B = 1, T = 90, H = 2, K = 100, V = 200, n = 1, initial_state = true,
    dtypes = { cpu = { "f32" } } },
  { name = "K=V=64 n=9 (n > 8)", B = 1, T = 60, H = 2, K = 64, V = 64, n = 9, initial_state = true,
    cu_seqlens = { 0, 23, 23, 60 }, dtypes = { cpu = { "f32" } } },

  -- g (and so dg) in float32 beside bf16 tokens, as the bf16 mixer hands it over: the
  -- fast path and the recurrent kernels
  { name = "f32 gate, fast path K=V=64 n=2, packed", B = 1, T = 150, H = 2, K = 64, V = 64, n = 2,
    gate_f32 = true, initial_state = true, cu_seqlens = { 0, 40, 40, 150 },
    dtypes = { cpu = { "bf16" }, cuda = { "bf16" } } },
  { name = "f32 gate, fast path K=V=128 n=3", B = 2, T = 70, H = 2, K = 128, V = 128, n = 3,
    gate_f32 = true, dtypes = { cpu = { "bf16" }, cuda = { "bf16" } } },
  { name = "f32 gate, fast path K=V=32 n=4", B = 1, T = 60, H = 2, K = 32, V = 32, n = 4,
    gate_f32 = true, beta_max = 2, cu_seqlens = { 0, 25, 60 },
    dtypes = { cpu = { "bf16" }, cuda = { "bf16" } } },
}

-- Each case's seed salt is its place in the table.
for i, case in ipairs(M.gdp) do case.salt = 1000 + i end

function M.label(case)
  return string.format("%s [B=%d T=%d H=%d K=%d V=%d n=%d]", case.name, case.B, case.T, case.H,
                       case.K, case.V, case.n)
end

-- The dtype g (and dg) take in a run of `dtype`: float32 beside bf16 tokens where the
-- case says gate_f32, else the tokens' dtype.
function M.gate_dtype(case, dtype)
  return (case.gate_f32 and dtype == "bf16") and "f32" or dtype
end

function M.dtypes(case, device)
  return (case.dtypes and case.dtypes[device]) or M.DTYPES[device]
end

-- The runs of one case in one dtype on one device: {algorithm =, save =, chunk_size =}.
--   cpu: the chunk kernels (f64, f32; bf16 computes in f32 under "auto"), plain and
--        saving (the cpu keeps nothing and recomputes: one saving run per dtype), and
--        the case's chunk sizes in f64.  "recurrent" on the cpu is the oracle itself.
--   cuda: "auto" and "recurrent", and "chunk" where the fast path takes the shape
--        (elsewhere "chunk" is an error: gdp_op_spec's dispatch specs); each plain and
--        saving.
function M.gdp_runs(case, dtype, device)
  local runs = {}
  if device == "cpu" then
    local algo = dtype == "bf16" and "auto" or "chunk"
    runs[1] = { algorithm = algo }
    runs[2] = { algorithm = algo, save = true }
    if dtype == "f64" then
      for _, cs in ipairs(case.chunk_sizes or {}) do runs[#runs + 1] = { algorithm = "chunk", chunk_size = cs } end
    end
  else
    local algos = { "auto", "recurrent" }
    if M.fast_path(case, dtype) then algos[3] = "chunk" end
    for _, a in ipairs(algos) do
      runs[#runs + 1] = { algorithm = a }
      runs[#runs + 1] = { algorithm = a, save = true }
    end
  end
  return runs
end

-- Normalises the rows of k [B,T*n,H,K] on the host (for cases without the in-kernel L2
-- norm: unit keys keep beta * ||k||^2 below 2).
local function unit_keys(k)
  local t = k:totable()
  for _, b in ipairs(t) do for _, row in ipairs(b) do for _, head in ipairs(row) do
    local s = 0
    for _, x in ipairs(head) do s = s + x * x end
    s = math.sqrt(s)
    for i = 1, #head do head[i] = head[i] / s end
  end end end
  return gdp.tensor(t, { dtype = k:dtype() })
end

-- Fresh float64 cpu inputs of a case (with do and dht) from the current seed.
function M.gdp_inputs(case)
  local args = ops.random_inputs({
    B = case.B, T = case.T, H = case.H, K = case.K, V = case.V, n = case.n, grads = true,
    gated = case.gated, initial_state = case.initial_state, cu_seqlens = case.cu_seqlens,
    beta_max = case.beta_max, g_min = case.g_min, g_max = case.g_max,
    use_qk_l2norm_in_kernel = case.l2norm ~= false,
  })
  if case.l2norm == false then args.k = unit_keys(args.k) end
  return args
end

-- The float64 cpu recurrence on the inputs rounded to `dtype` first: o, ht and the
-- gradients.  Rounding first keeps the comparison about the kernels: dg is
-- ill-conditioned under bf16 input rounding on some draws, so against the unrounded
-- inputs a correct bf16 kernel can sit just over 1e-2.
function M.gdp_oracle(args, dtype, gate_dtype)
  local rounded = ops.convert_inputs(args, dtype, "cpu")
  if rounded.g and gate_dtype then rounded.g = args.g:to({ dtype = gate_dtype }) end
  local ref = ops.convert_inputs(rounded, "f64", "cpu")
  ref.algorithm = "recurrent"
  local o, ht = ops.chunk_gated_delta_product(ref)
  return { o = o, ht = ht, grads = ops.chunk_gated_delta_product_backward(ref) }
end

-- Runs the forward and the backward of `args` (float64 cpu inputs) in `dtype` (g in
-- `gate_dtype`, default the same) on `device` as `run` says; returns o, ht, grads and
-- the saved block's size (nil when not saving).
function M.gdp_run(args, dtype, device, run, gate_dtype)
  local a = ops.convert_inputs(args, dtype, device)
  if a.g and gate_dtype then a.g = args.g:to({ dtype = gate_dtype, device = device }) end
  a.algorithm, a.chunk_size = run.algorithm, run.chunk_size
  local o, ht, saved, bytes
  if run.save then
    a.save_for_backward = true
    o, ht, saved = ops.chunk_gated_delta_product(a)
    a.save_for_backward, a.saved = nil, saved
    bytes = saved:bytes()
  else
    o, ht = ops.chunk_gated_delta_product(a)
  end
  local grads = ops.chunk_gated_delta_product_backward(a)
  if saved then saved:free() end
  return o, ht, grads, bytes
end

function M.run_label(run)
  return run.algorithm .. (run.chunk_size and (" chunk_size " .. string.format("%.0f", run.chunk_size)) or "")
         .. (run.save and ", saving" or "")
end

-- The mixer ops (nn.functional): each case makes float64 cpu inputs (`inputs`, from the
-- current seed) and runs its forward and backward (`run`, on inputs of any dtype and
-- device), returning named results; gdp_op_spec.lua's mixer part compares every result
-- in each dtype on each device with the float64 cpu run.  The ops' own float64 oracle
-- (loops written apart from the kernels), finite differences and strided inputs are
-- core/tests/test_mixer_ops.c's.
local F = require("gdp.nn.functional")
local function randn(shape) return gdp.randn(shape, { dtype = "f64" }) end
local function uniform(shape, lo, hi) return gdp.empty(shape, { dtype = "f64" }):uniform_(lo, hi) end

local function conv_case(name, T, B, C, W, o)
  return {
    name = string.format("conv1d %s [T=%d B=%d C=%d W=%d]", name, T, B, C, W),
    inputs = function()
      return { x = randn({ T, B, C }), weight = randn({ C, W }), bias = o.bias and randn({ C }) or nil,
               halo = o.halo and randn({ o.halo, B, C }) or nil, d_out = randn({ T, B, C }) }
    end,
    run = function(a)
      local opts = { activation = o.activation, cu_seqlens = o.cu, halo = a.halo }
      local g = F.conv1d_backward(a.x, a.weight, a.bias, a.d_out, opts)
      return { out = F.conv1d(a.x, a.weight, a.bias, opts), dx = g.dx, dweight = g.dweight,
               dbias = g.dbias, dhalo = g.dhalo }
    end,
  }
end

M.mixer = {
  conv_case("+ bias, SiLU", 17, 2, 6, 4, { bias = true, activation = "silu" }),
  conv_case("packed (empty, one-token), halo 2, SiLU", 23, 1, 5, 3,
            { activation = "silu", cu = { 0, 0, 7, 8, 23 }, halo = 2 }),
  conv_case("no activation, halo longer than W-1", 9, 1, 8, 4, { bias = true, activation = "none", halo = 5 }),
  { name = "beta = 2 sigmoid(b)",
    inputs = function() return { b = randn({ 13, 2, 5 }), d = randn({ 13, 2, 5 }) } end,
    run = function(a) return { beta = F.beta(a.b, 2), db = F.beta_backward(a.b, 2, a.d) } end },
  { name = "decay with dt_bias",
    inputs = function()
      return { a = randn({ 11, 2, 3 }), A_log = uniform({ 3 }, -1, 1), dt_bias = uniform({ 3 }, -1, 1),
               d = randn({ 11, 2, 3 }) }
    end,
    run = function(a)
      local da, dA, ddt = F.decay_backward(a.a, a.A_log, a.dt_bias, a.d)
      return { g = F.decay(a.a, a.A_log, a.dt_bias), da = da, dA_log = dA, ddt_bias = ddt }
    end },
  { name = "decay without dt_bias",
    inputs = function() return { a = randn({ 7, 1, 4 }), A_log = uniform({ 4 }, -1, 1), d = randn({ 7, 1, 4 }) } end,
    run = function(a)
      local da, dA = F.decay_backward(a.a, a.A_log, nil, a.d)
      return { g = F.decay(a.a, a.A_log, nil), da = da, dA_log = dA }
    end },
  { name = "gated RMSNorm, groups of 4, with z",
    inputs = function()
      return { y = randn({ 6, 3, 12 }), z = randn({ 6, 3, 12 }), w = uniform({ 12 }, 0.5, 1.5), d = randn({ 6, 3, 12 }) }
    end,
    run = function(a)
      local dy, dz, dw = F.gated_rmsnorm_backward(a.y, a.z, a.w, 4, 1e-5, a.d)
      return { out = F.gated_rmsnorm(a.y, a.z, a.w, 4, 1e-5), dy = dy, dz = dz, dweight = dw }
    end },
  { name = "RMSNorm without gate, one group",
    inputs = function() return { y = randn({ 9, 7 }), w = uniform({ 7 }, 0.5, 1.5), d = randn({ 9, 7 }) } end,
    run = function(a)
      local dy, _, dw = F.gated_rmsnorm_backward(a.y, nil, a.w, 7, 1e-5, a.d)
      return { out = F.gated_rmsnorm(a.y, nil, a.w, 7, 1e-5), dy = dy, dweight = dw }
    end },
  { name = "D skip per head",
    inputs = function()
      return { y = randn({ 5, 2, 3, 4 }), x = randn({ 5, 2, 3, 4 }), D = uniform({ 3 }, 0.5, 1.5), d = randn({ 5, 2, 3, 4 }) }
    end,
    run = function(a)
      local dx, dD = F.dskip_backward(a.x, a.D, a.d)
      return { out = F.dskip(a.y, a.x, a.D), dx_v = dx, dD = dD }
    end },
  { name = "D skip per channel",
    inputs = function()
      return { y = randn({ 4, 1, 2, 5 }), x = randn({ 4, 1, 2, 5 }), D = uniform({ 10 }, 0.5, 1.5), d = randn({ 4, 1, 2, 5 }) }
    end,
    run = function(a)
      local dx, dD = F.dskip_backward(a.x, a.D, a.d)
      return { out = F.dskip(a.y, a.x, a.D), dx_v = dx, dD = dD }
    end },
  { name = "repeat_heads 2 groups -> 6 heads",
    inputs = function() return { x = randn({ 5, 2, 2, 4 }), d = randn({ 5, 2, 6, 4 }) } end,
    run = function(a) return { out = F.repeat_heads(a.x, 6), dx = F.repeat_heads_backward(a.d, 2) } end },
}
for i, case in ipairs(M.mixer) do case.salt = 3000 + i end

-- Mixer dtypes per device (float64 on the cpu is the reference itself).
M.MIXER_DTYPES = { cpu = { "f32" }, cuda = { "f32" } }

-- A copy of a case's inputs in `dtype` on `device`.
function M.convert(inputs, dtype, device)
  local out = {}
  for key, t in pairs(inputs) do out[key] = t:to({ dtype = dtype, device = device, copy = true }) end
  return out
end

return M
