-- gdp.util: helpers for experiment scripts: command-line options from a config
-- table, JSON encoding, aligned console tables, simple statistics.
--
-- Does not load libgdp, so it works before the library is built.  Also the one place
-- of the Lua API's argument errors (argerror, int_arg), which every module uses.
local M = {}

------------------------------------------------------------------------------- arguments

-- Frames of functions defined in this package (lua/gdp/**.lua) are skipped when an
-- error is positioned, so that it points at the user's line however deeply the
-- failing call was nested inside gdp (t:float() -> t:to() -> check()).
local this_source = debug.getinfo(1, "S").source
local package_prefix = this_source:match("^(@.*[/\\])util%.lua$") or "@lua/gdp/"

local function is_internal(info)
  return info.what == "C" or info.what == "tail"
      or info.source:sub(1, #package_prefix) == package_prefix
end

-- Level (for error()/debug.getinfo, counted from the function that calls this one's
-- caller) of the first stack frame outside gdp.
local function user_level()
  local level = 3
  while true do
    local info = debug.getinfo(level, "S")
    if not info then return 3 end
    if not is_internal(info) then return level - 1 end
    level = level + 1
  end
end

-- "file:line" of the first stack frame outside gdp ("?" when there is none).
function M.user_where()
  local level = 3
  while true do
    local info = debug.getinfo(level, "Sl")
    if not info then return "?" end
    if not is_internal(info) then
      return info.short_src .. ":" .. (info.currentline or 0)
    end
    level = level + 1
  end
end

-- Raises "gdp.<fn>: <msg>" at the user's line (error(msg, 2) in spirit, but robust to
-- calls nested inside gdp).
function M.argerror(fn, msg)
  error("gdp." .. fn .. ": " .. msg, user_level())
end

-- A value as an argument message shows it: the string "2" (not 2), 2^63 in full
-- (not 9.2233720368548e+18), inf, nan, or the type of anything else.
function M.describe(x)
  if type(x) == "string" then return string.format("the string %q", x) end
  if type(x) == "number" then
    if x ~= x then return "nan" end
    if x == math.huge then return "inf" end
    if x == -math.huge then return "-inf" end
    if x == math.floor(x) then return string.format("%.0f", x) end
    return tostring(x)
  end
  if type(x) == "cdata" then return tostring(require("ffi").typeof(x)) end
  return type(x)
end

-- The ranges of the C types integer arguments end up in.
M.INT_MAX = 2 ^ 31 - 1
M.INT_MIN = -2 ^ 31
M.INT64_MAX = 2 ^ 63 - 1 -- as a double this is 2^63, so the check is v < 2^63
M.INT64_MIN = -2 ^ 63

-- The one checker of integer arguments: v must be a number (the string "2" is an
-- error, not 2), finite, integral and in [min, max] (defaults: C's int64_t range), so
-- that nothing reaches C as INT64_MIN or wraps.  `name` says which argument, 1-based
-- ("size of dim 1"); the message reads
--   gdp.<fn>: <name> must be an integer >= 0, got inf
-- Returns v.
function M.int_arg(fn, name, v, min, max)
  min = min or M.INT64_MIN
  max = max or M.INT64_MAX
  if type(v) == "number" and v == math.floor(v) and v >= min and v <= max and
     v < 2 ^ 63 then
    return v
  end
  local range
  if max >= M.INT64_MAX and min <= M.INT64_MIN then range = "an integer"
  elseif max >= M.INT64_MAX then range = "an integer >= " .. M.describe(min)
  elseif min <= M.INT64_MIN then range = "an integer <= " .. M.describe(max)
  else range = string.format("an integer in [%s, %s]", M.describe(min), M.describe(max)) end
  M.argerror(fn, string.format("%s must be %s, got %s", name, range, M.describe(v)))
end

-- Whether x is a number int_arg accepts with its default range.
function M.is_int(x)
  return type(x) == "number" and x == math.floor(x) and x >= M.INT64_MIN and x < 2 ^ 63
end

-- int_arg for an optional argument: nil stays nil.
function M.int_opt(fn, name, v, min, max)
  if v == nil then return nil end
  return M.int_arg(fn, name, v, min, max)
end

-- Option `key` of a config table: cfg[key], or `default` when absent, checked by
-- int_arg (absent with no default is an error naming it).
function M.int_option(fn, cfg, key, default, min, max)
  local v = cfg[key]
  if v == nil then v = default end
  return M.int_arg(fn, key, v, min, max)
end

-- The same for a finite number >= min.
function M.num_option(fn, cfg, key, default, min)
  local v = cfg[key]
  if v == nil then v = default end
  if type(v) ~= "number" or not (v >= min) or v == math.huge then
    M.argerror(fn, string.format("%s: expected a finite number >= %g, got %s", key, min, tostring(v)))
  end
  return v
end

------------------------------------------------------------------------------- options

-- Parses `--key value`, `--key=value`, `--flag`, `--no-flag` and positional arguments
-- against a config table whose values give the defaults and the types:
--
--   local config = {device = "cpu", B = 1, json = false}
--   local opts, files = util.parse_args(arg, config, {
--     usage = "luajit experiments/x.lua [options] FILE...",
--     help = {{"device", "cpu or cuda"}, {"B", "batch size"}, {"json", "print JSON"}},
--     choices = {device = {"cpu", "cuda"}},
--     aliases = {["against-fla"] = "against_fla"},
--   })
--
-- Returns a new table (config overridden by the command line) and the positional
-- arguments.  Option names may use '-' for '_'.  --help prints the usage and exits 0;
-- a bad option prints the problem and the usage to stderr and exits 2.
function M.parse_args(argv, config, spec)
  spec = spec or {}
  local opts, positional = {}, {}
  for k, v in pairs(config) do opts[k] = v end

  local function usage()
    local lines = { "usage: " .. (spec.usage or "luajit script.lua [options]") }
    if spec.description then lines[#lines + 1] = spec.description end
    lines[#lines + 1] = "options:"
    local listed = {}
    local function line(key, help)
      listed[key] = true
      local default = config[key]
      local kind = type(default) == "boolean" and "" or (" " .. type(default):upper())
      local choices = spec.choices and spec.choices[key]
      local flag = (type(default) == "boolean" and "[no-]" or "") .. key:gsub("_", "-")
      lines[#lines + 1] = string.format("  --%-18s %s%s (default: %s)", flag .. kind,
        help or "", choices and (" [" .. table.concat(choices, "|") .. "]") or "", tostring(default))
    end
    for _, h in ipairs(spec.help or {}) do line(h[1], h[2]) end
    local rest = {}
    for k in pairs(config) do if not listed[k] then rest[#rest + 1] = k end end
    table.sort(rest)
    for _, k in ipairs(rest) do line(k) end
    lines[#lines + 1] = "  --help               this text"
    return table.concat(lines, "\n")
  end

  local function fail(msg)
    io.stderr:write("error: ", msg, "\n", usage(), "\n")
    os.exit(2)
  end

  local function resolve(name)
    if spec.aliases and spec.aliases[name] then return spec.aliases[name] end
    local key = name:gsub("-", "_")
    if config[key] ~= nil then return key end
    return nil
  end

  local function convert(key, raw)
    local default = config[key]
    local ty = type(default)
    local v
    if ty == "number" then
      v = tonumber(raw)
      if v == nil then fail(string.format("--%s: expected a number, got '%s'", key, raw)) end
    elseif ty == "boolean" then
      if raw == "true" or raw == "1" or raw == "yes" then v = true
      elseif raw == "false" or raw == "0" or raw == "no" then v = false
      else fail(string.format("--%s: expected true or false, got '%s'", key, raw)) end
    else
      v = raw
    end
    local choices = spec.choices and spec.choices[key]
    if choices then
      local ok = false
      for _, c in ipairs(choices) do ok = ok or c == v end
      if not ok then
        fail(string.format("--%s: expected one of %s, got '%s'", key, table.concat(choices, ", "), raw))
      end
    end
    return v
  end

  local i = 1
  local only_positional = false
  while i <= #argv do
    local a = argv[i]
    if only_positional or a:sub(1, 2) ~= "--" then
      positional[#positional + 1] = a
    elseif a == "--" then
      only_positional = true
    elseif a == "--help" or a == "-h" then
      print(usage())
      os.exit(0)
    else
      local name, value = a:match("^%-%-([^=]+)=(.*)$")
      name = name or a:sub(3)
      local key = resolve(name)
      if key == nil and name:sub(1, 3) == "no-" and value == nil then
        key = resolve(name:sub(4))
        if key and type(config[key]) == "boolean" then
          opts[key] = false
          key = false
        else
          key = nil
        end
      end
      if key == nil then fail("unknown option --" .. name) end
      if key then
        if value == nil and type(config[key]) == "boolean" then
          opts[key] = true
        else
          if value == nil then
            i = i + 1
            value = argv[i]
            if value == nil then fail("--" .. name .. ": missing value") end
          end
          opts[key] = convert(key, value)
        end
      end
    end
    i = i + 1
  end
  return opts, positional
end

------------------------------------------------------------------------------- JSON

-- Marks a table to be encoded as a JSON array even when empty.
local array_mt = { __jsontype = "array" }
function M.json_array(t) return setmetatable(t or {}, array_mt) end

local escapes = {
  ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
  ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
}
local function json_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return escapes[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

-- Shortest decimal text that reads back as the same double.
local function number_text(x)
  if x ~= x or x == math.huge or x == -math.huge then return nil end
  if x == math.floor(x) and math.abs(x) < 2 ^ 53 then return string.format("%d", x) end
  for _, f in ipairs({ "%.15g", "%.16g", "%.17g" }) do
    local s = string.format(f, x)
    if tonumber(s) == x then return s end
  end
end
M.number_text = number_text

local function is_array(t)
  if getmetatable(t) == array_mt then return true end
  local n = #t
  if n == 0 then return false end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end

-- Encodes nil/booleans/numbers/strings/tables (keys sorted; NaN and infinities become
-- null, as JSON has no spelling for them).  indent: nil for one line, or a number.
function M.json_encode(value, indent)
  local out = {}
  local function enc(v, depth)
    local ty = type(v)
    if v == nil then out[#out + 1] = "null"
    elseif ty == "boolean" then out[#out + 1] = tostring(v)
    elseif ty == "number" then out[#out + 1] = number_text(v) or "null"
    elseif ty == "string" then out[#out + 1] = json_string(v)
    elseif ty == "cdata" then
      local n = tonumber(v)
      out[#out + 1] = n and (number_text(n) or "null") or json_string(tostring(v))
    elseif ty == "table" then
      local nl, pad, pad_in = "", "", ""
      if indent then
        nl = "\n"
        pad = string.rep(" ", indent * depth)
        pad_in = string.rep(" ", indent * (depth + 1))
      end
      if is_array(v) then
        if #v == 0 then out[#out + 1] = "[]" return end
        out[#out + 1] = "[" .. nl
        for i = 1, #v do
          out[#out + 1] = pad_in
          enc(v[i], depth + 1)
          out[#out + 1] = (i < #v and "," or "") .. nl
        end
        out[#out + 1] = pad .. "]"
      else
        local keys = {}
        for k in pairs(v) do keys[#keys + 1] = tostring(k) end
        table.sort(keys)
        if #keys == 0 then out[#out + 1] = "{}" return end
        out[#out + 1] = "{" .. nl
        for i, k in ipairs(keys) do
          local val = v[k]
          if val == nil then val = v[tonumber(k)] end
          out[#out + 1] = pad_in .. json_string(k) .. (indent and ": " or ":")
          enc(val, depth + 1)
          out[#out + 1] = (i < #keys and "," or "") .. nl
        end
        out[#out + 1] = pad .. "}"
      end
    else
      error("util.json_encode: cannot encode a " .. ty, 2)
    end
  end
  enc(value, 0)
  return table.concat(out)
end

------------------------------------------------------------------------------- tables

-- Formats rows (arrays of values) under a header as an aligned text table whose
-- header line starts with '#', so that gnuplot and awk skip it.  Numbers are printed
-- with `numfmt` (default "%.3g").
function M.format_table(header, rows, numfmt)
  numfmt = numfmt or "%.3g"
  local cells = {}
  local widths = {}
  local function cell(v)
    if type(v) == "number" then
      if v ~= v then return "nan" end
      if v == math.floor(v) and math.abs(v) < 1e15 then return string.format("%d", v) end
      return string.format(numfmt, v)
    end
    return tostring(v == nil and "" or v)
  end
  local all = { header }
  for _, r in ipairs(rows) do all[#all + 1] = r end
  for ri, r in ipairs(all) do
    cells[ri] = {}
    for ci = 1, #header do
      local s = cell(r[ci])
      if ci == 1 then s = (ri == 1 and "# " or "  ") .. s end
      cells[ri][ci] = s
      widths[ci] = math.max(widths[ci] or 0, #s)
    end
  end
  local lines = {}
  for ri, r in ipairs(cells) do
    local parts = {}
    for ci, s in ipairs(r) do
      -- padded by hand: a "%-Ns" format breaks for widths over 99
      parts[ci] = s .. string.rep(" ", widths[ci] - #s)
    end
    lines[ri] = (table.concat(parts, "  "):gsub("%s+$", ""))
  end
  return table.concat(lines, "\n")
end

------------------------------------------------------------------------------- statistics

function M.median(xs)
  local s = {}
  for i, x in ipairs(xs) do s[i] = x end
  table.sort(s)
  local n = #s
  if n == 0 then return nil end
  if n % 2 == 1 then return s[(n + 1) / 2] end
  return 0.5 * (s[n / 2] + s[n / 2 + 1])
end

-- The spread of a sample: {n =, min =, p10 =, median =, p90 =, max =} (percentiles by
-- the nearest rank), or {n = 0} for an empty one.  Timings record it beside medians.
function M.spread(xs)
  local s = {}
  for i, x in ipairs(xs) do s[i] = x end
  table.sort(s)
  local n = #s
  if n == 0 then return { n = 0 } end
  local function rank(p) return s[math.max(1, math.ceil(p * n))] end
  return { n = n, min = s[1], p10 = rank(0.1), median = M.median(s), p90 = rank(0.9), max = s[n] }
end

-- The spread's fields in a row: <prefix>_min, _p10, _p90, _max, each times `scale`.
function M.spread_fields(into, prefix, xs, scale)
  local sp = M.spread(xs)
  scale = scale or 1
  for _, k in ipairs({ "min", "p10", "p90", "max" }) do
    into[prefix .. "_" .. k] = sp[k] and sp[k] * scale or nil
  end
  return into
end

function M.min(xs)
  local m = math.huge
  for _, x in ipairs(xs) do if x < m then m = x end end
  return m
end

function M.mean(xs)
  local s = 0
  for _, x in ipairs(xs) do s = s + x end
  return s / #xs
end

-- FNV-1a hash of a string, as a number in [0, 2^31): seeds derived from configs.
function M.hash(s)
  local two32 = 4294967296
  local h = 2166136261
  for i = 1, #s do
    h = bit.bxor(h, s:byte(i)) % two32
    -- h * 16777619 mod 2^32 without leaving doubles' exact range: prime = 2^24 + 403
    h = ((h * 403) % two32 + bit.lshift(h, 24) % two32) % two32
  end
  return h % 2147483648
end

-- Reads a shell command's output (trailing newline removed), or nil on failure.
function M.capture(cmd)
  local p = io.popen(cmd .. " 2>/dev/null")
  if not p then return nil end
  local out = p:read("*a")
  local ok = p:close()
  if not out or out == "" then return nil end
  return (out:gsub("%s+$", "")), ok
end

function M.shell_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

-- The repository root of an experiment script (experiments/x.lua: its folder's parent),
-- absolute where the shell can resolve it; script is arg[0] (the launcher does not
-- change directory).
function M.repo_root(script)
  local root = (tostring(script):match("^(.*)/[^/]*$") or ".") .. "/.."
  return M.capture("cd " .. M.shell_quote(root) .. " && pwd") or root
end


-- util.json_decode(text) -> value: the inverse of json_encode, for JSON written by other
-- tools (tools/fla_bench.py).  null becomes nil; NaN, Infinity and -Infinity (Python's
-- json.dumps writes them) become numbers.  Errors name the byte and what was there.
local function utf8_char(cp)
  if cp < 0x80 then return string.char(cp) end
  if cp < 0x800 then return string.char(0xC0 + math.floor(cp / 0x40), 0x80 + cp % 0x40) end
  if cp < 0x10000 then
    return string.char(0xE0 + math.floor(cp / 0x1000), 0x80 + math.floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
  end
  return string.char(0xF0 + math.floor(cp / 0x40000), 0x80 + math.floor(cp / 0x1000) % 0x40,
                     0x80 + math.floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
end

local ESCAPES = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }
local LITERALS = { ["true"] = true, ["false"] = false, ["NaN"] = 0 / 0, ["Infinity"] = math.huge,
                   ["-Infinity"] = -math.huge }

function M.json_decode(text)
  local pos = 1
  local function fail(what)
    error(string.format("%s at byte %d (near '%s')", what, pos, text:sub(pos, pos + 24)), 0)
  end
  local function skip() pos = text:find("[^ \t\r\n]", pos) or #text + 1 end
  local value
  local function str()
    pos = pos + 1
    local parts = {}
    while true do
      local s = text:find('["\\%c]', pos)
      if not s then fail("unterminated string") end
      parts[#parts + 1] = text:sub(pos, s - 1)
      pos = s
      local c = text:sub(s, s)
      if c == '"' then pos = s + 1 return table.concat(parts) end
      if c ~= "\\" then fail("control character in a string") end
      local e = text:sub(s + 1, s + 1)
      if e == "u" then
        local hex = text:match("^%x%x%x%x", s + 2)
        if not hex then fail("bad \\u escape") end
        local cp = tonumber(hex, 16)
        pos = s + 6
        local lo = cp >= 0xD800 and cp <= 0xDBFF and text:match("^\\u(%x%x%x%x)", pos)
        lo = lo and tonumber(lo, 16)
        if lo and lo >= 0xDC00 and lo <= 0xDFFF then -- a surrogate pair: one code point
          cp = 0x10000 + (cp - 0xD800) * 0x400 + (lo - 0xDC00)
          pos = pos + 6
        end
        parts[#parts + 1] = utf8_char(cp)
      elseif ESCAPES[e] then
        parts[#parts + 1] = ESCAPES[e]
        pos = s + 2
      else
        fail("bad escape")
      end
    end
  end
  function value()
    skip()
    local c = text:sub(pos, pos)
    if c == "{" then
      local obj = {}
      pos = pos + 1
      skip()
      if text:sub(pos, pos) == "}" then pos = pos + 1 return obj end
      while true do
        skip()
        if text:sub(pos, pos) ~= '"' then fail("expected a string key") end
        local key = str()
        skip()
        if text:sub(pos, pos) ~= ":" then fail("expected ':'") end
        pos = pos + 1
        obj[key] = value()
        skip()
        c = text:sub(pos, pos)
        pos = pos + 1
        if c == "}" then return obj end
        if c ~= "," then pos = pos - 1 fail("expected ',' or '}'") end
      end
    elseif c == "[" then
      local arr, n = {}, 0
      pos = pos + 1
      skip()
      if text:sub(pos, pos) == "]" then pos = pos + 1 return arr end
      while true do
        n = n + 1
        arr[n] = value()
        skip()
        c = text:sub(pos, pos)
        pos = pos + 1
        if c == "]" then return arr end
        if c ~= "," then pos = pos - 1 fail("expected ',' or ']'") end
      end
    elseif c == '"' then
      return str()
    end
    local num = text:match("^-?%d[%d.eE+-]*", pos)
    if num then
      local v = tonumber(num)
      if not v then fail("bad number") end
      pos = pos + #num
      return v
    end
    for word, v in pairs(LITERALS) do
      if text:sub(pos, pos + #word - 1) == word then pos = pos + #word return v end
    end
    if text:sub(pos, pos + 3) == "null" then pos = pos + 4 return nil end
    fail(pos > #text and "unexpected end" or "unexpected character")
  end
  local v = value()
  skip()
  if pos <= #text then fail("text after the JSON value") end
  return v
end

-- The default context of `device` for an experiment script; when the device is not
-- there (no GPU, or a CPU-only build) one line on stderr, "<script>: device cuda is not
-- available: <the core's reason>", and exit status 2 (a usage error), nothing run.
function M.device_or_exit(script, device)
  local gdp = require("gdp")
  local ok, ctx = pcall(gdp.device, device)
  if ok then return ctx end
  -- the core's message without the Lua position and the C source location
  local why = tostring(ctx):gsub("^[^\n]-:%d+: ", ""):gsub(" %([%w_/.]+:%d+%)$", "")
  io.stderr:write(script, ": device ", tostring(device), " is not available: ", why, "\n")
  os.exit(2)
end

return M
