-- gdp.cp.timing: an optional clock on the stages of the context-parallel paths, so that a
-- benchmark can say where CP time goes (experiments/bench_cp.lua, docs/design.md 4.4).
--
--   local timing = require("gdp.cp.timing")
--   local acc = {}
--   timing.set(acc)        -- stage name -> seconds, accumulated over the calls
--   ... the CP layer's forward/backward, gdp_chunkwise_context_parallel ...
--   timing.set(nil)        -- off again (the default)
--
-- Off, stage() only calls its function: the normal path is not slowed.  On, each stage is
-- timed between synchronisations of its device, so its queued device work counts where
-- it ran; the synchronisations slow the whole run, so time the plain path with it off.
-- Stages (their names are the keys): chunkwise summary_forward, allgather_forward,
-- compose_forward, local_forward and the same four _backward, correct_forward, halo_forward,
-- halo_backward (the layer's conv halo); headwise all_to_all_in_forward, local_forward,
-- all_to_all_out_forward, all_to_all_out_backward, local_backward, all_to_all_in_backward.
-- local_* are the operator's own runs; every other stage is CP work around them.
local tensor = require("gdp.tensor")

local M = {}

local acc = nil

-- Turns the clock on (a table: stage name -> seconds, added to) or off (nil).
function M.set(t)
  if t ~= nil and type(t) ~= "table" then
    tensor.argerror("cp.timing.set", "expected a table (stage name -> seconds) or nil, got " .. type(t))
  end
  acc = t
end

-- The table the clock adds to, or nil when it is off.
function M.get() return acc end

local clock = require("gdp.clock").new()

local function add(name, seconds, ...)
  acc[name] = (acc[name] or 0) + seconds
  return ...
end

-- fn(...)'s results; with the clock on, fn's seconds (device work included: `device` is
-- the device name its work runs on), less those of stages nested inside it, are added
-- to the table under `name`.
function M.stage(name, device, fn, ...)
  if acc == nil then return fn(...) end
  return add(name, clock:run(device, fn, ...))
end

return M
