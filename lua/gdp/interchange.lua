-- gdp.interchange: a causal LM's parameters under fla's GatedDeltaProductForCausalLM
-- names and under Megatron-Core's hybrid-model names, both ways, with the configuration
-- in the safetensors metadata (docs/interchange.md has the mapping tables).
--
--   local X = require("gdp.interchange")
--   X.save("lm-fla.safetensors", model, config, "fla")                 -- or "megatron"
--   local params, config, format = X.load("lm-fla.safetensors")        -- back to our names
--   model:set_parameters(params)
--   local tensors, fla_config = X.to_fla(params, config)               -- the tables alone
--
-- Our names (gdp.nn's causal LM): embed.weight; per layer i (0-based)
-- layers.i.mixer_norm.weight (before the mixer), layers.i.mixer.<the mixer's Megatron
-- names>, layers.i.mlp_norm.weight (before the MLP), layers.i.mlp.w_gate / w_up / w_down;
-- norm.weight (final); lm_head.weight (absent when tied).  NAMES below holds them.
--
-- `config` (ours): vocab_size, hidden_size, num_layers, intermediate_size, norm_eps,
-- tie_embeddings (or gdp.nn.CausalLM's spelling: vocab, hidden, layers, mlp_ratio; and
-- X.causal_lm_options(config) turns a loaded config into CausalLM's options), and
-- mixer = {num_heads, head_dim, num_groups, state_dim,
-- num_householder, conv_width, conv_bias, allow_neg_eigval, D, use_short_conv,
-- use_output_gate, use_forget_gate} with gdp.nn.GatedDeltaProduct's meanings and
-- defaults.  The mixer's in_proj rows are [z | V | K | Q | b | a] (z without an output
-- gate and a without a forget gate absent), V as (m, head, p), K as (m, group, n), b as
-- (m, head); its conv channels are [V | K | Q].  fla's k/v/b projections use the same
-- (n, h, d) order, so converting splits and joins rows and never permutes them.
--
-- What fla's model cannot hold is an error naming it (num_groups ~= num_heads, a D
-- skip, conv biases, per-channel norm weights that differ between heads); names map
-- exactly, the math does not: fla's o_norm normalises each head and gates after the
-- norm, Megatron's (ours) gates before it in groups of d_inner / num_groups.
local tensor = require("gdp.tensor")
local gio = require("gdp.io")
local util = require("gdp.util")

local argerror = tensor.argerror

local X = {}

-- Our parameter names.
X.NAMES = {
  embed = "embed.weight",
  final_norm = "norm.weight",
  lm_head = "lm_head.weight",
  layer = "layers.%d.",
  mixer_norm = "mixer_norm.weight",
  mlp_norm = "mlp_norm.weight",
  mixer = "mixer.",
  w_gate = "mlp.w_gate",
  w_up = "mlp.w_up",
  w_down = "mlp.w_down",
}

------------------------------------------------------------------------------- config

local function need_int(fn, t, key, where, min)
  local v = t[key]
  if type(v) ~= "number" or v ~= math.floor(v) or v < (min or 1) then
    argerror(fn, string.format("%s%s: expected an integer >= %d, got %s", where, key, min or 1, tostring(v)))
  end
  return v
end

-- Our config with the defaults filled in, checked.
local function normalize(fn, config)
  if type(config) ~= "table" or type(config.mixer) ~= "table" then
    argerror(fn, "config: expected {vocab_size, hidden_size, num_layers, intermediate_size, mixer = {...}}, got " ..
                 type(config))
  end
  if config.vocab ~= nil or config.hidden ~= nil then -- gdp.nn.CausalLM's options
    local hidden = config.hidden
    config = { vocab_size = config.vocab, hidden_size = hidden, num_layers = config.layers or 1,
               intermediate_size = type(hidden) == "number" and math.floor((config.mlp_ratio or 4) * hidden + 0.5),
               norm_eps = config.norm_eps or 1e-5, tie_embeddings = config.tie_embeddings, mixer = config.mixer }
  end
  local c = {
    vocab_size = need_int(fn, config, "vocab_size", "config."),
    hidden_size = need_int(fn, config, "hidden_size", "config."),
    num_layers = need_int(fn, config, "num_layers", "config.", 0),
    intermediate_size = need_int(fn, config, "intermediate_size", "config."),
    norm_eps = config.norm_eps or 1e-5,
    tie_embeddings = config.tie_embeddings == true,
  }
  local m = config.mixer
  local mixer = {
    num_heads = need_int(fn, m, "num_heads", "config.mixer."),
    head_dim = need_int(fn, m, "head_dim", "config.mixer."),
    num_groups = m.num_groups == nil and 1 or need_int(fn, m, "num_groups", "config.mixer."),
    state_dim = need_int(fn, m, "state_dim", "config.mixer."),
    num_householder = m.num_householder == nil and 3 or need_int(fn, m, "num_householder", "config.mixer."),
    conv_width = m.conv_width == nil and 4 or need_int(fn, m, "conv_width", "config.mixer."),
    conv_bias = m.conv_bias ~= false,
    allow_neg_eigval = m.allow_neg_eigval == true,
    D = m.D or false,
    use_short_conv = m.use_short_conv ~= false,
    use_output_gate = m.use_output_gate ~= false,
    use_forget_gate = m.use_forget_gate ~= false,
  }
  if mixer.num_heads % mixer.num_groups ~= 0 then
    argerror(fn, string.format("config.mixer.num_groups: expected a divisor of num_heads = %d, got %d",
                               mixer.num_heads, mixer.num_groups))
  end
  c.mixer = mixer
  return c
end

-- The mixer's in_proj row sections and conv channel sections, in order: {name, rows}.
local function sections(m, D)
  local d_inner = m.num_heads * m.head_dim
  local M = m.num_householder
  local rows = {}
  if m.use_output_gate then rows[#rows + 1] = { "z", d_inner } end
  local conv = { { "V", M * d_inner }, { "K", M * m.num_groups * m.state_dim }, { "Q", m.num_groups * m.state_dim } }
  for _, s in ipairs(conv) do rows[#rows + 1] = s end
  rows[#rows + 1] = { "b", M * m.num_heads }
  if m.use_forget_gate then rows[#rows + 1] = { "a", m.num_heads } end
  return rows, conv, d_inner
end

------------------------------------------------------------------------------- tensors

local function shape_str(t) return tensor.shape_str(t:shape()) end

local function take(fn, tensors, name, shape, used)
  local t = tensors[name]
  if t == nil then argerror(fn, "missing tensor '" .. name .. "'") end
  tensor.tensor_arg(t, fn, name)
  if shape and tensor.shape_str(shape) ~= shape_str(t) then
    argerror(fn, string.format("%s: expected shape %s, got %s", name, tensor.shape_str(shape), shape_str(t)))
  end
  if used then used[name] = true end
  return t
end

-- Fails on tensors that no rule took (a file of another architecture or a typo).
local function no_leftovers(fn, tensors, used)
  local extra = {}
  for name in pairs(tensors) do
    if not used[name] then extra[#extra + 1] = name end
  end
  table.sort(extra)
  if #extra > 0 then
    argerror(fn, "unexpected tensors (no parameter of this config): " .. table.concat(extra, ", "))
  end
end

-- Row blocks of t along dim 1 named by `secs`: name -> view.
local function split_rows(t, secs)
  local out, off = {}, 1
  for _, s in ipairs(secs) do
    out[s[1]] = t:narrow(1, off, s[2])
    off = off + s[2]
  end
  return out
end

-- One tensor from row blocks (in secs' order) of the same trailing shape.
local function join_rows(parts, secs, like)
  local rows = 0
  for _, s in ipairs(secs) do rows = rows + s[2] end
  local shape = like:shape()
  shape[1] = rows
  local out = tensor.empty(shape, { dtype = like:dtype(), device = like:device() })
  local off = 1
  for _, s in ipairs(secs) do
    out:narrow(1, off, s[2]):copy(parts[s[1]])
    off = off + s[2]
  end
  return out
end

------------------------------------------------------------------------------- pairs

-- Copies the tensors that map one to one: pairs {ours, theirs, shape (nil: any)}, from
-- `src` to `dst`; `forward` true: ours -> theirs.
local function copy_pairs(fn, pairs_, src, dst, used, forward)
  for _, pr in ipairs(pairs_) do
    local from, to = pr[1], pr[2]
    if not forward then from, to = to, from end
    dst[to] = take(fn, src, from, pr[3], used)
  end
end

-- The one-to-one pairs outside the layers.
local function global_pairs(c, embed, final_norm, head)
  local Dm, V = c.hidden_size, c.vocab_size
  local out = { { X.NAMES.embed, embed, { V, Dm } }, { X.NAMES.final_norm, final_norm, { Dm } } }
  if not c.tie_embeddings then out[#out + 1] = { X.NAMES.lm_head, head, { V, Dm } } end
  return out
end

------------------------------------------------------------------------------- fla

local FLA_CONV = { V = "v_conv1d", K = "k_conv1d", Q = "q_conv1d" }
local FLA_PROJ = { z = "g_proj", V = "v_proj", K = "k_proj", Q = "q_proj", b = "b_proj", a = "a_proj" }

local function fla_config(c)
  local m = c.mixer
  return {
    model_type = "gated_deltaproduct", architectures = util.json_array({ "GatedDeltaProductForCausalLM" }),
    vocab_size = c.vocab_size, hidden_size = c.hidden_size, num_hidden_layers = c.num_layers,
    intermediate_size = c.intermediate_size, hidden_ratio = c.intermediate_size / c.hidden_size,
    hidden_act = "swish", norm_eps = c.norm_eps, tie_word_embeddings = c.tie_embeddings,
    num_heads = m.num_heads, head_dim = m.state_dim, expand_v = m.head_dim / m.state_dim,
    num_householder = m.num_householder, allow_neg_eigval = m.allow_neg_eigval,
    use_short_conv = m.use_short_conv, conv_size = m.conv_width, use_output_gate = m.use_output_gate,
    use_forget_gate = m.use_forget_gate,
  }
end

local function config_from_fla(fn, f)
  if type(f) ~= "table" then argerror(fn, "config: expected fla's GatedDeltaProductConfig fields, got " .. type(f)) end
  local N = need_int(fn, f, "head_dim", "fla config.")
  local P = (f.expand_v or 2) * N
  if P ~= math.floor(P) then argerror(fn, "fla config.expand_v: head_dim * expand_v must be an integer, got " .. P) end
  local D = need_int(fn, f, "hidden_size", "fla config.")
  return normalize(fn, {
    vocab_size = f.vocab_size, hidden_size = D, num_layers = f.num_hidden_layers,
    intermediate_size = f.intermediate_size or (f.hidden_ratio or 4) * D,
    norm_eps = f.norm_eps, tie_embeddings = f.tie_word_embeddings == true,
    mixer = { num_heads = f.num_heads, head_dim = P, num_groups = f.num_heads, state_dim = N,
              num_householder = f.num_householder or 1, conv_width = f.conv_size or 4, conv_bias = false,
              allow_neg_eigval = f.allow_neg_eigval == true, D = false,
              use_short_conv = f.use_short_conv ~= false, use_output_gate = f.use_output_gate ~= false,
              use_forget_gate = f.use_forget_gate == true },
  })
end

local function check_fla_expressible(fn, c)
  local m = c.mixer
  if m.num_groups ~= m.num_heads then
    argerror(fn, string.format("config.mixer.num_groups: fla's model pairs key and value heads one to one " ..
                               "(num_groups = num_heads = %d), got %d", m.num_heads, m.num_groups))
  end
  if m.D then argerror(fn, "config.mixer.D: fla's layer has no D skip, got " .. tostring(m.D)) end
  if m.use_short_conv and m.conv_bias then
    argerror(fn, "config.mixer.conv_bias: fla's model builds its short convs without bias, got true")
  end
end

-- Layer i's one-to-one pairs (ours, fla's, shape).
local function fla_layer_pairs(c, i)
  local m, Dm, F = c.mixer, c.hidden_size, c.intermediate_size
  local ours = string.format(X.NAMES.layer, i)
  local mx, theirs = ours .. X.NAMES.mixer, string.format("model.layers.%d.", i)
  local d_inner = m.num_heads * m.head_dim
  local out = {
    { mx .. "out_proj.weight", theirs .. "attn.o_proj.weight", { Dm, d_inner } },
    { ours .. X.NAMES.mixer_norm, theirs .. "attn_norm.weight", { Dm } },
    { ours .. X.NAMES.mlp_norm, theirs .. "mlp_norm.weight", { Dm } },
    { ours .. X.NAMES.w_gate, theirs .. "mlp.gate_proj.weight", { F, Dm } },
    { ours .. X.NAMES.w_up, theirs .. "mlp.up_proj.weight", { F, Dm } },
    { ours .. X.NAMES.w_down, theirs .. "mlp.down_proj.weight", { Dm, F } },
  }
  if m.use_forget_gate then
    out[#out + 1] = { mx .. "A_log", theirs .. "attn.A_log", { m.num_heads } }
    out[#out + 1] = { mx .. "dt_bias", theirs .. "attn.dt_bias", { m.num_heads } }
  end
  return out, mx, theirs .. "attn."
end

local function total_rows(secs)
  local n = 0
  for _, s in ipairs(secs) do n = n + s[2] end
  return n
end

function X.to_fla(params, config)
  local fn = "interchange.to_fla"
  local c = normalize(fn, config)
  check_fla_expressible(fn, c)
  local m, Dm = c.mixer, c.hidden_size
  local rows, conv, d_inner = sections(m)
  local out, used = {}, {}
  copy_pairs(fn, global_pairs(c, "model.embeddings.weight", "model.norm.weight", "lm_head.weight"), params, out,
             used, true)
  for i = 0, c.num_layers - 1 do
    local pairs_, mx, attn = fla_layer_pairs(c, i)
    copy_pairs(fn, pairs_, params, out, used, true)
    local proj = split_rows(take(fn, params, mx .. "in_proj.weight", { total_rows(rows), Dm }, used), rows)
    for _, s in ipairs(rows) do out[attn .. FLA_PROJ[s[1]] .. ".weight"] = proj[s[1]] end
    if m.use_short_conv then
      local w = split_rows(take(fn, params, mx .. "conv1d.weight", { total_rows(conv), 1, m.conv_width }, used), conv)
      for _, s in ipairs(conv) do out[attn .. FLA_CONV[s[1]] .. ".weight"] = w[s[1]] end
    end
    -- fla's o_norm has one [head_v_dim] weight for all heads: ours must repeat it
    local heads = take(fn, params, mx .. "norm.weight", { d_inner }, used):view(m.num_heads, m.head_dim)
    local first = heads:narrow(1, 1, 1)
    for h = 2, m.num_heads do
      if heads:narrow(1, h, 1):sub(first):max_abs() ~= 0 then
        argerror(fn, string.format("%snorm.weight: fla's o_norm shares one weight among the heads; head %d differs from head 1",
                                   mx, h))
      end
    end
    out[attn .. "o_norm.weight"] = first:view(m.head_dim)
  end
  no_leftovers(fn, params, used)
  return out, fla_config(c)
end

function X.from_fla(tensors, fla_cfg)
  local fn = "interchange.from_fla"
  local c = config_from_fla(fn, fla_cfg)
  local m, Dm = c.mixer, c.hidden_size
  local rows, conv, d_inner = sections(m)
  local out, used = {}, {}
  copy_pairs(fn, global_pairs(c, "model.embeddings.weight", "model.norm.weight", "lm_head.weight"), tensors, out,
             used, false)
  -- a tied head saved anyway: the embedding is its weight
  if c.tie_embeddings and tensors["lm_head.weight"] ~= nil then used["lm_head.weight"] = true end
  for i = 0, c.num_layers - 1 do
    local pairs_, mx, attn = fla_layer_pairs(c, i)
    copy_pairs(fn, pairs_, tensors, out, used, false)
    local parts = {}
    for _, s in ipairs(rows) do parts[s[1]] = take(fn, tensors, attn .. FLA_PROJ[s[1]] .. ".weight", { s[2], Dm }, used) end
    out[mx .. "in_proj.weight"] = join_rows(parts, rows, parts.b)
    if m.use_short_conv then
      local w = {}
      for _, s in ipairs(conv) do
        w[s[1]] = take(fn, tensors, attn .. FLA_CONV[s[1]] .. ".weight", { s[2], 1, m.conv_width }, used)
      end
      out[mx .. "conv1d.weight"] = join_rows(w, conv, w.V)
    end
    local onorm = take(fn, tensors, attn .. "o_norm.weight", { m.head_dim }, used)
    local nw = tensor.empty({ m.num_heads, m.head_dim }, { dtype = onorm:dtype(), device = onorm:device() })
    for h = 1, m.num_heads do nw:narrow(1, h, 1):copy(onorm:view(1, m.head_dim)) end
    out[mx .. "norm.weight"] = nw:view(d_inner)
  end
  no_leftovers(fn, tensors, used)
  return out, c
end

------------------------------------------------------------------------------- Megatron

local function megatron_config(c)
  local m = c.mixer
  return {
    hidden_size = c.hidden_size, num_layers = 2 * c.num_layers, ffn_hidden_size = c.intermediate_size,
    padded_vocab_size = c.vocab_size, layernorm_epsilon = c.norm_eps, normalization = "RMSNorm",
    gated_linear_unit = true, activation_func = "silu",
    share_embeddings_and_output_weights = c.tie_embeddings,
    hybrid_override_pattern = string.rep("M-", c.num_layers),
    mamba_num_heads = m.num_heads, mamba_head_dim = m.head_dim, mamba_num_groups = m.num_groups,
    mamba_state_dim = m.state_dim, gdp_num_householder = m.num_householder,
    d_conv = m.conv_width, conv_bias = m.conv_bias, allow_neg_eigval = m.allow_neg_eigval,
    D_has_hdim = m.D == "channel", D = m.D and true or false,
    use_short_conv = m.use_short_conv, use_output_gate = m.use_output_gate, use_forget_gate = m.use_forget_gate,
  }
end

local function config_from_megatron(fn, g)
  if type(g) ~= "table" then argerror(fn, "config: expected the Megatron config fields, got " .. type(g)) end
  local pattern = g.hybrid_override_pattern
  local L = need_int(fn, g, "num_layers", "megatron config.", 0)
  if type(pattern) ~= "string" or pattern ~= string.rep("M-", L / 2) then
    argerror(fn, string.format("megatron config.hybrid_override_pattern: expected alternating mixer and MLP " ..
                               "layers ('M-' x %s), got %s", tostring(L / 2), tostring(pattern)))
  end
  return normalize(fn, {
    vocab_size = g.padded_vocab_size, hidden_size = g.hidden_size, num_layers = L / 2,
    intermediate_size = g.ffn_hidden_size, norm_eps = g.layernorm_epsilon,
    tie_embeddings = g.share_embeddings_and_output_weights == true,
    mixer = { num_heads = g.mamba_num_heads, head_dim = g.mamba_head_dim, num_groups = g.mamba_num_groups,
              state_dim = g.mamba_state_dim, num_householder = g.gdp_num_householder, conv_width = g.d_conv,
              conv_bias = g.conv_bias, allow_neg_eigval = g.allow_neg_eigval == true,
              D = g.D == true and (g.D_has_hdim and "channel" or "head") or false,
              use_short_conv = g.use_short_conv, use_output_gate = g.use_output_gate,
              use_forget_gate = g.use_forget_gate },
  })
end

-- Layer i's one-to-one pairs: the mixer's parameters keep their names inside
-- decoder.layers.<2i>.mixer, the pre-norms fold into the next linear layer (TE's
-- layer_norm_weight), the MLP is layer 2i+1.  Also returns the fc1 name and ours for
-- w_gate / w_up, which fc1 stacks on rows (Megatron's swiglu: silu(first half) *
-- second half).
local function megatron_layer_pairs(c, i)
  local m, Dm, F = c.mixer, c.hidden_size, c.intermediate_size
  local ours = string.format(X.NAMES.layer, i)
  local mixer_l = string.format("decoder.layers.%d.mixer.", 2 * i)
  local mlp_l = string.format("decoder.layers.%d.mlp.", 2 * i + 1)
  local names = { "in_proj.weight", "norm.weight", "out_proj.weight" }
  if m.use_short_conv then
    names[#names + 1] = "conv1d.weight"
    if m.conv_bias then names[#names + 1] = "conv1d.bias" end
  end
  if m.use_forget_gate then
    names[#names + 1] = "A_log"
    names[#names + 1] = "dt_bias"
  end
  if m.D then names[#names + 1] = "D" end
  local out = {
    { ours .. X.NAMES.mixer_norm, mixer_l .. "in_proj.layer_norm_weight", { Dm } },
    { ours .. X.NAMES.mlp_norm, mlp_l .. "linear_fc1.layer_norm_weight", { Dm } },
    { ours .. X.NAMES.w_down, mlp_l .. "linear_fc2.weight", { Dm, F } },
  }
  for _, name in ipairs(names) do out[#out + 1] = { ours .. X.NAMES.mixer .. name, mixer_l .. name } end
  return out, mlp_l .. "linear_fc1.weight", ours
end

local function fc1_secs(F) return { { "gate", F }, { "up", F } } end

local MEGATRON_GLOBALS = { "embedding.word_embeddings.weight", "decoder.final_norm.weight", "output_layer.weight" }

function X.to_megatron(params, config)
  local fn = "interchange.to_megatron"
  local c = normalize(fn, config)
  local Dm, F = c.hidden_size, c.intermediate_size
  local out, used = {}, {}
  copy_pairs(fn, global_pairs(c, unpack(MEGATRON_GLOBALS)), params, out, used, true)
  for i = 0, c.num_layers - 1 do
    local pairs_, fc1, ours = megatron_layer_pairs(c, i)
    copy_pairs(fn, pairs_, params, out, used, true)
    local gate = take(fn, params, ours .. X.NAMES.w_gate, { F, Dm }, used)
    local up = take(fn, params, ours .. X.NAMES.w_up, { F, Dm }, used)
    out[fc1] = join_rows({ gate = gate, up = up }, fc1_secs(F), gate)
  end
  no_leftovers(fn, params, used)
  return out, megatron_config(c)
end

function X.from_megatron(tensors, mcfg)
  local fn = "interchange.from_megatron"
  local c = config_from_megatron(fn, mcfg)
  local Dm, F = c.hidden_size, c.intermediate_size
  local out, used = {}, {}
  copy_pairs(fn, global_pairs(c, unpack(MEGATRON_GLOBALS)), tensors, out, used, false)
  for i = 0, c.num_layers - 1 do
    local pairs_, fc1, ours = megatron_layer_pairs(c, i)
    copy_pairs(fn, pairs_, tensors, out, used, false)
    local halves = split_rows(take(fn, tensors, fc1, { 2 * F, Dm }, used), fc1_secs(F))
    out[ours .. X.NAMES.w_gate] = halves.gate
    out[ours .. X.NAMES.w_up] = halves.up
  end
  no_leftovers(fn, tensors, used)
  return out, c
end

-- gdp.nn.CausalLM's options for a config as from_fla / from_megatron / load return it
-- (mlp_ratio = intermediate_size / hidden_size).
function X.causal_lm_options(config)
  local c = normalize("interchange.causal_lm_options", config)
  local mixer = {}
  for k, v in pairs(c.mixer) do mixer[k] = v end
  return { vocab = c.vocab_size, hidden = c.hidden_size, layers = c.num_layers,
           mlp_ratio = c.intermediate_size / c.hidden_size, tie_embeddings = c.tie_embeddings,
           norm_eps = c.norm_eps, mixer = mixer }
end

------------------------------------------------------------------------------- files

local FORMATS = { fla = { X.to_fla, X.from_fla }, megatron = { X.to_megatron, X.from_megatron } }

-- Writes params (our names; a table name -> tensor or a module, whose parameters() are
-- taken) as `format` ("fla" | "megatron") with metadata format = "pt" (what PyTorch's
-- safetensors writers put there), gdp_interchange = format and config = that format's
-- config as JSON.
function X.save(path, params, config, format)
  if type(params) == "table" and type(params.parameters) == "function" then params = params:parameters() end
  local conv = FORMATS[format]
  if not conv then argerror("interchange.save", "format: expected \"fla\" or \"megatron\", got " .. tostring(format)) end
  local tensors, cfg = conv[1](params, config)
  gio.save(path, tensors, { format = "pt", gdp_interchange = format, config = util.json_encode(cfg) })
end

-- Reads a file written by save (or any file of those names with the config in its
-- metadata; opts.format and opts.config override what the metadata says).  Returns
-- params under our names, our config, and the format.
function X.load(path, opts)
  local fn = "interchange.load"
  opts = tensor.check_opts(fn, opts, { format = true, config = true, device = true })
  local tensors, meta = gio.load(path, { device = opts.device })
  local format = opts.format or meta.gdp_interchange
  local conv = FORMATS[format]
  if not conv then
    argerror(fn, string.format("%s: format: expected \"fla\" or \"megatron\" (metadata gdp_interchange or opts.format), got %s",
                               path, tostring(format)))
  end
  local cfg = opts.config
  if cfg == nil then
    if meta.config == nil then argerror(fn, path .. ": no config in the metadata (pass opts.config)") end
    cfg = util.json_decode(meta.config)
  end
  local params, config = conv[2](tensors, cfg)
  return params, config, format
end

return X
