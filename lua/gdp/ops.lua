-- gdp.ops: the Gated DeltaProduct operator (fla's chunk_gated_delta_product semantics).
--
--   local o, ht = gdp.ops.chunk_gated_delta_product{
--     q = q, k = k, v = v, g = g, beta = beta,      -- g = nil: ungated
--     num_householder = 2,                          -- default: k's rows / q's rows
--     scale = nil,                                  -- default K^-1/2
--     initial_state = h0, output_final_state = true,
--     use_qk_l2norm_in_kernel = true,
--     cu_seqlens = {0, 5, 5, 12},                   -- a Lua table or an int tensor; B = 1
--     chunk_size = nil, algorithm = "auto",         -- nil: the backend's own (cpu: 64);
--                                                   -- "auto" | "chunk" | "recurrent"
--     value_block = nil,                            -- tuning for this call (see below)
--   }
--   local grads = gdp.ops.chunk_gated_delta_product_backward{ <same>, ["do"] = dO, dht = dht }
--   -- grads.dq, grads.dk, grads.dv, grads.dbeta, grads.dg (nil if ungated), grads.dh0
--
-- Save for backward (opt-in): with save_for_backward = true the forward returns a third
-- value, a gdp.GdpSaved handle of what the backward would recompute (cuda variant 3: the
-- chunk panels and states, 0.97 GB at 4 x 4096, H = 16, K = V = 128, n = 2; elsewhere
-- 0 bytes, and the backward recomputes); pass it as `saved` to the backward, which then
-- skips the recompute.  It belongs to the forward's input VALUES (not checked; the
-- problem -- shapes, dtype, device, options, cu_seqlens -- is, field by field).
--   local o, ht, saved = ops.chunk_gated_delta_product{ <args>, save_for_backward = true }
--   local grads = ops.chunk_gated_delta_product_backward{ <args>, ["do"] = dO, saved = saved }
--   saved:bytes(); saved:free()   -- free is idempotent; the GC frees it otherwise
--
-- Positional form, as in fla: chunk_gated_delta_product(q, k, v, g, beta, opts).
-- Layouts (row-major): q [B,T,H,K], k [B,T*n,H,K], v [B,T*n,H,V], beta [B,T*n,H],
-- g [B,T,H], states [N,H,K,V]; row t*n+j of k/v/beta is Householder step j of token t.
-- The context is q's.  Lua checks what it needs itself (argument types, options,
-- num_householder); shapes, dtypes, devices and cu_seqlens values are checked by the
-- C library, whose errors name the argument, the expected and the actual value.
--
-- Tuning (gdp.h, gdp_tuning): knobs of speed, not of the math; 0 is the backend's own.
--   value_block  the CUDA fast path's value-block width: 16, 32 or 64 (no effect on cpu)
--   gdp.set_tuning{value_block = 32}              -- every default context, now and later
--   gdp.set_tuning({value_block = 32}, "cuda:1")  -- one device's context (or a context)
--   gdp.get_tuning("cuda:1")  --> {value_block = 32}
--   gdp.get_tuning()          --> what set_tuning without a device set (zeros at start)
-- Keys not given keep their values; per call, value_block = 32 in the arguments above
-- wins over the context's.  gdp.results records the tuning in every run's meta.json.
local ffi = require("ffi")
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")
local util = require("gdp.util")

local argerror, check, call_outputs = tensor.argerror, tensor.check, tensor.call_outputs
local shape_str = tensor.shape_str

local M = {}

local FWD = "chunk_gated_delta_product"
local BWD = "chunk_gated_delta_product_backward"
local DH0 = "chunk_gated_delta_product_dh0"

local ALGORITHMS = {
  auto = lib.GDP_ALGO_AUTO,
  chunk = lib.GDP_ALGO_CHUNK,
  recurrent = lib.GDP_ALGO_RECURRENT,
}

local common_keys = {
  q = true, k = true, v = true, g = true, beta = true, num_householder = true, scale = true,
  initial_state = true, output_final_state = true, use_qk_l2norm_in_kernel = true,
  cu_seqlens = true, chunk_size = true, algorithm = true, value_block = true,
  -- aliases: the C API's names
  h0 = true, use_qk_l2norm = true,
  -- the upstream gradients, ignored by the forward so that one table drives both passes
  ["do"] = true, d_o = true, dO = true, dht = true,
  -- save for backward: the forward's switch and the backward's handle (each ignored by
  -- the other pass, for the same reason)
  save_for_backward = true, saved = true,
}
local bwd_keys = common_keys

local tensor_box = ffi.typeof("gdp_tensor *[1]")
local saved_box = ffi.typeof("gdp_delta_product_saved *[1]")
local Saved_ptr = ffi.typeof("gdp_delta_product_saved *")

-- gdp.GdpSaved: a saved forward (gdp_delta_product_saved), owned through ffi.gc.
local saved_freed = setmetatable({}, { __mode = "k" })
local saved_methods = {}
function saved_methods.bytes(s)
  if saved_freed[s] then return 0 end
  return tonumber(lib.gdp_delta_product_saved_bytes(s))
end
function saved_methods.free(s)
  if saved_freed[s] then return end
  saved_freed[s] = true
  lib.gdp_delta_product_saved_free(ffi.gc(s, nil))
end
function saved_methods.is_freed(s) return saved_freed[s] == true end
ffi.metatype("struct gdp_delta_product_saved", {
  __index = saved_methods,
  __tostring = function(s)
    if saved_freed[s] then return "gdp.GdpSaved<freed>" end
    return string.format("gdp.GdpSaved<%d bytes>", tonumber(lib.gdp_delta_product_saved_bytes(s)))
  end,
})

function M.is_saved(x)
  return ffi.istype(Saved_ptr, x) and not saved_freed[x]
end

local function typename(x)
  if type(x) == "cdata" then return tostring(ffi.typeof(x)) end
  return type(x)
end

-- A tuning field (an int32 in C; 0: the backend's own; the library checks the value).
local function tuning_int(fn, key, x)
  return util.int_arg(fn, key, x, util.INT_MIN, util.INT_MAX)
end

-- Accepts the table form or fla's positional form (q, k, v, g, beta, opts).
local function normalize(fn, a1, k, v, g, beta, opts)
  if tensor.is_tensor(a1) or (a1 ~= nil and type(a1) ~= "table") then
    local args = {}
    if opts ~= nil then
      if type(opts) ~= "table" then
        argerror(fn, "options: expected a table, got " .. typename(opts))
      end
      for key, val in pairs(opts) do args[key] = val end
    end
    args.q, args.k, args.v, args.g, args.beta = a1, k, v, g, beta
    return args
  end
  if type(a1) ~= "table" then
    argerror(fn, "expected an argument table {q =, k =, v =, g =, beta =, ...} or q, k, v, g, beta, opts")
  end
  return a1
end


-- A Lua table of sequence boundaries becomes an int64 cpu tensor (the library reads
-- cu_seqlens on the host); the library checks the values.
local function seqlens(fn, cu)
  if cu == nil or tensor.is_tensor(cu) then return cu end
  if type(cu) ~= "table" then
    argerror(fn, "cu_seqlens: expected a table of integers or an i32/i64 tensor, got " .. typename(cu))
  end
  for i = 1, #cu do util.int_arg(fn, "cu_seqlens[" .. i .. "]", cu[i], 0, 2 ^ 53 - 1) end
  return tensor.tensor(cu, { #cu }, { dtype = "i64", device = "cpu" })
end

-- Checks and converts the arguments; returns the C options struct and the handles.
local function prepare(fn, args, allowed)
  tensor.check_opts(fn, args, allowed)
  local q = tensor.tensor_arg(args.q, fn, "q")
  local k = tensor.tensor_arg(args.k, fn, "k")
  local v = tensor.tensor_arg(args.v, fn, "v")
  local beta = tensor.tensor_arg(args.beta, fn, "beta")
  local g = args.g
  if g ~= nil then tensor.tensor_arg(g, fn, "g") end
  local h0 = args.initial_state
  if h0 == nil then h0 = args.h0 end
  if h0 ~= nil then tensor.tensor_arg(h0, fn, "initial_state") end

  if q:dim() ~= 4 then
    argerror(fn, "q: expected 4 dims [B,T,H,K], got shape " .. shape_str(q:shape()))
  end
  local T = q:size(2)
  if k:dim() ~= 4 then
    argerror(fn, "k: expected 4 dims [B,T*n,H,K], got shape " .. shape_str(k:shape()))
  end
  local n = util.int_opt(fn, "num_householder", args.num_householder, 1)
  local krows = k:size(2)
  if n == nil then
    if T == 0 then
      n = 1
    elseif krows % T ~= 0 or krows == 0 then
      argerror(fn, string.format("k: expected T*n rows (T = %d from q), got %d rows, " ..
                                 "not a multiple of T: pass num_householder", T, krows))
    else
      n = krows / T
    end
  elseif krows ~= T * n then
    argerror(fn, string.format("k: expected T*num_householder = %d*%d = %d rows on dim 2, got %d%s",
                               T, n, T * n, krows,
                               (T > 0 and krows % T == 0) and
                                 string.format(" (num_householder %d would match)", krows / T) or ""))
  end
  local cu = seqlens(fn, args.cu_seqlens)

  local opts = ffi.new("gdp_delta_product_options")
  lib.gdp_delta_product_options_init(opts)
  opts.num_householder = n
  if args.scale ~= nil then
    if type(args.scale) ~= "number" or not (args.scale > 0) or args.scale == math.huge then
      argerror(fn, "scale: expected a finite number > 0 (nil: K^-1/2), got " .. tostring(args.scale))
    end
    opts.scale = args.scale
  end
  -- nil keeps gdp_delta_product_options_init's 0: the backend's own chunk
  local cs = util.int_opt(fn, "chunk_size", args.chunk_size, 1)
  if cs then opts.chunk_size = cs end
  -- nil keeps 0: the context's (the library checks the value)
  if args.value_block ~= nil then
    opts.value_block = tuning_int(fn, "value_block", args.value_block)
  end
  local l2 = args.use_qk_l2norm_in_kernel
  if l2 == nil then l2 = args.use_qk_l2norm end
  opts.use_qk_l2norm = l2 and 1 or 0
  opts.output_final_state = args.output_final_state and 1 or 0
  local algo = args.algorithm or "auto"
  if ALGORITHMS[algo] == nil then
    argerror(fn, "algorithm: expected \"auto\", \"chunk\" or \"recurrent\", got " .. tostring(algo))
  end
  opts.algorithm = ALGORITHMS[algo]
  return opts, q, k, v, g, beta, h0, cu
end
M._prepare = prepare

-- Forward: returns o [B,T,H,V] and ht [N,H,K,V] (nil unless output_final_state), and
-- with save_for_backward = true a gdp.GdpSaved for the backward's `saved`.
function M.chunk_gated_delta_product(a1, k, v, g, beta, opts)
  local args = normalize(FWD, a1, k, v, g, beta, opts)
  local o_opts, q, kk, vv, gg, bb, h0, cu = prepare(FWD, args, common_keys)
  local save = args.save_for_backward
  if save ~= nil and type(save) ~= "boolean" then
    argerror(FWD, "save_for_backward: expected a boolean, got " .. typename(save))
  end
  local o, ht = tensor_box(), tensor_box()
  if not save then
    return call_outputs(FWD, "gdp_delta_product_forward", { o, ht }, q:ctx(), o_opts, q, kk, vv, gg, bb, h0,
                        cu, o, ht)
  end
  local sv = saved_box()
  local out_o, out_ht, saved = call_outputs(FWD, "gdp_delta_product_forward_ex",
                                            { o, ht, { sv, lib.gdp_delta_product_saved_free } },
                                            q:ctx(), o_opts, q, kk, vv, gg, bb, h0, cu, o, ht, sv)
  if lib.gdp_delta_product_saved_bytes(saved) > 0 then
    tensor.after_alloc(tonumber(lib.gdp_tensor_device_type(q)))
  end
  return out_o, out_ht, saved
end

-- Backward of sum(o * do) + sum(ht * dht): returns {dq, dk, dv, dbeta, dg, dh0}
-- (dg nil when ungated, dh0 nil without initial_state).
-- The backward's do (also spelled d_o, dO) and dht (nil: zeros), checked.
local function upstream_grads(fn, args)
  local d_o = args["do"]
  if d_o == nil then d_o = args.d_o end
  if d_o == nil then d_o = args.dO end
  tensor.tensor_arg(d_o, fn, "do")
  if args.dht ~= nil then tensor.tensor_arg(args.dht, fn, "dht") end
  return d_o, args.dht
end

function M.chunk_gated_delta_product_backward(a1, k, v, g, beta, opts)
  local args = normalize(BWD, a1, k, v, g, beta, opts)
  local o_opts, q, kk, vv, gg, bb, h0, cu = prepare(BWD, args, bwd_keys)
  local d_o, dht = upstream_grads(BWD, args)
  local saved = args.saved
  if saved ~= nil then
    if not ffi.istype(Saved_ptr, saved) then
      argerror(BWD, "saved: expected the gdp.GdpSaved a forward with save_for_backward = true " ..
                    "returned, got " .. typename(saved))
    elseif saved_freed[saved] then
      argerror(BWD, "saved: it was freed with :free() and cannot be used")
    end
  end
  local dq, dk, dv, dbeta, dg, dh0 = tensor_box(), tensor_box(), tensor_box(), tensor_box(),
                                     tensor_box(), tensor_box()
  local outs = { dq, dk, dv, dbeta, dg, dh0 }
  local r
  if saved == nil then
    r = { call_outputs(BWD, "gdp_delta_product_backward", outs, q:ctx(), o_opts, q, kk, vv, gg, bb, h0, cu,
                       d_o, dht, dq, dk, dv, dbeta, dg, dh0) }
  else
    r = { call_outputs(BWD, "gdp_delta_product_backward_ex", outs, q:ctx(), o_opts, q, kk, vv, gg, bb, h0,
                       cu, d_o, dht, dq, dk, dv, dbeta, dg, dh0, saved) }
  end
  return { dq = r[1], dk = r[2], dv = r[3], dbeta = r[4], dg = r[5], dh0 = r[6] }
end

-- dh0 alone, from the backward's arguments (initial_state optional: dh0 does not depend
-- on it): the CUDA fast path then skips everything but its prep and state-gradient pass.
function M.chunk_gated_delta_product_dh0(a1, k, v, g, beta, opts)
  local args = normalize(DH0, a1, k, v, g, beta, opts)
  local o_opts, q, kk, vv, gg, bb, h0, cu = prepare(DH0, args, bwd_keys)
  local d_o, dht = upstream_grads(DH0, args)
  local dh0 = tensor_box()
  return (call_outputs(DH0, "gdp_delta_product_backward_dh0", { dh0 }, q:ctx(), o_opts, q, kk, vv, gg, bb, h0,
                       cu, d_o, dht, dh0))
end

local STATE_NAMES = { initial_state = true, h0 = true, dht = true }
local TENSOR_NAMES = { "q", "k", "v", "g", "beta", "initial_state", "h0", "do", "d_o", "dO", "dht" }

-- Random inputs for the operator, from the device context's RNG (gdp.manual_seed):
--   cfg = {B, T, H, K, V, n, dtype = "f64", device = "cpu", gated = true,
--          initial_state = false, cu_seqlens = nil (a table; then B must be 1),
--          grads = false (also do and dht), beta_max = 1 (2: negative eigenvalues),
--          g_min = -0.2 (log decays uniform in [g_min, g_max]), g_max = -0.01,
--          use_qk_l2norm_in_kernel = true, output_final_state = true}
-- Returns an argument table for chunk_gated_delta_product (and, with grads, for its
-- backward).  q, k, v, do, dht are standard normal (k is normalised inside the op);
-- states are float32 for float32/bf16 inputs, float64 for float64 ones.
function M.random_inputs(cfg)
  local B, T, H, K, V, n = cfg.B or 1, cfg.T, cfg.H or 1, cfg.K, cfg.V or cfg.K, cfg.num_householder or cfg.n or 1
  local dtype = cfg.dtype or "f64"
  local sdtype = dtype == "f64" and "f64" or "f32"
  local opts = { dtype = dtype, device = cfg.device }
  local sopts = { dtype = sdtype, device = cfg.device }
  local N = cfg.cu_seqlens and (#cfg.cu_seqlens - 1) or B
  local args = {
    q = tensor.randn({ B, T, H, K }, opts),
    k = tensor.randn({ B, T * n, H, K }, opts),
    v = tensor.randn({ B, T * n, H, V }, opts),
    beta = tensor.empty({ B, T * n, H }, opts):uniform_(0, cfg.beta_max or 1),
    num_householder = n,
    use_qk_l2norm_in_kernel = cfg.use_qk_l2norm_in_kernel ~= false,
    output_final_state = cfg.output_final_state ~= false,
    cu_seqlens = cfg.cu_seqlens,
  }
  if cfg.gated ~= false then
    args.g = tensor.empty({ B, T, H }, opts):uniform_(cfg.g_min or -0.2, cfg.g_max or -0.01)
  end
  if cfg.initial_state then args.initial_state = tensor.randn({ N, H, K, V }, sopts) end
  if cfg.grads then
    args["do"] = tensor.randn({ B, T, H, V }, opts)
    args.dht = tensor.randn({ N, H, K, V }, sopts)
  end
  return args
end

-- A copy of an argument table with its tensors converted: token tensors to `dtype`,
-- states to float64 (dtype f64) or float32, all but cu_seqlens to `device`.
function M.convert_inputs(args, dtype, device)
  local out = {}
  for key, val in pairs(args) do out[key] = val end
  local sdtype = dtype == "f64" and "f64" or "f32"
  for _, key in ipairs(TENSOR_NAMES) do
    local t = args[key]
    if t ~= nil then
      out[key] = t:to({ dtype = STATE_NAMES[key] and sdtype or dtype, device = device, copy = true })
    end
  end
  -- cu_seqlens stays where it is: the library reads it on the host.
  return out
end

-- Relative-error tolerances against a float64 reference (docs/design.md section 6).
M.TOLERANCE = { f64 = 1e-10, f32 = 1e-4, bf16 = 1e-2 }
-- In bf16, dbeta and dg (sums over K of products that cancel) and dh0 (a sum over the
-- whole sequence) are held to 2e-2, as fla holds its dbeta and dg under the same metric.
local BF16_SUMMED = { dbeta = true, dg = true, dh0 = true }

-- The bound for operator output or gradient `name` ("o", "ht", "dq", ..., "dh0") in `dtype`.
function M.tolerance(dtype, name)
  if dtype == "bf16" and BF16_SUMMED[name] then return 2e-2 end
  return assert(M.TOLERANCE[dtype], "tolerance: dtype: expected f64, f32 or bf16")
end

local GOLDEN_OUTPUTS = { "o", "ht", "dq", "dk", "dv", "dbeta", "dg", "dh0" }

-- Runs one golden operator case (the format of spec/fixtures/golden/README.md: inputs,
-- do/dht and float64 reference outputs and gradients, loaded with gdp.load) through
-- the forward and the backward.  opts: dtype ("f64"), device ("cpu"), algorithm
-- ("auto"), save_for_backward (false: the forward saves and the backward reads it).  Returns rows {name =, err =, tol =, ok =} for every output and gradient
-- the file holds (err NaN and ok false when the op did not return one), and timings
-- {fwd_ms =, bwd_ms =}.
function M.check_golden_case(t, meta, opts)
  opts = opts or {}
  local dtype = opts.dtype or "f64"
  local args = {
    q = t.q, k = t.k, v = t.v, g = t.g, beta = t.beta, initial_state = t.h0,
    cu_seqlens = t.cu_seqlens, ["do"] = t["do"], dht = t.dht,
    num_householder = tonumber(meta.num_householder),
    scale = tonumber(meta.scale),
    use_qk_l2norm_in_kernel = meta.use_qk_l2norm == "true",
    output_final_state = t.ht ~= nil,
    algorithm = opts.algorithm or "auto",
  }
  args = M.convert_inputs(args, dtype, opts.device or "cpu")
  local ctx = args.q:ctx()
  ctx:sync()
  local t0 = lib.gdp_time_now()
  args.save_for_backward = opts.save_for_backward or nil
  local o, ht, saved = M.chunk_gated_delta_product(args)
  ctx:sync()
  local t1 = lib.gdp_time_now()
  args.save_for_backward, args.saved = nil, saved
  local grads = M.chunk_gated_delta_product_backward(args)
  ctx:sync()
  local t2 = lib.gdp_time_now()
  if saved then saved:free() end
  local got = { o = o, ht = ht }
  for key, val in pairs(grads) do got[key] = val end
  local rows = {}
  for _, name in ipairs(GOLDEN_OUTPUTS) do
    local ref = t[name]
    if ref ~= nil then
      local err = 0 / 0
      if got[name] ~= nil then
        err = tensor.rel_error(got[name]:to({ dtype = "f64", device = "cpu" }),
                               ref:to({ dtype = "f64", device = "cpu" }))
      end
      local tol = opts.tol or M.tolerance(dtype, name)
      rows[#rows + 1] = { name = name, err = err, tol = tol, ok = err <= tol }
    end
  end
  return rows, { fwd_ms = (t1 - t0) * 1e3, bwd_ms = (t2 - t1) * 1e3 }
end

-- Useful floating-point work of the recurrence (the count the benchmarks report):
-- forward 2*K*V*(2n+1) per token and head, backward twice that.
function M.gdp_flops(B, T, H, K, V, n, pass)
  local fwd = 2.0 * K * V * (2 * n + 1) * B * T * H
  if pass == "forward" or pass == nil then return fwd end
  if pass == "backward" then return 2 * fwd end
  if pass == "forward_backward" then return 3 * fwd end
  error("gdp.ops.gdp_flops: pass: expected forward, backward or forward_backward, got " .. tostring(pass), 2)
end

-- Seconds that fn() takes on ctx's device, synchronised before and after so that the
-- queued work of a device is inside the measurement.
function M.timed(ctx, fn)
  ctx:sync()
  local t0 = lib.gdp_time_now()
  fn()
  ctx:sync()
  return lib.gdp_time_now() - t0
end

-- The device's own seconds for fn()'s queued work, without the host's launch time (fla's
-- "GPU only" way): fn runs while a spin of hold_ms (default 20) holds ctx's stream, and
-- the time is taken between device marks after the spin and after fn's work.  Returns
-- device seconds, host seconds (fn's launch time), or nil, host seconds and a note when
-- the host took longer than the hold (the device then waited for the host inside the
-- marks, so the figure would not be the device's alone).  cuda contexts only.
function M.timed_device(ctx, fn, hold_ms)
  hold_ms = hold_ms or 20
  ctx:timer_start(hold_ms)
  local t0 = lib.gdp_time_now()
  local ok, err = pcall(fn)
  local host = lib.gdp_time_now() - t0
  local ms = ctx:timer_stop() -- also after an error: no start left pending
  if not ok then error(err, 0) end
  if host * 1e3 >= 0.9 * hold_ms then
    return nil, host, string.format("the host took %.2f ms to queue the work, near or past the %.0f ms hold: "
      .. "not the device's time alone", host * 1e3, hold_ms)
  end
  return ms / 1e3, host
end

-- Frees every tensor among the values of t (explicit frees keep device memory flat in
-- timing loops instead of waiting for the collector).
function M.free_all(t)
  for _, x in pairs(t) do if tensor.is_tensor(x) then x:free() end end
end

-- Median seconds of the forward and of forward+backward on `problem` (a random_inputs
-- table, with grads), over `samples` runs after `warmup` untimed ones, each on fresh
-- random inputs drawn outside the timed region (never zeros, never the same buffers),
-- and third {fwd = util.spread(...), fwdbwd = ...} (seconds: n, min, p10, median, p90,
-- max).  opts: warmup, samples, algorithm, chunk_size, value_block.
function M.time_forward_backward(problem, opts)
  local fwd, fwdbwd = {}, {}
  for r = 1, opts.warmup + opts.samples do
    local args = M.random_inputs(problem)
    args.algorithm, args.chunk_size = opts.algorithm, opts.chunk_size
    args.value_block = opts.value_block
    local ctx = args.q:ctx()
    local o, ht, grads
    local t_fwd = M.timed(ctx, function() o, ht = M.chunk_gated_delta_product(args) end)
    o:free(); if ht then ht:free() end
    local t_fb = M.timed(ctx, function()
      o, ht = M.chunk_gated_delta_product(args)
      grads = M.chunk_gated_delta_product_backward(args)
    end)
    o:free(); if ht then ht:free() end
    M.free_all(grads)
    M.free_all(args)
    if r > opts.warmup then
      fwd[#fwd + 1], fwdbwd[#fwdbwd + 1] = t_fwd, t_fb
    end
  end
  return util.median(fwd), util.median(fwdbwd), { fwd = util.spread(fwd), fwdbwd = util.spread(fwdbwd) }
end

------------------------------------------------------------------ tuning (see the header)

local TUNING_KEYS = { value_block = true }
local TUNING_FIELDS = { "value_block" }
local tuning_box = ffi.typeof("gdp_tuning[1]")
local default_tuning = { value_block = 0 } -- what set_tuning without a device set

-- Sets the given fields of c's tuning, keeping the others.
local function ctx_set_fields(fn, c, fields)
  local t = tuning_box()
  check(lib.gdp_ctx_get_tuning(c, t), fn)
  for key, val in pairs(fields) do t[0][key] = val end
  check(lib.gdp_ctx_set_tuning(c, t), fn)
end

function M.set_tuning(t, dev)
  local fn = "set_tuning"
  if type(t) ~= "table" then
    argerror(fn, "expected a table such as {value_block = 32}, got " .. typename(t))
  end
  tensor.check_opts(fn, t, TUNING_KEYS)
  for key, val in pairs(t) do tuning_int(fn, key, val) end
  if dev ~= nil then
    ctx_set_fields(fn, tensor.get_ctx(fn, dev), t)
    return
  end
  -- the cpu context first: the library checks the values before any context changes
  ctx_set_fields(fn, tensor.get_ctx(fn, "cpu"), t)
  for _, c in ipairs(tensor.default_contexts()) do ctx_set_fields(fn, c, t) end
  for key, val in pairs(t) do default_tuning[key] = val end
end

-- {value_block = ...} of a device's context (a name or a context), or with no argument
-- what set_tuning without a device set.
function M.get_tuning(dev)
  local out = {}
  if dev == nil then
    for _, key in ipairs(TUNING_FIELDS) do out[key] = default_tuning[key] end
    return out
  end
  local t = tuning_box()
  check(lib.gdp_ctx_get_tuning(tensor.get_ctx("get_tuning", dev), t), "get_tuning")
  for _, key in ipairs(TUNING_FIELDS) do out[key] = tonumber(t[0][key]) end
  return out
end

-- The kernels the last operator call (forward or backward) ran on a device's context (a
-- name or a context): "chunked" or "recurrent" on the cpu, "fast chunked" or "recurrent"
-- on cuda; nil before the first call.  algorithm = "auto" never falls to slower kernels
-- unseen: this says which it took.
function M.last_path(dev)
  if dev == nil then argerror("last_path", "expected a device name or context, got nil") end
  local name = lib.gdp_ctx_last_path(tensor.get_ctx("last_path", dev))
  return name ~= nil and ffi.string(name) or nil
end

-- Default contexts created after a set_tuning without a device get its values.
tensor.ctx_created_hooks[#tensor.ctx_created_hooks + 1] = function(c)
  local t = tuning_box()
  for _, key in ipairs(TUNING_FIELDS) do t[0][key] = default_tuning[key] end
  check(lib.gdp_ctx_set_tuning(c, t), "set_tuning")
end

-- Exposed for the layers (gdp.nn.functional): one conversion rule for cu_seqlens.
M.seqlens_arg = seqlens

return M
