-- gdp.train: the training loop -- one step (zero_grad, forward, loss, backward, clip,
-- optimiser step, schedule), runs with progress lines, periodic evaluation, run-folder
-- records, and checkpoints that resume bit for bit.
--
--   local train = require("gdp.train")
--   local result = train.run{
--     model = model, optimizer = gdp.optim.AdamW(model, {lr = 1e-3}),
--     criterion = crit,                 -- crit:forward(out, target) -> loss (a number),
--                                       -- crit:backward(out, target) -> d out; one with
--                                       -- forward_tensor (nn.CrossEntropy) is read once
--                                       -- a step, with the gradient norms
--     batch = function(step) return {input = x, target = y, args = {cu}, tokens = n} end,
--     steps = 1000, schedule = gdp.optim.schedule.cosine{lr = 1e-3, total_steps = 1000},
--     max_grad_norm = 1.0,              -- nil: measure the norm, do not clip
--     log_every = 10, eval_every = 100, eval = function(model, step) return {acc = a} end,
--     checkpoint = "ckpt.safetensors", checkpoint_every = 100,   -- and at the end
--     resume = "ckpt.safetensors",      -- continue a run from its checkpoint
--     run = gdp.results.new_run("study", {...}),  -- or study = "name": results.csv, plot
--     config = {...},                   -- recorded in checkpoints (and the run's meta)
--   }
--   -- result.step, result.losses[step], result.evals[step], result.checkpoint
--
-- The model follows gdp.nn's contract: forward(input, ...) and backward(input, d_out, ...)
-- with batch.args as the extra arguments.  `forward_backward = function(model, batch)
-- -> loss` replaces the criterion for models with another calling convention (it runs
-- forward, loss and backward itself; the gradients are zeroed before).
--
-- Bit-exact resume.  A checkpoint holds the parameters, the optimiser's state and step,
-- the RNG state of every default context (seed and Philox offset) and the config;
-- loading it restores all of them, so a run that stops at step N and resumes gives the
-- parameters and losses of the run that did not stop, bit for bit -- provided
-- batch(step) depends only on the step and on gdp's RNG, as the schedule depends only on
-- the step.
local ffi = require("ffi")
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")
local gio = require("gdp.io")
local optim = require("gdp.optim")
local progress = require("gdp.progress")
local results = require("gdp.results")
local util = require("gdp.util")

local argerror = tensor.argerror

local function gdp_time() return lib.gdp_time_now() end

local M = {}

M.CHECKPOINT_FORMAT = "gdp.checkpoint"
M.CHECKPOINT_VERSION = 1

------------------------------------------------------------------------------- one step

local step_keys = { model = true, optimizer = true, criterion = true, forward_backward = true,
                    batch = true, schedule = true, max_grad_norm = true }

local function check_model(fn, model)
  if type(model) ~= "table" or type(model.zero_grad) ~= "function" or type(model.forward) ~= "function" then
    argerror(fn, "model: expected a module with forward, backward and zero_grad, got " .. type(model))
  end
end

-- One training step; returns {step, loss, grad_norm, lr, tokens}.  The loss and the
-- gradient norm must be finite: otherwise an error names the step (the parameters are
-- left as they were before the optimiser step).
function M.step(a)
  local fn = "train.step"
  a = tensor.check_opts(fn, a, step_keys)
  check_model(fn, a.model)
  local opt, batch = a.optimizer, a.batch
  if type(opt) ~= "table" or type(opt.step) ~= "function" then
    argerror(fn, "optimizer: expected a gdp.optim optimiser, got " .. type(opt))
  end
  if type(batch) ~= "table" or batch.input == nil then
    argerror(fn, "batch: expected a table {input =, target =, args =, tokens =}, got " .. type(batch))
  end
  if a.criterion == nil and a.forward_backward == nil then
    argerror(fn, "criterion: expected a criterion (forward/backward) or a forward_backward function")
  end
  local step = opt:steps() + 1
  if a.schedule then opt:set_lr(a.schedule(step)) end
  local model = a.model
  model:zero_grad()
  local loss
  local args = batch.args or {}
  if a.forward_backward then
    loss = a.forward_backward(model, batch)
  else
    local out = model:forward(batch.input, unpack(args))
    local crit = a.criterion
    if crit.forward_tensor then
      loss = crit:forward_tensor(out, batch.target)
    else
      loss = crit:forward(out, batch.target)
    end
    local dout = crit:backward(out, batch.target)
    model:backward(batch.input, dout, unpack(args))
  end
  -- The norms' read back is the step's one wait on the device (on cuda it also reports
  -- the checks the step's ops queued, gdp.h "model layer ops"); a loss left on the
  -- device is read after it, from an all but empty queue.
  local norm = optim.clip_grad_norm(model, a.max_grad_norm)
  if tensor.is_tensor(loss) then loss = loss:get(1) end
  if type(loss) ~= "number" then loss = tonumber(loss) end
  if loss == nil or loss ~= loss or loss == math.huge or loss == -math.huge then
    error(string.format("gdp.train.step: step %d: the loss is %s (not finite); stopping", step, tostring(loss)), 2)
  end
  if norm ~= norm or norm == math.huge then
    error(string.format("gdp.train.step: step %d: the gradient norm is %s (not finite); stopping", step,
                        tostring(norm)), 2)
  end
  opt:step()
  local tokens = batch.tokens
  if tokens == nil and tensor.is_tensor(batch.input) then tokens = batch.input:numel() end
  return { step = step, loss = loss, grad_norm = norm, lr = opt:get_lr(), tokens = tokens or 0 }
end

------------------------------------------------------------------------------- RNG state

local function u64_text(x) return (tostring(x):gsub("ULL$", "")) end

local function u64_parse(fn, s)
  if type(s) ~= "string" or not s:match("^%d+$") or #s > 20 then
    argerror(fn, "rng: expected a decimal uint64, got " .. tostring(s))
  end
  local v = ffi.new("uint64_t", 0)
  for i = 1, #s do v = v * 10 + (s:byte(i) - 48) end
  if u64_text(v) ~= s then argerror(fn, "rng: " .. s .. " does not fit in a uint64") end
  return v
end

-- {initial = <gdp.manual_seed's seed or nil>, contexts = {["cpu"] = {seed, offset}, ...}}
-- as strings, exactly.
function M.rng_state()
  local out = { contexts = {} }
  local initial = tensor.initial_seed()
  if initial ~= nil then out.initial = string.format("%.0f", initial) end
  for _, c in ipairs(tensor.default_contexts()) do
    out.contexts[c:name()] = { seed = u64_text(lib.gdp_ctx_seed(c)), offset = u64_text(lib.gdp_ctx_rng_offset(c)) }
  end
  return out
end

function M.set_rng_state(state)
  local fn = "train.set_rng_state"
  if type(state) ~= "table" or type(state.contexts) ~= "table" then
    argerror(fn, "state: expected the table rng_state() returns")
  end
  if state.initial ~= nil then tensor.manual_seed(tonumber(state.initial)) end
  for name, s in pairs(state.contexts) do
    local c = tensor.get_ctx(fn, name)
    lib.gdp_ctx_manual_seed(c, u64_parse(fn, s.seed))
    lib.gdp_ctx_set_rng_offset(c, u64_parse(fn, s.offset))
  end
end

------------------------------------------------------------------------------- checkpoints

-- Writes one safetensors file: "model.<name>" for every parameter (in its dtype),
-- "optim.<name>.<state>" for the optimiser's tensors, and metadata: format, version,
-- step, optimizer (its kind, step, lr, hyperparameters), rng, config (JSON) and
-- param_names.  Written to path .. ".tmp" first, then renamed: a crash mid-write
-- leaves the previous checkpoint intact.
function M.save_checkpoint(path, a)
  local fn = "train.save_checkpoint"
  if type(path) ~= "string" or path == "" then argerror(fn, "path: expected a file name, got " .. tostring(path)) end
  a = tensor.check_opts(fn, a, { model = true, optimizer = true, config = true, metadata = true })
  local model, opt = a.model, a.optimizer
  local tensors = {}
  local params = model:parameters()
  local names = model:parameter_names()
  for _, name in ipairs(names) do tensors["model." .. name] = params[name] end
  for key, t in pairs(opt:state_tensors()) do tensors["optim." .. key] = t end
  local meta = {}
  for k, v in pairs(a.metadata or {}) do meta[k] = v end
  meta.format = M.CHECKPOINT_FORMAT
  meta.format_version = M.CHECKPOINT_VERSION
  meta.step = opt:steps()
  meta.optimizer = util.json_encode(opt:state_metadata())
  meta.rng = util.json_encode(M.rng_state())
  meta.config = util.json_encode(a.config or {})
  meta.param_names = util.json_encode(util.json_array(names))
  local tmp = path .. ".tmp"
  gio.save(tmp, tensors, meta)
  local ok, err = os.rename(tmp, path)
  if not ok then argerror(fn, "cannot move " .. tmp .. " to " .. path .. ": " .. tostring(err)) end
  return path
end

-- Restores a checkpoint into model and optimizer (same architecture: every parameter
-- and state tensor present with its shape) and the RNG state.  Returns the step and the
-- metadata (config decoded from JSON as meta.config_table).
function M.load_checkpoint(path, a)
  local fn = "train.load_checkpoint"
  a = tensor.check_opts(fn, a, { model = true, optimizer = true, device = true })
  local model, opt = a.model, a.optimizer
  local tensors, meta = gio.load(path, { device = a.device or model.device })
  if meta.format ~= M.CHECKPOINT_FORMAT then
    argerror(fn, string.format("%s: not a gdp checkpoint (metadata format = %s, expected %s)", path,
                               tostring(meta.format), M.CHECKPOINT_FORMAT))
  end
  if tonumber(meta.format_version) ~= M.CHECKPOINT_VERSION then
    argerror(fn, string.format("%s: checkpoint format version %s, this gdp reads %d", path,
                               tostring(meta.format_version), M.CHECKPOINT_VERSION))
  end
  local params, state = {}, {}
  for key, t in pairs(tensors) do
    local name = key:match("^model%.(.+)$")
    if name then params[name] = t end
    local skey = key:match("^optim%.(.+)$")
    if skey then state[skey] = t end
  end
  -- parameters first: the optimiser then records their write counters (bf16 masters)
  model:set_parameters(params, true)
  if type(model.clear_state) == "function" then model:clear_state() end
  if opt then opt:load_state(state, util.json_decode(meta.optimizer)) end
  M.set_rng_state(util.json_decode(meta.rng))
  meta.config_table = util.json_decode(meta.config)
  return tonumber(meta.step), meta
end

------------------------------------------------------------------------------- runs

local run_keys = {
  model = true, optimizer = true, criterion = true, forward_backward = true, batch = true,
  steps = true, schedule = true, max_grad_norm = true, log_every = true, eval_every = true,
  eval = true, checkpoint = true, checkpoint_every = true, resume = true, run = true,
  study = true, config = true, out = true, on_step = true,
}

-- Option `key` of a, or default; nil (absent, no default) stays nil.
local function opt_int(fn, a, key, default, min)
  local v = a[key]
  if v == nil then v = default end
  return util.int_opt(fn, key, v, min)
end

local function fmt_rate(x)
  if x >= 1e6 then return string.format("%.2fM", x / 1e6) end
  if x >= 1e3 then return string.format("%.1fK", x / 1e3) end
  return string.format("%.0f", x)
end

-- status: the plot draws only rows whose status is ok (gdp.results.plot)
local LOG_COLUMNS = { "step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "status" }

-- Runs steps opt:steps() + 1 .. a.steps (after a resume: from the checkpoint's step).
function M.run(a)
  local fn = "train.run"
  a = tensor.check_opts(fn, a, run_keys)
  check_model(fn, a.model)
  if type(a.batch) ~= "function" then argerror(fn, "batch: expected a function(step) -> batch, got " .. type(a.batch)) end
  local total = opt_int(fn, a, "steps", nil, 0)
  local log_every = opt_int(fn, a, "log_every", 10, 1)
  local eval_every = opt_int(fn, a, "eval_every", nil, 1)
  local ckpt_every = opt_int(fn, a, "checkpoint_every", nil, 1)
  if eval_every and type(a.eval) ~= "function" then argerror(fn, "eval: expected a function(model, step) with eval_every") end
  if a.run and a.study then argerror(fn, "run, study: give one (a run folder, or a study name to make one)") end
  local run = a.run
  if a.study then run = results.new_run(a.study, { config = a.config }) end
  local ckpt_path = a.checkpoint
  if ckpt_every and not ckpt_path then
    if not (run and run.dir) then
      argerror(fn, "checkpoint: expected a path with checkpoint_every (or a run folder to put it in)")
    end
    ckpt_path = run.dir .. "/checkpoint.safetensors"
  end
  local opt = a.optimizer
  local result = { losses = {}, evals = {}, checkpoint = ckpt_path }
  if a.resume then
    local step = M.load_checkpoint(a.resume, { model = a.model, optimizer = opt })
    result.resumed_from = step
    if run and run.meta then
      run.meta.resumed_from = { path = a.resume, step = step }
      run:write_meta()
    end
  end
  local log_csv, eval_csv
  if run then
    log_csv = run:csv(LOG_COLUMNS)
  end
  local bar = progress.new(math.max(total - opt:steps(), 0), { title = "train", out = a.out })
  local t_start = gdp_time()
  local t_window, tokens_window, steps_done = t_start, 0, 0

  local function evaluate(step)
    local metrics = a.eval(a.model, step)
    if type(metrics) ~= "table" then argerror(fn, "eval: expected a table of metrics, got " .. type(metrics)) end
    result.evals[step] = metrics
    if run then
      if not eval_csv then
        local cols = { "step" }
        for k in pairs(metrics) do cols[#cols + 1] = k end
        table.sort(cols, function(x, y) return x == "step" or (y ~= "step" and x < y) end)
        eval_csv = run:csv(cols, "eval.csv")
      end
      local row = { step = step }
      for k, v in pairs(metrics) do row[k] = v end
      eval_csv:row(row)
    end
    return metrics
  end

  local function save(step)
    M.save_checkpoint(ckpt_path, { model = a.model, optimizer = opt, config = a.config })
    result.checkpoint_step = step
  end

  local first = opt:steps() + 1
  for step = first, total do
    local r = M.step({ model = a.model, optimizer = opt, criterion = a.criterion,
                       forward_backward = a.forward_backward, batch = a.batch(step),
                       schedule = a.schedule, max_grad_norm = a.max_grad_norm })
    result.losses[step] = r.loss
    steps_done = steps_done + 1
    tokens_window = tokens_window + r.tokens
    local label = string.format("step %d loss %.5g lr %.3g", step, r.loss, r.lr)
    bar:update(steps_done, label)
    if step % log_every == 0 or step == total then
      local now = gdp_time()
      local rate = tokens_window / math.max(now - t_window, 1e-9)
      local eta = (now - t_start) / steps_done * (total - step)
      local line = string.format("step %d/%d  loss %.5g  lr %.3g  |g| %.3g  %s tok/s  ETA %s", step, total,
                                 r.loss, r.lr, r.grad_norm, fmt_rate(rate), progress.format_time(eta))
      if not bar.tty and not bar.silent then
        bar.out:write("train: " .. line .. "\n")
        bar.out:flush()
      end
      if log_csv then
        log_csv:row({ step = step, loss = r.loss, lr = r.lr, grad_norm = r.grad_norm, tokens_per_s = rate,
                      elapsed_s = now - t_start, status = "ok" })
      end
      t_window, tokens_window = now, 0
    end
    if a.on_step then a.on_step(r) end
    if eval_every and step % eval_every == 0 then evaluate(step) end
    if ckpt_every and step % ckpt_every == 0 and step ~= total then save(step) end
  end
  bar:finish()
  -- after the rows: the plot renders its PNG when written
  if run then run:plot({ x = "step", y = { "loss" }, logy = true, title = (run.study or "train") .. ": training loss" }) end
  local last = math.max(opt:steps(), 0)
  if a.eval and result.evals[last] == nil then evaluate(last) end
  if ckpt_path then save(last) end
  result.step = last
  if a.study and run then run:finish({ status = "ok" }) end
  return result
end


return M
