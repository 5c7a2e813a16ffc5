-- gdp.optim.schedule: learning rates as functions of the step.  Each constructor
-- returns a function lr(step) for the 1-based number of the step about to be taken, so a
-- run resumed at step s + 1 gets the rate the uninterrupted run had there.
--
--   local S = gdp.optim.schedule
--   S.constant{lr = 1e-3}                                        -- lr
--   S.linear_warmup{lr = 1e-3, warmup_steps = 100}               -- lr * min(1, step / warmup)
--   S.cosine{lr = 1e-3, total_steps = 1000, warmup_steps = 100, min_lr = 1e-5}
--   -- warmup as above, then min_lr + (lr - min_lr) (1 + cos(pi p)) / 2 with
--   -- p = (step - warmup) / (total - warmup) clamped to [0, 1]: lr right after the
--   -- warmup, min_lr at total_steps and after.
local tensor = require("gdp.tensor")
local util = require("gdp.util")

local argerror = tensor.argerror

local M = {}

local number, integer = util.num_option, util.int_option

local function check_step(fn, step)
  if type(step) ~= "number" or step < 1 or step ~= math.floor(step) then
    argerror(fn, "step: expected the 1-based step number, an integer >= 1, got " .. tostring(step))
  end
end

local function warmup_factor(step, warmup)
  if warmup > 0 and step < warmup then return step / warmup end
  return 1
end

function M.constant(cfg)
  local fn = "optim.schedule.constant"
  cfg = tensor.check_opts(fn, cfg, { lr = true })
  local lr = number(fn, cfg, "lr", nil, 0)
  return function(step)
    check_step(fn, step)
    return lr
  end
end

function M.linear_warmup(cfg)
  local fn = "optim.schedule.linear_warmup"
  cfg = tensor.check_opts(fn, cfg, { lr = true, warmup_steps = true })
  local lr = number(fn, cfg, "lr", nil, 0)
  local warmup = integer(fn, cfg, "warmup_steps", nil, 0)
  return function(step)
    check_step(fn, step)
    return lr * warmup_factor(step, warmup)
  end
end

function M.cosine(cfg)
  local fn = "optim.schedule.cosine"
  cfg = tensor.check_opts(fn, cfg, { lr = true, total_steps = true, warmup_steps = true, min_lr = true })
  local lr = number(fn, cfg, "lr", nil, 0)
  local total = integer(fn, cfg, "total_steps", nil, 1)
  local warmup = integer(fn, cfg, "warmup_steps", 0, 0)
  local min_lr = number(fn, cfg, "min_lr", 0, 0)
  if warmup >= total then
    argerror(fn, string.format("warmup_steps: expected fewer than total_steps = %d, got %d", total, warmup))
  end
  if min_lr > lr then
    argerror(fn, string.format("min_lr: expected at most lr = %g, got %g", lr, min_lr))
  end
  return function(step)
    check_step(fn, step)
    if step < warmup then return lr * warmup_factor(step, warmup) end
    local p = math.min(1, (step - warmup) / (total - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * p))
  end
end

return M
