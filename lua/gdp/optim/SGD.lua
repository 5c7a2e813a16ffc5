-- gdp.optim.SGD: stochastic gradient descent with momentum, dampening, Nesterov's
-- variant and L2 weight decay (torch.optim.SGD's update; kernels/optim_problem.h), one
-- fused kernel per parameter.
--
--   local opt = gdp.optim.SGD(model, {lr = 0.1, momentum = 0.9, nesterov = true,
--                                     weight_decay = 1e-4, no_decay = {"bias"}})
--
-- State per parameter: momentum_buffer (when momentum > 0) and, for bf16 parameters,
-- float32 master weights.
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")
local Optimizer = require("gdp.optim.Optimizer")

local SGD = setmetatable({}, { __index = Optimizer })
SGD.__index = SGD
SGD.kind = "SGD"

local FN = "optim.SGD"
local keys = { lr = true, momentum = true, dampening = true, nesterov = true, weight_decay = true,
               no_decay = true }

function SGD.new(model, cfg)
  cfg = cfg or {}
  local self = setmetatable({}, SGD)
  local momentum = Optimizer.check_number(FN, "momentum", type(cfg) == "table" and cfg.momentum or nil, 0,
                                          0, math.huge, true)
  self.state_names = momentum > 0 and { "momentum_buffer" } or {}
  cfg = Optimizer.init(self, FN, model, cfg, keys)
  self.momentum = momentum
  self.dampening = Optimizer.check_number(FN, "dampening", cfg.dampening, 0, 0, 1, false)
  self.nesterov = cfg.nesterov == true
  if self.nesterov and (self.momentum <= 0 or self.dampening ~= 0) then
    tensor.argerror(FN, string.format("nesterov: needs momentum > 0 and dampening 0, got momentum %g, dampening %g",
                                      self.momentum, self.dampening))
  end
  return self
end

function SGD:update(name, p, g, st, weight_decay)
  tensor.check(lib.gdp_optim_sgd_step(p, g, st.momentum_buffer, st.master, self.lr, self.momentum,
                                      self.dampening, weight_decay, self.nesterov and 1 or 0,
                                      self.step_count), FN .. ":step (" .. name .. ")")
end

function SGD:hyperparameters()
  return { kind = "SGD", lr = self.lr, momentum = self.momentum, dampening = self.dampening,
           nesterov = self.nesterov, weight_decay = self.weight_decay }
end

return setmetatable(SGD, { __index = Optimizer, __call = function(_, ...) return SGD.new(...) end })
