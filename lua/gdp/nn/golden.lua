-- gdp.nn.golden: runs a golden mixer case (spec/fixtures/golden/mixer_*.safetensors;
-- format in that folder's README) through nn.GatedDeltaProduct and reports the
-- relative error of the output, the input gradient and every parameter gradient.
-- Shared by spec/mixer_spec.lua and experiments/check_reference.lua, so that both
-- check the same things the same way.
local gdp = require("gdp")
local GatedDeltaProduct = require("gdp.nn.GatedDeltaProduct")

local M = {}

M.TOLERANCE = { f64 = 1e-10, f32 = 1e-4, bf16 = 1e-2 }

-- The module a golden file's metadata describes (Megatron's mixer: no D), of `dtype`
-- on `device` (nil: cpu).
function M.module_for(meta, dtype, device)
  return GatedDeltaProduct{
    hidden_size = tonumber(meta.d_model), num_heads = tonumber(meta.nheads),
    head_dim = tonumber(meta.headdim), num_groups = tonumber(meta.ngroups),
    state_dim = tonumber(meta.d_state), num_householder = tonumber(meta.num_householder),
    conv_width = tonumber(meta.d_conv), conv_bias = meta.conv_bias == "true",
    allow_neg_eigval = tonumber(meta.beta_scale) == 2, norm_eps = tonumber(meta.norm_eps),
    dtype = dtype, device = device,
  }
end

local function rounded(v, dtype) return v:to({ dtype = dtype }):to({ dtype = "f64" }) end

-- The case's parameters for the float64 layer `ref`, rounded to what `m` holds.
local function rounded_params(t, ref, m)
  local params = {}
  for _, name in ipairs(ref:parameter_names()) do
    if t[name] ~= nil then params[name] = rounded(t[name], m:param_dtype(name)) end
  end
  return params
end

-- out, grad.x and grad.<param> of the float64 layer `ref` on x and dy rounded to m's dtype.
local function reference_run(ref, t, m)
  local x, dy = rounded(t.x, m.dtype), rounded(t.dy, m.dtype)
  local out = { out = ref:forward(x, t.cu_seqlens), ["grad.x"] = ref:backward(x, dy, t.cu_seqlens) }
  for name, g in pairs(ref:gradients()) do out["grad." .. name] = g end
  return out
end

-- The float64 CPU layer's out, grad.x and grad.<param> on the case's x, dy and
-- parameters rounded to what `m` holds (its dtype; its float32 parameters in float32).
local function rounded_input_reference(t, meta, m)
  local ref = M.module_for(meta, "f64", "cpu")
  ref:set_parameters(rounded_params(t, ref, m), false)
  return reference_run(ref, t, m)
end

-- The layer's stage methods whose results a bf16 layer hands on as bf16 tensors (the
-- decay gate g and its gradient dg in float32, as in the layer).
local STORED_STAGES = { "in_proj_forward", "conv_forward", "ssm_inputs", "ssm_forward", "out_forward",
                        "out_backward", "ssm_backward", "ssm_inputs_backward", "conv_backward" }
local FLOAT32_STORED = { g = true, dg = true }

local function stored(v, dtype, key)
  if gdp.is_tensor(v) then
    local to = dtype == "bf16" and FLOAT32_STORED[key] and "f32" or dtype
    return v:to({ dtype = to }):to({ dtype = "f64" })
  end
  if type(v) ~= "table" then return v end
  local o = {}
  for k, x in pairs(v) do o[k] = stored(x, dtype, k) end
  return o
end

-- The destinations some backward stages write in place (sections of the in_proj
-- gradient), by argument position after self: a tensor or a table of tensors.
local IN_PLACE_ARG = { out_backward = 5, ssm_inputs_backward = 5, conv_backward = 8 }

local function round_in_place(v, dtype)
  if gdp.is_tensor(v) then
    v:copy(stored(v, dtype))
  elseif type(v) == "table" then
    for _, x in pairs(v) do round_in_place(x, dtype) end
  end
end

-- The float64 cpu layer of rounded_input_reference with every tensor a stage hands to
-- the next rounded to `dtype` (g, dg to float32) -- the layer's storage, in exact
-- arithmetic: the error that storing those tensors in bf16 makes by itself, the floor
-- below which no layer with that storage (Megatron's has the same) can go.  out_forward's
-- saved intermediates stay exact (the kernels keep them only to recompute).  What a
-- stage writes into a destination argument (IN_PLACE_ARG) is rounded there as well.
function M.storage_floor_reference(t, meta, m)
  local model = M.module_for(meta, "f64", "cpu")
  model:set_parameters(rounded_params(t, model, m), false)
  for _, name in ipairs(STORED_STAGES) do
    local stage = model[name]
    model[name] = function(self, ...)
      local r = { stage(self, ...) }
      for i = 1, (name == "out_forward" and 1 or #r) do r[i] = stored(r[i], m.dtype) end
      if IN_PLACE_ARG[name] and select("#", ...) >= IN_PLACE_ARG[name] then
        round_in_place((select(IN_PLACE_ARG[name], ...)), m.dtype)
      end
      return unpack(r)
    end
  end
  return reference_run(model, t, m)
end

-- Returns rows {name, err, tol, ok, err_file} for out, grad.x and grad.<param> of every
-- parameter, plus timings {fwd_ms, bwd_ms}.  opts: dtype ("f64"), device ("cpu"; the
-- file's tensors are copied there), tol (M.TOLERANCE[dtype]).  A gradient in the file that the module
-- lacks, or a parameter whose gradient the file lacks, is a failing row (err NaN).
--
-- Below float64 the gated error `err` is against the float64 layer run on the inputs as
-- the layer holds them (x, dy and every parameter rounded to its dtype), and `err_file`
-- against the file.  Rounding the inputs alone moves a bf16 case's gradients by more than
-- 1e-2 of the file's values (grad.x 1.0e-2, grad.dt_bias 1.7e-2 on mixer_m2_g2, computed
-- exactly in float64), so no bf16 layer can meet 1e-2 against the file; the rounded-input
-- reference measures what the layer's own arithmetic adds.  The f64 rows (the CPU
-- layer against the file at 1e-10) tie that reference to the file.  In bf16, err_floor
-- is storage_floor_reference's error against the same reference: what bf16 storage
-- between the stages costs in exact arithmetic (an err near it is storage, not the
-- kernels; mixer_m3_packed_bias_neg's gradients have floors above 1e-2).
function M.check_case(t, meta, opts)
  opts = opts or {}
  local dtype = opts.dtype or "f64"
  local tol = opts.tol or M.TOLERANCE[dtype]
  if not tol then
    error("gdp.nn.golden.check_case: dtype: expected f64, f32 or bf16, got " .. tostring(dtype), 2)
  end
  local device = opts.device or "cpu"
  local m = M.module_for(meta, dtype, device)
  m:set_parameters(t, false)
  local x = t.x:to({ dtype = dtype, device = device })
  local dy = t.dy:to({ dtype = dtype, device = device })
  local ctx = gdp.device(device)
  ctx:sync()
  local t0 = gdp.time()
  local out = m:forward(x, t.cu_seqlens)
  ctx:sync()
  local t1 = gdp.time()
  local dx = m:backward(x, dy, t.cu_seqlens)
  ctx:sync()
  local t2 = gdp.time()

  local ref, floor = t, nil
  if dtype ~= "f64" then ref = rounded_input_reference(t, meta, m) end
  if dtype == "bf16" then floor = M.storage_floor_reference(t, meta, m) end

  local rows = {}
  local function rel(got, want)
    if got == nil or want == nil then return 0 / 0 end
    return gdp.rel_error(got:to({ dtype = "f64", device = "cpu" }), want:to({ dtype = "f64", device = "cpu" }))
  end
  local function row(name, got)
    local err = rel(got, ref[name])
    rows[#rows + 1] = { name = name, err = err, tol = tol, ok = err <= tol, err_file = rel(got, t[name]),
                        err_floor = floor and rel(floor[name], ref[name]) or nil }
  end
  row("out", out)
  row("grad.x", dx)
  local grads, params = m:gradients(), m:parameters()
  for _, name in ipairs(m:parameter_names()) do row("grad." .. name, grads[name]) end
  local names = {}
  for name in pairs(t) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local p = name:match("^grad%.(.+)$")
    if p and p ~= "x" and params[p] == nil then
      rows[#rows + 1] = { name = name .. " (not in the module)", err = 0 / 0, tol = tol, ok = false,
                          err_file = 0 / 0 }
    end
  end
  return rows, { fwd_ms = (t1 - t0) * 1e3, bwd_ms = (t2 - t1) * 1e3 }
end

return M
