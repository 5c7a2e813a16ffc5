-- The interactive REPL survives errors: a script of lines that fail (Lua-side
-- checks, C errors, a freed tensor) followed by a good line, piped into `luajit -i`
-- with gdp loaded, must print each error and then the good line's result.
local H = gdp_test

local function run_repl(lines)
  local script = os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
  -- the same package path as this busted run, so the REPL finds the same gdp
  local cmd = string.format("LUA_PATH=%q luajit -i -e 'gdp = require(\"gdp\")' < %s 2>&1",
                            package.path, script)
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
end)
