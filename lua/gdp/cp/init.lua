-- gdp.cp: context parallelism of the Gated DeltaProduct mixer (docs/design.md section 4).
--
--   local gdp = require("gdp")
--   local group = gdp.comm.world()
--   -- headwise all-to-all (Megatron's GDPContextParallel):
--   local hcp = gdp.cp.GDPContextParallel{cp_group = group, d_inner_local_tp = ..., ...}
--   -- chunkwise state passing:
--   local o, saved = gdp.cp.gdp_chunkwise_context_parallel(q, k, v, g, beta, cu, n, scale,
--                                                          group, gdp.cp.cpu_backend(), p, f)
--   -- or the whole layer: gdp.nn.GatedDeltaProduct{..., cp_mode = "chunkwise", cp_group = group}
--   -- sharding helpers: gdp.cp.shard.split / gather
--   -- where CP time goes: gdp.cp.timing.set({}) (stage name -> seconds; nil: off)
--
-- Which to choose: chunkwise moves a fixed 4*cp*H*K*(K+V) bytes per layer and direction
-- (independent of the sequence length, any cp); headwise moves activations (grows with
-- the sequence length) and needs cp <= num_heads, but runs the unmodified operator on
-- whole sequences.  See README.md, "Context parallelism".
local tensor = require("gdp.tensor")
local shard = require("gdp.cp.shard")
local chunkwise = require("gdp.cp.chunkwise")
local headwise = require("gdp.cp.headwise")
local timing = require("gdp.cp.timing")

local M = {}

M.shard = shard
M.chunkwise = chunkwise
M.headwise = headwise
M.timing = timing -- the optional stage clock (off by default)

M.GDPContextParallel = headwise.GDPContextParallel

M.gdp_chunkwise_context_parallel = chunkwise.gdp_chunkwise_context_parallel
M.gdp_chunkwise_context_parallel_backward = chunkwise.gdp_chunkwise_context_parallel_backward
M.cpu_backend = chunkwise.cpu_backend
M.packed_sequence_cp_metadata = chunkwise.packed_sequence_cp_metadata
M.unpacked_cp_metadata = chunkwise.unpacked_cp_metadata
M.conv_halo_exchange = chunkwise.conv_halo_exchange
M.conv_halo_exchange_backward = chunkwise.conv_halo_exchange_backward

-- Layer support (used by gdp.nn.GatedDeltaProduct with cp_mode set).
M.MODES = { headwise = true, chunkwise = true }

-- A string's digest as an integer below 2^53 (exact in a double and an int64).
local function digest(str)
  local h1, h2 = 5381, 7
  for i = 1, #str do
    local b = str:byte(i)
    h1 = (h1 * 33 + b) % 4294967291
    h2 = (h2 * 131 + b) % 2097143
  end
  return h1 * 2097152 + h2
end

-- The module's configuration: every field that is a number, string or boolean (sizes,
-- norm_eps, cp_reduce_grads, dtype, algorithm, ...), sorted by name, as "name=value".
local function config_fields(m)
  local names = {}
  for k, v in pairs(m) do
    local t = type(v)
    if type(k) == "string" and (t == "number" or t == "string" or t == "boolean") then names[#names + 1] = k end
  end
  table.sort(names)
  local values = {}
  for i, k in ipairs(names) do
    local v = m[k]
    values[i] = type(v) == "number" and string.format("%.17g", v) or tostring(v)
  end
  return names, values
end

-- Collective: raises on every rank unless every rank's module has the same
-- configuration, naming the first field that differs (any field that changes the math
-- or the communication: cp_reduce_grads differing would hang the backward, norm_eps
-- differing would silently change the output).  Two small collectives.
function M.agree_config(group, m, fn)
  local names, values = config_fields(m)
  group:agree(fn .. ": the configuration's field names (the same options on every rank)",
              { #names, digest(table.concat(names, ",")) })
  local mine = {}
  for i = 1, #names do mine[i] = digest(values[i]) end
  local all = group:allgather(tensor.tensor(mine, { #names }, { dtype = "i64" })):totable()
  for r = 2, #all do
    for i = 1, #names do
      if all[r][i] ~= all[1][i] then
        tensor.argerror(fn, string.format("configuration differs across ranks: %s differs between " ..
                                          "rank 0 and rank %d (this rank, %d, has %s = %s)",
                                          names[i], r - 1, group:rank(), names[i], values[i]))
      end
    end
  end
end

-- Called by GatedDeltaProduct.new (collective): ranks agree on the configuration, the
-- parameters become identical on all ranks (broadcast from cp rank 0, so that a layer
-- built without a seed is still one layer), then the mode's state is built.
function M.attach(m)
  local group = m.cp_group
  M.agree_config(group, m, "nn.GatedDeltaProduct")
  for _, name in ipairs(m:parameter_names()) do group:broadcast(m.params[name], 0) end
  if m.cp_mode == "headwise" then headwise.attach(m) else chunkwise.attach(m) end
end

function M.layer_forward(module, x, cu_seqlens)
  if module.cp_mode == "headwise" then return headwise.layer_forward(module, x, cu_seqlens) end
  return chunkwise.layer_forward(module, x, cu_seqlens)
end

-- Sums the step's parameter gradients over the group with one all-reduce of a flat
-- buffer per gradient dtype (a bf16 layer keeps A_log's and dt_bias's in float32), then
-- adds them into the module's accumulated gradients.
local function reduce_into(m, scratch, target)
  local names = m:parameter_names()
  local groups, order = {}, {}
  for _, name in ipairs(names) do
    local dt = scratch[name]:dtype()
    if groups[dt] == nil then
      groups[dt] = { names = {}, total = 0 }
      order[#order + 1] = dt
    end
    local grp = groups[dt]
    grp.names[#grp.names + 1] = name
    grp.total = grp.total + scratch[name]:numel()
  end
  for _, dt in ipairs(order) do -- the same order on every rank: parameter_names' order
    local grp = groups[dt]
    local flat = tensor.empty({ grp.total }, { dtype = dt, device = m.device })
    local pos = 0
    for _, name in ipairs(grp.names) do
      local g = scratch[name]
      flat:narrow(1, pos + 1, g:numel()):copy(g:reshape(g:numel()))
      pos = pos + g:numel()
    end
    m.cp_group:all_reduce(flat, "sum")
    pos = 0
    for _, name in ipairs(grp.names) do
      local g = target[name]
      g:add_(flat:narrow(1, pos + 1, g:numel()):view(g:shape()))
      pos = pos + g:numel()
    end
  end
end

-- Backward of the rank-local output: returns the rank-local dx.  The step's parameter
-- gradients go to scratch buffers first; with cp_reduce_grads (default) they are summed
-- over the group before they are added to m:gradients(), so that every rank ends with
-- the gradients of the cp = 1 layer on the global batch.
function M.layer_backward(m, dy)
  local target = m.grads
  local scratch = m.cp_scratch
  if scratch == nil then
    scratch = {}
    for name, t in pairs(target) do
      scratch[name] = tensor.zeros(t:shape(), { dtype = t:dtype(), device = t:device() })
    end
    m.cp_scratch = scratch
  else
    for _, t in pairs(scratch) do t:zero() end
  end
  m.grads = scratch
  local ok, dx = pcall(m.cp_mode == "headwise" and headwise.layer_backward or chunkwise.layer_backward,
                       m, dy)
  m.grads = target
  if not ok then error(dx, 0) end
  local b0 = m.cp_group:bytes()
  if m.cp_reduce_grads then
    reduce_into(m, scratch, target)
  else
    for name, t in pairs(target) do t:add_(scratch[name]) end
  end
  local b1 = m.cp_group:bytes()
  if m.cp_bytes then
    m.cp_bytes.grad_reduce = (b1.sent - b0.sent) + (b1.received - b0.received)
  end
  return dx
end

return M
