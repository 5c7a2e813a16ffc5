-- experiments/bench_comm.lua: gdp.comm's collectives timed in nccl-tests' style.
--
--   mpirun -np 4 ./gdp experiments/bench_comm.lua [-b 8] [-e 64M] [-f 2] [--device cuda]
--          [--dtype f32] [--iters 20] [--warmup 5] [--ops allgather,alltoall,allreduce,broadcast]
--          [--json] [--record NAME]
--
-- Sizes run from -b to -e bytes by factor -f (suffixes K, M, G: powers of 1024).  The
-- size is nccl-tests' "size": the whole buffer (allgather: the gathered output,
-- alltoall: each rank's send buffer).  Per size and collective, in place and out of
-- place: the median time over --iters timed calls (the slowest rank's median), algbw =
-- size / time and busbw = algbw * factor with nccl-tests' factors (allreduce
-- 2(n-1)/n, allgather and alltoall (n-1)/n, broadcast 1).  After the timed loop one
-- more call on known values is checked element by element ("ok" / "WRONG").
-- The metadata check is turned off while timing (c:set_check(false)), as the output
-- says; it is on again for the checked call.  --json: stdout is one JSON object (the
-- table goes to stderr); --record NAME also writes it to results/<UTC date>-NAME.json.
local gdp = require("gdp")
local util = require("gdp.util")
local tensor = require("gdp.tensor")

local opts = { b = "8", e = "64M", f = 2, device = "cpu", dtype = "f32", iters = 20, warmup = 5,
               ops = "allgather,alltoall,allreduce,broadcast", json = false, record = "" }
local i = 1
while i <= #arg do
  local a = arg[i]
  local key = a:match("^%-%-?([%w_]+)$")
  if key == "json" then
    opts.json = true
  elseif key == "help" or key == "h" then
    io.stdout:write((io.open(arg[0]):read("*a"):match("^(.-)\nlocal ") or ""), "\n")
    os.exit(0)
  elseif key and opts[key] ~= nil and arg[i + 1] then
    opts[key] = arg[i + 1]
    i = i + 1
  else
    io.stderr:write("bench_comm: unknown or incomplete option ", a, " (--help)\n")
    os.exit(2)
  end
  i = i + 1
end

local function bytes_of(s)
  local num, suf = tostring(s):match("^(%d+)([KMGkmg]?)$")
  if not num then error("bench_comm: a size: expected digits and K, M or G, got " .. tostring(s)) end
  local mul = ({ [""] = 1, K = 1024, M = 1024 ^ 2, G = 1024 ^ 3 })[suf:upper()]
  return tonumber(num) * mul
end

local c = gdp.comm.world()
local r, n = c:rank(), c:size()
local esize = ({ f64 = 8, f32 = 4, bf16 = 2, i32 = 4, i64 = 8 })[opts.dtype]
if not esize then error("bench_comm: --dtype: expected f64, f32, bf16, i32 or i64") end
local device = opts.device
local iters, warmup, factor = tonumber(opts.iters), tonumber(opts.warmup), tonumber(opts.f)
local out = opts.json and io.stderr or io.stdout
local function say(fmt, ...) if r == 0 then out:write(string.format(fmt, ...), "\n") end end

local BUS = {
  allreduce = function() return 2 * (n - 1) / n end,
  allgather = function() return (n - 1) / n end,
  alltoall = function() return (n - 1) / n end,
  broadcast = function() return 1 end,
}

-- Small integers (exact in every dtype, sums included for n <= 16).
local function filled(count, rank)
  local v = {}
  for k = 1, count do v[k] = (rank * 7 + k) % 13 end
  return tensor.tensor(v, { count }, { dtype = opts.dtype, device = device })
end

-- One collective at one size: a run(in_place) function and a check(in_place) -> bool.
local function setup(op, size)
  local count = math.floor(size / esize)
  if op == "allgather" or op == "alltoall" then count = math.floor(count / n) * n end
  if count == 0 then return nil end
  local per = count / n
  if op == "allgather" then
    local send = filled(per, r)
    local all = tensor.zeros({ n, per }, { dtype = opts.dtype, device = device })
    local mine = all:select(1, r + 1)
    return count, function(ip)
      if ip then c:allgather_into(all, mine) else c:allgather_into(all, send) end
    end, function(ip)
      mine:copy(send)
      if ip then c:allgather_into(all, mine) else c:allgather_into(all, send) end
      local got = all:flat()
      for q = 0, n - 1 do
        for k = 1, per do
          if got[q * per + k] ~= (q * 7 + k) % 13 then return false end
        end
      end
      return true
    end
  elseif op == "alltoall" then
    local send = filled(count, r)
    local recv = tensor.zeros({ count }, { dtype = opts.dtype, device = device })
    local lib = require("gdp.lib")
    local function run(ip)
      if ip then
        tensor.check(lib.gdp_comm_alltoall(c, send, send), "comm.alltoall")
      else
        tensor.check(lib.gdp_comm_alltoall(c, recv, send), "comm.alltoall")
      end
    end
    return count, run, function(ip)
      send:copy(filled(count, r))
      run(ip)
      local got = (ip and send or recv):flat()
      -- block q of the result is rank q's block r
      for q = 0, n - 1 do
        for k = 1, per do
          if got[q * per + k] ~= (q * 7 + r * per + k) % 13 then return false end
        end
      end
      return true
    end
  elseif op == "allreduce" then
    local t = filled(count, r)
    local dst = tensor.zeros({ count }, { dtype = opts.dtype, device = device })
    local function run(ip)
      if ip then c:all_reduce(t, "sum") else dst:copy(t); c:all_reduce(dst, "sum") end
    end
    return count, run, function(ip)
      t:copy(filled(count, r))
      run(ip)
      local got = (ip and t or dst):flat()
      for k = 1, count do
        local want = 0
        for q = 0, n - 1 do want = want + (q * 7 + k) % 13 end
        if got[k] ~= want then return false end
      end
      return true
    end
  else -- broadcast
    local t = filled(count, r)
    local dst = tensor.zeros({ count }, { dtype = opts.dtype, device = device })
    local function run(ip)
      if ip then c:broadcast(t, 0) else dst:copy(t); c:broadcast(dst, 0) end
    end
    return count, run, function(ip)
      t:copy(filled(count, r))
      run(ip)
      local got = (ip and t or dst):flat()
      for k = 1, count do if got[k] ~= (k) % 13 then return false end end
      return true
    end
  end
end

local function median(xs)
  table.sort(xs)
  local m = #xs
  return m % 2 == 1 and xs[(m + 1) / 2] or 0.5 * (xs[m / 2] + xs[m / 2 + 1])
end

local function slowest(x)
  local t = tensor.tensor({ x }, { 1 }, { dtype = "f64" })
  c:all_reduce(t, "max")
  return t:flat()[1]
end

local ops_list = {}
for name in opts.ops:gmatch("[^,]+") do
  if not BUS[name] then error("bench_comm: --ops: unknown collective " .. name) end
  ops_list[#ops_list + 1] = name
end

local backend = c:backend(device:match("^cuda") and device or "cpu")
say("# bench_comm: %d ranks, %s %s tensors, transport %s, %d iters (%d warm-up)", n, device,
    opts.dtype, backend, iters, warmup)
say("# the metadata check is OFF while timing (c:set_check(false)); ON for the checked call")
say("# %-10s %12s %12s | %10s %9s %9s %5s | %10s %9s %9s %5s", "op", "size(B)", "count",
    "oop us", "algbw", "busbw", "ok", "ip us", "algbw", "busbw", "ok")

local rows, all_ok = {}, true
local size = bytes_of(opts.b)
local last = bytes_of(opts.e)
while size <= last do
  for _, op in ipairs(ops_list) do
    local count, run, verify = setup(op, size)
    if count then
      local bytes = count * esize
      local row = { op = op, size = bytes, count = count, dtype = opts.dtype }
      for _, ip in ipairs({ false, true }) do
        c:set_check(false)
        for _ = 1, warmup do run(ip) end
        c:barrier()
        local times = {}
        for k = 1, iters do
          local t0 = gdp.time()
          run(ip)
          times[k] = gdp.time() - t0
        end
        c:set_check(true)
        local t = slowest(median(times))
        local ok = verify(ip)
        local okall = tensor.tensor({ ok and 1 or 0 }, { 1 }, { dtype = "f64" })
        c:all_reduce(okall, "min")
        ok = okall:flat()[1] == 1
        all_ok = all_ok and ok
        local algbw = bytes / t / 1e9
        local key = ip and "in_place" or "out_of_place"
        row[key] = { time_us = t * 1e6, algbw_GBps = algbw, busbw_GBps = algbw * BUS[op](), ok = ok }
      end
      local o, p = row.out_of_place, row.in_place
      say("  %-10s %12d %12d | %10.1f %9.3f %9.3f %5s | %10.1f %9.3f %9.3f %5s", op, bytes, count,
          o.time_us, o.algbw_GBps, o.busbw_GBps, o.ok and "ok" or "WRONG", p.time_us, p.algbw_GBps,
          p.busbw_GBps, p.ok and "ok" or "WRONG")
      rows[#rows + 1] = row
    end
  end
  size = math.floor(size * factor)
  if factor <= 1 then break end
end

local report = {
  benchmark = "bench_comm", ranks = n, device = device, dtype = opts.dtype, transport = backend,
  iters = iters, warmup = warmup, check_while_timing = false, all_ok = all_ok,
  busbw_factors = "allreduce 2(n-1)/n; allgather, alltoall (n-1)/n; broadcast 1 (nccl-tests)",
  time = "median over iters of each rank's wall time per call, max over ranks",
  end_time = os.date("!%Y-%m-%dT%H:%M:%SZ"), gdp_version = gdp.version, args = arg, rows = rows,
}
if r == 0 then
  if opts.json then io.stdout:write(util.json_encode(report, 1), "\n") end
  if opts.record ~= "" then
    if not opts.record:match("^[%w%-_.]+$") then
      io.stderr:write("bench_comm: --record: expected letters, digits, '-', '_' and '.'\n")
      os.exit(2)
    end
    say("# recorded: %s", require("gdp.results").record(opts.record, report))
  end
end
say("# %s", all_ok and "all bytes checked: ok" or "some results were WRONG")
os.exit(all_ok and 0 or 1)
