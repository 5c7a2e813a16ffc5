-- Helpers of the experiment scripts (gdp.util, gdp.results, gdp.progress) and the
-- scripts' command lines, run as subprocesses on tiny configurations.
local util = require("gdp.util")
local results = require("gdp.results")
local progress = require("gdp.progress")
local H = gdp_test

local sh = gdp_test.sh

local function lua_cmd(script, args)
  return string.format("LUA_PATH=%q luajit %s %s", package.path, script, args or "")
end

local function read_all(path)
  local f = assert(io.open(path, "r"))
  local s = f:read("*a")
  f:close()
  return s
end

describe("util", function()
  it("parses options against a config table", function()
    local cfg = { device = "cpu", T = 4096, json = false, ["repeat"] = 5, against_fla = false }
    local o, pos = util.parse_args({ "--T", "128", "--json", "--repeat=2", "--against-fla", "a", "--", "--b" }, cfg,
                                   { choices = { device = { "cpu", "cuda" } } })
    assert.are.same({ device = "cpu", T = 128, json = true, ["repeat"] = 2, against_fla = true }, o)
    assert.are.same({ "a", "--b" }, pos)
    assert.are.equal(4096, cfg.T) -- the config table is not modified
    local o2 = util.parse_args({ "--no-json", "--device", "cuda" }, { json = true, device = "cpu" })
    assert.are.same({ json = false, device = "cuda" }, o2)
  end)

  it("rejects unknown options and bad values with exit status 2", function()
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write('local u = require("gdp.util"); u.parse_args(arg, {T = 1, device = "cpu"}, ',
            '{choices = {device = {"cpu", "cuda"}}}); print("parsed")\n')
    f:close()
    local out, rc = sh(lua_cmd(script, "--bogus 1"))
    assert.are.equal(2, rc)
    assert.truthy(out:find("unknown option --bogus", 1, true), out)
    out, rc = sh(lua_cmd(script, "--T x"))
    assert.are.equal(2, rc)
    assert.truthy(out:find("--T: expected a number, got 'x'", 1, true), out)
    out, rc = sh(lua_cmd(script, "--device tpu"))
    assert.are.equal(2, rc)
    assert.truthy(out:find("expected one of cpu, cuda", 1, true), out)
    out, rc = sh(lua_cmd(script, "--help"))
    assert.are.equal(0, rc)
    assert.truthy(out:find("--device", 1, true), out)
    os.remove(script)
  end)

  it("encodes JSON deterministically", function()
    assert.are.equal('{"a":1,"b":[1,2.5,"x\\n"],"c":null,"d":{},"e":[],"f":true}',
                     util.json_encode({ b = { 1, 2.5, "x\n" }, a = 1, c = 0 / 0, d = {},
                                        e = util.json_array(), f = true }))
    assert.are.equal("0.1", util.json_encode(0.1))
    assert.are.equal("0.1767766952966369", util.json_encode(0.1767766952966369))
    assert.are.equal('"tab\\t\\u0001"', util.json_encode("tab\t\1"))
  end)

  it("formats aligned tables with a # header and computes medians", function()
    local s = util.format_table({ "a", "bb" }, { { 1, 2.5 }, { "long", 0 / 0 } })
    assert.are.equal("# a     bb\n  1     2.5\n  long  nan", s)
    assert.are.equal(2, util.median({ 3, 1, 2 }))
    assert.are.equal(2.5, util.median({ 4, 1, 2, 3 }))
    assert.are.equal(util.hash("abc"), util.hash("abc"))
    assert.are_not.equal(util.hash("abc"), util.hash("abd"))
  end)
end)

describe("results", function()
  local dir
  before_each(function()
    dir = os.tmpname()
    os.remove(dir)
  end)
  after_each(function() os.execute("rm -rf " .. util.shell_quote(dir)) end)

  it("takes the revision from GDP_GIT_SHA for a tree copied without its history", function()
    local ffi = require("ffi")
    pcall(ffi.cdef, "int setenv(const char *, const char *, int); int unsetenv(const char *);")
    local sha = string.rep("ab12", 10)
    ffi.C.setenv("GDP_GIT_SHA", sha, 1)
    ffi.C.setenv("GDP_GIT_DIRTY", "1", 1)
    local ok, info = pcall(results.git_info)
    ffi.C.setenv("GDP_GIT_SHA", "not a sha", 1) -- ignored: the repository's own answer
    local ok2, own = pcall(results.git_info)
    ffi.C.unsetenv("GDP_GIT_SHA")
    ffi.C.unsetenv("GDP_GIT_DIRTY")
    assert.is_true(ok and ok2)
    assert.are.same({ sha = sha, short = "ab12ab1", dirty = true, from = "GDP_GIT_SHA" }, info)
    assert.are_not.equal(sha, own.sha)
    assert.is_nil(own.from)
  end)

  it("makes a run folder with meta.json, results.csv flushed per row, plot.gp", function()
    local run = results.new_run("study", { root = dir, config = { T = 5 }, seed = 3, args = { "--x" } })
    assert.truthy(run.dir:find(dir .. "/study/", 1, true))
    local meta = read_all(run.dir .. "/meta.json")
    assert.truthy(meta:find('"seed": 3', 1, true), meta)
    assert.truthy(meta:find('"git"', 1, true))
    assert.truthy(meta:find('"start_time"', 1, true))
    local csv = run:csv({ "T", "time_ms", "status", "error" })
    csv:row({ T = 5, time_ms = 1.5, status = "ok" })
    -- flushed: readable before the run ends
    assert.are.equal("T,time_ms,status,error\n5,1.5,ok,\n", read_all(run.dir .. "/results.csv"))
    csv:row({ T = 6, status = "error", error = 'bad "x", y' })
    assert.has_error(function() csv:row({ T = 7, nope = 1 }) end)
    run:plot({ x = "T", y = { "time_ms" }, logx = true })
    run:finish({ status = "ok" })
    assert.truthy(read_all(run.dir .. "/results.csv"):find('6,,error,"bad ""x"", y"', 1, true))
    local gp = read_all(run.dir .. "/plot.gp")
    assert.truthy(gp:find('set datafile separator ","', 1, true))
    assert.truthy(gp:find("set logscale x 2", 1, true))
    assert.truthy(gp:find('using "T":((strcol("status") eq "ok") ? column("time_ms") : NaN)', 1, true), gp)
    assert.truthy(gp:find("noenhanced", 1, true), gp) -- '_' in names is no subscript
    assert.truthy(read_all(run.dir .. "/meta.json"):find('"end_time"', 1, true))
    local has_gnuplot = os.execute("command -v gnuplot >/dev/null 2>&1")
    if has_gnuplot == 0 or has_gnuplot == true then
      assert.truthy(io.open(run.dir .. "/plot.png", "r"), "the PNG is made beside plot.gp")
    end
  end)

  it("meta.json has the CPU model, thread counts and a sweep's axes", function()
    local run = results.new_run("facts", { root = dir })
    local sweep = require("gdp.sweep")
    sweep.run { run = run, axes = { n = { 1, 2 } }, base = { T = 3 }, columns = { "y" },
                fn = function(cfg) return { y = cfg.n * cfg.T } end }
    run:finish()
    local meta = util.json_decode(read_all(run.dir .. "/meta.json"))
    assert.are.equal("ok", meta.status)
    assert.are.same({ 1, 2 }, meta.sweep.axes.n)
    assert.are.equal(2, meta.sweep.configs)
    assert.truthy(meta.threads and meta.threads.gdp_cpu_context >= 1, read_all(run.dir .. "/meta.json"))
    local f = io.open("/proc/cpuinfo", "r")
    if f then
      f:close()
      assert.truthy(type(meta.cpu_model) == "string" and #meta.cpu_model > 0)
    end
  end)

  it("every meta.json has a status: failed until finish, then ok or failed with a reason", function()
    local function meta_of(run) return read_all(run.dir .. "/meta.json") end
    local run = results.new_run("st", { root = dir })
    assert.truthy(meta_of(run):find('"status": "failed"', 1, true), meta_of(run))
    assert.truthy(meta_of(run):find('"reason": "did not finish', 1, true), meta_of(run))
    run:finish()
    assert.truthy(meta_of(run):find('"status": "ok"', 1, true), meta_of(run))
    assert.is_nil(meta_of(run):find('"reason"', 1, true), meta_of(run))
    run = results.new_run("st", { root = dir })
    run:finish({ status = "error", error = "shape 3 failed" })
    assert.truthy(meta_of(run):find('"status": "failed"', 1, true), meta_of(run))
    assert.truthy(meta_of(run):find('"reason": "shape 3 failed"', 1, true), meta_of(run))
    run = results.new_run("st", { root = dir })
    run:finish({ exit_code = 1 })
    assert.truthy(meta_of(run):find('"reason": "exit code 1"', 1, true), meta_of(run))
  end)

  it("puts runs under the repository's experiments/runs wherever the script starts", function()
    local cwd = os.getenv("PWD")
    local lpath = cwd .. "/lua/?.lua;" .. cwd .. "/lua/?/init.lua;" .. package.path
    local probe = "print(require(\"gdp.results\").root)"
    local out = sh(string.format("cd /tmp && env -u GDP_RUNS_DIR -u GDP_ROOT LUA_PATH=%q luajit -e %s",
                                 lpath, util.shell_quote(probe)))
    assert.are.equal(cwd .. "/experiments/runs", (out:gsub("%s+$", "")))
    out = sh(string.format("cd /tmp && env -u GDP_RUNS_DIR GDP_ROOT=/some/repo LUA_PATH=%q luajit -e %s",
                           lpath, util.shell_quote(probe)))
    assert.are.equal("/some/repo/experiments/runs", (out:gsub("%s+$", "")))
    out = sh(string.format("cd /tmp && GDP_RUNS_DIR=/elsewhere LUA_PATH=%q luajit -e %s",
                           lpath, util.shell_quote(probe)))
    assert.are.equal("/elsewhere", (out:gsub("%s+$", "")))
  end)

  it("finish says where the run went", function()
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write(string.format("local r = require('gdp.results').new_run('where', {root = %q}); r:finish()\n", dir))
    f:close()
    local out, rc = sh(lua_cmd(script))
    os.remove(script)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("where: run ok, saved in " .. dir .. "/where/", 1, true), out)
  end)

  it("appends to a study file and keeps files with other columns", function()
    local path = dir .. "/s/results.csv"
    results.append_csv(path, { "a", "b" }, { a = 1, b = 2 })
    results.append_csv(path, { "a", "b" }, { a = 3, b = 4 })
    assert.are.equal("a,b\n1,2\n3,4\n", read_all(path))
    local other = results.append_csv(path, { "a", "c" }, { a = 5, c = 6 })
    assert.are_not.equal(path, other)
    assert.are.equal("a,b\n1,2\n3,4\n", read_all(path))
    assert.are.equal("a,c\n5,6\n", read_all(other))
  end)
end)

describe("progress", function()
  it("prints one line per finished step without a terminal", function()
    local tmp = os.tmpname()
    local f = assert(io.open(tmp, "w"))
    local bar = progress.new(2, { out = f, tty = false })
    bar:update(0, "first")
    bar:done()
    bar:done("second")
    bar:finish()
    f:close()
    local s = read_all(tmp)
    os.remove(tmp)
    assert.truthy(s:match("^%[1/2%] first %(.-elapsed%)\n%[2/2%] second %(.-elapsed%)\n$"), s)
  end)
end)

describe("experiment scripts", function()
  local runs
  before_each(function()
    runs = os.tmpname()
    os.remove(runs)
  end)
  after_each(function() os.execute("rm -rf " .. util.shell_quote(runs)) end)

  -- issue 21's CI check: DeltaProduct's qualitative result at CPU size (parity needs
  -- negative eigenvalues at n_h = 1); the script asserts it and says so on its last line.
  it("state_tracking --quick learns parity with beta in (0,2) and not in (0,1)", function()
    local out, rc = sh(string.format("GDP_RUNS_DIR=%s %s", runs, lua_cmd("experiments/state_tracking.lua", "--quick")))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("state_tracking quick: ok", 1, true), out)
    local with, without = out:match("([%d.]+) with beta in %(0,2%), ([%d.]+) in %(0,1%)")
    assert.truthy(tonumber(with) >= 0.99 and tonumber(without) < 0.8, out)
    local run = out:match("saved in (%S+)")
    assert.truthy(run and read_all(run .. "/curves.csv"):find("parity n_h=1 beta_max=2 seed 1", 1, true), out)
  end)

  it("state_tracking --resume keeps the done rows and their curves in the new run's curves.csv", function()
    local grid = "--tasks parity --nh 1 --seeds 1 --hidden 16 --heads 2 --head-dim 8 --mlp-ratio 2 " ..
      "--train-len 16 --eval-len 32 --batch 16 --eval-batch 32 --train-seqs 320 --epochs 1 " ..
      "--eval-every 10 --curve-step 8"
    local out, rc = sh(string.format("GDP_RUNS_DIR=%s %s", runs,
                                     lua_cmd("experiments/state_tracking.lua", grid .. " --beta-max 2")))
    assert.are.equal(0, rc, out)
    local first = out:match("saved in (%S+)")
    out, rc = sh(string.format("GDP_RUNS_DIR=%s %s", runs, lua_cmd("experiments/state_tracking.lua",
                                                                   grid .. " --beta-max 2,1 --resume " .. first)))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("1 done before, 1 to run", 1, true), out)
    local second = out:match("saved in (%S+)")
    local function curve(dir, label)
      local pts = {}
      for line in read_all(dir .. "/curves.csv"):gmatch("[^\n]+") do
        local l, len, acc = line:match("^(.-),(%d+),([^,]*),ok$")
        if l == label then pts[#pts + 1] = len .. "=" .. acc end
      end
      return table.concat(pts, " ")
    end
    local resumed = "parity n_h=1 beta_max=2 seed 1"
    assert.are.equal(4, #curve(first, resumed):gsub("[^=]", ""))
    assert.are.equal(curve(first, resumed), curve(second, resumed))
    assert.are.equal(4, #curve(second, "parity n_h=1 beta_max=1 seed 1"):gsub("[^=]", ""))
    -- a figure per task and beta range, each with its config's line
    local gp = read_all(second .. "/plot.gp")
    for _, b in ipairs({ 1, 2 }) do
      local fig = gp:match('set output "plot%-parity%-beta' .. b .. '%.png"(.-)\n\n') or
                  gp:match('set output "plot%-parity%-beta' .. b .. '%.png"(.*)$')
      assert.truthy(fig and fig:find("parity n_h=1 beta_max=" .. b .. " seed 1", 1, true), gp)
      assert.falsy(fig:find("beta_max=" .. (3 - b), 1, true), gp)
    end
  end)

  -- state_tracking.lua with these options (it must succeed): its output and run folder
  local function state_tracking(args)
    local out, rc = sh(string.format("GDP_RUNS_DIR=%s %s", runs, lua_cmd("experiments/state_tracking.lua", args)))
    assert.are.equal(0, rc, out)
    return out, out:match("saved in (%S+)")
  end
  local function final_row(dir)
    local _, rows = require("gdp.sweep").read_csv(dir .. "/results.csv")
    return rows[#rows]
  end

  -- A config that the time budget stops keeps a checkpoint and continues under
  -- --resume, over as many calls as it takes, ending where the uninterrupted run ends.
  it("state_tracking --time-budget pauses a running config; --resume continues it bit for bit", function()
    local grid = "--tasks parity --nh 1 --beta-max 2 --seeds 1 --hidden 16 --heads 2 --head-dim 8 " ..
      "--mlp-ratio 2 --train-len 16 --eval-len 16 --batch 16 --eval-batch 32 --train-seqs 1600 " ..
      "--epochs 1 --eval-every 40 --early-stop 0 --curve-step 8"
    local function st(args) return state_tracking(grid .. args) end
    local _, straight = st("")
    -- the first evaluation (step 40) comes after the 10 ms budget: paused there
    local out, first = st(" --time-budget 0.01")
    assert.truthy(out:find("paused at step 40 of 100", 1, true), out)
    assert.is_nil(final_row(first), "a paused config writes no row")
    local partial = out:match("%((%S+partial%-%x+%.safetensors)%)")
    assert.truthy(partial and io.open(partial, "rb"), out)
    out = st(" --time-budget 0.01 --resume " .. first)
    assert.truthy(out:find("continues from step 40 of 100", 1, true), out)
    local second = out:match("saved in (%S+)")
    assert.truthy(out:find("paused at step 80 of 100", 1, true), out)
    local last
    out, last = st(" --resume " .. second)
    assert.truthy(out:find("continues from step 80 of 100", 1, true), out)
    local want, got = final_row(straight), final_row(last)
    assert.are.equal("ok", got.status)
    assert.are.equal(want.steps, got.steps)
    assert.are.equal(want.loss, got.loss) -- the CSV's shortest round-trip text: bit for bit
    assert.are.equal(want.acc_train_len, got.acc_train_len)
    assert.are.equal(want.acc_token, got.acc_token)
    assert.is_nil(io.open(last .. "/" .. partial:match("[^/]+$"), "rb"), "the finished run keeps no checkpoint")
  end)

  it("state_tracking --curriculum scores a longer prefix after each epoch under 0.3, also across a pause", function()
    local grid = "--tasks parity --nh 1 --beta-max 2 --seeds 1 --hidden 16 --heads 2 --head-dim 8 " ..
      "--mlp-ratio 2 --train-len 8 --eval-len 8 --batch 16 --eval-batch 32 --train-seqs 320 --epochs 12 " ..
      "--eval-every 20 --early-stop 0 --curve-step 8 --lr 1e-2"
    local function st(args)
      local out, dir = state_tracking(grid .. args)
      return out, final_row(dir)
    end
    local out, row = st(" --curriculum")
    -- 20 steps an epoch: the prefix grows one token at a time, only at epoch ends, up to all 8
    local widened = {}
    for step, n in out:gmatch("step (%d+): the loss scores (%d+) tokens") do
      assert.are.equal(0, tonumber(step) % 20, out)
      widened[#widened + 1] = tonumber(n)
    end
    assert.are.same({ 3, 4, 5, 6, 7, 8 }, widened)
    local _, plain = st("")
    assert.are_not.equal(plain.loss, row.loss, "the curriculum changes the training")
    -- paused before the first widening and continued: the same run
    local paused = st(" --curriculum --time-budget 0.01")
    assert.truthy(paused:find("paused at step 20 of 240", 1, true), paused)
    local first = paused:match("saved in (%S+)")
    local _, resumed = st(" --curriculum --resume " .. first)
    assert.are.equal(row.loss, resumed.loss)
  end)

  it("state_tracking --speed --against-fla times both stacks per n_h (fla stubbed)", function()
    local stub = [[echo '{"rows":[{"nh":1,"step_ms":2,"tokens_per_s":100}]}' #]]
    local out, rc = sh(string.format("GDP_RUNS_DIR=%s %s", runs, lua_cmd("experiments/state_tracking.lua",
      "--speed --against-fla --tasks S3 --nh 1 --batch 4 --train-len 8 --hidden 16 --heads 2 --head-dim 8 " ..
      "--speed-steps 2 --fla-cmd " .. util.shell_quote(stub))))
    assert.are.equal(0, rc, out)
    local step_ms, tok_s, speedup = out:match("\n  S3%s+1%s+([%d.e+]+)%s+([%d.e+]+)%s+2%s+100%s+([%d.e+]+)")
    assert.truthy(step_ms and tonumber(step_ms) > 0, out)
    assert.truthy(math.abs(tonumber(speedup) - tonumber(tok_s) / 100) <= 2e-3 * tonumber(speedup), out) -- both printed to 4 digits
    local _, rc2 = sh(lua_cmd("experiments/state_tracking.lua", "--against-fla"))
    assert.are.equal(2, rc2)
  end)

  it("train_lm --quick lowers the validation loss of a byte-level GDP model", function()
    local out, rc = sh(string.format("GDP_RUNS_DIR=%s %s", runs, lua_cmd("experiments/train_lm.lua", "--quick")))
    assert.are.equal(0, rc, out)
    local first, last = out:match("train_lm quick: ok %(validation loss ([%d.]+) %-> ([%d.]+)%)")
    assert.truthy(first and tonumber(last) < 0.9 * tonumber(first), out)
    local run = out:match("saved in (%S+)")
    assert.truthy(run and read_all(run .. "/eval.csv"):find("val_loss", 1, true), out)
  end)

  it("bench_gdp --json prints one JSON object and appends a results row", function()
    local out, rc = sh(string.format("GDP_RUNS_DIR=%s %s 2>/dev/null", runs,
      lua_cmd("experiments/bench_gdp.lua",
              "--T 64 --H 2 --K 16 --V 16 --n 2 --warmup 0 --repeat 2 --sgemm-size 64 --json")))
    assert.are.equal(0, rc, out)
    local json = out:match("^%s*(%b{})%s*$")
    assert.truthy(json, "stdout is not one JSON object:\n" .. out)
    for _, key in ipairs({ "gflops", "fraction_of_sgemm", "sgemm_gflops", "fwd_ms", "fwdbwd_ms" }) do
      local v = tonumber(json:match('"' .. key .. '":([-%d.e+]+)'))
      assert.truthy(v and v > 0, key .. " in " .. json)
    end
    assert.truthy(json:find('"status":"ok"', 1, true))
    local csv = read_all(runs .. "/bench_gdp/results.csv")
    assert.truthy(csv:match("^start_time,"), csv)
    assert.truthy(csv:find(",ok,", 1, true), csv)
  end)

  it("bench_data prints tokens/s per task and writes its rows", function()
    local out, rc = sh(string.format("GDP_RUNS_DIR=%s %s 2>/dev/null", runs,
      lua_cmd("experiments/bench_data.lua", "--batch 8 --length 16 --repeat 1 --tasks S3,parity")))
    assert.are.equal(0, rc, out)
    for _, task in ipairs({ "S3", "parity" }) do
      local rate = tonumber(out:match("\n  " .. task .. "%s+[%d.]+%s+([%d.e+]+)"))
      assert.truthy(rate and rate > 0, task .. " in\n" .. out)
    end
    local csv = read_all(runs .. "/bench_data/" .. util.capture("ls " .. runs .. "/bench_data") .. "/results.csv")
    assert.truthy(csv:find(",ok,", 1, true), csv)
  end)

  it("check_reference reports every tensor and fails on a tight tolerance", function()
    local files = H.list_files(H.golden_dir, "^gdp_n1_basic%.safetensors$")
    if #files == 0 then pending("no golden fixtures") return end
    local out, rc = sh(lua_cmd("experiments/check_reference.lua", files[1]))
    assert.are.equal(0, rc, out)
    for _, name in ipairs({ "o", "ht", "dq", "dk", "dv", "dbeta", "dg" }) do
      assert.truthy(out:find("operator  " .. name .. " ", 1, true), name .. "\n" .. out)
    end
    out, rc = sh(lua_cmd("experiments/check_reference.lua", "--tol 1e-18 " .. files[1]))
    assert.are.equal(1, rc, out)
    assert.truthy(out:find("FAIL", 1, true))
  end)
end)

describe("the experiment scripts' first-hour errors", function()
  it("check_reference: a missing FILE is one line and exit 2", function()
    local out, rc = sh(lua_cmd("experiments/check_reference.lua", "/nonexistent/case.safetensors"))
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("check_reference: cannot read /nonexistent/case.safetensors: No such file", 1, true), out)
    assert.is_nil(out:find("traceback", 1, true), out)
    assert.are.equal(1, select(2, out:gsub("\n", "")), out)
  end)

  it("a CUDA device that is not there is one line and exit 2", function()
    if require("gdp").has_cuda() then return pending("this machine has a GPU") end
    for _, script in ipairs({ "experiments/bench_gdp.lua", "experiments/check_reference.lua",
                              "experiments/bench_data.lua" }) do
      local out, rc = sh(lua_cmd(script, "--device cuda"))
      assert.are.equal(2, rc, out)
      assert.truthy(out:find("device cuda is not available", 1, true), out)
      assert.is_nil(out:find("traceback", 1, true), out)
      assert.are.equal(1, select(2, out:gsub("\n", "")), out)
    end
  end)
end)
