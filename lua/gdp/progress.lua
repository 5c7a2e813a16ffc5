-- gdp.progress: a progress bar for long sweeps, on stderr.
--
--   local bar = progress.new(#configs, {title = "bench"})
--   for i, cfg in ipairs(configs) do
--     bar:update(i - 1, label(cfg))      -- before the work: shows what runs now
--     ...
--     bar:done(label(cfg))               -- after it: one config finished
--   end
--   bar:finish()
--
-- When stderr is a terminal the bar is redrawn in place, at most ~10 times a second,
-- with i/N, elapsed time, ETA and the current label.  Otherwise (logs, pipes) it
-- prints one line per finished config.  GDP_PROGRESS=0 silences it, =1 forces the
-- terminal form.
local M = {}

local clock
do
  local ok, lib = pcall(require, "gdp.lib")
  if ok then
    clock = function() return lib.gdp_time_now() end
  else
    clock = os.time
  end
end

local stderr_is_tty
local function is_tty()
  if stderr_is_tty == nil then
    local force = os.getenv("GDP_PROGRESS")
    if force == "1" then stderr_is_tty = true
    elseif force == "0" then stderr_is_tty = false
    else
      local r = os.execute("[ -t 2 ]")
      stderr_is_tty = (r == 0 or r == true)
    end
  end
  return stderr_is_tty
end

local MIN_REDRAW_S = 0.1
local BAR_WIDTH = 24

local function fmt_time(s)
  if s == nil or s ~= s or s == math.huge then return "?" end
  if s < 60 then return string.format("%.1fs", s) end
  if s < 3600 then return string.format("%dm%02ds", math.floor(s / 60), math.floor(s % 60)) end
  return string.format("%dh%02dm", math.floor(s / 3600), math.floor(s % 3600 / 60))
end

local Bar = {}
Bar.__index = Bar

-- total: number of steps; opts: title, out (a file, default io.stderr), tty (override).
function M.new(total, opts)
  opts = opts or {}
  local bar = setmetatable({
    total = total,
    title = opts.title or "",
    out = opts.out or io.stderr,
    tty = opts.tty,
    count = 0,
    start = clock(),
    last_draw = -math.huge,
    silent = os.getenv("GDP_PROGRESS") == "0",
  }, Bar)
  if bar.tty == nil then bar.tty = is_tty() end
  return bar
end

function Bar:_line(label)
  local elapsed = clock() - self.start
  local eta = self.count > 0 and elapsed / self.count * (self.total - self.count) or nil
  local frac = self.total > 0 and self.count / self.total or 1
  local filled = math.floor(frac * BAR_WIDTH + 0.5)
  return string.format("%s[%s%s] %d/%d %s elapsed, ETA %s %s", self.title ~= "" and (self.title .. " ") or "",
                       string.rep("=", filled), string.rep(" ", BAR_WIDTH - filled), self.count,
                       self.total, fmt_time(elapsed), fmt_time(eta), label or "")
end

function Bar:_draw(label, force)
  if self.silent or not self.tty then return end
  local now = clock()
  if not force and now - self.last_draw < MIN_REDRAW_S then return end
  self.last_draw = now
  self.out:write("\r\27[K", self:_line(label))
  self.out:flush()
end

-- Sets the number of finished steps and the label of the current one.
function Bar:update(count, label)
  self.count = count
  self.label = label
  self:_draw(label, false)
end

-- One more step finished.
function Bar:done(label)
  self.count = self.count + 1
  if self.silent then return end
  if self.tty then
    self:_draw(label or self.label, self.count == self.total)
  else
    self.out:write(string.format("[%d/%d] %s (%s elapsed)\n", self.count, self.total,
                                 label or self.label or "", fmt_time(clock() - self.start)))
    self.out:flush()
  end
end

-- Ends the bar's line (terminal form).
function Bar:finish()
  if self.silent or not self.tty then return end
  self:_draw(self.label, true)
  self.out:write("\n")
  self.out:flush()
end

M.format_time = fmt_time

return M
