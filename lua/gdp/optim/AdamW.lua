-- gdp.optim.AdamW: Adam with decoupled weight decay and bias correction
-- (torch.optim.AdamW's update; the math is in kernels/optim_problem.h), one fused kernel
-- per parameter on the parameter's device.
--
--   local opt = gdp.optim.AdamW(model, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8,
--                                       weight_decay = 0.01,
--                                       no_decay = {"bias", "A_log", "dt_bias", "norm.weight"}})
--   model:zero_grad(); ...backward...; opt:step()
--
-- State per parameter: exp_avg, exp_avg_sq (float64 for f64 parameters, else float32)
-- and, for bf16 parameters, float32 master weights (gdp.optim.Optimizer).
local ffi = require("ffi")
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")
local Optimizer = require("gdp.optim.Optimizer")

local AdamW = setmetatable({}, { __index = Optimizer })
AdamW.__index = AdamW
AdamW.kind = "AdamW"
AdamW.state_names = { "exp_avg", "exp_avg_sq" }

local FN = "optim.AdamW"
local keys = { lr = true, betas = true, eps = true, weight_decay = true, no_decay = true }

function AdamW.new(model, cfg)
  local self = setmetatable({}, AdamW)
  cfg = Optimizer.init(self, FN, model, cfg or {}, keys)
  local betas = cfg.betas or { 0.9, 0.999 }
  if type(betas) ~= "table" then
    tensor.argerror(FN, "betas: expected a table {beta1, beta2}, got " .. type(betas))
  end
  self.beta1 = Optimizer.check_number(FN, "beta1", betas[1], nil, 0, 1, true)
  self.beta2 = Optimizer.check_number(FN, "beta2", betas[2], nil, 0, 1, true)
  self.eps = Optimizer.check_number(FN, "eps", cfg.eps, 1e-8, 0, math.huge, true)
  if self.eps == 0 then tensor.argerror(FN, "eps: expected a number > 0, got 0") end
  return self
end

function AdamW:update(name, p, g, st, weight_decay)
  tensor.check(lib.gdp_optim_adamw_step(p, g, st.exp_avg, st.exp_avg_sq, st.master, self.lr,
                                        self.beta1, self.beta2, self.eps, weight_decay,
                                        self.step_count), FN .. ":step (" .. name .. ")")
end

function AdamW:hyperparameters()
  return { kind = "AdamW", lr = self.lr, beta1 = self.beta1, beta2 = self.beta2, eps = self.eps,
           weight_decay = self.weight_decay }
end

return setmetatable(AdamW, { __index = Optimizer, __call = function(_, ...) return AdamW.new(...) end })
