-- experiments/bench_cp.lua at a tiny size on the cpu (H = 2, K = V = 16, 64 tokens per
-- rank), run through the launcher at one rank and under `mpirun -np 2` (these specs are
-- not tagged #mpi: they start mpirun themselves), and gdp.cp.timing, the stage clock it
-- reads (#mpi: in process on every rank of the suite's mpirun).
local gdp = require("gdp")
local util = require("gdp.util")
local cp = require("gdp.cp")
local H = gdp_test

local TINY = "--device cpu --H 2 --K 16 --V 16 --hidden 32 --groups 1 --tokens-per-rank 64 " ..
             "--n 1,2 --warmup 0 --repeat 2 --check-tokens 16"

local function sh(cmd)
  local p = assert(io.popen(cmd))
  local out = p:read("*a")
  p:close()
  return out:gsub("rc=%d+%s*$", ""), tonumber(out:match("rc=(%d+)%s*$"))
end

-- The report of a --json run (stdout is one JSON object; rank 0 writes it).
local function run_json(np, args, runs)
  local cmd = H.launcher_cmd(np, "experiments/bench_cp.lua", args .. " --json", 240)
  local out, rc = sh("GDP_RUNS_DIR=" .. util.shell_quote(runs) .. " " .. cmd:gsub(" 2>&1;", " 2>/dev/null;"))
  assert.are.equal(0, rc, out)
  local json = out:match("(%b{})%s*$")
  assert.truthy(json, "no JSON object in:\n" .. out)
  return util.json_decode(json)
end

local function row_of(report, target, mode, n)
  for _, r in ipairs(report.rows) do
    if r.target == target and r.mode == mode and r.n == n then return r end
  end
  error(string.format("no row %s %s n = %d", target, mode, n))
end

describe("bench_cp", function()
  local runs
  before_each(function()
    runs = os.tmpname()
    os.remove(runs)
  end)
  after_each(function() os.execute("rm -rf " .. util.shell_quote(runs)) end)

  it("at one rank: the plain layer and operator, every field of the JSON", function()
    local rep = run_json(nil, TINY .. " --dtype f64", runs)
    assert.are.equal("bench_cp", rep.tool)
    assert.are.equal(1, rep.world_size)
    assert.are.equal("cpu", rep.device)
    assert.are.equal("self", rep.comm_backend)
    assert.are.equal("ok", rep.status)
    assert.truthy(rep.git_sha:match("^%x+$") or rep.git_sha == "unknown", rep.git_sha)
    assert.truthy(rep.command:find("experiments/bench_cp.lua", 1, true), rep.command)
    assert.are.equal(4, #rep.rows) -- {layer, operator} x n = {1, 2}
    for _, r in ipairs(rep.rows) do
      assert.are.equal("plain", r.mode)
      assert.are.equal(64, r.T)
      for _, key in ipairs({ "fwd", "fwdbwd" }) do
        local med, lo, hi = r[key .. "_ms"], r[key .. "_min_ms"], r[key .. "_max_ms"]
        assert.is_true(med > 0 and lo <= med and med <= hi, key .. ": " .. util.json_encode(r))
      end
      assert.is_nil(r.breakdown) -- no CP stages at cp = 1
    end
    local meta = util.json_decode(assert(io.open(runs .. "/bench_cp/" ..
      util.capture("ls " .. util.shell_quote(runs .. "/bench_cp")) .. "/meta.json")):read("*a"))
    assert.are.equal("ok", meta.status)
  end)

  it("at one rank with --emulate-cp 3: each rank's chunkwise operator alone, with its stages", function()
    local rep = run_json(nil, TINY .. " --dtype f64 --targets operator --n 2 --emulate-cp 3", runs)
    assert.are.equal(1, rep.world_size)
    assert.truthy(rep.emulated:find("local copies", 1, true), rep.emulated)
    local seen, plain, critical, total = {}, nil, nil, 0
    for _, r in ipairs(rep.rows) do
      if r.mode == "plain" and r.target == "operator" then plain = r end
    end
    for _, r in ipairs(rep.rows) do
      if r.mode == "chunkwise-emulated" then
        seen[#seen + 1] = r.emulated_rank
        -- one critical path for the group: at least this rank's local runs, at most every
        -- rank's stages added up; the estimate and beyond_plain against the plain row
        critical = critical or r.critical_path_ms
        assert.are.equal(critical, r.critical_path_ms)
        local st = r.breakdown.stages_ms
        assert.is_true(critical >= st.local_forward + st.local_backward - 1e-12, util.json_encode(r))
        for _, v in pairs(st) do total = total + v end
        assert.are.near(plain.fwdbwd_ms / critical, r.efficiency_estimate, 1e-12)
        assert.are.near(r.fwdbwd_ms / plain.fwdbwd_ms - 1, r.beyond_plain, 1e-12)
        assert.are.equal(3, r.cp)
        assert.are.equal(192, r.T)
        local bd = r.breakdown
        assert.are.equal(r.emulated_rank, bd.worst_rank)
        assert.are.equal(r.emulated_rank, bd.by_rank[1].rank)
        assert.is_true(bd.local_ms > 0 and bd.overhead_ms > 0, util.json_encode(bd))
        assert.are.near(bd.overhead_ms / bd.local_ms, bd.overhead_fraction, 1e-9)
        for _, s in ipairs(bd.stage_order) do assert.is_true(bd.stages_ms[s] >= 0, s) end
      else
        assert.are.equal("plain", r.mode)
      end
    end
    assert.are.same({ 0, 1, 2 }, seen)
    assert.is_true(critical <= total + 1e-12, string.format("critical path %g > all stages %g", critical, total))
    local out, rc = sh(H.launcher_cmd(nil, "experiments/bench_cp.lua", TINY .. " --targets layer --emulate-cp 2"))
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("bench_cp: --emulate-cp: times the operator target; --targets has no operator", 1, true),
                  out)
  end)

  it("under mpirun -np 2: checks, efficiency against the baseline, stages within the step", function()
    if not H.can_mpirun then return pending("no mpirun or built without MPI") end
    local base = run_json(nil, TINY .. " --dtype f32", runs)
    local file = os.tmpname()
    local f = assert(io.open(file, "w"))
    f:write(util.json_encode(base))
    f:close()
    local rep = run_json(2, TINY .. " --dtype f32 --baseline " .. file, runs)
    os.remove(file)
    assert.are.equal(2, rep.world_size)
    assert.are.equal("mpi", rep.comm_backend)
    assert.are.equal(8, #rep.checks) -- {layer, operator} x {headwise, chunkwise} x n
    for _, c in ipairs(rep.checks) do
      assert.is_true(c.ok and c.max_rel_err <= 1e-4, util.json_encode(c))
    end
    assert.are.equal(8, #rep.rows)
    for _, r in ipairs(rep.rows) do
      local b = row_of(base, r.target, "plain", r.n)
      assert.are.equal(128, r.T)
      assert.are.near(b.fwd_ms / r.fwd_ms, r.efficiency_fwd, 1e-12)
      assert.are.near(b.fwdbwd_ms / r.fwdbwd_ms, r.efficiency_fwdbwd, 1e-12)
      assert.are.equal(b.fwdbwd_ms, r.baseline_fwdbwd_ms)
      local bd = r.breakdown
      assert.are.equal(2, #bd.by_rank)
      for _, br in ipairs(bd.by_rank) do
        local sum, over, loc = 0, 0, 0
        for _, s in ipairs(bd.stage_order) do
          local v = br.stages_ms[s]
          assert.is_true(v >= 0, s)
          sum = sum + v
          if s:match("^local_") then loc = loc + v else over = over + v end
        end
        assert.is_true(sum <= br.step_ms * (1 + 1e-9), string.format("rank %d: stages %.6f > step %.6f ms",
                                                                    br.rank, sum, br.step_ms))
        assert.is_true(loc > 0)
        assert.are.near(over / loc, br.overhead_fraction, 1e-9)
      end
      local names = table.concat(bd.stage_order, ",")
      if r.mode == "chunkwise" then
        assert.truthy(names:find("summary_forward,allgather_forward,compose_forward,correct_forward,local_forward", 1, true), names)
        assert.are.equal(r.target == "layer", names:find("halo_backward", 1, true) ~= nil, names)
      else
        assert.truthy(names:find("all_to_all_in_forward,local_forward,all_to_all_out_forward", 1, true), names)
      end
    end
  end)

  it("bad arguments: one line and exit 2, at one rank and on every rank of two", function()
    local cases = {
      { "--modes ringwise", "bench_cp: --modes: expected headwise and/or chunkwise" },
      { "--n 0", "bench_cp: --n: expected integers >= 1" },
      { "--baseline /nonexistent/base.json", "bench_cp: --baseline: cannot read /nonexistent/base.json" },
    }
    for _, c in ipairs(cases) do
      local out, rc = sh(H.launcher_cmd(nil, "experiments/bench_cp.lua", TINY .. " " .. c[1]))
      assert.are.equal(2, rc, out)
      assert.truthy(out:find(c[2], 1, true), out)
      assert.are.equal(1, select(2, out:gsub("\n", "")), out)
    end
    if not H.can_mpirun then return pending("no mpirun or built without MPI") end
    -- 3 heads do not split over 2 ranks (headwise); every rank says so
    local out, rc = sh(H.launcher_cmd(2, "experiments/bench_cp.lua", (TINY:gsub("%-%-H 2", "--H 3"))))
    assert.are.equal(2, rc, out)
    local _, lines = out:gsub("bench_cp: %-%-modes headwise: %-%-H = 3 heads do not split over cp = 2 ranks", "")
    assert.are.equal(2, lines, out)
    assert.is_nil(out:find("traceback", 1, true), out)
  end)
end)

-- tools/fla_cp_bench.py, issue 23's fla anchors: it needs torch, fla and GPUs, so here only
-- its option parsing (before it imports torch): help, and a bad option refused.
describe("tools/fla_cp_bench.py (no torch needed to parse)", function()
  it("prints its usage and refuses an option it does not know", function()
    local py = "python3 " .. H.root .. "/tools/fla_cp_bench.py"
    local out, rc = H.sh(py .. " --help")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("--tokens-per-rank", 1, true), out)
    assert.truthy(out:find("chunkwise", 1, true), out)
    out, rc = H.sh(py .. " --no-such-option")
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("unrecognized arguments: --no-such-option", 1, true), out)
  end)
end)

describe("gdp.cp.timing", function()
  it("is off by default; on, it adds each stage's seconds and passes every result through", function()
    assert.is_nil(cp.timing.get())
    local function three() return 1, nil, 3 end
    assert.are.same({ 1, nil, 3 }, { cp.timing.stage("x", "cpu", three) })
    local acc = {}
    cp.timing.set(acc)
    local a, b, c = cp.timing.stage("x", "cpu", three)
    cp.timing.stage("x", "cpu", function() end)
    cp.timing.set(nil)
    assert.are.same({ 1, nil, 3 }, { a, b, c })
    assert.is_true(acc.x >= 0)
    assert.are.same({ "x" }, (function() local k = {} for n in pairs(acc) do k[#k + 1] = n end return k end)())
    H.expect_error(function() cp.timing.set(5) end, "cp.timing.set", "expected a table (stage name -> seconds) or nil, got number")
  end)
end)

describe("gdp.cp.timing on every rank #mpi", function()
  local group = gdp.comm.world()
  local P, RANK = group:size(), group:rank()
  if P > 1 then gdp.device("cpu"):set_num_threads(1) end

  it("clocks the chunkwise stages without changing a bit of the result", function()
    local n, Lc, Hh, K, V = 2, 8, 2, 4, 3
    H.reseed(3)
    local q = gdp.randn({ 1, Lc, Hh, K }, { dtype = "f64" })
    local k = gdp.randn({ 1, Lc * n, Hh, K }, { dtype = "f64" })
    local v = gdp.randn({ 1, Lc * n, Hh, V }, { dtype = "f64" })
    local beta = gdp.rand({ 1, Lc * n, Hh }, { dtype = "f64" })
    local g = gdp.rand({ 1, Lc, Hh }, { dtype = "f64" }) * -0.1
    local d_o = gdp.randn({ 1, Lc, Hh, V }, { dtype = "f64" })
    local function step()
      local o, saved = cp.gdp_chunkwise_context_parallel{ q = q, k = k, v = v, g = g, beta = beta,
                                                           num_householder = n, cp_group = group }
      return o, saved:backward(d_o)
    end
    local o_plain, g_plain = step()
    local acc = {}
    cp.timing.set(acc)
    local t0 = gdp.time()
    local ok, o_timed, g_timed = pcall(step)
    local total = gdp.time() - t0
    cp.timing.set(nil)
    assert.is_true(ok, tostring(o_timed))
    assert.are.equal(0, gdp.rel_error(o_timed, o_plain))
    for _, name in ipairs({ "dq", "dk", "dv", "dg", "dbeta" }) do
      assert.are.equal(0, gdp.rel_error(g_timed[name], g_plain[name]), name)
    end
    local sum = 0
    for _, s in ipairs({ "summary", "allgather", "compose", "local" }) do
      for _, dir in ipairs({ "forward", "backward" }) do
        local v_s = acc[s .. "_" .. dir]
        assert.is_true(type(v_s) == "number" and v_s >= 0, s .. "_" .. dir .. " on rank " .. RANK)
        sum = sum + v_s
      end
    end
    assert.is_true(sum <= total, string.format("stages %.6f s > the call's %.6f s", sum, total))
  end)
end)
