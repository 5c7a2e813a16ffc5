-- gdp.interchange: our causal-LM names <-> fla's GatedDeltaProductForCausalLM and
-- Megatron's hybrid model, round trips bit for bit, where each section lands, files
-- with the config in the metadata, and what cannot be expressed.
local gdp = require("gdp")
local X = require("gdp.interchange")
local util = require("gdp.util")
local C = require("train_cases")
local H = gdp_test

-- Random parameters of every name and shape our config implies, written out plainly.
local function make_params(cfg, dtype)
  local m = cfg.mixer
  local D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  local nh, P, ng, N, M = m.num_heads, m.head_dim, m.num_groups or 1, m.state_dim, m.num_householder
  local d_inner = nh * P
  local rows = (m.use_output_gate ~= false and d_inner or 0) + M * d_inner + M * ng * N + ng * N + M * nh
               + (m.use_forget_gate ~= false and nh or 0)
  local conv_dim = M * d_inner + M * ng * N + ng * N
  local shapes = { ["embed.weight"] = { V, D }, ["norm.weight"] = { D } }
  if not cfg.tie_embeddings then shapes["lm_head.weight"] = { V, D } end
  for i = 0, cfg.num_layers - 1 do
    local l = "layers." .. i .. "."
    shapes[l .. "mixer_norm.weight"] = { D }
    shapes[l .. "mlp_norm.weight"] = { D }
    shapes[l .. "mixer.in_proj.weight"] = { rows, D }
    if m.use_short_conv ~= false then
      shapes[l .. "mixer.conv1d.weight"] = { conv_dim, 1, m.conv_width or 4 }
      if m.conv_bias ~= false then shapes[l .. "mixer.conv1d.bias"] = { conv_dim } end
    end
    if m.use_forget_gate ~= false then
      shapes[l .. "mixer.A_log"] = { nh }
      shapes[l .. "mixer.dt_bias"] = { nh }
    end
    if m.D then shapes[l .. "mixer.D"] = { m.D == "channel" and d_inner or nh } end
    shapes[l .. "mixer.out_proj.weight"] = { D, d_inner }
    shapes[l .. "mlp.w_gate"] = { F, D }
    shapes[l .. "mlp.w_up"] = { F, D }
    shapes[l .. "mlp.w_down"] = { D, F }
  end
  local p = {}
  for name, shape in pairs(shapes) do p[name] = gdp.randn(shape, { dtype = dtype or "f32" }) end
  for i = 0, cfg.num_layers - 1 do -- fla's o_norm: one weight shared by the heads
    local w = gdp.randn({ P }, { dtype = dtype or "f32" })
    local nw = p["layers." .. i .. ".mixer.norm.weight"] or gdp.empty({ d_inner }, { dtype = dtype or "f32" })
    for h = 1, nh do nw:narrow(1, (h - 1) * P + 1, P):copy(w) end
    p["layers." .. i .. ".mixer.norm.weight"] = nw
  end
  return p
end

local function same_tables(a, b)
  local na, nb = 0, 0
  for name, t in pairs(a) do
    na = na + 1
    assert.is_truthy(b[name], "missing " .. name)
    assert.is_true(C.bitwise_equal(t, b[name]), name .. " differs")
  end
  for _ in pairs(b) do nb = nb + 1 end
  assert.are.equal(na, nb)
end

local FLA_CFG = { vocab_size = 11, hidden_size = 8, num_layers = 2, intermediate_size = 12, tie_embeddings = false,
                  mixer = { num_heads = 2, head_dim = 6, num_groups = 2, state_dim = 4, num_householder = 2,
                            conv_width = 3, conv_bias = false } }

describe("interchange: fla", function()
  it("ours -> fla -> ours is bitwise, with fla's names and sections", function()
    H.reseed(51)
    local p = make_params(FLA_CFG)
    local t, fcfg = X.to_fla(p, FLA_CFG)
    assert.are.equal(2, fcfg.num_heads)
    assert.are.equal(4, fcfg.head_dim)
    assert.are.equal(1.5, fcfg.expand_v)
    assert.are.equal(2, fcfg.num_hidden_layers)
    local expect = { "model.embeddings.weight", "model.norm.weight", "lm_head.weight" }
    for i = 0, 1 do
      for _, n in ipairs({ "attn_norm.weight", "mlp_norm.weight", "attn.g_proj.weight", "attn.q_proj.weight",
                           "attn.k_proj.weight", "attn.v_proj.weight", "attn.b_proj.weight", "attn.a_proj.weight",
                           "attn.q_conv1d.weight", "attn.k_conv1d.weight", "attn.v_conv1d.weight", "attn.A_log",
                           "attn.dt_bias", "attn.o_norm.weight", "attn.o_proj.weight", "mlp.gate_proj.weight",
                           "mlp.up_proj.weight", "mlp.down_proj.weight" }) do
        expect[#expect + 1] = "model.layers." .. i .. "." .. n
      end
    end
    local names = {}
    for n in pairs(t) do names[#names + 1] = n end
    table.sort(names)
    table.sort(expect)
    assert.are.same(expect, names)
    -- in_proj rows [z | V | K | Q | b | a] with d_inner 12, M 2, K heads 2 x 4
    local w = p["layers.1.mixer.in_proj.weight"]
    assert.is_true(C.bitwise_equal(t["model.layers.1.attn.g_proj.weight"], w:narrow(1, 1, 12)))
    assert.is_true(C.bitwise_equal(t["model.layers.1.attn.v_proj.weight"], w:narrow(1, 13, 24)))
    assert.is_true(C.bitwise_equal(t["model.layers.1.attn.k_proj.weight"], w:narrow(1, 37, 16)))
    assert.is_true(C.bitwise_equal(t["model.layers.1.attn.q_proj.weight"], w:narrow(1, 53, 8)))
    assert.is_true(C.bitwise_equal(t["model.layers.1.attn.b_proj.weight"], w:narrow(1, 61, 4)))
    assert.is_true(C.bitwise_equal(t["model.layers.1.attn.a_proj.weight"], w:narrow(1, 65, 2)))
    local cw = p["layers.0.mixer.conv1d.weight"]
    assert.is_true(C.bitwise_equal(t["model.layers.0.attn.q_conv1d.weight"], cw:narrow(1, 41, 8)))
    assert.is_true(C.bitwise_equal(t["model.layers.0.attn.o_norm.weight"],
                                   p["layers.0.mixer.norm.weight"]:narrow(1, 7, 6)))
    local back, cfg = X.from_fla(t, fcfg)
    same_tables(p, back)
    assert.are.equal(2, cfg.mixer.num_groups)
    assert.are.equal(6, cfg.mixer.head_dim)
  end)

  it("the state-tracking switches (no conv, gate, forget gate) and tied embeddings round-trip", function()
    H.reseed(52)
    local cfg = { vocab_size = 5, hidden_size = 8, num_layers = 1, intermediate_size = 32, tie_embeddings = true,
                  mixer = { num_heads = 2, head_dim = 4, num_groups = 2, state_dim = 4, num_householder = 3,
                            use_short_conv = false, use_output_gate = false, use_forget_gate = false } }
    local p = make_params(cfg)
    local t, fcfg = X.to_fla(p, cfg)
    assert.is_nil(t["lm_head.weight"])
    assert.is_nil(t["model.layers.0.attn.g_proj.weight"])
    assert.is_nil(t["model.layers.0.attn.A_log"])
    assert.is_false(fcfg.use_forget_gate)
    assert.is_true(fcfg.tie_word_embeddings)
    same_tables(p, (X.from_fla(t, fcfg)))
  end)

  it("save and load through a file with the config in the metadata (f64 stays f64)", function()
    H.reseed(53)
    local p = make_params(FLA_CFG, "f64")
    local path = os.tmpname()
    X.save(path, p, FLA_CFG, "fla")
    local raw, meta = gdp.load(path)
    assert.are.equal("pt", meta.format)
    assert.are.equal("fla", meta.gdp_interchange)
    assert.are.equal("gated_deltaproduct", util.json_decode(meta.config).model_type)
    assert.is_truthy(raw["model.layers.1.attn.k_proj.weight"])
    local back, cfg, format = X.load(path)
    os.remove(path)
    assert.are.equal("fla", format)
    assert.are.equal(FLA_CFG.intermediate_size, cfg.intermediate_size)
    same_tables(p, back)
  end)

  it("what fla cannot hold is an error naming it", function()
    local p = make_params(FLA_CFG)
    local grouped = util.json_decode(util.json_encode(FLA_CFG))
    grouped.mixer.num_groups = 1
    H.expect_error(function() X.to_fla(p, grouped) end, "num_groups", "num_groups = num_heads = 2", "got 1")
    local biased = util.json_decode(util.json_encode(FLA_CFG))
    biased.mixer.conv_bias = true
    H.expect_error(function() X.to_fla(p, biased) end, "conv_bias", "without bias")
    p["layers.0.mixer.norm.weight"]:set(7, 8)
    H.expect_error(function() X.to_fla(p, FLA_CFG) end, "layers.0.mixer.norm.weight", "head 2 differs")
  end)
end)

describe("interchange: our modules and configs", function()
  -- The real mixer's parameters fill a layer: the row sections here are the module's.
  for _, sw in ipairs({ {}, { use_short_conv = false, use_output_gate = false, use_forget_gate = false } }) do
    it("the mixer module's parameters convert both ways (switches " .. (sw.use_short_conv == false and "off" or "on") .. ")", function()
      H.reseed(71)
      local mixer = { num_heads = 2, head_dim = 4, num_groups = 2, state_dim = 4, num_householder = 2,
                      conv_width = 4, conv_bias = false }
      for k, v in pairs(sw) do mixer[k] = v end
      local cfg = { vocab = 7, hidden = 8, layers = 1, mlp_ratio = 2, mixer = mixer }
      local opts = { hidden_size = 8, dtype = "f64" }
      for k, v in pairs(mixer) do opts[k] = v end
      local m = gdp.nn.GatedDeltaProduct(opts)
      local p = make_params({ vocab_size = 7, hidden_size = 8, num_layers = 1, intermediate_size = 16,
                              mixer = mixer }, "f64")
      for name, t in pairs(m:parameters()) do p["layers.0.mixer." .. name] = t end
      for _, fmt in ipairs({ "fla", "megatron" }) do
        local t, their_cfg = X["to_" .. fmt](p, cfg)
        local back, ours = X["from_" .. fmt](t, their_cfg)
        same_tables(p, back)
        local lm = X.causal_lm_options(ours)
        assert.are.same({ 7, 8, 1, 2 }, { lm.vocab, lm.hidden, lm.layers, lm.mlp_ratio })
        assert.are.equal(sw.use_forget_gate ~= false, lm.mixer.use_forget_gate)
      end
    end)
  end
end)

local MEG_CFG = { vocab_size = 9, hidden_size = 8, num_layers = 2, intermediate_size = 10, tie_embeddings = false,
                  mixer = { num_heads = 4, head_dim = 3, num_groups = 2, state_dim = 5, num_householder = 2,
                            conv_width = 4, conv_bias = true, D = "channel" } }

describe("interchange: Megatron", function()
  it("ours -> megatron -> ours is bitwise; layers alternate mixer and MLP; fc1 is [gate; up]", function()
    H.reseed(61)
    local p = make_params(MEG_CFG)
    local t, mcfg = X.to_megatron(p, MEG_CFG)
    assert.are.equal("M-M-", mcfg.hybrid_override_pattern)
    assert.are.equal(4, mcfg.num_layers)
    assert.is_true(mcfg.D_has_hdim)
    assert.is_true(C.bitwise_equal(t["decoder.layers.2.mixer.in_proj.weight"], p["layers.1.mixer.in_proj.weight"]))
    assert.is_true(C.bitwise_equal(t["decoder.layers.2.mixer.D"], p["layers.1.mixer.D"]))
    assert.is_true(C.bitwise_equal(t["decoder.layers.2.mixer.in_proj.layer_norm_weight"], p["layers.1.mixer_norm.weight"]))
    assert.is_true(C.bitwise_equal(t["decoder.layers.3.mlp.linear_fc1.layer_norm_weight"], p["layers.1.mlp_norm.weight"]))
    local fc1 = t["decoder.layers.1.mlp.linear_fc1.weight"]
    assert.are.same({ 20, 8 }, fc1:shape())
    assert.is_true(C.bitwise_equal(fc1:narrow(1, 1, 10), p["layers.0.mlp.w_gate"]))
    assert.is_true(C.bitwise_equal(fc1:narrow(1, 11, 10), p["layers.0.mlp.w_up"]))
    assert.is_true(C.bitwise_equal(t["output_layer.weight"], p["lm_head.weight"]))
    assert.is_true(C.bitwise_equal(t["embedding.word_embeddings.weight"], p["embed.weight"]))
    local back = X.from_megatron(t, mcfg)
    same_tables(p, back)
    local path = os.tmpname()
    X.save(path, p, MEG_CFG, "megatron")
    local back2, cfg, format = X.load(path)
    os.remove(path)
    assert.are.equal("megatron", format)
    assert.are.equal("channel", cfg.mixer.D)
    same_tables(p, back2)
  end)

  it("missing, misshapen and unexpected tensors are errors naming them", function()
    local p = make_params(MEG_CFG)
    local t, mcfg = X.to_megatron(p, MEG_CFG)
    t["decoder.layers.3.mlp.linear_fc2.weight"] = nil
    H.expect_error(function() X.from_megatron(t, mcfg) end, "missing tensor 'decoder.layers.3.mlp.linear_fc2.weight'")
    t["decoder.layers.3.mlp.linear_fc2.weight"] = gdp.zeros({ 8, 11 })
    H.expect_error(function() X.from_megatron(t, mcfg) end, "linear_fc2.weight", "expected shape [8x10]", "got [8x11]")
    t["decoder.layers.3.mlp.linear_fc2.weight"] = gdp.zeros({ 8, 10 })
    t["decoder.layers.9.mixer.x"] = gdp.zeros({ 1 })
    H.expect_error(function() X.from_megatron(t, mcfg) end, "unexpected tensors", "decoder.layers.9.mixer.x")
    p["layers.0.extra"] = gdp.zeros({ 1 })
    H.expect_error(function() X.to_megatron(p, MEG_CFG) end, "unexpected tensors", "layers.0.extra")
    local path = os.tmpname()
    gdp.save(path, { x = gdp.zeros({ 1 }) })
    H.expect_error(function() X.load(path) end, "format: expected \"fla\" or \"megatron\"", "got nil")
    os.remove(path)
    H.expect_error(function() X.save(path, p, MEG_CFG, "hf") end, "format", "got hf")
  end)
end)
