-- train_lm: a GDP language model on bytes (vocab 256, no tokenizer to train), through
-- gdp.train: progress lines, evaluation on a held-out tail of the text, a run folder
-- with the loss curve (results.csv, eval.csv, plot.gp / plot.png) and a checkpoint that
-- --resume continues bit for bit.  Reports tokens/s and, with a peak rate, MFU.
--
--   ./gdp experiments/train_lm.lua --device cuda --dtype bf16                 # 6 x 512, n_h = 2
--   ./gdp experiments/train_lm.lua --text corpus.txt --steps 2000 --batch 16 --seq 1024
--   ./gdp experiments/train_lm.lua --quick                                    # CPU-sized check
--
-- Text: --text FILE (its bytes), else the repository's own README.md and docs/*.md
-- (about 100 KB: enough to see the loss fall, not to learn English).  The last
-- --val-fraction of the bytes is held out.  Batch `step` reads --batch windows of --seq + 1
-- bytes at positions hashed from (--seed, step, row), so a batch depends on its step
-- only (what bit-exact resume needs) and never on the order runs are made in.
--
-- FLOP per token (forward + backward = 3x forward): 6 x the parameters' weight (every
-- matmul: embedding head included when tied) plus the GDP operator's 3 x 2 K V (2n+1)
-- per head and layer; MFU = that x tokens/s / --peak-tflops (default 989 on cuda: the
-- H200's dense bf16 rate; none on the cpu unless given).
--
-- --quick: 2 layers x 32 on the cpu in f32, 60 steps; asserts the validation loss fell
-- below its start by at least 10% and prints "train_lm quick: ok" (else what failed, and
-- exits 1).
local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")
local nn = require("gdp.nn")
local optim = require("gdp.optim")
local train = require("gdp.train")

local opts = util.parse_args(arg, {
  quick = false, device = "cpu", dtype = "f32", text = "",
  layers = 6, hidden = 512, heads = 4, head_dim = 128, nh = 2, mlp_ratio = 4,
  batch = 8, seq = 2048, steps = 300, lr = 1e-3, warmup = 30, weight_decay = 0.1,
  max_grad_norm = 1.0, val_fraction = 0.1, eval_every = 50, eval_batches = 4,
  log_every = 10, seed = 1, peak_tflops = 0, resume = "",
}, {
  usage = "./gdp experiments/train_lm.lua [--quick] [options]",
  help = {
    { "quick", "the CPU-sized check (see the header); overrides the size options" },
    { "device", "cpu or cuda" }, { "dtype", "f64/f32 on the cpu; f32/bf16 on cuda" },
    { "text", "a text file to train on (default: the repository's README.md and docs/*.md)" },
    { "layers", "blocks" }, { "hidden", "model width" }, { "heads", "mixer heads" },
    { "head_dim", "K = V per head" }, { "nh", "Householder steps per token" },
    { "mlp_ratio", "SwiGLU hidden = ratio x hidden" },
    { "batch", "sequences per step" }, { "seq", "bytes per sequence" }, { "steps", "training steps" },
    { "lr", "AdamW peak learning rate (cosine schedule to lr/10)" }, { "warmup", "warmup steps" },
    { "weight_decay", "AdamW weight decay (not on norms, biases, A_log, dt_bias, D)" },
    { "max_grad_norm", "global gradient-norm clip (0: none)" },
    { "val_fraction", "the held-out tail of the text" }, { "eval_every", "steps between evaluations" },
    { "eval_batches", "held-out batches per evaluation" }, { "log_every", "steps between log lines" },
    { "seed", "the model's and the batches' seed" },
    { "peak_tflops", "the device's peak for MFU (0: 989 on cuda, none on the cpu)" },
    { "resume", "a checkpoint.safetensors of an earlier run to continue" },
  },
})

if opts.quick then
  opts.device, opts.dtype = "cpu", "f32"
  opts.layers, opts.hidden, opts.heads, opts.head_dim, opts.mlp_ratio = 2, 32, 2, 16, 2
  opts.batch, opts.seq, opts.steps, opts.lr, opts.warmup = 8, 64, 60, 3e-3, 5
  opts.eval_every, opts.eval_batches, opts.log_every = 20, 2, 20
end

util.device_or_exit("train_lm", opts.device)

-- The text as a Lua string of bytes.
local function read_text()
  local paths = {}
  if opts.text ~= "" then
    paths[1] = opts.text
  else
    local root = os.getenv("GDP_ROOT") or "."
    paths[1] = root .. "/README.md"
    local p = io.popen("ls " .. util.shell_quote(root) .. "/docs/*.md 2>/dev/null")
    for line in p:lines() do paths[#paths + 1] = line end
    p:close()
  end
  local parts = {}
  for _, path in ipairs(paths) do
    local f, why = io.open(path, "rb")
    if not f then
      io.stderr:write("train_lm: cannot read ", path, ": ", tostring(why), "\n")
      os.exit(2)
    end
    parts[#parts + 1] = f:read("*a")
    f:close()
  end
  return table.concat(parts, "\n")
end

local text = read_text()
local n_val = math.floor(#text * opts.val_fraction)
local n_train = #text - n_val
if n_train < opts.seq + 2 or n_val < opts.seq + 2 then
  io.stderr:write(string.format("train_lm: the text has %d bytes; --seq %d needs more than %d in each split\n",
                                #text, opts.seq, opts.seq + 1))
  os.exit(2)
end

-- --batch windows of seq + 1 bytes from [first, first + len): inputs and next-byte targets.
local function windows(first, len, salt, step)
  local B, T = opts.batch, opts.seq
  local inp, tgt = {}, {}
  for b = 1, B do
    local h = util.hash(string.format("%d:%s:%d:%d", opts.seed, salt, step, b))
    local start = first + h % (len - T - 1)
    local row_in, row_tgt = {}, {}
    for t = 1, T do
      row_in[t] = text:byte(start + t)
      row_tgt[t] = text:byte(start + t + 1)
    end
    inp[b], tgt[b] = row_in, row_tgt
  end
  local o = { dtype = "i32", device = opts.device }
  return gdp.tensor(inp, o), gdp.tensor(tgt, o)
end

local mixer = { num_heads = opts.heads, head_dim = opts.head_dim, state_dim = opts.head_dim,
                num_groups = opts.heads, num_householder = opts.nh }
local model = nn.CausalLM{ vocab = 256, hidden = opts.hidden, layers = opts.layers, mixer = mixer,
                           mlp_ratio = opts.mlp_ratio, tie_embeddings = true, dtype = opts.dtype,
                           device = opts.device, seed = opts.seed }
local params = 0
for _, name in ipairs(model:parameter_names()) do params = params + model:parameters()[name]:numel() end
local op_flop = opts.layers * opts.heads * 2 * opts.head_dim * opts.head_dim * (2 * opts.nh + 1)
local flop_per_token = 6 * params + 3 * op_flop
local peak = opts.peak_tflops > 0 and opts.peak_tflops or (opts.device:match("^cuda") and 989 or nil)

local crit = nn.CrossEntropy{}
local no_decay = function(name)
  return name:match("norm") or name:match("bias") or name:match("A_log") or name:match("%.D$") ~= nil
end
local opt = optim.AdamW(model, { lr = opts.lr, weight_decay = opts.weight_decay, no_decay = no_decay })
local schedule = optim.schedule.cosine{ lr = opts.lr, total_steps = opts.steps, min_lr = opts.lr / 10,
                                        warmup_steps = math.min(opts.warmup, opts.steps - 1) }

local function val_loss(m)
  local sum = 0
  for i = 1, opts.eval_batches do
    local x, y = windows(n_train, n_val, "val", i)
    sum = sum + crit:forward(m:forward(x), y)
    m:clear_state()
    x:free(); y:free()
  end
  return sum / opts.eval_batches
end

local run = results.new_run("train_lm", { config = opts, args = arg, seed = opts.seed })
local first_val = val_loss(model)
local t0 = gdp.time()
local result = train.run{
  model = model, optimizer = opt, criterion = crit, schedule = schedule, run = run,
  max_grad_norm = opts.max_grad_norm > 0 and opts.max_grad_norm or nil,
  batch = function(step)
    local x, y = windows(0, n_train, "train", step)
    return { input = x, target = y, tokens = opts.batch * opts.seq }
  end,
  steps = opts.steps, log_every = opts.log_every, eval_every = opts.eval_every,
  eval = function(m) local l = val_loss(m); return { val_loss = l, val_bits_per_byte = l / math.log(2) } end,
  resume = opts.resume ~= "" and opts.resume or nil, config = opts,
}
local wall = gdp.time() - t0
local steps_run = result.step - (result.resumed_from or 0)
local tok_s = steps_run * opts.batch * opts.seq / wall
local last_val = result.evals[result.step].val_loss
local mfu = peak and flop_per_token * tok_s / (peak * 1e12) or nil

print(string.format("# train_lm: %d layers x %d, %d heads x %d, n_h = %d, %.2fM parameters, %s %s",
                    opts.layers, opts.hidden, opts.heads, opts.head_dim, opts.nh, params / 1e6,
                    opts.device, opts.dtype))
print(string.format("# %d steps of %d x %d bytes: %.0f tokens/s over the whole run (evaluations included), %s",
                    steps_run, opts.batch, opts.seq, tok_s,
                    mfu and string.format("MFU %.3f of %.0f TFLOP/s (%.3g GFLOP per token)", mfu, peak,
                                          flop_per_token / 1e9) or "no MFU (no peak rate)"))
print(string.format("# validation loss %.4f -> %.4f (%.3f -> %.3f bits per byte)", first_val, last_val,
                    first_val / math.log(2), last_val / math.log(2)))
run.meta.summary = { params = params, tokens_per_s = tok_s, mfu = mfu, flop_per_token = flop_per_token,
                     val_loss_first = first_val, val_loss_last = last_val, steps = steps_run }

if opts.quick then
  local ok = last_val < 0.9 * first_val
  run:finish({ status = ok and "ok" or "failed",
               reason = not ok and string.format("val loss %.4f -> %.4f: fell less than 10%%", first_val, last_val) or nil })
  if not ok then
    print(string.format("train_lm quick: FAILED: the validation loss went %.4f -> %.4f", first_val, last_val))
    os.exit(1)
  end
  print(string.format("train_lm quick: ok (validation loss %.4f -> %.4f)", first_val, last_val))
  return
end
run:finish({ status = "ok" })
