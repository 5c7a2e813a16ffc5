-- gdp.sweep: grids, config seeds, failures as rows, resume, flushing, progress, plots,
-- and the householder_sweep experiment run as a subprocess at a tiny size.
local gdp = require("gdp")
local sweep = require("gdp.sweep")
local util = require("gdp.util")
local results = require("gdp.results")

local function read_all(path)
  local f = assert(io.open(path, "r"))
  local s = f:read("*a")
  f:close()
  return s
end

local function lines_of(s)
  local out = {}
  for line in s:gmatch("([^\n]*)\n") do out[#out + 1] = line end
  return out
end

local function tmpdir()
  local dir = os.tmpname()
  os.remove(dir)
  return dir
end

local sh = gdp_test.sh

-- A progress sink: a temporary file (never a terminal).
local function sink()
  local path = os.tmpname()
  return { out = assert(io.open(path, "w")), tty = false }, path
end

describe("sweep.grid", function()
  it("is the product of the axes, sorted by name, the last axis fastest", function()
    local cs = sweep.grid{ n = { 1, 2, 3 }, chunk_size = { 32, 64 }, dtype = { "f32", "f64" } }
    assert.are.equal(12, #cs)
    assert.are.same({ chunk_size = 32, dtype = "f32", n = 1 }, cs[1])
    assert.are.same({ chunk_size = 32, dtype = "f32", n = 2 }, cs[2])
    assert.are.same({ chunk_size = 32, dtype = "f64", n = 1 }, cs[4])
    assert.are.same({ chunk_size = 64, dtype = "f32", n = 1 }, cs[7])
    assert.are.same({ chunk_size = 64, dtype = "f64", n = 3 }, cs[12])
    -- every combination exactly once
    local seen = {}
    for _, c in ipairs(cs) do
      local k = sweep.key(c)
      assert.is_nil(seen[k], k)
      seen[k] = true
    end
  end)

  it("follows a given order; a scalar is a fixed column", function()
    local cs = sweep.grid({ n = { 1, 2 }, chunk_size = { 32, 64, 128 }, dtype = "f32" },
                          { order = { "n", "chunk_size" } })
    assert.are.equal(6, #cs)
    assert.are.same({ n = 1, chunk_size = 32, dtype = "f32" }, cs[1])
    assert.are.same({ n = 1, chunk_size = 64, dtype = "f32" }, cs[2])
    assert.are.same({ n = 2, chunk_size = 128, dtype = "f32" }, cs[6])
    assert.are.same({ {} }, sweep.grid({}))
  end)

  it("rejects empty axes, reserved names and unknown order entries", function()
    gdp_test.expect_error(function() sweep.grid{ n = {} } end, "gdp.sweep.grid", "axis 'n'", "non-empty")
    gdp_test.expect_error(function() sweep.grid{ seed = { 1, 2 } } end, "'seed' is a reserved column")
    gdp_test.expect_error(function() sweep.grid({ n = { 1 } }, { order = { "m" } }) end, "order: 'm' is not an axis")
    gdp_test.expect_error(function() sweep.grid{ f = { print } } end, "axis 'f' value 1", "got function")
  end)
end)

describe("sweep seeds", function()
  it("hash the canonical config text with FNV-1a", function()
    -- FNV-1a 32 of "a" is 0xe40c292c; seeds are reduced mod 2^31
    assert.are.equal(0x640c292c, util.hash("a"))
    assert.are.equal("chunk_size=64;dtype=f32;n=2", sweep.key({ n = 2, dtype = "f32", chunk_size = 64 }))
    assert.are.equal(util.hash("chunk_size=64;dtype=f32;n=2"), sweep.seed({ n = 2, dtype = "f32", chunk_size = 64 }))
    -- escaping keeps the text unambiguous; reserved columns and "" are not part of it
    assert.are.equal("a=x%3Bb%3Dy", sweep.key({ a = "x;b=y" }))
    assert.are.equal("a=1;b=0.1;c=true;d=[1,2]", sweep.key({ a = 1, b = 0.1, c = true, d = { 1, 2 }, e = "", seed = 7 }))
  end)

  it("are stable for a config and differ between configs and repeats", function()
    local cs = sweep.grid{ n = { 1, 2, 3, 4 }, chunk_size = { 16, 32, 64 }, dtype = { "f32", "bf16" } }
    local seeds = {}
    for _, c in ipairs(cs) do
      local s = sweep.seed(c)
      assert.are.equal(s, sweep.seed(c))
      -- a fresh table built in another order, and one carrying its seed, give the same
      assert.are.equal(s, sweep.seed({ dtype = c.dtype, n = c.n, chunk_size = c.chunk_size }))
      assert.are.equal(s, sweep.seed({ dtype = c.dtype, n = c.n, chunk_size = c.chunk_size, seed = 99 }))
      assert.truthy(s >= 0 and s < 2 ^ 31 and s == math.floor(s))
      assert.is_nil(seeds[s], "seed collision: " .. sweep.key(c))
      seeds[s] = true
      assert.are_not.equal(s, sweep.seed(c, 2))
      assert.are_not.equal(s, sweep.seed(c, 1, 5))
    end
    -- the seed does not depend on the other axes' values or the position in the sweep
    local small = sweep.grid{ n = { 3 }, chunk_size = { 32 }, dtype = { "f32" } }
    assert.truthy(seeds[sweep.seed(small[1])])
  end)

  it("are passed as cfg.seed and set with gdp.manual_seed before fn", function()
    local drawn = {}
    local rows = sweep.run{
      axes = { n = { 1, 2 } }, repeats = 2, progress = false,
      fn = function(cfg, ctx)
        assert.are.equal(sweep.seed({ n = cfg.n }, ctx.repeat_index), cfg.seed)
        assert.are.equal(cfg.seed, gdp.initial_seed())
        drawn[#drawn + 1] = gdp.randn({ 3 }, { dtype = "f64" }):totable()
        return { x = 1 }
      end,
    }
    assert.are.equal(4, #rows)
    for i, row in ipairs(rows) do
      assert.are.equal(sweep.seed({ n = row.n }, row["repeat"]), row.seed)
      gdp.manual_seed(row.seed)
      assert.are.same(gdp.randn({ 3 }, { dtype = "f64" }):totable(), drawn[i])
    end
    assert.are_not.same(drawn[1], drawn[2]) -- repeats draw other inputs
  end)
end)

describe("sweep.run", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() os.execute("rm -rf " .. util.shell_quote(dir)) end)

  it("writes the header first and flushes every row as it finishes", function()
    local run = results.new_run("flush", { root = dir })
    local path = run.dir .. "/results.csv"
    local header = "chunk_size,n,T,time_ms,label,status,error,seed,repeat,time_s"
    local rows = sweep.run{
      study = "flush", run = run, axes = { n = { 1, 2, 3 }, chunk_size = { 8, 16 } }, base = { T = 64 },
      columns = { "time_ms", "label" }, progress = false,
      fn = function(cfg, ctx)
        local lines = lines_of(read_all(path))
        assert.are.equal(header, lines[1])
        assert.are.equal(ctx.index, #lines) -- the header and every earlier row, complete
        if ctx.index > 1 then
          local prev = sweep.grid{ n = { 1, 2, 3 }, chunk_size = { 8, 16 } }[ctx.index - 1]
          assert.truthy(lines[#lines]:match("^" .. prev.chunk_size .. "," .. prev.n .. ",64,"), lines[#lines])
        end
        return { time_ms = cfg.n * 0.5, label = "a,\"b\"" }
      end,
    }
    assert.are.equal(6, #rows)
    local lines = lines_of(read_all(path))
    assert.are.equal(7, #lines)
    assert.truthy(lines[2]:match('^8,1,64,0%.5,"a,""b""",ok,,%d+,1,[%d.e-]+$'), lines[2])
    local h, parsed = sweep.read_csv(path)
    assert.are.equal(header, table.concat(h, ","))
    assert.are.equal('a,"b"', parsed[6].label)
    assert.are.equal("1.5", parsed[6].time_ms)
  end)

  it("time_budget: no row starts once it is spent; those rows are not written, and resume runs them", function()
    local path = dir .. "/budget.csv"
    local calls = {}
    local out = sink()
    -- each row takes ~30 ms: with a 50 ms budget the first two start, the third does not
    local function fn(cfg)
      calls[#calls + 1] = cfg.n
      local t0 = gdp.time()
      while gdp.time() - t0 < 0.03 do end
      return { y = cfg.n }
    end
    local rows, summary = sweep.run{ axes = { n = { 1, 2, 3, 4 } }, columns = { "y" }, csv = path,
                                     progress = out, time_budget = 0.05, fn = fn }
    out.out:close()
    assert.are.same({ 1, 2 }, calls)
    assert.are.same({ 2, 2, 2 }, { summary.ran, summary.ok, summary.not_run })
    assert.are.same({ "ok", "ok", "not_run", "not_run" },
                    { rows[1].status, rows[2].status, rows[3].status, rows[4].status })
    assert.are.equal(3, rows[3].n)
    assert.truthy(rows[4].error:match("time budget of 0%.05 s"), rows[4].error)
    local _, written = sweep.read_csv(path)
    assert.are.equal(2, #written)
    -- the rerun (no budget) runs the two rows left, and only those
    calls = {}
    local rows2, summary2 = sweep.run{ axes = { n = { 1, 2, 3, 4 } }, columns = { "y" }, csv = path,
                                       progress = false, fn = fn }
    assert.are.same({ 3, 4 }, calls)
    assert.are.same({ 2, 2, 0 }, { summary2.resumed, summary2.ran, summary2.not_run })
    assert.are.equal(4, rows2[4].y)
    -- a budget of 0 starts nothing; a bad one is an error naming it
    calls = {}
    local _, s0 = sweep.run{ axes = { n = { 5 } }, columns = { "y" }, progress = false, time_budget = 0, fn = fn }
    assert.are.same({}, calls)
    assert.are.equal(1, s0.not_run)
    local ok, err = pcall(sweep.run, { axes = { n = { 1 } }, progress = false, time_budget = -1, fn = fn })
    assert.is_false(ok)
    assert.truthy(tostring(err):match("time_budget: expected seconds >= 0"), tostring(err))
  end)

  it("pause: a row stopped for the budget is not_run and not written; the rerun sees its resume_dir", function()
    local path = dir .. "/pause.csv"
    local seen = {}
    -- row n = 2 watches the budget and pauses once it is spent; the row after is not started
    local function fn(cfg, ctx)
      seen[#seen + 1] = { n = cfg.n, left = ctx.budget_left and ctx.budget_left(), resume_dir = ctx.resume_dir }
      if cfg.n == 2 and ctx.budget_left then
        while ctx.budget_left() > 0 do end
        sweep.pause("stopped at step 7")
      end
      return { y = cfg.n }
    end
    local rows, summary = sweep.run{ axes = { n = { 1, 2, 3 } }, columns = { "y" }, csv = path,
                                     progress = false, time_budget = 0.05, fn = fn }
    assert.are.same({ 1, 1, 2 }, { summary.ran, summary.ok, summary.not_run })
    assert.are.same({ "ok", "not_run", "not_run" }, { rows[1].status, rows[2].status, rows[3].status })
    assert.are.equal("stopped at step 7", rows[2].error)
    assert.are.equal(2, #seen)
    assert.is_true(seen[1].left > 0 and seen[1].left <= 0.05, tostring(seen[1].left))
    local _, written = sweep.read_csv(path)
    assert.are.equal(1, #written)
    -- resumed from that CSV into another: the two left run, told where the rows came from
    seen = {}
    local rows2, summary2 = sweep.run{ axes = { n = { 1, 2, 3 } }, columns = { "y" }, csv = dir .. "/pause2.csv",
                                       resume = path, progress = false, fn = fn }
    assert.are.same({ 1, 2, 0 }, { summary2.resumed, summary2.ran, summary2.not_run })
    assert.are.same({ 2, 3 }, { seen[1].n, seen[2].n })
    assert.are.equal(dir, seen[1].resume_dir)
    assert.is_nil(seen[1].left, "no budget: no budget_left")
    assert.are.equal(2, rows2[2].y)
  end)

  it("records failures as rows and goes on", function()
    local calls = {}
    local out, log = sink()
    local rows, summary = sweep.run{
      axes = { n = { 1, 2, 3, 4, 5 } }, columns = { "y" }, csv = dir .. "/r.csv", progress = out,
      fn = function(cfg)
        calls[#calls + 1] = cfg.n
        if cfg.n == 2 then error("diverged at step 7") end
        if cfg.n == 3 then sweep.skip("needs cuda") end
        if cfg.n == 4 then return gdp.matmul(gdp.randn({ 2, 3 }), gdp.randn({ 2, 3 })) end -- a library error
        if cfg.n == 5 then return { y = 1, typo = 2 } end
        return { y = 10 * cfg.n }
      end,
    }
    out.out:close()
    assert.are.same({ 1, 2, 3, 4, 5 }, calls)
    assert.are.same({ total = 5, ran = 5, ok = 1, error = 3, skipped = 1, resumed = 0, not_run = 0,
                      csv = dir .. "/r.csv" }, summary)
    assert.are.same({ "ok", "error", "skipped", "error", "error" },
                    { rows[1].status, rows[2].status, rows[3].status, rows[4].status, rows[5].status })
    assert.are.equal(10, rows[1].y)
    assert.truthy(rows[2].error:find("sweep_spec.lua:%d+: diverged at step 7"), rows[2].error)
    assert.are.equal("needs cuda", rows[3].error)
    assert.truthy(rows[4].error:find("GDP_ERR_SHAPE", 1, true), rows[4].error)
    assert.truthy(rows[5].error:find("fn returned column 'typo'", 1, true), rows[5].error)
    assert.is_nil(rows[5].y) -- nothing of a rejected result is kept
    local _, parsed = sweep.read_csv(dir .. "/r.csv")
    assert.are.equal(5, #parsed)
    assert.are.equal("error", parsed[2].status)
    assert.truthy(parsed[2].error:find("diverged at step 7", 1, true))
    -- without a terminal: one plain line per config, errors included, no redraws
    local text = read_all(log)
    os.remove(log)
    assert.is_nil(text:find("\r", 1, true))
    assert.is_nil(text:find("\27", 1, true))
    assert.truthy(text:find("^# gdp.sweep sweep: 5 configs x 1 repeat, 0 done before, 5 to run"), text)
    assert.truthy(text:find("\n%[1/5%] n=1 %(.-elapsed%)\n"), text)
    assert.truthy(text:find("\n%[2/5%] n=2 %-> error: .-diverged at step 7"), text)
    assert.truthy(text:find("\n%[3/5%] n=3 %-> skipped: needs cuda"), text)
    assert.are.equal(6, #lines_of(text))
  end)

  it("stops on an interrupt, keeping the rows written", function()
    local calls = 0
    local ok, err = pcall(sweep.run, {
      axes = { n = { 1, 2, 3 } }, columns = { "y" }, csv = dir .. "/r.csv", progress = false,
      fn = function(cfg)
        calls = calls + 1
        if cfg.n == 2 then error("interrupted!") end -- what LuaJIT raises on Ctrl-C
        return { y = 1 }
      end,
    })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("interrupted!", 1, true))
    assert.are.equal(2, calls)
    assert.are.equal(2, #lines_of(read_all(dir .. "/r.csv"))) -- header and n = 1
  end)

  it("resumes: a rerun on the same run folder calls fn only for missing and failed rows", function()
    local run = results.new_run("resume", { root = dir })
    local axes = { n = { 1, 2, 3 }, chunk_size = { 32, 64 } }
    local function study(fn, extra)
      local o = { study = "resume", run = run, axes = axes, base = { T = 16 }, columns = { "y" }, repeats = 2,
                  progress = false, fn = fn }
      for k, v in pairs(extra or {}) do o[k] = v end
      return sweep.run(o)
    end
    -- first run: n = 2 fails, and an interrupt stops it at the first config with chunk_size 64
    local first = {}
    pcall(study, function(cfg, ctx)
      first[#first + 1] = ctx.label
      if cfg.chunk_size == 64 then error("interrupted!") end
      if cfg.n == 2 then error("bad luck") end
      return { y = cfg.n + cfg.seed % 7 }
    end)
    assert.are.equal(7, #first) -- 6 rows of chunk_size 32, then the interrupted one
    -- a row cut short by a killed process is ignored
    local f = assert(io.open(run.dir .. "/results.csv", "a"))
    f:write("32,3,16,9")
    f:close()
    local second = {}
    local rows, summary = study(function(cfg, ctx)
      second[#second + 1] = string.format("n=%d cs=%d r=%d", cfg.n, cfg.chunk_size, ctx.repeat_index)
      return { y = cfg.n + cfg.seed % 7 }
    end)
    assert.are.same({ "n=2 cs=32 r=1", "n=2 cs=32 r=2",
                      "n=1 cs=64 r=1", "n=1 cs=64 r=2", "n=2 cs=64 r=1", "n=2 cs=64 r=2",
                      "n=3 cs=64 r=1", "n=3 cs=64 r=2" }, second)
    assert.are.equal(12, #rows)
    assert.are.same({ total = 12, ran = 8, ok = 12, error = 0, skipped = 0, resumed = 4, not_run = 0,
                      csv = run.dir .. "/results.csv" }, summary)
    -- resumed rows come back from the file, as numbers, in config order
    assert.are.same({ 32, 1, 16, 1 + rows[1].seed % 7, "ok", 1 },
                    { rows[1].chunk_size, rows[1].n, rows[1].T, rows[1].y, rows[1].status, rows[1]["repeat"] })
    assert.are.equal(sweep.seed({ n = 1, chunk_size = 32, T = 16 }, 2), rows[2].seed)
    -- a third run has nothing left to do; resume = false or another salt reruns all
    local third = 0
    local _, s3 = study(function() third = third + 1 return { y = 0 } end)
    assert.are.equal(0, third)
    assert.are.equal(12, s3.resumed)
    study(function() third = third + 1 return { y = 0 } end, { seed = 3 })
    assert.are.equal(12, third)
    study(function() third = third + 1 return { y = 0 } end, { resume = false })
    assert.are.equal(24, third)
    -- every row written is in the one file: 4 ok + 2 failed, 8, then 12 + 12
    local _, parsed, bad = sweep.read_csv(run.dir .. "/results.csv")
    assert.are.equal(6 + 8 + 24, #parsed)
    assert.are.equal(1, bad)
  end)

  it("carries a previous run's ok rows into a new run (resume = <run folder>)", function()
    local old = results.new_run("carry", { root = dir })
    sweep.run{ run = old, axes = { n = { 1, 2 } }, columns = { "y" }, progress = false,
               fn = function(cfg) if cfg.n == 2 then error("x") end return { y = 5 } end }
    local new = results.new_run("carry", { root = dir })
    local calls = {}
    local rows, summary = sweep.run{ run = new, axes = { n = { 1, 2, 3 } }, columns = { "y" }, progress = false,
                                     resume = old.dir, fn = function(cfg) calls[#calls + 1] = cfg.n return { y = 7 } end }
    assert.are.same({ 2, 3 }, calls)
    assert.are.equal(1, summary.resumed)
    assert.are.same({ 5, 7, 7 }, { rows[1].y, rows[2].y, rows[3].y })
    local _, parsed = sweep.read_csv(new.dir .. "/results.csv")
    assert.are.equal(3, #parsed) -- the carried row is in the new run's file
    assert.are.same({ "1", "5" }, { parsed[1].n, parsed[1].y })
    gdp_test.expect_error(function()
      sweep.run{ axes = { n = { 1 } }, columns = {}, progress = false, resume = dir .. "/nothing",
                 csv = dir .. "/x.csv", fn = function() end }
    end, "resume: no results file")
  end)

  it("takes an explicit list of configs, their columns in `order` and then by name", function()
    local out, log = sink()
    local rows = sweep.run{
      configs = { { n = 1 }, { n = 2, mode = "x,y" }, { n = 1 } }, order = { "n" }, base = { T = 8 },
      columns = { "y" }, csv = dir .. "/c.csv", progress = out, label = function(cfg) return "cfg " .. cfg.n end,
      fn = function(cfg) return { y = cfg.n } end,
    }
    out.out:close()
    assert.are.equal(3, #rows)
    assert.is_nil(rows[1].mode)
    assert.are.equal(rows[1].seed, rows[3].seed) -- the same config, the same seed
    assert.are.equal("n,T,mode,y,status,error,seed,repeat,time_s", lines_of(read_all(dir .. "/c.csv"))[1])
    assert.truthy(lines_of(read_all(dir .. "/c.csv"))[3]:match('^2,8,"x,y",2,ok,'))
    assert.truthy(read_all(log):find("[2/3] cfg 2 (", 1, true))
    os.remove(log)
    -- a duplicated config is two rows: a rerun finds both done
    local calls = 0
    local _, s = sweep.run{ configs = { { n = 1 }, { n = 2, mode = "x,y" }, { n = 1 } }, order = { "n" }, base = { T = 8 },
                            columns = { "y" }, csv = dir .. "/c.csv", progress = false,
                            fn = function() calls = calls + 1 end }
    assert.are.equal(0, calls)
    assert.are.equal(3, s.resumed)
  end)

  it("checks its arguments", function()
    local fn = function() end
    gdp_test.expect_error(function() sweep.run{ axes = { n = { 1 } } } end, "gdp.sweep.run: fn: expected a function")
    gdp_test.expect_error(function() sweep.run{ fn = fn } end, "exactly one of axes")
    gdp_test.expect_error(function() sweep.run{ fn = fn, axes = {}, repeat_count = 2 } end, "unknown option 'repeat_count'")
    gdp_test.expect_error(function() sweep.run{ fn = fn, axes = {}, csv = dir .. "/a.csv" } end,
                          "columns: expected the list of result columns")
    gdp_test.expect_error(function() sweep.run{ fn = fn, axes = { n = { 1 } }, base = { seed = 1 } } end,
                          "'seed' is a reserved column", "pass seed = <salt>")
    gdp_test.expect_error(function() sweep.run{ fn = fn, axes = { n = { 1 } }, columns = { "n" } } end,
                          "columns: 'n' is also a config column")
    gdp_test.expect_error(function() sweep.run{ fn = fn, axes = {}, repeats = 0 } end, "repeats: expected an integer >= 1")
    assert.are.equal(sweep, gdp.sweep) -- loaded lazily by require("gdp")
  end)
end)

describe("sweep.read_csv and sweep.plot", function()
  local dir
  before_each(function()
    dir = tmpdir()
    results.mkdir_p(dir)
  end)
  after_each(function() os.execute("rm -rf " .. util.shell_quote(dir)) end)

  it("reads quoted fields and drops a truncated last record", function()
    local f = assert(io.open(dir .. "/a.csv", "w"))
    f:write('a,b,c\n1,"x, ""y""",\n2,"multi\nline",z\r\n4,"q"x,y\n3,"cut')
    f:close()
    local header, rows, bad = sweep.read_csv(dir .. "/a.csv")
    assert.are.same({ "a", "b", "c" }, header)
    assert.are.same({ { a = "1", b = 'x, "y"', c = "" }, { a = "2", b = "multi\nline", c = "z" } }, rows)
    assert.are.equal(2, bad) -- text after a closing quote, and the cut last record
    assert.is_nil(sweep.read_csv(dir .. "/none.csv"))
  end)

  it("writes a gnuplot script with one line per value of `by`", function()
    local path = sweep.plot(dir, {
      { x = "n", y = { "fwd_ms", "fwdbwd_ms" }, by = "chunk_size", rows = { { chunk_size = 32 }, { chunk_size = 64 },
        { chunk_size = 32 } }, xtics = 1 },
      { x = "T", y = "err", logx = true, logy = true, output = "err.svg" },
    })
    assert.are.equal(dir .. "/plot.gp", path)
    local gp = read_all(path)
    assert.truthy(gp:find('set datafile separator ","', 1, true))
    assert.truthy(gp:find("set datafile missing NaN", 1, true))
    assert.truthy(gp:find('set output "plot.png"', 1, true))
    assert.truthy(gp:find('set output "err.svg"', 1, true))
    assert.truthy(gp:find("set logscale x 2", 1, true))
    local _, nplots = gp:gsub('"results.csv" using ', "")
    assert.are.equal(5, nplots) -- 2 y x 2 chunk sizes, then 1
    assert.truthy(gp:find('strcol("chunk_size") eq "64"', 1, true))
    assert.truthy(gp:find('title "fwdbwd_ms, chunk_size = 32"', 1, true))
    assert.truthy(gp:find('using "T":((strcol("status") eq "ok") ? column("err") : NaN)', 1, true))
    assert.is_nil(sweep.plot({ study = "x" }, { x = "n", y = "y" })) -- a rank without a folder
    -- (gnuplot itself runs the script where it is installed)
    local has_gnuplot = os.execute("command -v gnuplot >/dev/null 2>&1")
    if has_gnuplot == 0 or has_gnuplot == true then
      local f = assert(io.open(dir .. "/results.csv", "w"))
      f:write("chunk_size,n,T,fwd_ms,fwdbwd_ms,err,status\n32,1,8,1,3,1e-7,ok\n64,1,8,2,5,2e-7,ok\n" ..
              "32,2,16,2,5,1e-7,ok\n64,2,16,,,,error\n")
      f:close()
      local out, rc = sh("cd " .. util.shell_quote(dir) .. " && gnuplot plot.gp")
      assert.are.equal(0, rc, out)
      assert.truthy(io.open(dir .. "/plot.png", "r"), "no plot.png")
    end
  end)
end)

describe("householder_sweep experiment", function()
  local runs
  before_each(function() runs = tmpdir() end)
  after_each(function() os.execute("rm -rf " .. util.shell_quote(runs)) end)

  local function experiment(args)
    return sh(string.format("GDP_RUNS_DIR=%s LUA_PATH=%q luajit experiments/householder_sweep.lua %s",
                            util.shell_quote(runs), package.path, args))
  end
  local TINY = "--T 48 --H 1 --K 16 --V 16 --n 1,2 --chunk-size 8,16 --warmup 0 --samples 1 --check-T 24 --check-H 1"

  it("writes a run folder with one ok row per config and resumes from it", function()
    local out, rc = experiment(TINY)
    assert.are.equal(0, rc, out)
    -- progress without a terminal: one line per config, no redraws
    assert.is_nil(out:find("\27[", 1, true), out)
    assert.truthy(out:find("[4/4] chunk_size=16 n=2", 1, true), out)
    assert.truthy(out:find("\n# dtype  chunk  n  fwd_ms", 1, true), out)
    local dir = out:match("# run folder: (%S+)")
    assert.truthy(dir, out)
    local header, rows = sweep.read_csv(dir .. "/results.csv")
    assert.are.same({ "dtype", "chunk_size", "n" }, { header[1], header[2], header[3] })
    assert.are.equal(4, #rows)
    for i, r in ipairs(rows) do
      assert.are.equal("ok", r.status, r.error)
      assert.are.equal(({ "8", "8", "16", "16" })[i], r.chunk_size)
      assert.are.equal(({ "1", "2", "1", "2" })[i], r.n)
      assert.are.equal("48", r.T)
      for _, c in ipairs({ "fwd_ms", "fwdbwd_ms", "gflops_fwd", "gflops_fwdbwd" }) do
        assert.truthy(tonumber(r[c]) > 0, c .. " = " .. r[c])
      end
      -- f32 chunk path against the float64 recurrence
      assert.truthy(tonumber(r.fwd_rel_err) > 0 and tonumber(r.fwd_rel_err) <= 1e-4, r.fwd_rel_err)
      assert.truthy(tonumber(r.bwd_rel_err) > 0 and tonumber(r.bwd_rel_err) <= 1e-4, r.bwd_rel_err)
      assert.are.equal("yes", r.within_tol)
      assert.are.equal(tostring(sweep.seed({ dtype = "f32", chunk_size = tonumber(r.chunk_size), n = tonumber(r.n),
        device = "cpu", B = 1, T = 48, H = 1, K = 16, V = 16, algorithm = "chunk", use_qk_l2norm = true, warmup = 0,
        samples = 1, check_T = 24, check_H = 1, threads = tonumber(r.threads) })), r.seed)
    end
    assert.truthy(read_all(dir .. "/plot.gp"):find('strcol("chunk_size") eq "16"', 1, true))
    assert.truthy(read_all(dir .. "/meta.json"):find('"ok": 4', 1, true))
    -- a grown grid measures only the new configs
    out, rc = experiment(TINY:gsub("%-%-n 1,2", "--n 1,2,3") .. " --resume " .. dir)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("6 configs x 1 repeat, 4 done before, 2 to run", 1, true), out)
    local dir2 = out:match("# run folder: (%S+)")
    local _, rows2 = sweep.read_csv(dir2 .. "/results.csv")
    assert.are.equal(6, #rows2)
    assert.are.same(rows[1], rows2[1]) -- carried over as it was
  end)
end)
