-- gdp.results: run folders for experiments.
--
--   local run = results.new_run("bench_gdp", {config = cfg, seed = seed, args = arg})
--   -- experiments/runs/bench_gdp/<UTC time>-<git sha>/meta.json written now
--   local csv = run:csv({"T", "n", "fwd_ms", "status", "error"})   -- results.csv
--   csv:row({T = 4096, n = 2, fwd_ms = 1.5, status = "ok"})          -- flushed at once
--   run:plot({x = "T", y = {"fwd_ms"}, logx = true})               -- plot.gp
--   run:finish()                                                   -- end time in meta.json
--
-- A study-level file that gathers one row per run across runs:
--   results.append_csv("experiments/runs/bench_gdp/results.csv", columns, row)
--
-- A benchmark's report where the README cites it (rank 0 only):
--   local path = results.record("cp-h200x2", report)   -- results/<UTC date>-cp-h200x2.json
--
-- Only rank 0 writes (OMPI_COMM_WORLD_RANK / PMI_RANK); other ranks get a run whose
-- methods do nothing.  meta.json holds the args, config, seed, git revision and dirty
-- flag, gdp_build_info(), the devices, the tuning (gdp.set_tuning: its default and each
-- default context's, at the start and, under tuning_end, at the finish when it changed),
-- selected environment variables, and start and end times (nccl-tests' JSON idea).
--
-- Where runs go: the repository's experiments/runs/ wherever the script is started
-- from (GDP_ROOT, which ./gdp exports, else the checkout this file lies in); the
-- environment variable GDP_RUNS_DIR overrides it, and new_run's opts.root overrides
-- both.  run:finish() prints where the run went (on stderr: stdout stays the tool's).
--
-- Every meta.json has a status: "ok", or "failed" with a reason.  new_run writes
-- "failed" ("did not finish") at once, so a script that dies before run:finish()
-- leaves an honest record; finish() sets "ok", or "failed" when extra.status is not
-- "ok" (reason: extra.reason or extra.error) or extra.exit_code is not 0.
local util = require("gdp.util")

local M = {}

local function absolute(path)
  if path:sub(1, 1) == "/" then return path end
  local cwd = os.getenv("PWD") or util.capture("pwd")
  if not cwd or cwd == "" then return path end
  return cwd .. "/" .. (path:gsub("^%./", ""))
end

-- The repository: GDP_ROOT (which ./gdp exports), else the checkout this file lies in;
-- nil when neither is known.
local function repo_root()
  local repo = os.getenv("GDP_ROOT")
  if not repo or repo == "" then
    local src = debug.getinfo(1, "S").source
    repo = src:sub(1, 1) == "@" and src:sub(2):match("^(.*)/lua/gdp/[^/]+$") or nil
    if not repo and src:match("^@lua/gdp/") then repo = "." end
  end
  if not repo or repo == "" then return nil end
  return absolute(repo)
end

local function default_root()
  local env = os.getenv("GDP_RUNS_DIR")
  if env and env ~= "" then return env end
  local repo = repo_root()
  if not repo then return "experiments/runs" end
  return repo .. "/experiments/runs"
end

M.root = default_root()

local function rank()
  return tonumber(os.getenv("OMPI_COMM_WORLD_RANK") or os.getenv("PMI_RANK") or "0") or 0
end

local function utc_now() return os.date("!%Y-%m-%dT%H:%M:%SZ") end

local function mkdir_p(path)
  local ok = os.execute("mkdir -p " .. util.shell_quote(path))
  if not (ok == 0 or ok == true) then
    error("gdp.results: cannot create directory " .. path, 3)
  end
end
M.mkdir_p = mkdir_p

-- {sha = "abc123...", short = "abc1234", dirty = true/false} or {sha = "unknown"}.
-- GDP_GIT_SHA (a full sha) names the revision of a tree copied without its own history
-- (a GPU machine's copy, whose .git, if any, is not the source's): then dirty is what
-- GDP_GIT_DIRTY says (1 or 0) and `from` says where the sha came from.
function M.git_info()
  local given = os.getenv("GDP_GIT_SHA")
  if given and given:match("^%x+$") and #given == 40 then
    return { sha = given, short = given:sub(1, 7), dirty = os.getenv("GDP_GIT_DIRTY") == "1",
             from = "GDP_GIT_SHA" }
  end
  -- (LuaJIT's popen gives no exit status: check the text, as outside a repository
  -- `git rev-parse` echoes its argument)
  local sha = util.capture("git rev-parse --verify -q HEAD")
  if not sha or not sha:match("^%x+$") or #sha < 40 then
    return { sha = "unknown", short = "nogit", dirty = false }
  end
  local status = util.capture("git status --porcelain --untracked-files=no")
  return { sha = sha, short = sha:sub(1, 7), dirty = status ~= nil and status ~= "" }
end

local ENV_KEYS = { "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                   "GDP_NUM_THREADS", "GDP_LIB", "GDP_SYNC_EVERY_OP", "HOSTNAME" }

local function environment()
  local env = {}
  for _, k in ipairs(ENV_KEYS) do env[k] = os.getenv(k) end
  -- NCCL_* variables: listed by the shell, since Lua cannot enumerate the environment.
  local all = util.capture("env") or ""
  for k, v in all:gmatch("(NCCL_[%w_]+)=([^\n]*)") do env[k] = v end
  return env
end

-- The tuning: {default = gdp.get_tuning(), contexts = {cpu = {...}, ["cuda:0"] = ...}}
-- for the default contexts created so far.
local function tuning_facts(gdp)
  local contexts = {}
  for _, c in ipairs(require("gdp.tensor").default_contexts()) do
    contexts[c:name()] = gdp.get_tuning(c)
  end
  return { default = gdp.get_tuning(), contexts = contexts }
end

-- The first "model name" of /proc/cpuinfo (nil elsewhere).
local function cpu_model()
  local f = io.open("/proc/cpuinfo", "r")
  if not f then return nil end
  local text = f:read("*a")
  f:close()
  return text:match("model name%s*:%s*([^\n]+)")
end

-- Thread counts that shape timings: the environment's, gdp's cpu context's and
-- OpenBLAS's (read with openblas_get_num_threads when the library is loaded).
local function thread_facts(gdp)
  local t = {
    GDP_NUM_THREADS = os.getenv("GDP_NUM_THREADS"), OMP_NUM_THREADS = os.getenv("OMP_NUM_THREADS"),
    OPENBLAS_NUM_THREADS = os.getenv("OPENBLAS_NUM_THREADS"),
    online_cores = tonumber(util.capture("nproc") or ""),
  }
  if gdp then
    t.gdp_cpu_context = gdp.device("cpu"):num_threads()
    local ffi = require("ffi")
    local ok, n = pcall(function() -- libgdp's namespace also resolves its OpenBLAS
      pcall(ffi.cdef, "int openblas_get_num_threads(void);")
      return gdp.lib.openblas_get_num_threads()
    end)
    if ok then t.openblas = tonumber(n) end
  end
  return t
end

-- The GPUs' names (nvidia-smi), when the library sees a CUDA device.
local function gpu_names(gdp)
  if not (gdp and gdp.has_cuda()) then return nil end
  local out = util.capture("nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null")
  if not out or out == "" then return nil end
  local names = {}
  for line in out:gmatch("[^\n]+") do names[#names + 1] = line end
  return util.json_array(names)
end

-- Facts about the library when it can be loaded (the results module itself does not
-- need it).
local function gdp_facts()
  local ok, gdp = pcall(require, "gdp")
  if not ok then return { error = tostring(gdp) } end
  return {
    version = gdp.version,
    build_info = gdp.build_info_table(),
    devices = util.json_array(gdp.devices()),
    tuning = tuning_facts(gdp),
  }
end

local function quote_csv(v)
  if v == nil then return "" end
  if type(v) == "number" then
    return util.number_text(v) or (v ~= v and "nan" or (v > 0 and "inf" or "-inf"))
  end
  local s = tostring(v)
  if s:find('[,"\n\r]') then s = '"' .. s:gsub('"', '""') .. '"' end
  return s
end

local function csv_line(values, n)
  local parts = {}
  for i = 1, n or #values do parts[i] = quote_csv(values[i]) end
  return table.concat(parts, ",") .. "\n"
end

local Csv = {}
Csv.__index = Csv

-- Writes one row (a table column -> value), flushed at once.
function Csv:row(row)
  if not self.file then return end
  local values = {}
  for i, c in ipairs(self.columns) do values[i] = row[c] end
  for k in pairs(row) do
    if not self.known[k] then
      error("gdp.results: row has column '" .. tostring(k) .. "' not in the header of " .. self.path, 2)
    end
  end
  self.file:write(csv_line(values, #self.columns))
  self.file:flush()
end

function Csv:close()
  if self.file then self.file:close() end
  self.file = nil
end

local function read_first_line(path)
  local f = io.open(path, "r")
  if not f then return nil end
  local line = f:read("*l")
  f:close()
  return line
end

-- Opens a CSV file with the given columns.  append = true keeps the rows already
-- there when the header matches; a file with another header is left alone and the
-- rows go to a sibling file named after the new header's hash (reported on stderr).
local function open_csv(path, columns, append)
  local known = {}
  for _, c in ipairs(columns) do known[c] = true end
  local header = csv_line(columns)
  local mode = "w"
  if append then
    local first = read_first_line(path)
    if first == nil then
      mode = "w"
    elseif first .. "\n" == header then
      mode = "a"
    else
      local alt = path:gsub("%.csv$", "") .. string.format(".%08x.csv", util.hash(header))
      io.stderr:write(string.format("gdp.results: %s has other columns; writing to %s\n", path, alt))
      path = alt
      mode = read_first_line(path) and "a" or "w"
    end
  end
  local f, err = io.open(path, mode)
  if not f then error("gdp.results: cannot open " .. path .. ": " .. tostring(err), 3) end
  if mode == "w" then f:write(header) end
  f:flush()
  return setmetatable({ path = path, columns = columns, known = known, file = f }, Csv)
end
M.open_csv = open_csv

-- Appends one row to a (study-level) CSV file, creating it with a header when new.
function M.append_csv(path, columns, row)
  if rank() ~= 0 then return end
  local dir = path:match("^(.*)/[^/]*$")
  if dir then mkdir_p(dir) end
  local csv = open_csv(path, columns, true)
  csv:row(row)
  local written = csv.path
  csv:close()
  return written
end

------------------------------------------------------------------------------- plots

local function fail(msg)
  error("gdp.results.plot: " .. msg, 3)
end

-- The text a value has in a CSV cell (numbers as the writer spells them).
local function value_text(v)
  if type(v) == "number" then
    return util.number_text(v) or (v ~= v and "nan" or (v > 0 and "inf" or "-inf"))
  elseif type(v) == "table" then
    return util.json_encode(v)
  elseif v == nil then
    return nil
  end
  return tostring(v)
end

-- Runs gnuplot on a script in dir when gnuplot is installed (./gdp's set-up installs
-- gnuplot-nox), else says on stderr that the PNG was skipped.  Returns true when the
-- PNGs were made.
function M.render_plot(dir, file)
  local q = util.shell_quote
  local found = os.execute("command -v gnuplot >/dev/null 2>&1")
  if not (found == 0 or found == true) then
    io.stderr:write(string.format("gdp.results: gnuplot not found: skipped the PNG of %s/%s " ..
                                  "(apt-get install gnuplot-nox; then: cd %s && gnuplot %s)\n",
                                  dir, file, q(dir), file))
    return false
  end
  local out = util.capture("cd " .. q(dir) .. " && gnuplot " .. q(file) .. " 2>&1 && echo GDP_PLOT_OK") or ""
  if not out:find("GDP_PLOT_OK", 1, true) then
    io.stderr:write(string.format("gdp.results: gnuplot failed on %s/%s: %s\n", dir, file, out))
    return false
  end
  return true
end

local function gp_string(s)
  return '"' .. tostring(s):gsub('[\\"]', "\\%0") .. '"'
end

-- Writes a gnuplot script (default plot.gp) in a run folder for its results.csv, with
-- one line per value of a `by` column.  target: a gdp.results run (nothing is written
-- on ranks without a folder) or a folder path.  spec, or a list of specs (one figure
-- each, in one script):
--   x (a column; nil: the row number), y (a column or a list), by (a column; nil: one line per y), values (the `by`
--   values to draw, default: those in `rows`, in order), rows (the sweep's rows),
--   logx (log2 x axis), logy, xtics (e.g. 1), xlabel, ylabel, title, output (default plot.png, then
--   plot-<i>.png), csv (default results.csv), file (default plot.gp), style
--   ("linespoints").
-- Only rows whose status is ok are drawn; points of one line are sorted by x and
-- repeats at the same x averaged (gnuplot's smooth unique).  Text is noenhanced, so
-- names with '_' print as they are.  Then the PNGs are made (render_plot) and the
-- script's path is returned.
function M.plot(target, specs)
  local dir = target
  if type(target) == "table" then
    dir = target.dir
    if dir == nil then return nil end -- a rank without a run folder
  end
  if type(dir) ~= "string" then fail("expected a gdp.results run or a folder path, got " .. type(target)) end
  if type(specs) ~= "table" then fail("expected a plot spec table, got " .. type(specs)) end
  if specs.x ~= nil or specs.y ~= nil then specs = { specs } end
  local lines = {
    "# Generated by gdp.results; run: gnuplot " .. (specs[1].file or "plot.gp") .. " (in this folder)",
  }
  for i, spec in ipairs(specs) do
    if spec.x ~= nil and type(spec.x) ~= "string" then
      fail(string.format("spec %d: x: expected a column name (nil: the row number)", i))
    end
    local ys = type(spec.y) == "table" and spec.y or { spec.y }
    if #ys == 0 or type(ys[1]) ~= "string" then fail(string.format("spec %d: y: expected a column or a list", i)) end
    local out = spec.output or (i == 1 and "plot.png" or string.format("plot-%d.png", i))
    if i > 1 then lines[#lines + 1] = "" end
    lines[#lines + 1] = "reset"
    lines[#lines + 1] = 'set datafile separator ","'
    -- rows filtered out become NaN: as "missing" they neither break nor end a line
    lines[#lines + 1] = "set datafile missing NaN"
    lines[#lines + 1] = "set grid"
    lines[#lines + 1] = "set key left top"
    if out:match("%.svg$") then
      lines[#lines + 1] = "set terminal svg size 900,600 noenhanced"
    else
      lines[#lines + 1] = "set terminal pngcairo size 900,600 noenhanced" -- '_' in names is no subscript
    end
    lines[#lines + 1] = "set output " .. gp_string(out)
    lines[#lines + 1] = "set title " .. gp_string(spec.title or ((ys[1]) .. " vs " .. (spec.x or "row")))
    lines[#lines + 1] = "set xlabel " .. gp_string(spec.xlabel or spec.x or "row")
    lines[#lines + 1] = "set ylabel " .. gp_string(spec.ylabel or table.concat(ys, ", "))
    if spec.logx then lines[#lines + 1] = "set logscale x 2" end
    if spec.xtics then lines[#lines + 1] = "set xtics " .. tostring(spec.xtics) end
    if spec.logy then lines[#lines + 1] = "set logscale y" end
    local values = spec.values
    if spec.by and values == nil then
      local seen = {}
      values = {}
      for _, row in ipairs(spec.rows or {}) do
        local t = value_text(row[spec.by])
        if t ~= nil and not seen[t] then
          seen[t] = true
          values[#values + 1] = row[spec.by]
        end
      end
      if #values == 0 then fail(string.format("spec %d: by = '%s' needs values = {...} or rows", i, spec.by)) end
    end
    local plots = {}
    local csvfile = gp_string(spec.csv or "results.csv")
    for yi, y in ipairs(ys) do
      for vi, v in ipairs(spec.by and values or { false }) do
        local cond = 'strcol("status") eq "ok"'
        local title = y
        if spec.by then
          cond = cond .. string.format(" && strcol(%s) eq %s", gp_string(spec.by), gp_string(value_text(v)))
          title = (#ys > 1 and (y .. ", ") or "") .. spec.by .. " = " .. value_text(v)
        end
        plots[#plots + 1] = string.format('%s using %s:((%s) ? column(%s) : NaN) smooth unique with %s lc %d dt %d pt %d title %s',
          csvfile, spec.x and gp_string(spec.x) or "0", cond, gp_string(y), spec.style or "linespoints", vi, yi, 6 + yi,
          gp_string(title))
      end
    end
    lines[#lines + 1] = "plot " .. table.concat(plots, ", \\\n     ")
  end
  local path = dir .. "/" .. (specs[1].file or "plot.gp")
  local f, err = io.open(path, "w")
  if not f then fail("cannot write " .. path .. ": " .. tostring(err)) end
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
  M.render_plot(dir, specs[1].file or "plot.gp")
  return path
end


local Run = {}
Run.__index = Run

local function write_file(path, text)
  local f, err = io.open(path, "w")
  if not f then error("gdp.results: cannot write " .. path .. ": " .. tostring(err), 3) end
  f:write(text)
  f:close()
end

-- Writes report (a table) as JSON to <repo>/results/<UTC date>-<name>.json and returns
-- the path; rank 0 only (other ranks return nil).  name: letters, digits, '-', '_', '.'.
function M.record(name, report)
  if type(name) ~= "string" or not name:match("^[%w%-_.]+$") then
    error("gdp.results.record: name: expected letters, digits, '-', '_' and '.', got " .. tostring(name), 2)
  end
  if rank() ~= 0 then return nil end
  local dir = (repo_root() or ".") .. "/results"
  mkdir_p(dir)
  local path = string.format("%s/%s-%s.json", dir, os.date("!%Y-%m-%d"), name)
  write_file(path, util.json_encode(report, 1) .. "\n")
  return path
end

function Run:write_meta()
  if not self.dir then return end
  write_file(self.dir .. "/meta.json", util.json_encode(self.meta, 2) .. "\n")
end

-- Opens results.csv of the run (or another name) with these columns.
function Run:csv(columns, name)
  if not self.dir then return setmetatable({ columns = columns, known = {} }, Csv) end
  local csv = open_csv(self.dir .. "/" .. (name or "results.csv"), columns, false)
  self.csvs[#self.csvs + 1] = csv
  return csv
end

-- Writes plot.gp for the run's results.csv and renders it (M.plot: spec = {x =,
-- y = {columns...}, by =, logx =, logy =, xlabel =, ylabel =, title =, style =,
-- output = "plot.png", csv = "results.csv"}).
function Run:plot(spec)
  return M.plot(self, spec)
end

-- Sets meta.json's field `key` to value and writes meta.json now.
function Run:record(key, value)
  if not self.dir then return end
  self.meta[key] = value
  self:write_meta()
end

-- Records the end time (and any extra fields) in meta.json and closes the CSV files.
function Run:finish(extra)
  if not self.dir then return end
  for _, c in ipairs(self.csvs) do c:close() end
  self.meta.end_time = utc_now()
  local gdp = package.loaded["gdp"]
  if gdp and self.meta.gdp and self.meta.gdp.tuning then
    local now = tuning_facts(gdp)
    if util.json_encode(now) ~= util.json_encode(self.meta.gdp.tuning) then
      self.meta.gdp.tuning_end = now
    end
  end
  extra = extra or {}
  for k, v in pairs(extra) do self.meta[k] = v end
  if extra.status ~= nil and extra.status ~= "ok" then
    self.meta.status = "failed"
    self.meta.reason = tostring(extra.reason or extra.error or ("status " .. tostring(extra.status)))
  elseif extra.exit_code ~= nil and extra.exit_code ~= 0 then
    self.meta.status = "failed"
    self.meta.reason = tostring(extra.reason or ("exit code " .. tostring(extra.exit_code)))
  else
    self.meta.status = "ok"
    self.meta.reason = nil
  end
  self:write_meta()
  io.stderr:write(string.format("%s: run %s, saved in %s\n", self.study,
                                self.meta.status == "ok" and "ok" or ("failed (" .. self.meta.reason .. ")"),
                                self.dir))
end

-- opts: config, seed, args (the script's arg table), root (default experiments/runs),
-- extra (more meta fields).
function M.new_run(study, opts)
  opts = opts or {}
  local run = setmetatable({ study = study, csvs = {} }, Run)
  if rank() ~= 0 then return run end
  local git = M.git_info()
  local stamp = os.date("!%Y%m%dT%H%M%SZ")
  local base = (opts.root or M.root) .. "/" .. study
  local dir = base .. "/" .. stamp .. "-" .. git.short
  -- Two runs in the same second get distinct folders.
  local suffix = 1
  while read_first_line(dir .. "/meta.json") do
    suffix = suffix + 1
    dir = base .. "/" .. stamp .. "-" .. git.short .. "-" .. suffix
  end
  mkdir_p(dir)
  run.dir = dir
  local args = {}
  for i, a in ipairs(opts.args or {}) do args[i] = a end
  run.meta = {
    study = study,
    args = util.json_array(args),
    script = opts.args and opts.args[0] or nil,
    config = opts.config or {},
    seed = opts.seed,
    git = git,
    gdp = gdp_facts(),
    env = environment(),
    cpu_model = cpu_model(),
    threads = thread_facts(package.loaded["gdp"]),
    gpus = gpu_names(package.loaded["gdp"]),
    host = util.capture("hostname"),
    luajit = jit and jit.version or _VERSION,
    start_time = utc_now(),
    status = "failed", -- until finish() says otherwise
    reason = "did not finish (the script stopped before run:finish)",
  }
  for k, v in pairs(opts.extra or {}) do run.meta[k] = v end
  run:write_meta()
  return run
end

return M
