-- gdp.data: synthetic training data and its metric (gdp.h, "synthetic data";
-- docs/design.md section 7).
--
--   local data = require("gdp.data")             -- also gdp.data
--   local tokens, labels = data.state_tracking{task = "S5", batch = 2048, length = 128,
--                                              seed = 1, offset = 0, device = "cuda"}
--   -- tokens, labels: i32 [batch, length]; labels[b][t] = tokens[b][1] * ... * tokens[b][t]
--   data.num_classes("S5")                        --> 120 (token and label values 0..119)
--   data.permutation("S3", 1)                     --> {0, 2, 1}: element 1 in one-line notation
--   local acc = data.sequence_accuracy(predictions, labels)
--   acc.cumulative[128]   -- the fraction of sequences right at every token 1..128
--   acc.per_token[128]    -- the fraction right at token 128
--   acc.token             -- the mean of per_token
--
-- Tasks: "parity" (tokens 0/1, label = prefix parity), "modular_addition" (modulus = m:
-- label = prefix sum mod m), "S3", "S4", "A5", "S5" (group word problems: token = an
-- element's index, label = the index of the prefix product).  Sequence s of a set is a
-- function of (seed, s) only, s = offset + row - 1: consecutive batches of one set take
-- offsets 0, B, 2B, ...; a test set takes another seed (or a disjoint offset range) and
-- any length, and the first T tokens of a sequence are the same at every length.
local ffi = require("ffi")
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")
local util = require("gdp.util")

local argerror, check, call_outputs = tensor.argerror, tensor.check, tensor.call_outputs

local M = {}

M.TASKS = { "parity", "modular_addition", "S3", "S4", "A5", "S5" }

local tensor_box = ffi.typeof("gdp_tensor *[1]")
local task_box = ffi.typeof("gdp_state_task[1]")
local i64_box = ffi.typeof("int64_t[1]")

local function task_arg(fn, task)
  if type(task) ~= "string" then
    argerror(fn, "task: expected one of " .. table.concat(M.TASKS, ", ") .. ", got " .. tostring(task))
  end
  local box = task_box()
  check(lib.gdp_state_task_from_name(task, box), fn)
  return box[0]
end

local function int_arg(fn, what, v, min, default)
  if v == nil then v = default end
  return util.int_arg(fn, what, v, min)
end

-- The modulus the C API takes: m for modular_addition (required), 0 for the others.
local function modulus_arg(fn, task, modulus)
  if task == "modular_addition" then return int_arg(fn, "modulus", modulus, 2) end
  if modulus ~= nil then
    argerror(fn, "modulus: only task modular_addition takes one, got task " .. task ..
                 " with modulus " .. tostring(modulus))
  end
  return 0
end

-- The group's order: token and label values are 0 .. num_classes - 1.
function M.num_classes(task, modulus)
  local fn = "data.num_classes"
  local t = task_arg(fn, task)
  local out = i64_box()
  check(lib.gdp_state_task_size(t, modulus_arg(fn, task, modulus), out), fn)
  return tonumber(out[0])
end

-- Element `index` (0-based, as tokens are) of a permutation-group task in one-line
-- notation: a table p of its degree's length with p[i + 1] = image of i (0-based).
function M.permutation(task, index)
  local fn = "data.permutation"
  local t = task_arg(fn, task)
  local perm, degree = ffi.new("int32_t[5]"), ffi.new("int32_t[1]")
  check(lib.gdp_state_task_permutation(t, int_arg(fn, "index", index, 0), perm, degree), fn)
  local out = {}
  for i = 0, degree[0] - 1 do out[i + 1] = perm[i] end
  return out
end

local st_keys = { task = true, batch = true, length = true, seed = true, offset = true,
                  modulus = true, device = true }

-- tokens, labels: i32 [batch, length] on `device` (default "cpu").
function M.state_tracking(opts)
  local fn = "data.state_tracking"
  if type(opts) ~= "table" then
    argerror(fn, "expected an options table {task =, batch =, length =, seed =, offset =, device =}")
  end
  tensor.check_opts(fn, opts, st_keys)
  local task = task_arg(fn, opts.task)
  local modulus = modulus_arg(fn, opts.task, opts.modulus)
  local batch = int_arg(fn, "batch", opts.batch, 0)
  local length = int_arg(fn, "length", opts.length, 0)
  if opts.seed == nil then argerror(fn, "seed: expected an integer >= 0 (the set's seed), got nil") end
  local seed = int_arg(fn, "seed", opts.seed, 0)
  local offset = int_arg(fn, "offset", opts.offset, 0, 0)
  local ctx = tensor.get_ctx(fn, opts.device)
  local tok, lab = tensor_box(), tensor_box()
  return call_outputs(fn, "gdp_data_state_tracking", { tok, lab }, ctx, task, modulus, batch, length,
                      ffi.cast("uint64_t", seed), ffi.cast("uint64_t", offset), tok, lab)
end

-- {cumulative = {T values}, per_token = {T values}, token = mean of per_token} for
-- predictions (i32/i64 classes [B,T] or float scores [B,T,C], argmax taken) against
-- labels [B,T]; index t is the prefix length / the token, 1-based.
function M.sequence_accuracy(predictions, labels)
  local fn = "data.sequence_accuracy"
  tensor.tensor_arg(predictions, fn, "predictions")
  tensor.tensor_arg(labels, fn, "labels")
  local T = labels:dim() == 2 and labels:size(2) or 0
  local cum, per = ffi.new("double[?]", T + 1), ffi.new("double[?]", T + 1)
  check(lib.gdp_data_sequence_accuracy(predictions, labels, T, cum, per), fn)
  local out = { cumulative = {}, per_token = {}, token = 0 }
  for t = 1, T do
    out.cumulative[t], out.per_token[t] = cum[t - 1], per[t - 1]
    out.token = out.token + per[t - 1] / T
  end
  if T == 0 then out.token = 0 / 0 end
  return out
end

return M
