-- householder_sweep: what do more Householder steps per token cost, and does the chunk
-- size matter?  Sweeps num_householder n x chunk_size (x dtype) on one problem shape and
-- records, for every config, speed and accuracy together:
--   * forward and forward+backward time of the chunk algorithm (median of `samples`
--     runs after `warmup`, each on fresh random inputs drawn outside the timed region),
--     and GFLOP/s by the recurrence's own count (gdp.ops.gdp_flops: forward
--     2*K*V*(2n+1) per token and head, forward+backward three times that);
--   * the relative error ||x - ref|| / ||ref|| of the chunk algorithm in the config's
--     dtype against the float64 token-by-token recurrence (the oracle) on a smaller
--     problem of the same config (check_T tokens, check_H heads, same K, V, n, chunk
--     size): fwd_rel_err for o and the final state (the larger), bwd_rel_err the largest
--     over dq, dk, dv, dbeta, dg; tol is docs/design.md's bound for the dtype.
--
--   ./gdp experiments/householder_sweep.lua [--device cpu|cuda] [--n 1,2,3,4]
--         [--chunk-size 32,64] [--dtype f32] [--B 1 --T 1024 --H 4 --K 64 --V 64]
--         [--samples 5] [--resume <run folder>] [--help]
--
-- Each config's inputs come from a seed derived from the config (gdp.sweep), so a rerun
-- or a larger grid redraws the same inputs for the same config.  Output: a run folder
-- experiments/runs/householder_sweep/<time>-<sha>/ with meta.json, results.csv (one row
-- per config, flushed as it finishes; status ok|error|skipped) and plot.gp (gnuplot:
-- plot.png, time vs n with one line per chunk size; error.png, the relative errors),
-- and a '#'-headed table on stdout.  --resume <run folder> carries that run's finished
-- rows into the new run and measures only the rest (an interrupted sweep, or a grid
-- grown by a value).  Exits 1 if a config failed or an error exceeds its tolerance.

local config = {
  device = "cpu",
  n = "1,2,3,4",           -- Householder steps per token (axis)
  chunk_size = "32,64",    -- steps per chunk of the chunk algorithm (axis)
  dtype = "f32",           -- input dtype(s) (axis): f32 | bf16 | f64
  B = 1, T = 1024, H = 4, K = 64, V = 64,
  algorithm = "chunk",     -- the path timed and checked
  use_qk_l2norm = true,
  warmup = 1,
  samples = 5,             -- timed runs per config (median)
  check_T = 128,           -- tokens of the accuracy problem (B = 1)
  check_H = 2,             -- heads of the accuracy problem
  threads = 0,             -- cpu worker threads; 0: the library's default (all cores)
  seed = 0,                -- salt of the per-config seeds; 0: none
  resume = "",             -- a previous run folder whose ok rows are kept
}

local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")
local sweep = gdp.sweep

local opts = util.parse_args(arg, config, {
  usage = "./gdp experiments/householder_sweep.lua [options]",
  description = "Time and accuracy of the chunk algorithm over num_householder x chunk_size.",
  help = {
    { "device", "cpu, cuda or cuda:<i>" },
    { "n", "comma-separated Householder steps per token" },
    { "chunk_size", "comma-separated chunk sizes" },
    { "dtype", "comma-separated input dtypes (f32, bf16, f64)" },
    { "B", "batch" }, { "T", "tokens per sequence" }, { "H", "heads" }, { "K", "key dim" }, { "V", "value dim" },
    { "algorithm", "operator algorithm timed and checked" },
    { "warmup", "untimed runs first" }, { "samples", "timed runs per config (median)" },
    { "check_T", "tokens of the accuracy problem" }, { "check_H", "heads of the accuracy problem" },
    { "threads", "cpu threads (0: all cores)" }, { "seed", "salt of the per-config seeds (0: none)" },
    { "resume", "previous run folder: keep its ok rows, measure the rest" },
  },
  choices = { algorithm = { "auto", "chunk", "recurrent" } },
})

-- "1,2,4" -> {1, 2, 4}; "f32,bf16" -> {"f32", "bf16"}
local function list(s)
  local out = {}
  for item in tostring(s):gmatch("[^,%s]+") do out[#out + 1] = tonumber(item) or item end
  return out
end

local ctx = gdp.device(opts.device)
if opts.threads > 0 then ctx:set_num_threads(opts.threads) end

local run = results.new_run("householder_sweep", {
  config = opts, seed = opts.seed ~= 0 and opts.seed or nil, args = arg,
  extra = { resumed_from = opts.resume ~= "" and opts.resume or nil },
})

local free_all = gdp.ops.free_all

local function rel_err(x, ref)
  return gdp.rel_error(x:to({ dtype = "f64", device = "cpu" }), ref)
end

-- Median forward and forward+backward seconds on fresh inputs.
local function measure_time(cfg)
  return gdp.ops.time_forward_backward({
    B = cfg.B, T = cfg.T, H = cfg.H, K = cfg.K, V = cfg.V, n = cfg.n, dtype = cfg.dtype, device = ctx,
    grads = true, use_qk_l2norm_in_kernel = cfg.use_qk_l2norm, output_final_state = true,
  }, { warmup = cfg.warmup, samples = cfg.samples, algorithm = cfg.algorithm, chunk_size = cfg.chunk_size })
end

-- Relative errors of the config's path against the float64 recurrence on the cpu.
local function measure_error(cfg)
  local ref_args = gdp.ops.random_inputs{
    B = 1, T = cfg.check_T, H = cfg.check_H, K = cfg.K, V = cfg.V, n = cfg.n, dtype = "f64", device = "cpu",
    grads = true, use_qk_l2norm_in_kernel = cfg.use_qk_l2norm, output_final_state = true,
  }
  ref_args.algorithm = "recurrent"
  local ref_o, ref_ht = gdp.ops.chunk_gated_delta_product(ref_args)
  local ref_grads = gdp.ops.chunk_gated_delta_product_backward(ref_args)
  local args = gdp.ops.convert_inputs(ref_args, cfg.dtype, ctx)
  args.algorithm, args.chunk_size = cfg.algorithm, cfg.chunk_size
  local o, ht = gdp.ops.chunk_gated_delta_product(args)
  local grads = gdp.ops.chunk_gated_delta_product_backward(args)
  local fwd_err = math.max(rel_err(o, ref_o), rel_err(ht, ref_ht))
  local bwd_err = 0
  for _, name in ipairs({ "dq", "dk", "dv", "dbeta", "dg" }) do
    local e = rel_err(grads[name], ref_grads[name])
    if e ~= e then bwd_err = e break end -- NaN never passes
    bwd_err = math.max(bwd_err, e)
  end
  free_all(ref_args); free_all(args); free_all(ref_grads); free_all(grads)
  ref_o:free(); ref_ht:free(); o:free(); ht:free()
  return fwd_err, bwd_err
end

local function measure(cfg)
  if not ctx:supports("gdp_forward", cfg.dtype) then
    sweep.skip(string.format("%s has no gdp_forward for %s", ctx:name(), cfg.dtype))
  end
  local t_fwd, t_fb, spread = measure_time(cfg)
  local fwd_err, bwd_err = measure_error(cfg)
  local flops = gdp.ops.gdp_flops(cfg.B, cfg.T, cfg.H, cfg.K, cfg.V, cfg.n, "forward")
  local tol = gdp.ops.TOLERANCE[cfg.dtype]
  return {
    fwd_ms = t_fwd * 1e3, fwdbwd_ms = t_fb * 1e3,
    fwd_ms_min = spread.fwd.min * 1e3, fwd_ms_max = spread.fwd.max * 1e3,
    fwdbwd_ms_min = spread.fwdbwd.min * 1e3, fwdbwd_ms_max = spread.fwdbwd.max * 1e3,
    timed_runs = spread.fwd.n,
    gflops_fwd = flops / t_fwd / 1e9, gflops_fwdbwd = 3 * flops / t_fb / 1e9,
    tokens_per_s = cfg.B * cfg.T / t_fb,
    fwd_rel_err = fwd_err, bwd_rel_err = bwd_err, tol = tol,
    within_tol = (fwd_err <= tol and bwd_err <= tol) and "yes" or "no",
  }
end

local columns = { "fwd_ms", "fwdbwd_ms", "fwd_ms_min", "fwd_ms_max", "fwdbwd_ms_min", "fwdbwd_ms_max",
                  "timed_runs", "gflops_fwd", "gflops_fwdbwd", "tokens_per_s",
                  "fwd_rel_err", "bwd_rel_err", "tol", "within_tol" }
local base = {
  device = ctx:name(), B = opts.B, T = opts.T, H = opts.H, K = opts.K, V = opts.V,
  algorithm = opts.algorithm, use_qk_l2norm = opts.use_qk_l2norm, warmup = opts.warmup,
  samples = opts.samples, check_T = opts.check_T, check_H = opts.check_H, threads = ctx:num_threads(),
}
local axes = { n = list(opts.n), chunk_size = list(opts.chunk_size), dtype = list(opts.dtype) }

local rows, summary = sweep.run{
  study = "householder_sweep",
  axes = axes,
  order = { "dtype", "chunk_size", "n" },   -- n varies fastest: one line per chunk size
  base = base,
  columns = columns,
  fn = measure,
  run = run,
  resume = opts.resume ~= "" and opts.resume or true,
  seed = opts.seed ~= 0 and opts.seed or nil,
}

local chunk_sizes = axes.chunk_size
sweep.plot(run, {
  { x = "n", y = { "fwd_ms", "fwdbwd_ms" }, by = "chunk_size", values = chunk_sizes, output = "plot.png",
    title = string.format("householder_sweep: B=%d T=%d H=%d K=%d V=%d on %s (solid: forward, dashed: fwd+bwd)",
                          opts.B, opts.T, opts.H, opts.K, opts.V, ctx:name()),
    xlabel = "Householder steps per token n", ylabel = "time (ms, median)", xtics = 1 },
  { x = "n", y = { "fwd_rel_err", "bwd_rel_err" }, by = "chunk_size", values = chunk_sizes, output = "error.png",
    logy = true, title = string.format("householder_sweep: relative error vs float64 recurrence (T=%d H=%d)",
                                       opts.check_T, opts.check_H),
    xlabel = "Householder steps per token n", ylabel = "||x - ref|| / ||ref||", xtics = 1 },
})

local failures, inaccurate = summary.error, 0
for _, r in ipairs(rows) do if r.within_tol == "no" then inaccurate = inaccurate + 1 end end
run:finish({ configs = summary.total, ok = summary.ok, errors = summary.error, skipped = summary.skipped,
             resumed = summary.resumed, inaccurate = inaccurate,
             status = (failures == 0 and inaccurate == 0) and "ok" or "failed",
             reason = (failures > 0 or inaccurate > 0) and
               string.format("%d configs failed, %d outside the tolerance", failures, inaccurate) or nil })

print(string.format("# householder_sweep: gdp %s on %s, B=%d T=%d H=%d K=%d V=%d, %s, %d threads, " ..
                    "median of %d; errors vs float64 recurrence at T=%d H=%d",
                    gdp.version, ctx:name(), opts.B, opts.T, opts.H, opts.K, opts.V, opts.algorithm,
                    ctx:num_threads(), opts.samples, opts.check_T, opts.check_H))
print(sweep.table(rows, {
  "dtype", { "chunk_size", "chunk" }, "n", "fwd_ms", "fwdbwd_ms", { "gflops_fwd", "GFLOP/s_fwd" },
  { "gflops_fwdbwd", "GFLOP/s_fb" }, { "fwd_rel_err", "fwd_err" }, { "bwd_rel_err", "bwd_err" }, "status",
}, "%.4g"))
for _, r in ipairs(rows) do
  if r.status ~= "ok" then print(string.format("# %s n=%s chunk_size=%s: %s", r.status, tostring(r.n),
                                               tostring(r.chunk_size), tostring(r.error))) end
end
if summary.resumed > 0 then print(string.format("# %d rows carried over from %s", summary.resumed, opts.resume)) end
if inaccurate > 0 then print(string.format("# %d configs exceed their tolerance (within_tol = no)", inaccurate)) end
if run.dir then print("# run folder: " .. run.dir) end
os.exit((failures == 0 and inaccurate == 0) and 0 or 1)
