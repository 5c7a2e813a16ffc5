-- gdp.nn.Sequential: modules applied one after the other.
--
--   local seq = nn.Sequential{blk1, blk2}     -- or nn.Sequential():add(blk1):add(blk2)
--   local y = seq:forward(x, cu_seqlens)      -- the arguments after x go to every module
--   local dx = seq:backward(x, dy, cu_seqlens)
--
-- Children are named "0", "1", ... (torch's convention), so parameter names read
-- "0.mixer.A_log", and "layers.0.mixer.A_log" inside a model.
local tensor = require("gdp.tensor")
local Module = require("gdp.nn.Module")

local argerror = tensor.argerror

local Sequential = Module.class("Sequential")
local FN = Sequential.FN

function Sequential.new(modules)
  if modules ~= nil and type(modules) ~= "table" then
    argerror(FN, "expected a list of modules or nil, got " .. type(modules))
  end
  local self = setmetatable({ children = {} }, Sequential)
  for _, m in ipairs(modules or {}) do self:add(m) end
  return self
end

function Sequential:add(m)
  if type(m) ~= "table" or type(m.forward) ~= "function" or type(m.backward) ~= "function" then
    argerror(FN .. ":add", "module: expected a module (forward, backward), got " .. tostring(m))
  end
  if #self.children > 0 and (m.dtype ~= self.dtype or m.device ~= self.device) then
    argerror(FN .. ":add", string.format("module: expected dtype %s on %s (the first module's), got %s on %s",
                                         self.dtype, self.device, tostring(m.dtype), tostring(m.device)))
  end
  self.dtype, self.device = m.dtype, m.device
  self.children[#self.children + 1] = { tostring(#self.children), m }
  return self
end

function Sequential:size() return #self.children end

-- The i-th module (1-based, as in torch's nn.Sequential:get).
function Sequential:get(i) return self.children[i] and self.children[i][2] end

function Sequential:forward(x, ...)
  local inputs = { x }
  for i, child in ipairs(self.children) do
    inputs[i + 1] = child[2]:forward(inputs[i], ...)
  end
  Module.set_cache(self, x, Module.packing_key((...)), { inputs = inputs })
  self.output = inputs[#inputs]
  return self.output
end

function Sequential:backward(x, dy, ...)
  local c = Module.cache_for(self, x, Module.packing_key((...)))
  if c == nil then
    self:forward(x, ...)
    c = self.cache
  end
  for i = #self.children, 1, -1 do
    dy = self.children[i][2]:backward(c.inputs[i], dy, ...)
  end
  self.grad_input = dy
  return dy
end

function Sequential:__tostring()
  local parts = {}
  for i, c in ipairs(self.children) do parts[i] = "  (" .. c[1] .. "): " .. tostring(c[2]) end
  return "nn.Sequential {\n" .. table.concat(parts, "\n") .. "\n}"
end

return Sequential
