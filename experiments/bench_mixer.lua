-- bench_mixer: times one Gated DeltaProduct mixer layer (nn.GatedDeltaProduct): the
-- forward and the forward+backward (parameter gradients included), and with
-- --against-megatron Megatron-Core's GatedDeltaProductMixer at the same shapes in the
-- same run (tools/megatron_mixer.py).
--
--   ./gdp experiments/bench_mixer.lua --device cuda [--dtype bf16] [--T 4096 --B 4
--         --hidden 2048 --heads 16 --head_dim 128 --groups 4 --state 128 --conv 4]
--         [--M 2,3] [--warmup 2 --repeat 10] [--profile] [--against-megatron
--         [--python python3] [--megatron-path .megatron] [--fla-path .fla]]
--         [--json] [--record NAME]
--
-- The issue's comparison (one H200):
--   ./gdp experiments/bench_mixer.lua --device cuda --against-megatron --profile --json \
--         --record mixer-h200
--
-- Each repeat draws fresh random inputs x, dy ~ N(0, 1) outside the timed region; times are
-- medians over --repeat after --warmup untimed runs, host-timed between device
-- synchronisations.  The layer's parameters are Megatron's init (seed 1), conv bias as
-- --conv_bias (Megatron's default: on).
--
-- Memory: activation_bytes is gdp's live device memory (gdp.memory_live_bytes) that the
-- forward leaves for the backward (the layer's cache), measured after a forward as the
-- difference to before it; step_live_peak_bytes is the highest live count sampled between
-- the stages of one forward+backward, beyond what was live before it (a lower bound of
-- the true peak: kernels' scratch and transients inside a stage are not seen).
-- Megatron's figure is torch.cuda.max_memory_allocated during one forward+backward beyond
-- what was allocated before it (its activations, saved tensors, gradients and transients).
--
-- --profile: one more forward+backward per repeat, run stage by stage with a device
-- synchronisation around each (in_proj, conv, ssm_inputs, ssm, out; out_backward,
-- ssm_backward, ssm_inputs_backward, conv_backward, in_proj_backward): median ms per
-- stage (the sum is above the plain time by the synchronisations).
--
-- Output: a table (stderr with --json, whose stdout is ONE JSON object: configuration,
-- command, per-shape rows with fwd_ms, fwdbwd_ms, stages, memory, Megatron's figures and
-- speedup_fwd / speedup_fwdbwd = Megatron ms / ours (> 1: we are faster)).  --record NAME
-- also writes it to results/<UTC date>-NAME.json.  Exit status 0 when everything ran, 1
-- when something failed, 2 on bad options or a missing Megatron setup.

local config = {
  device = "cuda",
  dtype = "bf16",
  T = 4096, B = 4, hidden = 2048, heads = 16, head_dim = 128, groups = 4, state = 128,
  conv = 4, M = "2,3", conv_bias = true, neg_eigval = false,
  warmup = 2, ["repeat"] = 10,
  profile = false,
  against_megatron = false,
  python = "python3",
  megatron_path = "",   -- "": <repo>/.megatron
  fla_path = "",        -- "": <repo>/.fla
  megatron_cmd = "",    -- test hook: replaces `python3 tools/megatron_mixer.py`
  json = false,
  record = "",
}

local gdp = require("gdp")
local util = require("gdp.util")
local nn = require("gdp.nn")

local opts = util.parse_args(arg, config, {
  usage = "./gdp experiments/bench_mixer.lua [options]",
  description = "Times one GatedDeltaProduct mixer layer (and Megatron's, with --against-megatron).",
  help = {
    { "device", "device (cuda, cuda:<i>, cpu)" },
    { "dtype", "layer dtype (bf16 or f32 on cuda; f32 or f64 on the cpu)" },
    { "M", "Householder steps per token, comma-separated (one row each)" },
    { "profile", "also time each stage (synchronised) per repeat" },
    { "against_megatron", "time Megatron-Core's mixer in the same run" },
    { "megatron_path", "folder holding megatron/core (default <repo>/.megatron)" },
    { "fla_path", "folder holding fla/ (default <repo>/.fla)" },
    { "record", "NAME: also write the JSON report to results/<UTC date>-NAME.json" },
  },
  choices = { dtype = { "f64", "f32", "bf16" } },
  aliases = { ["against-megatron"] = "against_megatron", ["megatron-path"] = "megatron_path",
              ["fla-path"] = "fla_path", ["megatron-cmd"] = "megatron_cmd",
              ["head-dim"] = "head_dim", ["conv-bias"] = "conv_bias", ["neg-eigval"] = "neg_eigval" },
})

local function say(fmt, ...) io.stderr:write(string.format(fmt, ...), "\n") end
local out = opts.json and io.stderr or io.stdout
local function put(fmt, ...) out:write(string.format(fmt, ...), "\n") end

local root = util.repo_root(arg[0])

local Ms = {}
for v in tostring(opts.M):gmatch("[^,]+") do
  local m = tonumber(v)
  if not m or m < 1 or m ~= math.floor(m) then
    say("bench_mixer: --M: expected integers >= 1, comma-separated, got '%s'", tostring(opts.M))
    os.exit(2)
  end
  Ms[#Ms + 1] = m
end
if opts.record ~= "" and not opts.record:match("^[%w%-_.]+$") then
  say("bench_mixer: --record: expected a name of letters, digits, '-', '_' and '.', got %s", opts.record)
  os.exit(2)
end

local ok_ctx, ctx = pcall(gdp.device, opts.device)
if not ok_ctx then
  say("bench_mixer: device %s: %s", opts.device, tostring(ctx))
  os.exit(2)
end
local devtype = opts.device:match("^cuda") and "cuda" or "cpu"

------------------------------------------------------------------------------- megatron

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local text = p:read("*a")
  local ok, _, rc = p:close()
  return text, ok and 0 or (rc or 1)
end

local function megatron_command(args)
  if opts.megatron_cmd ~= "" then return opts.megatron_cmd .. " " .. args end
  local mp = opts.megatron_path ~= "" and opts.megatron_path or (root .. "/.megatron")
  local fp = opts.fla_path ~= "" and opts.fla_path or (root .. "/.fla")
  return string.format("cd %s && PYTHONPATH=%s:%s${PYTHONPATH:+:$PYTHONPATH} %s tools/megatron_mixer.py %s",
                       util.shell_quote(root), util.shell_quote(mp), util.shell_quote(fp),
                       util.shell_quote(opts.python), args)
end

-- JSON objects of the tool's output lines.
local function json_lines(text)
  local rows = {}
  for line in text:gmatch("[^\n]+") do
    if line:match("^%s*{") then
      local ok, v = pcall(util.json_decode, line)
      if ok and type(v) == "table" then rows[#rows + 1] = v end
    end
  end
  return rows
end

if opts.against_megatron then
  local problems = {}
  if opts.megatron_cmd == "" then
    if devtype ~= "cuda" then problems[#problems + 1] = "--against-megatron needs --device cuda" end
    if opts.dtype ~= "bf16" then problems[#problems + 1] = "--against-megatron times Megatron in bf16: use --dtype bf16" end
    local mp = opts.megatron_path ~= "" and opts.megatron_path or (root .. "/.megatron")
    local f = io.open(mp .. "/megatron/core/ssm/gated_delta_product.py")
    if f then f:close() else problems[#problems + 1] = "no megatron/core/ssm/gated_delta_product.py under " .. mp end
  end
  if #problems == 0 then
    local text = sh(megatron_command("--check"))
    local rows = json_lines(text)
    if not (rows[1] and rows[1].ok) then
      problems[#problems + 1] = "tools/megatron_mixer.py --check: " .. (rows[1] and tostring(rows[1].error) or text)
    end
  end
  if #problems > 0 then
    for _, p in ipairs(problems) do say("bench_mixer: %s", p) end
    os.exit(2)
  end
end

------------------------------------------------------------------------------- gdp

local function layer_cfg(M)
  return {
    hidden_size = opts.hidden, num_heads = opts.heads, head_dim = opts.head_dim,
    num_groups = opts.groups, state_dim = opts.state, num_householder = M,
    conv_width = opts.conv, conv_bias = opts.conv_bias, allow_neg_eigval = opts.neg_eigval,
    dtype = opts.dtype, device = opts.device, seed = 1,
  }
end

local function live() return gdp.memory_live_bytes(devtype) end

local function inputs()
  local x = gdp.randn({ opts.T, opts.B, opts.hidden }, { dtype = opts.dtype, device = opts.device })
  local dy = gdp.randn({ opts.T, opts.B, opts.hidden }, { dtype = opts.dtype, device = opts.device })
  return x, dy
end

local function timed(fn)
  ctx:sync()
  local t0 = gdp.time()
  fn()
  ctx:sync()
  return gdp.time() - t0
end

local FWD_STAGES = { "in_proj", "conv", "ssm_inputs", "ssm", "out" }
local BWD_STAGES = { "out_backward", "ssm_backward", "ssm_inputs_backward", "conv_backward", "in_proj_backward" }

-- One forward+backward stage by stage (the steps of GatedDeltaProduct:forward/backward),
-- each timed between synchronisations; also samples the live bytes between stages.
local function profiled_step(m, x, dy, base)
  local t, peak = {}, 0
  local function stage(name, fn)
    local r
    t[name] = timed(function() r = { fn() } end) -- trailing nils only (dx_v without D)
    peak = math.max(peak, live() - base)
    return unpack(r)
  end
  m:clear_state()
  local zx = stage("in_proj", function() return m:in_proj_forward(x) end)
  local parts = m:split_in_proj(zx)
  local xBC_c = stage("conv", function() return m:conv_forward(parts.xBC, nil) end)
  local inp = stage("ssm_inputs", function() return m:ssm_inputs(xBC_c, parts.b, parts.a) end)
  local o, op_saved = stage("ssm", function() return m:ssm_forward(inp, nil, m.save_for_backward) end)
  local _, saved = stage("out", function() return m:out_forward(o, parts.z, inp.x_v) end)
  local dzx, dparts = m:in_proj_grad(x:size(1), x:size(2))
  -- as GatedDeltaProduct:backward: the stages fill dzx's sections in place
  local d_o, dx_v = stage("out_backward", function()
    local o_grad, _, x_v_grad = m:out_backward(saved, parts.z, inp.x_v, dy, dparts.z)
    return o_grad, x_v_grad
  end)
  local g = stage("ssm_backward", function() return m:ssm_backward(inp, nil, d_o, op_saved) end)
  if op_saved then op_saved:free() end
  local dxBC_c = stage("ssm_inputs_backward", function()
    return m:ssm_inputs_backward(g, parts.b, parts.a, dx_v, { db = dparts.b, da = dparts.a })
  end)
  stage("conv_backward", function() m:conv_backward(parts.xBC, dxBC_c, nil, nil, nil, nil, nil, dparts.xBC) end)
  stage("in_proj_backward", function() return m:in_proj_backward(x, dzx) end)
  return t, peak
end

local function bench_shape(M)
  local m = nn.GatedDeltaProduct(layer_cfg(M))
  local fwd, fb, stages, act, peaks = {}, {}, {}, {}, {}
  for _, s in ipairs(FWD_STAGES) do stages[s] = {} end
  for _, s in ipairs(BWD_STAGES) do stages[s] = {} end
  for r = 1, opts.warmup + opts["repeat"] do
    local keep = r > opts.warmup
    local x, dy = inputs()
    m:clear_state()
    collectgarbage(); collectgarbage()
    ctx:sync()
    local before = live()
    local t_f = timed(function() m:forward(x) end)
    local a = live() - before
    m:clear_state()
    collectgarbage(); collectgarbage()
    local t_fb = timed(function()
      m:forward(x)
      m:backward(x, dy)
    end)
    m:clear_state()
    if keep then
      fwd[#fwd + 1], fb[#fb + 1], act[#act + 1] = t_f, t_fb, a
    end
    if opts.profile then
      collectgarbage(); collectgarbage()
      local base = live()
      local t, peak = profiled_step(m, x, dy, base)
      if keep then
        for name, v in pairs(t) do table.insert(stages[name], v) end
        peaks[#peaks + 1] = peak
      end
      m:clear_state()
    end
    x:free(); dy:free()
  end
  local row = {
    M = M, T = opts.T, B = opts.B, hidden = opts.hidden, heads = opts.heads,
    head_dim = opts.head_dim, groups = opts.groups, state = opts.state, conv = opts.conv,
    fwd_ms = util.median(fwd) * 1e3, fwdbwd_ms = util.median(fb) * 1e3,
    activation_bytes = util.median(act),
    tokens = opts.T * opts.B,
  }
  row.tokens_per_s_fwdbwd = row.tokens / (row.fwdbwd_ms / 1e3)
  if opts.profile then
    row.stages_ms = {}
    for _, list in ipairs({ FWD_STAGES, BWD_STAGES }) do
      for _, s in ipairs(list) do row.stages_ms[s] = util.median(stages[s]) * 1e3 end
    end
    row.step_live_peak_bytes = util.median(peaks)
  end
  return row
end

local start_time = os.date("!%Y-%m-%dT%H:%M:%SZ")
local rows, failures = {}, {}
for _, M in ipairs(Ms) do
  local ok, row = pcall(bench_shape, M)
  if ok then
    rows[#rows + 1] = row
  else
    failures[#failures + 1] = string.format("M = %d: %s", M, tostring(row))
    rows[#rows + 1] = { M = M, error = tostring(row) }
  end
  collectgarbage(); collectgarbage()
end

------------------------------------------------------------------------------- megatron run

local megatron_cmd, megatron_err
if opts.against_megatron then
  local shapes = {}
  for _, M in ipairs(Ms) do
    shapes[#shapes + 1] = table.concat({ opts.T, opts.B, opts.hidden, opts.heads, opts.head_dim,
                                         opts.groups, opts.state, M }, ":")
  end
  megatron_cmd = megatron_command(string.format("--shapes %s --reps %d --warmup %d --conv-bias %d",
                                                table.concat(shapes, ","), opts["repeat"],
                                                math.max(opts.warmup, 1), opts.conv_bias and 1 or 0))
  local text, rc = sh(megatron_cmd)
  local by_M = {}
  for _, r in ipairs(json_lines(text)) do
    if r.error then megatron_err = (megatron_err and megatron_err .. "; " or "") .. tostring(r.error)
    elseif r.M then by_M[r.M] = r end
  end
  if rc ~= 0 and not megatron_err then megatron_err = "exit status " .. tostring(rc) .. ": " .. text:sub(-2000) end
  for _, row in ipairs(rows) do
    local r = by_M[row.M]
    if r and row.fwd_ms then
      row.megatron_fwd_ms, row.megatron_fwdbwd_ms = r.fwd_ms, r.fwdbwd_ms
      row.megatron_peak_bytes = r.peak_bytes
      row.speedup_fwd = r.fwd_ms / row.fwd_ms
      row.speedup_fwdbwd = r.fwdbwd_ms / row.fwdbwd_ms
      row.megatron_norm = r.norm
    elseif not r then
      failures[#failures + 1] = string.format("M = %d: no Megatron result", row.M)
    end
  end
  if megatron_err then failures[#failures + 1] = "megatron: " .. megatron_err end
end

------------------------------------------------------------------------------- output

local function mib(b) return b and string.format("%.1f", b / 2 ^ 20) or "" end
local function ms(v) return v and string.format("%.3f", v) or "" end
put("# gdp %s, %s, %s, hidden %d, %d heads x %d, %d groups x %d, conv %d, T = %d, B = %d, median of %d",
    gdp.version, ctx:name(), opts.dtype, opts.hidden, opts.heads, opts.head_dim, opts.groups,
    opts.state, opts.conv, opts.T, opts.B, opts["repeat"])
local header = { "M", "fwd_ms", "fwdbwd_ms", "act_MiB", "mega_fwd", "mega_fb", "mega_MiB", "speedup_f", "speedup_fb" }
local trows = {}
for _, r in ipairs(rows) do
  trows[#trows + 1] = { tostring(r.M), ms(r.fwd_ms), ms(r.fwdbwd_ms), mib(r.activation_bytes),
                        ms(r.megatron_fwd_ms), ms(r.megatron_fwdbwd_ms), mib(r.megatron_peak_bytes),
                        r.speedup_fwd and string.format("%.2fx", r.speedup_fwd) or "",
                        r.speedup_fwdbwd and string.format("%.2fx", r.speedup_fwdbwd) or "" }
end
put("%s", util.format_table(header, trows))
if opts.profile then
  for _, r in ipairs(rows) do
    if r.stages_ms then
      local parts = {}
      for _, list in ipairs({ FWD_STAGES, BWD_STAGES }) do
        for _, s in ipairs(list) do parts[#parts + 1] = string.format("%s %.3f", s, r.stages_ms[s]) end
      end
      put("# M = %d stages (ms): %s; live peak between stages %s MiB", r.M, table.concat(parts, ", "),
          mib(r.step_live_peak_bytes))
    end
  end
end
for _, f in ipairs(failures) do put("# error: %s", f) end

local command = { "./gdp", arg[0] }
for _, a in ipairs(arg) do
  command[#command + 1] = a:match("^[%w%-_.,:=/+]+$") and a or util.shell_quote(a)
end
local git = require("gdp.results").git_info()
local report = {
  tool = "bench_mixer", command = table.concat(command, " "), config = opts,
  start_time = start_time, end_time = os.date("!%Y-%m-%dT%H:%M:%SZ"), device = ctx:name(),
  gdp_version = gdp.version, git_sha = git.short, git_dirty = git.dirty,
  shapes = util.json_array(rows), status = #failures == 0 and "ok" or "error",
  error = #failures > 0 and table.concat(failures, "; ") or nil,
  speedup = "Megatron ms / our ms (> 1: ours is faster)",
  memory = "activation_bytes: gdp live device bytes the forward keeps for the backward; "
           .. "megatron_peak_bytes: torch.cuda.max_memory_allocated over one forward+backward "
           .. "beyond what was allocated before it",
  megatron = opts.against_megatron and { command = megatron_cmd, error = megatron_err } or nil,
}
if opts.record ~= "" then
  local ok, path = pcall(require("gdp.results").record, opts.record, report)
  if ok then
    put("# recorded: %s", path)
  else
    put("# error: %s", tostring(path))
    report.status = "error"
  end
end
if opts.json then io.stdout:write(util.json_encode(report), "\n") end
os.exit(report.status == "ok" and 0 or 1)
