-- gdp.nn.profile: where a model's forward and backward time goes, module by module.
--
--   local profile = require("gdp.nn.profile")
--   local p = profile.attach(model)        -- every module in the tree (through .children)
--   p:add(optimizer, "step", "optimizer step")   -- any other object's method
--   ... forward / backward steps; p:stage(name, device, fn, ...) for other work ...
--   print(p:format())                      -- one row per module and stage, slowest first
--   p:detach()                             -- the model as it was
--
-- Times are exclusive: a module's row leaves out the modules (and stages) that ran
-- inside it, so the rows add up to the profiled time.  The GDP mixer's stages
-- (in_proj_forward ... out_backward, the split its forward and backward are made of)
-- get rows of their own.  Every profiled call synchronises its device before and
-- after, which slows a step: time steps with the profile detached.
local tensor = require("gdp.tensor")
local clock = require("gdp.clock")

local M = {}

local Profile = {}
Profile.__index = Profile

-- The GDP mixer's stage methods (nn.GatedDeltaProduct's header lists them).
local MIXER_STAGES = {
  "in_proj_forward", "conv_forward", "ssm_inputs", "ssm_forward", "out_forward",
  "out_backward", "ssm_backward", "ssm_inputs_backward", "conv_backward", "in_proj_backward",
}

-- fn(...)'s results; its seconds on `device`, less those of profiled calls inside it,
-- are added to row `name`.
function Profile:stage(name, device, fn, ...)
  return self:add_time(name, self.clock:run(device, fn, ...))
end

function Profile:add_time(name, seconds, ...)
  local row = self.rows[name]
  if row == nil then
    row = { name = name, seconds = 0, calls = 0 }
    self.rows[name] = row
    self.order[#self.order + 1] = name
  end
  row.seconds = row.seconds + seconds
  row.calls = row.calls + 1
  return ...
end

-- Replaces m[method] (found through m's class) with a profiled call named `name`.
local function wrap(self, m, method, name)
  local original = m[method]
  if type(original) ~= "function" then return end
  local had_own = rawget(m, method) ~= nil
  m[method] = function(obj, ...)
    return self:stage(name, obj.device or "cpu", original, obj, ...)
  end
  self.undo[#self.undo + 1] = function()
    if had_own then m[method] = original else m[method] = nil end
  end
end

-- Profiles obj:method(...) too (a criterion, an optimiser's step), as row `name`.
function Profile:add(obj, method, name)
  if type(obj) ~= "table" or type(obj[method]) ~= "function" then
    tensor.argerror("nn.profile:add", string.format("%s: expected a table with a method %s", tostring(name), tostring(method)))
  end
  wrap(self, obj, method, name)
  return self
end

-- Profiles every module of `model`'s tree: rows "<path> forward" / "<path> backward"
-- (path from the parameter names' prefixes, "model" for the root) and the mixers' stages.
function M.attach(model)
  if type(model) ~= "table" or type(model.forward) ~= "function" then
    tensor.argerror("nn.profile.attach", "model: expected a module (forward, backward), got " .. type(model))
  end
  local self = setmetatable({ rows = {}, order = {}, undo = {}, clock = clock.new() }, Profile)
  local function visit(m, path)
    wrap(self, m, "forward", path .. " forward")
    wrap(self, m, "backward", path .. " backward")
    local cls = getmetatable(m)
    if cls and cls.__name == "GatedDeltaProduct" then
      for _, s in ipairs(MIXER_STAGES) do wrap(self, m, s, path .. " " .. s) end
    end
    for _, child in ipairs(m.children or {}) do
      visit(child[2], path == "model" and child[1] or (path .. "." .. child[1]))
    end
  end
  visit(model, "model")
  return self
end

-- Restores every wrapped method.
function Profile:detach()
  for i = #self.undo, 1, -1 do self.undo[i]() end
  self.undo = {}
end

-- Rows {name, ms (total), calls, ms_per_call}, slowest first.
function Profile:report()
  local out = {}
  for _, name in ipairs(self.order) do
    local r = self.rows[name]
    out[#out + 1] = { name = name, ms = r.seconds * 1e3, calls = r.calls, ms_per_call = r.seconds * 1e3 / r.calls }
  end
  table.sort(out, function(a, b) return a.ms > b.ms end)
  return out
end

-- The report as text lines (name, ms per call, share of the total).
function Profile:format()
  local rows, total = self:report(), 0
  for _, r in ipairs(rows) do total = total + r.ms end
  local lines = { string.format("%-44s %10s %7s %6s", "module / stage", "ms/call", "calls", "share") }
  for _, r in ipairs(rows) do
    lines[#lines + 1] = string.format("%-44s %10.3f %7d %5.1f%%", r.name, r.ms_per_call, r.calls,
                                      total > 0 and 100 * r.ms / total or 0)
  end
  return table.concat(lines, "\n")
end

return M
