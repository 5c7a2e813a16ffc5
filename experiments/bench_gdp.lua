-- bench_gdp: times the GDP operator's forward and forward+backward and compares its
-- useful throughput with the device's single-precision matmul, measured in the same run.
--
--   ./gdp experiments/bench_gdp.lua [--device cpu|cuda] [--dtype f32|bf16|f64]
--         [--B 1 --T 4096 --H 4 --K 128 --V 128 --n 2] [--warmup 1] [--repeat 5] [--json]
--         [--no-save] [--help]
--
-- Each repeat draws fresh random inputs (never zeros) outside the timed region; the
-- reported times are medians.  Throughput uses the recurrence's own FLOP count:
-- forward 2*K*V*(2n+1) per token and head, backward twice that, forward+backward three
-- times the forward.  sgemm_gflops is gdp.matmul on f32 M = N = K = sgemm_size on the
-- same device (OpenBLAS on all cores on the cpu).
--
-- On cuda the run also measures two ceilings (METHOD: measure them where you time):
-- bf16 matmul TFLOP/s (cuBLAS, float32 accumulation, M = N = K = matmul_size) and
-- device-copy TB/s (bytes read + written), and reports the fraction of each that the
-- operator reaches and the floor max(FLOP / matmul rate, fewest bytes / copy rate),
-- where the fewest bytes read every input once and write every output once.
--
-- Output: a table on stdout (stderr with --json, whose stdout is ONE JSON object with
-- gflops and fraction_of_sgemm for forward+backward, gflops_fwd, sgemm_gflops, fwd_ms,
-- fwdbwd_ms and the configuration); a run folder experiments/runs/bench_gdp/<time>-<sha>/
-- (meta.json, results.csv, plot.gp) and one row appended to
-- experiments/runs/bench_gdp/results.csv per run.

local config = {
  device = "cpu",
  dtype = "f32",
  B = 1, T = 4096, H = 4, K = 128, V = 128, n = 2,
  algorithm = "auto",      -- auto | chunk | recurrent
  chunk_size = 64,
  use_qk_l2norm = true,
  warmup = 1,
  ["repeat"] = 5,
  sgemm_size = 1024,
  sgemm_repeat = 10,
  ceilings = true,         -- cuda: also measure the bf16 matmul and device-copy ceilings
  matmul_size = 8192,      -- M = N = K of the bf16 matmul ceiling
  copy_mib = 1024,         -- size of the device-copy ceiling's buffer
  threads = 0,             -- cpu worker threads; 0: the library's default (all cores)
  seed = 1234,
  json = false,
  against_fla = false,     -- cuda only; not implemented yet
  save = true,             -- write the run folder and the study's results.csv
}

local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")

local opts = util.parse_args(arg, config, {
  usage = "./gdp experiments/bench_gdp.lua [options]",
  description = "Benchmarks chunk_gated_delta_product forward and forward+backward.",
  help = {
    { "device", "cpu, cuda or cuda:<i>" }, { "dtype", "input dtype" },
    { "B", "batch" }, { "T", "tokens per sequence" }, { "H", "heads" }, { "K", "key dim" },
    { "V", "value dim" }, { "n", "Householder steps per token" },
    { "warmup", "untimed repeats first" }, { "repeat", "timed repeats (median)" },
    { "json", "print one JSON object on stdout" },
    { "save", "write the run folder and append to the study's results.csv" },
    { "algorithm", "operator algorithm" }, { "chunk_size", "steps per chunk" },
    { "threads", "cpu threads (0: all cores)" }, { "sgemm_size", "M = N = K of the matmul reference" },
    { "against_fla", "also time fla (cuda; not implemented yet)" },
    { "ceilings", "cuda: measure the bf16 matmul and copy ceilings in this run" },
    { "matmul_size", "M = N = K of the bf16 matmul ceiling" }, { "copy_mib", "MiB copied for the copy ceiling" },
  },
  choices = { dtype = { "f64", "f32", "bf16" }, algorithm = { "auto", "chunk", "recurrent" } },
})

-- Human-readable output goes to stderr when stdout carries the JSON.
local out = opts.json and io.stderr or io.stdout
local function say(fmt, ...) out:write(string.format(fmt, ...), "\n") end

if opts.against_fla then
  io.stderr:write("bench_gdp: --against-fla is not implemented yet (cuda only; it needs fla on the GPU machine)\n")
end

local start_time = os.date("!%Y-%m-%dT%H:%M:%SZ")
gdp.manual_seed(opts.seed)
local ctx = gdp.device(opts.device)
if opts.threads > 0 then ctx:set_num_threads(opts.threads) end

local run = opts.save and results.new_run("bench_gdp", { config = opts, seed = opts.seed, args = arg }) or nil

local function timed(fn) return gdp.ops.timed(ctx, fn) end

-- sgemm reference on the same device.
local function bench_sgemm()
  local N = opts.sgemm_size
  local a = gdp.randn({ N, N }, { dtype = "f32", device = ctx })
  local b = gdp.randn({ N, N }, { dtype = "f32", device = ctx })
  local c = gdp.empty({ N, N }, { dtype = "f32", device = ctx })
  for _ = 1, 2 do gdp.matmul(a, b, { out = c }) end
  local times = {}
  for i = 1, opts.sgemm_repeat do
    times[i] = timed(function() gdp.matmul(a, b, { out = c }) end)
  end
  return 2 * N * N * N / util.median(times) / 1e9
end

-- The two ceilings of a cuda device, measured here (nil on cpu).
local function bench_ceilings()
  local N = opts.matmul_size
  local a = gdp.randn({ N, N }, { dtype = "bf16", device = ctx })
  local b = gdp.randn({ N, N }, { dtype = "bf16", device = ctx })
  local c = gdp.empty({ N, N }, { dtype = "bf16", device = ctx })
  for _ = 1, 3 do gdp.matmul(a, b, { out = c }) end
  local mm = {}
  for i = 1, 10 do mm[i] = timed(function() gdp.matmul(a, b, { out = c }) end) end
  a:free(); b:free(); c:free()
  local n = opts.copy_mib * 2 ^ 20 / 4
  local src = gdp.rand({ n }, { dtype = "f32", device = ctx })
  local dst = gdp.empty({ n }, { dtype = "f32", device = ctx })
  for _ = 1, 3 do dst:copy(src) end
  local cp = {}
  for i = 1, 10 do cp[i] = timed(function() dst:copy(src) end) end
  src:free(); dst:free()
  return 2 * N ^ 3 / util.median(mm) / 1e12, 2 * n * 4 / util.median(cp) / 1e12
end

-- Fewest bytes the operator must move: every input read once, every output written once.
local function min_bytes(pass)
  local B, T, H, K, V, n = opts.B, opts.T, opts.H, opts.K, opts.V, opts.n
  local e = ({ f64 = 8, f32 = 4, bf16 = 2 })[opts.dtype]
  local qkvbg = B * T * H * K + B * T * n * H * (K + V + 1) + B * T * H
  local fwd = e * (qkvbg + B * T * H * V) + 4 * B * H * K * V -- inputs, o, ht (f32)
  if pass == "forward" then return fwd end
  -- backward: the inputs and dO again, the five gradients out
  return fwd + e * (qkvbg + B * T * H * V) + e * qkvbg
end

local function bench_op()
  return gdp.ops.time_forward_backward({
    B = opts.B, T = opts.T, H = opts.H, K = opts.K, V = opts.V, n = opts.n,
    dtype = opts.dtype, device = ctx, grads = true, use_qk_l2norm_in_kernel = opts.use_qk_l2norm,
    output_final_state = true,
  }, { warmup = opts.warmup, samples = opts["repeat"], algorithm = opts.algorithm,
       chunk_size = opts.chunk_size })
end

local row = {
  start_time = start_time, git_sha = results.git_info().short, device = ctx:name(), dtype = opts.dtype,
  algorithm = opts.algorithm, B = opts.B, T = opts.T, H = opts.H, K = opts.K, V = opts.V, n = opts.n,
  threads = ctx:num_threads(), ["repeat"] = opts["repeat"],
}
local ok, err = pcall(function()
  row.sgemm_gflops = bench_sgemm()
  local t_fwd, t_fb = bench_op()
  local flops_fwd = gdp.ops.gdp_flops(opts.B, opts.T, opts.H, opts.K, opts.V, opts.n, "forward")
  row.fwd_ms = t_fwd * 1e3
  row.fwdbwd_ms = t_fb * 1e3
  row.gflops_fwd = flops_fwd / t_fwd / 1e9
  row.gflops = 3 * flops_fwd / t_fb / 1e9
  row.fraction_of_sgemm = row.gflops / row.sgemm_gflops
  row.tokens_per_s = opts.B * opts.T / t_fb
  if opts.ceilings and row.device:match("^cuda") then
    row.bf16_matmul_tflops, row.copy_tbps = bench_ceilings()
    local fb_bytes = min_bytes("forward_backward")
    row.fraction_of_bf16_matmul = row.gflops / (row.bf16_matmul_tflops * 1e3)
    row.fraction_of_copy = fb_bytes / t_fb / (row.copy_tbps * 1e12)
    row.floor_fwdbwd_ms = 1e3 * math.max(3 * flops_fwd / (row.bf16_matmul_tflops * 1e12),
                                         fb_bytes / (row.copy_tbps * 1e12))
    row.floor_fwd_ms = 1e3 * math.max(flops_fwd / (row.bf16_matmul_tflops * 1e12),
                                      min_bytes("forward") / (row.copy_tbps * 1e12))
  end
end)
row.status = ok and "ok" or "error"
if not ok then row.error = tostring(err) end

local columns = { "start_time", "git_sha", "device", "dtype", "algorithm", "B", "T", "H", "K", "V", "n",
                  "threads", "repeat", "fwd_ms", "fwdbwd_ms", "gflops_fwd", "gflops", "sgemm_gflops",
                  "fraction_of_sgemm", "tokens_per_s", "bf16_matmul_tflops", "copy_tbps",
                  "fraction_of_bf16_matmul", "fraction_of_copy", "floor_fwd_ms", "floor_fwdbwd_ms",
                  "status", "error", "run_dir" }
if run then
  row.run_dir = run.dir
  local csv = run:csv(columns)
  csv:row(row)
  local study_csv = results.append_csv(results.root .. "/bench_gdp/results.csv", columns, row)
  run:plot({ x = nil, y = { "gflops", "sgemm_gflops" }, csv = study_csv and "../" .. study_csv:match("[^/]+$"),
             title = "bench_gdp: GFLOP/s per run (forward+backward)", ylabel = "GFLOP/s", style = "points" })
  run:finish({ status = row.status, error = row.error })
end

say("# gdp %s on %s, %s, B=%d T=%d H=%d K=%d V=%d n=%d, algorithm %s, %d threads, median of %d",
    gdp.version, row.device, opts.dtype, opts.B, opts.T, opts.H, opts.K, opts.V, opts.n,
    opts.algorithm, row.threads, opts["repeat"])
if ok then
  say("%s", util.format_table({ "pass", "time_ms", "GFLOP/s", "of_sgemm" }, {
    { "forward", row.fwd_ms, row.gflops_fwd, row.gflops_fwd / row.sgemm_gflops },
    { "forward+backward", row.fwdbwd_ms, row.gflops, row.fraction_of_sgemm },
    { "sgemm " .. opts.sgemm_size, "", row.sgemm_gflops, 1 },
  }, "%.4g"))
  say("# %.0f tokens/s forward+backward", row.tokens_per_s)
  if row.bf16_matmul_tflops then
    say("# ceilings measured now: bf16 matmul %.0f TFLOP/s, copy %.2f TB/s; forward+backward " ..
        "reaches %.3f of the matmul and %.3f of the copy rate; floor %.3f ms fwd, %.3f ms fwd+bwd",
        row.bf16_matmul_tflops, row.copy_tbps, row.fraction_of_bf16_matmul, row.fraction_of_copy,
        row.floor_fwd_ms, row.floor_fwdbwd_ms)
  end
else
  say("# error: %s", row.error)
end
if run then say("# run folder: %s", run.dir) end

if opts.json then
  local obj = {}
  for k, v in pairs(row) do obj[k] = v end
  io.stdout:write(util.json_encode(obj), "\n")
end
os.exit(ok and 0 or 1)
