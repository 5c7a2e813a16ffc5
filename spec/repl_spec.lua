-- The interactive REPL of `./gdp` (no arguments, lua/gdp/repl.lua), driven by a
-- scripted stdin through the launcher itself: it prints an expression's value, survives
-- errors (Lua-side checks, C errors, a freed tensor) and keeps going.
local H = gdp_test

local root = os.getenv("GDP_ROOT") or "."
-- the launcher must use this run's build (not build a default one): GDP_LIB's folder,
-- configured as it is (a CPU-only build stays one)
local build = (os.getenv("GDP_LIB") or ""):match("^(.*)/[^/]+$")
local env = build and string.format("GDP_BUILD_DIR=%q ", build) or ""
do
  local f = build and io.open(build .. "/CMakeCache.txt", "r")
  if f then
    if f:read("*a"):find("GDP_CUDA:BOOL=OFF", 1, true) then env = env .. "GDP_NO_CUDA=1 " end
    f:close()
  end
end

local function run_repl(lines)
  local script = os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
  local cmd = string.format("%stimeout 120 %s/gdp < %s 2>&1", env, root, script)
  local p = assert(io.popen(cmd))
  local out = p:read("*a")
  p:close()
  os.remove(script)
  return out
end

describe("REPL", function()
  it("reports errors and keeps going", function()
    local out = run_repl({
      "t = gdp.zeros(2, 3)",
      "u = t:view(4)",                                     -- C error: GDP_ERR_SHAPE
      "t:narrow(1, 3, 1)",                                 -- Lua-side check
      "gdp.ops.chunk_gated_delta_product{q = t}",          -- missing arguments
      "x = gdp.load('/nonexistent.safetensors')",          -- GDP_ERR_IO
      "t:free(); t:numel()",                               -- freed handle
      "print('ALIVE', gdp.tensor({1, 2, 3}):sum())",
      "print(gdp.tensor({{1, 2}, {3, 4}}))",
    })
    assert.truthy(out:find("gdp.view: GDP_ERR_SHAPE", 1, true), out)
    assert.truthy(out:find("gdp.narrow:", 1, true), out)
    assert.truthy(out:find("k: expected a gdp tensor, got nil", 1, true), out)
    assert.truthy(out:find("gdp.load: GDP_ERR_IO", 1, true), out)
    assert.truthy(out:find("freed", 1, true), out)
    assert.truthy(out:find("ALIVE\t6", 1, true), out)
    assert.truthy(out:find("gdp.Tensor<f32, cpu>[2x2]", 1, true), out)
    assert.is_nil(out:find("error object is not a string", 1, true), out)
  end)

  it("prints the value of an expression typed alone, and runs statements", function()
    local out = run_repl({
      "x = gdp.tensor({7, 8, 9})",
      "x",
      "1 + 2",
      "'a', nil, 4",
      "=10 * 10",
      "for i = 1, 2 do",
      "  io.write('loop', i, ' ')",
      "end",
      "local y = 5",
      "error('boom')",
      "print('END')",
    })
    assert.truthy(out:find("gdp.Tensor<f32, cpu>[3]", 1, true), out)
    assert.truthy(out:find("> 3\n", 1, true), out)
    assert.truthy(out:find("a\tnil\t4", 1, true), out)
    assert.truthy(out:find("> 100\n", 1, true), out)
    assert.truthy(out:find("loop1 loop2", 1, true), out)
    assert.truthy(out:find("stdin:1: boom", 1, true), out)
    assert.truthy(out:find("END", 1, true), out)
    assert.is_nil(out:find("syntax error", 1, true), out)
    assert.is_nil(out:find("unexpected symbol", 1, true), out)
  end)

  -- Real SIGINTs, sent by a child the session itself starts (its pid from getpid), while
  -- stdin is held open by a writer that waits for the session's marks (files) before
  -- each next step.
  it("Ctrl-C stops a long op and, at the prompt, drops the line; the state stays", function()
    local script, mark = os.tmpname(), os.tmpname()
    os.remove(mark)
    local f = assert(io.open(script, "w"))
    f:write(string.format([=[
wait_for() { for _ in $(seq 600); do [ -e "$1" ] && return; sleep 0.1; done; }
{
  echo 'ffi = require("ffi"); ffi.cdef("int getpid(void);"); pid = ffi.C.getpid(); x = 42; mark = "%s"'
  echo 'a = gdp.ops.random_inputs{T = 300000, K = 64, V = 64, H = 2, n = 2, dtype = "f64"}; a.algorithm = "recurrent"; gdp.device("cpu"):set_num_threads(1)'
  echo 'os.execute("(sleep 0.5; kill -INT " .. pid .. ") &"); t0 = gdp.time(); o = gdp.ops.chunk_gated_delta_product(a)'
  echo 'print("OP", o, gdp.time() - t0); io.open(mark .. "1", "w"):close()'
  wait_for "%s1"
  echo 'os.execute("(sleep 0.5; kill -INT " .. pid .. ") &"); io.open(mark .. "2", "w"):close()'
  wait_for "%s2"
  sleep 2
  echo 'print("AFTER", x)'
}
]=], mark, mark, mark))
    f:close()
    local p = assert(io.popen(string.format("bash %s | %stimeout 120 %s/gdp 2>&1", script, env, root)))
    local out = p:read("*a")
    p:close()
    os.remove(script)
    os.remove(mark .. "1")
    os.remove(mark .. "2")
    assert.truthy(out:find("GDP_ERR_INTERRUPTED: ", 1, true), out)
    -- the kernel itself saw the flag (it stopped inside its token loop, not after it);
    -- the time is only a loose bound (the signal's sender starts late on a busy machine)
    assert.truthy(out:find("forward_recurrent_f64: interrupted", 1, true), out)
    local elapsed = tonumber(out:match("OP\tnil\t([%d.e+-]+)"))
    assert.truthy(elapsed and elapsed < 10, out)
    assert.truthy(out:find("> \n> AFTER\t42", 1, true), out) -- a fresh prompt, then the old state
  end)
end)
