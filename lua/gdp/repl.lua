-- gdp.repl: the interactive prompt of `./gdp` (no arguments).
--
-- LuaJIT's own `-i` prompt runs a line as a statement and prints nothing, so typing `x`
-- is a syntax error and `1 + 2` shows nothing.  Here, as in `th`, a line is first
-- compiled as `return <line>`: if that compiles it is an expression and its values are
-- printed (`x` shows the tensor, `1 + 2` prints 3); otherwise the line runs as a
-- statement.  A leading `=` (LuaJIT's form) also works.  An unfinished chunk (a `for`
-- without its `end`) continues on the next line at the `>>` prompt.  An error prints
-- its message and the prompt continues.
--
-- Ctrl-C: the launcher starts run() inside luajit's own protected call, whose SIGINT
-- handler turns an interrupt into the error "interrupted!" at the next Lua step, and
-- then resets SIGINT to the default (end the process).  run() puts in libgdp's handler
-- (gdp_interrupt_install), which sets the library's interrupt flag and passes the
-- signal on to luajit's outside gdp's calls, and puts it back after each line:
--   - during a long CPU op the kernels see the flag and stop; the op raises
--     "GDP_ERR_INTERRUPTED: interrupted (Ctrl-C)", its outputs are not made (or are
--     already owned by the collector: gdp.tensor's call_outputs), and the session
--     keeps its state;
--   - in plain Lua code luajit's handler raises "interrupted!" as before;
--   - at the prompt the read returns (EINTR), the line typed so far is dropped and a
--     fresh prompt is shown; the session keeps its state.
-- Without libgdp (a broken build) luajit's handler is put back after each line instead.
local M = {}

local ffi = require("ffi")

local ok_lib, lib = pcall(require, "gdp.lib")
if not ok_lib then lib = nil end

local restore_sigint = function() end
if lib then
  restore_sigint = function() lib.gdp_interrupt_install() end
else
  local ok = pcall(ffi.cdef, [[
    typedef void (*gdp_repl_sighandler_t)(int);
    gdp_repl_sighandler_t signal(int signum, gdp_repl_sighandler_t handler);
  ]])
  if ok then
    pcall(function()
      local SIGINT = 2
      local old = ffi.C.signal(SIGINT, ffi.cast("gdp_repl_sighandler_t", 1)) -- SIG_IGN
      ffi.C.signal(SIGINT, old)
      local addr = tonumber(ffi.cast("intptr_t", old))
      if addr and addr > 1 then -- neither SIG_DFL (0) nor SIG_IGN (1): luajit's handler
        restore_sigint = function() ffi.C.signal(SIGINT, old) end
      end
    end)
  end
end

-- The chunk for `src`: an expression's values are returned, a statement runs.  Returns
-- fn, or nil and the statement's compile error.
function M.compile(src, chunkname)
  chunkname = chunkname or "=stdin"
  if src:sub(1, 1) == "=" then src = "return " .. src:sub(2) end
  -- select(1, ...) keeps every value, and is no tail call of the line itself, so an
  -- error raised by it still names stdin:1
  local fn = loadstring("return select(1, " .. src .. "\n)", chunkname)
  if fn then return fn end
  return loadstring(src, chunkname)
end

-- Whether a compile error only says the chunk is not finished yet.
function M.incomplete(err)
  return type(err) == "string" and err:sub(-7) == "'<eof>'"
end

local function message(e)
  if type(e) == "string" then return e end
  local ok, s = pcall(tostring, e) -- tables with __tostring, error objects
  return ok and s or ("(error object of type " .. type(e) .. ")")
end

local function show(n, ...)
  if n == 0 then return end
  local parts = {}
  for i = 1, n do
    local v = select(i, ...)
    local ok, s = pcall(tostring, v)
    parts[i] = ok and s or ("<" .. type(v) .. ": " .. message(s) .. ">")
  end
  io.write(table.concat(parts, "\t"), "\n")
end

local function capture(ok, ...) return ok, select("#", ...), { ... } end

local function report(e)
  io.stdout:flush() -- keep the order of output and errors when both go to one pipe
  io.stderr:write(message(e), "\n")
end

-- One line (or several, for an unfinished chunk) read, run and shown.  Returns false
-- at the end of input.
-- A line from input; at the prompt a Ctrl-C only sets the flag (deferred), so that the
-- read returns EINTR instead of luajit raising inside the prompt.  Returns the line,
-- false for "interrupted at the prompt", or nil at the end of input.
local function read_line(input)
  if lib then lib.gdp_interrupt_defer(1) end
  local line, err = input:read("*l")
  if lib then
    lib.gdp_interrupt_defer(-1)
    if line == nil and err ~= nil and lib.gdp_interrupt_requested() ~= 0 then
      lib.gdp_interrupt_clear()
      return false
    end
  end
  return line
end

local function step(input)
  if lib then lib.gdp_interrupt_clear() end -- a Ctrl-C that landed outside gdp's calls
  io.write("> ")
  io.flush()
  local src = read_line(input)
  if src == false then
    io.write("\n") -- the line typed so far is dropped; a fresh prompt
    return true
  end
  if src == nil then return false end
  local fn, err = M.compile(src)
  while not fn and M.incomplete(err) do
    io.write(">> ")
    io.flush()
    local more = read_line(input)
    if more == false then
      io.write("\n")
      return true
    end
    if more == nil then break end
    src = src .. "\n" .. more
    fn, err = M.compile(src)
  end
  if not fn then
    report(err)
    return true
  end
  local ok, n, res = capture(pcall(fn))
  if ok then
    show(n, unpack(res, 1, n))
  else
    report(res[1])
  end
  return true
end

function M.run(input)
  input = input or io.stdin
  restore_sigint()
  while true do
    local ok, more = pcall(step, input)
    restore_sigint()
    if not ok then -- an interrupt that landed in the prompt itself
      report(more)
    elseif not more then
      io.write("\n")
      return
    end
  end
end

return M
