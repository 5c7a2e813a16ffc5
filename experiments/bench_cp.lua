-- bench_cp: context-parallel weak scaling of the Gated DeltaProduct mixer layer and of the
-- bare operator, headwise and chunkwise, with the chunkwise overhead breakdown
-- (docs/design.md section 4.4).
--
--   mpirun -np R ./gdp experiments/bench_cp.lua [--device cuda] [--dtype bf16]
--          [--H 16 --K 128 --V 128 --hidden 2048 --groups 4 --conv 4] [--n 1,2]
--          [--tokens-per-rank 16384,4096] [--modes headwise,chunkwise]
--          [--targets layer,operator] [--warmup 3 --repeat 15] [--no-profile]
--          [--no-check --check-tokens 64] [--baseline FILE] [--emulate-cp C] [--json]
--          [--record NAME]
--
-- Weak scaling: cp = R (the mpirun world; one process is cp = 1), T = tokens_per_rank * cp,
-- B = 1, one sequence.  Targets:
--   layer     nn.GatedDeltaProduct (forward; forward+backward with parameter gradients),
--             cp_mode = the mode (its default layout: headwise zigzag, chunkwise
--             contiguous); cp = 1: the plain layer.
--   operator  chunkwise: gdp.cp.gdp_chunkwise_context_parallel on already-sharded q, k, v,
--             g, beta (validate = false, as the layer calls it) and its backward;
--             headwise: one all-to-all of every input (packed in one buffer) to whole
--             sequences of H/cp heads, the operator, one all-to-all of o back (backward:
--             d_o in, the operator's backward, the five gradients back in one buffer);
--             cp = 1: the plain operator.  L2 norm of q, k in the kernel, as the layer.
-- cp = 1 has no modes: its rows are mode "plain".  Inputs are fresh N(0, 1) draws per
-- repeat (beta uniform, g uniform in [-0.1, 0]) outside the timed region.  Each rank
-- times each repeat between device synchronisations after a barrier; fwd_ms is the
-- slowest rank's median over --repeat (after --warmup untimed runs), *_min_ms and
-- *_max_ms the slowest rank's fastest and slowest repeat.
--
-- Efficiency (--baseline FILE, a JSON this script wrote at -np 1 with the same shapes):
-- t(cp = 1) / t(cp) per target, n and tokens per rank, forward and forward+backward.
--
-- Breakdown (--profile, on by default, cp > 1): more forward+backward repeats with
-- gdp.cp.timing on (each stage between device synchronisations): per rank the mean
-- seconds of each stage and of the whole step (means, so that the stages add up to at
-- most the step); overhead = every stage that is not the operator's own run (local_*):
-- chunkwise the summaries, all-gathers and compositions (and the layer's conv halo),
-- headwise the all-to-alls; overhead_fraction = overhead / (local_forward +
-- local_backward), reported for the rank where it is largest (issue 19's goal:
-- <= 0.10 for chunkwise at 16K tokens per rank, n = 2, K = V = 128).
--
-- Emulated ranks (--emulate-cp C, one process): the chunkwise operator's work of each
-- rank r of cp = C alone on this device, the group replaced by a stand-in whose
-- all-gather copies this rank's summary to every slot (no link, no other rank's values:
-- the outputs are not cp = 1's, the times are rank r's); rows mode "chunkwise-emulated"
-- with their breakdown.  On one GPU this is the CP work's own cost, without the other
-- ranks' kernels sharing the device (what -np C on one GPU measures) and without the
-- link (the all-gathers here are local copies of a [Nb, H, K, V+K] summary).
--
-- Check (--check, on by default, cp > 1): before timing, each target, mode and n at
-- --check-tokens tokens per rank against cp = 1 on the same global batch (output, input
-- gradients, layer parameter gradients), the dtype's tolerance (gdp.ops.TOLERANCE); the
-- worst error over ranks decides on every rank; a failure ends every rank (exit 1).
--
-- Output (rank 0): a table on stdout (stderr with --json, whose stdout is then ONE JSON
-- object); a run folder experiments/runs/bench_cp/<time>-<sha>/ (meta.json,
-- bench_cp.json, results.csv); --record NAME also writes results/<UTC date>-NAME.json.
-- Bad arguments: one line on every rank and exit 2.  --device cuda with several ranks
-- puts rank r on cuda:(local rank mod the GPU count).

local config = {
  device = "cuda",
  dtype = "bf16",
  H = 16, K = 128, V = 128, hidden = 2048, groups = 4, conv = 4,
  n = "1,2",
  tokens_per_rank = "16384,4096",
  modes = "headwise,chunkwise",
  targets = "layer,operator",
  warmup = 3, ["repeat"] = 15,
  profile = true,
  check = true, check_tokens = 64,
  baseline = "",
  emulate_cp = 0,
  seed = 1,
  json = false,
  record = "",
}

local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")
local nn = require("gdp.nn")
local cp = require("gdp.cp")
local ops = gdp.ops

local opts = util.parse_args(arg, config, {
  usage = "mpirun -np R ./gdp experiments/bench_cp.lua [options]",
  description = "Weak scaling of headwise and chunkwise context parallelism (layer and operator).",
  help = {
    { "device", "device (cuda: one GPU per rank; cpu)" },
    { "dtype", "dtype of the layer and of the operator's inputs" },
    { "H", "heads" }, { "K", "key (state) size" }, { "V", "value (head) size" },
    { "n", "Householder steps per token, comma-separated" },
    { "tokens_per_rank", "tokens per rank, comma-separated (T = this * cp)" },
    { "modes", "CP strategies, comma-separated (headwise, chunkwise)" },
    { "targets", "what to time, comma-separated (layer, operator)" },
    { "profile", "time the stages of CP (cp > 1) in extra synchronised repeats" },
    { "check", "check CP against cp = 1 before timing (cp > 1)" },
    { "check_tokens", "tokens per rank of the check" },
    { "baseline", "FILE: a JSON of this script at -np 1: efficiency = t(cp=1) / t(cp)" },
    { "emulate_cp", "C: with one process, also time each rank of chunkwise cp = C alone (operator target)" },
    { "json", "stdout: one JSON object (the table goes to stderr)" },
    { "record", "NAME: also write the JSON to results/<UTC date>-NAME.json" },
  },
  choices = { dtype = { "f64", "f32", "bf16" } },
  aliases = { ["tokens-per-rank"] = "tokens_per_rank", ["check-tokens"] = "check_tokens",
              ["emulate-cp"] = "emulate_cp" },
})

local world = gdp.comm.world()
local CP, RANK = world:size(), world:rank()

------------------------------------------------------------------------------- arguments

local function int_list(key)
  local out = {}
  for item in tostring(opts[key]):gmatch("[^,]+") do
    local v = tonumber(item)
    if v == nil or v < 1 or v ~= math.floor(v) then return nil end
    out[#out + 1] = v
  end
  return #out > 0 and out or nil
end

local function name_list(key, allowed)
  local out = {}
  for item in tostring(opts[key]):gmatch("[^,]+") do
    if not allowed[item] then return nil end
    out[#out + 1] = item
  end
  return #out > 0 and out or nil
end

local function read_baseline(path)
  local f = io.open(path, "r")
  if not f then return nil, "--baseline: cannot read " .. path end
  local text = f:read("*a")
  f:close()
  local ok, b = pcall(util.json_decode, text)
  if not ok or type(b) ~= "table" or b.tool ~= "bench_cp" or type(b.rows) ~= "table" then
    return nil, "--baseline: " .. path .. " is not a JSON report of bench_cp"
  end
  if b.world_size ~= 1 then
    return nil, string.format("--baseline: %s was run with %s ranks, expected 1 (cp = 1)", path,
                              tostring(b.world_size))
  end
  for _, key in ipairs({ "dtype", "H", "K", "V", "hidden", "groups", "conv" }) do
    local theirs = b.config and b.config[key]
    if theirs ~= opts[key] then
      return nil, string.format("--baseline: %s has %s = %s, this run %s = %s", path, key, tostring(theirs),
                                key, tostring(opts[key]))
    end
  end
  return b
end

-- The arguments' problem (one line), or nil; then the parsed lists.
local function argument_problem()
  local lists = {}
  lists.n = int_list("n")
  if not lists.n then return "--n: expected integers >= 1, comma-separated, got '" .. tostring(opts.n) .. "'" end
  lists.tokens = int_list("tokens_per_rank")
  if not lists.tokens then
    return "--tokens-per-rank: expected integers >= 1, comma-separated, got '" .. tostring(opts.tokens_per_rank) .. "'"
  end
  lists.modes = name_list("modes", cp.MODES)
  if not lists.modes then
    return "--modes: expected headwise and/or chunkwise, comma-separated, got '" .. tostring(opts.modes) .. "'"
  end
  lists.targets = name_list("targets", { layer = true, operator = true })
  if not lists.targets then
    return "--targets: expected layer and/or operator, comma-separated, got '" .. tostring(opts.targets) .. "'"
  end
  for _, key in ipairs({ "H", "K", "V", "hidden", "groups", "conv", "repeat", "check_tokens" }) do
    local v = opts[key]
    if v < 1 or v ~= math.floor(v) then return string.format("--%s: expected an integer >= 1, got %s", key, v) end
  end
  if opts.warmup < 0 or opts.warmup ~= math.floor(opts.warmup) then
    return "--warmup: expected an integer >= 0, got " .. opts.warmup
  end
  if opts.H % opts.groups ~= 0 then
    return string.format("--groups: expected a divisor of --H = %d, got %d", opts.H, opts.groups)
  end
  for _, mode in ipairs(lists.modes) do
    if mode == "headwise" and CP > 1 then
      if opts.H % CP ~= 0 then
        return string.format("--modes headwise: --H = %d heads do not split over cp = %d ranks", opts.H, CP)
      end
      local ng = opts.groups
      if (ng >= CP and ng % CP ~= 0) or (ng < CP and CP % ng ~= 0) then
        return string.format("--modes headwise: --groups = %d does not split over (or repeat to) cp = %d", ng, CP)
      end
      for _, t in ipairs(lists.tokens) do
        if t % 2 ~= 0 then
          return string.format("--modes headwise: the zigzag layout needs an even --tokens-per-rank, got %d", t)
        end
      end
      if opts.check and opts.check_tokens % 2 ~= 0 then
        return string.format("--modes headwise: the zigzag layout needs an even --check-tokens, got %d",
                             opts.check_tokens)
      end
    end
  end
  if opts.emulate_cp ~= 0 then
    local c = opts.emulate_cp
    if c < 2 or c ~= math.floor(c) then return "--emulate-cp: expected an integer >= 2, got " .. c end
    if CP > 1 then
      return string.format("--emulate-cp: run with one process (it stands in for the group), got %d ranks", CP)
    end
    local has_operator = false
    for _, t in ipairs(lists.targets) do has_operator = has_operator or t == "operator" end
    if not has_operator then return "--emulate-cp: times the operator target; --targets has no operator" end
  end
  if opts.record ~= "" and not opts.record:match("^[%w%-_.]+$") then
    return "--record: expected a name of letters, digits, '-', '_' and '.', got " .. opts.record
  end
  if opts.baseline ~= "" then
    local b, why = read_baseline(opts.baseline)
    if not b then return why end
    lists.baseline = b
  end
  return nil, lists
end

-- Every rank judges its arguments, then the ranks agree, so that all of them stop (one
-- line each, exit 2) when any one objects: none is left waiting in a collective.
local problem, lists = argument_problem()
local objections = world:all_reduce(gdp.tensor({ problem and 1 or 0 }, { 1 }, { dtype = "f64" }), "max")
if objections:flat()[1] > 0 then
  io.stderr:write("bench_cp: " .. (problem or "another rank rejected the arguments") .. "\n")
  os.exit(2)
end

local device = opts.device
if device == "cuda" and CP > 1 then
  local count = #gdp.devices() - 1
  local lr = tonumber(os.getenv("OMPI_COMM_WORLD_LOCAL_RANK") or os.getenv("MPI_LOCALRANKID") or RANK)
  if count > 0 then device = "cuda:" .. (lr % count) end
end
local ctx = util.device_or_exit("bench_cp", device)
if CP > 1 and device == "cpu" then ctx:set_num_threads(1) end
local comm_backend = world:backend(device)

local out = opts.json and io.stderr or io.stdout
local function put(fmt, ...) if RANK == 0 then out:write(string.format(fmt, ...), "\n") end end

------------------------------------------------------------------------------- inputs

local H, K, V, B = opts.H, opts.K, opts.V, 1
local dtype = opts.dtype
local topts = { dtype = dtype, device = device }

local function layer_cfg(n, mode)
  return {
    hidden_size = opts.hidden, num_heads = H, head_dim = V, num_groups = opts.groups, state_dim = K,
    num_householder = n, conv_width = opts.conv, dtype = dtype, device = device, seed = opts.seed,
    cp_mode = mode, cp_group = mode and world or nil,
  }
end

-- Random operator inputs over Tn tokens: q, k, v, g, beta (and d_o) in the op's layouts.
local function op_inputs(Tn, n, draw)
  draw = draw or function(shape) return gdp.randn(shape, topts) end
  local x = {
    q = draw({ B, Tn, H, K }), k = draw({ B, Tn * n, H, K }), v = draw({ B, Tn * n, H, V }),
    beta = (draw({ B, Tn * n, H }, "rand")), g = draw({ B, Tn, H }, "rand") * -0.1,
  }
  x["do"] = draw({ B, Tn, H, V })
  return x
end

local function fresh(shape, kind)
  if kind == "rand" then return gdp.rand(shape, topts) end
  return gdp.randn(shape, topts)
end

local function op_args(x, n)
  return { q = x.q, k = x.k, v = x.v, g = x.g, beta = x.beta, num_householder = n,
           use_qk_l2norm_in_kernel = true }
end

-- Rows [r*Lc, (r+1)*Lc) of dim 2 (times n for k, v, beta) of every operator input.
local function op_shard(x, n, Lc, r)
  local s = {}
  for name, t in pairs(x) do
    local per = (name == "k" or name == "v" or name == "beta") and n or 1
    s[name] = t:narrow(2, r * Lc * per + 1, Lc * per):contiguous()
  end
  return s
end

------------------------------------------------------------------------------- headwise operator

-- One all-to-all of several fields packed in one buffer: block d of the send buffer
-- holds part(x, d) of every field x (the same shape on every rank and for every d); the
-- piece received from rank s goes to place(out, s, x) of a new out_shape(x) tensor.
local function exchange(fields, part, out_shape, place)
  local per, total = {}, 0
  for i, x in ipairs(fields) do
    per[i] = part(x, 0):numel()
    total = total + per[i]
  end
  local send = gdp.empty({ CP, total }, topts)
  for d = 0, CP - 1 do
    local pos, row = 0, send:select(1, d + 1)
    for i, x in ipairs(fields) do
      local piece = part(x, d)
      row:narrow(1, pos + 1, per[i]):view(piece:shape()):copy(piece)
      pos = pos + per[i]
    end
  end
  local recv = world:all_to_all(send)
  local outs, pos = {}, 0
  for i, x in ipairs(fields) do
    local shape = part(x, 0):shape()
    local full = gdp.empty(out_shape(x), topts)
    for src = 0, CP - 1 do
      place(full, src, x):copy(recv:select(1, src + 1):narrow(1, pos + 1, per[i]):view(shape))
    end
    outs[i] = full
    pos = pos + per[i]
  end
  return outs
end

-- [B, R, H, D] sequence shards (R rows per rank; beta, g as [B, R, H, 1]) -> [B, R*cp, H/cp, D]:
-- this rank's heads of every rank's rows.
local function to_heads(fields)
  local Hl = H / CP
  return exchange(fields, function(x, d) return x:narrow(3, d * Hl + 1, Hl) end,
                  function(x) return { x:size(1), x:size(2) * CP, Hl, x:size(4) } end,
                  function(full, src, x) return full:narrow(2, src * x:size(2) + 1, x:size(2)) end)
end

-- The reverse: [B, R*cp, H/cp, D] (this rank's heads, all rows) -> [B, R, H, D] (all
-- heads, this rank's rows).
local function to_sequence(fields)
  local Hl = H / CP
  local function rows(x) return x:size(2) / CP end
  return exchange(fields, function(x, d) return x:narrow(2, d * rows(x) + 1, rows(x)) end,
                  function(x) return { x:size(1), rows(x), H, x:size(4) } end,
                  function(full, src) return full:narrow(3, src * Hl + 1, Hl) end)
end

local function as4(t) return t:dim() == 3 and t:view(t:size(1), t:size(2), t:size(3), 1) or t end

local stage = cp.timing.stage

-- Headwise CP of the operator: forward returns o (this rank's rows) and what backward needs.
local function headwise_forward(x, n)
  local f = stage("all_to_all_in_forward", device, to_heads,
                  { x.q, x.k, x.v, as4(x.beta), as4(x.g) })
  local hx = { q = f[1], k = f[2], v = f[3], beta = f[4]:select(4, 1), g = f[5]:select(4, 1) }
  local args = op_args(hx, n)
  local o = stage("local_forward", device, ops.chunk_gated_delta_product, args)
  local o_seq = stage("all_to_all_out_forward", device, to_sequence, { o })[1]
  return o_seq, args
end

local function headwise_backward(args, d_o)
  args["do"] = stage("all_to_all_out_backward", device, to_heads, { d_o })[1]
  local g = stage("local_backward", device, ops.chunk_gated_delta_product_backward, args)
  local back = stage("all_to_all_in_backward", device, to_sequence,
                     { g.dq, g.dk, g.dv, as4(g.dbeta), as4(g.dg) })
  return { dq = back[1], dk = back[2], dv = back[3], dbeta = back[4]:select(4, 1), dg = back[5]:select(4, 1) }
end

------------------------------------------------------------------------------- one step

-- A stand-in for rank r of a group of cpn ranks inside one process (--emulate-cp): what
-- gdp_chunkwise_context_parallel asks of its group with validate = false (size, rank,
-- allgather), the all-gather a local copy of this rank's summary to every slot.
local function stand_in_group(cpn, r)
  local g = {}
  function g.size() return cpn end
  function g.rank() return r end
  function g.allgather(_, t)
    local shape = t:shape()
    table.insert(shape, 1, cpn)
    local all = gdp.empty(shape, { dtype = t:dtype(), device = t:device() })
    for i = 1, cpn do all:select(1, i):copy(t) end
    return all
  end
  return g
end

-- A runner for (target, mode, n, tokens per rank): runner.draw() fresh inputs,
-- runner.forward(), runner.step() (forward+backward); mode nil: cp = 1.  group: the
-- chunkwise operator's (default the world).
local function make_runner(target, mode, n, Lc, group)
  local r = {}
  if target == "layer" then
    local m = nn.GatedDeltaProduct(layer_cfg(n, mode))
    local x, dy
    function r.draw()
      x, dy = gdp.randn({ Lc, B, opts.hidden }, topts), gdp.randn({ Lc, B, opts.hidden }, topts)
    end
    function r.forward() m:clear_state(); m:forward(x) end
    function r.step()
      m:clear_state()
      m:forward(x)
      m:backward(x, dy)
    end
    function r.free() m:clear_state(); x:free(); dy:free() end
    return r
  end
  local x
  function r.draw() x = op_inputs(Lc, n, fresh) end
  function r.free() for _, t in pairs(x) do t:free() end end
  if mode == nil then
    function r.forward() ops.chunk_gated_delta_product(op_args(x, n)) end
    function r.step()
      local args = op_args(x, n)
      ops.chunk_gated_delta_product(args)
      args["do"] = x["do"]
      ops.chunk_gated_delta_product_backward(args)
    end
  elseif mode == "chunkwise" then
    local function fwd()
      local a = op_args(x, n)
      a.cp_group, a.validate = group or world, false
      return cp.gdp_chunkwise_context_parallel(a)
    end
    function r.forward() fwd() end
    function r.step()
      local _, saved = fwd()
      saved:backward(x["do"])
    end
  else
    function r.forward() headwise_forward(x, n) end
    function r.step()
      local _, args = headwise_forward(x, n)
      headwise_backward(args, x["do"])
    end
  end
  return r
end

------------------------------------------------------------------------------- check

-- Worst relative errors over the ranks of CP against cp = 1 on one global batch.
local function check_config(target, mode, n)
  local Lc = opts.check_tokens
  local T = Lc * CP
  local names, errs = {}, {}
  local function add(name, got, want)
    names[#names + 1] = name
    local e = gdp.rel_error(got:to({ dtype = "f64", device = "cpu" }), want:to({ dtype = "f64", device = "cpu" }))
    errs[#errs + 1] = e == e and e or math.huge
  end
  gdp.manual_seed(opts.seed + 17 * n)
  -- drawn on the cpu in float32: the same values on every rank, then moved
  local function draw(shape, kind)
    local t = kind == "rand" and gdp.rand(shape, { dtype = "f32" }) or gdp.randn(shape, { dtype = "f32" })
    return t:to(topts)
  end
  if target == "layer" then
    local ref = nn.GatedDeltaProduct(layer_cfg(n, nil))
    local m = nn.GatedDeltaProduct(layer_cfg(n, mode))
    local x, dy = draw({ T, B, opts.hidden }), draw({ T, B, opts.hidden })
    local out_ref = ref:forward(x)
    local dx_ref = ref:backward(x, dy)
    local so = { layout = m.cp_layout }
    local xl = cp.shard.split(x, CP, RANK, so)
    local o = m:forward(xl)
    local dx = m:backward(xl, cp.shard.split(dy, CP, RANK, so))
    add("out", o, cp.shard.split(out_ref, CP, RANK, so))
    add("dx", dx, cp.shard.split(dx_ref, CP, RANK, so))
    for _, name in ipairs(m:parameter_names()) do add("grad " .. name, m:gradients()[name], ref:gradients()[name]) end
  else
    local x = op_inputs(T, n, draw)
    local args = op_args(x, n)
    local o_ref = ops.chunk_gated_delta_product(args)
    args["do"] = x["do"]
    local g_ref = ops.chunk_gated_delta_product_backward(args)
    local xl = op_shard(x, n, Lc, RANK)
    local o, g
    if mode == "chunkwise" then
      local a = op_args(xl, n)
      a.cp_group = world
      local saved
      o, saved = cp.gdp_chunkwise_context_parallel(a)
      g = saved:backward(xl["do"])
    else
      local hargs
      o, hargs = headwise_forward(xl, n)
      g = headwise_backward(hargs, xl["do"])
    end
    local want = op_shard({ o = o_ref, q = g_ref.dq, k = g_ref.dk, v = g_ref.dv, beta = g_ref.dbeta, g = g_ref.dg },
                          n, Lc, RANK)
    add("o", o, want.o)
    for _, f in ipairs({ "q", "k", "v", "beta", "g" }) do add("d" .. f, g["d" .. f], want[f]) end
  end
  local worst = world:all_reduce(gdp.tensor(errs, { #errs }, { dtype = "f64" }), "max"):flat()
  local tol = ops.TOLERANCE[dtype]
  local bad = {}
  local max_err = 0
  for i, name in ipairs(names) do
    max_err = math.max(max_err, worst[i])
    if not (worst[i] <= tol) then bad[#bad + 1] = string.format("%s %.3e", name, worst[i]) end
  end
  return { target = target, mode = mode, n = n, tokens_per_rank = Lc, max_rel_err = max_err, tol = tol,
           ok = #bad == 0, failed = #bad > 0 and table.concat(bad, ", ") or nil }
end

------------------------------------------------------------------------------- timing

-- Seconds of fn on this rank, started together after a barrier, device work included.
local function timed(fn)
  world:barrier()
  return ops.timed(ctx, fn)
end

local STAGES = {
  chunkwise = { "summary_forward", "allgather_forward", "compose_forward", "correct_forward", "local_forward",
                "summary_backward", "allgather_backward", "compose_backward", "local_backward" },
  headwise = { "all_to_all_in_forward", "local_forward", "all_to_all_out_forward",
               "all_to_all_out_backward", "local_backward", "all_to_all_in_backward" },
}
local function stage_names(target, mode)
  local names = {}
  for i, s in ipairs(STAGES[mode]) do names[i] = s end
  if target == "layer" and mode == "chunkwise" then
    names[#names + 1] = "halo_forward"
    names[#names + 1] = "halo_backward"
  end
  return names
end

local function spread(xs)
  local lo, hi = math.huge, -math.huge
  for _, v in ipairs(xs) do lo, hi = math.min(lo, v), math.max(hi, v) end
  return util.median(xs), lo, hi
end

-- Per rank: mean seconds of each stage and of the step over the profiled repeats; then
-- every rank's, gathered.  Returns the breakdown of the rank with the largest fraction.
local function profile(runner, target, mode)
  local names = stage_names(target, mode)
  local sums, total = {}, 0
  for _, s in ipairs(names) do sums[s] = 0 end
  for _ = 1, opts["repeat"] do
    runner.draw()
    local acc = {}
    cp.timing.set(acc)
    local ok, err = pcall(function() total = total + timed(runner.step) end)
    cp.timing.set(nil)
    if not ok then error(err, 0) end
    for name, v in pairs(acc) do
      if sums[name] == nil then error("bench_cp: unexpected stage " .. name, 0) end
      sums[name] = sums[name] + v
    end
    runner.free()
  end
  local mine = { total / opts["repeat"] }
  for i, s in ipairs(names) do mine[i + 1] = sums[s] / opts["repeat"] end
  local all = world:allgather(gdp.tensor(mine, { #mine }, { dtype = "f64" })):totable()
  local by_rank, worst = {}, nil
  for r, vals in ipairs(all) do
    local b = { rank = r - 1, step_ms = vals[1] * 1e3, stages_ms = {}, overhead_ms = 0, local_ms = 0 }
    for i, s in ipairs(names) do
      local v = vals[i + 1] * 1e3
      b.stages_ms[s] = v
      if s:match("^local_") then b.local_ms = b.local_ms + v else b.overhead_ms = b.overhead_ms + v end
    end
    b.overhead_fraction = b.local_ms > 0 and b.overhead_ms / b.local_ms or nil
    by_rank[r] = b
    if worst == nil or (b.overhead_fraction or 0) > (worst.overhead_fraction or 0) then worst = b end
  end
  return { stage_order = util.json_array(names), worst_rank = worst.rank, step_ms = worst.step_ms,
           stages_ms = worst.stages_ms, overhead_ms = worst.overhead_ms, local_ms = worst.local_ms,
           overhead_fraction = worst.overhead_fraction, by_rank = util.json_array(by_rank) }
end

local function bench(target, mode, n, Lc, group)
  local runner = make_runner(target, mode, n, Lc, group)
  local fwd, fb = {}, {}
  for rep = 1, opts.warmup + opts["repeat"] do
    runner.draw()
    local t_f = timed(runner.forward)
    local t_fb = timed(runner.step)
    runner.free()
    if rep > opts.warmup then fwd[#fwd + 1], fb[#fb + 1] = t_f, t_fb end
    collectgarbage()
  end
  local f_med, f_lo, f_hi = spread(fwd)
  local b_med, b_lo, b_hi = spread(fb)
  local slowest = world:all_reduce(gdp.tensor({ f_med, f_lo, f_hi, b_med, b_lo, b_hi }, { 6 }, { dtype = "f64" }),
                                   "max"):flat()
  local row = {
    target = target, mode = mode or "plain", cp = CP, n = n, tokens_per_rank = Lc, T = Lc * CP, B = B,
    fwd_ms = slowest[1] * 1e3, fwd_min_ms = slowest[2] * 1e3, fwd_max_ms = slowest[3] * 1e3,
    fwdbwd_ms = slowest[4] * 1e3, fwdbwd_min_ms = slowest[5] * 1e3, fwdbwd_max_ms = slowest[6] * 1e3,
  }
  if mode ~= nil and opts.profile then row.breakdown = profile(runner, target, mode) end
  return row
end

------------------------------------------------------------------------------- run

local start_time = os.date("!%Y-%m-%dT%H:%M:%SZ")
local run = results.new_run("bench_cp", { config = opts, seed = opts.seed, args = arg,
                                          extra = { world_size = CP, comm_backend = comm_backend } })
local modes = CP > 1 and lists.modes or { false }

local checks = {}
if opts.check and CP > 1 then
  for _, target in ipairs(lists.targets) do
    for _, mode in ipairs(modes) do
      for _, n in ipairs(lists.n) do
        local c = check_config(target, mode, n)
        checks[#checks + 1] = c
        put("# check %s %s n = %d (%d tokens per rank): max rel err %.3e (tol %.0e) %s", target, mode, n,
            c.tokens_per_rank, c.max_rel_err, c.tol, c.ok and "ok" or ("FAILED: " .. c.failed))
        if not c.ok then
          run:finish({ status = "failed", reason = "check failed: " .. target .. " " .. mode .. ": " .. c.failed })
          if RANK == 0 then
            io.stderr:write(string.format("bench_cp: %s %s n = %d differs from cp = 1: %s (tol %.0e)\n", target,
                                          mode, n, c.failed, c.tol))
          end
          os.exit(1)
        end
      end
    end
  end
end

local baseline_rows = {}
if lists.baseline then
  for _, b in ipairs(lists.baseline.rows) do
    baseline_rows[table.concat({ b.target, b.n, b.tokens_per_rank }, ":")] = b
  end
end

local rows = {}
-- --emulate-cp: each rank of chunkwise cp = C alone (the profile's rows are this
-- process's, so its rank is the emulated one)
-- beyond_plain: the rank's unprofiled forward+backward against the cp = 1 operator's on
-- the same tokens, less 1: all its CP work, also what runs inside its local runs (the
-- transition's columns riding on the local forward, unpacked), which the stages count as
-- local_forward.
--
-- critical_path_ms: what cp = C would take on C GPUs but for the link, from the ranks'
-- stages: an all-gather ends when the last rank reaches it, so each phase between two
-- all-gathers costs its slowest rank's time.  Phases as the gdp backends run them:
-- forward_prepare (summary_forward with local_forward inside), the all-gather,
-- forward_apply (compose, correct), backward_prepare (summary_backward), the all-gather,
-- backward_apply (compose, local_backward).  efficiency_estimate = the cp = 1 operator's
-- fwdbwd_ms / critical_path_ms (the stages are synchronised, so it errs low).
local PHASES = {
  { "summary_forward", "local_forward" }, { "allgather_forward" }, { "compose_forward", "correct_forward" },
  { "summary_backward" }, { "allgather_backward" }, { "compose_backward", "local_backward" },
}
local function emulated_rows(n, Lc)
  local C = opts.emulate_cp
  local plain
  for _, r in ipairs(rows) do
    if r.target == "operator" and r.mode == "plain" and r.n == n and r.tokens_per_rank == Lc then plain = r end
  end
  local group_rows = {}
  for r = 0, C - 1 do
    local row = bench("operator", "chunkwise", n, Lc, stand_in_group(C, r))
    row.mode, row.cp, row.T, row.emulated_rank = "chunkwise-emulated", C, Lc * C, r
    if plain then row.beyond_plain = row.fwdbwd_ms / plain.fwdbwd_ms - 1 end
    if row.breakdown then
      row.breakdown.worst_rank = r
      row.breakdown.by_rank[1].rank = r
    end
    rows[#rows + 1] = row
    group_rows[#group_rows + 1] = row
    collectgarbage()
  end
  if not group_rows[1].breakdown then return end
  local critical = 0
  for _, phase in ipairs(PHASES) do
    local slowest = 0
    for _, row in ipairs(group_rows) do
      local t = 0
      for _, s in ipairs(phase) do t = t + (row.breakdown.stages_ms[s] or 0) end
      slowest = math.max(slowest, t)
    end
    critical = critical + slowest
  end
  for _, row in ipairs(group_rows) do
    row.critical_path_ms = critical
    row.efficiency_estimate = plain and plain.fwdbwd_ms / critical or nil
  end
end
for _, target in ipairs(lists.targets) do
  for _, mode in ipairs(modes) do
    for _, n in ipairs(lists.n) do
      for _, Lc in ipairs(lists.tokens) do
        local row = bench(target, mode or nil, n, Lc)
        local base = baseline_rows[table.concat({ target, n, Lc }, ":")]
        if base then
          row.baseline_fwd_ms, row.baseline_fwdbwd_ms = base.fwd_ms, base.fwdbwd_ms
          row.efficiency_fwd = base.fwd_ms / row.fwd_ms
          row.efficiency_fwdbwd = base.fwdbwd_ms / row.fwdbwd_ms
        end
        rows[#rows + 1] = row
        collectgarbage()
      end
    end
  end
end
if opts.emulate_cp ~= 0 then
  for _, n in ipairs(lists.n) do
    for _, Lc in ipairs(lists.tokens) do emulated_rows(n, Lc) end
  end
end

------------------------------------------------------------------------------- output

local function num(v, fmt) return v and string.format(fmt or "%.3f", v) or "-" end
put("# bench_cp: gdp %s, %s, cp = %d (%s), %s, H = %d, K = %d, V = %d, hidden %d, %d groups, conv %d, B = 1; " ..
    "ms: slowest rank's median of %d [its min, max]", gdp.version, ctx:name(), CP, comm_backend, dtype, H, K, V,
    opts.hidden, opts.groups, opts.conv, opts["repeat"])
local trows = {}
for _, r in ipairs(rows) do
  local b = r.breakdown
  trows[#trows + 1] = {
    r.target, r.emulated_rank and string.format("%s (rank %d of %d)", r.mode, r.emulated_rank, r.cp) or r.mode,
    r.n, r.tokens_per_rank, r.T,
    string.format("%.3f [%.3f, %.3f]", r.fwd_ms, r.fwd_min_ms, r.fwd_max_ms),
    string.format("%.3f [%.3f, %.3f]", r.fwdbwd_ms, r.fwdbwd_min_ms, r.fwdbwd_max_ms),
    num(r.efficiency_fwd), num(r.efficiency_fwdbwd), b and num(b.overhead_fraction) or "-",
  }
end
put("%s", util.format_table({ "target", "mode", "n", "tokens/rank", "T", "fwd_ms", "fwdbwd_ms", "eff_fwd",
                              "eff_fwdbwd", "overhead" }, trows))
for _, r in ipairs(rows) do
  local b = r.breakdown
  if b then
    local parts = {}
    for _, s in ipairs(b.stage_order) do parts[#parts + 1] = string.format("%s %.3f", s, b.stages_ms[s]) end
    put("# %s %s n = %d, %d/rank, rank %d (synchronised step %.3f ms): %s; overhead %.3f ms = %.1f%% of the " ..
        "operator's %.3f ms%s", r.target, r.mode, r.n, r.tokens_per_rank, b.worst_rank, b.step_ms,
        table.concat(parts, ", "), b.overhead_ms, 100 * (b.overhead_fraction or 0), b.local_ms,
        r.beyond_plain and string.format("; unprofiled fwd+bwd %.1f%% beyond the cp = 1 operator's",
                                         100 * r.beyond_plain) or "")
  end
end
for _, r in ipairs(rows) do
  if r.critical_path_ms and r.emulated_rank == r.cp - 1 then
    put("# chunkwise-emulated cp = %d, n = %d, %d/rank: critical path %.3f ms (each phase's slowest rank), " ..
        "estimated efficiency %s against the cp = 1 operator", r.cp, r.n, r.tokens_per_rank, r.critical_path_ms,
        num(r.efficiency_estimate))
  end
end
if opts.baseline ~= "" then put("# efficiency = t(cp = 1) / t(cp = %d), baseline %s", CP, opts.baseline) end

local command = { "mpirun -np " .. CP, "./gdp", arg[0] }
for _, a in ipairs(arg) do
  command[#command + 1] = a:match("^[%w%-_.,:=/+]+$") and a or util.shell_quote(a)
end
local git = results.git_info()
local report = {
  tool = "bench_cp", command = table.concat(command, " "), config = opts, world_size = CP, cp = CP,
  comm_backend = comm_backend, device = ctx:name(), dtype = dtype, gdp_version = gdp.version,
  git_sha = git.sha, git_dirty = git.dirty, start_time = start_time, end_time = os.date("!%Y-%m-%dT%H:%M:%SZ"),
  baseline = opts.baseline ~= "" and opts.baseline or nil,
  checks = util.json_array(checks), rows = util.json_array(rows), status = "ok",
  time = "per rank the median (min, max) over the repeats of a barrier-started, device-synchronised "
         .. "call; the maximum over ranks of each",
  breakdown = "cp > 1: per rank the mean over profiled repeats of each gdp.cp.timing stage; overhead = "
              .. "the stages other than local_* (the operator); reported for the rank with the largest "
              .. "overhead / (local_forward + local_backward)",
  emulated = opts.emulate_cp ~= 0 and ("chunkwise-emulated rows: each rank of cp = " .. opts.emulate_cp
    .. " alone in this process; the all-gathers are local copies (no link), the outputs not cp = 1's; "
    .. "beyond_plain = the row's fwdbwd_ms / the cp = 1 operator's - 1: all the rank's CP work, also "
    .. "what rides inside its local runs; critical_path_ms = the sum over the phases between all-gathers "
    .. "of the slowest rank's stages; efficiency_estimate = the cp = 1 operator's fwdbwd_ms / it") or nil,
}
local csv = run:csv({ "target", "mode", "cp", "n", "tokens_per_rank", "T", "fwd_ms", "fwdbwd_ms", "efficiency_fwd",
                      "efficiency_fwdbwd", "overhead_fraction" })
for _, r in ipairs(rows) do
  csv:row({ target = r.target, mode = r.mode, cp = r.cp, n = r.n, tokens_per_rank = r.tokens_per_rank, T = r.T,
            fwd_ms = r.fwd_ms, fwdbwd_ms = r.fwdbwd_ms, efficiency_fwd = r.efficiency_fwd,
            efficiency_fwdbwd = r.efficiency_fwdbwd,
            overhead_fraction = r.breakdown and r.breakdown.overhead_fraction })
end
if run.dir then
  local f = io.open(run.dir .. "/bench_cp.json", "w")
  if f then f:write(util.json_encode(report, 1), "\n") f:close() end
end
if opts.record ~= "" then
  local path = results.record(opts.record, report)
  if path then put("# recorded: %s", path) end
end
run:finish()
if RANK == 0 and opts.json then io.stdout:write(util.json_encode(report), "\n") end
os.exit(0)
