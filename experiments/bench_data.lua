-- experiments/bench_data.lua: throughput of the state-tracking generators (gdp.data,
-- docs/design.md section 7) in tokens per second.
--
--   ./gdp experiments/bench_data.lua [--device cpu|cuda] [--batch 2048] [--length 512]
--                                    [--tasks parity,modular_addition,S3,S4,A5,S5]
--                                    [--modulus 10] [--repeat 5]
--
-- Per task: the median wall time of --repeat draws (after five untimed ones) of batch x
-- length tokens and labels (consecutive offsets of one seed, each draw's tensors freed
-- before the next, as a training loop draws them; on cuda each draw
-- ends with a synchronisation, so the figure includes the kernel), and tokens/s =
-- batch * length / that time.  Writes a run folder (experiments/runs/bench_data/...:
-- meta.json, results.csv) and prints the table.
local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")

local config = { device = "cpu", batch = 2048, length = 512,
                 tasks = "parity,modular_addition,S3,S4,A5,S5", modulus = 10, ["repeat"] = 5 }
local opts = util.parse_args(arg, config, {
  usage = "./gdp experiments/bench_data.lua [options]",
  description = "Tokens per second of gdp.data.state_tracking.",
  choices = { device = { "cpu", "cuda" } },
})

util.device_or_exit("bench_data", opts.device)
local run = results.new_run("bench_data", { config = opts, args = arg })
local csv = run:csv({ "task", "device", "batch", "length", "median_ms", "tokens_per_s", "status", "error" })
io.stdout:write(string.format("# device %s, batch %d, length %d, median of %d\n", opts.device,
                              opts.batch, opts.length, opts["repeat"]))
io.stdout:write(string.format("# %-18s %12s %16s\n", "task", "median ms", "tokens/s"))
local failed = 0
for task in tostring(opts.tasks):gmatch("[^,]+") do
  local ok, err = pcall(function()
    local times = {}
    local warmup = 5 -- threads, and the allocator settling on reusing its pages
    for r = 1, opts["repeat"] + warmup do
      local t0 = gdp.time()
      local tok, lab = gdp.data.state_tracking{
        task = task, modulus = task == "modular_addition" and opts.modulus or nil,
        batch = opts.batch, length = opts.length, seed = 1, offset = (r - 1) * opts.batch,
        device = opts.device }
      gdp.sync(opts.device)
      if r > warmup then times[#times + 1] = gdp.time() - t0 end
      -- the last draw's buffers go back now, as a training loop's do batch after batch
      tok, lab = nil, nil
      collectgarbage()
    end
    table.sort(times)
    local median = times[math.floor((#times + 1) / 2)]
    local rate = opts.batch * opts.length / median
    io.stdout:write(string.format("  %-18s %12.3f %16.4g\n", task, median * 1e3, rate))
    csv:row({ task = task, device = opts.device, batch = opts.batch, length = opts.length,
              median_ms = median * 1e3, tokens_per_s = rate, status = "ok" })
  end)
  if not ok then
    failed = failed + 1
    io.stdout:write(string.format("  %-18s failed: %s\n", task, tostring(err)))
    csv:row({ task = task, device = opts.device, batch = opts.batch, length = opts.length,
              status = "error", error = tostring(err) })
  end
end
run:finish({ status = failed == 0 and "ok" or "failed", reason = failed > 0 and (failed .. " tasks failed") or nil })
os.exit(failed == 0 and 0 or 1)
