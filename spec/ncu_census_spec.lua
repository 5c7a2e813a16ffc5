-- tools/ncu_census.py (the kernel census of gpu_run.sh census) on a CSV written here in
-- ncu's --csv form: the profiled program's own lines mixed in, time units from ns to
-- ms, a thousands separator, another metric's rows; totals and order checked against
-- numbers known here.  No GPU: runs everywhere.
local sh = gdp_test.sh

local HEADER = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",' ..
  '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'

local function row(id, kernel, metric, unit, value)
  return string.format('"%d","7","luajit","h","%s","1","13","(128, 1, 1)","(64, 1, 1)","0","9.0",' ..
                       '"Command line profiler metrics","%s","%s","%s"', id, kernel, metric, unit, value)
end

describe("tools/ncu_census.py", function()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute("mkdir -p " .. dir)
  local csv = dir .. "/ncu.csv"
  local tool = "python3 tools/ncu_census.py"

  it("sums each kernel's launches, largest first, per step", function()
    local f = assert(io.open(csv, "w"))
    f:write("==PROF== Connected to process 7\n", "state_tracking_speed: run ok\n", HEADER, "\n",
            row(0, "void k_small<1>(int)", "gpu__time_duration.sum", "usecond", "250"), "\n",
            row(1, "gemm", "gpu__time_duration.sum", "msecond", "2.5"), "\n",
            row(2, "void k_small<1>(int)", "gpu__time_duration.sum", "nsecond", "1,250,000"), "\n",
            row(3, "gemm", "dram__bytes.sum", "byte", "999999"), "\n",
            "# task n_h step_ms\n")
    f:close()
    local out, rc = sh(tool .. " " .. csv .. " --per 2")
    assert.are.equal(0, rc, out)
    -- gemm 2.5 ms over 1 launch; k_small 0.25 + 1.25 = 1.5 ms over 2; 4 ms in all
    assert.truthy(out:find("total 4.000 ms over 3 launches, 2.000 ms per step %(2 steps%)"), out)
    local a = out:find("1%.250%s+1%s+gemm\n")
    local b = out:find("0%.750%s+2%s+void k_small<1>%(int%)\n")
    assert.truthy(a and b and a < b, out)
  end)

  it("bad input: no ncu header, a step count below 1, an unknown unit", function()
    local f = assert(io.open(csv, "w"))
    f:write("just the program's output\n")
    f:close()
    local out, rc = sh(tool .. " " .. csv)
    assert.are_not.equal(0, rc)
    assert.truthy(out:find("no ncu CSV header"), out)
    out, rc = sh(tool .. " " .. csv .. " --per 0")
    assert.are_not.equal(0, rc)
    assert.truthy(out:find("%-%-per: expected a positive number of steps, got 0"), out)
    f = assert(io.open(csv, "w"))
    f:write(HEADER, "\n", row(0, "k", "gpu__time_duration.sum", "cycle", "5"), "\n")
    f:close()
    out, rc = sh(tool .. " " .. csv)
    assert.are_not.equal(0, rc)
    assert.truthy(out:find("unknown time unit 'cycle'"), out)
  end)

  teardown(function() os.execute("rm -rf " .. dir) end)
end)
