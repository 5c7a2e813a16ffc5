-- gdp.sweep: parameter sweeps for experiments.
--
--   local sweep = gdp.sweep                      -- or require("gdp.sweep")
--   local configs = sweep.grid{n = {1, 2, 3}, chunk_size = {32, 64}, dtype = "f32"}
--   -- 6 configs; axes sorted by name (or in opts.order), the last one varying fastest
--
--   local run = gdp.results.new_run("my_study", {config = opts, args = arg})
--   local rows, summary = sweep.run{
--     study = "my_study",     -- the progress title (default: the run's study)
--     axes = {n = {1, 2, 3}, chunk_size = {32, 64}},   -- or configs = {{...}, {...}}
--     order = {"chunk_size", "n"},                      -- optional axis / column order
--     base = {T = 1024, H = 4, K = 64},                 -- fixed part of every config
--     columns = {"fwd_ms", "rel_err"},                  -- what fn returns (CSV header)
--     fn = function(cfg, ctx) ... return {fwd_ms = t, rel_err = e} end,
--     run = run,              -- write <run.dir>/results.csv (or csv = "path.csv")
--     repeats = 1,            -- rows per config
--     resume = true,          -- skip (config, repeat) rows already ok in that CSV;
--                             -- a path (run folder or CSV) also carries a previous
--                             -- run's ok rows into this one
--     progress = true,        -- gdp.progress on stderr; false, or {out =, tty =, title =}
--     seed = nil,             -- salt mixed into every config's seed (new draws)
--     time_budget = nil,      -- seconds: no row starts once the sweep has run this long
--   }
--
-- Every config is base overlaid with the config.  Its values are numbers, strings,
-- booleans or (JSON-encoded) tables.  For each config and repeat, in order:
--   * the seed is derived from the config (below), set as cfg.seed and passed to
--     gdp.manual_seed before fn runs, so a rerun draws the same inputs;
--   * fn(cfg, ctx) runs under xpcall; ctx = {index, total, config_index, repeat_index,
--     seed, key, label, study, run, resume_dir (the folder of a resume path, or nil),
--     budget_left (with time_budget: a function giving the seconds left, <= 0 once spent;
--     else nil)};
--   * one row is written and flushed: the config columns (axes first, then the rest
--     sorted), the result columns, status, error, seed, repeat, time_s (fn's wall time).
-- status is "ok", "error" (fn raised: the message, on one line, is in `error`; the
-- sweep goes on) or "skipped" (fn called sweep.skip(reason), or the library answered
-- GDP_ERR_UNSUPPORTED).  An interrupt (Ctrl-C: LuaJIT's "interrupted!" error) stops the
-- sweep and is raised again after the bar and the file are closed; the rows written so
-- far stay, and a rerun with resume skips them.
--
-- time_budget (seconds, from the start of sweep.run): checked before each row; once it
-- is spent, the rows not yet started are returned with status "not_run" (and counted
-- in summary.not_run) but not written to the CSV, so a rerun with resume runs them.  A
-- row that starts inside the budget runs to its end unless fn stops it: fn may watch
-- ctx.budget_left(), keep its progress where it can find it again (e.g. a checkpoint in
-- ctx.run's folder, looked for there and in ctx.resume_dir) and call sweep.pause(note);
-- the row is then "not_run" too, so the rerun continues it.  Otherwise leave a row's
-- length of slack under a hard limit (a device call's, say).
--
-- Seeds: key(cfg) is the canonical text "k1=v1;k2=v2;..." over the config's keys sorted
-- by name (the reserved columns below excluded; numbers in their shortest round-trip
-- decimal form, as they appear in the CSV; '%', ';', '=' and '#' in keys and values
-- escaped as %XX; absent and empty-string values left out).  seed(cfg, r, salt) is
-- FNV-1a (32-bit) of key(cfg) -- followed by "#repeat=<r>" when r > 1 and by
-- "#salt=<salt>" when a salt is given -- reduced mod 2^31 (gdp.util.hash).  The seed
-- depends only on the config, not on its position in the sweep or on the other axes'
-- values, so adding an axis value leaves the other configs' inputs unchanged.
--
-- Resume: a row counts as done when its CSV has every column of this sweep's header,
-- its status is "ok", and its config columns, repeat and seed equal the planned row's
-- (so a different salt reruns everything).  Failed and skipped configs run again; their
-- old rows stay in the file (later rows supersede earlier ones).  Under MPI only rank 0
-- has the run folder: collective sweeps should pass resume = false, or every rank must
-- be given the same csv path.
--
-- Reserved names (not allowed as config or result columns): status, error, seed,
-- repeat, time_s.
local util = require("gdp.util")
local results = require("gdp.results")
local progress = require("gdp.progress")

local M = {}

local RESERVED = { "status", "error", "seed", "repeat", "time_s" }
local reserved = {}
for _, name in ipairs(RESERVED) do reserved[name] = true end
M.RESERVED = RESERVED

local function fail(fn, msg, level)
  error("gdp.sweep." .. fn .. ": " .. msg, (level or 2) + 1)
end

-- The library is optional: without it, seeds are only passed as cfg.seed and times
-- come from os.clock.
local gdp_mod
local function gdp_lib()
  if gdp_mod == nil then
    local ok, mod = pcall(require, "gdp")
    gdp_mod = ok and mod or false
  end
  return gdp_mod or nil
end

local function wall_clock()
  local gdp = gdp_lib()
  if gdp then return gdp.time() end
  return os.clock()
end

------------------------------------------------------------------------------- keys and seeds

-- The text a value has in the CSV file and in the config key (nil: not a config value).
local function value_text(v)
  local ty = type(v)
  if ty == "number" then
    return util.number_text(v) or (v ~= v and "nan" or (v > 0 and "inf" or "-inf"))
  elseif ty == "string" then
    return v
  elseif ty == "boolean" then
    return tostring(v)
  elseif ty == "table" then
    return util.json_encode(v)
  end
  return nil
end
M.value_text = value_text

local function check_value(fn, where, v, level)
  if value_text(v) == nil then
    fail(fn, string.format("%s: expected a number, string, boolean or table, got %s", where, type(v)),
         (level or 2) + 1)
  end
end

local function escape(s)
  return (s:gsub("[%%;=#]", function(c) return string.format("%%%02X", c:byte()) end))
end

-- The canonical text of a config (see the top of the file).
function M.key(cfg)
  if type(cfg) ~= "table" then fail("key", "expected a config table, got " .. type(cfg)) end
  local keys = {}
  for k, v in pairs(cfg) do
    if type(k) ~= "string" then
      fail("key", "config keys must be strings, got " .. type(k) .. " " .. tostring(k))
    end
    if not reserved[k] then
      local text = value_text(v)
      if text == nil then
        fail("key", string.format("%s: expected a number, string, boolean or table, got %s", k, type(v)))
      end
      if text ~= "" then keys[#keys + 1] = k end
    end
  end
  table.sort(keys)
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = escape(k) .. "=" .. escape(value_text(cfg[k])) end
  return table.concat(parts, ";")
end

local function seed_of_key(key, repeat_index, salt)
  local s = key
  if repeat_index and repeat_index ~= 1 then s = s .. "#repeat=" .. value_text(repeat_index) end
  if salt ~= nil then s = s .. "#salt=" .. escape(value_text(salt)) end
  return util.hash(s)
end

-- The seed of a config's repeat_index-th row (default 1), with an optional salt.
function M.seed(cfg, repeat_index, salt)
  return seed_of_key(M.key(cfg), repeat_index, salt)
end

------------------------------------------------------------------------------- grid

local function axis_order(fn, axes, order)
  local names, seen = {}, {}
  if order ~= nil then
    if type(order) ~= "table" then fail(fn, "order: expected a list of axis names, got " .. type(order), 3) end
    for _, name in ipairs(order) do
      if axes[name] == nil then
        fail(fn, string.format("order: '%s' is not an axis", tostring(name)), 3)
      end
      if not seen[name] then
        names[#names + 1] = name
        seen[name] = true
      end
    end
  end
  local rest = {}
  for name in pairs(axes) do
    if type(name) ~= "string" then
      fail(fn, "axis names must be strings, got " .. type(name) .. " " .. tostring(name), 3)
    end
    if not seen[name] then rest[#rest + 1] = name end
  end
  table.sort(rest)
  for _, name in ipairs(rest) do names[#names + 1] = name end
  return names
end

-- The cartesian product of the axes: a list of config tables.  An axis is a list of
-- values, or one value (a fixed column).  Axes go in opts.order, then the others by
-- name; the first one varies slowest, the last one fastest (nested loops).
-- Also returns the axis names in that order.
local function grid(fn, axes, opts)
  if type(axes) ~= "table" then fail(fn, "axes: expected a table name -> list of values, got " .. type(axes), 3) end
  opts = opts or {}
  local names = axis_order(fn, axes, opts.order)
  local lists = {}
  for i, name in ipairs(names) do
    if reserved[name] then
      fail(fn, string.format("axis '%s' is a reserved column name (%s)", name, table.concat(RESERVED, ", ")), 3)
    end
    local values = axes[name]
    if type(values) ~= "table" then
      values = { values } -- one value: a fixed column
    elseif #values == 0 then
      fail(fn, string.format("axis '%s': expected a non-empty list of values", name), 3)
    end
    for j, v in ipairs(values) do check_value(fn, string.format("axis '%s' value %d", name, j), v, 3) end
    lists[i] = values
  end
  local configs = {}
  if #names == 0 then return { {} }, names end
  local idx = {}
  for i = 1, #names do idx[i] = 1 end
  while true do
    local cfg = {}
    for i, name in ipairs(names) do cfg[name] = lists[i][idx[i]] end
    configs[#configs + 1] = cfg
    local i = #names
    while i >= 1 do
      idx[i] = idx[i] + 1
      if idx[i] <= #lists[i] then break end
      idx[i] = 1
      i = i - 1
    end
    if i == 0 then break end
  end
  return configs, names
end

function M.grid(axes, opts)
  return (grid("grid", axes, opts))
end

------------------------------------------------------------------------------- CSV reading

-- Splits CSV text (RFC 4180: quoted fields may hold commas, doubled quotes and line
-- breaks) into records, lists of strings.
local function parse_csv(text)
  local records, record = {}, {}
  local pos, len = 1, #text
  while pos <= len do
    local value
    if text:sub(pos, pos) == '"' then
      local parts = {}
      pos = pos + 1
      while true do
        local q = text:find('"', pos, true)
        if not q then -- unterminated quote: a truncated last record
          parts[#parts + 1] = text:sub(pos)
          pos = len + 1
          record.broken = true
          break
        end
        parts[#parts + 1] = text:sub(pos, q - 1)
        if text:sub(q + 1, q + 1) == '"' then
          parts[#parts + 1] = '"'
          pos = q + 2
        else
          pos = q + 1
          break
        end
      end
      value = table.concat(parts)
      -- text between a closing quote and the separator makes the record malformed
      local stop = text:find("[,\r\n]", pos) or len + 1
      if stop > pos then record.broken = true end
      pos = stop
    else
      local stop = text:find("[,\r\n]", pos) or len + 1
      value = text:sub(pos, stop - 1)
      pos = stop
    end
    record[#record + 1] = value
    local sep = text:sub(pos, pos)
    if sep == "," then
      pos = pos + 1
      if pos > len then record[#record + 1] = "" end
    else
      if sep == "\r" and text:sub(pos + 1, pos + 1) == "\n" then pos = pos + 1 end
      pos = pos + 1
      records[#records + 1] = record
      record = {}
    end
  end
  if #record > 0 then
    record.broken = true -- no final newline: the writer stopped mid-row
    records[#records + 1] = record
  end
  return records
end

-- Reads a CSV file with a header line.  Returns the header (a list of names) and the
-- rows as tables name -> text ("" for empty fields); records whose field count differs
-- from the header's (a row cut short when a process died) are left out and counted in
-- the third value.  Returns nil when the file does not exist or is empty.
function M.read_csv(path)
  local f = io.open(path, "r")
  if not f then return nil end
  local text = f:read("*a")
  f:close()
  local records = parse_csv(text)
  if #records == 0 then return nil end
  local header = records[1]
  header.broken = nil
  local rows, bad = {}, 0
  for i = 2, #records do
    local rec = records[i]
    if rec.broken or #rec ~= #header then
      bad = bad + 1
    else
      local row = {}
      for j, name in ipairs(header) do row[name] = rec[j] end
      rows[#rows + 1] = row
    end
  end
  return header, rows, bad
end

-- A CSV text as a Lua value: numbers where the text reads as one, nil for "".
local SPECIAL = { nan = 0 / 0, inf = math.huge, ["-inf"] = -math.huge }
local function from_text(s)
  if s == nil or s == "" then return nil end
  if SPECIAL[s] then return SPECIAL[s] end
  local n = tonumber(s)
  -- only the texts this module writes for numbers (so "0x10" or "1.50" stay strings)
  if n ~= nil and value_text(n) == s then return n end
  return s
end

------------------------------------------------------------------------------- run

local Skip = {}
Skip.__index = Skip
Skip.__tostring = function(s) return "skipped: " .. tostring(s.reason) end

-- Raised inside fn: the row is recorded with status "skipped" and this reason.
function M.skip(reason)
  error(setmetatable({ reason = reason or "skipped" }, Skip), 2)
end

local Pause = {}
Pause.__index = Pause
Pause.__tostring = function(p) return "paused: " .. tostring(p.note) end

-- Raised inside fn when it stopped part way for the time budget and kept what a rerun
-- needs to continue: the row is returned with status "not_run" and this note, and not
-- written, so a rerun with resume runs it again.
function M.pause(note)
  error(setmetatable({ note = note or "paused" }, Pause), 2)
end

local function is_interrupt(e)
  return type(e) == "string" and e:find("interrupted!%s*$") ~= nil
end

local function skip_reason(e)
  if getmetatable(e) == Skip then return tostring(e.reason) end
  if type(e) == "table" and e.name == "GDP_ERR_UNSUPPORTED" then return tostring(e) end
  return nil
end

local function one_line(s)
  return (tostring(s):gsub("%s*\r?\n%s*", " | "))
end

local function copy(t)
  local out = {}
  for k, v in pairs(t) do out[k] = v end
  return out
end

local RUN_KEYS = {
  study = true, axes = true, configs = true, order = true, base = true, fn = true, columns = true,
  repeats = true, resume = true, run = true, csv = true, csv_name = true, progress = true,
  seed = true, label = true, traceback = true, time_budget = true,
}

-- The CSV path of a resume source: a run folder or a CSV file.
local function source_path(src)
  if src:match("%.csv$") then return src end
  return (src:gsub("/+$", "")) .. "/results.csv"
end

-- Runs fn over the configs; see the top of the file.  Returns the rows (one per config
-- and repeat, in order; rows resumed from a CSV have the values read back from it) and
-- a summary {total, ran, ok, error, skipped, resumed, not_run, csv = path written or nil}.
function M.run(opts)
  if type(opts) ~= "table" then fail("run", "expected an options table, got " .. type(opts)) end
  for k in pairs(opts) do
    if not RUN_KEYS[k] then fail("run", "unknown option '" .. tostring(k) .. "'") end
  end
  if type(opts.fn) ~= "function" then fail("run", "fn: expected a function(cfg, ctx), got " .. type(opts.fn)) end
  if (opts.axes == nil) == (opts.configs == nil) then
    fail("run", "expected exactly one of axes (a grid) or configs (a list of config tables)")
  end
  local budget = opts.time_budget
  if budget ~= nil and (type(budget) ~= "number" or budget ~= budget or budget < 0) then
    fail("run", "time_budget: expected seconds >= 0 or nil, got " .. tostring(budget))
  end
  local study = opts.study or (type(opts.run) == "table" and opts.run.study) or "sweep"
  local repeats = opts.repeats or 1
  if not util.is_int(repeats) or repeats < 1 then
    fail("run", "repeats: expected an integer >= 1, got " .. tostring(repeats))
  end
  local base = opts.base or {}
  if type(base) ~= "table" then fail("run", "base: expected a table, got " .. type(base)) end
  local salt = opts.seed
  if salt ~= nil then check_value("run", "seed (the salt)", salt) end

  -- configs, merged with base
  local configs, axis_names
  if opts.axes then
    configs, axis_names = grid("run", opts.axes, { order = opts.order })
  else
    if type(opts.configs) ~= "table" then fail("run", "configs: expected a list of tables, got " .. type(opts.configs)) end
    configs, axis_names = opts.configs, opts.order or {}
  end
  local merged, present = {}, {}
  for i, c in ipairs(configs) do
    if type(c) ~= "table" then fail("run", string.format("configs[%d]: expected a table, got %s", i, type(c))) end
    local cfg = copy(base)
    for k, v in pairs(c) do cfg[k] = v end
    for k, v in pairs(cfg) do
      if type(k) ~= "string" then
        fail("run", string.format("config %d: keys must be strings, got %s %s", i, type(k), tostring(k)))
      end
      if reserved[k] then
        fail("run", string.format("config %d: '%s' is a reserved column (%s)%s", i, k, table.concat(RESERVED, ", "),
                                  k == "seed" and "; seeds come from the config: pass seed = <salt> to sweep.run" or ""))
      end
      check_value("run", string.format("config %d: %s", i, k), v)
      present[k] = true
    end
    merged[i] = cfg
  end
  if type(opts.run) == "table" and opts.run.record then
    local axes = {}
    for name, values in pairs(opts.axes or {}) do axes[name] = util.json_array(values) end
    opts.run:record("sweep", { axes = axes, order = util.json_array(axis_names), configs = #merged,
                               repeats = repeats, base = base })
  end

  -- columns: axes (or order) first, then the other config keys by name
  local cfg_cols, seen = {}, {}
  for _, name in ipairs(axis_names) do
    if present[name] and not seen[name] then
      cfg_cols[#cfg_cols + 1] = name
      seen[name] = true
    end
  end
  local rest = {}
  for k in pairs(present) do if not seen[k] then rest[#rest + 1] = k end end
  table.sort(rest)
  for _, k in ipairs(rest) do
    cfg_cols[#cfg_cols + 1] = k
    seen[k] = true
  end
  local res_cols = opts.columns
  if res_cols ~= nil and type(res_cols) ~= "table" then
    fail("run", "columns: expected a list of result column names, got " .. type(res_cols))
  end
  local res_known = {}
  for i, c in ipairs(res_cols or {}) do
    if type(c) ~= "string" then fail("run", string.format("columns[%d]: expected a string, got %s", i, type(c))) end
    if reserved[c] then fail("run", "columns: '" .. c .. "' is a reserved column") end
    if seen[c] then fail("run", "columns: '" .. c .. "' is also a config column") end
    res_known[c] = true
  end
  local header = {}
  for _, c in ipairs(cfg_cols) do header[#header + 1] = c end
  for _, c in ipairs(res_cols or {}) do header[#header + 1] = c end
  for _, c in ipairs(RESERVED) do header[#header + 1] = c end

  -- where rows go
  local csv_path = opts.csv
  if csv_path == nil and opts.run ~= nil then
    if type(opts.run) ~= "table" then fail("run", "run: expected a gdp.results run, got " .. type(opts.run)) end
    if opts.run.dir then csv_path = opts.run.dir .. "/" .. (opts.csv_name or "results.csv") end
  end
  if csv_path ~= nil and res_cols == nil then
    fail("run", "columns: expected the list of result columns fn returns (the header of " .. csv_path .. ")")
  end
  local resume = opts.resume
  if resume == nil then resume = true end
  if type(resume) ~= "boolean" and type(resume) ~= "string" then
    fail("run", "resume: expected true, false or a run folder / CSV path, got " .. type(resume))
  end

  -- rows already done: own file (kept as they are) and a carried-over source (copied)
  local done, done_count = {}, 0
  local function row_id(key, repeat_index, seed)
    return key .. "\0" .. value_text(repeat_index) .. "\0" .. value_text(seed)
  end
  local function collect(path, carry)
    local file_header, rows = M.read_csv(path)
    if not file_header then return end
    local has = {}
    for _, c in ipairs(file_header) do has[c] = true end
    for _, c in ipairs(header) do if not has[c] then return end end
    for _, r in ipairs(rows) do
      if r.status == "ok" then
        local sub = {}
        for _, c in ipairs(cfg_cols) do if r[c] ~= "" then sub[c] = r[c] end end
        local id = row_id(M.key(sub), r["repeat"], r.seed)
        local list = done[id]
        if not list then
          list = {}
          done[id] = list
        end
        list[#list + 1] = { text = r, carry = carry }
      end
    end
  end
  local csv
  if csv_path then
    local dir = csv_path:match("^(.*)/[^/]*$")
    if dir then results.mkdir_p(dir) end
    csv = results.open_csv(csv_path, header, true) -- appends when the header matches
    -- a process killed mid-row leaves a line without its newline: end it, so that the
    -- next row starts on its own line (read_csv drops the cut one)
    local f = io.open(csv.path, "rb")
    if f then
      local size = f:seek("end")
      local last = size and size > 0 and f:seek("set", size - 1) and f:read(1)
      f:close()
      if last and last ~= "\n" then
        csv.file:write("\n")
        csv.file:flush()
      end
    end
  end
  if resume ~= false and csv then collect(csv.path, false) end
  if type(resume) == "string" then
    local src = source_path(resume)
    local probe = io.open(src, "r")
    if not probe then
      if csv then csv:close() end
      fail("run", "resume: no results file " .. src)
    end
    probe:close()
    if not (csv and src == csv.path) then collect(src, true) end
  end
  local resume_dir = type(resume) == "string" and (source_path(resume):match("^(.*)/[^/]*$") or ".") or nil

  -- labels: the columns that vary
  local varying = {}
  for _, c in ipairs(cfg_cols) do
    local first
    for _, cfg in ipairs(merged) do
      local t = value_text(cfg[c]) or ""
      if first == nil then first = t elseif t ~= first then
        varying[#varying + 1] = c
        break
      end
    end
  end
  local function label_of(cfg, r)
    local s
    if opts.label then
      s = tostring(opts.label(cfg))
    else
      local parts = {}
      for _, c in ipairs(varying) do
        if cfg[c] ~= nil then parts[#parts + 1] = c .. "=" .. value_text(cfg[c]) end
      end
      s = table.concat(parts, " ")
    end
    if repeats > 1 then s = s .. string.format(" (repeat %d/%d)", r, repeats) end
    return s
  end

  -- plan: which rows run, which are resumed
  local rows, plan = {}, {}
  local summary = { total = #merged * repeats, ran = 0, ok = 0, error = 0, skipped = 0, resumed = 0,
                    not_run = 0 }
  for i, cfg in ipairs(merged) do
    local key = M.key(cfg)
    for r = 1, repeats do
      local seed = seed_of_key(key, r, salt)
      local list = done[row_id(key, r, seed)]
      local prev = list and table.remove(list, 1)
      if prev then
        local row = {}
        for _, c in ipairs(header) do row[c] = from_text(prev.text[c]) end
        rows[#rows + 1] = row
        summary.resumed = summary.resumed + 1
        summary.ok = summary.ok + 1
        if prev.carry then
          local line = {}
          for _, c in ipairs(header) do line[c] = prev.text[c] end
          csv:row(line)
        end
      else
        rows[#rows + 1] = false
        plan[#plan + 1] = { slot = #rows, cfg = cfg, config_index = i, r = r, seed = seed, key = key }
      end
    end
  end

  -- progress
  local bar, bar_out
  if opts.progress ~= false and os.getenv("GDP_PROGRESS") ~= "0" then
    local popts = type(opts.progress) == "table" and opts.progress or {}
    local tty = popts.tty
    bar_out = popts.out or io.stderr
    if tty == nil and bar_out ~= io.stderr then tty = false end
    bar = progress.new(#plan, { title = popts.title or study, out = bar_out, tty = tty })
    bar_out:write(string.format("# gdp.sweep %s: %d configs x %d repeat%s, %d done before, %d to run%s\n",
                                study, #merged, repeats, repeats == 1 and "" or "s", summary.resumed, #plan,
                                csv and (", rows in " .. csv.path) or ""))
    bar_out:flush()
  end

  local gdp = gdp_lib()
  local sweep_t0 = wall_clock()
  local budget_left = budget and function() return budget - (wall_clock() - sweep_t0) end or nil
  for k, p in ipairs(plan) do
    if budget_left and budget_left() <= 0 then
      -- the budget is spent: this row and the rest are not started (nor written)
      local message = string.format("not started: the sweep's time budget of %g s was spent", budget)
      for j = k, #plan do
        local q = plan[j]
        local row = {}
        for _, c in ipairs(cfg_cols) do row[c] = q.cfg[c] end
        row.status, row.error, row.seed, row["repeat"] = "not_run", message, q.seed, q.r
        rows[q.slot] = row
      end
      summary.not_run = summary.not_run + #plan - k + 1
      break
    end
    local label = label_of(p.cfg, p.r)
    if bar then bar:update(k - 1, label) end
    local cfg = copy(p.cfg)
    cfg.seed = p.seed
    if gdp then gdp.manual_seed(p.seed) end
    local ctx = {
      index = k, total = #plan, config_index = p.config_index, repeat_index = p.r, seed = p.seed,
      key = p.key, label = label, study = study, run = opts.run, resume_dir = resume_dir,
      budget_left = budget_left,
    }
    local trace
    local t0 = wall_clock()
    local ok, res = xpcall(function() return opts.fn(cfg, ctx) end, function(e)
      if not is_interrupt(e) and skip_reason(e) == nil and getmetatable(e) ~= Pause then
        trace = debug.traceback(tostring(e), 2)
      end
      return e
    end)
    local elapsed = wall_clock() - t0
    if not ok and is_interrupt(res) then
      if bar then bar:finish() end
      if csv then csv:close() end
      io.stderr:write(string.format("gdp.sweep %s: interrupted at %d/%d (%s)%s\n", study, k, #plan, label,
                                    csv and ("; rows so far in " .. csv.path .. ", which a rerun with resume skips") or ""))
      error(res, 0)
    end

    local row, status, message = {}, "ok", nil
    for _, c in ipairs(cfg_cols) do row[c] = p.cfg[c] end
    if not ok and getmetatable(res) == Pause then
      -- stopped for the budget, to be continued: returned, not written
      row.status, row.error, row.seed, row["repeat"] = "not_run", one_line(res.note), p.seed, p.r
      rows[p.slot] = row
      summary.not_run = summary.not_run + 1
      if bar then bar:done(label .. " -> paused: " .. one_line(res.note):sub(1, 200)) end
      goto continue
    end
    if ok then
      if res ~= nil and type(res) ~= "table" then
        status, message = "error", "fn returned a " .. type(res) .. ", expected a table column -> value or nil"
      elseif res ~= nil then
        local values = {}
        for c, v in pairs(res) do
          if type(v) == "cdata" then v = tonumber(v) or tostring(v) end
          if type(c) ~= "string" or (res_cols ~= nil and not res_known[c]) or reserved[c] or seen[c] then
            status, message = "error", string.format("fn returned column '%s', which is not in columns {%s}",
                                                     tostring(c), table.concat(res_cols or {}, ", "))
            break
          elseif value_text(v) == nil then
            status, message = "error", string.format("fn returned %s = a %s", c, type(v))
            break
          end
          values[c] = v
        end
        if status == "ok" then
          for c, v in pairs(values) do row[c] = v end
        end
      end
    else
      local reason = skip_reason(res)
      if reason then
        status, message = "skipped", one_line(reason)
      else
        status, message = "error", one_line(tostring(res))
        if opts.traceback and trace then io.stderr:write(trace, "\n") end
        -- tensors of the failed config are unreachable now: free them before the next
        collectgarbage()
      end
    end
    -- (microseconds: the clock's resolution matters, not 17 digits)
    row.status, row.error, row.seed, row["repeat"] = status, message, p.seed, p.r
    row.time_s = math.floor(elapsed * 1e6 + 0.5) / 1e6
    if csv then
      local line = {}
      for c, v in pairs(row) do line[c] = type(v) == "table" and value_text(v) or v end
      csv:row(line)
    end
    rows[p.slot] = row
    summary.ran = summary.ran + 1
    summary[status] = summary[status] + 1
    if bar then
      if status ~= "ok" and bar.tty then
        bar_out:write("\r\27[K", string.format("%s: %s: %s\n", label, status, message))
      end
      bar:done(status == "ok" and label or string.format("%s -> %s: %s", label, status, message:sub(1, 200)))
    end
    ::continue::
  end
  if bar then bar:finish() end
  if summary.not_run > 0 and bar_out then
    bar_out:write(string.format("gdp.sweep %s: time budget of %g s spent, %d of %d rows not started or paused%s\n",
                                study, budget, summary.not_run, #plan,
                                csv and ("; a rerun with resume runs them (rows in " .. csv.path .. ")") or ""))
  end
  if csv then
    summary.csv = csv.path
    csv:close()
  end
  return rows, summary
end

------------------------------------------------------------------------------- output

-- An aligned text table (gdp.util.format_table, '#' header) of some columns of rows.
-- columns: names, or {name, heading} pairs.
function M.table(rows, columns, numfmt)
  local names, heads = {}, {}
  for i, c in ipairs(columns) do
    if type(c) == "table" then names[i], heads[i] = c[1], c[2] or c[1] else names[i], heads[i] = c, c end
  end
  local out = {}
  for r, row in ipairs(rows) do
    local line = {}
    for i, name in ipairs(names) do
      local v = row[name]
      if v == nil then v = "-" end
      line[i] = v
    end
    out[r] = line
  end
  return util.format_table(heads, out, numfmt)
end

-- Writes a gnuplot script for a run folder's CSV and renders it: gdp.results.plot
-- (one line per value of a `by` column, only rows with status ok, a PNG beside it).
M.plot = results.plot

return M
