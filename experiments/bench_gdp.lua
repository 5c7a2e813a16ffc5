-- bench_gdp: times the GDP operator's forward and forward+backward at one or more shapes,
-- compares its useful throughput with ceilings measured in the same run, and (cuda,
-- --against-fla) with fla's chunk_gated_delta_product timed in the same run.
--
--   ./gdp experiments/bench_gdp.lua [--device cpu|cuda] [--dtype f32|bf16|f64]
--         [--B 1 --T 4096 --H 4 --K 128 --V 128 --n 2] [--shapes ITEM,... | --set NAME]
--         [--against-fla [--fla-path DIR] [--python python3]] [--warmup 1] [--repeat 5]
--         [--save-for-backward | --with-saving] [--seed 1234] [--json] [--no-save] [--help]
--
-- Issue 22's comparison (H200, every shape of the set in one call, ceilings measured once):
--   ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --set issue22 --against-fla \
--         --with-saving --repeat 30 --json
--
-- --shapes lists the shapes, comma-separated, and overrides --B/--T/--n (default: that
-- single shape at --H/--K/--V).  An item (lua/gdp/bench_shapes.lua, which tools/fla_bench.py
-- mirrors) is
--   [H<h>K<k>V<v>:]<B>x<T>x<n>             B sequences of T tokens, n Householder steps
--   [H<h>K<k>V<v>:]packed<N>mean<L>x<n>    N sequences of random lengths with mean L,
--                                          packed into one (B = 1, cu_seqlens)
-- with positive integers; the prefix gives the item its own heads (H heads, key size K,
-- value size V), without it the item has --H/--K/--V.  A packed item's lengths are uniform
-- on [1, 2L - 1], drawn from --seed (splitmix64: length i = 1 + x_i mod (2L - 1)); fla gets
-- the same item and seed, draws the same lengths, and returns them, and bench_gdp refuses
-- its times for that shape if they differ.  A bad item stops the run (exit status 2) with
-- a message naming it and the syntax.  --set NAME takes the items of a named set instead
-- (gdp.bench_shapes.SETS):
--   issue22  H16K128V128: 4x4096x1, 4x4096x2, 4x4096x3, 1x32768x2, 1x65536x2, 64x1024x3,
--            packed1000mean200x2; H8K32V32: 256x512x4, 256x512x2; H8K256V256: 2x4096x2;
--            H32K64V64: 8x2048x2
-- A shape's label (`shape` in the JSON and the CSV, the key of fla's row) is its item in
-- canonical form, the prefix written only when its heads are not --H/--K/--V.  Every row
-- records H, K, V, packed, seqs (N; B when not packed), tokens (B * T), for packed rows
-- mean_len, len_min, len_max, and path: gdp.ops.last_path, the kernels the operator took
-- ("fast chunked" or "recurrent" on cuda; saving_path for --with-saving's saving pass), so
-- that a shape fallen onto a slower path shows; the table has shape (the item without its
-- heads), heads, tokens and path columns.
-- Each repeat draws fresh random inputs (never zeros) outside the timed region; the
-- reported times are medians.  Inputs (--inputs): "gdp" is gdp.ops.random_inputs
-- (g ~ U(-0.2, -0.01), beta ~ U(0, 1)); "fla" is what tools/fla_bench.py draws
-- (g = logsigmoid(N(0, 1)), beta = sigmoid(U(0, 1))); "auto" is fla with --against-fla,
-- else gdp.  Both: q, k, v, dO ~ N(0, 1), L2 norm of q and k in the kernel, no initial
-- state; the final state ht (and a dht in the backward) unless --no-final-state, and fla
-- is asked for the same.
--
-- FLOP: the recurrence's own count (not the chunk algorithm's, which does more):
-- forward 2*K*V*(2n+1) per token and head, backward twice that, forward+backward three
-- times the forward.  sgemm_gflops is gdp.matmul on f32 M = N = K = sgemm_size on the
-- same device (OpenBLAS on all cores on the cpu).
--
-- On cuda the run also measures two ceilings once (METHOD: measure them where you time):
-- bf16 matmul TFLOP/s (cuBLAS, float32 accumulation, M = N = K = matmul_size) and
-- device-copy TB/s (bytes read + written), and reports per shape the fraction of each
-- that the operator reaches, the floor max(FLOP / matmul rate, fewest bytes / copy
-- rate), where the fewest bytes read every input once and write every output once, and
-- the gap: measured time / floor (1 = at the floor).
--
-- --against-fla (cuda, --dtype bf16): after our shapes, runs
--   PYTHONPATH=<fla-path> python3 tools/fla_bench.py --shapes <labels> --H --K --V --reps R ...
-- once for all shapes, whatever their heads (fla's source: fla/__init__.py, fla/utils,
-- fla/ops, fla/modules in --fla-path, default <repo>/.fla), and reports fla's fwd and
-- fwd+bwd medians, speedup = fla ms / our ms (> 1: we are faster), and fla's fraction of the
-- same ceilings.  One process for every shape: Triton compiles and autotunes each fla
-- kernel once per autotune key (fla's keys: H, K, V and the chunk size, some also B or
-- varlen; n is a compile-time constant, so by these keys a new n compiles without
-- re-tuning) for the whole run, and with TRITON_CACHE_DIR kept between runs fla keeps both on disk (its
-- FLA_CACHE_RESULTS=1, the default), which saves its minutes of first compile (see
-- tools/gpu_run.sh).  fla_warmup_s in a row: the wall seconds of fla's untimed warm-up
-- there, where that compiling and autotuning lands.  Before timing anything it checks the
-- device, the dtype, the fla folder, python3 and (fla_bench.py --check) torch, triton, fla
-- and a CUDA device, and stops with exit status 2 and every problem named.
-- Test hook: --fla-cmd CMD replaces `python3 tools/fla_bench.py` (CMD gets the same
-- arguments, and `--check` first, which must print "ok"), skips the device, folder and
-- python3 checks, and so lets a stub exercise the comparison on the cpu
-- (spec/bench_fla_spec.lua).
--
-- --save-for-backward: the timed forwards keep what the backward would recompute
-- (save_for_backward = true; cuda variant 3 keeps its chunk panels and states) and the
-- backward of forward+backward reads it; the kept bytes are freed after each repeat.
-- --with-saving: times each shape both ways in the same run, the plain path's figures as
-- usual and the saving path's under saving_* (saving_fwd_ms, saving_fwdbwd_ms, ...,
-- saving_speedup_fwd/_fwdbwd against fla) in the JSON and the table (not in the CSV,
-- whose header stays fixed).
-- With --against-fla, fla_bench.py also times each fla pass "queued" (launched while a
-- spin kernel holds the stream, so the events see GPU time only, without Python's launch
-- time); the JSON then has fla_fwd_queued_ms, fla_fwdbwd_queued_ms, fla_fwd_host_ms,
-- fla_fwdbwd_host_ms, speedup_fwdbwd_queued (and saving_speedup_fwdbwd_queued), or
-- fla_queued_note saying why not; the table adds fla_q_fb, speedup_q_fb, sv_speedup_q_fb.
-- On cuda our forward+backward is also timed that way (gdp.ops.timed_device: launched
-- behind a spin, device marks around it; same inputs as the repeat's host-timed pass):
-- fwdbwd_device_ms, saving_fwdbwd_device_ms, and against fla's queued figure (both GPU
-- time only) speedup_fwdbwd_device, saving_speedup_fwdbwd_device; the table adds dev_fb,
-- sv_dev_fb, speedup_dev, sv_speedup_dev.  A repeat whose launches took longer than the
-- hold leaves the figure out with device_note saying so.
--
-- Output: a table on stdout (stderr with --json, whose stdout is ONE JSON object: the
-- configuration, command, ceilings, flop_count, fla's versions, and `shapes`, an array of
-- per-shape objects; with one shape its fields are also at the top level, as before:
-- gflops and fraction_of_sgemm for forward+backward, gflops_fwd, sgemm_gflops, fwd_ms,
-- fwdbwd_ms, ...); a run folder experiments/runs/bench_gdp/<time>-<sha>/ (meta.json,
-- bench_gdp.json = that object, results.csv with one row per shape, plot.gp) and one row
-- per shape appended to experiments/runs/bench_gdp/results.csv.  Exit status 0 when every
-- shape (and fla) ran, 1 when something failed, 2 on bad options or a missing fla setup.

local config = {
  device = "cpu",
  dtype = "f32",
  B = 1, T = 4096, H = 4, K = 128, V = 128, n = 2,
  shapes = "",             -- items (see the header); empty: --set's, else the single --B/--T/--n shape
  set = "",                -- a named set of items (gdp.bench_shapes.SETS: issue22)
  algorithm = "auto",      -- auto | chunk | recurrent
  chunk_size = 0,          -- 0: the backend's own (cpu 64; cuda: fixed by n)
  use_qk_l2norm = true,
  final_state = true,      -- output ht (and take a dht in the backward)
  inputs = "auto",         -- auto | gdp | fla: distribution of g and beta
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
  against_fla = false,     -- cuda, bf16: also time fla at the same shapes in this run
  fla_path = "",           -- folder holding fla/ (empty: <repo>/.fla)
  python = "python3",      -- interpreter for tools/fla_bench.py
  fla_reps = 0,            -- fla's timed repeats (0: --repeat)
  fla_warmup = 5,          -- fla's untimed repeats (Triton autotuning happens there)
  fla_cmd = "",            -- test hook: replaces `python3 tools/fla_bench.py`
  save = true,             -- write the run folder and the study's results.csv
  record = "",             -- also write the report to results/<UTC date>-<record>.json
  save_for_backward = false, -- forwards keep their workspace for the backward (gdp.ops)
  with_saving = false,     -- time each shape plain and saving for backward, in one run
}

local ffi = require("ffi")
local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")
local bench_shapes = require("gdp.bench_shapes")

local opts = util.parse_args(arg, config, {
  usage = "./gdp experiments/bench_gdp.lua [options]",
  description = "Benchmarks chunk_gated_delta_product forward and forward+backward (and fla's, --against-fla).",
  help = {
    { "device", "cpu, cuda or cuda:<i>" }, { "dtype", "input dtype" },
    { "B", "batch" }, { "T", "tokens per sequence" }, { "H", "heads" }, { "K", "key dim" },
    { "V", "value dim" }, { "n", "Householder steps per token" },
    { "shapes", "[H<h>K<k>V<v>:]BxTxn or [H<h>K<k>V<v>:]packed<N>mean<L>x<n>, comma-separated, timed in one run" },
    { "set", "a named set of --shapes items: issue22" },
    { "warmup", "untimed repeats first" }, { "repeat", "timed repeats (median)" },
    { "json", "print one JSON object on stdout" },
    { "save", "write the run folder and append to the study's results.csv" },
    { "record", "NAME: also write the JSON report to results/<UTC date>-NAME.json (what the README cites)" },
    { "algorithm", "operator algorithm" }, { "chunk_size", "steps per chunk" },
    { "final_state", "output ht, backward takes dht (fla too)" },
    { "inputs", "g/beta distribution: fla = logsigmoid/sigmoid, gdp = uniform; auto: fla with --against-fla" },
    { "threads", "cpu threads (0: all cores)" }, { "sgemm_size", "M = N = K of the matmul reference" },
    { "against_fla", "also time fla at the same shapes (cuda, bf16)" },
    { "fla_path", "folder holding fla/ (empty: <repo>/.fla)" },
    { "python", "python for tools/fla_bench.py" },
    { "save_for_backward", "forwards keep panels and states; the backward reads them" },
    { "with_saving", "time every shape both plain and saving for backward (saving_* figures)" },
    { "fla_reps", "fla's timed repeats (0: --repeat)" }, { "fla_warmup", "fla's untimed repeats" },
    { "fla_cmd", "test hook: command replacing `python3 tools/fla_bench.py`" },
    { "ceilings", "cuda: measure the bf16 matmul and copy ceilings in this run" },
    { "matmul_size", "M = N = K of the bf16 matmul ceiling" }, { "copy_mib", "MiB copied for the copy ceiling" },
  },
  choices = { dtype = { "f64", "f32", "bf16" }, algorithm = { "auto", "chunk", "recurrent" },
              inputs = { "auto", "gdp", "fla" } },
})

-- Human-readable output goes to stderr when stdout carries the JSON.
local out = opts.json and io.stderr or io.stdout
local function say(fmt, ...) out:write(string.format(fmt, ...), "\n") end

-- A problem with the options or the setup: named on stderr, exit status 2, nothing timed.
local function refuse(lines)
  for _, l in ipairs(lines) do io.stderr:write("bench_gdp: error: ", l, "\n") end
  os.exit(2)
end

------------------------------------------------------------------------------- shapes

-- The shapes: --set NAME's items, --shapes' items (gdp.bench_shapes: the syntax, the
-- packed lengths, the labels), or the single --B/--T/--n shape at --H/--K/--V.
local common_head = { H = opts.H, K = opts.K, V = opts.V }
if opts.set ~= "" and opts.shapes ~= "" then
  refuse({ string.format("--set %s and --shapes both name the shapes: give one", opts.set) })
end
local shape_items = opts.shapes
if opts.set ~= "" then
  shape_items = bench_shapes.SETS[opts.set]
  if not shape_items then
    local names = {}
    for name in pairs(bench_shapes.SETS) do names[#names + 1] = name end
    table.sort(names)
    refuse({ string.format("--set: expected one of %s, got '%s'", table.concat(names, ", "), opts.set) })
  end
end
if shape_items == "" then shape_items = string.format("%dx%dx%d", opts.B, opts.T, opts.n) end
local shapes, shapes_err = bench_shapes.parse(shape_items, common_head, opts.seed)
if not shapes then refuse({ shapes_err }) end
local shape_names = {}
for i, s in ipairs(shapes) do shape_names[i] = s.label end
local shape_list = table.concat(shape_names, ",")

if opts.with_saving and opts.save_for_backward then
  refuse({ "--with-saving times the plain path and the saving path; --save-for-backward would make " ..
           "both saving: give one of them" })
end

local inputs = opts.inputs
if inputs == "auto" then inputs = opts.against_fla and "fla" or "gdp" end

------------------------------------------------------------------------------- fla

-- The repository root, from this script's path (the launcher does not change directory).
local root = util.repo_root(arg[0])

local fla_dir = opts.fla_path ~= "" and opts.fla_path or (root .. "/.fla")
if fla_dir:sub(1, 1) ~= "/" then fla_dir = (util.capture("pwd") or ".") .. "/" .. fla_dir end

-- Output (stdout and stderr) and exit status of a shell command.
local function sh(cmd)
  local p = io.popen("{ " .. cmd .. "; } 2>&1; echo \"rc=$?\"")
  local text = p:read("*a")
  p:close()
  local rc = tonumber(text:match("rc=(%d+)%s*$"))
  return (text:gsub("rc=%d+%s*$", ""):gsub("%s+$", "")), rc
end

-- The command that runs fla_bench.py (or the --fla-cmd stub) with fla on PYTHONPATH.
local function fla_command(args)
  local tool = opts.fla_cmd ~= "" and opts.fla_cmd
    or (util.shell_quote(opts.python) .. " " .. util.shell_quote(root .. "/tools/fla_bench.py"))
  return "(export PYTHONPATH=" .. util.shell_quote(fla_dir) .. "${PYTHONPATH:+:$PYTHONPATH}; " ..
         tool .. " " .. args .. ")"
end

-- Everything that would stop the fla run, found before anything is timed.
local function fla_problems()
  local problems = {}
  local hooked = opts.fla_cmd ~= ""
  if not hooked and not opts.device:match("^cuda") then
    problems[#problems + 1] = string.format("--against-fla: fla's kernels are Triton and need a CUDA GPU; " ..
      "got --device %s (run with --device cuda)", opts.device)
  end
  if opts.dtype ~= "bf16" then
    problems[#problems + 1] = string.format("--against-fla compares at bf16, the dtype fla_bench.py uses; " ..
      "got --dtype %s (pass --dtype bf16)", opts.dtype)
  end
  if hooked then
    -- the stub stands for python3 and fla: only its own check remains
  else
    local f = io.open(fla_dir .. "/fla/__init__.py", "r")
    local usable = true
    if f then
      f:close()
    else
      usable = false
      problems[#problems + 1] = string.format("--against-fla: no fla source at %s (missing %s/fla/__init__.py): " ..
        "copy fla's fla/__init__.py, fla/utils, fla/ops and fla/modules (github fla-org/flash-linear-attention) " ..
        "there, or pass --fla-path DIR", fla_dir, fla_dir)
    end
    local found, rc = sh("command -v " .. util.shell_quote(opts.python))
    if rc ~= 0 then
      usable = false
      problems[#problems + 1] = string.format("--against-fla: %s not found on PATH (tools/fla_bench.py needs " ..
        "python3 with torch and triton; pass --python PATH)", opts.python)
    else
      opts.python_path = found
    end
    if not usable then return problems end
  end
  local cmd = fla_command("--check")
  local text, rc = sh(cmd)
  local last = text:match("([^\n]*)$")
  if rc ~= 0 or last ~= "ok" then
    problems[#problems + 1] = string.format("--against-fla: %s (PYTHONPATH=%s%s; checked with: %s)",
      last ~= "" and last or ("exit status " .. tostring(rc)), fla_dir,
      hooked and "" or (", python " .. (opts.python_path or opts.python)), cmd)
  end
  return problems
end

if opts.against_fla then
  local problems = fla_problems()
  if #problems > 0 then refuse(problems) end
end

-- Runs fla at every shape in one process (so Triton compiles and autotunes each kernel
-- once per key for the whole run: see tools/fla_bench.py); returns its decoded JSON (rows
-- keyed by label added as by_shape) and the command, or nil, a message and the command.
local function run_fla()
  local args = string.format("--shapes %s --H %d --K %d --V %d --reps %d --warmup %d --seed %d%s",
    shape_list, opts.H, opts.K, opts.V, opts.fla_reps > 0 and opts.fla_reps or opts["repeat"],
    opts.fla_warmup, opts.seed, opts.final_state and " --final-state" or "")
  local cmd = fla_command(args)
  local tmp = os.tmpname()
  io.stderr:write("bench_gdp: running fla: ", cmd, "\n")
  -- stderr (fla's progress, or its traceback) goes straight to ours
  local status = os.execute(cmd .. " > " .. util.shell_quote(tmp))
  local f = io.open(tmp, "r")
  local text = f and f:read("*a") or ""
  if f then f:close() end
  os.remove(tmp)
  if not (status == 0 or status == true) then
    local rc = type(status) == "number" and (status >= 256 and status / 256 or status) or tostring(status)
    return nil, string.format("fla_bench.py failed (exit status %s; its stderr is above)", tostring(rc)), cmd
  end
  -- the JSON object starts on a line of its own (anything a library printed before it is skipped)
  local start = text:sub(1, 1) == "{" and 1 or text:find("\n{")
  if not start then return nil, "fla_bench.py printed no JSON object: " .. text:sub(1, 200), cmd end
  local ok, obj = pcall(util.json_decode, text:sub(start))
  if not ok then return nil, "fla_bench.py's output is not JSON: " .. obj, cmd end
  if type(obj) ~= "table" or type(obj.rows or obj.shapes) ~= "table" then
    return nil, "fla_bench.py's JSON has no rows array", cmd
  end
  obj.by_shape = {}
  for _, r in ipairs(obj.rows or obj.shapes) do
    -- keyed by the label of the shape the row says it timed (heads and packing included;
    -- a row without heads is at the common ones), never by the order of the rows
    if type(r) == "table" and r.B and r.T and r.n and (not r.packed or (r.seqs and r.mean_len)) then
      local timed = { B = r.B, T = r.T, n = r.n, H = r.H or opts.H, K = r.K or opts.K, V = r.V or opts.V,
                      packed = r.packed == true, seqs = r.seqs, mean_len = r.mean_len }
      obj.by_shape[bench_shapes.label(timed, common_head)] = r
    end
  end
  return obj, nil, cmd
end

-- Why fla's row r is not a time for packed shape s (other lengths than ours), or nil.
local function packing_mismatch(s, r)
  if not s.packed then return nil end
  if r.T ~= s.T then
    return string.format("fla timed %s tokens, ours %d: its lengths are not ours", tostring(r.T), s.T)
  end
  if type(r.lengths) ~= "table" or #r.lengths ~= s.seqs then
    return string.format("fla's row has no list of its %d lengths to check against ours", s.seqs)
  end
  for i = 1, s.seqs do
    if r.lengths[i] ~= s.lengths[i] then
      return string.format("fla's length %d is %s, ours %d: not the same packing", i, tostring(r.lengths[i]),
                           s.lengths[i])
    end
  end
  return nil
end

------------------------------------------------------------------------------- timing

local start_time = os.date("!%Y-%m-%dT%H:%M:%SZ")
gdp.manual_seed(opts.seed)
local ctx = util.device_or_exit("bench_gdp", opts.device)
if opts.threads > 0 then ctx:set_num_threads(opts.threads) end

local git = results.git_info()
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
  a:free(); b:free(); c:free()
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

-- Fewest bytes the operator must move at shape s: every input read once, every output
-- written once.
local function min_bytes(s, pass)
  local B, T, H, K, V, n = s.B, s.T, s.H, s.K, s.V, s.n
  local e = ({ f64 = 8, f32 = 4, bf16 = 2 })[opts.dtype]
  local state = opts.final_state and 4 * s.seqs * H * K * V or 0 -- ht out, dht in (f32), one per sequence
  local qkvbg = B * T * H * K + B * T * n * H * (K + V + 1) + B * T * H
  local fwd = e * (qkvbg + B * T * H * V) + state -- inputs, o, ht
  if pass == "forward" then return fwd end
  -- backward: the inputs and dO (and dht) again, the five gradients out
  return fwd + e * (qkvbg + B * T * H * V) + state + e * qkvbg
end

-- A tensor of `shape` drawn on the host by draw (gdp.randn or gdp.rand, so the seed
-- governs it), mapped elementwise by fn, then moved to the run's dtype and device.
local function host_drawn(draw, shape, fn)
  local h = draw(shape, { dtype = "f32", device = "cpu" })
  local p = ffi.cast("float *", h:data())
  for i = 0, h:numel() - 1 do p[i] = fn(p[i]) end
  local t = h:to({ dtype = opts.dtype, device = ctx, copy = true })
  h:free()
  return t
end
local function logsigmoid(x) return math.min(x, 0) - math.log(1 + math.exp(-math.abs(x))) end
local function sigmoid(x) return 1 / (1 + math.exp(-x)) end

-- One set of random inputs at shape s, in the --inputs distribution.
local function draw_inputs(s)
  local args = gdp.ops.random_inputs({
    B = s.B, T = s.T, H = s.H, K = s.K, V = s.V, n = s.n, dtype = opts.dtype, device = ctx,
    grads = true, use_qk_l2norm_in_kernel = opts.use_qk_l2norm, output_final_state = opts.final_state,
    cu_seqlens = s.cu_seqlens,
  })
  -- the offsets as a tensor made here, outside the timed region (a table would be
  -- converted inside every call)
  if s.cu_seqlens then args.cu_seqlens = gdp.ops.seqlens_arg("bench_gdp", s.cu_seqlens) end
  if not opts.final_state then args.dht:free(); args.dht = nil end
  if inputs == "fla" then
    args.g:free(); args.beta:free()
    args.g = host_drawn(gdp.randn, { s.B, s.T, s.H }, logsigmoid)
    args.beta = host_drawn(gdp.rand, { s.B, s.T * s.n, s.H }, sigmoid)
  end
  args.algorithm = opts.algorithm
  if opts.chunk_size > 0 then args.chunk_size = opts.chunk_size end
  return args
end

-- On cuda each repeat also times forward+backward on the device alone (gdp.ops.timed_device:
-- launched behind a spin, as fla_bench.py's "queued" figure is), on the same inputs.
local device_timer = ctx:type() == "cuda"

-- Median seconds of the forward and of forward+backward at shape s, and (cuda) of
-- forward+backward on the device alone, or nil and why not; `save`: the forwards save
-- for backward and the backward reads what they kept.
local function time_shape(s, save)
  local fwd, fwdbwd, fwdbwd_dev, dev_note = {}, {}, {}, nil
  for r = 1, opts.warmup + opts["repeat"] do
    local args = draw_inputs(s)
    local o, ht, grads, saved
    args.save_for_backward = save or nil
    local function release()
      o:free(); if ht then ht:free() end
      if saved then saved:free() end
      if grads then gdp.ops.free_all(grads) end
      o, ht, saved, grads, args.saved = nil, nil, nil, nil, nil
    end
    local function forward_backward()
      o, ht, saved = gdp.ops.chunk_gated_delta_product(args)
      args.saved = saved
      grads = gdp.ops.chunk_gated_delta_product_backward(args)
    end
    local t_fwd = timed(function() o, ht, saved = gdp.ops.chunk_gated_delta_product(args) end)
    release()
    local t_fb = timed(forward_backward)
    release()
    local t_dev, note
    if device_timer then
      local dev_s, _, why = gdp.ops.timed_device(ctx, forward_backward)
      t_dev, note = dev_s, why
      release()
    end
    args.save_for_backward = nil
    gdp.ops.free_all(args)
    if r > opts.warmup then
      fwd[#fwd + 1], fwdbwd[#fwdbwd + 1] = t_fwd, t_fb
      if t_dev then fwdbwd_dev[#fwdbwd_dev + 1] = t_dev end
      dev_note = dev_note or note
    end
  end
  -- one repeat whose host outran the hold invalidates the figure (it would mix in host time)
  local dev = (device_timer and not dev_note and #fwdbwd_dev > 0) and util.median(fwdbwd_dev) or nil
  return util.median(fwd), util.median(fwdbwd), dev, dev_note, { fwd = fwd, fwdbwd = fwdbwd }
end

-- Fields common to the run and to every CSV row.
local common = {
  start_time = start_time, git_sha = git.short, device = ctx:name(), dtype = opts.dtype,
  algorithm = opts.algorithm, threads = ctx:num_threads(),
  ["repeat"] = opts["repeat"], inputs = inputs, final_state = opts.final_state,
}
-- the heads, where every shape has the same (else each row says its own)
common.H, common.K, common.V = shapes[1].H, shapes[1].K, shapes[1].V
for _, s in ipairs(shapes) do
  if s.H ~= common.H or s.K ~= common.K or s.V ~= common.V then common.H, common.K, common.V = nil, nil, nil end
end
local ceil = {}     -- sgemm_gflops, bf16_matmul_tflops, copy_tbps
local failures = {} -- messages of whatever failed

local ok, err = pcall(function()
  ceil.sgemm_gflops = bench_sgemm()
  if opts.ceilings and common.device:match("^cuda") then
    ceil.bf16_matmul_tflops, ceil.copy_tbps = bench_ceilings()
  end
end)
if not ok then failures[#failures + 1] = "ceilings: " .. tostring(err) end

-- The figures of times (seconds) at shape s against the ceilings; `prefix` names them
-- (fla's: "fla_").
local function figures(s, t_fwd, t_fb, prefix, into)
  local flops_fwd = gdp.ops.gdp_flops(s.B, s.T, s.H, s.K, s.V, s.n, "forward")
  local function put(k, v) into[prefix .. k] = v end
  put("fwd_ms", t_fwd * 1e3)
  put("fwdbwd_ms", t_fb * 1e3)
  put("gflops_fwd", flops_fwd / t_fwd / 1e9)
  put("gflops", 3 * flops_fwd / t_fb / 1e9)
  put("tokens_per_s", s.B * s.T / t_fb)
  put("tokens_per_s_fwd", s.B * s.T / t_fwd)
  if ceil.sgemm_gflops then put("fraction_of_sgemm", into[prefix .. "gflops"] / ceil.sgemm_gflops) end
  if ceil.bf16_matmul_tflops then
    local mm, cp = ceil.bf16_matmul_tflops * 1e12, ceil.copy_tbps * 1e12
    local fb_bytes, f_bytes = min_bytes(s, "forward_backward"), min_bytes(s, "forward")
    put("fraction_of_bf16_matmul", 3 * flops_fwd / t_fb / mm)
    put("fraction_of_bf16_matmul_fwd", flops_fwd / t_fwd / mm)
    put("fraction_of_copy", fb_bytes / t_fb / cp)
    put("fraction_of_copy_fwd", f_bytes / t_fwd / cp)
    local floor_fb = math.max(3 * flops_fwd / mm, fb_bytes / cp)
    local floor_f = math.max(flops_fwd / mm, f_bytes / cp)
    if prefix == "" then
      into.floor_fwdbwd_ms, into.floor_fwd_ms = floor_fb * 1e3, floor_f * 1e3
      into.floor_bound = 3 * flops_fwd / mm >= fb_bytes / cp and "matmul" or "copy"
    end
    put("gap_fwdbwd", t_fb / floor_fb)
    put("gap_fwd", t_fwd / floor_f)
  end
end

-- The shapes are timed even when a ceiling failed: their figures just lack the fractions.
local rows = {}
for i, s in ipairs(shapes) do
  local row = { B = s.B, T = s.T, n = s.n, H = s.H, K = s.K, V = s.V, shape = s.label, packed = s.packed,
                seqs = s.seqs, tokens = s.tokens }
  if s.packed then row.mean_len, row.len_min, row.len_max = s.mean_len, s.len_min, s.len_max end
  rows[i] = row
  local shape_ok, shape_err = pcall(function()
    local t_fwd, t_fb, t_dev, dev_note, samples = time_shape(s, opts.save_for_backward)
    -- the kernels "auto" took, so that a shape fallen onto a slower path shows
    row.path = gdp.ops.last_path(opts.device)
    figures(s, t_fwd, t_fb, "", row)
    util.spread_fields(row, "fwd_ms", samples.fwd, 1e3)
    util.spread_fields(row, "fwdbwd_ms", samples.fwdbwd, 1e3)
    row.fwdbwd_device_ms, row.device_note = t_dev and t_dev * 1e3, dev_note
    if opts.with_saving then
      local sv_fwd, sv_fb, sv_dev, sv_note = time_shape(s, true)
      row.saving_path = gdp.ops.last_path(opts.device)
      figures(s, sv_fwd, sv_fb, "saving_", row)
      row.saving_fwdbwd_device_ms, row.saving_device_note = sv_dev and sv_dev * 1e3, sv_note
    end
  end)
  row.status = shape_ok and "ok" or "error"
  if not shape_ok then
    row.error = tostring(shape_err)
    failures[#failures + 1] = s.label .. ": " .. row.error
  end
  io.stderr:write(string.format("bench_gdp: %s %s\n", s.label,
    shape_ok and string.format("fwd %.4g ms, fwd+bwd %.4g ms%s (%s kernels)", row.fwd_ms, row.fwdbwd_ms,
      row.saving_fwd_ms and string.format("; saving: fwd %.4g ms, fwd+bwd %.4g ms", row.saving_fwd_ms,
      row.saving_fwdbwd_ms) or "", row.path or "?") or row.error))
end

local fla, fla_err, fla_cmd
if opts.against_fla then
  fla, fla_err, fla_cmd = run_fla()
  if not fla then failures[#failures + 1] = "fla: " .. fla_err end
  for i, s in ipairs(shapes) do
    local row, r = rows[i], fla and fla.by_shape[s.label]
    local mismatch = r and packing_mismatch(s, r)
    if r and not mismatch and tonumber(r.fwd_ms) and tonumber(r.fwdbwd_ms) then
      row.fla_warmup_s = tonumber(r.warmup_s)
      figures(s, r.fwd_ms / 1e3, r.fwdbwd_ms / 1e3, "fla_", row)
      if row.fwd_ms then
        row.speedup_fwd = row.fla_fwd_ms / row.fwd_ms
        row.speedup_fwdbwd = row.fla_fwdbwd_ms / row.fwdbwd_ms
      end
      if row.saving_fwd_ms then
        row.saving_speedup_fwd = row.fla_fwd_ms / row.saving_fwd_ms
        row.saving_speedup_fwdbwd = row.fla_fwdbwd_ms / row.saving_fwdbwd_ms
      end
      -- fla's queued (GPU-only) timing, where fla_bench.py made one: its launch time
      -- hidden behind a spin, against our times as measured (host included)
      row.fla_queued_note = type(r.queued_note) == "string" and r.queued_note or nil
      row.fla_fwd_host_ms, row.fla_fwdbwd_host_ms = tonumber(r.fwd_host_ms), tonumber(r.fwdbwd_host_ms)
      row.fla_fwd_queued_ms, row.fla_fwdbwd_queued_ms = tonumber(r.fwd_queued_ms), tonumber(r.fwdbwd_queued_ms)
      -- against ours as measured (host included: *_queued) and on the device alone
      -- (gdp.ops.timed_device: *_device), plain and saving
      for _, pre in ipairs({ "", "saving_" }) do
        for ours, name in pairs({ fwdbwd_ms = "speedup_fwdbwd_queued", fwdbwd_device_ms = "speedup_fwdbwd_device" }) do
          if row.fla_fwdbwd_queued_ms and row[pre .. ours] then
            row[pre .. name] = row.fla_fwdbwd_queued_ms / row[pre .. ours]
          end
        end
      end
    else
      row.fla_error = fla_err or (r and type(r.error) == "string" and s.label .. ": " .. r.error)
        or (mismatch and s.label .. ": " .. mismatch) or "fla_bench.py gave no times for " .. s.label
      if fla then failures[#failures + 1] = "fla: " .. row.fla_error end
    end
  end
end

local status = #failures == 0 and "ok" or "error"

------------------------------------------------------------------------------- output

local command = { "./gdp", arg[0] }
for _, a in ipairs(arg) do
  command[#command + 1] = a:match("^[%w%-_.,:=/+]+$") and a or util.shell_quote(a)
end
command = table.concat(command, " ")

local report = {
  command = command, config = opts, shapes = util.json_array(rows), status = status,
  error = #failures > 0 and table.concat(failures, "; ") or nil, git_dirty = git.dirty,
  flop_count = "recurrence: forward 2*K*V*(2n+1) per token and head, backward twice that",
  floor = "max(FLOP / bf16 matmul rate, fewest bytes / copy rate); gap = time / floor",
  speedup = "fla ms / our ms (> 1: ours is faster)",
  gdp_version = gdp.version, end_time = os.date("!%Y-%m-%dT%H:%M:%SZ"),
}
for k, v in pairs(common) do report[k] = v end
-- in the JSON and meta.json (the config), not a CSV column: the study's CSV keeps its header
report.save_for_backward = opts.save_for_backward
report.with_saving = opts.with_saving
for k, v in pairs(ceil) do report[k] = v end
if opts.against_fla then
  report.fla = { command = fla_cmd, error = fla_err, pythonpath = fla_dir }
  for _, k in ipairs({ "tool", "fla_version", "fla_commit", "fla_path", "torch", "triton", "python",
                       "device", "final_state", "reps", "warmup", "seed" }) do
    if fla then report.fla[k] = fla[k] end
  end
  if fla and not fla.fla_commit then report.fla.fla_commit = "unknown" end
end
-- One shape: its figures at the top level too, as before --shapes.
if #shapes == 1 and rows[1] then
  for k, v in pairs(rows[1]) do if k ~= "status" and k ~= "error" then report[k] = v end end
end

local columns = { "start_time", "git_sha", "device", "dtype", "algorithm", "inputs", "final_state",
                  "shape", "B", "T", "H", "K", "V", "n", "threads", "repeat", "fwd_ms", "fwd_ms_min", "fwd_ms_p10",
                  "fwd_ms_p90", "fwd_ms_max", "fwdbwd_ms", "fwdbwd_ms_min", "fwdbwd_ms_p10", "fwdbwd_ms_p90",
                  "fwdbwd_ms_max", "gflops_fwd",
                  "gflops", "sgemm_gflops", "fraction_of_sgemm", "tokens_per_s", "tokens_per_s_fwd",
                  "bf16_matmul_tflops", "copy_tbps", "fraction_of_bf16_matmul", "fraction_of_bf16_matmul_fwd",
                  "fraction_of_copy", "fraction_of_copy_fwd", "floor_fwd_ms", "floor_fwdbwd_ms", "floor_bound",
                  "gap_fwd", "gap_fwdbwd", "fla_fwd_ms", "fla_fwdbwd_ms", "speedup_fwd", "speedup_fwdbwd",
                  "fla_fraction_of_bf16_matmul", "fla_fraction_of_copy", "fla_gap_fwdbwd", "fla_version",
                  "fla_error", "status", "error", "run_dir" }
if run then
  report.run_dir = run.dir
  local csv = run:csv(columns)
  local study_csv
  local known = {}
  for _, c in ipairs(columns) do known[c] = true end
  local csv_rows = #rows > 0 and rows or { { status = "error" } }
  for _, r in ipairs(csv_rows) do
    local line = {}
    for k, v in pairs(common) do line[k] = v end
    for k, v in pairs(ceil) do line[k] = v end
    for k, v in pairs(r) do if known[k] then line[k] = v end end
    line.fla_version = fla and fla.fla_version or nil
    line.run_dir = run.dir
    if line.status ~= "error" and status == "error" then line.status = "error" end
    line.error = line.error or report.error
    csv:row(line)
    study_csv = results.append_csv(results.root .. "/bench_gdp/results.csv", columns, line)
  end
  -- across the study's runs (row order), one line per shape of this run
  run:plot({ x = nil, y = "gflops", by = "shape", values = shape_names,
             csv = study_csv and "../" .. study_csv:match("[^/]+$"),
             title = "bench_gdp: forward+backward GFLOP/s per shape, one point per run",
             xlabel = "run (row of experiments/runs/bench_gdp/results.csv)", ylabel = "GFLOP/s" })
  local f = io.open(run.dir .. "/bench_gdp.json", "w")
  if f then f:write(util.json_encode(report, 1), "\n") f:close() end
  run:finish({ status = status, error = report.error })
end

local r1 = rows[1]
say("# gdp %s on %s, %s, %s, %s, algorithm %s, %d threads, median of %d; inputs %s, %s",
    gdp.version, common.device, opts.dtype, #shapes == 1 and string.format("B=%d T=%d n=%d", shapes[1].B,
    shapes[1].T, shapes[1].n) or (#shapes .. " shapes"),
    common.H and string.format("H=%d K=%d V=%d", common.H, common.K, common.V) or "heads per shape", opts.algorithm,
    common.threads, opts["repeat"], inputs, (opts.final_state and "final state" or "no final state") ..
    (opts.save_for_backward and ", save for backward" or ""))
if opts.shapes == "" and opts.set == "" and not opts.against_fla and not opts.with_saving and r1
   and r1.status == "ok" then
  -- the single-shape table of before --shapes (--B/--T/--n alone); --shapes, even with one
  -- shape, and the columns of --with-saving / --against-fla take the table below
  say("%s", util.format_table({ "pass", "time_ms", "GFLOP/s", "of_sgemm" }, {
    { "forward", r1.fwd_ms, r1.gflops_fwd, r1.gflops_fwd / ceil.sgemm_gflops },
    { "forward+backward", r1.fwdbwd_ms, r1.gflops, r1.fraction_of_sgemm },
    { "sgemm " .. opts.sgemm_size, "", ceil.sgemm_gflops, 1 },
  }, "%.4g"))
  say("# %.0f tokens/s forward+backward", r1.tokens_per_s)
  if ceil.bf16_matmul_tflops then
    say("# ceilings measured now: bf16 matmul %.0f TFLOP/s, copy %.2f TB/s; forward+backward " ..
        "reaches %.3f of the matmul and %.3f of the copy rate; floor %.3f ms fwd, %.3f ms fwd+bwd",
        ceil.bf16_matmul_tflops, ceil.copy_tbps, r1.fraction_of_bf16_matmul, r1.fraction_of_copy,
        r1.floor_fwd_ms, r1.floor_fwdbwd_ms)
  end
elseif #rows > 0 then
  say("# FLOP: the recurrence's count; speedup = fla ms / our ms; of_mm, of_copy: fraction of the ceilings " ..
      "(fwd+bwd); gap = time / floor")
  if ceil.sgemm_gflops then say("# sgemm %d: %.4g GFLOP/s", opts.sgemm_size, ceil.sgemm_gflops) end
  if ceil.bf16_matmul_tflops then
    say("# ceilings measured now: bf16 matmul %.0f TFLOP/s, copy %.2f TB/s", ceil.bf16_matmul_tflops, ceil.copy_tbps)
  end
  -- shape: the item without its heads, which have a column of their own (see the header)
  local header = { "shape", "heads", "tokens", "fwd_ms", "fwdbwd_ms", "Mtok/s" }
  local has_fla, has_ceil = opts.against_fla, ceil.bf16_matmul_tflops ~= nil
  if opts.with_saving then for _, h in ipairs({ "sv_fwd", "sv_fwdbwd" }) do header[#header + 1] = h end end
  if has_fla then for _, h in ipairs({ "fla_fwd", "fla_fwdbwd", "speedup_fwd", "speedup_fb" }) do header[#header + 1] = h end end
  if has_fla and opts.with_saving then header[#header + 1] = "sv_speedup_fb" end
  local has_queued = false
  for _, r in ipairs(rows) do has_queued = has_queued or r.fla_fwdbwd_queued_ms ~= nil end
  if has_queued then
    for _, h in ipairs({ "fla_q_fb", "speedup_q_fb" }) do header[#header + 1] = h end
    if opts.with_saving then header[#header + 1] = "sv_speedup_q_fb" end
  end
  local has_dev = false
  for _, r in ipairs(rows) do has_dev = has_dev or r.fwdbwd_device_ms ~= nil end
  if has_dev then
    header[#header + 1] = "dev_fb"
    if opts.with_saving then header[#header + 1] = "sv_dev_fb" end
    if has_queued then
      header[#header + 1] = "speedup_dev"
      if opts.with_saving then header[#header + 1] = "sv_speedup_dev" end
    end
  end
  if has_ceil then for _, h in ipairs({ "of_mm", "of_copy", "floor_ms", "gap" }) do header[#header + 1] = h end end
  if has_fla and has_ceil then for _, h in ipairs({ "fla_of_mm", "fla_gap" }) do header[#header + 1] = h end end
  header[#header + 1] = "path"
  local lines = {}
  for i, r in ipairs(rows) do
    local s = shapes[i]
    local l = { bench_shapes.body(s), bench_shapes.head_text(s), s.tokens, r.fwd_ms or r.status, r.fwdbwd_ms,
                r.tokens_per_s and r.tokens_per_s / 1e6 }
    if opts.with_saving then
      for _, k in ipairs({ "saving_fwd_ms", "saving_fwdbwd_ms" }) do l[#l + 1] = r[k] or "-" end
    end
    if has_fla then
      for _, k in ipairs({ "fla_fwd_ms", "fla_fwdbwd_ms", "speedup_fwd", "speedup_fwdbwd" }) do l[#l + 1] = r[k] or "-" end
    end
    if has_fla and opts.with_saving then l[#l + 1] = r.saving_speedup_fwdbwd or "-" end
    if has_queued then
      for _, k in ipairs({ "fla_fwdbwd_queued_ms", "speedup_fwdbwd_queued" }) do l[#l + 1] = r[k] or "-" end
      if opts.with_saving then l[#l + 1] = r.saving_speedup_fwdbwd_queued or "-" end
    end
    if has_dev then
      l[#l + 1] = r.fwdbwd_device_ms or "-"
      if opts.with_saving then l[#l + 1] = r.saving_fwdbwd_device_ms or "-" end
      if has_queued then
        l[#l + 1] = r.speedup_fwdbwd_device or "-"
        if opts.with_saving then l[#l + 1] = r.saving_speedup_fwdbwd_device or "-" end
      end
    end
    if has_ceil then
      for _, k in ipairs({ "fraction_of_bf16_matmul", "fraction_of_copy", "floor_fwdbwd_ms", "gap_fwdbwd" }) do
        l[#l + 1] = r[k] or "-"
      end
    end
    if has_fla and has_ceil then
      for _, k in ipairs({ "fla_fraction_of_bf16_matmul", "fla_gap_fwdbwd" }) do l[#l + 1] = r[k] or "-" end
    end
    -- one word, so that the columns still split on blanks
    l[#l + 1] = ((r.path or "-") .. (r.saving_path and r.saving_path ~= r.path and "/" .. r.saving_path or ""))
      :gsub(" ", "_")
    lines[i] = l
  end
  say("%s", util.format_table(header, lines, "%.4g"))
  if has_queued then
    say("# fla_q_fb: fla's forward+backward with its launches queued behind a spin (GPU time only); " ..
        "speedup_q_fb = that / our ms as measured (host included)")
  end
  if has_dev then
    say("# dev_fb: our forward+backward on the device alone (launched behind a spin, as fla_q_fb)%s",
        has_queued and "; speedup_dev = fla_q_fb / dev_fb, both GPU time only" or "")
  end
  for _, r in ipairs(rows) do
    if r.fla_queued_note then say("# fla %s: queued timing: %s", r.shape, r.fla_queued_note) end
    if r.device_note then say("# %s: no dev_fb: %s", r.shape, r.device_note) end
    if r.saving_device_note then say("# %s: no sv_dev_fb: %s", r.shape, r.saving_device_note) end
  end
  if fla then
    say("# fla %s (commit %s), torch %s, triton %s, on %s", tostring(fla.fla_version or "?"),
        tostring(fla.fla_commit or "unknown"), tostring(fla.torch or "?"), tostring(fla.triton or "?"),
        tostring(fla.device or "?"))
  end
end
for _, f in ipairs(failures) do say("# error: %s", f) end

if opts.record ~= "" then
  if not opts.record:match("^[%w%-_.]+$") then
    io.stderr:write("bench_gdp: --record: expected a name of letters, digits, '-', '_' and '.', got ",
                    opts.record, "\n")
    os.exit(2)
  end
  local ok, path = pcall(require("gdp.results").record, opts.record, report)
  if ok then
    say("# recorded: %s", path)
  else
    say("# error: %s", tostring(path))
    status = "error"
  end
end
if opts.json then io.stdout:write(util.json_encode(report), "\n") end
os.exit(status == "ok" and 0 or 1)
