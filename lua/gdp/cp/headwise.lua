-- gdp.cp.headwise: headwise (all-to-all) context parallelism of the GDP mixer,
-- Megatron-Core's GDPContextParallel (docs/design.md section 4.1).
--
--   local hcp = gdp.cp.GDPContextParallel{
--     cp_group = group, d_inner_local_tp = nh * P, nheads_local_tp = nh,
--     ngroups_local_tp = ng, d_state = N, num_householder = M, headdim = P,
--     conv1d_cp1 = {weight = w, bias = b}, dt_bias_cp1 = dt_bias, A_log_cp1 = A_log,
--     D_cp1 = D, D_has_hdim = false, layout = "zigzag"}
--   local xh = hcp:pre_conv_ssm(zx, {cu_seqlens = cu})  -- [T/cp,B,d_in_proj] -> [T,B,width_local]
--   ...  conv (hcp:conv1d with hcp:get_conv1d_weight()), gates, the operator on nh/cp heads
--   local y = hcp:post_conv_ssm(y_heads, {cu_seqlens = cu})  -- [T,B,w] -> [T/cp,B,cp*w]
--   -- every method has a backward: pre_conv_ssm_backward, post_conv_ssm_backward,
--   -- conv1d_backward, get_conv1d_weight_backward(d_slice, grad_full), ...
--
-- Input is sequence-sharded (each rank holds T/cp tokens of the in_proj output, in the
-- zigzag or contiguous layout of gdp.cp.shard); one all-to-all turns it into the whole
-- sequence for this rank's nh/cp heads, and a reverse all-to-all brings the operator's
-- output back to sequence shards.  The output of pre_conv_ssm is laid out exactly like
-- the in_proj output of a cp = 1 layer with nh/cp heads and ng_local groups:
-- [z (d_inner/cp), V (M, nh/cp, P), K (M, ng_local, N), Q (ng_local, N), b (M, nh/cp),
-- a (nh/cp)], so the layer's own stages run on it unchanged.
--  - Householder copies are folded into the batch before the all-to-all: each copy m of
--    V, K and b is split by heads on its own (rank r gets its heads of every copy).
--  - Groups: ng >= cp needs ng % cp == 0 (ng/cp groups per rank); ng < cp needs
--    cp % ng == 0 and each group's K, Q (and conv channels) are repeated cp/ng times,
--    the replica travelling with its heads (rank r gets group r / (cp/ng)).
--  - Parameters are sliced per rank (get_*); their backward adds the slice's gradient
--    into the full (cp = 1) parameter's gradient.  With repeated groups several ranks
--    hold the same K/Q conv channels, so the full gradients are complete only after a
--    sum over the group (the layer does it).
--  - Zigzag (Megatron's attention load balancing): the gathered order after the
--    all-to-all is [c_0, c_{2cp-1}, c_1, c_{2cp-2}, ...]; it is undone (per sequence for
--    packed THD input, whose global cu_seqlens are then required) before the conv and
--    redone before the reverse all-to-all.
--  - gdp.cp.timing (off by default) clocks the layer's stages: all_to_all_in_*,
--    local_* (the operator) and all_to_all_out_*, for _forward and _backward.
local tensor = require("gdp.tensor")
local util = require("gdp.util")
local F = require("gdp.nn.functional")
local shard = require("gdp.cp.shard")
local timing = require("gdp.cp.timing")

local argerror = tensor.argerror
local shape_str = tensor.shape_str

local M = {}

local FN = "cp.GDPContextParallel"


local GDPContextParallel = {}
GDPContextParallel.__index = GDPContextParallel
GDPContextParallel.__name = "GDPContextParallel"

local arg_order = { "cp_group", "d_inner_local_tp", "nheads_local_tp", "ngroups_local_tp", "d_state",
                    "num_householder", "headdim", "conv1d_cp1", "dt_bias_cp1", "A_log_cp1", "D_cp1",
                    "D_has_hdim" }
local allowed = {}
for _, k in ipairs(arg_order) do allowed[k] = true end
allowed.layout = true

local function check_param(fn, t, what, shape)
  if t == nil then return end
  tensor.tensor_arg(t, fn, what)
  if shape_str(t:shape()) ~= shape_str(shape) then
    argerror(fn, string.format("%s: expected shape %s, got %s", what, shape_str(shape), shape_str(t:shape())))
  end
end

-- Local part of the constructor: checks and geometry.
local function construct(cfg)
  tensor.check_opts(FN, cfg, allowed)
  local self = setmetatable({}, GDPContextParallel)
  local group = cfg.cp_group
  if group == nil then argerror(FN, "cp_group: expected a gdp.comm communicator, got nil") end
  self.group = group
  local cp, r = group:size(), group:rank()
  self.cp, self.rank = cp, r
  local function int(key, min)
    local v = cfg[key]
    return util.int_arg(FN, key, v, min)
  end
  local d_inner, nh, ng = int("d_inner_local_tp", 1), int("nheads_local_tp", 1), int("ngroups_local_tp", 1)
  local N, Mh, P = int("d_state", 1), int("num_householder", 1), int("headdim", 1)
  if d_inner ~= nh * P then
    argerror(FN, string.format("d_inner_local_tp: expected nheads_local_tp * headdim = %d * %d = %d, got %d",
                               nh, P, nh * P, d_inner))
  end
  if nh % ng ~= 0 then
    argerror(FN, string.format("ngroups_local_tp: expected a divisor of nheads_local_tp = %d, got %d", nh, ng))
  end
  if nh % cp ~= 0 then
    argerror(FN, string.format("nheads_local_tp = %d is not divisible by the cp size %d: headwise CP " ..
                               "splits heads over ranks (cp <= num_heads; use chunkwise CP otherwise)",
                               nh, cp))
  end
  if ng >= cp then
    if ng % cp ~= 0 then
      argerror(FN, string.format("ngroups_local_tp = %d >= cp = %d must be divisible by cp", ng, cp))
    end
    self.ngroups_local, self.group_repeat = ng / cp, 1
  else
    if cp % ng ~= 0 then
      argerror(FN, string.format("ngroups_local_tp = %d < cp = %d: cp must be divisible by it " ..
                                 "(each group is repeated cp/ngroups times)", ng, cp))
    end
    self.ngroups_local, self.group_repeat = 1, cp / ng
  end
  self.d_inner, self.nheads, self.ngroups, self.d_state, self.num_householder, self.headdim =
    d_inner, nh, ng, N, Mh, P
  self.nheads_local, self.d_inner_local = nh / cp, d_inner / cp
  self.layout = cfg.layout or "zigzag"
  if not shard.LAYOUTS[self.layout] then
    argerror(FN, "layout: expected \"zigzag\" or \"contiguous\", got " .. tostring(self.layout))
  end
  self.D_has_hdim = cfg.D_has_hdim == true

  -- Global section offsets (0-based) of the in_proj output and of the conv channels.
  local o = {}
  o.z = 0
  o.V = d_inner
  o.K = o.V + Mh * d_inner
  o.Q = o.K + Mh * ng * N
  o.b = o.Q + ng * N
  o.a = o.b + Mh * nh
  o.width = o.a + nh
  o.conv_dim = o.b - o.V
  self.off = o

  local conv = cfg.conv1d_cp1
  if conv ~= nil then
    if type(conv) ~= "table" or conv.weight == nil then
      argerror(FN, "conv1d_cp1: expected a table {weight = [C,1,W] or [C,W], bias = [C] or nil}")
    end
    tensor.tensor_arg(conv.weight, FN, "conv1d_cp1.weight")
    if conv.weight:size(1) ~= o.conv_dim then
      argerror(FN, string.format("conv1d_cp1.weight: expected %d channels (V, K, Q), got shape %s",
                                 o.conv_dim, shape_str(conv.weight:shape())))
    end
    check_param(FN, conv.bias, "conv1d_cp1.bias", { o.conv_dim })
  end
  self.conv1d_cp1 = conv
  check_param(FN, cfg.dt_bias_cp1, "dt_bias_cp1", { nh })
  check_param(FN, cfg.A_log_cp1, "A_log_cp1", { nh })
  check_param(FN, cfg.D_cp1, "D_cp1", { self.D_has_hdim and d_inner or nh })
  self.dt_bias_cp1, self.A_log_cp1, self.D_cp1 = cfg.dt_bias_cp1, cfg.A_log_cp1, cfg.D_cp1
  return self
end

-- GDPContextParallel{...} or GDPContextParallel(cp_group, d_inner_local_tp, nheads_local_tp,
-- ngroups_local_tp, d_state, num_householder, headdim, conv1d_cp1, dt_bias_cp1, A_log_cp1,
-- D_cp1, D_has_hdim[, opts]) (the seeds' order; opts.layout = "zigzag" | "contiguous").
-- Collective: checks run on every rank and ranks must agree on the configuration.
function GDPContextParallel.new(...)
  local cfg
  local a1 = ...
  if type(a1) == "table" and a1.cp_group ~= nil and select("#", ...) == 1 then
    cfg = a1
  else
    cfg = {}
    for i, key in ipairs(arg_order) do cfg[key] = (select(i, ...)) end
    local opts = select(#arg_order + 1, ...)
    if opts ~= nil then for key, val in pairs(opts) do cfg[key] = val end end
  end
  local group = cfg.cp_group
  if group == nil then argerror(FN, "cp_group: expected a gdp.comm communicator, got nil") end
  local self = shard.agreed(group, construct, cfg)
  group:agree(FN .. ": configuration (d_inner, heads, groups, d_state, householder, headdim, " ..
              "D_has_hdim, layout, conv bias)",
              { self.d_inner, self.nheads, self.ngroups, self.d_state, self.num_householder,
                self.headdim, self.D_has_hdim and 1 or 0, self.layout == "zigzag" and 1 or 2,
                (self.conv1d_cp1 and self.conv1d_cp1.bias) and 1 or 0 })
  return self
end

setmetatable(GDPContextParallel, { __call = function(_, ...) return GDPContextParallel.new(...) end })

function GDPContextParallel:__tostring()
  return string.format("cp.GDPContextParallel(cp %d, rank %d, heads %d/%d, groups %d (x%d), %s)",
                       self.cp, self.rank, self.nheads_local, self.nheads, self.ngroups_local,
                       self.group_repeat, self.layout)
end

------------------------------------------------------------------------------- geometry

-- First global group held by rank d.
function GDPContextParallel:first_group(d)
  if self.group_repeat > 1 then return math.floor(d / self.group_repeat) end
  return d * self.ngroups_local
end

-- Width of the local in_proj sections (with or without z).
function GDPContextParallel:local_width(with_z)
  local Mh, N = self.num_householder, self.d_state
  local dl, nhl, ngl = self.d_inner_local, self.nheads_local, self.ngroups_local
  return (with_z and dl or 0) + Mh * dl + Mh * ngl * N + ngl * N + Mh * nhl + nhl
end

-- Column runs {src, dst, len} (0-based) from the global in_proj output to rank d's local
-- sections.  Each Householder copy is its own run: the fold of M into the batch.
function GDPContextParallel:segments(d, with_z)
  local o, Mh, N = self.off, self.num_householder, self.d_state
  local dl, nhl, ngl, ng, nh = self.d_inner_local, self.nheads_local, self.ngroups_local, self.ngroups,
                               self.nheads
  local g0 = self:first_group(d)
  local segs, dst = {}, 0
  local function add(src, len)
    segs[#segs + 1] = { src, dst, len }
    dst = dst + len
  end
  if with_z then add(o.z + d * dl, dl) end
  for m = 0, Mh - 1 do add(o.V + m * self.d_inner + d * dl, dl) end
  for m = 0, Mh - 1 do add(o.K + m * ng * N + g0 * N, ngl * N) end
  add(o.Q + g0 * N, ngl * N)
  for m = 0, Mh - 1 do add(o.b + m * nh + d * nhl, nhl) end
  add(o.a + d * nhl, nhl)
  return segs
end

-- The conv channel runs (conv channel coordinates) of rank d: the V, K, Q runs.
function GDPContextParallel:conv_segments(d)
  local out = {}
  local Mh = self.num_householder
  for i, s in ipairs(self:segments(d, false)) do
    if i <= 2 * Mh + 1 then out[#out + 1] = { s[1] - self.off.V, s[2], s[3] } end
  end
  return out
end

-- conv channels of one rank: d_inner/cp per copy, its groups' K per copy, its groups' Q.
function GDPContextParallel:conv1d_channels()
  local Mh = self.num_householder
  return Mh * self.d_inner_local + (Mh + 1) * self.ngroups_local * self.d_state
end

------------------------------------------------------------------------------- all-to-alls

local function order_opts(self, cu)
  return { layout = self.layout, cu_seqlens = cu }
end

-- [Tl,B,width] sequence shard -> [T,B,wl] natural order, this rank's heads.
function GDPContextParallel:_cp2hp(x, with_z, cu)
  local cp = self.cp
  local Tl, B = x:size(1), x:size(2)
  local wl = self:local_width(with_z)
  local send = tensor.empty({ cp, Tl, B, wl }, { dtype = x:dtype(), device = x:device() })
  for d = 0, cp - 1 do
    local dst = send:select(1, d + 1)
    for _, s in ipairs(self:segments(d, with_z)) do
      dst:narrow(3, s[2] + 1, s[3]):copy(x:narrow(3, s[1] + 1, s[3]))
    end
  end
  local recv = self.group:all_to_all(send)
  return shard.undo_order(recv:view(cp * Tl, B, wl), cp, order_opts(self, cu))
end

-- Backward of _cp2hp: [T,B,wl] -> [Tl,B,width] (replicated groups summed; z columns zero
-- unless with_z).
function GDPContextParallel:_cp2hp_backward(dy, with_z, cu)
  local cp = self.cp
  local T, B, wl = dy:size(1), dy:size(2), dy:size(3)
  local Tl = T / cp
  local send = shard.redo_order(dy, cp, order_opts(self, cu)):contiguous():view(cp, Tl, B, wl)
  local recv = self.group:all_to_all(send)
  local dx = tensor.zeros({ Tl, B, self.off.width }, { dtype = dy:dtype(), device = dy:device() })
  for d = 0, cp - 1 do
    local src = recv:select(1, d + 1)
    for _, s in ipairs(self:segments(d, with_z)) do
      dx:narrow(3, s[1] + 1, s[3]):add_(src:narrow(3, s[2] + 1, s[3]))
    end
  end
  return dx
end

-- [T,B,w] (this rank's columns of every token, natural order) -> [Tl,B,cp*w] (all
-- ranks' columns of this rank's tokens, in rank order).
function GDPContextParallel:_hp2cp(y, cu)
  local cp = self.cp
  local T, B, w = y:size(1), y:size(2), y:size(3)
  local Tl = T / cp
  local send = shard.redo_order(y, cp, order_opts(self, cu)):contiguous():view(cp, Tl, B, w)
  local recv = self.group:all_to_all(send)
  return recv:permute(2, 3, 1, 4):reshape(Tl, B, cp * w)
end

function GDPContextParallel:_hp2cp_backward(dy, cu)
  local cp = self.cp
  local Tl, B = dy:size(1), dy:size(2)
  local w = dy:size(3) / cp
  local send = dy:reshape(Tl, B, cp, w):permute(3, 1, 2, 4):contiguous()
  local recv = self.group:all_to_all(send)
  return shard.undo_order(recv:view(cp * Tl, B, w), cp, order_opts(self, cu))
end

------------------------------------------------------------------------------- validation

-- Local checks of a sequence-sharded input [Tl,B,...] and the global cu_seqlens (a
-- table or nil).  Raises an argument error.
function GDPContextParallel:check_tokens(fn, x, cu, width)
  tensor.tensor_arg(x, fn, "input")
  if x:dim() ~= 3 then argerror(fn, "input: expected [T/cp,B,width], got " .. shape_str(x:shape())) end
  if width ~= nil and x:size(3) ~= width then
    argerror(fn, string.format("input: expected width %d on dim 3, got shape %s", width, shape_str(x:shape())))
  end
  local T = x:size(1) * self.cp
  if cu ~= nil and x:size(2) ~= 1 then
    argerror(fn, "input: packed input (cu_seqlens given) needs B = 1, got shape " .. shape_str(x:shape()))
  end
  local problem = shard.layout_problem(T, self.cp, self.layout, cu)
  if problem then argerror(fn, problem) end
end

-- Collective: local checks on every rank, then agreement on the shapes and cu_seqlens.
function GDPContextParallel:validate(fn, x, cu_in, width)
  local group = self.group
  local cu = shard.agreed(group, function()
    local cu = shard.seqlens_table(cu_in, fn)
    self:check_tokens(fn, x, cu, width)
    return cu
  end)
  shard.agree_tokens(group, fn, x, cu)
  return cu
end

------------------------------------------------------------------------------- public methods

-- in_proj output [T/cp,B,d_in_proj] (sequence shard) -> [T,B,width_local] (this rank's
-- heads, whole sequence, natural order).  opts: cu_seqlens (GLOBAL boundaries, packed
-- THD input: required for zigzag), skip_z (true: z is not sent and not in the output).
function GDPContextParallel:pre_conv_ssm(input, opts)
  opts = opts or {}
  local cu = self:validate("cp.GDPContextParallel:pre_conv_ssm", input, opts.cu_seqlens, self.off.width)
  return self:_cp2hp(input, not opts.skip_z, cu)
end

-- Backward: d_output [T,B,width_local] -> d_input [T/cp,B,d_in_proj].
function GDPContextParallel:pre_conv_ssm_backward(d_output, opts)
  opts = opts or {}
  local fn = "cp.GDPContextParallel:pre_conv_ssm_backward"
  local cu = shard.agreed(self.group, function()
    tensor.tensor_arg(d_output, fn, "d_output")
    local wl = self:local_width(not opts.skip_z)
    if d_output:dim() ~= 3 or d_output:size(3) ~= wl or d_output:size(1) % self.cp ~= 0 then
      argerror(fn, string.format("d_output: expected [T,B,%d] with T %% cp == 0, got %s", wl,
                                 shape_str(d_output:shape())))
    end
    local cu = shard.seqlens_table(opts.cu_seqlens, fn)
    local problem = shard.layout_problem(d_output:size(1), self.cp, self.layout, cu)
    if problem then argerror(fn, problem) end
    return cu
  end)
  return self:_cp2hp_backward(d_output, not opts.skip_z, cu)
end

-- [T,B,w] (this rank's heads; e.g. y or z) -> [T/cp,B,cp*w] (all heads, this rank's
-- tokens in its layout).  opts: cu_seqlens (global, packed).
function GDPContextParallel:post_conv_ssm(input, opts)
  opts = opts or {}
  local fn = "cp.GDPContextParallel:post_conv_ssm"
  local cu = shard.agreed(self.group, function()
    tensor.tensor_arg(input, fn, "input")
    if input:dim() ~= 3 then argerror(fn, "input: expected [T,B,w], got " .. shape_str(input:shape())) end
    local cu = shard.seqlens_table(opts.cu_seqlens, fn)
    local problem = shard.layout_problem(input:size(1), self.cp, self.layout, cu)
    if problem then argerror(fn, problem) end
    return cu
  end)
  return self:_hp2cp(input, cu)
end

function GDPContextParallel:post_conv_ssm_backward(d_output, opts)
  opts = opts or {}
  local fn = "cp.GDPContextParallel:post_conv_ssm_backward"
  local cu = shard.agreed(self.group, function()
    tensor.tensor_arg(d_output, fn, "d_output")
    if d_output:dim() ~= 3 or d_output:size(3) % self.cp ~= 0 then
      argerror(fn, "d_output: expected [T/cp,B,cp*w], got " .. shape_str(d_output:shape()))
    end
    local cu = shard.seqlens_table(opts.cu_seqlens, fn)
    local problem = shard.layout_problem(d_output:size(1) * self.cp, self.cp, self.layout, cu)
    if problem then argerror(fn, problem) end
    return cu
  end)
  return self:_hp2cp_backward(d_output, cu)
end

------------------------------------------------------------------------------- parameters

local function need(self, t, what)
  if t == nil then argerror(FN, what .. ": not given to the constructor") end
  return t
end

-- Rows of the conv weight (or bias) for this rank: [conv1d_channels(), ...].
local function slice_rows(self, full)
  local shape = full:shape()
  shape[1] = self:conv1d_channels()
  local out = tensor.empty(shape, { dtype = full:dtype(), device = full:device() })
  for _, s in ipairs(self:conv_segments(self.rank)) do
    out:narrow(1, s[2] + 1, s[3]):copy(full:narrow(1, s[1] + 1, s[3]))
  end
  return out
end

local function scatter_rows(self, d_slice, grad, full)
  grad = grad or tensor.zeros(full:shape(), { dtype = full:dtype(), device = full:device() })
  for _, s in ipairs(self:conv_segments(self.rank)) do
    grad:narrow(1, s[1] + 1, s[3]):add_(d_slice:narrow(1, s[2] + 1, s[3]))
  end
  return grad
end

function GDPContextParallel:get_conv1d_weight()
  return slice_rows(self, need(self, self.conv1d_cp1, "conv1d_cp1").weight)
end

-- Adds the gradient of the slice into grad (the full weight's shape; a new zero tensor
-- when nil) and returns grad.
function GDPContextParallel:get_conv1d_weight_backward(d_slice, grad)
  return scatter_rows(self, d_slice, grad, need(self, self.conv1d_cp1, "conv1d_cp1").weight)
end

-- nil when the conv has no bias.
function GDPContextParallel:get_conv1d_bias()
  local conv = need(self, self.conv1d_cp1, "conv1d_cp1")
  if conv.bias == nil then return nil end
  return slice_rows(self, conv.bias)
end

function GDPContextParallel:get_conv1d_bias_backward(d_slice, grad)
  local conv = need(self, self.conv1d_cp1, "conv1d_cp1")
  if conv.bias == nil or d_slice == nil then return grad end
  return scatter_rows(self, d_slice, grad, conv.bias)
end

local function head_range(self, per_channel)
  if per_channel then return self.rank * self.d_inner_local, self.d_inner_local end
  return self.rank * self.nheads_local, self.nheads_local
end

local function slice_vec(self, full, per_channel)
  local start, len = head_range(self, per_channel)
  return full:narrow(1, start + 1, len):clone()
end

local function scatter_vec(self, d_slice, grad, full, per_channel)
  grad = grad or tensor.zeros(full:shape(), { dtype = full:dtype(), device = full:device() })
  local start, len = head_range(self, per_channel)
  grad:narrow(1, start + 1, len):add_(d_slice)
  return grad
end

function GDPContextParallel:get_dt_bias() return slice_vec(self, need(self, self.dt_bias_cp1, "dt_bias_cp1")) end
function GDPContextParallel:get_dt_bias_backward(d, grad)
  return scatter_vec(self, d, grad, need(self, self.dt_bias_cp1, "dt_bias_cp1"))
end
function GDPContextParallel:get_A_log() return slice_vec(self, need(self, self.A_log_cp1, "A_log_cp1")) end
function GDPContextParallel:get_A_log_backward(d, grad)
  return scatter_vec(self, d, grad, need(self, self.A_log_cp1, "A_log_cp1"))
end
-- D by head, or by channel with D_has_hdim.
function GDPContextParallel:get_D()
  return slice_vec(self, need(self, self.D_cp1, "D_cp1"), self.D_has_hdim)
end
function GDPContextParallel:get_D_backward(d, grad)
  return scatter_vec(self, d, grad, need(self, self.D_cp1, "D_cp1"), self.D_has_hdim)
end

-- The depthwise causal conv of this rank's channels: x [T,B,conv1d_channels()] (the
-- V, K, Q sections of pre_conv_ssm's output).  opts: cu_seqlens (global), activation
-- ("none", as Megatron's conv1d; "silu" fuses the mixer's activation).
function GDPContextParallel:conv1d(x, opts)
  opts = opts or {}
  return F.conv1d(x, self:get_conv1d_weight(), self:get_conv1d_bias(),
                  { activation = opts.activation or "none", cu_seqlens = opts.cu_seqlens })
end

-- Backward of conv1d: returns dx; adds the weight and bias gradients into grads.weight
-- and grads.bias (full shapes) when given.
function GDPContextParallel:conv1d_backward(x, d_out, opts, grads)
  opts = opts or {}
  local r = F.conv1d_backward(x, self:get_conv1d_weight(), self:get_conv1d_bias(), d_out,
                              { activation = opts.activation or "none", cu_seqlens = opts.cu_seqlens })
  if grads ~= nil then
    if grads.weight ~= nil then self:get_conv1d_weight_backward(r.dweight, grads.weight) end
    if grads.bias ~= nil then self:get_conv1d_bias_backward(r.dbias, grads.bias) end
  end
  return r.dx, r.dweight, r.dbias
end

M.GDPContextParallel = GDPContextParallel

------------------------------------------------------------------------------- the layer

-- Builds the layer's headwise state (called by gdp.cp.attach; collective).
function M.attach(m)
  local p = m.params
  m.cp_state = GDPContextParallel.new{
    cp_group = m.cp_group, d_inner_local_tp = m.sizes.d_inner, nheads_local_tp = m.num_heads,
    ngroups_local_tp = m.num_groups, d_state = m.state_dim, num_householder = m.num_householder,
    headdim = m.head_dim, conv1d_cp1 = { weight = p["conv1d.weight"], bias = p["conv1d.bias"] },
    dt_bias_cp1 = p["dt_bias"], A_log_cp1 = p["A_log"], D_cp1 = p["D"],
    D_has_hdim = m.D_mode == "channel", layout = m.cp_layout,
  }
end

-- A cp = 1 layer of this rank's nh/cp heads (and local groups) whose parameters are
-- the current slices: the module's stages run on it unchanged.
local function local_module(m, hcp)
  local cls = getmetatable(m)
  local view = setmetatable({}, cls)
  for _, key in ipairs({ "hidden_size", "head_dim", "state_dim", "num_householder", "conv_width",
                         "norm_eps", "beta_scale", "allow_neg_eigval", "conv_bias", "D_mode",
                         "dtype", "device", "algorithm", "scale", "use_short_conv",
                         "use_output_gate", "use_forget_gate" }) do
    view[key] = m[key]
  end
  view.num_heads, view.num_groups = hcp.nheads_local, hcp.ngroups_local
  view.sizes = cls.compute_sizes(view.num_heads, view.head_dim, view.num_groups, view.state_dim,
                                 view.num_householder)
  view.params = {
    ["conv1d.weight"] = hcp:get_conv1d_weight(), ["conv1d.bias"] = hcp:get_conv1d_bias(),
    dt_bias = hcp:get_dt_bias(), A_log = hcp:get_A_log(),
  }
  if m.D_mode then view.params.D = hcp:get_D() end
  -- each gradient in its parameter's dtype: a bf16 layer keeps A_log and dt_bias in f32
  view.grads = {}
  for name, t in pairs(view.params) do
    view.grads[name] = tensor.zeros(t:shape(), { dtype = t:dtype(), device = m.device })
  end
  return view
end

function M.layer_forward(m, x, cu_in)
  local fn = "nn.GatedDeltaProduct:forward (headwise CP)"
  local hcp = m.cp_state
  local group = m.cp_group
  local b0 = group:bytes()
  local cu = shard.agreed(group, function()
    shard.check_layer_input(m, fn, x)
    local cu = shard.seqlens_table(cu_in, fn)
    hcp:check_tokens(fn, x, cu)
    return cu
  end)
  shard.agree_tokens(group, fn, x, cu)
  local b1 = group:bytes()

  local s = m.sizes
  local T, B = x:size(1) * hcp.cp, x:size(2)
  local zx = m:in_proj_forward(x)
  local z = zx:narrow(3, s.z_off, s.d_inner)
  -- z stays with its tokens: the gated norm runs after the reverse all-to-all.
  local loc = timing.stage("all_to_all_in_forward", m.device, hcp._cp2hp, hcp, zx, false, cu)
  local view = local_module(m, hcp)
  local ls = view.sizes
  local xBC = loc:narrow(3, 1, ls.conv_dim)
  local b = loc:narrow(3, ls.conv_dim + 1, ls.b_dim)
  local a = loc:narrow(3, ls.conv_dim + ls.b_dim + 1, ls.a_dim)
  local inp = view:inputs_forward(xBC, b, a, cu)
  local o = timing.stage("local_forward", m.device, view.ssm_forward, view, inp, cu)
  local y = o:permute(2, 1, 3, 4)
  if m.D_mode then y = F.dskip(y, inp.x_v, view.params.D) end
  local y3 = y:reshape(T, B, ls.d_inner)
  local y_seq = timing.stage("all_to_all_out_forward", m.device, hcp._hp2cp, hcp, y3, cu)
  local Tl = x:size(1)
  local yn = F.gated_rmsnorm(y_seq, z, m.params["norm.weight"], s.norm_group, m.norm_eps)
  local out = tensor.matmul(yn:view(Tl * B, s.d_inner), m.params["out_proj.weight"], { trans_b = true })
  local b2 = group:bytes()
  m.cp_bytes = {
    forward_check = (b1.sent - b0.sent) + (b1.received - b0.received),
    forward_sent = b2.sent - b1.sent, forward_received = b2.received - b1.received,
    forward_received_incl_self = (b2.received_incl_self or 0) - (b1.received_incl_self or 0),
  }
  m.cache = { x = x, cu_in = cu_in, cu = cu, zx = zx, z = z, view = view, xBC = xBC, b = b, a = a,
              inp = inp, y_seq = y_seq, yn = yn }
  return out:view(Tl, B, m.hidden_size)
end

-- Backward; accumulates into m.grads (gdp.cp.layer_backward points them at scratch
-- buffers and sums them over the group).
function M.layer_backward(m, dy)
  local fn = "nn.GatedDeltaProduct:backward (headwise CP)"
  local c = m.cache
  local hcp = m.cp_state
  local group = m.cp_group
  local x = c.x
  shard.agree_dy(group, fn, dy, x)
  local b1 = group:bytes()
  local s = m.sizes
  local Tl, B = x:size(1), x:size(2)
  local T = Tl * hcp.cp
  local view = c.view
  local ls = view.sizes
  local dout2 = dy:reshape(Tl * B, m.hidden_size)
  tensor.matmul(dout2, c.yn:view(Tl * B, s.d_inner),
                { trans_a = true, out = m.grads["out_proj.weight"], beta = 1 })
  local dyn = tensor.matmul(dout2, m.params["out_proj.weight"]):view(Tl, B, s.d_inner)
  local dy_seq, dz, dnw = F.gated_rmsnorm_backward(c.y_seq, c.z, m.params["norm.weight"],
                                                   s.norm_group, m.norm_eps, dyn)
  m.grads["norm.weight"]:add_(dnw)
  local dy3 = timing.stage("all_to_all_out_backward", m.device, hcp._hp2cp_backward, hcp, dy_seq, c.cu)
  local dy4 = dy3:view(T, B, hcp.nheads_local, m.head_dim)
  local dx_v
  if m.D_mode then
    local dD
    dx_v, dD = F.dskip_backward(c.inp.x_v, view.params.D, dy4)
    hcp:get_D_backward(dD, m.grads["D"])
  end
  local g = timing.stage("local_backward", m.device, view.ssm_backward, view, c.inp, c.cu,
                         dy4:permute(2, 1, 3, 4))
  local dloc = tensor.empty({ T, B, hcp:local_width(false) }, { dtype = m.dtype, device = m.device })
  view:inputs_backward(g, c.xBC, c.b, c.a, dx_v, c.cu, nil,
                       { dxBC = dloc:narrow(3, 1, ls.conv_dim), db = dloc:narrow(3, ls.conv_dim + 1, ls.b_dim),
                         da = dloc:narrow(3, ls.conv_dim + ls.b_dim + 1, ls.a_dim) },
                       { weight = view.params["conv1d.weight"], bias = view.params["conv1d.bias"],
                         grads = { weight = view.grads["conv1d.weight"], bias = view.grads["conv1d.bias"] } })
  hcp:get_conv1d_weight_backward(view.grads["conv1d.weight"], m.grads["conv1d.weight"])
  if m.grads["conv1d.bias"] ~= nil then
    hcp:get_conv1d_bias_backward(view.grads["conv1d.bias"], m.grads["conv1d.bias"])
  end
  hcp:get_A_log_backward(view.grads["A_log"], m.grads["A_log"])
  hcp:get_dt_bias_backward(view.grads["dt_bias"], m.grads["dt_bias"])
  local dzx = timing.stage("all_to_all_in_backward", m.device, hcp._cp2hp_backward, hcp, dloc, false, c.cu)
  dzx:narrow(3, s.z_off, s.d_inner):copy(dz)
  local dx = m:in_proj_backward(x, dzx)
  local b2 = group:bytes()
  m.cp_bytes = m.cp_bytes or {}
  m.cp_bytes.backward_sent, m.cp_bytes.backward_received = b2.sent - b1.sent, b2.received - b1.received
  m.cp_bytes.backward_received_incl_self = (b2.received_incl_self or 0) - (b1.received_incl_self or 0)
  return dx
end

return M
