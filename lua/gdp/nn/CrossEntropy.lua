-- gdp.nn.CrossEntropy: the mean token cross-entropy as a module (the function is
-- nn.functional.cross_entropy; gdp.h, gdp_nn_cross_entropy).
--
--   local crit = nn.CrossEntropy{ignore_index = -100}
--   local loss, loss_t = crit:forward(logits, targets, mask)   -- a number and a [1] tensor
--   local dlogits = crit:backward(logits, targets, mask)       -- d(mean loss)/d logits
--   local loss_t = crit:forward_tensor(logits, targets, mask)  -- no read back (cuda: no wait)
--
-- logits [..., V] (f64/f32, bf16 on cuda: computed in float32); targets i32/i64 of the
-- leading shape; mask (optional) of the targets' shape: rows where it is 0 do not
-- count, nor rows whose target is ignore_index.  The mean is over the counted rows
-- (crit.count after forward); 0 when none counts.  forward computes the gradient too,
-- and backward returns it when called with the same tensors (unwritten since).
-- forward_tensor leaves the loss on the logits' device, [1] float64 (crit.result: [2],
-- the loss and the counted rows; crit.loss and crit.count are nil): on cuda it queues
-- its work without waiting, and a bad target is reported by the next op that waits
-- (gdp.h, "model layer ops"), as gdp.train.step does once a step for loss and norms.
local tensor = require("gdp.tensor")
local util = require("gdp.util")
local Module = require("gdp.nn.Module")
local F = require("gdp.nn.functional")


local CrossEntropy = Module.class("CrossEntropy")
local FN = CrossEntropy.FN

local keys = { ignore_index = true }

function CrossEntropy.new(cfg)
  cfg = Module.options(FN, cfg, keys)
  local self = setmetatable({}, CrossEntropy)
  local ii = cfg.ignore_index
  if ii == nil then ii = -100 end
  util.int_arg(FN, "ignore_index", ii)
  self.ignore_index = ii
  self.params, self.grads, self.param_order = {}, {}, {}
  return self
end

-- (Module.cache_for: by object and write count, no read of their values)
local function key_of(targets, mask)
  return { targets, targets:version(), mask or false, mask and mask:version() or 0 }
end

-- The loss and its gradient queued (method: the caller's name, for messages).
local function queue(self, method, logits, targets, mask)
  tensor.tensor_arg(logits, FN .. method, "logits")
  tensor.tensor_arg(targets, FN .. method, "targets")
  local result, dlogits = F.cross_entropy_result(logits, targets,
                                                 { ignore_index = self.ignore_index, mask = mask })
  self.result, self.count, self.loss = result, nil, nil
  Module.set_cache(self, logits, key_of(targets, mask), { dlogits = dlogits })
  self.output = result:narrow(1, 1, 1)
  return self.output
end

function CrossEntropy:forward_tensor(logits, targets, mask)
  return queue(self, ":forward_tensor", logits, targets, mask)
end

function CrossEntropy:forward(logits, targets, mask)
  queue(self, ":forward", logits, targets, mask)
  local host = self.result:cpu() -- one read back for both
  self.loss, self.count = host:get(1), host:get(2)
  return self.loss, self.output
end

function CrossEntropy:backward(logits, targets, mask)
  tensor.tensor_arg(logits, FN .. ":backward", "logits")
  tensor.tensor_arg(targets, FN .. ":backward", "targets")
  local c = Module.cache_for(self, logits, key_of(targets, mask))
  if c == nil then
    self:forward(logits, targets, mask)
    c = self.cache
  end
  self.grad_input = c.dlogits
  return c.dlogits
end

function CrossEntropy:__tostring()
  return string.format("nn.CrossEntropy(ignore_index %d)", self.ignore_index)
end

return CrossEntropy
