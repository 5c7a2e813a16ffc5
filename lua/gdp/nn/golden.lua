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

-- Returns rows {name, err, tol, ok} for out, grad.x and grad.<param> of every
-- parameter, plus timings {fwd_ms, bwd_ms}.  opts: dtype ("f64"), device ("cpu"; the
-- file's tensors are copied there), tol (M.TOLERANCE[dtype]).  A gradient in the file that the module
-- lacks, or a parameter whose gradient the file lacks, is a failing row (err NaN).
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

  local rows = {}
  local function row(name, got, ref)
    local err = 0 / 0
    if got ~= nil and ref ~= nil then
      err = gdp.rel_error(got:to({ dtype = "f64", device = "cpu" }), ref:to({ dtype = "f64", device = "cpu" }))
    end
    rows[#rows + 1] = { name = name, err = err, tol = tol, ok = err <= tol }
  end
  row("out", out, t.out)
  row("grad.x", dx, t["grad.x"])
  local grads, params = m:gradients(), m:parameters()
  for _, name in ipairs(m:parameter_names()) do row("grad." .. name, grads[name], t["grad." .. name]) end
  local names = {}
  for name in pairs(t) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local p = name:match("^grad%.(.+)$")
    if p and p ~= "x" and params[p] == nil then row(name .. " (not in the module)", nil, t[name]) end
  end
  return rows, { fwd_ms = (t1 - t0) * 1e3, bwd_ms = (t2 - t1) * 1e3 }
end

return M
