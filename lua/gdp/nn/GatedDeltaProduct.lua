-- gdp.nn.GatedDeltaProduct: the Gated DeltaProduct mixer layer with Megatron-Core's
-- semantics and parameter names (docs/design.md section 3), forward and backward, in the
-- style of torch's nn.
--
--   local nn = require("gdp.nn")
--   local m = nn.GatedDeltaProduct{hidden_size = 64, num_heads = 4, head_dim = 16,
--                                  num_groups = 2, state_dim = 16, num_householder = 2,
--                                  dtype = "f64", seed = 1}
--   local out = m:forward(x, cu_seqlens)      -- x [T,B,hidden_size], out like x
--   local dx = m:backward(x, dy)              -- accumulates m:gradients()
--   m:parameters()["in_proj.weight"], m:gradients()["A_log"], m:zero_grad()
--   m:save("mixer.safetensors"); m:load("mixer.safetensors")
--
-- Options (defaults): hidden_size, num_heads, head_dim, num_groups (1), state_dim,
-- num_householder (3), conv_width (4), allow_neg_eigval (false: beta in (0,1); true:
-- (0,2)), D (false | "head" | "channel": the optional skip y += D * x_v, per head or per
-- channel = Megatron's D_has_hdim), norm_eps (1e-5), conv_bias (true), dtype ("f64" |
-- "f32" on the cpu; "f32" | "bf16" on cuda), device ("cpu"; "cuda", "cuda:<i>"), seed
-- (nil: the device's current RNG stream), algorithm ("auto": the operator's),
-- init_method_std (0.02), num_layers (1, for out_proj's scaled init),
-- save_for_backward (true: the operator's forward keeps what its backward would
-- recompute, gdp.ops' save_for_backward: on cuda about 1 GB more per layer at 4 x 4096
-- tokens, 16 heads x 128, n = 2, and a backward 0.6 ms shorter there; false: the
-- backward recomputes it).
--
-- Switches of fla's GatedDeltaProduct layer (all true by default: the layer above),
-- for the DeltaProduct state-tracking setup, which turns all three off:
--   use_short_conv = false   no conv1d.weight / conv1d.bias: q, k, v = SiLU of their
--                            in_proj sections (fla: F.silu(q_proj(x)), ...).
--   use_output_gate = false  no z section in in_proj: the norm is RMSNorm(y) * norm.weight
--                            (fla's o_norm = RMSNorm without g_proj), in the same groups.
--   use_forget_gate = false  no a section, no A_log / dt_bias: the operator runs ungated
--                            (fla: g = None).
-- fla normalises every value head alone with one [head_v_dim] weight shared by the
-- heads; this layer normalises groups of d_inner / num_groups channels (Megatron), each
-- channel with its own weight: with num_groups = num_heads (fla's layout when K and V
-- heads pair one to one) the groups are fla's heads and, at the initial weights (ones),
-- the two are the same function.  Context parallelism needs the three switches on.
--
-- Devices and dtypes.  Parameters, gradients and every intermediate live on the layer's
-- device; each op runs where its tensors are.  A bf16 layer keeps float32 copies where
-- Megatron does: A_log and dt_bias (and their gradients) are float32, the decay gate g
-- is computed in float32 from them (then rounded to bf16, the operator's token dtype),
-- and the norms' statistics are float32 inside the kernels; the GEMMs take bf16 operands
-- with float32 accumulation.  Every other parameter has the layer's dtype.
--
-- Layout.  in_proj maps D_model to [z (d_inner), V (M d_inner), K (M ng N), Q (ng N),
-- b (M nh), a (nh)] on the last dim, with V inside as (m, head, p), K as (m, group, n)
-- and b as (m, head); the depthwise conv (+SiLU) runs over the channels [V, K, Q] and
-- restarts at every packed sequence.  The operator sees q [B,T,nh,N] (groups repeated
-- to heads: head h uses group h / (nh/ng)), k [B,T*M,nh,N] with row t*M+m, v
-- [B,T*M,nh,P], beta [B,T*M,nh], g [B,T,nh], L2-normalised q and k, scale N^-1/2 and
-- no initial state.  The D skip reads x_v = the first value copy (m = 0) of the conv
-- output (Megatron's GDP has no D; with M = 1 this is Mamba2's x).  Then the gated
-- RMSNorm RMSNorm(y * SiLU(z)) * norm.weight in groups of d_inner / ng, and out_proj.
--
-- Initialisation (Megatron-Core's defaults): in_proj.weight ~ N(0, init_method_std);
-- out_proj.weight ~ N(0, init_method_std / sqrt(2 num_layers)) (the scaled output init);
-- conv1d.weight and conv1d.bias ~ U(-1/sqrt(W), 1/sqrt(W)) (torch Conv1d's default,
-- fan_in = W for a depthwise conv); A ~ U(0, 16), A_log = log A; dt = exp(U(log 1e-3,
-- log 1e-1)) clamped >= 1e-4, dt_bias = dt + log(-expm1(-dt)); D and norm.weight ones.
--
-- Context parallelism (docs/design.md section 4; gdp.cp): cp_mode = "headwise" (all-to-all
-- around the conv and the operator, Megatron's GDPContextParallel) or "chunkwise" (state
-- passing with a conv halo), cp_group = a gdp.comm communicator, cp_layout = "zigzag"
-- (headwise default) or "contiguous" (chunkwise: always).  forward(x, cu_seqlens) then
-- takes the rank-local tokens x [T/cp,B,D] in that layout (gdp.cp.shard.split makes
-- them) and the GLOBAL cu_seqlens, and returns the rank-local output; backward returns
-- the rank-local dx.  Parameters are broadcast from cp rank 0 at construction and the
-- parameter gradients of each backward are summed over the group (cp_reduce_grads =
-- false leaves them rank-partial, for a caller that reduces them with its data-parallel
-- gradients).  Ranks check once per call that they agree on shapes and configuration.
--
-- Stages.  forward = in_proj_forward -> split_in_proj -> inputs_forward (conv_forward ->
-- ssm_inputs; without short conv ssm_inputs alone, applying the SiLU) -> ssm_forward ->
-- out_forward, and backward mirrors them (out_backward, ssm_backward, inputs_backward
-- (ssm_inputs_backward, conv_backward), in_proj_backward).  Each stage takes and returns
-- plain tensors, so that context-parallel variants can put all-to-alls or halo
-- exchanges between them, and parameter slices in place of the full parameters.
local ffi = require("ffi")
local tensor = require("gdp.tensor")
local util = require("gdp.util")
local ops = require("gdp.ops")
local gio = require("gdp.io")
local F = require("gdp.nn.functional")
local Module = require("gdp.nn.Module")

local argerror = tensor.argerror

local GatedDeltaProduct = {}
GatedDeltaProduct.__index = GatedDeltaProduct
GatedDeltaProduct.__name = "GatedDeltaProduct"

local FN = "nn.GatedDeltaProduct"

local option_keys = {
  hidden_size = true, num_heads = true, head_dim = true, num_groups = true, state_dim = true,
  num_householder = true, conv_width = true, allow_neg_eigval = true, D = true, norm_eps = true,
  conv_bias = true, dtype = true, device = true, seed = true, algorithm = true,
  save_for_backward = true, init_method_std = true, num_layers = true,
  cp_mode = true, cp_group = true, cp_layout = true, cp_reduce_grads = true,
  use_short_conv = true, use_output_gate = true, use_forget_gate = true,
}

-- Megatron's names, in the order of the layer.
local PARAM_ORDER = {
  "in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
  "out_proj.weight",
}

local function int_opt(cfg, key, default, min) return util.int_option(FN, cfg, key, default, min) end
local function num_opt(cfg, key, default, min) return util.num_option(FN, cfg, key, default, min) end

------------------------------------------------------------------------------- construction

-- Parameters kept in float32 in a bf16 layer (Megatron's gate parameters).
local FLOAT32_IN_BF16 = { A_log = true, dt_bias = true }

-- The dtype of parameter `name` (and of its gradient).
function GatedDeltaProduct:param_dtype(name)
  if self.dtype == "bf16" and FLOAT32_IN_BF16[name] then return "f32" end
  return self.dtype
end

-- Values of a tensor computed on the host: fn(i) for i = 1..n, as a tensor of dtype
-- `dtype` on the module's device.
local function host_tensor(self, n, dtype, fn)
  local vals = {}
  for i = 1, n do vals[i] = fn(i) end
  return tensor.tensor(vals, { n }, { dtype = dtype, device = self.device })
end

-- The decay gate's A_log and dt_bias: drawn in float64 from the same RNG, transformed on
-- the host.
local function init_gate_parameters(self, p)
  local nh = self.num_heads
  local dt_u = tensor.empty({ nh }, { dtype = "f64", device = self.device })
                 :uniform_(math.log(1e-3), math.log(1e-1)):flat()
  p["dt_bias"] = host_tensor(self, nh, self:param_dtype("dt_bias"), function(i)
    local dt = math.max(math.exp(dt_u[i]), 1e-4)
    -- inverse softplus: log(exp(dt) - 1) = dt + log(1 - exp(-dt)) = dt + log(-expm1(-dt));
    -- -expm1(-dt) written as 1 - exp(-dt) loses digits for small dt, so use the series.
    local e = dt < 1e-5 and dt * (1 - dt / 2) or (1 - math.exp(-dt))
    return dt + math.log(e)
  end)
  local A_u = tensor.empty({ nh }, { dtype = "f64", device = self.device }):uniform_(0, 16):flat()
  p["A_log"] = host_tensor(self, nh, self:param_dtype("A_log"), function(i) return math.log(A_u[i]) end)
end

local function init_parameters(self)
  local opts = { dtype = self.dtype, device = self.device }
  local p = {}
  local s = self.sizes
  p["in_proj.weight"] = tensor.empty({ s.d_in_proj, self.hidden_size }, opts)
                          :normal_(0, self.init_method_std)
  local bound = 1 / math.sqrt(self.conv_width)
  if self.use_short_conv then
    p["conv1d.weight"] = tensor.empty({ s.conv_dim, 1, self.conv_width }, opts):uniform_(-bound, bound)
    if self.conv_bias then
      p["conv1d.bias"] = tensor.empty({ s.conv_dim }, opts):uniform_(-bound, bound)
    end
  end
  local nh = self.num_heads
  if self.use_forget_gate then init_gate_parameters(self, p) end
  if self.D_mode then
    p["D"] = tensor.ones({ self.D_mode == "channel" and s.d_inner or nh }, opts)
  end
  p["norm.weight"] = tensor.ones({ s.d_inner }, opts)
  p["out_proj.weight"] = tensor.empty({ self.hidden_size, s.d_inner }, opts)
                           :normal_(0, self.init_method_std / math.sqrt(2 * self.num_layers))
  return p
end

local function construct(cfg)
  if type(cfg) ~= "table" then
    argerror(FN, "expected an options table {hidden_size =, num_heads =, head_dim =, state_dim =, ...}")
  end
  tensor.check_opts(FN, cfg, option_keys)
  local self = setmetatable({}, GatedDeltaProduct)
  self.hidden_size = int_opt(cfg, "hidden_size", nil, 1)
  self.num_heads = int_opt(cfg, "num_heads", nil, 1)
  self.head_dim = int_opt(cfg, "head_dim", nil, 1)
  self.num_groups = int_opt(cfg, "num_groups", 1, 1)
  self.state_dim = int_opt(cfg, "state_dim", nil, 1)
  self.num_householder = int_opt(cfg, "num_householder", 3, 1)
  self.conv_width = int_opt(cfg, "conv_width", 4, 1)
  self.norm_eps = num_opt(cfg, "norm_eps", 1e-5, 0)
  self.init_method_std = num_opt(cfg, "init_method_std", 0.02, 0)
  self.num_layers = int_opt(cfg, "num_layers", 1, 1)
  self.allow_neg_eigval = cfg.allow_neg_eigval == true
  self.beta_scale = self.allow_neg_eigval and 2 or 1
  self.conv_bias = cfg.conv_bias ~= false
  for _, key in ipairs({ "use_short_conv", "use_output_gate", "use_forget_gate" }) do
    local v = cfg[key]
    if v ~= nil and type(v) ~= "boolean" then
      argerror(FN, string.format("%s: expected true or false, got %s", key, tostring(v)))
    end
    self[key] = v ~= false
  end
  if cfg.D ~= nil and cfg.D ~= false and cfg.D ~= "head" and cfg.D ~= "channel" then
    argerror(FN, "D: expected false, \"head\" or \"channel\" (D_has_hdim), got " .. tostring(cfg.D))
  end
  self.D_mode = cfg.D or false
  self.device = cfg.device or "cpu"
  local on_cuda = type(self.device) == "string" and self.device:match("^cuda") ~= nil
  self.dtype = cfg.dtype or (on_cuda and "f32" or "f64")
  if on_cuda then
    if self.dtype ~= "f32" and self.dtype ~= "bf16" then
      argerror(FN, "dtype: expected \"f32\" or \"bf16\" on " .. self.device ..
                   " (the cuda operator's dtypes), got " .. tostring(self.dtype))
    end
  elseif self.dtype ~= "f64" and self.dtype ~= "f32" then
    argerror(FN, "dtype: expected \"f64\" or \"f32\" on " .. tostring(self.device) ..
                 (self.dtype == "bf16" and " (bf16 layers run on cuda)" or "") ..
                 ", got " .. tostring(self.dtype))
  end
  self.algorithm = cfg.algorithm or "auto"
  if cfg.save_for_backward ~= nil and type(cfg.save_for_backward) ~= "boolean" then
    argerror(FN, "save_for_backward: expected a boolean, got " .. tostring(cfg.save_for_backward))
  end
  self.save_for_backward = cfg.save_for_backward ~= false
  if self.num_heads % self.num_groups ~= 0 then
    argerror(FN, string.format("num_groups: expected a divisor of num_heads = %d, got %d",
                               self.num_heads, self.num_groups))
  end

  self.sizes = GatedDeltaProduct.compute_sizes(self.num_heads, self.head_dim, self.num_groups,
                                               self.state_dim, self.num_householder, self)
  self.scale = self.state_dim ^ -0.5 -- as Megatron writes it (d_state ** -0.5)

  local cp_mode = cfg.cp_mode
  if cp_mode == false then cp_mode = nil end
  if cp_mode ~= nil and cp_mode ~= "headwise" and cp_mode ~= "chunkwise" then
    argerror(FN, "cp_mode: expected nil, \"headwise\" or \"chunkwise\", got " .. tostring(cp_mode))
  end
  self.cp_mode = cp_mode
  if cp_mode ~= nil then
    if not (self.use_short_conv and self.use_output_gate and self.use_forget_gate) then
      argerror(FN, "cp_mode: context parallelism needs use_short_conv, use_output_gate and " ..
                   "use_forget_gate on (the CP stages exchange the conv halo and gate sections)")
    end
    if cfg.cp_group == nil then
      argerror(FN, "cp_group: expected a gdp.comm communicator with cp_mode = \"" .. cp_mode .. "\", got nil")
    end
    self.cp_group = cfg.cp_group
    self.cp_layout = cfg.cp_layout or (cp_mode == "headwise" and "zigzag" or "contiguous")
    self.cp_reduce_grads = cfg.cp_reduce_grads ~= false
  elseif cfg.cp_group ~= nil or cfg.cp_layout ~= nil then
    argerror(FN, "cp_group/cp_layout: given without cp_mode (\"headwise\" or \"chunkwise\")")
  end

  -- A given seed draws the parameters from its own stream and leaves the device's
  -- stream where it was.
  local ctx = tensor.get_ctx(FN, self.device)
  self.device_name = ctx:name()
  local saved_seed, saved_offset
  if cfg.seed ~= nil then
    util.int_arg(FN, "seed", cfg.seed, 0)
    saved_seed, saved_offset = ctx:seed(), ctx:rng_offset()
    ctx:manual_seed(cfg.seed)
  end
  local ok, params = pcall(init_parameters, self)
  if saved_seed ~= nil then
    ctx:manual_seed(saved_seed)
    ctx:set_rng_offset(saved_offset)
  end
  if not ok then error(params, 0) end
  self.params = params
  self.grads = {}
  for name, t in pairs(params) do
    self.grads[name] = tensor.zeros(t:shape(), { dtype = self:param_dtype(name), device = self.device })
  end
  self.cache = nil
  return self
end

function GatedDeltaProduct.new(cfg)
  if type(cfg) == "table" and cfg.cp_mode and cfg.cp_group ~= nil then
    -- Context parallel: a configuration error on one rank is raised on every rank
    -- (instead of leaving the others waiting in the first collective).
    local cp = require("gdp.cp")
    local self = cp.shard.agreed(cfg.cp_group, construct, cfg)
    cp.attach(self)
    return self
  end
  return construct(cfg)
end

-- Section sizes and offsets of a layer with nh heads of dim P, ng groups of state dim N
-- and M Householder steps (context-parallel ranks use it with their local head and
-- group counts); `switches` (optional) holds use_output_gate and use_forget_gate (false:
-- no z, no a section).
function GatedDeltaProduct.compute_sizes(nh, P, ng, N, M, switches)
  local s = {}
  s.d_inner = nh * P
  s.z_dim = (switches == nil or switches.use_output_gate ~= false) and s.d_inner or 0
  s.v_dim = M * s.d_inner         -- V: (m, head, p)
  s.k_dim = M * ng * N            -- K: (m, group, n)
  s.q_dim = ng * N
  s.conv_dim = s.v_dim + s.k_dim + s.q_dim
  s.b_dim = M * nh                -- b: (m, head)
  s.a_dim = (switches == nil or switches.use_forget_gate ~= false) and nh or 0
  s.d_in_proj = s.z_dim + s.conv_dim + s.b_dim + s.a_dim
  -- 1-based offsets on the in_proj output's last dim and on the conv channels
  s.z_off = 1
  s.xBC_off = 1 + s.z_dim
  s.b_off = s.xBC_off + s.conv_dim
  s.a_off = s.b_off + s.b_dim
  s.v_off, s.k_off, s.q_off = 1, 1 + s.v_dim, 1 + s.v_dim + s.k_dim
  s.norm_group = s.d_inner / ng
  return s
end

setmetatable(GatedDeltaProduct, {
  __call = function(_, cfg) return GatedDeltaProduct.new(cfg) end,
})

function GatedDeltaProduct:__tostring()
  return string.format("nn.GatedDeltaProduct(hidden %d, heads %d x %d, groups %d x %d, " ..
                       "householder %d, %s%s%s%s%s, %s, %s%s)",
                       self.hidden_size, self.num_heads, self.head_dim, self.num_groups,
                       self.state_dim, self.num_householder,
                       self.use_short_conv and ("conv " .. self.conv_width) or "no conv",
                       self.use_output_gate and "" or ", no output gate",
                       self.use_forget_gate and "" or ", no forget gate",
                       self.allow_neg_eigval and ", neg eigval" or "",
                       self.D_mode and (", D " .. self.D_mode) or "", self.dtype, self.device,
                       self.cp_mode and string.format(", cp %s %s x %d", self.cp_mode,
                                                      self.cp_layout, self.cp_group:size()) or "")
end

------------------------------------------------------------------------------- parameters

-- Parameter names present in this module, in layer order.
function GatedDeltaProduct:parameter_names()
  local out = {}
  for _, name in ipairs(PARAM_ORDER) do
    if self.params[name] ~= nil then out[#out + 1] = name end
  end
  return out
end

-- name -> tensor (the live parameters: writing into them changes the module).
function GatedDeltaProduct:parameters() return self.params end

-- name -> tensor of accumulated gradients.
function GatedDeltaProduct:gradients() return self.grads end

function GatedDeltaProduct:zero_grad()
  for _, g in pairs(self.grads) do g:zero() end
  return self
end

-- Copies values (any dtype) into the parameters from a table name -> tensor.  Every
-- parameter must be present with its shape; with strict (default) no other name may be.
function GatedDeltaProduct:set_parameters(tensors, strict)
  if strict == nil then strict = true end
  if type(tensors) ~= "table" then
    argerror(FN, "set_parameters: expected a table {name = tensor}, got " .. type(tensors))
  end
  for _, name in ipairs(self:parameter_names()) do
    local src = tensors[name]
    if src == nil then argerror(FN, "set_parameters: missing parameter '" .. name .. "'") end
    tensor.tensor_arg(src, FN .. ":set_parameters", name)
    local dst = self.params[name]
    if tensor.shape_str(src:shape()) ~= tensor.shape_str(dst:shape()) then
      argerror(FN, string.format("set_parameters: %s: expected shape %s, got %s", name,
                                 tensor.shape_str(dst:shape()), tensor.shape_str(src:shape())))
    end
    dst:copy(src)
  end
  if strict then
    for name in pairs(tensors) do
      if self.params[name] == nil then
        argerror(FN, "set_parameters: unexpected tensor '" .. tostring(name) ..
                     "' (not a parameter of this module; pass strict = false to ignore)")
      end
    end
  end
  self.cache = nil
  return self
end

-- safetensors with Megatron's names and the configuration as metadata.
function GatedDeltaProduct:save(path)
  gio.save(path, self.params, {
    layer = "GatedDeltaProduct", hidden_size = self.hidden_size, num_heads = self.num_heads,
    head_dim = self.head_dim, num_groups = self.num_groups, state_dim = self.state_dim,
    num_householder = self.num_householder, conv_width = self.conv_width,
    allow_neg_eigval = self.allow_neg_eigval, D = self.D_mode or "false",
    norm_eps = self.norm_eps, conv_bias = self.conv_bias, use_short_conv = self.use_short_conv,
    use_output_gate = self.use_output_gate, use_forget_gate = self.use_forget_gate,
  })
end

-- Loads parameters saved by save (or any file with Megatron's names; strict = false
-- ignores the file's other tensors).
function GatedDeltaProduct:load(path, strict)
  local tensors = gio.load(path, { device = self.device })
  return self:set_parameters(tensors, strict)
end

------------------------------------------------------------------------------- stages

local function check_input(self, fn, x)
  tensor.tensor_arg(x, fn, "x")
  if x:dim() ~= 3 or x:size(3) ~= self.hidden_size then
    argerror(fn, string.format("x: expected [T,B,%d] (sequence-major, hidden_size %d), got %s",
                               self.hidden_size, self.hidden_size, tensor.shape_str(x:shape())))
  end
  if x:dtype() ~= self.dtype then
    argerror(fn, string.format("x: expected dtype %s (the module's), got %s", self.dtype, x:dtype()))
  end
  if self.device_name and x:device() ~= self.device_name then
    argerror(fn, string.format("x: expected a tensor on %s (the module's device), got %s",
                               self.device_name, x:device()))
  end
end

-- x [T,B,D] -> the in_proj output [T,B,d_in_proj].
function GatedDeltaProduct:in_proj_forward(x, weight)
  local T, B = x:size(1), x:size(2)
  local x2 = x:reshape(T * B, self.hidden_size)
  local zx = tensor.matmul(x2, weight or self.params["in_proj.weight"], { trans_b = true })
  return zx:view(T, B, self.sizes.d_in_proj)
end

-- Backward of in_proj: returns dx [T,B,D]; accumulates in_proj.weight's gradient.
function GatedDeltaProduct:in_proj_backward(x, dzx, weight, grad)
  local T, B = x:size(1), x:size(2)
  local x2 = x:reshape(T * B, self.hidden_size)
  local dzx2 = dzx:reshape(T * B, self.sizes.d_in_proj)
  tensor.matmul(dzx2, x2, { trans_a = true, out = grad or self.grads["in_proj.weight"], beta = 1 })
  local dx = tensor.matmul(dzx2, weight or self.params["in_proj.weight"])
  return dx:view(T, B, self.hidden_size)
end

-- Views of the in_proj output's sections: z [T,B,d_inner] (nil without output gate),
-- xBC [T,B,conv_dim], b [T,B,M*nh], a [T,B,nh] (nil without forget gate).
function GatedDeltaProduct:split_in_proj(zx)
  local s = self.sizes
  return {
    z = s.z_dim > 0 and zx:narrow(3, s.z_off, s.z_dim) or nil,
    xBC = zx:narrow(3, s.xBC_off, s.conv_dim),
    b = zx:narrow(3, s.b_off, s.b_dim),
    a = s.a_dim > 0 and zx:narrow(3, s.a_off, s.a_dim) or nil,
  }
end

-- The in_proj output's gradient [T,B,d_in_proj], allocated before the backward stages
-- so that they fill its sections in place (the conv backward writes dxBC there, the
-- fused input stage db and da, the output norm dz); returns it and its section views
-- (split_in_proj's).
function GatedDeltaProduct:in_proj_grad(T, B)
  local dzx = tensor.empty({ T, B, self.sizes.d_in_proj }, { dtype = self.dtype, device = self.device })
  return dzx, self:split_in_proj(dzx)
end

-- Depthwise causal conv + SiLU over [V, K, Q]; halo [L,B,C] optional (context parallel).
-- A layer with short conv only: without, inputs_forward has the input stage apply the SiLU.
function GatedDeltaProduct:conv_forward(xBC, cu_seqlens, halo, weight, bias)
  return F.conv1d(xBC, weight or self.params["conv1d.weight"],
                  bias or (weight == nil and self.params["conv1d.bias"] or nil),
                  { activation = "silu", cu_seqlens = cu_seqlens, halo = halo })
end

-- Returns dxBC [T,B,C] (written into `out` when given: a view into the in_proj
-- gradient) and dhalo (nil without halo); accumulates the conv gradients into grads
-- (default: the module's) when given.
function GatedDeltaProduct:conv_backward(xBC, dxBC_c, cu_seqlens, halo, weight, bias, grads, out)
  local w = weight or self.params["conv1d.weight"]
  local b = bias or (weight == nil and self.params["conv1d.bias"] or nil)
  local r = F.conv1d_backward(xBC, w, b, dxBC_c,
                              { activation = "silu", cu_seqlens = cu_seqlens, halo = halo, dx = out })
  grads = grads or { weight = self.grads["conv1d.weight"], bias = self.grads["conv1d.bias"] }
  Module.accumulate(grads.weight, r.dweight)
  if r.dbias ~= nil and grads.bias ~= nil then Module.accumulate(grads.bias, r.dbias) end
  return r.dx, r.dhalo
end

-- The sizes of the fused input stage (F.ssm_inputs) of this layer, or of a context-
-- parallel rank's view of it (its local head and group counts).
function GatedDeltaProduct:input_dims()
  return { num_heads = self.num_heads, head_dim = self.head_dim, num_groups = self.num_groups,
           state_dim = self.state_dim, num_householder = self.num_householder,
           beta_scale = self.beta_scale }
end

-- The operator's inputs from the conv output and the gate sections, in one fused op:
-- {q [B,T,nh,N], k [B,T*M,nh,N], v [B,T*M,nh,P], beta [B,T*M,nh], g [B,T,nh] (nil
--  without forget gate), x_v [T,B,nh,P] (value copy m = 0, for the D skip: a view)}.
-- g is in A_log's dtype (float32 in a bf16 layer, as Megatron's
-- -exp(A_log.float()) * softplus(a.float() + dt_bias)), and handed to the operator so:
-- its gradient comes back in float32 too, and the sums over tokens that make the A_log
-- and dt_bias gradients do not start from bf16-rounded terms.
-- silu = true: xBC_c is the in_proj section itself, taken through SiLU here (a layer
-- without short conv: no pass of its own), and x_v is a view of v's copy m = 0.
function GatedDeltaProduct:ssm_inputs(xBC_c, b, a, silu)
  local s = self.sizes
  local T, B = xBC_c:size(1), xBC_c:size(2)
  local p = self.params
  local inp = F.ssm_inputs(xBC_c, b, a, a and p["A_log"], a and p["dt_bias"], self:input_dims(),
                           { silu = silu or false })
  if silu then
    local M, nh, P = self.num_householder, self.num_heads, self.head_dim
    inp.x_v = inp.v:view(B, T, M, nh, P):select(3, 1):transpose(1, 2)
  else
    inp.x_v = xBC_c:narrow(3, s.v_off, s.d_inner):view(T, B, self.num_heads, self.head_dim)
  end
  return inp
end

-- Backward of ssm_inputs: from the operator's gradients (and dx_v of the D skip) to
-- dxBC_c [T,B,C], db [T,B,M*nh], da [T,B,nh] (nil without forget gate); accumulates the
-- A_log and dt_bias gradients.  out (optional) {dxBC =, db =, da =}: views to write
-- those into (the in_proj gradient's sections), returned.  silu_input: the xBC of a
-- forward with silu (dxBC is then its gradient).
function GatedDeltaProduct:ssm_inputs_backward(grads, b, a, dx_v, out, silu_input)
  local p = self.params
  local r = F.ssm_inputs_backward(b, a, a and p["A_log"], a and p["dt_bias"], self:input_dims(),
                                  { dq = grads.dq, dk = grads.dk, dv = grads.dv, dbeta = grads.dbeta,
                                    dg = a and grads.dg or nil, dx_v = dx_v },
                                  out and { dxBC = out.dxBC, db = out.db, da = out.da },
                                  { silu_input = silu_input })
  if a ~= nil then
    Module.accumulate(self.grads["A_log"], r.dA_log)
    if r.ddt_bias ~= nil then Module.accumulate(self.grads["dt_bias"], r.ddt_bias) end
  end
  return r.dxBC, r.db, r.da
end

local function op_args(self, inp, cu_seqlens)
  return {
    q = inp.q, k = inp.k, v = inp.v, g = inp.g, beta = inp.beta,
    num_householder = self.num_householder, scale = self.scale,
    use_qk_l2norm_in_kernel = true, output_final_state = false,
    cu_seqlens = cu_seqlens, algorithm = self.algorithm,
  }
end

-- The GDP operator: o [B,T,nh,P], and with save = true the operator's saved state for
-- ssm_backward (a gdp.GdpSaved; nil without).
function GatedDeltaProduct:ssm_forward(inp, cu_seqlens, save)
  local args = op_args(self, inp, cu_seqlens)
  if save then
    args.save_for_backward = true
    local o, _, saved = ops.chunk_gated_delta_product(args)
    return o, saved
  end
  return (ops.chunk_gated_delta_product(args))
end

-- {dq, dk, dv, dbeta, dg} for d_o [B,T,nh,P]; saved (optional) from ssm_forward.
function GatedDeltaProduct:ssm_backward(inp, cu_seqlens, d_o, saved)
  local args = op_args(self, inp, cu_seqlens)
  args["do"] = d_o
  args.saved = saved
  return ops.chunk_gated_delta_product_backward(args)
end

-- o [B,T,nh,P] -> out [T,B,D]: the output norm (the D skip fused into the gated RMSNorm
-- with z, z nil: plain RMSNorm; F.out_norm reads o, x_v and z where they lie), then
-- out_proj.  Returns out and the intermediates out_backward needs.
function GatedDeltaProduct:out_forward(o, z, x_v)
  local T, B = o:size(2), o:size(1)
  local s = self.sizes
  local D = self.D_mode and self.params["D"] or nil
  local yn = F.out_norm(o, D and x_v or nil, D, z, self.params["norm.weight"], s.norm_group,
                        self.norm_eps)
  local out = tensor.matmul(yn:view(T * B, s.d_inner), self.params["out_proj.weight"],
                            { trans_b = true })
  return out:view(T, B, self.hidden_size), { o = o, yn = yn }
end

-- Backward of out_forward: returns d_o [B,T,nh,P], dz [T,B,d_inner] (nil without z;
-- written into dz_into when given: the z section of the in_proj gradient) and dx_v (nil
-- without D); accumulates out_proj, norm and D gradients.
function GatedDeltaProduct:out_backward(saved, z, x_v, dout, dz_into)
  local s = self.sizes
  local T, B = dout:size(1), dout:size(2)
  local dout2 = dout:reshape(T * B, self.hidden_size)
  tensor.matmul(dout2, saved.yn:view(T * B, s.d_inner),
                { trans_a = true, out = self.grads["out_proj.weight"], beta = 1 })
  local dyn = tensor.matmul(dout2, self.params["out_proj.weight"]):view(T, B, s.d_inner)
  local D = self.D_mode and self.params["D"] or nil
  local g = F.out_norm_backward(saved.o, D and x_v or nil, D, z, self.params["norm.weight"],
                                s.norm_group, self.norm_eps, dyn, z and dz_into or nil)
  Module.accumulate(self.grads["norm.weight"], g.dweight)
  if D then Module.accumulate(self.grads["D"], g.dD) end
  return g.d_o, g.dz, g.dx_v
end

------------------------------------------------------------------------------- nn interface

-- out [T,B,D] for x [T,B,D]; cu_seqlens (a table or an int tensor over T, B = 1) packs
-- independent sequences.  Keeps what backward needs.
-- What a backward must match to reuse the cached forward: x's object, its write count
-- (x:version(): an in-place write keeps the object) and the packing (Module.packing_key:
-- a cu_seqlens table by its values, as it may be changed in place; a cu_seqlens tensor
-- by its object and write count).  The counts see every write through gdp's API (also
-- through a view); a write through the raw x:data() pointer is not seen.

-- The conv and the input stage, as every path of the layer runs them (the layer, and
-- both context-parallel strategies on their shards): the operator's inputs (with x_v).
-- Without short conv the input stage applies the SiLU itself, so no pass of its own
-- reads and writes the xBC section.  halo, weight, bias: conv_forward's.
function GatedDeltaProduct:inputs_forward(xBC, b, a, cu_seqlens, halo, weight, bias)
  if not self.use_short_conv then return self:ssm_inputs(xBC, b, a, true) end
  return self:ssm_inputs(self:conv_forward(xBC, cu_seqlens, halo, weight, bias), b, a)
end

-- Backward of inputs_forward: writes dxBC, db, da into out {dxBC =, db =, da =} (views
-- into the in_proj gradient) and returns dhalo (nil without halo or short conv).  conv
-- (optional) {weight =, bias =, grads =}: conv_backward's weight, bias and grads.
function GatedDeltaProduct:inputs_backward(grads, xBC, b, a, dx_v, cu_seqlens, halo, out, conv)
  conv = conv or {}
  if not self.use_short_conv then
    self:ssm_inputs_backward(grads, b, a, dx_v, out, xBC)
    return nil
  end
  local dxBC_c = self:ssm_inputs_backward(grads, b, a, dx_v, { db = out.db, da = out.da })
  local _, dhalo = self:conv_backward(xBC, dxBC_c, cu_seqlens, halo, conv.weight, conv.bias,
                                      conv.grads, out.dxBC)
  return dhalo
end

local function remember_inputs(self, x, cu_seqlens)
  self.cache.x_version = x:version()
  self.cache.packing = Module.packing_key(cu_seqlens)
end

-- True when the cached forward was computed on exactly these inputs.
function GatedDeltaProduct:cache_matches(x, cu_seqlens)
  local c = self.cache
  if c == nil or not rawequal(c.x, x) or c.x_version ~= x:version() then return false end
  return Module.same_key(c.packing, Module.packing_key(cu_seqlens))
end

function GatedDeltaProduct:forward(x, cu_seqlens)
  if self.cp_mode then
    local out = require("gdp.cp").layer_forward(self, x, cu_seqlens)
    remember_inputs(self, x, cu_seqlens)
    self.output = out
    return out
  end
  check_input(self, FN .. ":forward", x)
  local cu = F.seqlens(cu_seqlens, FN .. ":forward")
  local zx = self:in_proj_forward(x)
  local parts = self:split_in_proj(zx)
  local inp = self:inputs_forward(parts.xBC, parts.b, parts.a, cu)
  self:drop_operator_state()
  local o, op_saved = self:ssm_forward(inp, cu, self.save_for_backward)
  local out, saved = self:out_forward(o, parts.z, inp.x_v)
  self.cache = { x = x, cu_in = cu_seqlens, cu = cu, zx = zx, parts = parts, inp = inp,
                 saved = saved, op_saved = op_saved }
  remember_inputs(self, x, cu_seqlens)
  self.output = out
  return out
end

-- dx for the loss sum(out * dy); parameter gradients accumulate (zero_grad resets them).
-- Uses the last forward when it was run on these inputs -- the same x object, not written
-- through gdp's API since (x:version(); a raw x:data() write is not seen), and the same
-- cu_seqlens values (nil: unpacked) -- else runs it again, so a stale forward is never
-- reused.  With cp_mode the checks and that decision are agreed over the group before
-- any collective.
function GatedDeltaProduct:backward(x, dy, cu_seqlens)
  local fn = FN .. ":backward"
  local function check_args()
    check_input(self, fn, x)
    tensor.tensor_arg(dy, fn, "dy")
    if tensor.shape_str(dy:shape()) ~= tensor.shape_str(x:shape()) then
      argerror(fn, string.format("dy: expected the shape of x %s, got %s",
                                 tensor.shape_str(x:shape()), tensor.shape_str(dy:shape())))
    end
    if dy:dtype() ~= self.dtype then
      argerror(fn, string.format("dy: expected dtype %s (the module's), got %s", self.dtype, dy:dtype()))
    end
    if dy:device() ~= x:device() then
      argerror(fn, string.format("dy: expected device %s (x's), got %s", x:device(), dy:device()))
    end
    return self:cache_matches(x, cu_seqlens)
  end
  local reuse
  if self.cp_mode then
    local shard = require("gdp.cp").shard
    reuse = shard.all_true(self.cp_group, shard.agreed(self.cp_group, check_args))
  else
    reuse = check_args()
  end
  if not reuse then self:forward(x, cu_seqlens) end
  local c = self.cache
  if self.cp_mode then
    local dx = require("gdp.cp").layer_backward(self, dy)
    self.grad_input = dx
    return dx
  end
  local dzx, dparts = self:in_proj_grad(x:size(1), x:size(2))
  local d_o, _, dx_v = self:out_backward(c.saved, c.parts.z, c.inp.x_v, dy, dparts.z)
  local g = self:ssm_backward(c.inp, c.cu, d_o, c.op_saved)
  self:inputs_backward(g, c.parts.xBC, c.parts.b, c.parts.a, dx_v, c.cu, nil,
                       { dxBC = dparts.xBC, db = dparts.b, da = dparts.a })
  local dx = self:in_proj_backward(x, dzx)
  self.grad_input = dx
  return dx
end

-- Frees the operator's saved state of the last forward now (device memory that the
-- garbage collector would hand back only later).
function GatedDeltaProduct:drop_operator_state()
  if self.cache and self.cache.op_saved then
    self.cache.op_saved:free()
    self.cache.op_saved = nil
  end
end

-- Drops the tensors kept between forward and backward.
function GatedDeltaProduct:clear_state()
  self:drop_operator_state()
  self.cache, self.output, self.grad_input = nil, nil, nil
  return self
end

return GatedDeltaProduct
