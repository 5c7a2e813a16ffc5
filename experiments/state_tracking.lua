-- state_tracking: DeltaProduct's state-tracking study (Siems et al. 2025): a one-layer
-- GDP model learns group word problems (token = a group element, label = the prefix
-- product) at one length and is evaluated at longer ones.  The paper's setup: hidden
-- 128, 8 heads x 32 (K = V = 32), no short conv, no output gate, no forget gate, q/k/v
-- through SiLU then the L2 norm, a x4 SwiGLU MLP; AdamW (lr 1e-3, betas 0.9/0.999, eps
-- 1e-8, weight decay 1e-6) on a cosine schedule, batch 2048, 100 epochs over 99k
-- training sequences of length 128, evaluation at length 512, early stop at 0.99.  The
-- metric is the cumulative sequence accuracy: for each prefix length t, the fraction
-- of test sequences with every token up to t right.
--
--   ./gdp experiments/state_tracking.lua --device cuda --dtype bf16   # the grid below
--   ./gdp experiments/state_tracking.lua --quick                      # CPU-sized check
--
-- The grid (through gdp.sweep: a rerun with --resume RUN_DIR skips the rows done, and a
-- failed config is a row with its error; --time_budget S starts no config after S
-- seconds and stops a running one at its next evaluation after S, keeping a checkpoint
-- in the run folder (partial-<key hash>.safetensors) that --resume continues from bit
-- for bit, so a grid, and one long config, spread over calls of a fixed length): task x
-- n_h (Householder steps) x beta range ((0,1): beta_max 1; (0,2): beta_max 2, negative
-- eigenvalues) x seed.  Output: a table
-- of accuracy at lengths 128, 256, 512 per config, results.csv with the curve of every
-- config (acc_at_<t> columns at --curve-step intervals; also curves.csv), and plots of
-- accuracy against length, one figure per task and beta range with a line per n_h and
-- seed (plot-<task>-beta<max>.png).
--
-- --quick: parity (tokens 0/1, label the prefix parity) with a small model at n_h = 1,
-- trained at length 32 and evaluated there, with beta in (0,2) and in (0,1).  It asserts
-- the paper's qualitative result -- parity is learned with negative eigenvalues
-- (>= 0.99) and not without (< 0.8) -- prints "state_tracking quick: ok" or what failed,
-- and exits 1 on a failure.
local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")
local sweep = require("gdp.sweep")
local nn = require("gdp.nn")
local optim = require("gdp.optim")
local train = require("gdp.train")
local data = require("gdp.data")
local tensor = require("gdp.tensor")
local profile = require("gdp.nn.profile")

local opts = util.parse_args(arg, {
    quick = false, device = "cpu", dtype = "f32",
    tasks = "S3,S5", nh = "1,2,3,4", beta_max = "1,2", seeds = "1,2,3",
    hidden = 128, heads = 8, head_dim = 32, mlp_ratio = 4,
    train_len = 128, eval_len = 512, train_seqs = 99000, batch = 2048, epochs = 100,
    eval_batch = 2048, eval_every = 100, early_stop = 0.99, curve_step = 32,
    lr = 1e-3, weight_decay = 1e-6, warmup = 0, max_grad_norm = 1.0, bos = false, curriculum = false,
    resume = "", time_budget = 0, speed = false, speed_steps = 20, against_fla = false, profile = false,
    fla_cmd = "", fla_path = "",
  }, {
  usage = "./gdp experiments/state_tracking.lua [--quick] [options]",
  help = {
    { "quick", "the CPU-sized parity check (see the header); overrides the grid options" },
    { "device", "cpu or cuda" },
    { "dtype", "f64/f32 on the cpu; f32/bf16 on cuda" },
    { "tasks", "comma-separated: parity, S3, S4, A5, S5, modular_addition" },
    { "nh", "Householder steps per token, comma-separated" },
    { "beta_max", "1: beta in (0,1); 2: beta in (0,2) (negative eigenvalues); comma-separated" },
    { "seeds", "model seeds, comma-separated (the data's seeds are fixed: train 1, test 2)" },
    { "hidden", "model width" }, { "heads", "mixer heads" }, { "head_dim", "K = V per head" },
    { "mlp_ratio", "SwiGLU hidden = ratio x hidden" },
    { "train_len", "training sequence length" }, { "eval_len", "evaluation length" },
    { "train_seqs", "training sequences per epoch (offsets cycle through them)" },
    { "batch", "training batch" }, { "epochs", "epochs (steps = epochs x train_seqs / batch)" },
    { "eval_batch", "test sequences" }, { "eval_every", "steps between evaluations" },
    { "early_stop", "stop when the accuracy at eval_len reaches this (0: never)" },
    { "curve_step", "the CSV records the accuracy every this many tokens" },
    { "lr", "AdamW peak learning rate (cosine schedule)" }, { "weight_decay", "AdamW weight decay" },
    { "warmup", "warmup steps" }, { "max_grad_norm", "global gradient-norm clip (0: none)" },
    { "bos", "a start token in front of every sequence, as the authors' [BOS] (its label not scored)" },
    { "curriculum", "the authors' length curriculum: the loss scores the first 2 tokens, one more after " ..
                    "each epoch whose mean loss is below 0.3" },
    { "resume", "a previous run folder of this study: its ok rows are kept, a paused config continues " ..
                "from its checkpoint, the rest run" },
    { "time_budget", "seconds (0: none): no config starts after the grid has run this long, and a running " ..
                     "one stops at its next evaluation with a checkpoint; the rest are left for a rerun " ..
                     "with --resume" },
    { "speed", "instead of training to the end: tokens/s of --speed-steps training steps per n_h" },
    { "speed_steps", "timed steps per n_h with --speed (after 3 untimed)" },
    { "against_fla", "with --speed: fla's GatedDeltaProductForCausalLM at the same config, same call" },
    { "profile", "with --speed: two more steps with gdp.nn.profile attached; prints where a step's time goes" },
    { "fla_cmd", "the fla side's command (empty: python3 tools/fla_state_tracking.py, fla_path on PYTHONPATH)" },
    { "fla_path", "folder holding fla/ for the fla side (empty: <repo>/.fla, as bench_gdp)" },
  },
})

if opts.quick then
  -- parity at length 32 on the cpu: learned in a few hundred steps with beta in (0,2)
  opts.tasks, opts.nh, opts.beta_max, opts.seeds = "parity", "1", "2,1", "1"
  opts.device, opts.dtype = "cpu", "f32"
  opts.hidden, opts.heads, opts.head_dim, opts.mlp_ratio = 16, 2, 8, 2
  opts.train_len, opts.eval_len, opts.batch, opts.eval_batch = 32, 32, 32, 128
  opts.train_seqs, opts.epochs, opts.eval_every = 32 * 400, 1, 50
  opts.lr, opts.warmup, opts.curve_step = 1e-2, 20, 8
end

local function list(s, conv)
  local out = {}
  for item in tostring(s):gmatch("[^,]+") do out[#out + 1] = conv and conv(item) or item end
  return out
end

util.device_or_exit("state_tracking", opts.device)
if opts.against_fla and not opts.speed then
  io.stderr:write("state_tracking: --against-fla times training steps: use it with --speed\n")
  os.exit(2)
end
if opts.against_fla and opts.bos then -- fla's side has no start token: the steps would differ
  io.stderr:write("state_tracking: --against-fla times the same steps on both sides: leave out --bos\n")
  os.exit(2)
end

local TRAIN_SEED, TEST_SEED = 1, 2
local LENGTHS = { 128, 256, 512 }

-- --bos: the authors' setup puts a [BOS] token in front of every sequence (inputs and
-- targets).  Without one the state starts at zero and the first token cannot tell that
-- it is first, so every token's write has to carry the start too; with one the model can
-- write a fixed start once.  Here the start token is class num_classes (one more input
-- id) and its target is ignored by the loss and the accuracy, so the scores stay over
-- the group's tokens.
local IGNORE = -100
local function vocab_of(cfg) return data.num_classes(cfg.task) + (cfg.bos and 1 or 0) end

-- The task's batch, with the start token in front where cfg.bos asks for it.
local function batch_of(cfg, batch, length, seed, offset)
  local x, y = data.state_tracking{ task = cfg.task, batch = batch, length = length, seed = seed,
                                    offset = offset, device = cfg.device }
  if not cfg.bos then return x, y end
  local xb = tensor.empty({ batch, length + 1 }, { dtype = x:dtype(), device = cfg.device })
  local yb = tensor.empty({ batch, length + 1 }, { dtype = y:dtype(), device = cfg.device })
  xb:narrow(2, 1, 1):fill(data.num_classes(cfg.task))
  xb:narrow(2, 2, length):copy(x)
  yb:narrow(2, 1, 1):fill(IGNORE)
  yb:narrow(2, 2, length):copy(y)
  x:free(); y:free()
  return xb, yb
end

-- The model of one config: the paper's layer (every switch off but the L2 norm).
local function make_model(cfg)
  return nn.CausalLM{
    vocab = vocab_of(cfg), hidden = cfg.hidden, layers = 1,
    mixer = { num_heads = cfg.heads, head_dim = cfg.head_dim, state_dim = cfg.head_dim,
              num_groups = cfg.heads, num_householder = cfg.nh,
              allow_neg_eigval = cfg.beta_max == 2, use_short_conv = false,
              use_output_gate = false, use_forget_gate = false },
    mlp_ratio = cfg.mlp_ratio, dtype = cfg.dtype, device = cfg.device, seed = cfg.seed,
  }
end

-- Cumulative sequence accuracy of the model on the test set at eval_len (the group's
-- tokens: after a start token, the positions that follow it).
local function evaluate(model, test)
  local logits = model:forward(test.tokens)
  local L = test.labels:size(2)
  if test.tokens:size(2) > L then logits = logits:narrow(2, test.tokens:size(2) - L + 1, L):contiguous() end
  local acc = data.sequence_accuracy(logits, test.labels)
  model:clear_state()
  return acc
end

local function config_label(cfg)
  return string.format("%s n_h=%d beta_max=%d seed %d", cfg.task, cfg.nh, cfg.beta_max, cfg.seed_model) -- no comma: one CSV field
end

-- A config stopped by the time budget keeps a checkpoint (model, optimiser, RNG, and
-- how far it got) in its run folder; a rerun with --resume continues it from there, so
-- one config can span device calls.  The file is named by the config's sweep key.
local function partial_path(dir, key) return string.format("%s/partial-%08x.safetensors", dir, util.hash(key)) end

-- The checkpoint this config left, in this run's folder or the resumed one (nil: none).
local function find_partial(ctx)
  for _, dir in ipairs({ ctx.run and ctx.run.dir or false, ctx.resume_dir or false }) do
    if dir then
      local path = partial_path(dir, ctx.key)
      local f = io.open(path, "rb")
      if f then f:close() return path end
    end
  end
  return nil
end

local function run_config(cfg, ctx)
  local model = make_model(cfg)
  local steps = math.max(1, math.floor(cfg.epochs * cfg.train_seqs / cfg.batch))
  local opt = optim.AdamW(model, { lr = cfg.lr, betas = { 0.9, 0.999 }, eps = 1e-8,
                                   weight_decay = cfg.weight_decay })
  local schedule = optim.schedule.cosine{ lr = cfg.lr, total_steps = steps,
                                          warmup_steps = math.min(cfg.warmup, steps - 1) }
  local crit = nn.CrossEntropy{ ignore_index = IGNORE }
  local test = {}
  test.tokens, test.labels = batch_of(cfg, cfg.eval_batch, cfg.eval_len, TEST_SEED, 0)
  if cfg.bos then -- the accuracy reads the labels of the group's tokens alone
    local labels = test.labels:narrow(2, 2, cfg.eval_len):contiguous()
    test.labels:free()
    test.labels = labels
  end
  local per_epoch = math.max(1, math.floor(cfg.train_seqs / cfg.batch))
  local t0, tokens, acc, last_loss, step = gdp.time(), 0, nil, nil, 0
  local before_s = 0 -- training seconds of the earlier calls of a continued config
  -- --curriculum (the authors' option): the loss scores the first `scored` group tokens;
  -- an epoch whose mean loss is below 0.3 adds one
  local scored, epoch_loss = cfg.curriculum and math.min(2, cfg.train_len) or cfg.train_len, 0
  local resumed = ctx and find_partial(ctx)
  if resumed then
    local meta
    step, meta = train.load_checkpoint(resumed, { model = model, optimizer = opt })
    local partial = util.json_decode(meta.partial or "{}")
    if partial.key ~= ctx.key then
      error(string.format("state_tracking: %s belongs to the config '%s', not '%s'", resumed,
                          tostring(partial.key), ctx.key))
    end
    tokens, before_s, last_loss = partial.tokens, partial.train_s, partial.loss
    scored, epoch_loss = partial.scored, partial.epoch_loss
    io.stderr:write(string.format("state_tracking: %s continues from step %d of %d (%s)\n", config_label(cfg),
                                  step, steps, resumed))
  end
  local own = ctx and ctx.run and ctx.run.dir and partial_path(ctx.run.dir, ctx.key)
  local first = cfg.bos and 2 or 1 -- label column of the first group token
  while step < steps do
    step = step + 1
    local x, y = batch_of(cfg, cfg.batch, cfg.train_len, TRAIN_SEED, ((step - 1) % per_epoch) * cfg.batch)
    if scored < cfg.train_len then y:narrow(2, first + scored, cfg.train_len - scored):fill(IGNORE) end
    local r = train.step{ model = model, optimizer = opt, criterion = crit, schedule = schedule,
                          max_grad_norm = cfg.max_grad_norm > 0 and cfg.max_grad_norm or nil,
                          batch = { input = x, target = y, tokens = cfg.batch * cfg.train_len } }
    tokens, last_loss = tokens + cfg.batch * cfg.train_len, r.loss
    x:free(); y:free()
    if cfg.curriculum then
      epoch_loss = epoch_loss + r.loss
      if step % per_epoch == 0 then
        if epoch_loss / per_epoch < 0.3 and scored < cfg.train_len then
          scored = scored + 1
          io.stderr:write(string.format("state_tracking: %s step %d: the loss scores %d tokens\n",
                                        config_label(cfg), step, scored))
        end
        epoch_loss = 0
      end
    end
    if step % cfg.eval_every == 0 or step == steps then
      acc = evaluate(model, test)
      if cfg.early_stop > 0 and acc.cumulative[cfg.eval_len] >= cfg.early_stop then break end
      if step < steps and own and ctx.budget_left and ctx.budget_left() <= 0 then
        local partial = { key = ctx.key, tokens = tokens, train_s = before_s + gdp.time() - t0, loss = last_loss,
                          scored = scored, epoch_loss = epoch_loss }
        train.save_checkpoint(own, { model = model, optimizer = opt, config = cfg,
                                     metadata = { partial = util.json_encode(partial) } })
        test.tokens:free(); test.labels:free()
        sweep.pause(string.format("paused at step %d of %d for the time budget (%s); --resume continues it",
                                  step, steps, own))
      end
    end
  end
  test.tokens:free(); test.labels:free()
  if own then os.remove(own) end -- finished: nothing left to continue
  local wall = before_s + gdp.time() - t0
  local out = { steps = step, loss = last_loss, tokens_per_s = tokens / wall, train_s = wall,
                acc_token = acc.token }
  for _, L in ipairs(LENGTHS) do
    if L <= cfg.eval_len then out["acc_" .. L] = acc.cumulative[L] end
  end
  out.acc_train_len = acc.cumulative[math.min(cfg.train_len, cfg.eval_len)]
  for t = cfg.curve_step, cfg.eval_len, cfg.curve_step do out["acc_at_" .. t] = acc.cumulative[t] end
  return out
end

-- --speed: whole training steps (zero_grad, forward, loss, backward, clip, AdamW) of the
-- first task at each n_h, on the training batches; the median step.
local function speed_of(cfg)
  local model = make_model(cfg)
  local opt = optim.AdamW(model, { lr = cfg.lr, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = cfg.weight_decay })
  local crit = nn.CrossEntropy{}
  local ctx = gdp.device(cfg.device)
  local times = {}
  for i = 1, 3 + cfg.speed_steps do
    local x, y = batch_of(cfg, cfg.batch, cfg.train_len, TRAIN_SEED, (i - 1) * cfg.batch)
    ctx:sync()
    local t0 = gdp.time()
    train.step{ model = model, optimizer = opt, criterion = crit,
                max_grad_norm = cfg.max_grad_norm > 0 and cfg.max_grad_norm or nil,
                batch = { input = x, target = y, tokens = cfg.batch * cfg.train_len } }
    ctx:sync()
    if i > 3 then times[#times + 1] = gdp.time() - t0 end
    x:free(); y:free()
  end
  local step_s = util.median(times)
  if cfg.profile then
    local prof = profile.attach(model)
    prof:add(crit, "forward", "criterion forward"):add(crit, "backward", "criterion backward")
    prof:add(opt, "step", "optimizer step"):add(optim, "clip_grad_norm", "clip_grad_norm")
    for i = 1, 2 do
      local x, y = batch_of(cfg, cfg.batch, cfg.train_len, TRAIN_SEED, (i - 1) * cfg.batch)
      prof:stage("the rest of the step", cfg.device, train.step, { model = model, optimizer = opt, criterion = crit,
                 max_grad_norm = cfg.max_grad_norm > 0 and cfg.max_grad_norm or nil,
                 batch = { input = x, target = y, tokens = cfg.batch * cfg.train_len } })
      x:free(); y:free()
    end
    prof:detach()
    print(string.format("# profile of %s at n_h = %d (2 synchronised steps; unprofiled step %.2f ms):",
                        cfg.task, cfg.nh, step_s * 1e3))
    print(prof:format())
  end
  return { step_ms = step_s * 1e3, tokens_per_s = cfg.batch * cfg.train_len / step_s }
end

if opts.speed then
  local task = list(opts.tasks)[1]
  local nhs = list(opts.nh, tonumber)
  local beta = list(opts.beta_max, tonumber)[1]
  local run = results.new_run("state_tracking_speed", { config = opts, args = arg })
  local csv = run:csv({ "task", "nh", "beta_max", "batch", "length", "step_ms", "tokens_per_s",
                        "fla_step_ms", "fla_tokens_per_s", "speedup", "status" })
  local fla = {}
  if opts.against_fla then
    local root = util.repo_root(arg[0]) -- for the default fla side and its fla/
    local fla_dir = opts.fla_path ~= "" and opts.fla_path or (root .. "/.fla")
    local fla_cmd = opts.fla_cmd ~= "" and opts.fla_cmd
      or string.format("PYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} python3 %s", util.shell_quote(fla_dir),
                       util.shell_quote(root .. "/tools/fla_state_tracking.py"))
    local cmd = string.format("%s --nh %s --beta-max %d --vocab %d --batch %d --length %d --steps %d",
                              fla_cmd, opts.nh, beta, data.num_classes(task), opts.batch,
                              opts.train_len, opts.speed_steps)
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    local ok, rep = pcall(util.json_decode, out:match("(%b{})%s*$") or "")
    if not ok or type(rep) ~= "table" or type(rep.rows) ~= "table" then
      io.stderr:write("state_tracking: the fla side gave no report (", cmd, "):\n", out, "\n")
      run:finish({ status = "failed", reason = "fla side failed" })
      os.exit(1)
    end
    for _, r in ipairs(rep.rows) do fla[tonumber(r.nh)] = r end
  end
  local lines = {}
  for _, nh in ipairs(nhs) do
    local cfg = {}
    for k, v in pairs(opts) do cfg[k] = v end
    cfg.task, cfg.nh, cfg.beta_max, cfg.seed = task, nh, beta, 1
    local r = speed_of(cfg)
    local f = fla[nh]
    local row = { task = task, nh = nh, beta_max = beta, batch = opts.batch, length = opts.train_len,
                  step_ms = r.step_ms, tokens_per_s = r.tokens_per_s, status = "ok",
                  fla_step_ms = f and f.step_ms, fla_tokens_per_s = f and f.tokens_per_s,
                  speedup = f and r.tokens_per_s / f.tokens_per_s }
    csv:row(row)
    lines[#lines + 1] = { task, nh, row.step_ms, row.tokens_per_s, row.fla_step_ms or "-",
                          row.fla_tokens_per_s or "-", row.speedup or "-" }
  end
  print(util.format_table({ "task", "n_h", "step_ms", "tok/s", "fla_step_ms", "fla_tok/s", "speedup" }, lines, "%.4g"))
  run:finish({ status = "ok" })
  return
end

local columns = { "steps", "loss", "tokens_per_s", "train_s", "acc_token", "acc_train_len" }
for _, L in ipairs(LENGTHS) do
  if L <= opts.eval_len then columns[#columns + 1] = "acc_" .. L end
end
for t = opts.curve_step, opts.eval_len, opts.curve_step do columns[#columns + 1] = "acc_at_" .. t end

local run = results.new_run("state_tracking", { config = opts, args = arg })
-- accuracy against length, one line per config (the plot's data)
local curves = run:csv({ "config", "length", "acc", "status" }, "curves.csv")
local base = {}
for _, k in ipairs({ "device", "dtype", "hidden", "heads", "head_dim", "mlp_ratio", "train_len",
                     "eval_len", "train_seqs", "batch", "epochs", "eval_batch", "eval_every",
                     "early_stop", "curve_step", "lr", "weight_decay", "warmup", "max_grad_norm" }) do
  base[k] = opts[k]
end
-- (absent when off: the keys of earlier runs' rows stay theirs)
if opts.bos then base.bos = true end
if opts.curriculum then base.curriculum = true end
local curved = {} -- config labels whose curve is in curves.csv
local rows = sweep.run{
  study = "state_tracking", run = run, base = base, columns = columns,
  axes = { task = list(opts.tasks), nh = list(opts.nh, tonumber), beta_max = list(opts.beta_max, tonumber),
           seed_model = list(opts.seeds, tonumber) },
  order = { "task", "nh", "beta_max", "seed_model" },
  resume = opts.resume ~= "" and opts.resume or true,
  time_budget = opts.time_budget > 0 and opts.time_budget or nil,
  fn = function(cfg, ctx)
    cfg.seed = cfg.seed_model
    local out = run_config(cfg, ctx)
    local label = config_label(cfg)
    for t = cfg.curve_step, cfg.eval_len, cfg.curve_step do
      curves:row({ config = label, length = t, acc = out["acc_at_" .. t], status = "ok" })
    end
    curved[label] = true
    return out
  end,
}
-- rows resumed from an earlier run: their curves from the acc_at_* columns read back, so
-- that this run's curves.csv and plot hold every config of the table
for _, r in ipairs(rows) do
  local label = r.status == "ok" and config_label(r)
  if label and not curved[label] then
    for t = opts.curve_step, opts.eval_len, opts.curve_step do
      curves:row({ config = label, length = t, acc = tonumber(r["acc_at_" .. t]), status = "ok" })
    end
    curved[label] = true
  end
end

-- The table: accuracy at each length per config.
local header = { "task", "n_h", "beta", "seed", "steps", "acc@train" }
for _, L in ipairs(LENGTHS) do if L <= opts.eval_len then header[#header + 1] = "acc@" .. L end end
header[#header + 1] = "tok/s"
local lines = {}
for _, r in ipairs(rows) do
  local l = { r.task, r.nh, r.beta_max == 2 and "(0,2)" or "(0,1)", r.seed_model }
  if r.status == "ok" then
    l[#l + 1], l[#l + 2] = r.steps, r.acc_train_len
    for _, L in ipairs(LENGTHS) do if L <= opts.eval_len then l[#l + 1] = r["acc_" .. L] end end
    l[#l + 1] = r.tokens_per_s
  else
    l[#l + 1] = r.status .. ": " .. tostring(r.error)
  end
  lines[#lines + 1] = l
end
print(util.format_table(header, lines, "%.3f"))

-- One figure per task and beta range (a line per n_h and seed): plot-<task>-beta<max>.png.
local figures, by_group = {}, {}
for _, r in ipairs(rows) do
  if r.status == "ok" then
    local key = r.task .. "-beta" .. r.beta_max
    local fig = by_group[key]
    if fig == nil then
      fig = { x = "length", y = "acc", by = "config", values = {}, csv = "curves.csv",
              output = "plot-" .. key .. ".png",
              title = string.format("state tracking, %s, beta in (0,%d): cumulative sequence accuracy",
                                    r.task, r.beta_max),
              xlabel = "length (tokens)", ylabel = "cumulative sequence accuracy" }
      by_group[key] = fig
      figures[#figures + 1] = fig
    end
    fig.values[#fig.values + 1] = config_label(r)
  end
end
if #figures > 0 then sweep.plot(run, figures) end

local failed, not_run = 0, 0
for _, r in ipairs(rows) do
  if r.status == "not_run" then not_run = not_run + 1 elseif r.status ~= "ok" then failed = failed + 1 end
end
if not_run > 0 then
  print(string.format("state_tracking: %d configs not started or paused (--time_budget %g s); rerun with --resume %s",
                      not_run, opts.time_budget, run.dir or "<this run's folder>"))
end

if opts.quick then
  local by_beta = {}
  for _, r in ipairs(rows) do by_beta[r.beta_max] = r end
  local with, without = by_beta[2], by_beta[1]
  local problems = {}
  if not with or with.status ~= "ok" then problems[#problems + 1] = "the (0,2) run failed"
  elseif with.acc_train_len < 0.99 then
    problems[#problems + 1] = string.format("parity with beta in (0,2): %.3f < 0.99", with.acc_train_len)
  end
  if not without or without.status ~= "ok" then problems[#problems + 1] = "the (0,1) run failed"
  elseif without.acc_train_len >= 0.8 then
    problems[#problems + 1] = string.format("parity with beta in (0,1): %.3f >= 0.8", without.acc_train_len)
  end
  run:finish({ status = #problems == 0 and "ok" or "failed",
               reason = #problems > 0 and table.concat(problems, "; ") or nil })
  if #problems > 0 then
    print("state_tracking quick: FAILED: " .. table.concat(problems, "; "))
    os.exit(1)
  end
  print(string.format("state_tracking quick: ok (parity at length %d: %.3f with beta in (0,2), %.3f in (0,1))",
                      opts.train_len, with.acc_train_len, without.acc_train_len))
  return
end

-- configs left by the time budget are no failure: meta.json counts them (not_run)
run:finish({ status = failed == 0 and "ok" or "failed",
             reason = failed > 0 and (failed .. " configs failed") or nil,
             not_run = not_run > 0 and not_run or nil })
if failed > 0 then os.exit(1) end
