-- gdp.clock: synchronised, exclusive timing of nested stages, shared by gdp.cp.timing and
-- gdp.nn.profile.  clock:run(device, fn, ...) synchronises `device` before and after fn
-- and returns fn's seconds less those of runs nested inside it (so nested stages never
-- count twice), then fn's results; an error in fn passes through with the clock intact.
local tensor = require("gdp.tensor")
local lib = require("gdp.lib")

local M = {}

local Clock = {}
Clock.__index = Clock

function M.new() return setmetatable({ nested = nil }, Clock) end

local function pack(...) return { n = select("#", ...), ... } end

function Clock:run(device, fn, ...)
  local ctx = tensor.get_ctx("clock", device)
  ctx:sync()
  local outer = self.nested
  self.nested = 0
  local t0 = lib.gdp_time_now()
  local r = pack(pcall(fn, ...))
  ctx:sync()
  local dt = lib.gdp_time_now() - t0
  local own = dt - self.nested
  self.nested = outer and outer + dt or nil
  if not r[1] then error(r[2], 0) end
  return own, unpack(r, 2, r.n)
end

return M
