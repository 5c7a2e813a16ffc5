-- gdp.optim.Optimizer: what AdamW and SGD share -- the parameters of a module taken by
-- name, per-parameter state tensors, float32 master weights for bf16 parameters,
-- per-name weight decay, and the state as tensors and metadata for checkpoints.
--
-- A concrete optimiser sets `kind` ("AdamW", "SGD"), `state_names` (the tensors each
-- parameter keeps, e.g. {"exp_avg", "exp_avg_sq"}) and `update(self, name, param, grad,
-- state, weight_decay)`, which runs the fused kernel for one parameter.
--
-- The module follows the gdp.nn contract: parameter_names(), parameters() (name ->
-- live tensor), gradients() (name -> gradient of the parameter's shape).  Parameters
-- are looked up by name at every step, so a module that replaces a tensor is followed.
--
-- Masters.  A bf16 parameter's optimiser keeps a float32 master copy: the update runs
-- on it and writes the bf16 tensor from it.  When the parameter is written by anyone
-- else between two steps (set_parameters, a load, a manual copy: its write counter,
-- t:version(), moved), the next step first takes the master from the new bf16 values.
-- Writes through raw data pointers are not seen.
local tensor = require("gdp.tensor")
local util = require("gdp.util")

local argerror = tensor.argerror

local Optimizer = {}
Optimizer.__index = Optimizer

-- The dtype of the moments and masters of a parameter.
local function state_dtype(param_dtype)
  return param_dtype == "f64" and "f64" or "f32"
end

-- v (nil: default) as a number in [lo, hi] or [lo, hi); `key` names it in the error.
local function check_number(fn, key, v, default, lo, hi, hi_open)
  if v == nil then v = default end
  local ok = type(v) == "number" and v == v and v >= lo and (hi_open and v < hi or (not hi_open and v <= hi))
  if not ok then
    argerror(fn, string.format("%s: expected a number in [%g, %g%s, got %s", key, lo, hi,
                               hi_open and ")" or "]", tostring(v)))
  end
  return v
end
Optimizer.check_number = check_number

-- True when `entry` names parameter `name`: the whole name, or its last dotted parts
-- ("A_log" names "layers.0.mixer.A_log", "norm.weight" names "layers.1.norm.weight").
local function names_param(entry, name)
  if entry == name then return true end
  return #name > #entry and name:sub(-#entry - 1) == "." .. entry
end

-- Weight decay of each parameter: cfg.weight_decay, or 0 for the names that
-- cfg.no_decay lists (a list of names or dotted suffixes, or a function(name, tensor)
-- -> true for no decay).  A list entry that names no parameter is an error (a typo
-- would otherwise decay what it meant to spare).
local function decay_table(fn, names, params, cfg, weight_decay)
  local out = {}
  local nd = cfg.no_decay
  if nd ~= nil and type(nd) ~= "table" and type(nd) ~= "function" then
    argerror(fn, "no_decay: expected a list of parameter names or suffixes, or a function(name, tensor), got " ..
                 type(nd))
  end
  local used = {}
  for _, name in ipairs(names) do
    local spared = false
    if type(nd) == "function" then
      spared = nd(name, params[name]) == true
    elseif nd then
      for i, entry in ipairs(nd) do
        if type(entry) ~= "string" then
          argerror(fn, string.format("no_decay[%d]: expected a string, got %s", i, type(entry)))
        end
        if names_param(entry, name) then
          spared = true
          used[i] = true
        end
      end
    end
    out[name] = spared and 0 or weight_decay
  end
  if type(nd) == "table" then
    for i, entry in ipairs(nd) do
      if not used[i] then
        argerror(fn, string.format("no_decay[%d]: '%s' names no parameter of the module (names: %s)",
                                   i, entry, table.concat(names, ", ")))
      end
    end
  end
  return out
end

-- Common construction: self.model, self.names, self.lr, self.decay, self.state.
function Optimizer.init(self, fn, model, cfg, allowed)
  if type(model) ~= "table" or type(model.parameter_names) ~= "function"
      or type(model.parameters) ~= "function" or type(model.gradients) ~= "function" then
    argerror(fn, "model: expected a module with parameter_names(), parameters() and gradients(), got " ..
                 type(model))
  end
  cfg = tensor.check_opts(fn, cfg, allowed)
  self.fn = fn
  self.model = model
  self.names = model:parameter_names()
  if #self.names == 0 then argerror(fn, "model: the module has no parameters") end
  self.lr = check_number(fn, "lr", cfg.lr, nil, 0, math.huge, true)
  self.weight_decay = check_number(fn, "weight_decay", cfg.weight_decay, 0, 0, math.huge, true)
  local params = model:parameters()
  self.decay = decay_table(fn, self.names, params, cfg, self.weight_decay)
  self.step_count = 0
  self.state = {}
  for _, name in ipairs(self.names) do
    local p = params[name]
    tensor.tensor_arg(p, fn, "parameter " .. name)
    local st = { dtype = state_dtype(p:dtype()) }
    local opts = { dtype = st.dtype, device = p:device() }
    for _, s in ipairs(self.state_names) do st[s] = tensor.zeros(p:shape(), opts) end
    if p:dtype() == "bf16" then
      st.master = p:to(opts)
      st.seen_version = p:version()
    end
    self.state[name] = st
  end
  return cfg
end

function Optimizer:set_lr(lr)
  if type(lr) ~= "number" or not (lr >= 0) or lr == math.huge then
    argerror(self.fn .. ":set_lr", "lr: expected a finite number >= 0, got " .. tostring(lr))
  end
  self.lr = lr
end

function Optimizer:get_lr() return self.lr end

-- The number of steps taken (the next step is step_count + 1).
function Optimizer:steps() return self.step_count end

-- One update of every parameter from its accumulated gradient.
function Optimizer:step()
  local params, grads = self.model:parameters(), self.model:gradients()
  self.step_count = self.step_count + 1
  for _, name in ipairs(self.names) do
    local p, g, st = params[name], grads[name], self.state[name]
    if p == nil then argerror(self.fn .. ":step", "parameter " .. name .. " is missing from the module") end
    if g == nil then argerror(self.fn .. ":step", "gradient of " .. name .. " is missing (gradients())") end
    if st.master then
      if p:version() ~= st.seen_version then st.master:copy(p) end
    end
    self:update(name, p, g, st, self.decay[name])
    if st.master then st.seen_version = p:version() end
  end
end

-- Checkpoint form: tensors "<param name>.<state>" (exp_avg, exp_avg_sq, master,
-- momentum_buffer...) and metadata strings (optimiser kind, step, hyperparameters).
function Optimizer:state_tensors()
  local out = {}
  for _, name in ipairs(self.names) do
    local st = self.state[name]
    for _, s in ipairs(self.state_names) do out[name .. "." .. s] = st[s] end
    if st.master then out[name .. ".master"] = st.master end
  end
  return out
end

function Optimizer:state_metadata()
  return { kind = self.kind, step = self.step_count, lr = self.lr, config = self:config() }
end

-- Restores state_tensors() / state_metadata() (as read back from a checkpoint: the
-- metadata's numbers may be strings).  Every state tensor must be present with its
-- shape; the optimiser kind must match.
function Optimizer:load_state(tensors, meta)
  local fn = self.fn .. ":load_state"
  if type(tensors) ~= "table" or type(meta) ~= "table" then
    argerror(fn, "expected (tensors, metadata) tables as state_tensors() and state_metadata() give")
  end
  if meta.kind ~= self.kind then
    argerror(fn, string.format("the state is of optimiser %s, this one is %s", tostring(meta.kind), self.kind))
  end
  local step = tonumber(meta.step)
  if not step or step < 0 or step ~= math.floor(step) then
    argerror(fn, "step: expected an integer >= 0, got " .. tostring(meta.step))
  end
  local params = self.model:parameters()
  for key, dst in pairs(self:state_tensors()) do
    local src = tensors[key]
    if src == nil then argerror(fn, "missing state tensor '" .. key .. "'") end
    tensor.tensor_arg(src, fn, key)
    if tensor.shape_str(src:shape()) ~= tensor.shape_str(dst:shape()) then
      argerror(fn, string.format("%s: expected shape %s, got %s", key, tensor.shape_str(dst:shape()),
                                 tensor.shape_str(src:shape())))
    end
    dst:copy(src)
  end
  for _, name in ipairs(self.names) do
    local st = self.state[name]
    if st.master then st.seen_version = params[name]:version() end
  end
  self.step_count = step
  if meta.lr ~= nil then self:set_lr(tonumber(meta.lr)) end
end

-- Hyperparameters as a JSON text (for run records and checkpoints).
function Optimizer:config()
  local c = self:hyperparameters()
  local decayed = {}
  for _, name in ipairs(self.names) do
    if self.decay[name] == 0 and self.weight_decay > 0 then decayed[#decayed + 1] = name end
  end
  c.no_decay = util.json_array(decayed)
  return util.json_encode(c)
end

return Optimizer
