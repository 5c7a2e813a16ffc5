-- cp_equivalence: a random Gated DeltaProduct layer and a random packed batch, run at
-- cp = 1 and at cp = N (the mpirun world), forward and backward; prints the largest
-- relative error over the ranks of the output, the input gradient and every parameter
-- gradient, and exits non-zero when one is above the tolerance (f64 1e-10, f32 1e-4).
--
--   mpirun -np N ./gdp experiments/cp_equivalence.lua [--mode headwise|chunkwise]
--          [--dtype f64|f32] [--seed S] [--lengths 5,4,7] [--layout zigzag|contiguous]
--
-- Without --lengths, a random packing (some sequences empty) that fits the mode:
-- lengths multiples of 2N for headwise zigzag, a total multiple of N otherwise.  Every
-- rank builds the same global batch from the seed, runs the cp = 1 layer itself and
-- compares its own shard; rank 0 writes the run folder (results.csv, meta.json).

local config = {
  mode = "chunkwise",    -- headwise | chunkwise
  dtype = "f64",         -- f64 | f32
  seed = 1,
  lengths = "",          -- comma-separated global sequence lengths; "" = random
  layout = "",           -- "" = the mode's default (headwise: zigzag; chunkwise: contiguous)
  tokens_per_rank = 12,  -- random packing: about this many tokens per rank
  hidden = 16, heads = 4, head_dim = 4, groups = 2, state_dim = 8, householder = 2,
  D = "head",            -- none | head | channel
  tol = 0,               -- 0: the dtype's tolerance
}

local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")
local nn = require("gdp.nn")
local cp = require("gdp.cp")

local opts = util.parse_args(arg, config, {
  usage = "mpirun -np N ./gdp experiments/cp_equivalence.lua [options]",
  description = "Checks a context-parallel GatedDeltaProduct layer against cp = 1.",
  help = {
    { "mode", "context-parallel strategy" },
    { "dtype", "dtype of the layer and the batch" },
    { "seed", "seed of the layer, the batch and the random packing" },
    { "lengths", "global sequence lengths, e.g. 5,4,7 (\"\": random)" },
    { "layout", "token layout (\"\": the mode's default)" },
    { "D", "D skip: none, head or channel" },
  },
  choices = { mode = { "headwise", "chunkwise" }, dtype = { "f64", "f32" },
              D = { "none", "head", "channel" }, layout = { "", "zigzag", "contiguous" } },
})

local group = gdp.comm.world()
local N, rank = group:size(), group:rank()
if N > 1 then gdp.device("cpu"):set_num_threads(1) end
local layout = opts.layout ~= "" and opts.layout or (opts.mode == "headwise" and "zigzag" or "contiguous")
local tol = opts.tol > 0 and opts.tol or gdp.ops.TOLERANCE[opts.dtype]

local function say(...) if rank == 0 then print(string.format(...)) end end

-- Lengths: given, or a random packing that fits the layout (the same on every rank).
local lengths = {}
if opts.lengths ~= "" then
  for x in opts.lengths:gmatch("[^,]+") do
    local v = tonumber(x)
    if v == nil or v < 0 or v ~= math.floor(v) then
      io.stderr:write("cp_equivalence: --lengths: expected non-negative integers, got '", x, "'\n")
      os.exit(2, true)
    end
    lengths[#lengths + 1] = v
  end
else
  math.randomseed(opts.seed)
  local unit = (opts.mode == "headwise" and layout == "zigzag") and 2 * N or 1
  local units = math.max(1, math.floor(opts.tokens_per_rank * N / unit))
  if unit == 1 then units = units - units % N; if units == 0 then units = N end end
  local cuts = {}
  for i = 1, math.random(1, 5) do cuts[i] = math.random(0, units) end
  table.sort(cuts)
  local prev = 0
  for _, c in ipairs(cuts) do lengths[#lengths + 1] = (c - prev) * unit; prev = c end
  lengths[#lengths + 1] = (units - prev) * unit
end
local cu = { 0 }
for _, l in ipairs(lengths) do cu[#cu + 1] = cu[#cu] + l end
local T = cu[#cu]

say("# cp_equivalence: mode %s (%s), cp %d, %s, seed %d, lengths [%s] (%d tokens, %d per rank)",
    opts.mode, layout, N, opts.dtype, opts.seed, table.concat(lengths, ","), T, T / N)

local cfg = {
  hidden_size = opts.hidden, num_heads = opts.heads, head_dim = opts.head_dim,
  num_groups = opts.groups, state_dim = opts.state_dim, num_householder = opts.householder,
  D = opts.D ~= "none" and opts.D or false, dtype = opts.dtype, seed = opts.seed,
}

local run = results.new_run("cp_equivalence", { config = opts, seed = opts.seed, args = arg,
                                                extra = { cp = N, lengths = util.json_array(lengths) } })
local csv = run:csv({ "tensor", "max_rel_err", "tol", "status", "error" })

-- Building the CP layer and running it are collective and raise the same error on
-- every rank for bad input (e.g. lengths that do not fit the layout).
local ok, err = pcall(function()
  local ref = nn.GatedDeltaProduct(cfg)
  cfg.cp_mode, cfg.cp_group, cfg.cp_layout = opts.mode, group, layout
  local m = nn.GatedDeltaProduct(cfg)
  gdp.manual_seed(opts.seed + 1000)
  local x = gdp.randn({ T, 1, opts.hidden }, { dtype = opts.dtype })
  local dy = gdp.randn({ T, 1, opts.hidden }, { dtype = opts.dtype })
  local t0 = gdp.time()
  local out_ref = ref:forward(x, cu)
  local dx_ref = ref:backward(x, dy, cu)
  local t1 = gdp.time()
  local sopts = { layout = layout, cu_seqlens = cu }
  local xl = cp.shard.split(x, N, rank, sopts)
  group:barrier()
  local t2 = gdp.time()
  local out = m:forward(xl, cu)
  local dx = m:backward(xl, cp.shard.split(dy, N, rank, sopts), cu)
  local t3 = gdp.time()
  local names = { "out", "dx" }
  local errs = {
    gdp.rel_error(out:to("f64"), cp.shard.split(out_ref, N, rank, sopts):to("f64")),
    gdp.rel_error(dx:to("f64"), cp.shard.split(dx_ref, N, rank, sopts):to("f64")),
  }
  for _, name in ipairs(m:parameter_names()) do
    names[#names + 1] = "grad " .. name
    errs[#errs + 1] = gdp.rel_error(m:gradients()[name]:to("f64"), ref:gradients()[name]:to("f64"))
  end
  -- NaN never passes: send it as +inf so that max keeps it.
  for i, e in ipairs(errs) do if e ~= e then errs[i] = math.huge end end
  local worst = group:all_reduce(gdp.tensor(errs, { #errs }, { dtype = "f64" }), "max"):flat()
  local rows = {}
  for i, name in ipairs(names) do
    local status = worst[i] <= tol and "ok" or "FAIL"
    rows[i] = { name, worst[i], tol, status }
    csv:row({ tensor = name, max_rel_err = worst[i], tol = tol, status = status })
  end
  say("%s", util.format_table({ "tensor", "max_rel_err", "tol", "status" }, rows, "%.3e"))
  say("# cp = 1: %.1f ms forward+backward; cp = %d: %.1f ms (rank 0, this machine)",
      (t1 - t0) * 1e3, N, (t3 - t2) * 1e3)
  for i = 1, #worst do if not (worst[i] <= tol) then return false end end
  return true
end)

local code = 0
if not ok then
  say("cp_equivalence: error: %s", tostring(err))
  csv:row({ tensor = "-", status = "error", error = tostring(err) })
  code = 2
elseif not err then
  say("cp_equivalence: FAILED: a relative error exceeds %.0e", tol)
  code = 1
else
  say("cp_equivalence: ok (all errors <= %.0e)", tol)
end
run:finish({ exit_code = code })
os.exit(code, true)
