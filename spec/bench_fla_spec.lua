-- experiments/bench_gdp.lua --shapes and --against-fla, run as subprocesses on the cpu at
-- tiny shapes.  fla itself needs a GPU, so its side is a stub named by the documented
-- test hook --fla-cmd: a Lua script that answers --check and prints fla_bench.py-style
-- JSON (escapes, a surrogate pair, NaN, Infinity, null, noise before the object) with
-- times derived from the shape, so that the parsing, the matching by shape and the
-- ratios are checked against numbers known here.  No GPU tag: runs everywhere.
-- bench_gdp's JSON is read back with dkjson (busted's own dependency), a decoder
-- independent of the one inside bench_gdp.
local util = require("gdp.util")
local has_dkjson, dkjson = pcall(require, "dkjson")

local function sh(cmd)
  local p = assert(io.popen("{ " .. cmd .. "; } 2>&1; echo \"rc=$?\""))
  local text = p:read("*a")
  p:close()
  local rc = tonumber(text:match("rc=(%d+)%s*$"))
  return text:gsub("rc=%d+%s*$", ""), rc
end

local function write(path, text)
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
end

local function read_all(path)
  local f = assert(io.open(path, "r"))
  local s = f:read("*a")
  f:close()
  return s
end

-- The stub: times fwd_ms = B*T*n / 1000, fwdbwd_ms = 3 * that (as strings JSON must
-- carry); STUB_CHECK replaces the --check answer, STUB_DROP leaves that shape out,
-- STUB_PYTHONPATH makes it fail (exit 4) unless PYTHONPATH starts with it.  Queued
-- (GPU-only) times are half the eager ones, host times 0.25 / 0.5 ms; STUB_QNOTE makes
-- the queued figures null with that note instead.
local STUB = [=[
local args = table.concat(arg, " ")
if arg[1] == "--check" then
  local answer = os.getenv("STUB_CHECK") or "ok"
  print("a warning a library printed")
  print(answer)
  os.exit(answer == "ok" and 0 or 1)
end
local want = os.getenv("STUB_PYTHONPATH")
if want and (os.getenv("PYTHONPATH") or ""):sub(1, #want) ~= want then
  io.stderr:write("stub: PYTHONPATH does not start with ", want, "\n")
  os.exit(4)
end
local shapes = args:match("%-%-shapes (%S+)")
local rows = {}
for b, t, n in shapes:gmatch("(%d+)x(%d+)x(%d+)") do
  if b .. "x" .. t .. "x" .. n ~= os.getenv("STUB_DROP") then
    local ms = b * t * n / 1000
    local qnote = os.getenv("STUB_QNOTE")
    local queued = qnote and string.format('"fwd_queued_ms": null, "fwdbwd_queued_ms": null, "fwd_host_ms": null, ' ..
      '"fwdbwd_host_ms": null, "queued_note": "%s"', qnote) or string.format('"fwd_queued_ms": %.17g, ' ..
      '"fwdbwd_queued_ms": %.17g, "fwd_host_ms": 0.25, "fwdbwd_host_ms": 0.5, "queued_note": null', ms / 2, 1.5 * ms)
    rows[#rows + 1] = string.format('{"B": %s, "T": %s, "n": %s, "H": 2, "K": 16, "V": 16, "fwd_ms": %.17g, ' ..
      '"fwd_min_ms": NaN, "fwdbwd_ms": %.17g, "fwdbwd_min_ms": Infinity, "note": null, %s}', b, t, n, ms, 3 * ms, queued)
  end
end
print("noise {not json} on stdout first")
print('{\n "tool": "stub \\"fla\\" \\u00e9\\ud83d\\ude00", "fla_version": "0.0-stub", "fla_commit": null,\n' ..
      ' "torch": "t", "triton": "tr", "device": "Stub GPU",\n "rows": [' .. table.concat(rows, ",\n  ") .. ']\n}')
]=]

describe("bench_gdp --shapes and --against-fla (cpu, fla stubbed)", function()
  local tmp, runs, stub, base
  before_each(function()
    tmp = os.tmpname()
    os.remove(tmp)
    os.execute("mkdir -p " .. util.shell_quote(tmp))
    runs = tmp .. "/runs"
    stub = tmp .. "/fla_stub.lua"
    write(stub, STUB)
    base = string.format("GDP_RUNS_DIR=%s LUA_PATH=%q luajit experiments/bench_gdp.lua --T 32 --H 2 --K 16 --V 16 " ..
                         "--threads 1 --warmup 0 --repeat 2 --sgemm-size 32", util.shell_quote(runs), package.path)
  end)
  after_each(function() os.execute("rm -rf " .. util.shell_quote(tmp)) end)

  local function decode(out)
    -- (not %b{}: the strings may hold braces)
    local json = out:match("^%s*({[^\n]*})%s*$")
    assert.truthy(json, "stdout is not one JSON object on one line:\n" .. out)
    local obj = dkjson.decode(json)
    assert.are.equal("table", type(obj), json)
    return obj
  end

  it("times every shape of --shapes in one run, one JSON object, one CSV row per shape", function()
    if not has_dkjson then pending("dkjson (busted's dependency) not found") return end
    local out, rc = sh(base .. " --shapes 1x32x1,2x16x2,1x8x3 --json 2>/dev/null")
    assert.are.equal(0, rc, out)
    local r = decode(out)
    assert.are.equal("ok", r.status)
    assert.are.equal(3, #r.shapes)
    for i, want in ipairs({ { 1, 32, 1 }, { 2, 16, 2 }, { 1, 8, 3 } }) do
      local s = r.shapes[i]
      assert.are.same(want, { s.B, s.T, s.n })
      assert.truthy(s.fwd_ms > 0 and s.fwdbwd_ms > 0, out)
      assert.near(s.B * s.T / (s.fwdbwd_ms / 1e3), s.tokens_per_s, 1e-6 * s.tokens_per_s)
      assert.near(2 * 16 * 16 * (2 * s.n + 1) * s.B * s.T * 2 / (s.fwd_ms / 1e3) / 1e9, s.gflops_fwd,
                  1e-9 * s.gflops_fwd)
    end
    -- several shapes: no single shape's figures at the top level; the ones of the run are
    assert.is_nil(r.fwd_ms)
    assert.truthy(r.sgemm_gflops > 0)
    assert.truthy(r.flop_count:find("^recurrence"), r.flop_count)
    assert.truthy(r.command:find("--shapes 1x32x1,2x16x2,1x8x3", 1, true), r.command)
    assert.are.equal("gdp", r.inputs) -- auto without --against-fla
    assert.are.equal(3 + 1, select(2, read_all(r.run_dir .. "/results.csv"):gsub("\n", "")))
    assert.are.same(r, dkjson.decode(read_all(r.run_dir .. "/bench_gdp.json")))
  end)

  it("keeps the single-shape fields at the top level and in a one-element shapes array", function()
    if not has_dkjson then pending("dkjson (busted's dependency) not found") return end
    local out, rc = sh(base .. " --B 2 --T 24 --n 3 --no-save --json 2>/dev/null")
    assert.are.equal(0, rc, out)
    local r = decode(out)
    assert.are.equal(1, #r.shapes)
    assert.are.same({ 2, 24, 3 }, { r.B, r.T, r.n })
    assert.are.equal(r.shapes[1].fwd_ms, r.fwd_ms)
    assert.are.equal(r.shapes[1].fraction_of_sgemm, r.fraction_of_sgemm)
  end)

  it("prints the shapes table for one --shapes shape too, with the --with-saving columns", function()
    -- (the per-pass table of a bare --B/--T/--n run has no saving columns: a script that
    -- filtered for the shapes table got nothing from a one-shape --shapes run)
    for _, args in ipairs({ " --shapes 1x32x2 --with-saving", " --B 1 --T 32 --n 2 --with-saving" }) do
      local out, rc = sh(base .. args .. " --no-save 2>&1")
      assert.are.equal(0, rc, out)
      assert.truthy(out:find("\n# BxTxn +fwd_ms +fwdbwd_ms +Mtok/s +sv_fwd +sv_fwdbwd"), args .. ":\n" .. out)
      assert.truthy(out:find("\n  1x32x2 +[%d.]+ +[%d.]+ +[%d.]+ +[%d.]+ +[%d.]+"), args .. ":\n" .. out)
    end
    local out, rc = sh(base .. " --B 1 --T 32 --n 2 --no-save 2>&1")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("\n# pass +time_ms +GFLOP/s +of_sgemm"), out)
  end)

  it("refuses malformed --shapes with exit status 2", function()
    for _, bad in ipairs({ "4x4096", "4x4096x0", "4x4096x2,", "ax1x1", "1x2x3x4" }) do
      local out, rc = sh(base .. " --shapes " .. util.shell_quote(bad))
      assert.are.equal(2, rc, bad .. ": " .. out)
      assert.truthy(out:find("--shapes: expected comma-separated BxTxn", 1, true), out)
    end
  end)

  it("--against-fla names every missing piece before timing anything", function()
    local out, rc = sh(base .. " --against-fla --fla-path " .. util.shell_quote(tmp .. "/nofla") ..
                       " --python /nonexistent/python3")
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("need a CUDA GPU; got --device cpu", 1, true), out)
    assert.truthy(out:find("compares at bf16", 1, true), out)
    assert.truthy(out:find("no fla source at " .. tmp .. "/nofla", 1, true), out)
    assert.truthy(out:find("/nonexistent/python3 not found", 1, true), out)
    assert.falsy(out:find("fwd+bwd", 1, true), out) -- nothing was timed
  end)

  it("--against-fla reports a failing check of the fla setup", function()
    local out, rc = sh("STUB_CHECK='cannot import torch: No module named torch' " .. base ..
                       " --dtype bf16 --against-fla --fla-cmd " .. util.shell_quote("luajit " .. stub))
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("--against-fla: cannot import torch: No module named torch", 1, true), out)
  end)

  it("--against-fla parses fla's JSON and computes speedups and figures per shape", function()
    if not has_dkjson then pending("dkjson (busted's dependency) not found") return end
    local out, rc = sh("STUB_PYTHONPATH=" .. util.shell_quote(tmp) .. " " .. base ..
                       " --dtype bf16 --shapes 1x32x1,2x16x2 --against-fla --no-final-state --json " ..
                       "--fla-path " .. util.shell_quote(tmp) .. " --fla-cmd " .. util.shell_quote("luajit " .. stub) ..
                       " 2>/dev/null")
    assert.are.equal(0, rc, out)
    local r = decode(out)
    assert.are.equal("ok", r.status, r.error)
    assert.are.equal("fla", r.inputs) -- auto with --against-fla
    assert.are.equal('stub "fla" \u{e9}\u{1F600}', r.fla.tool)
    assert.are.equal("0.0-stub", r.fla.fla_version)
    assert.are.equal("unknown", r.fla.fla_commit)
    assert.are.equal("Stub GPU", r.fla.device)
    for i, s in ipairs(r.shapes) do
      local ms = s.B * s.T * s.n / 1000
      assert.are.equal(ms, s.fla_fwd_ms, "shape " .. i)
      assert.are.equal(3 * ms, s.fla_fwdbwd_ms)
      assert.near(ms / s.fwd_ms, s.speedup_fwd, 1e-12 * s.speedup_fwd)
      assert.near(3 * ms / s.fwdbwd_ms, s.speedup_fwdbwd, 1e-12 * s.speedup_fwdbwd)
      assert.near(s.B * s.T / (3 * ms / 1e3), s.fla_tokens_per_s, 1e-9 * s.fla_tokens_per_s)
      -- fla's queued (GPU-only) figures, against our times as measured
      assert.are.equal(ms / 2, s.fla_fwd_queued_ms)
      assert.are.equal(1.5 * ms, s.fla_fwdbwd_queued_ms)
      assert.are.equal(0.5, s.fla_fwdbwd_host_ms)
      assert.near(1.5 * ms / s.fwdbwd_ms, s.speedup_fwdbwd_queued, 1e-12 * s.speedup_fwdbwd_queued)
      assert.is_nil(s.fla_queued_note)
    end
    -- the stub was given the shapes, H/K/V, the repeats and no --final-state (and fla's
    -- folder first on PYTHONPATH, which it checked)
    assert.truthy(r.fla.command:find("--shapes 1x32x1,2x16x2 --H 2 --K 16 --V 16 --reps 2 --warmup 5", 1, true),
                  r.fla.command)
    assert.falsy(r.fla.command:find("--final-state", 1, true), r.fla.command)
    assert.are.equal(tmp, r.fla.pythonpath)
  end)

  it("--with-saving times every shape plain and saving, with speedups for both", function()
    if not has_dkjson then pending("dkjson (busted's dependency) not found") return end
    local out, rc = sh(base .. " --dtype bf16 --shapes 1x32x1,2x16x2 --against-fla --with-saving --no-save --json " ..
                       "--fla-cmd " .. util.shell_quote("luajit " .. stub) .. " 2>/dev/null")
    assert.are.equal(0, rc, out)
    local r = decode(out)
    assert.are.equal("ok", r.status, r.error)
    assert.is_true(r.with_saving)
    for i, s in ipairs(r.shapes) do
      local ms = s.B * s.T * s.n / 1000
      assert.truthy(s.fwd_ms > 0 and s.saving_fwd_ms > 0 and s.saving_fwdbwd_ms > 0, "shape " .. i)
      assert.near(3 * ms / s.saving_fwdbwd_ms, s.saving_speedup_fwdbwd, 1e-12 * s.saving_speedup_fwdbwd)
      assert.near(ms / s.saving_fwd_ms, s.saving_speedup_fwd, 1e-12 * s.saving_speedup_fwd)
      assert.near(s.B * s.T / (s.saving_fwdbwd_ms / 1e3), s.saving_tokens_per_s, 1e-9 * s.saving_tokens_per_s)
      assert.near(1.5 * ms / s.saving_fwdbwd_ms, s.saving_speedup_fwdbwd_queued,
                  1e-12 * s.saving_speedup_fwdbwd_queued)
    end
    -- both ways at once is refused before anything is timed
    local out2, rc2 = sh(base .. " --with-saving --save-for-backward")
    assert.are.equal(2, rc2, out2)
    assert.truthy(out2:find("--with-saving times the plain path and the saving path", 1, true), out2)
  end)

  it("--against-fla keeps fla's eager times and says why when its queued timing is missing", function()
    if not has_dkjson then pending("dkjson (busted's dependency) not found") return end
    local note = "host time 25.00 ms reaches the 20 ms spin"
    local cmd = "STUB_QNOTE=" .. util.shell_quote(note) .. " " .. base .. " --dtype bf16 --shapes 1x32x1 " ..
                "--against-fla --no-save --fla-cmd " .. util.shell_quote("luajit " .. stub)
    local out, rc = sh(cmd .. " --json 2>/dev/null")
    assert.are.equal(0, rc, out)
    local r = decode(out)
    assert.are.equal("ok", r.status, r.error)
    local s = r.shapes[1]
    assert.are.equal(3 * 32 / 1000, s.fla_fwdbwd_ms)
    assert.is_nil(s.fla_fwdbwd_queued_ms)
    assert.is_nil(s.speedup_fwdbwd_queued)
    assert.are.equal(note, s.fla_queued_note)
    -- the table says it too, and has no queued columns
    local table_out, rc2 = sh(cmd .. " 2>&1")
    assert.are.equal(0, rc2, table_out)
    assert.truthy(table_out:find("# fla 1x32x1: queued timing: " .. note, 1, true), table_out)
    assert.falsy(table_out:find("fla_q_fb", 1, true), table_out)
  end)

  it("--against-fla records a shape fla left out, and fla failures, as errors (exit status 1)", function()
    if not has_dkjson then pending("dkjson (busted's dependency) not found") return end
    local out, rc = sh("STUB_DROP=2x16x2 " .. base .. " --dtype bf16 --shapes 1x32x1,2x16x2 --against-fla --json " ..
                       "--no-save --fla-cmd " .. util.shell_quote("luajit " .. stub) .. " 2>/dev/null")
    assert.are.equal(1, rc, out)
    local r = decode(out)
    assert.are.equal("error", r.status)
    assert.truthy(r.shapes[1].speedup_fwd > 0)
    assert.truthy(r.shapes[2].fla_error:find("no times for 2x16x2", 1, true), r.shapes[2].fla_error)
    assert.truthy(r.shapes[2].fwd_ms > 0) -- ours is still reported

    local failing = "sh -c 'test \"$1\" = --check && echo ok && exit 0; echo boom >&2; exit 3' stub"
    out, rc = sh(base .. " --dtype bf16 --against-fla --json --no-save --fla-cmd " .. util.shell_quote(failing) ..
                 " 2>/dev/null")
    assert.are.equal(1, rc, out)
    r = decode(out)
    assert.truthy(r.fla.error:find("exit status 3", 1, true), r.fla.error)
    assert.truthy(r.fwd_ms > 0)

    local garbled = "sh -c 'test \"$1\" = --check && echo ok && exit 0; echo \"{\\\"rows\\\": [1,}\"' stub"
    out, rc = sh(base .. " --dtype bf16 --against-fla --json --no-save --fla-cmd " .. util.shell_quote(garbled) ..
                 " 2>/dev/null")
    assert.are.equal(1, rc, out)
    r = decode(out)
    assert.truthy(r.fla.error:find("not JSON: unexpected character at byte 13", 1, true), r.fla.error)
  end)
end)
