-- gdp.nn.functional: the mixer layer ops and the model layer ops of libgdp (gdp.h,
-- "mixer layer ops", "model layer ops") as plain functions on tensors, each forward
-- with its backward.  The layers in gdp.nn are built from these; context-parallel
-- variants reuse them between their communication steps.
--
--   local F = require("gdp.nn.functional")
--   local y = F.conv1d(x, w, b, {activation = "silu", cu_seqlens = {0, 5, 9}, halo = h})
--   local g = F.conv1d_backward(x, w, b, dy, {activation = "silu", cu_seqlens = ..., halo = h})
--   -- g.dx, g.dweight, g.dbias (nil without bias), g.dhalo (nil without halo)
--
-- The context is that of the first tensor argument.  Shapes, dtypes and devices are
-- checked by the C library, whose errors name the argument, expected and actual value.
local ffi = require("ffi")
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")
local util = require("gdp.util")
local ops = require("gdp.ops")

local argerror, call_outputs = tensor.argerror, tensor.call_outputs
local tensor_arg = tensor.tensor_arg

local F = {}

local tensor_box = ffi.typeof("gdp_tensor *[1]")

local ACTIVATIONS = { none = lib.GDP_ACT_NONE, silu = lib.GDP_ACT_SILU }

local function opt_tensor(x, fn, what)
  if x == nil then return nil end
  return tensor_arg(x, fn, what)
end

local function number_arg(x, fn, what)
  if type(x) ~= "number" or x ~= x then
    argerror(fn, string.format("%s: expected a number, got %s", what, tostring(x)))
  end
  return x
end

local function int_arg(x, fn, what, min)
  return util.int_arg(fn, what, x, min)
end

-- A Lua table of sequence boundaries becomes an int64 cpu tensor; tensors pass through
-- (the operator's rule, gdp.ops).
function F.seqlens(cu, fn)
  return ops.seqlens_arg(fn or "seqlens", cu)
end

local conv_keys = { activation = true, cu_seqlens = true, halo = true }
local conv_backward_keys = { activation = true, cu_seqlens = true, halo = true, dx = true }

local function conv_opts(fn, opts, keys)
  opts = tensor.check_opts(fn, opts, keys or conv_keys)
  local act = ACTIVATIONS[opts.activation or "none"]
  if act == nil then
    argerror(fn, "activation: expected \"none\" or \"silu\", got " .. tostring(opts.activation))
  end
  return act, F.seqlens(opts.cu_seqlens, fn), opt_tensor(opts.halo, fn, "halo")
end

-- Depthwise causal conv1d over time: x [T,B,C], weight [C,W] or [C,1,W], bias [C] or nil.
-- opts: activation ("none" | "silu"), cu_seqlens (restart at every packed sequence,
-- B = 1), halo [L,B,C] (the tokens before token 0; nil: zeros).
function F.conv1d(x, weight, bias, opts)
  local fn = "nn.functional.conv1d"
  tensor_arg(x, fn, "x")
  tensor_arg(weight, fn, "weight")
  opt_tensor(bias, fn, "bias")
  local act, cu, halo = conv_opts(fn, opts)
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_conv1d_forward", { out }, x:ctx(), x, weight, bias, halo, cu, act, out)
end

-- Backward of sum(conv1d(...) * d_out): {dx, dweight, dbias, dhalo}.  opts as conv1d's,
-- plus dx: a [T,B,C] tensor to write dx into (any strides, e.g. the in_proj gradient's
-- channel slice; it must not overlap the inputs), returned as dx.
function F.conv1d_backward(x, weight, bias, d_out, opts)
  local fn = "nn.functional.conv1d_backward"
  tensor_arg(x, fn, "x")
  tensor_arg(weight, fn, "weight")
  opt_tensor(bias, fn, "bias")
  tensor_arg(d_out, fn, "d_out")
  local act, cu, halo = conv_opts(fn, opts, conv_backward_keys)
  local gx = opt_tensor(opts and opts.dx, fn, "dx") or tensor.empty(x:shape(), { dtype = x:dtype(), device = x:device() })
  local dw, db, dh = tensor_box(), tensor_box(), tensor_box()
  local gw, gb, gh = call_outputs(fn, "gdp_mixer_conv1d_backward", { dw, db, dh }, x:ctx(), x,
                                  weight, bias, halo, cu, act, d_out, gx, dw, db, dh)
  return { dx = gx, dweight = gw, dbias = gb, dhalo = gh }
end

-- beta = scale * sigmoid(b), elementwise.
function F.beta(b, scale)
  local fn = "nn.functional.beta"
  tensor_arg(b, fn, "b")
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_beta_forward", { out }, b:ctx(), b, number_arg(scale or 1, fn, "scale"), out)
end

function F.beta_backward(b, scale, d_beta)
  local fn = "nn.functional.beta_backward"
  tensor_arg(b, fn, "b")
  tensor_arg(d_beta, fn, "d_beta")
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_beta_backward", { out }, b:ctx(), b, number_arg(scale or 1, fn, "scale"),
             d_beta, out)
end

-- x * sigmoid(x), elementwise (q/k/v of a mixer without short conv).
function F.silu(x)
  local fn = "nn.functional.silu"
  tensor_arg(x, fn, "x")
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_silu_forward", { out }, x:ctx(), x, out)
end

-- dx of sum(silu(x) * d_out); written into `into` (x's shape, a view is fine) when given.
function F.silu_backward(x, d_out, into)
  local fn = "nn.functional.silu_backward"
  tensor_arg(x, fn, "x")
  tensor_arg(d_out, fn, "d_out")
  if into ~= nil then tensor_arg(into, fn, "into") end
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_silu_backward", { out }, x:ctx(), x, d_out, into, out)
end

-- g = -exp(A_log[h]) * softplus(a + dt_bias[h]) for a [..., H]; dt_bias may be nil.
function F.decay(a, A_log, dt_bias)
  local fn = "nn.functional.decay"
  tensor_arg(a, fn, "a")
  tensor_arg(A_log, fn, "A_log")
  opt_tensor(dt_bias, fn, "dt_bias")
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_decay_forward", { out }, a:ctx(), a, A_log, dt_bias, out)
end

-- Returns da, dA_log, ddt_bias (nil without dt_bias).
function F.decay_backward(a, A_log, dt_bias, d_g)
  local fn = "nn.functional.decay_backward"
  tensor_arg(a, fn, "a")
  tensor_arg(A_log, fn, "A_log")
  opt_tensor(dt_bias, fn, "dt_bias")
  tensor_arg(d_g, fn, "d_g")
  local da, dA, ddt = tensor_box(), tensor_box(), tensor_box()
  return call_outputs(fn, "gdp_mixer_decay_backward", { da, dA, ddt }, a:ctx(), a, A_log, dt_bias, d_g,
                      da, dA, ddt)
end

-- RMSNorm(y * silu(z)) * weight over the last dim in groups of group_size (z nil: no gate).
function F.gated_rmsnorm(y, z, weight, group_size, eps)
  local fn = "nn.functional.gated_rmsnorm"
  tensor_arg(y, fn, "y")
  opt_tensor(z, fn, "z")
  tensor_arg(weight, fn, "weight")
  group_size = int_arg(group_size or y:size(-1), fn, "group_size", 1)
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_gated_rmsnorm_forward", { out }, y:ctx(), y, z, weight, group_size,
             number_arg(eps or 1e-5, fn, "eps"), out)
end

-- Returns dy, dz (nil without z), dweight.
function F.gated_rmsnorm_backward(y, z, weight, group_size, eps, d_out)
  local fn = "nn.functional.gated_rmsnorm_backward"
  tensor_arg(y, fn, "y")
  opt_tensor(z, fn, "z")
  tensor_arg(weight, fn, "weight")
  tensor_arg(d_out, fn, "d_out")
  group_size = int_arg(group_size or y:size(-1), fn, "group_size", 1)
  local dy, dz, dw = tensor_box(), tensor_box(), tensor_box()
  return call_outputs(fn, "gdp_mixer_gated_rmsnorm_backward", { dy, dz, dw }, y:ctx(), y, z, weight,
                      group_size, number_arg(eps or 1e-5, fn, "eps"), d_out, dy, dz, dw)
end

local function out_norm_args(fn, o, x_v, D, z, weight, group_size, eps)
  tensor_arg(o, fn, "o")
  opt_tensor(x_v, fn, "x_v")
  opt_tensor(D, fn, "D")
  opt_tensor(z, fn, "z")
  tensor_arg(weight, fn, "weight")
  return int_arg(group_size or weight:numel(), fn, "group_size", 1), number_arg(eps or 1e-5, fn, "eps")
end

-- The mixer's output norm: the D skip fused into the gated RMSNorm (gdp.h,
-- gdp_mixer_out_norm_*): gated_rmsnorm(o' + D * x_v, z, weight, group_size, eps) where o'
-- is the operator's output o [B,T,H,P] read as [T,B,H,P]; out [T,B,H*P].  x_v [T,B,H,P]
-- and D [H] | [H*P] both nil: no skip; z [T,B,H*P] or nil: no gate.  Views whose last
-- dim is contiguous are read in place.
function F.out_norm(o, x_v, D, z, weight, group_size, eps)
  local fn = "nn.functional.out_norm"
  local gs, e = out_norm_args(fn, o, x_v, D, z, weight, group_size, eps)
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_out_norm_forward", { out }, o:ctx(), o, x_v, D, z, weight, gs, e, out)
end

-- Backward of sum(out_norm(...) * d_out): {d_o [B,T,H,P] (o's layout), dz (nil without
-- z), dx_v, dD (nil without the skip), dweight}, in one pass.  dz_into (optional): a
-- tensor of z's shape to write dz into (any strides, e.g. the z section of the in_proj
-- gradient; it must not overlap the inputs), returned as dz.
function F.out_norm_backward(o, x_v, D, z, weight, group_size, eps, d_out, dz_into)
  local fn = "nn.functional.out_norm_backward"
  local gs, e = out_norm_args(fn, o, x_v, D, z, weight, group_size, eps)
  tensor_arg(d_out, fn, "d_out")
  opt_tensor(dz_into, fn, "dz_into")
  local b = { tensor_box(), tensor_box(), tensor_box(), tensor_box(), tensor_box() }
  local d_o, dz, dx_v, dD, dw = call_outputs(fn, "gdp_mixer_out_norm_backward", b, o:ctx(), o, x_v, D,
                                             z, weight, gs, e, d_out, dz_into, b[1], b[2], b[3], b[4],
                                             b[5])
  return { d_o = d_o, dz = dz, dx_v = dx_v, dD = dD, dweight = dw }
end

-- x [..., G, N] -> [..., num_heads, N]; head h reads group h / (num_heads / G).
function F.repeat_heads(x, num_heads)
  local fn = "nn.functional.repeat_heads"
  tensor_arg(x, fn, "x")
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_repeat_heads_forward", { out }, x:ctx(), x,
             int_arg(num_heads, fn, "num_heads", 1), out)
end

-- d_out [..., H, N] -> [..., num_groups, N] (sums over each group's heads).
function F.repeat_heads_backward(d_out, num_groups)
  local fn = "nn.functional.repeat_heads_backward"
  tensor_arg(d_out, fn, "d_out")
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_repeat_heads_backward", { out }, d_out:ctx(), d_out,
             int_arg(num_groups, fn, "num_groups", 1), out)
end

local inputs_dims_keys = { num_heads = true, head_dim = true, num_groups = true, state_dim = true,
                          num_householder = true, beta_scale = true }

-- The sizes table of ssm_inputs: num_heads, head_dim, num_groups, state_dim,
-- num_householder (all required), beta_scale (1).
local function inputs_dims(fn, dims)
  if type(dims) ~= "table" then
    argerror(fn, "dims: expected a table {num_heads =, head_dim =, num_groups =, state_dim =, " ..
                 "num_householder =, beta_scale =}, got " .. type(dims))
  end
  tensor.check_opts(fn, dims, inputs_dims_keys)
  return int_arg(dims.num_heads, fn, "num_heads", 1), int_arg(dims.head_dim, fn, "head_dim", 1),
         int_arg(dims.num_groups, fn, "num_groups", 1), int_arg(dims.state_dim, fn, "state_dim", 1),
         int_arg(dims.num_householder, fn, "num_householder", 1),
         number_arg(dims.beta_scale or 1, fn, "beta_scale")
end

-- The mixer's input stage in one op: xBC [T,B,conv_dim] (the conv output: V (m,h,p),
-- K (m,g,n), Q (g,n)), b [T,B,M*nh], a [T,B,nh] or nil (then A_log, dt_bias nil) ->
-- {q [B,T,nh,N], k [B,T*M,nh,N], v [B,T*M,nh,P], beta [B,T*M,nh], g [B,T,nh] in
-- A_log's dtype (nil without a)}; head h reads group h / (nh/ng).  dims: see inputs_dims.
-- opts.silu = true: xBC goes through SiLU as it is read (a layer without short conv).
function F.ssm_inputs(xBC, b, a, A_log, dt_bias, dims, opts)
  local fn = "nn.functional.ssm_inputs"
  opts = tensor.check_opts(fn, opts, { silu = true })
  if opts.silu ~= nil and type(opts.silu) ~= "boolean" then
    argerror(fn, "opts.silu: expected a boolean, got " .. type(opts.silu))
  end
  tensor_arg(xBC, fn, "xBC")
  tensor_arg(b, fn, "b")
  opt_tensor(a, fn, "a")
  opt_tensor(A_log, fn, "A_log")
  opt_tensor(dt_bias, fn, "dt_bias")
  local nh, P, ng, N, M, scale = inputs_dims(fn, dims)
  local q, k, v, beta, g = tensor_box(), tensor_box(), tensor_box(), tensor_box(), tensor_box()
  local rq, rk, rv, rbeta, rg = call_outputs(fn, "gdp_mixer_ssm_inputs_forward", { q, k, v, beta, g },
                                             xBC:ctx(), xBC, b, a, A_log, dt_bias, nh, P, ng, N, M,
                                             scale, opts.silu and 1 or 0, q, k, v, beta, g)
  return { q = rq, k = rk, v = rv, beta = rbeta, g = rg }
end

local inputs_grad_keys = { dq = true, dk = true, dv = true, dbeta = true, dg = true, dx_v = true }
local inputs_out_keys = { dxBC = true, db = true, da = true }

-- Backward of ssm_inputs for grads {dq, dk, dv, dbeta, dg (with a), dx_v (optional: added
-- to value copy m = 0)}: {dxBC, db, da (nil without a), dA_log, ddt_bias (nil without
-- dt_bias)}.  out (optional) {dxBC =, db =, da =}: tensors to write those into (any
-- strides, e.g. views into the in_proj gradient; they must not overlap the inputs).
-- how.silu_input: the xBC of a forward with opts.silu (dxBC is then its gradient).
function F.ssm_inputs_backward(b, a, A_log, dt_bias, dims, grads, out, how)
  local fn = "nn.functional.ssm_inputs_backward"
  tensor_arg(b, fn, "b")
  opt_tensor(a, fn, "a")
  opt_tensor(A_log, fn, "A_log")
  opt_tensor(dt_bias, fn, "dt_bias")
  local nh, P, ng, N, M, scale = inputs_dims(fn, dims)
  grads = tensor.check_opts(fn, grads, inputs_grad_keys)
  out = tensor.check_opts(fn, out, inputs_out_keys)
  how = tensor.check_opts(fn, how, { silu_input = true })
  opt_tensor(how.silu_input, fn, "silu_input")
  for name in pairs(inputs_grad_keys) do opt_tensor(grads[name], fn, name) end
  for name in pairs(inputs_out_keys) do opt_tensor(out[name], fn, "out." .. name) end
  local T, B = b:size(1), b:size(2)
  local opts = { dtype = b:dtype(), device = b:device() }
  local conv_dim = M * nh * P + (M + 1) * ng * N
  local dxBC = out.dxBC or tensor.empty({ T, B, conv_dim }, opts)
  local db = out.db or tensor.empty({ T, B, M * nh }, opts)
  local da = a ~= nil and (out.da or tensor.empty({ T, B, nh }, opts)) or nil
  local dA, ddt = tensor_box(), tensor_box()
  local rA, rdt = call_outputs(fn, "gdp_mixer_ssm_inputs_backward", { dA, ddt }, b:ctx(), b, a, A_log,
                               dt_bias, nh, P, ng, N, M, scale, how.silu_input, grads.dq, grads.dk,
                               grads.dv, grads.dbeta, grads.dg, grads.dx_v, dxBC, db, da, dA, ddt)
  return { dxBC = dxBC, db = db, da = da, dA_log = rA, ddt_bias = rdt }
end

-- y + D * x_v for y, x_v [..., H, P]; D [H] or [H*P].
function F.dskip(y, x_v, D)
  local fn = "nn.functional.dskip"
  tensor_arg(y, fn, "y")
  tensor_arg(x_v, fn, "x_v")
  tensor_arg(D, fn, "D")
  local out = tensor_box()
  return call_outputs(fn, "gdp_mixer_dskip_forward", { out }, y:ctx(), y, x_v, D, out)
end

-- Returns dx_v, dD (dy is d_out itself).
function F.dskip_backward(x_v, D, d_out)
  local fn = "nn.functional.dskip_backward"
  tensor_arg(x_v, fn, "x_v")
  tensor_arg(D, fn, "D")
  tensor_arg(d_out, fn, "d_out")
  local dx, dD = tensor_box(), tensor_box()
  return call_outputs(fn, "gdp_mixer_dskip_backward", { dx, dD }, x_v:ctx(), x_v, D, d_out, dx, dD)
end

-- Plain RMSNorm over the last dim: x * (mean(x^2) + eps)^-1/2 * weight (the gated
-- norm with no gate and one group).
function F.rms_norm(x, weight, eps)
  return F.gated_rmsnorm(x, nil, weight, nil, eps)
end

-- Returns dx, dweight.
function F.rms_norm_backward(x, weight, eps, d_out)
  local dx, _, dw = F.gated_rmsnorm_backward(x, nil, weight, nil, eps, d_out)
  return dx, dw
end

-- SwiGLU's gate: silu(gate) * up, elementwise.
function F.silu_mul(gate, up)
  local fn = "nn.functional.silu_mul"
  tensor_arg(gate, fn, "gate")
  tensor_arg(up, fn, "up")
  local out = tensor_box()
  return call_outputs(fn, "gdp_nn_silu_mul_forward", { out }, gate:ctx(), gate, up, out)
end

-- Returns d_gate, d_up.
function F.silu_mul_backward(gate, up, d_out)
  local fn = "nn.functional.silu_mul_backward"
  tensor_arg(gate, fn, "gate")
  tensor_arg(up, fn, "up")
  tensor_arg(d_out, fn, "d_out")
  local dg, du = tensor_box(), tensor_box()
  return call_outputs(fn, "gdp_nn_silu_mul_backward", { dg, du }, gate:ctx(), gate, up, d_out, dg, du)
end

-- weight [V,D], tokens (i32/i64, any shape, on the cpu or weight's device) ->
-- [tokens' shape..., D].
function F.embedding(weight, tokens)
  local fn = "nn.functional.embedding"
  tensor_arg(weight, fn, "weight")
  tensor_arg(tokens, fn, "tokens")
  local out = tensor_box()
  return call_outputs(fn, "gdp_nn_embedding_forward", { out }, weight:ctx(), weight, tokens, out)
end

-- dweight [num_embeddings, D] (float32 for bf16 d_out), summed in token order.
function F.embedding_backward(tokens, d_out, num_embeddings)
  local fn = "nn.functional.embedding_backward"
  tensor_arg(tokens, fn, "tokens")
  tensor_arg(d_out, fn, "d_out")
  local out = tensor_box()
  return call_outputs(fn, "gdp_nn_embedding_backward", { out }, d_out:ctx(), tokens, d_out,
                      int_arg(num_embeddings, fn, "num_embeddings", 1), out)
end

local xent_keys = { ignore_index = true, mask = true, grad = true }

-- The cross-entropy's checked options: ignore_index, mask, and the gradient's box
-- (nil when opts.grad is false).
local function xent_opts(fn, logits, targets, opts)
  tensor_arg(logits, fn, "logits")
  tensor_arg(targets, fn, "targets")
  opts = tensor.check_opts(fn, opts, xent_keys)
  local ignore = opts.ignore_index
  if ignore == nil then ignore = -100 end
  util.int_arg(fn, "ignore_index", ignore)
  return ignore, opt_tensor(opts.mask, fn, "mask"), opts.grad ~= false and tensor_box() or nil
end

-- Mean cross-entropy of logits [..., V] against targets (i32/i64, logits' leading
-- shape).  opts: ignore_index (-100), mask (a tensor like targets; rows where it is 0
-- do not count), grad (true: also the gradient).  Returns loss (a number: 0 when no
-- row counts), dlogits (like logits, or nil) and the counted rows.
function F.cross_entropy(logits, targets, opts)
  local fn = "nn.functional.cross_entropy"
  local ignore, mask, d = xent_opts(fn, logits, targets, opts)
  local loss, count = ffi.new("double[1]"), ffi.new("int64_t[1]")
  local dlogits = call_outputs(fn, "gdp_nn_cross_entropy", { d }, logits:ctx(), logits, targets, mask,
                               ignore, loss, count, d)
  return loss[0], dlogits, tonumber(count[0])
end

-- The same without reading the loss back: result, a float64 [2] tensor on the logits'
-- device (the mean loss, the counted rows), and dlogits.  On cuda nothing waits for the
-- device, and a bad target is reported by the next op that does (gdp.h, "model layer
-- ops"): a training step reads its loss with its gradient norms, in one wait.
function F.cross_entropy_result(logits, targets, opts)
  local fn = "nn.functional.cross_entropy_result"
  local ignore, mask, d = xent_opts(fn, logits, targets, opts)
  local r = tensor_box()
  return call_outputs(fn, "gdp_nn_cross_entropy_result", { r, d }, logits:ctx(), logits, targets,
                      mask, ignore, r, d)
end

return F
