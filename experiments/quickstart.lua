-- quickstart: a newcomer's first run (under a minute on 2 cores).
--
--   ./gdp experiments/quickstart.lua
--
-- Prints the build and the devices, builds a random Gated DeltaProduct problem (a
-- batch, and a packed variant with an empty sequence), checks the chunk algorithm
-- against the float64 token-by-token recurrence (the oracle) forward and backward,
-- times forward and forward+backward, and repeats the check on the GPU when there is
-- one.  Exits 1 if any check fails.  Read it top to bottom: it is also a tour of the
-- Lua API.

local config = {
  B = 2, T = 512, H = 4, K = 64, V = 64, n = 2,         -- the batched problem
  packed_cu_seqlens = { 0, 100, 100, 357, 512 },         -- the packed one: B = 1, T = 512
  chunk_size = 64,                                       -- the cpu's chunk (CUDA's is fixed by n)
  seed = 42,
  ["repeat"] = 3,                                        -- timing repeats (median)
}

local gdp = require("gdp")
local util = require("gdp.util")
local ops = gdp.ops

print("# gdp " .. gdp.version)
for line in gdp.build_info():gmatch("[^\n]+") do print("#   " .. line) end
print("# devices: " .. table.concat(gdp.devices(), ", "))
gdp.manual_seed(config.seed)
print("# seed: " .. config.seed)

-- Inputs in float64 on the cpu: q, k, v ~ N(0, 1) (q and k are L2-normalised inside the
-- op), beta ~ U(0, 1), g ~ U(-0.2, -0.01), an initial state, and the upstream
-- gradients do and dht of the loss sum(o * do) + sum(ht * dht).
local function problem(packed)
  local cfg = { B = config.B, T = config.T, H = config.H, K = config.K, V = config.V, n = config.n,
                dtype = "f64", initial_state = true, grads = true }
  if packed then
    cfg.B = 1
    cfg.cu_seqlens = config.packed_cu_seqlens
  end
  return ops.random_inputs(cfg)
end

local failures = 0
local rows = {}

-- Runs `args` converted to dtype/device with the chunk algorithm and compares every
-- output and gradient with the oracle's.
local function check(label, args, oracle, dtype, device)
  local run = ops.convert_inputs(args, dtype, device)
  -- cpu: the chunk algorithm at the configured chunk; cuda: "auto", the fast chunked path
  -- where it takes the problem (bf16, n <= 8, K <= 256, V <= 256) and else the recurrent kernels
  if device == "cpu" then
    run.algorithm, run.chunk_size = "chunk", config.chunk_size
  else
    run.algorithm = "auto"
  end
  local o, ht = ops.chunk_gated_delta_product(run)
  local grads = ops.chunk_gated_delta_product_backward(run)
  local got = { o = o, ht = ht, dq = grads.dq, dk = grads.dk, dv = grads.dv, dbeta = grads.dbeta,
                dg = grads.dg, dh0 = grads.dh0 }
  local tol = ops.TOLERANCE[dtype]
  for _, name in ipairs({ "o", "ht", "dq", "dk", "dv", "dbeta", "dg", "dh0" }) do
    local err = gdp.rel_error(got[name]:to({ dtype = "f64", device = "cpu" }), oracle[name])
    local pass = err <= tol -- false for NaN
    if not pass then failures = failures + 1 end
    rows[#rows + 1] = { label, device, dtype, name, err, tol, pass and "PASS" or "FAIL" }
  end
end

local function oracle_of(args)
  local ref = ops.convert_inputs(args, "f64", "cpu")
  ref.algorithm = "recurrent"
  local o, ht = ops.chunk_gated_delta_product(ref)
  local g = ops.chunk_gated_delta_product_backward(ref)
  return { o = o, ht = ht, dq = g.dq, dk = g.dk, dv = g.dv, dbeta = g.dbeta, dg = g.dg, dh0 = g.dh0 }
end

local problems = {
  { label = string.format("batch B=%d T=%d", config.B, config.T), args = problem(false) },
  { label = "packed " .. table.concat(config.packed_cu_seqlens, ","), args = problem(true) },
}
for _, p in ipairs(problems) do p.oracle = oracle_of(p.args) end

for _, p in ipairs(problems) do
  for _, dtype in ipairs({ "f64", "f32" }) do check(p.label, p.args, p.oracle, dtype, "cpu") end
end

-- The GPU, when the library was built with CUDA and sees one.
local cuda_note
if gdp.has_cuda() then
  for _, p in ipairs(problems) do
    for _, dtype in ipairs({ "f32", "bf16" }) do
      local ok, err = pcall(check, p.label, p.args, p.oracle, dtype, "cuda")
      if not ok then
        failures = failures + 1
        rows[#rows + 1] = { p.label, "cuda", dtype, "-", "", "", "ERROR: " .. tostring(err) }
      end
    end
  end
else
  cuda_note = "cuda not available (" .. (gdp.build_info_table().cuda == "no" and "library built without CUDA"
                                          or "no GPU visible") .. ")"
end

print()
print(string.format("# the operator (cpu: chunk algorithm; cuda: auto) vs the float64 recurrence (H=%d K=%d V=%d n=%d): ||x - ref|| / ||ref||",
                    config.H, config.K, config.V, config.n))
print(util.format_table({ "problem", "device", "dtype", "tensor", "rel_err", "tol", "result" }, rows, "%.2e"))
if cuda_note then print("# " .. cuda_note) end

-- Timing: the batched problem in float32, median of a few runs on fresh inputs.
local function time_device(device, dtype)
  local ctx = gdp.device(device)
  local fwd, fb = {}, {}
  for r = 1, config["repeat"] + 1 do
    local args = ops.random_inputs({ B = config.B, T = config.T, H = config.H, K = config.K,
                                     V = config.V, n = config.n, dtype = dtype, device = device,
                                     grads = true })
    ctx:sync()
    local t0 = gdp.time()
    ops.chunk_gated_delta_product(args)
    ctx:sync()
    local t1 = gdp.time()
    ops.chunk_gated_delta_product(args)
    ops.chunk_gated_delta_product_backward(args)
    ctx:sync()
    local t2 = gdp.time()
    if r > 1 then -- the first run warms up
      fwd[#fwd + 1] = t1 - t0
      fb[#fb + 1] = t2 - t1
    end
  end
  local flops = ops.gdp_flops(config.B, config.T, config.H, config.K, config.V, config.n, "forward")
  local t_f, t_fb = util.median(fwd), util.median(fb)
  return {
    { device, dtype, "forward", t_f * 1e3, flops / t_f / 1e9, config.B * config.T / t_f },
    { device, dtype, "forward+backward", t_fb * 1e3, 3 * flops / t_fb / 1e9, config.B * config.T / t_fb },
  }
end

local timing = time_device("cpu", "f32")
if gdp.has_cuda() then
  local ok, extra = pcall(time_device, "cuda", "bf16")
  if ok then for _, r in ipairs(extra) do timing[#timing + 1] = r end end
end
print()
print(string.format("# timing, B=%d T=%d H=%d K=%d V=%d n=%d (median of %d; GFLOP/s by the recurrence's count)",
                    config.B, config.T, config.H, config.K, config.V, config.n, config["repeat"]))
print(util.format_table({ "device", "dtype", "pass", "time_ms", "GFLOP/s", "tokens/s" }, timing, "%.4g"))

-- The run folder, as every study writes one (experiments/runs/quickstart/...): the
-- checks and the timings as CSV, meta.json with the configuration and the status.
local run = require("gdp.results").new_run("quickstart", { config = config, args = arg })
local checks = run:csv({ "problem", "device", "dtype", "tensor", "rel_err", "tol", "result" })
for _, r in ipairs(rows) do
  checks:row({ problem = r[1], device = r[2], dtype = r[3], tensor = r[4], rel_err = r[5], tol = r[6],
               result = r[7] })
end
local times = run:csv({ "device", "dtype", "pass", "time_ms", "gflops", "tokens_per_s" }, "timing.csv")
for _, r in ipairs(timing) do
  times:row({ device = r[1], dtype = r[2], pass = r[3], time_ms = r[4], gflops = r[5], tokens_per_s = r[6] })
end
run:finish({ failures = failures, status = failures == 0 and "ok" or "failed",
             reason = failures > 0 and (failures .. " checks out of tolerance") or nil })

print()
if failures == 0 then
  print("# PASS: every output and gradient is within tolerance")
else
  print(string.format("# FAIL: %d checks out of tolerance", failures))
end
os.exit(failures == 0 and 0 or 1)
