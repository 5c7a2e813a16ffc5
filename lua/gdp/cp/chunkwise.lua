-- gdp.cp.chunkwise: chunkwise (state-passing) context parallelism of the GDP operator,
-- gdp_chunkwise_context_parallel (docs/design.md section 4.2).
--
--   local cp = require("gdp.cp")
--   local meta = cp.packed_sequence_cp_metadata(global_cu, group:size(), group:rank())
--   local o, saved = cp.gdp_chunkwise_context_parallel(q, k, v, g, beta, meta.local_cu_seqlens,
--       num_householder, scale, group, cp.cpu_backend(), meta.preceding_rank_start,
--       meta.following_rank_stop, {use_qk_l2norm_in_kernel = true})
--   local grads = cp.gdp_chunkwise_context_parallel_backward(saved, d_o)  -- or saved:backward(d_o)
--   -- grads.dq, dk, dv, dg, dbeta: exact gradients of the rank's local inputs
--
-- The sequence stays sharded contiguously and every rank keeps all heads.  A rank's shard
-- acts on its incoming state as an affine map S_out = M_r S_in + dS_r (per head; M_r is
-- K x K).  Because the recurrence acts on the columns of S independently, one call of
-- the local operator on v' = [v | 0] (V+K columns) from h0' = [0 | I_K] ends in
-- [dS_r | M_r]; and one local backward with dO' = [dO | 0] and dht' = [0 | I_K] starts
-- from dh0' = [gamma_r | M_r^T] (gamma_r: the gradient reaching the incoming state from
-- the rank's own outputs; the adjoint never reads S or v).  So each direction needs ONE
-- all-gather of an [Nb, H, K, V+K] summary per rank, whatever the sequence length.
--
-- Summaries are float32 for float32/bf16 inputs (the operator's state dtype) and
-- float64 for float64 inputs, so that float64 runs match cp = 1 to ~1e-15; the
-- prefix/suffix compositions run in the summaries' dtype on their device.  (The
-- backend below never runs V + K columns at once: the same linearity splits the
-- summary into runs the local work needs anyway -- see cpu_backend.)
--
-- Packed input (B = 1, local cu_seqlens): the summary of the forward is that of the
-- rank's LAST local sequence and S_in is the initial state of its FIRST one; the
-- backward mirrors it.  p = preceding_rank_start, f = following_rank_stop: ranks [p, r)
-- hold the earlier part of my first sequence, ranks (r, f) the rest of my last one
-- (unpacked: p = 0, f = cp).  A rank whose summary nobody reads (f = r + 1 forward,
-- p = r backward) sends zeros instead of computing it.
--
-- Backend protocol (the seeds' GDPChunkwiseCPBackend; a backend only computes, the
-- framework here owns every collective):
--   summary, local_ctx = backend:forward_prepare(inputs)
--   o, saved           = backend:forward_apply(local_ctx, preceding)   -- [r-p, Nb, H, K, V+K]
--   summary, bwd_ctx   = backend:backward_prepare(d_o, saved)
--   grads              = backend:backward_apply(bwd_ctx, following)    -- ranks r+1..f-1
-- inputs = {q, k, v, g, beta, cu_seqlens (local table or nil), num_householder, scale,
--           use_qk_l2norm_in_kernel, chunk_size, algorithm,
--           need_forward_summary, need_backward_summary}.
--
-- The conv halo (conv_halo_exchange and its backward) moves the previous rank's last
-- W-1 tokens to the next rank, zeroed on rank 0 and cut where another sequence ends.
--
-- gdp.cp.timing (off by default) clocks the stages: summary_*, allgather_*, compose_*,
-- local_* (the operator's own runs, also where a backend runs them inside its summary
-- stage) for _forward and _backward, correct_forward (the start's outputs added to a
-- local run from zero) and halo_*.
local tensor = require("gdp.tensor")
local util = require("gdp.util")
local ops = require("gdp.ops")
local shard = require("gdp.cp.shard")
local timing = require("gdp.cp.timing")

local argerror = tensor.argerror
local shape_str = tensor.shape_str

local M = {}

local FN = "cp.gdp_chunkwise_context_parallel"
local FN_BWD = "cp.gdp_chunkwise_context_parallel_backward"

local DTYPE_CODE = { f64 = 1, f32 = 2, bf16 = 3 }

local is_int = util.is_int

-- The CUDA fast path's widest V (docs/kernels.md section 1).
local FAST_PATH_MAX_V = 256

local function state_dtype(dtype) return dtype == "f64" and "f64" or "f32" end

------------------------------------------------------------------------------- metadata

-- Rank-local metadata for chunkwise CP over packed sequences, from the GLOBAL sequence
-- boundaries (a table or an int tensor [N+1], ending at cp * Lc):
--   {local_cu_seqlens = {0, ..., Lc}, preceding_rank_start = p, following_rank_stop = f,
--    local_len = Lc, shard_start = r * Lc, tokens_before = tokens of my first sequence
--    held by earlier ranks}
-- A rank's local sequences are the global ones that share at least one token with its
-- shard (empty global sequences belong to no rank).  p = (global start of the sequence
-- holding my first token) // Lc, f = (global index of the last token of the sequence
-- holding my last token) // Lc + 1, so 0 <= p <= r < f <= cp.  docs/design.md's example
-- (lengths [5,4,7], cp = 4, Lc = 4) gives (p, f) = (0,2), (0,3), (1,4), (2,4), i.e.
-- (p, f-1) = (0,1), (0,2), (1,3), (2,3), and local cu_seqlens [0,4], [0,1,4], [0,1,4],
-- [0,4].  Raises an argument error on bad input (callers run it under comm:pcall).
function M.packed_sequence_cp_metadata(cu_seqlens, cp, rank)
  local fn = "cp.packed_sequence_cp_metadata"
  local cu = shard.seqlens_table(cu_seqlens, fn)
  if cu == nil then argerror(fn, "cu_seqlens: expected the global sequence boundaries, got nil") end
  util.int_arg(fn, "cp", cp, 1, util.INT_MAX)
  util.int_arg(fn, "rank", rank, 0, cp - 1)
  local problem = shard.seqlens_problem(cu)
  if problem then argerror(fn, problem) end
  local T = cu[#cu]
  if T == 0 or T % cp ~= 0 then
    argerror(fn, string.format("the packed token count %d must be a positive multiple of cp = %d " ..
                               "(every rank holds T/cp >= 1 tokens)", T, cp))
  end
  local Lc = T / cp
  local a, b = rank * Lc, (rank + 1) * Lc
  local local_cu = { 0 }
  local first, last
  for s = 1, #cu - 1 do
    local s0, s1 = cu[s], cu[s + 1]
    if s1 > s0 and s0 < b and s1 > a then
      first = first or s
      last = s
      local_cu[#local_cu + 1] = math.min(s1, b) - a
    end
  end
  local p = math.floor(cu[first] / Lc)
  local f = math.floor((cu[last + 1] - 1) / Lc) + 1
  return {
    local_cu_seqlens = local_cu, preceding_rank_start = p, following_rank_stop = f,
    local_len = Lc, shard_start = a, tokens_before = a - cu[first],
  }
end

-- The same for unpacked input (each batch column one sequence across all ranks).
function M.unpacked_cp_metadata(local_len, cp, rank)
  return {
    local_cu_seqlens = nil, preceding_rank_start = 0, following_rank_stop = cp,
    local_len = local_len, shard_start = rank * local_len, tokens_before = rank * local_len,
  }
end

------------------------------------------------------------------------------- helpers

-- First and last non-empty local sequences (1-based) of a local cu_seqlens table.
local function first_last(cu)
  local first, last
  for s = 1, #cu - 1 do
    if cu[s + 1] > cu[s] then
      first = first or s
      last = s
    end
  end
  return first, last
end

-- The operator's arguments for tokens [t0, t1) of a packed (B = 1) input, or all of it.
local function op_args(inputs, t0, t1)
  local n = inputs.num_householder
  local a = {
    q = inputs.q, k = inputs.k, v = inputs.v, g = inputs.g, beta = inputs.beta,
    num_householder = n, scale = inputs.scale,
    use_qk_l2norm_in_kernel = inputs.use_qk_l2norm_in_kernel,
    chunk_size = inputs.chunk_size, algorithm = inputs.algorithm,
    cu_seqlens = inputs.cu_seqlens,
  }
  if t0 ~= nil then
    a.q = a.q:narrow(2, t0 + 1, t1 - t0)
    a.k = a.k:narrow(2, n * t0 + 1, n * (t1 - t0))
    a.v = a.v:narrow(2, n * t0 + 1, n * (t1 - t0))
    a.beta = a.beta:narrow(2, n * t0 + 1, n * (t1 - t0))
    if a.g ~= nil then a.g = a.g:narrow(2, t0 + 1, t1 - t0) end
    a.cu_seqlens = nil
  end
  return a
end

local function dims(inputs)
  local q, v = inputs.q, inputs.v
  local B, H, K, V = q:size(1), q:size(3), q:size(4), v:size(4)
  local Nb = inputs.cu_seqlens and 1 or B
  return Nb, H, K, V
end

------------------------------------------------------------------------------- CPU backend

local CpuBackend = {}
CpuBackend.__index = CpuBackend
CpuBackend.__name = "gdp.cp.CpuBackend"

-- The CPU backend: the local work is gdp.ops' operator (opts.algorithm overrides the
-- inputs' algorithm when given).
--
-- What it runs, by linearity of the recurrence in (S_in, v) (the state's columns evolve
-- independently): every rank runs the local operator from zero before the all-gather
-- (its outputs o0, and dS, the last sequence's final state), a rank whose forward
-- summary someone reads also the transition of its last sequence -- the operator on K
-- zero value columns from I_K, whose final state is M and whose outputs O satisfy
-- o(S_in) = o0 + O S_in -- and a rank that a start reaches that of its first sequence
-- (the same run unpacked).  Once S_in is composed, forward_apply adds O S_in to the
-- first sequence's outputs (a [T, K] x [K, V] product per head, the heads of a batch
-- column in one batched matmul) instead of running the operator again, so no rank runs
-- the operator after the all-gather: the last rank's run overlaps the others'
-- summaries.  The backward summary's M^T is the transpose of that forward transition, so
-- the backward runs the operator's backward for gamma (dO on the first sequence, dht =
-- 0) and for the local gradients: two runs, not three.
function M.cpu_backend(opts)
  opts = opts or {}
  return setmetatable({ name = "cpu", algorithm = opts.algorithm, eye_cache = {}, zero_cache = {} }, CpuBackend)
end

-- The backend for cuda inputs: the same stages and runs on the device, the compositions
-- too (in the float32 state dtype).
function M.cuda_backend(opts)
  local b = M.cpu_backend(opts)
  b.name = "cuda"
  return b
end

-- The backend that suits a device ("cpu", "cuda", "cuda:<i>"): one per device name, kept,
-- so that a caller passing no backend keeps its identity and zero buffers from call to
-- call (made afresh, they cost 0.5-1 ms of a 16K-token transition on an H200).
local default_backends = {}
function M.backend_for(device)
  local key = type(device) == "string" and device or "cpu"
  local b = default_backends[key]
  if b == nil then
    b = key:match("^cuda") and M.cuda_backend() or M.cpu_backend()
    default_backends[key] = b
  end
  return b
end

-- The initial state handed to the operator: float64 stays float64 on the cpu; on cuda
-- the state dtype (float32 for float32 and bf16 inputs).
local function state_on(S, device, sdtype)
  if type(device) == "string" and device:match("^cuda") then
    return S:to({ dtype = sdtype, device = device })
  end
  return S:to({ device = device })
end

-- [Nb, H, K, K] of `dtype`: I_K for every (b, h).
function CpuBackend:identity_state(Nb, H, K, dtype, device)
  local key = table.concat({ Nb, H, K, dtype, device }, ":")
  local cached = self.eye_cache[key]
  if cached then return cached end
  local vals = {}
  for i = 1, K * K do vals[i] = 0 end
  for i = 0, K - 1 do vals[i * K + i + 1] = 1 end
  local eye = tensor.tensor(vals, { K, K }, { dtype = dtype, device = device })
  local out = tensor.empty({ Nb, H, K, K }, { dtype = dtype, device = device })
  for b = 1, Nb do
    for h = 1, H do out:select(1, b):select(1, h):copy(eye) end
  end
  self.eye_cache[key] = out
  return out
end

-- Zeros of `shape` [B, steps, H, K]: the transition's value columns, which the operator
-- only reads.  One buffer per (B, H, K, dtype, device), grown to the longest span asked
-- for; B = 1 (packed spans of varying length) gets a leading slice of it (contiguous).
function CpuBackend:zero_values(shape, dtype, device)
  local key = table.concat({ shape[1], shape[3], shape[4], dtype, device }, ":")
  local z = self.zero_cache[key]
  local fits = z ~= nil and (z:size(2) == shape[2] or (shape[1] == 1 and z:size(2) >= shape[2]))
  if not fits then
    z = tensor.zeros(shape, { dtype = dtype, device = device })
    self.zero_cache[key] = z
  end
  return z:size(2) == shape[2] and z or z:narrow(2, 1, shape[2])
end

local function with_algorithm(self, args)
  if self.algorithm ~= nil then args.algorithm = self.algorithm end
  return args
end

-- x [Nb, H, r, c] as the batch [Nb*H, r, c] (a view), or nil when its strides cannot
-- merge the first two dims.
local function merged_heads(x)
  if x:size(1) > 1 and x:size(2) > 1 and x:stride(1) ~= x:size(2) * x:stride(2) then return nil end
  return x:view(x:size(1) * x:size(2), x:size(3), x:size(4))
end

-- out[b, h] += A[b, h] @ B[b, h] for every batch column b and head h of [Nb, H, ., .]
-- tensors: one batched matmul over all (b, h) when the layouts merge them (always for
-- Nb = 1), else one per batch column -- not a launch per head.
local function add_head_products(out, A, B)
  local o, a, b = merged_heads(out), merged_heads(A), merged_heads(B)
  if o and a and b then
    tensor.matmul(a, b, { out = o, beta = 1 })
    return
  end
  for i = 1, out:size(1) do
    tensor.matmul(A:select(1, i), B:select(1, i), { out = out:select(1, i), beta = 1 })
  end
end

-- Composition of the preceding ranks' [dS | M] (in rank order): S <- M_j S + dS_j from
-- S = 0, in the summaries' dtype on their device.  Returns [Nb, H, K, V], or nil when
-- there are none.
local function compose_prefix(preceding, V, K)
  local np = preceding:size(1)
  if np == 0 then return nil end
  local S = preceding:select(1, 1):narrow(4, 1, V):clone()
  for j = 2, np do
    local sj = preceding:select(1, j)
    local S_new = sj:narrow(4, 1, V):clone()
    add_head_products(S_new, sj:narrow(4, V + 1, K), S)
    S = S_new
  end
  return S
end

-- Composition of the following ranks' [gamma | M^T] (given in rank order r+1..f-1,
-- applied from the last down): dS <- M_j^T dS + gamma_j from dS = 0.
local function compose_suffix(following, V, K)
  local nf = following:size(1)
  if nf == 0 then return nil end
  local dS = following:select(1, nf):narrow(4, 1, V):clone()
  for j = nf - 1, 1, -1 do
    local sj = following:select(1, j)
    local dS_new = sj:narrow(4, 1, V):clone()
    add_head_products(dS_new, sj:narrow(4, V + 1, K), dS)
    dS = dS_new
  end
  return dS
end
M.compose_prefix, M.compose_suffix = compose_prefix, compose_suffix

-- Token span {t0, t1} of local sequence s of a packed input; nil (all tokens) unpacked.
local function span_of(inputs, s)
  local cu = inputs.cu_seqlens
  if cu == nil then return nil end
  return { cu[s], cu[s + 1] }
end

-- The transition of a span (nil: every token, each batch column its own): the operator
-- from h0 = I_K on K zero value columns.  Returns its outputs O [B', T', H, K] and final
-- states M [Nb', H, K, K]: S_out = M S_in + dS, and the outputs of a start S_in are O S_in.
function CpuBackend:transition(ctx, span)
  local inputs = ctx.inputs
  local args = with_algorithm(self, span and op_args(inputs, span[1], span[2]) or op_args(inputs))
  local vshape = args.v:shape()
  vshape[#vshape] = ctx.K
  args.v = self:zero_values(vshape, args.v:dtype(), args.v:device())
  args.initial_state = self:identity_state(span and 1 or ctx.Nb, ctx.H, ctx.K, ctx.sdtype, args.v:device())
  args.output_final_state = true
  return ops.chunk_gated_delta_product(args)
end

-- Unpacked, the local run from zero and the transition are one run: the operator on
-- [v | 0] (V + K value columns) from [0 | I_K] ends in [dS | M] with outputs [o0 | O]
-- (the columns evolve independently), sharing everything but the state pass's and the
-- output's columns.  Returns o0 (contiguous), dS, O and M (views of the wide run's).
-- (bench_cp counts the run as local_forward; its cost beyond the plain local forward is
-- what the comparison with the cp = 1 operator shows.)
function CpuBackend:forward_with_transition(ctx, args)
  local V, K = ctx.V, ctx.K
  local v = args.v
  local shape = v:shape()
  shape[#shape] = V + K
  local vw = tensor.empty(shape, { dtype = v:dtype(), device = v:device() })
  vw:narrow(4, 1, V):copy(v)
  vw:narrow(4, V + 1, K):zero()
  args.v = vw
  args.initial_state = self:wide_start(ctx.Nb, ctx.H, K, V, ctx.sdtype, v:device())
  args.output_final_state = true
  local ow, htw = ops.chunk_gated_delta_product(args)
  return ow:narrow(4, 1, V):contiguous(), htw:narrow(4, 1, V), ow:narrow(4, V + 1, K), htw:narrow(4, V + 1, K)
end

-- [Nb, H, K, V + K] of `dtype`: zero value columns, then I_K, for every (b, h); kept.
function CpuBackend:wide_start(Nb, H, K, V, dtype, device)
  local key = table.concat({ "wide", Nb, H, K, V, dtype, device }, ":")
  local cached = self.eye_cache[key]
  if cached then return cached end
  local out = tensor.zeros({ Nb, H, K, V + K }, { dtype = dtype, device = device })
  out:narrow(4, V + 1, K):copy(self:identity_state(Nb, H, K, dtype, device))
  self.eye_cache[key] = out
  return out
end

-- o[:, span] += O S_in per batch column and head (o [B,T,H,V], O [B,T',H,K] over the
-- span, S_in [B,H,K,V]).  bf16: the matmul's float32 accumulator starts from o's values
-- (beta = 1) and is rounded once, as a float32 copy of o would be, without that copy.
local function add_start_outputs(o, O, S_in, span)
  local target = span and o:narrow(2, span[1] + 1, span[2] - span[1]) or o
  local S = S_in:to({ dtype = o:dtype(), device = o:device() })
  -- heads to dim 2: [B, H, T', K] @ [B, H, K, V] into [B, H, T', V] (views)
  add_head_products(target:transpose(2, 3), O:transpose(2, 3), S)
end

-- Local summary [dS | M] of the last local sequence (zero start).  Every rank runs its
-- local operator from zero here, before the all-gather, also one whose summary nobody
-- reads: its run then overlaps the other ranks' summaries instead of following them,
-- and a start that reaches it is added afterwards as O S_in, from the transition of its
-- first sequence, which its backward summary needs as M^T anyway.
--
-- That first-sequence transition is the only one any rank runs.  A summary's M is read
-- only by a composition that passes through the rank (compose_prefix starts from the dS
-- of the rank where the sequence began, ignoring that rank's M), i.e. when a start
-- reaches the rank and its first sequence is also its last; elsewhere (the first rank of
-- a span, or a last sequence that starts on this rank) M is left zero and not computed.
function CpuBackend:forward_prepare(inputs)
  local Nb, H, K, V = dims(inputs)
  local sdtype = state_dtype(inputs.q:dtype())
  local device = inputs.q:device()
  local ctx = { inputs = inputs, Nb = Nb, H = H, K = K, V = V, sdtype = sdtype }
  local summarised = inputs.need_forward_summary ~= false
  local reached = inputs.need_backward_summary ~= false -- a start reaches my first sequence
  local cu = inputs.cu_seqlens
  local first, last
  if cu ~= nil then first, last = first_last(cu) end
  ctx.first, ctx.last = first, last
  local args = with_algorithm(self, op_args(inputs))
  local ht
  -- (on cuda only while V + K stays within the fast path's value width: wider, the one
  -- run would fall onto the recurrent kernels)
  if reached and cu == nil and (not device:match("^cuda") or V + K <= FAST_PATH_MAX_V) then
    ctx.o0, ht, ctx.O_first, ctx.M_first = timing.stage("local_forward", device, self.forward_with_transition,
                                                       self, ctx, args)
  else
    args.output_final_state = summarised
    ctx.o0, ht = timing.stage("local_forward", device, ops.chunk_gated_delta_product, args)
    if reached then ctx.O_first, ctx.M_first = self:transition(ctx, span_of(inputs, first)) end
  end
  if not summarised then
    return tensor.zeros({ Nb, H, K, V + K }, { dtype = sdtype, device = device }), ctx
  end
  local summary = tensor.zeros({ Nb, H, K, V + K }, { dtype = sdtype, device = device })
  summary:narrow(4, 1, V):copy(cu and ht:narrow(1, last, 1) or ht)
  if reached and first == last then summary:narrow(4, V + 1, K):copy(ctx.M_first) end
  return summary, ctx
end

-- Composes S_in from the preceding summaries and runs (or completes) the local forward.
function CpuBackend:forward_apply(ctx, preceding)
  local inputs = ctx.inputs
  local V, K = ctx.V, ctx.K
  local device = inputs.q:device()
  local S_in = timing.stage("compose_forward", device, compose_prefix, preceding, V, K)
  local h0
  if S_in ~= nil then
    if inputs.cu_seqlens ~= nil then
      local cu = inputs.cu_seqlens
      local hdtype = device:match("^cuda") and ctx.sdtype or "f64"
      h0 = tensor.zeros({ #cu - 1, ctx.H, K, V }, { dtype = hdtype, device = device })
      h0:select(1, (first_last(cu))):copy(S_in:select(1, 1))
    else
      h0 = state_on(S_in, device, ctx.sdtype)
    end
  end
  local o = ctx.o0
  if S_in ~= nil then
    assert(ctx.O_first, "chunkwise CP: a start reached a rank that kept no first-sequence transition")
    timing.stage("correct_forward", device, add_start_outputs, o, ctx.O_first, S_in,
                 span_of(inputs, ctx.first))
  end
  return o, { inputs = inputs, h0 = h0, Nb = ctx.Nb, H = ctx.H, K = K, V = V, sdtype = ctx.sdtype,
              M_first = ctx.M_first, first = ctx.first }
end

-- Local backward summary [gamma | M^T] of the first local sequence.
--
-- gamma comes from the dh0 pass alone, also on a rank that no following rank reaches
-- (whose local backward could run here and give gamma as its dh0): the all-gather waits
-- for every rank's summary, so the other ranks would start their backward only after
-- that whole backward instead of after the dh0 pass (at cp = 2, 16K tokens per rank on
-- an H200: 2.7 ms against 1.5 ms, rank 0's backward then ending 1.2 ms later).
function CpuBackend:backward_prepare(d_o, saved)
  local inputs = saved.inputs
  local Nb, H, K, V = saved.Nb, saved.H, saved.K, saved.V
  local device = inputs.q:device()
  if inputs.need_backward_summary == false then
    return tensor.zeros({ Nb, H, K, V + K }, { dtype = saved.sdtype, device = device }), { saved = saved, d_o = d_o }
  end
  local summary = tensor.empty({ Nb, H, K, V + K }, { dtype = saved.sdtype, device = device })
  local cu = inputs.cu_seqlens
  local first = cu and first_last(cu)
  local span = span_of(inputs, first)
  local args = with_algorithm(self, span and op_args(inputs, span[1], span[2]) or op_args(inputs))
  -- gamma: the adjoint of dO on the value columns with dht = 0 (dh0 alone: on the CUDA
  -- fast path the prep and the state-gradient pass, no gradient kernels)
  args["do"] = span and d_o:narrow(2, span[1] + 1, span[2] - span[1]) or d_o
  args.initial_state = nil
  summary:narrow(4, 1, V):copy(ops.chunk_gated_delta_product_dh0(args))
  assert(saved.M_first, "chunkwise CP: a backward summary on a rank that kept no first-sequence transition")
  summary:narrow(4, V + 1, K):copy(saved.M_first:transpose(3, 4))
  return summary, { saved = saved, d_o = d_o }
end

-- Composes dS_out from the following summaries and runs the local backward.
function CpuBackend:backward_apply(bwd_ctx, following)
  local saved = bwd_ctx.saved
  local inputs = saved.inputs
  local V, K = saved.V, saved.K
  local device = inputs.q:device()
  local dht = timing.stage("compose_backward", device, function()
    local dS_out = compose_suffix(following, V, K)
    if dS_out == nil then return nil end
    if inputs.cu_seqlens ~= nil then
      local cu = inputs.cu_seqlens
      local _, last = first_last(cu)
      local hdtype = device:match("^cuda") and saved.sdtype or "f64"
      local h = tensor.zeros({ #cu - 1, saved.H, K, V }, { dtype = hdtype, device = device })
      h:select(1, last):copy(dS_out:select(1, 1))
      return h
    end
    return state_on(dS_out, device, saved.sdtype)
  end)
  local args = with_algorithm(self, op_args(inputs))
  args.initial_state = saved.h0
  args["do"] = bwd_ctx.d_o
  args.dht = dht
  local g = timing.stage("local_backward", device, ops.chunk_gated_delta_product_backward, args)
  return { dq = g.dq, dk = g.dk, dv = g.dv, dg = g.dg, dbeta = g.dbeta }
end

M.CpuBackend = CpuBackend

------------------------------------------------------------------------------- framework

local BACKEND_METHODS = { "forward_prepare", "forward_apply", "backward_prepare", "backward_apply" }

local arg_order = { "q", "k", "v", "g", "beta", "cu_seqlens", "num_householder", "scale",
                    "cp_group", "backend", "preceding_rank_start", "following_rank_stop" }
local allowed_keys = {
  q = true, k = true, v = true, g = true, beta = true, cu_seqlens = true,
  num_householder = true, scale = true, cp_group = true, backend = true,
  preceding_rank_start = true, following_rank_stop = true,
  use_qk_l2norm_in_kernel = true, chunk_size = true, algorithm = true, validate = true,
}

-- Local checks of the arguments (shapes the summary depends on, p/f bounds, the local
-- cu_seqlens); raises an argument error.  Returns the normalised inputs table.
local function local_inputs(args)
  local fn = FN
  tensor.check_opts(fn, args, allowed_keys)
  local group = args.cp_group
  if type(group) ~= "table" and type(group) ~= "cdata" and type(group) ~= "userdata" then
    argerror(fn, "cp_group: expected a gdp.comm communicator, got " .. type(group))
  end
  local q = tensor.tensor_arg(args.q, fn, "q")
  tensor.tensor_arg(args.k, fn, "k")
  local v = tensor.tensor_arg(args.v, fn, "v")
  tensor.tensor_arg(args.beta, fn, "beta")
  if args.g ~= nil then tensor.tensor_arg(args.g, fn, "g") end
  if q:dim() ~= 4 then argerror(fn, "q: expected [B,T,H,K], got " .. shape_str(q:shape())) end
  if v:dim() ~= 4 then argerror(fn, "v: expected [B,T*n,H,V], got " .. shape_str(v:shape())) end
  local n = args.num_householder
  util.int_arg(fn, "num_householder", n, 1)
  local B, T = q:size(1), q:size(2)
  if T < 1 then
    argerror(fn, "q: every rank must hold at least one token (shard the sequence so that T/cp >= 1), got T = " .. T)
  end
  local cp, r = group:size(), group:rank()
  local p, f = args.preceding_rank_start, args.following_rank_stop
  if p == nil then p = 0 end
  if f == nil then f = cp end
  if not is_int(p) or not is_int(f) or not (0 <= p and p <= r and r < f and f <= cp) then
    argerror(fn, string.format("preceding_rank_start = %s, following_rank_stop = %s on rank %d " ..
                               "of %d: expected 0 <= p <= rank < f <= cp", tostring(p), tostring(f),
                               r, cp))
  end
  local cu = shard.seqlens_table(args.cu_seqlens, fn)
  if cu ~= nil then
    if B ~= 1 then argerror(fn, "q: packed input (cu_seqlens given) needs B = 1, got B = " .. B) end
    local problem = shard.seqlens_problem(cu, T, "cu_seqlens (local)")
    if problem then argerror(fn, problem) end
  elseif p ~= 0 or f ~= cp then
    argerror(fn, string.format("unpacked input (no cu_seqlens) spans all ranks: expected " ..
                               "preceding_rank_start = 0 and following_rank_stop = %d, got %d and %d",
                               cp, p, f))
  end
  local l2 = args.use_qk_l2norm_in_kernel
  return {
    q = q, k = args.k, v = v, g = args.g, beta = args.beta, cu_seqlens = cu,
    num_householder = n, scale = args.scale, use_qk_l2norm_in_kernel = l2 == true,
    chunk_size = args.chunk_size, algorithm = args.algorithm,
    need_forward_summary = f > r + 1, need_backward_summary = p < r,
    p = p, f = f,
  }
end

-- Checks that p/f of all ranks describe one consistent set of sequence spans: rank r
-- continues a sequence from r-1 exactly when r-1's last sequence goes on to r, and
-- ranks inside a span agree on its ends.  Same verdict on every rank (computed from the
-- gathered values).
local function check_spans(group, p, f)
  local cp = group:size()
  local all = group:allgather(tensor.tensor({ p, f }, { 2 }, { dtype = "f64" })):flat()
  local P, Fs = {}, {}
  for r = 0, cp - 1 do P[r], Fs[r] = all[2 * r + 1], all[2 * r + 2] end
  for r = 0, cp - 1 do
    local bad
    if not (0 <= P[r] and P[r] <= r and r < Fs[r] and Fs[r] <= cp) then
      bad = string.format("rank %d has p = %d, f = %d: expected 0 <= p <= r < f <= cp = %d", r, P[r], Fs[r], cp)
    elseif r > 0 and ((P[r] < r) ~= (Fs[r - 1] > r)) then
      bad = string.format("rank %d has preceding_rank_start %d but rank %d has following_rank_stop %d: " ..
                          "a sequence continues from rank %d to %d only if both say so",
                          r, P[r], r - 1, Fs[r - 1], r - 1, r)
    elseif r > 0 and P[r] < r and P[r] ~= r - 1 and P[r - 1] ~= P[r] then
      bad = string.format("rank %d has preceding_rank_start %d but rank %d (inside that sequence) has %d",
                          r, P[r], r - 1, P[r - 1])
    elseif r > 0 and Fs[r - 1] > r and Fs[r - 1] ~= r + 1 and Fs[r] ~= Fs[r - 1] then
      bad = string.format("rank %d has following_rank_stop %d but rank %d (inside that sequence) has %d",
                          r - 1, Fs[r - 1], r, Fs[r])
    end
    if bad then argerror(FN, "inconsistent sequence spans: " .. bad) end
  end
end

local Saved = {}
Saved.__index = Saved

-- Forward.  Positional (the seeds' order, plus an optional options table) or a table:
--   gdp_chunkwise_context_parallel(q, k, v, g, beta, cu_seqlens, num_householder, scale,
--                                  cp_group, backend, preceding_rank_start,
--                                  following_rank_stop, opts)
-- opts: use_qk_l2norm_in_kernel (false, as fla), chunk_size, algorithm, validate (true:
-- local checks agreed over the group, then shapes and p/f consistency across ranks;
-- false: no checking collectives, for callers that validated on every rank already).
-- backend nil: the CPU backend.  Returns o [B,T,H,V] and the saved context (for
-- gdp_chunkwise_context_parallel_backward, or saved:backward(d_o)).  Collective.
function M.gdp_chunkwise_context_parallel(...)
  local args
  local a1 = ...
  if type(a1) == "table" and not tensor.is_tensor(a1) then
    args = a1
  else
    args = {}
    local n = select("#", ...)
    for i = 1, math.min(n, #arg_order) do args[arg_order[i]] = (select(i, ...)) end
    local opts = select(#arg_order + 1, ...)
    if opts ~= nil then
      if type(opts) ~= "table" then argerror(FN, "opts: expected a table, got " .. type(opts)) end
      for key, val in pairs(opts) do args[key] = val end
    end
  end
  local group = args.cp_group
  if group == nil then argerror(FN, "cp_group: expected a gdp.comm communicator, got nil") end
  local backend = args.backend
  if backend == nil then
    local ok, device = pcall(function() return args.q:device() end)
    backend = M.backend_for(ok and device or "cpu")
  end
  for _, name in ipairs(BACKEND_METHODS) do
    if type(backend[name]) ~= "function" then
      argerror(FN, "backend: missing method " .. name .. " (the four-stage protocol)")
    end
  end

  -- Local validation and the local summary under one agreement: a bad input on any
  -- rank is an error on every rank before the summary all-gather.  (validate = false:
  -- the caller has validated on every rank, so no checking collective runs.)
  local validate = args.validate ~= false
  local function prepare()
    local inp = local_inputs(args)
    local s, c = timing.stage("summary_forward", inp.q:device(), backend.forward_prepare, backend, inp)
    return inp, s, c
  end
  local inputs, summary, local_ctx
  if validate then
    inputs, summary, local_ctx = shard.agreed(group, prepare)
  else
    inputs, summary, local_ctx = prepare()
  end
  if validate then
    local Nb, H, K, V = dims(inputs)
    group:agree(FN .. ": summary shape [Nb,H,K,V], num_householder, dtype",
                { Nb, H, K, V, inputs.num_householder, DTYPE_CODE[inputs.q:dtype()] or 0 })
    check_spans(group, inputs.p, inputs.f)
  end
  local gathered = timing.stage("allgather_forward", summary:device(), function()
    return group:allgather(summary:contiguous())
  end)
  local r = group:rank()
  local preceding = gathered:narrow(1, inputs.p + 1, r - inputs.p)
  local o, saved = backend:forward_apply(local_ctx, preceding)
  return o, setmetatable({ backend = backend, group = group, saved = saved, inputs = inputs,
                          validate = validate }, Saved)
end

-- Backward: gradients {dq, dk, dv, dg, dbeta} of the local inputs for the loss
-- sum(o * d_o) over all ranks.  Collective.
function M.gdp_chunkwise_context_parallel_backward(saved_ctx, d_o)
  if getmetatable(saved_ctx) ~= Saved then
    argerror(FN_BWD, "saved: expected the context returned by gdp_chunkwise_context_parallel")
  end
  local group, backend, inputs = saved_ctx.group, saved_ctx.backend, saved_ctx.inputs
  local function prepare()
    tensor.tensor_arg(d_o, FN_BWD, "d_o")
    local q, v = inputs.q, inputs.v
    local want = { q:size(1), q:size(2), q:size(3), v:size(4) }
    if shape_str(d_o:shape()) ~= shape_str(want) then
      argerror(FN_BWD, string.format("d_o: expected the shape of o %s, got %s", shape_str(want),
                                     shape_str(d_o:shape())))
    end
    return timing.stage("summary_backward", d_o:device(), backend.backward_prepare, backend, d_o,
                        saved_ctx.saved)
  end
  local summary, bwd_ctx
  if saved_ctx.validate then
    summary, bwd_ctx = shard.agreed(group, prepare)
  else
    summary, bwd_ctx = prepare()
  end
  local gathered = timing.stage("allgather_backward", summary:device(), function()
    return group:allgather(summary:contiguous())
  end)
  local r = group:rank()
  local following = gathered:narrow(1, r + 2, inputs.f - r - 1)
  return backend:backward_apply(bwd_ctx, following)
end

function Saved:backward(d_o) return M.gdp_chunkwise_context_parallel_backward(self, d_o) end

------------------------------------------------------------------------------- conv halo

local HALO_TAG, HALO_BWD_TAG = 7301, 7401

-- Point-to-point shift by one rank (r -> r+1), on a chain: rank 0 only sends, the last
-- rank only receives, so it cannot deadlock.
local function shift_up(group, send, recv, tag)
  local r, cp = group:rank(), group:size()
  if cp == 1 then return false end
  if r == 0 then
    group:send(send, 1, tag)
    return false
  elseif r == cp - 1 then
    group:recv(recv, r - 1, tag)
  else
    group:sendrecv(send, r + 1, recv, r - 1, tag)
  end
  return true
end

local function shift_down(group, send, recv, tag)
  local r, cp = group:rank(), group:size()
  if cp == 1 then return false end
  if r == cp - 1 then
    group:send(send, r - 1, tag)
    return false
  elseif r == 0 then
    group:recv(recv, 1, tag)
  else
    group:sendrecv(send, r - 1, recv, r + 1, tag)
  end
  return true
end

-- The halo of the depthwise conv for rank-local x [Lc,B,C] (contiguous sharding): the
-- `halo_rows` (W-1) tokens before this rank's first one, from the previous rank(s)
-- (more than one when Lc < W-1).  Returns the last `valid_rows` of them as [valid,B,C]
-- (the rows that belong to this rank's first sequence: min(W-1, tokens_before)), or nil
-- when valid_rows is 0 (rank 0, or a sequence starting exactly at the shard start).
-- Collective over the ranks of `group` (every rank joins, whatever its valid_rows).
-- Collective: the halo exchanges' arguments, checked on every rank and agreed (the
-- point-to-point messages must have one size on every rank).
local function agree_halo(group, fn, x, what, halo_rows, valid_rows, dhalo)
  shard.agreed(group, function()
    tensor.tensor_arg(x, fn, what)
    if x:dim() ~= 3 then argerror(fn, what .. ": expected [Lc,B,C], got " .. shape_str(x:shape())) end
    util.int_arg(fn, "halo_rows", halo_rows, 0)
    util.int_arg(fn, "valid_rows (at most halo_rows = " .. halo_rows .. ")", valid_rows, 0, halo_rows)
    if dhalo ~= nil then
      tensor.tensor_arg(dhalo, fn, "dhalo")
      local want = { valid_rows, x:size(2), x:size(3) }
      if shape_str(dhalo:shape()) ~= shape_str(want) then
        argerror(fn, string.format("dhalo: expected %s, got %s", shape_str(want), shape_str(dhalo:shape())))
      end
    end
  end)
  group:agree(fn .. ": " .. what .. " shape [Lc,B,C], dtype and halo_rows",
              { x:size(1), x:size(2), x:size(3), DTYPE_CODE[x:dtype()] or 0, halo_rows })
end

function M.conv_halo_exchange(group, x, halo_rows, valid_rows)
  if group:size() > 1 then agree_halo(group, "cp.conv_halo_exchange", x, "x", halo_rows, valid_rows) end
  local Lc, B, C = x:size(1), x:size(2), x:size(3)
  local R = halo_rows
  if R == 0 or group:size() == 1 then return nil end
  local Lt = math.min(Lc, R)
  local J = math.ceil(R / Lc)
  local r = group:rank()
  local opts = { dtype = x:dtype(), device = x:device() }
  local halo = tensor.zeros({ R, B, C }, opts)
  local cur = x:narrow(1, Lc - Lt + 1, Lt):contiguous()
  for j = 1, J do
    local recv = tensor.empty({ Lt, B, C }, opts)
    shift_up(group, cur, recv, HALO_TAG + j)
    if r - j >= 0 then
      local count = math.min(Lc, R - (j - 1) * Lc)
      halo:narrow(1, R - (j - 1) * Lc - count + 1, count):copy(recv:narrow(1, Lt - count + 1, count))
    end
    cur = recv
  end
  if valid_rows <= 0 then return nil end
  return halo:narrow(1, R - valid_rows + 1, valid_rows)
end

-- Backward of conv_halo_exchange: dhalo [valid,B,C] (nil when valid_rows is 0) goes back
-- to the ranks that sent those tokens.  Returns the gradient of this rank's last
-- min(Lc, W-1) tokens, [Lt,B,C], to be added to the last rows of dx.  Collective.
function M.conv_halo_exchange_backward(group, dhalo, x, halo_rows, valid_rows)
  if group:size() > 1 then
    agree_halo(group, "cp.conv_halo_exchange_backward", x, "x", halo_rows, valid_rows, dhalo)
  end
  local Lc, B, C = x:size(1), x:size(2), x:size(3)
  local R = halo_rows
  local Lt = math.min(Lc, R)
  local opts = { dtype = x:dtype(), device = x:device() }
  if R == 0 or group:size() == 1 then return tensor.zeros({ Lt, B, C }, opts) end
  local J = math.ceil(R / Lc)
  local G = tensor.zeros({ R, B, C }, opts)
  if valid_rows > 0 and dhalo ~= nil then G:narrow(1, R - valid_rows + 1, valid_rows):copy(dhalo) end
  local acc = tensor.zeros({ Lt, B, C }, opts)
  for j = J, 1, -1 do
    local count = math.min(Lc, R - (j - 1) * Lc)
    local send = acc:clone()
    send:narrow(1, Lt - count + 1, count):add_(G:narrow(1, R - (j - 1) * Lc - count + 1, count))
    local recv = tensor.zeros({ Lt, B, C }, opts)
    if not shift_down(group, send, recv, HALO_BWD_TAG + j) then recv:zero() end
    acc = recv
  end
  return acc
end

------------------------------------------------------------------------------- the layer

-- Builds the layer's chunkwise state (called by gdp.cp.attach; collective).
function M.attach(m)
  shard.agreed(m.cp_group, function()
    if m.cp_layout ~= "contiguous" then
      argerror("nn.GatedDeltaProduct", "cp_layout: chunkwise CP keeps the sequence sharded " ..
               "contiguously, got \"" .. tostring(m.cp_layout) .. "\"")
    end
  end)
  m.cp_backend = M.backend_for(m.device)
end

function M.layer_forward(m, x, cu_in)
  local fn = "nn.GatedDeltaProduct:forward (chunkwise CP)"
  local group = m.cp_group
  local cp, r = group:size(), group:rank()
  local b0 = group:bytes()
  local cu, meta = shard.agreed(group, function()
    shard.check_layer_input(m, fn, x, 1)
    local cu = shard.seqlens_table(cu_in, fn)
    local meta
    if cu ~= nil then
      if x:size(2) ~= 1 then
        argerror(fn, "x: packed input (cu_seqlens given) needs B = 1, got " .. shape_str(x:shape()))
      end
      local problem = shard.seqlens_problem(cu, x:size(1) * cp, "cu_seqlens (global)")
      if problem then argerror(fn, problem .. " (= cp * the local token count)") end
      meta = M.packed_sequence_cp_metadata(cu, cp, r)
    else
      meta = M.unpacked_cp_metadata(x:size(1), cp, r)
    end
    return cu, meta
  end)
  shard.agree_tokens(group, fn, x, cu)
  local b1 = group:bytes()

  local zx = m:in_proj_forward(x)
  local parts = m:split_in_proj(zx)
  local R = m.conv_width - 1
  local valid = math.min(R, meta.tokens_before)
  local halo = timing.stage("halo_forward", m.device, M.conv_halo_exchange, group, parts.xBC, R, valid)
  local lcu = meta.local_cu_seqlens
  local inp = m:inputs_forward(parts.xBC, parts.b, parts.a, lcu, halo)
  local o, saved = M.gdp_chunkwise_context_parallel{
    q = inp.q, k = inp.k, v = inp.v, g = inp.g, beta = inp.beta, cu_seqlens = lcu,
    num_householder = m.num_householder, scale = m.scale, cp_group = group, backend = m.cp_backend,
    preceding_rank_start = meta.preceding_rank_start, following_rank_stop = meta.following_rank_stop,
    use_qk_l2norm_in_kernel = true, algorithm = m.algorithm, validate = false,
  }
  local out, saved_out = m:out_forward(o, parts.z, inp.x_v)
  local b2 = group:bytes()
  m.cp_bytes = {
    forward_check = (b1.sent - b0.sent) + (b1.received - b0.received),
    forward_sent = b2.sent - b1.sent, forward_received = b2.received - b1.received,
    forward_received_incl_self = (b2.received_incl_self or 0) - (b1.received_incl_self or 0),
  }
  m.cache = { x = x, cu_in = cu_in, cu = cu, meta = meta, zx = zx, parts = parts, halo = halo,
              valid = valid, inp = inp, saved = saved, saved_out = saved_out }
  return out
end

-- Backward; accumulates into m.grads (gdp.cp.layer_backward points them at scratch
-- buffers and sums them over the group).
function M.layer_backward(m, dy)
  local fn = "nn.GatedDeltaProduct:backward (chunkwise CP)"
  local c = m.cache
  local group = m.cp_group
  local x = c.x
  shard.agree_dy(group, fn, dy, x)
  local b1 = group:bytes()
  local dzx, dparts = m:in_proj_grad(x:size(1), x:size(2))
  local d_o, _, dx_v = m:out_backward(c.saved_out, c.parts.z, c.inp.x_v, dy, dparts.z)
  local g = M.gdp_chunkwise_context_parallel_backward(c.saved, d_o)
  local dhalo = m:inputs_backward(g, c.parts.xBC, c.parts.b, c.parts.a, dx_v, c.meta.local_cu_seqlens,
                                  c.halo, { dxBC = dparts.xBC, db = dparts.b, da = dparts.a })
  local R = m.conv_width - 1
  local dtail = timing.stage("halo_backward", m.device, M.conv_halo_exchange_backward, group, dhalo,
                             c.parts.xBC, R, c.valid)
  local Lc = x:size(1)
  local Lt = dtail:size(1)
  if Lt > 0 then dparts.xBC:narrow(1, Lc - Lt + 1, Lt):add_(dtail) end
  local dx = m:in_proj_backward(x, dzx)
  local b2 = group:bytes()
  m.cp_bytes = m.cp_bytes or {}
  m.cp_bytes.backward_sent, m.cp_bytes.backward_received = b2.sent - b1.sent, b2.received - b1.received
  m.cp_bytes.backward_received_incl_self = (b2.received_incl_self or 0) - (b1.received_incl_self or 0)
  return dx
end

return M
