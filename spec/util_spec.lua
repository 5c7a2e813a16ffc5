-- gdp.util's JSON reader against its writer and against text other tools write.
local util = require("gdp.util")

describe("util.json_decode", function()
  it("reads back what json_encode writes", function()
    local value = { name = "gdp \"x\"\n\t/", n = -12.5e-3, list = { 1, 2, { a = true, b = false } },
                    empty = {}, big = 123456789012 }
    local back = util.json_decode(util.json_encode(value))
    assert.are.same(value.name, back.name)
    assert.are.equal(value.n, back.n)
    assert.are.same(value.list, back.list)
    assert.are.equal(value.big, back.big)
  end)

  it("takes Python's json.dumps extras: NaN, Infinity, null, \\u escapes with surrogate pairs", function()
    local v = util.json_decode('{"a": NaN, "b": -Infinity, "c": null, "d": "\\u00e9\\ud83d\\ude00", "e": [Infinity]}')
    assert.is_true(v.a ~= v.a)
    assert.are.equal(-math.huge, v.b)
    assert.is_nil(v.c)
    assert.are.equal("\195\169\240\159\152\128", v.d)
    assert.are.equal(math.huge, v.e[1])
  end)

  it("names the byte and the problem in malformed text", function()
    for text, what in pairs({ ['{"a" 1}'] = "expected ':'", ['[1, 2'] = "expected ',' or ']'", ['{"a": '] = "unexpected end",
                              ['"abc'] = "unterminated string", ['{"a": 1} x'] = "text after the JSON value",
                              ['"\\q"'] = "bad escape", ['[1,,2]'] = "unexpected character" }) do
      local ok, err = pcall(util.json_decode, text)
      assert.is_false(ok, text)
      assert.truthy(tostring(err):find(what, 1, true), text .. " -> " .. tostring(err))
      assert.truthy(tostring(err):find("at byte %d+"), tostring(err))
    end
  end)
end)
