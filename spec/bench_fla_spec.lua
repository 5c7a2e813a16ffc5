-- experiments/bench_gdp.lua --shapes and --against-fla, run as subprocesses on the cpu at
-- tiny shapes.  fla itself needs a GPU, so its side is a stub named by the documented
-- test hook --fla-cmd: a Lua script that answers --check and prints fla_bench.py-style
-- JSON (escapes, a surrogate pair, NaN, Infinity, null, noise before the object) with
-- times derived from the shape, so that the parsing, the matching by shape and the
-- ratios are checked against numbers known here.  No GPU tag: runs everywhere.
-- bench_gdp's JSON is read back with dkjson (busted's own dependency), a decoder
-- independent of the one inside bench_gdp.
local util = require("gdp.util")
local bench_shapes = require("gdp.bench_shapes")
local has_dkjson, dkjson = pcall(require, "dkjson")

local sh = gdp_test.sh

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

-- Malformed --shapes, each with the item the message must name (bench_gdp and
-- tools/fla_bench.py word it alike).
local BAD_SHAPES = {
  { "4x4096", "4x4096" }, { "4x4096x0", "4x4096x0" }, { "4x4096x2,", "" }, { "ax1x1", "ax1x1" },
  { "1x2x3x4", "1x2x3x4" }, { "04x1x1", "04x1x1" }, { "2x2x2,H16K128:4x4096x2", "H16K128:4x4096x2" },
  { "H0K8V8:1x1x1", "H0K8V8:1x1x1" }, { "h8k8v8:1x1x1", "h8k8v8:1x1x1" }, { "H8K8V8:", "H8K8V8:" },
  { "packed10mean0x2", "packed10mean0x2" }, { "packed0mean5x2", "packed0mean5x2" },
  { "packed10mean5", "packed10mean5" }, { "packed10x5x2", "packed10x5x2" }, { "H8K8V8:packed", "H8K8V8:packed" },
  { "1x32x2, 1x-3x2", " 1x-3x2" }, { "H99999999999999999K8V8:1x1x1", "H99999999999999999K8V8:1x1x1" },
  { "99999999999999999x1x1", "99999999999999999x1x1" },
}

-- The stub: parses its --shapes with gdp.bench_shapes (the stub stands for fla_bench.py,
-- not for the parser, which the tests below check against fla_bench.py's own) and answers
-- each shape at its own heads with fwd_ms = tokens * n * H * K * V / 512000 (tokens * n /
-- 1000 at H = 2, K = V = 16), fwdbwd_ms = 3 * that (as strings JSON must carry), a packed
-- shape with its lengths; STUB_CHECK replaces the --check answer, STUB_DROP leaves that
-- shape out, STUB_FAIL answers that shape with an error row (no times), STUB_SHIFT moves one unit of a packed shape's length from its first sequence
-- to its second (same total: other lengths), STUB_PYTHONPATH makes it fail (exit 4) unless
-- PYTHONPATH starts with it.  Queued (GPU-only) times are half the eager ones, host times
-- 0.25 / 0.5 ms; STUB_QNOTE makes the queued figures null with that note instead.
local STUB = [=[
local bench_shapes = require("gdp.bench_shapes")
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
local function num(name) return tonumber(args:match("%-%-" .. name .. " (%d+)")) end
local shapes = assert(bench_shapes.parse(args:match("%-%-shapes (%S+)"), { H = num("H"), K = num("K"), V = num("V") },
                                         num("seed")))
local rows = {}
for _, s in ipairs(shapes) do
  if s.label == os.getenv("STUB_FAIL") then
    rows[#rows + 1] = string.format('{"shape": "%s", "B": %d, "T": %d, "n": %d, "H": %d, "K": %d, "V": %d, ' ..
      '"error": "OutOfMemoryError: CUDA out of memory"}', s.label, s.B, s.T, s.n, s.H, s.K, s.V)
  elseif s.label ~= os.getenv("STUB_DROP") then
    local ms = s.tokens * s.n * s.H * s.K * s.V / 512000
    local qnote = os.getenv("STUB_QNOTE")
    local queued = qnote and string.format('"fwd_queued_ms": null, "fwdbwd_queued_ms": null, "fwd_host_ms": null, ' ..
      '"fwdbwd_host_ms": null, "queued_note": "%s"', qnote) or string.format('"fwd_queued_ms": %.17g, ' ..
      '"fwdbwd_queued_ms": %.17g, "fwd_host_ms": 0.25, "fwdbwd_host_ms": 0.5, "queued_note": null', ms / 2, 1.5 * ms)
    local packing = '"packed": false, "lengths": null'
    if s.packed then
      local lengths = { unpack(s.lengths) }
      if os.getenv("STUB_SHIFT") then lengths[1], lengths[2] = lengths[1] - 1, lengths[2] + 1 end
      packing = string.format('"packed": true, "seqs": %d, "mean_len": %d, "lengths": [%s]', s.seqs, s.mean_len,
                              table.concat(lengths, ", "))
    end
    rows[#rows + 1] = string.format('{"shape": "%s", "B": %d, "T": %d, "n": %d, "H": %d, "K": %d, "V": %d, %s, ' ..
      '"tokens": %d, "fwd_ms": %.17g, "fwd_min_ms": NaN, "fwdbwd_ms": %.17g, "fwdbwd_min_ms": Infinity, ' ..
      '"warmup_s": 1.5, "note": null, %s}', s.label, s.B, s.T, s.n, s.H, s.K, s.V, packing, s.tokens, ms, 3 * ms,
      queued)
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
      assert.truthy(out:find("\n# shape +heads +tokens +fwd_ms +fwdbwd_ms +Mtok/s +sv_fwd +sv_fwdbwd +path"),
                    args .. ":\n" .. out)
      assert.truthy(out:find("\n  1x32x2 +H2K16V16 +32 +[%d.]+ +[%d.]+ +[%d.]+ +[%d.]+ +[%d.]+ +chunked\n"),
                    args .. ":\n" .. out)
    end
    local out, rc = sh(base .. " --B 1 --T 32 --n 2 --no-save 2>&1")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("\n# pass +time_ms +GFLOP/s +of_sgemm"), out)
  end)

  it("refuses malformed --shapes with exit status 2, naming the item and the syntax", function()
    for _, case in ipairs(BAD_SHAPES) do
      local bad, item = case[1], case[2]
      local out, rc = sh(base .. " --shapes " .. util.shell_quote(bad))
      assert.are.equal(2, rc, bad .. ": " .. out)
      assert.truthy(out:find("--shapes: bad item '" .. item .. "' in '" .. bad .. "': expected comma-separated " ..
                             "items [H<h>K<k>V<v>:]<B>x<T>x<n> or [H<h>K<k>V<v>:]packed<N>mean<L>x<n>", 1, true), out)
    end
    -- the same shape twice (a prefix naming the common heads is no other shape)
    local out, rc = sh(base .. " --shapes 1x32x2,H2K16V16:1x32x2")
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("item 'H2K16V16:1x32x2' in '1x32x2,H2K16V16:1x32x2' is the shape of an earlier " ..
                           "item (1x32x2)", 1, true), out)
    -- --set: a known name, and not with --shapes
    out, rc = sh(base .. " --set issue21")
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("--set: expected one of issue22, got 'issue21'", 1, true), out)
    out, rc = sh(base .. " --set issue22 --shapes 1x32x2")
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("--set issue22 and --shapes both name the shapes: give one", 1, true), out)
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

  it("--against-fla gives fla each shape's heads and packing and matches its rows by them", function()
    if not has_dkjson then pending("dkjson (busted's dependency) not found") return end
    local items = "1x32x1,H4K8V16:2x16x2,packed6mean5x2,H1K8V8:packed3mean2x3"
    local cmd = base .. " --dtype bf16 --shapes " .. items .. " --seed 77 --against-fla --with-saving --no-save " ..
                "--fla-cmd " .. util.shell_quote("luajit " .. stub)
    local out, rc = sh(cmd .. " --json 2>/dev/null")
    assert.are.equal(0, rc, out)
    local r = decode(out)
    assert.are.equal("ok", r.status, r.error)
    -- fla got every item as written (its heads, its packing) and the lengths' seed
    assert.truthy(r.fla.command:find("--shapes " .. items .. " --H 2 --K 16 --V 16 ", 1, true), r.fla.command)
    assert.truthy(r.fla.command:find("--seed 77", 1, true), r.fla.command)
    assert.is_nil(r.H) -- no heads common to every shape at the top level: each row has its own
    local want = {
      { shape = "1x32x1", H = 2, K = 16, V = 16, n = 1, packed = false, B = 1, T = 32, seqs = 1 },
      { shape = "H4K8V16:2x16x2", H = 4, K = 8, V = 16, n = 2, packed = false, B = 2, T = 16, seqs = 2 },
      { shape = "packed6mean5x2", H = 2, K = 16, V = 16, n = 2, packed = true, B = 1, seqs = 6, mean_len = 5 },
      { shape = "H1K8V8:packed3mean2x3", H = 1, K = 8, V = 8, n = 3, packed = true, B = 1, seqs = 3, mean_len = 2 },
    }
    assert.are.equal(#want, #r.shapes)
    for i, w in ipairs(want) do
      local s = r.shapes[i]
      for k, v in pairs(w) do assert.are.equal(v, s[k], w.shape .. ": " .. k) end
      if w.packed then
        local sum, lo, hi = 0, math.huge, 0
        for _, len in ipairs(bench_shapes.packed_lengths(w.seqs, w.mean_len, 77)) do
          sum, lo, hi = sum + len, math.min(lo, len), math.max(hi, len)
        end
        assert.are.same({ sum, sum, lo, hi }, { s.T, s.tokens, s.len_min, s.len_max }, w.shape)
      else
        assert.are.equal(s.B * s.T, s.tokens)
        assert.is_nil(s.mean_len)
      end
      -- fla's row found by heads and packing: the stub's time for this very shape
      local ms = s.tokens * s.n * s.H * s.K * s.V / 512000
      assert.are.equal(ms, s.fla_fwd_ms, w.shape)
      assert.near(3 * ms / s.fwdbwd_ms, s.speedup_fwdbwd, 1e-12 * s.speedup_fwdbwd)
      assert.near(1.5 * ms / s.saving_fwdbwd_ms, s.saving_speedup_fwdbwd_queued, 1e-12 * s.saving_speedup_fwdbwd_queued)
      assert.are.equal(1.5, s.fla_warmup_s)
      -- the FLOP count at the shape's own heads, and the kernels the operator took
      assert.near(2 * s.K * s.V * (2 * s.n + 1) * s.tokens * s.H / (s.fwd_ms / 1e3) / 1e9, s.gflops_fwd,
                  1e-9 * s.gflops_fwd)
      assert.are.equal("chunked", s.path)
      assert.are.equal("chunked", s.saving_path)
    end
    -- the table: the item without its heads, the heads, the tokens, ..., the path
    local table_out, rc2 = sh(cmd .. " 2>&1")
    assert.are.equal(0, rc2, table_out)
    assert.truthy(table_out:find(", heads per shape,", 1, true), table_out)
    assert.truthy(table_out:find("\n# shape +heads +tokens +fwd_ms +fwdbwd_ms +Mtok/s +sv_fwd"), table_out)
    for i, w in ipairs(want) do
      local line = string.format("\n  %s +H%dK%dV%d +%d +[^\n]* chunked\n", (w.shape:gsub("^H%d+K%d+V%d+:", "")),
                                 w.H, w.K, w.V, r.shapes[i].tokens)
      assert.truthy(table_out:find(line), line .. " in\n" .. table_out)
    end
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

  it("--against-fla records a shape fla left out, failed at or packed otherwise, and fla failures, as errors " ..
     "(exit status 1)", function()
    if not has_dkjson then pending("dkjson (busted's dependency) not found") return end
    -- the stub's switch, the shapes, what the second shape's fla_error says
    for _, case in ipairs({
      { "STUB_DROP=2x16x2", "1x32x1,2x16x2", "fla_bench.py gave no times for 2x16x2" },
      { "STUB_FAIL=H1K8V8:2x16x2", "1x32x1,H1K8V8:2x16x2", "H1K8V8:2x16x2: OutOfMemoryError: CUDA out of memory" },
      { "STUB_SHIFT=1", "1x32x1,packed4mean6x2", "packed4mean6x2: fla's length 1 is " },
    }) do
      local out, rc = sh(case[1] .. " " .. base .. " --dtype bf16 --shapes " .. case[2] .. " --against-fla --json " ..
                         "--no-save --fla-cmd " .. util.shell_quote("luajit " .. stub) .. " 2>/dev/null")
      assert.are.equal(1, rc, out)
      local r = decode(out)
      assert.are.equal("error", r.status)
      assert.truthy(r.shapes[1].speedup_fwd > 0, case[1])
      assert.is_nil(r.shapes[2].fla_fwd_ms)
      assert.truthy(r.shapes[2].fwd_ms > 0) -- ours is still reported
      assert.truthy(r.shapes[2].fla_error:find(case[3], 1, true), r.shapes[2].fla_error)
      assert.truthy(r.error:find(case[3], 1, true), r.error)
    end

    local failing = "sh -c 'test \"$1\" = --check && echo ok && exit 0; echo boom >&2; exit 3' stub"
    local out, rc = sh(base .. " --dtype bf16 --against-fla --json --no-save --fla-cmd " .. util.shell_quote(failing) ..
                       " 2>/dev/null")
    assert.are.equal(1, rc, out)
    local r = decode(out)
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

describe("gdp.bench_shapes and tools/fla_bench.py's parser", function()
  local common = { H = 2, K = 16, V = 16 }

  it("draws packed lengths uniform on [1, 2L - 1], the same for the same seed", function()
    -- splitmix64 from seed 1234, 1 + x mod 399 (the values Python's packed_lengths gives)
    assert.are.same({ 275, 246, 227, 262, 268, 192, 206, 36, 115, 141 }, bench_shapes.packed_lengths(10, 200, 1234))
    assert.are.same(bench_shapes.packed_lengths(50, 7, 5), bench_shapes.packed_lengths(50, 7, 5))
    assert.are_not.same(bench_shapes.packed_lengths(50, 7, 5), bench_shapes.packed_lengths(50, 7, 6))
    assert.are.same({ 1, 1, 1 }, bench_shapes.packed_lengths(3, 1, 9)) -- mean 1: every length 1
    local lengths = bench_shapes.packed_lengths(20000, 200, 1234)
    local sum, lo, hi = 0, math.huge, 0
    for _, len in ipairs(lengths) do
      assert.are.equal(math.floor(len), len)
      sum, lo, hi = sum + len, math.min(lo, len), math.max(hi, len)
    end
    assert.are.same({ 1, 399 }, { lo, hi })
    assert.near(200, sum / #lengths, 2) -- the standard error of the mean is 0.8 here
    assert.has_error(function() bench_shapes.packed_lengths(3, 2, -1) end,
                     "bench_shapes.packed_lengths: seed: expected an integer in [0, 2^53], got -1")
  end)

  it("parses heads and packing; a packed shape is one row of its lengths' sum", function()
    local shapes = assert(bench_shapes.parse("3x5x1, H8K32V64:2x7x4,packed9mean4x2,H1K8V8:packed2mean3x3",
                                             common, 42))
    assert.are.same({ "3x5x1", "H8K32V64:2x7x4", "packed9mean4x2", "H1K8V8:packed2mean3x3" },
                    { shapes[1].label, shapes[2].label, shapes[3].label, shapes[4].label })
    assert.are.same({ 3, 5, 1, 2, 16, 16, false, 3, 15 }, { shapes[1].B, shapes[1].T, shapes[1].n, shapes[1].H,
                    shapes[1].K, shapes[1].V, shapes[1].packed, shapes[1].seqs, shapes[1].tokens })
    assert.are.same({ 8, 32, 64, 4, 14 }, { shapes[2].H, shapes[2].K, shapes[2].V, shapes[2].n, shapes[2].tokens })
    for _, i in ipairs({ 3, 4 }) do
      local s = shapes[i]
      assert.are.same(bench_shapes.packed_lengths(s.seqs, s.mean_len, 42), s.lengths)
      assert.are.equal(s.seqs + 1, #s.cu_seqlens)
      assert.are.equal(0, s.cu_seqlens[1])
      for j = 1, s.seqs do assert.are.equal(s.lengths[j], s.cu_seqlens[j + 1] - s.cu_seqlens[j]) end
      assert.are.same({ 1, s.cu_seqlens[s.seqs + 1], s.T }, { s.B, s.T, s.tokens })
    end
    assert.are.same({ 2, 3, 3, 1, 8 }, { shapes[4].seqs, shapes[4].mean_len, shapes[4].n, shapes[4].H, shapes[4].V })
    -- a prefix naming the common heads is written as no prefix
    assert.are.equal("4x8x2", bench_shapes.parse("H2K16V16:4x8x2", common, 1)[1].label)
    local none, err = bench_shapes.parse("1x2x2,packed3mean2x2", common, 1.5)
    assert.is_nil(none)
    assert.are.equal("--seed: the packed item 'packed3mean2x2' needs an integer seed in [0, 2^53], got 1.5", err)
  end)

  it("names issue 22's set", function()
    local shapes = assert(bench_shapes.parse(bench_shapes.SETS.issue22, common, 1234))
    local got = {}
    for i, s in ipairs(shapes) do got[i] = s.label end
    assert.are.same({ "H16K128V128:4x4096x1", "H16K128V128:4x4096x2", "H16K128V128:4x4096x3",
                      "H16K128V128:1x32768x2", "H16K128V128:1x65536x2", "H16K128V128:64x1024x3",
                      "H16K128V128:packed1000mean200x2", "H8K32V32:256x512x4", "H8K32V32:256x512x2",
                      "H8K256V256:2x4096x2", "H32K64V64:8x2048x2" }, got)
    local packed = shapes[7]
    assert.are.same({ 1000, 200, 2, 1 }, { packed.seqs, packed.mean_len, packed.n, packed.B })
    local sum = 0
    for _, len in ipairs(packed.lengths) do
      assert.truthy(len >= 1 and len <= 399, len)
      sum = sum + len
    end
    assert.are.equal(sum, packed.T)
  end)

  -- python3 runs fla_bench.py's parser without torch (--parse-only imports none)
  local has_python = select(2, sh("command -v python3 >/dev/null")) == 0

  it("tools/fla_bench.py --parse-only gives the same shapes and lengths", function()
    if not (has_python and has_dkjson) then pending("python3 or dkjson not found") return end
    local items = bench_shapes.SETS.issue22 .. ",3x5x1,H8K32V64:2x7x4,packed9mean4x2,H1K8V8:packed2mean3x3"
    for _, seed in ipairs({ 0, 42, 2 ^ 53 }) do
      local out, rc = sh(string.format("python3 tools/fla_bench.py --parse-only --H 2 --K 16 --V 16 --seed %d " ..
                                       "--shapes %s 2>&1", seed, util.shell_quote(items)))
      assert.are.equal(0, rc, out)
      local theirs = dkjson.decode(out)
      assert.are.equal("table", type(theirs), out)
      local ours = assert(bench_shapes.parse(items, common, seed))
      assert.are.equal(#ours, #theirs.rows)
      for i, s in ipairs(ours) do
        local t = theirs.rows[i]
        assert.are.same({ s.label, s.B, s.T, s.n, s.H, s.K, s.V, s.packed, s.seqs, s.tokens },
                        { t.shape, t.B, t.T, t.n, t.H, t.K, t.V, t.packed, t.seqs, t.tokens }, s.label)
        if s.packed then
          assert.are.equal(s.mean_len, t.mean_len)
          assert.are.same(s.lengths, t.lengths, s.label .. " at seed " .. seed)
        else
          assert.is_nil(t.lengths)
        end
      end
    end
  end)

  it("tools/fla_bench.py refuses the items bench_gdp refuses, in the same words", function()
    if not has_python then pending("python3 not found") return end
    -- parse_shapes on every bad item in one interpreter, one message a line
    local script = "import sys; sys.path.insert(0, 'tools'); import fla_bench\n" ..
                   "for text in sys.argv[1:]:\n" ..
                   "    try:\n        fla_bench.parse_shapes(text, 2, 16, 16, 1); print('accepted: ' + text)\n" ..
                   "    except ValueError as e:\n        print(e)\n"
    local argv = {}
    for i, case in ipairs(BAD_SHAPES) do argv[i] = util.shell_quote(case[1]) end
    local out, rc = sh("python3 -B -c " .. util.shell_quote(script) .. " " .. table.concat(argv, " "))
    assert.are.equal(0, rc, out)
    local lines = {}
    for line in out:gmatch("[^\n]+") do lines[#lines + 1] = line end
    assert.are.equal(#BAD_SHAPES, #lines, out)
    for i, case in ipairs(BAD_SHAPES) do
      local bad, item = case[1], case[2]
      assert.are.equal("--shapes: bad item '" .. item .. "' in '" .. bad .. "': expected comma-separated items " ..
                       bench_shapes.SYNTAX, lines[i])
    end
    -- on the command line: exit status 2 (argparse's) with the message
    out, rc = sh("python3 tools/fla_bench.py --parse-only --H 2 --K 16 --V 16 --shapes 1x32x2,H2K16V16:1x32x2")
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("item 'H2K16V16:1x32x2' in '1x32x2,H2K16V16:1x32x2' is the shape of an earlier " ..
                           "item (1x32x2)", 1, true), out)
  end)
end)
