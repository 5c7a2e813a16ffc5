-- gdp.optim: optimisers, learning-rate schedules and gradient clipping for modules of
-- the gdp.nn contract (parameter_names / parameters / gradients by name).
--
--   local optim = require("gdp.optim")
--   local opt = optim.AdamW(model, {lr = 1e-3, weight_decay = 0.1, no_decay = {"bias", "A_log"}})
--   local lr_at = optim.schedule.cosine{lr = 1e-3, total_steps = 1000, warmup_steps = 50}
--   opt:set_lr(lr_at(opt:steps() + 1))
--   local norm = optim.clip_grad_norm(model, 1.0)   -- the norm before clipping
--   opt:step()
--
-- The updates are fused kernels of libgdp (gdp_optim_adamw_step, gdp_optim_sgd_step) on
-- the parameters' device; bf16 parameters get float32 master weights.
local tensor = require("gdp.tensor")

local M = {}

M.Optimizer = require("gdp.optim.Optimizer")
M.AdamW = require("gdp.optim.AdamW")
M.SGD = require("gdp.optim.SGD")
M.schedule = require("gdp.optim.schedule")

-- The global L2 norm of the gradients, sqrt(sum over tensors of ||g||^2) (one float64
-- reduction per tensor on its device, one read-back per device: gdp.sumsq_many),
-- returned before clipping; when max_norm is given
-- and the norm exceeds it, every gradient is scaled in place by max_norm / (norm + 1e-6)
-- (torch's clip_grad_norm_).  A non-finite norm leaves the gradients alone and is
-- returned as it is: the caller decides (gdp.train stops with an error).
-- `grads` is a module (its gradients()) or a table name -> tensor.
function M.clip_grad_norm(grads, max_norm)
  local fn = "optim.clip_grad_norm"
  if type(grads) == "table" and type(grads.gradients) == "function" then grads = grads:gradients() end
  if type(grads) ~= "table" then
    tensor.argerror(fn, "grads: expected a module or a table name -> tensor, got " .. type(grads))
  end
  if max_norm ~= nil and (type(max_norm) ~= "number" or not (max_norm > 0) or max_norm == math.huge) then
    tensor.argerror(fn, "max_norm: expected a finite number > 0 (or nil: only measure), got " .. tostring(max_norm))
  end
  local names = {}
  for name, g in pairs(grads) do
    tensor.tensor_arg(g, fn, "grads." .. tostring(name))
    names[#names + 1] = name
  end
  table.sort(names) -- a fixed summation order: the same norm whatever the table's order
  -- each device's squared norms in one read-back (a norm per tensor would wait on the
  -- device once each), summed in name order
  local by_device, sq = {}, {}
  for _, name in ipairs(names) do
    local d = grads[name]:device()
    local group = by_device[d]
    if group == nil then
      group = { names = {}, tensors = {} }
      by_device[d] = group
    end
    group.names[#group.names + 1] = name
    group.tensors[#group.tensors + 1] = grads[name]
  end
  for _, group in pairs(by_device) do
    local s = tensor.sumsq_many(group.tensors)
    for i, name in ipairs(group.names) do sq[name] = s[i] end
  end
  local sumsq = 0
  for _, name in ipairs(names) do sumsq = sumsq + sq[name] end
  local norm = math.sqrt(sumsq)
  if max_norm and norm == norm and norm ~= math.huge and norm > max_norm then
    local coef = max_norm / (norm + 1e-6)
    for _, name in ipairs(names) do grads[name]:scale_(coef) end
  end
  return norm
end

return M
