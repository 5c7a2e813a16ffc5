-- The model modules of gdp.nn (Embedding, Linear, RMSNorm, MLP, Block, Sequential,
-- CausalLM, CrossEntropy) on the cpu: central finite differences in float64 of every
-- parameter gradient and of dx, for each module and for a whole tiny CausalLM through
-- the loss; f32 against f64 on the same parameters; the parameter order; tied
-- weights (one parameter, both gradients added); gradient accumulation; stale-cache
-- safety; bad input errors naming the argument, expected and actual value.
local gdp = require("gdp")
local nn = require("gdp.nn")
local F = nn.functional
local H = gdp_test

local FD_TOL = 1e-6
-- The whole model through the loss is strongly curved and many of its gradients are
-- O(1e-4): the fourth-order differences (spec/helper.lua) keep their error far below
-- FD_TOL there.  A wrong backward is off by O(1), as the module checks show.

-- Fixes the test's random inputs and which entries the finite differences sample, so
-- that a test does not depend on the tests run before it.
local function reseed(salt)
  H.reseed(salt)
  math.randomseed(H.seed + salt)
end

local fd_error = H.fd_error

-- Checks every parameter gradient of m (and dx when x is a float tensor) against
-- finite differences of sum(m:forward(x, ...) * R).
local function check_module(m, x, samples, ...)
  local extra = { ... }
  local n_extra = select("#", ...)
  local out = m:forward(x, unpack(extra, 1, n_extra))
  local R = gdp.randn(out:shape(), { dtype = "f64" })
  local function loss() return m:forward(x, unpack(extra, 1, n_extra)):dot(R) end
  m:zero_grad()
  local dx = m:backward(x, R, unpack(extra, 1, n_extra))
  local grads = m:gradients()
  local params = m:parameters()
  local names = m:parameter_names()
  assert.is_true(#names > 0)
  for _, name in ipairs(names) do
    local e = fd_error(loss, params[name], grads[name], samples)
    assert.is_true(e <= FD_TOL, string.format("%s: finite differences vs backward: %.3e", name, e))
  end
  if x:dtype() == "f64" then
    local e = fd_error(loss, x, dx, samples)
    assert.is_true(e <= FD_TOL, string.format("dx: finite differences vs backward: %.3e", e))
  else
    assert.is_nil(dx)
  end
end

-- In parameter_names() order: pairs() order differs between runs (LuaJIT's string
-- hashes are seeded per process), and so would the random values.
local function randomize(m)
  local params = m:parameters()
  for _, name in ipairs(m:parameter_names()) do
    local t = params[name]
    if name:match("A_log$") or name:match("dt_bias$") then t:uniform_(-1, 1)
    elseif name:match("norm%.weight$") or name:match("mixer%.D$") then t:uniform_(0.5, 1.5)
    else t:normal_(0, 0.5) end
  end
end

local MIXER = { num_heads = 2, head_dim = 4, num_groups = 1, state_dim = 4, num_householder = 2 }

local function mixer_cfg(extra)
  local c = { hidden_size = 8 }
  for k, v in pairs(MIXER) do c[k] = v end
  for k, v in pairs(extra or {}) do c[k] = v end
  return c
end

local function tokens(shape, V, dtype)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  local ids = {}
  for i = 1, n do ids[i] = math.random(0, V - 1) end
  return gdp.tensor(ids, shape, { dtype = dtype or "i64" })
end

describe("gdp.nn modules: finite differences (f64)", function()
  it("Embedding", function()
    reseed(21)
    local m = nn.Embedding{ num_embeddings = 7, dim = 5, init_std = 1 }
    check_module(m, tokens({ 3, 4 }, 7), 35)
  end)

  it("Linear with and without bias, on [..., in] inputs of odd sizes", function()
    reseed(22)
    check_module(nn.Linear{ in_features = 5, out_features = 3 }, gdp.randn({ 2, 7, 5 }, { dtype = "f64" }), 15)
    check_module(nn.Linear{ ["in"] = 4, out = 6, bias = false, init = 0.5 }, gdp.randn({ 9, 4 }, { dtype = "f64" }), 24)
  end)

  it("RMSNorm", function()
    reseed(23)
    local m = nn.RMSNorm{ dim = 6 }
    m:parameters().weight:uniform_(0.5, 1.5)
    check_module(m, gdp.randn({ 5, 3, 6 }, { dtype = "f64" }), 18)
  end)

  it("MLP (SwiGLU) with the default x4 hidden and with biases", function()
    reseed(24)
    local m = nn.MLP{ dim = 4 }
    assert.are.equal(16, m.hidden)
    check_module(m, gdp.randn({ 3, 5, 4 }, { dtype = "f64" }), 12)
    check_module(nn.MLP{ dim = 3, hidden = 5, bias = true, init = 0.7 }, gdp.randn({ 7, 3 }, { dtype = "f64" }), 12)
  end)

  it("Block with the GDP mixer and the MLP, packed with an empty sequence", function()
    reseed(25)
    local m = nn.Block{ mixer = nn.GatedDeltaProduct(mixer_cfg{ seed = 3 }), mlp = nn.MLP{ dim = 8, hidden = 12 } }
    randomize(m)
    check_module(m, gdp.randn({ 11, 1, 8 }, { dtype = "f64" }), 6, { 0, 4, 4, 11 })
  end)

  it("Block without an MLP, B = 2", function()
    reseed(26)
    local m = nn.Block{ mixer = nn.GatedDeltaProduct(mixer_cfg{ allow_neg_eigval = true }) }
    randomize(m)
    assert.are.same({ "mixer_norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight",
                      "mixer.conv1d.bias", "mixer.dt_bias", "mixer.A_log", "mixer.norm.weight",
                      "mixer.out_proj.weight" }, m:parameter_names())
    check_module(m, gdp.randn({ 6, 2, 8 }, { dtype = "f64" }), 6)
  end)

  it("Sequential of Linear, MLP and RMSNorm", function()
    reseed(27)
    local m = nn.Sequential{ nn.Linear{ ["in"] = 3, out = 4 }, nn.MLP{ dim = 4, hidden = 6 }, nn.RMSNorm{ dim = 4 } }
    assert.are.same({ "0.weight", "0.bias", "1.w_gate", "1.w_up", "1.w_down", "2.weight" }, m:parameter_names())
    check_module(m, gdp.randn({ 5, 3 }, { dtype = "f64" }), 10)
  end)

  for _, case in ipairs({
    { label = "untied, tokens [B,T]", tie = false, shape = { 2, 5 } },
    { label = "tied, packed tokens [T] with cu_seqlens", tie = true, shape = { 9 }, cu = { 0, 3, 3, 9 } },
    { label = "tied, tokens [1,T] i32 with cu_seqlens", tie = true, shape = { 1, 7 }, cu = { 0, 5, 7 }, idx = "i32" },
  }) do
    it("a tiny CausalLM through the cross-entropy, " .. case.label, function()
      reseed(28)
      local V = 6
      local lm = nn.CausalLM{ vocab = V, hidden = 8, layers = 2, mixer = MIXER, mlp_ratio = 1.5,
                              tie_embeddings = case.tie, seed = 5 }
      randomize(lm)
      local tok = tokens(case.shape, V, case.idx)
      local tg = tokens(case.shape, V, "i64")
      tg:view(tg:numel()):set(-100, 2) -- one ignored target
      local function loss()
        return (F.cross_entropy(lm:forward(tok, case.cu), tg, { grad = false }))
      end
      local logits = lm:forward(tok, case.cu)
      local want = {}
      for i, s in ipairs(case.shape) do want[i] = s end
      want[#want + 1] = V
      assert.are.same(want, logits:shape())
      local _, dlogits = F.cross_entropy(logits, tg)
      lm:zero_grad()
      assert.is_nil(lm:backward(tok, dlogits, case.cu))
      local params, grads = lm:parameters(), lm:gradients()
      for _, name in ipairs(lm:parameter_names()) do
        local e = fd_error(loss, params[name], grads[name], 4, true)
        assert.is_true(e <= FD_TOL, string.format("%s: finite differences vs backward: %.3e", name, e))
      end
    end)
  end
end)

describe("gdp.nn modules: f32 against f64", function()
  it("a CausalLM in f32 matches the f64 model on the same parameters", function()
    reseed(31)
    local cfg = { vocab = 9, hidden = 8, layers = 2, mixer = MIXER, seed = 2 }
    local ref = nn.CausalLM(cfg)
    randomize(ref)
    cfg.dtype = "f32"
    local m = nn.CausalLM(cfg)
    m:set_parameters(ref:parameters())
    ref:set_parameters(m:parameters()) -- the reference sees the rounded values
    local tok, tg = tokens({ 3, 6 }, 9), tokens({ 3, 6 }, 9)
    local lr, lm_ = ref:forward(tok), m:forward(tok)
    assert.are.equal("f32", lm_:dtype())
    assert.tensor_near(lm_, lr, 1e-4)
    local loss_r, d_r = F.cross_entropy(lr, tg)
    local loss_m, d_m = F.cross_entropy(lm_, tg)
    assert.is_true(math.abs(loss_r - loss_m) <= 1e-5 * loss_r)
    ref:backward(tok, d_r)
    m:backward(tok, d_m)
    local gr, gm = ref:gradients(), m:gradients()
    for _, name in ipairs(ref:parameter_names()) do
      assert.are.equal("f32", gm[name]:dtype())
      assert.tensor_near(gm[name], gr[name], 1e-4, name)
    end
  end)
end)

describe("gdp.nn modules: learning", function()
  it("plain gradient descent fits a tiny CausalLM to a fixed batch (the pieces fit together)", function()
    reseed(36)
    local lm = nn.CausalLM{ vocab = 5, hidden = 16, layers = 1, tie_embeddings = true, init_std = 0.5,
                            mixer = { num_heads = 2, head_dim = 8, state_dim = 8, num_householder = 1 },
                            seed = 3 }
    local tok = tokens({ 4, 12 }, 5)
    local tg = tokens({ 4, 12 }, 5)
    local first, loss
    for step = 1, 40 do
      local l, d = F.cross_entropy(lm:forward(tok), tg)
      first, loss = first or l, l
      lm:zero_grad()
      lm:backward(tok, d)
      local p, g = lm:parameters(), lm:gradients()
      for _, name in ipairs(lm:parameter_names()) do p[name]:add_(g[name], -0.5) end
    end
    assert.is_true(loss < 0.5 * first, string.format("loss %.4f after 40 steps, %.4f at the start", loss, first))
  end)
end)

describe("gdp.nn modules: with gdp.interchange, gdp.optim and gdp.train", function()
  local X, optim, train = require("gdp.interchange"), require("gdp.optim"), require("gdp.train")
  -- what fla's model can hold: a group per head, no conv bias
  local cfg = { vocab = 7, hidden = 8, layers = 2, mlp_ratio = 2, tie_embeddings = false,
                mixer = { num_heads = 2, head_dim = 4, num_groups = 2, state_dim = 4,
                          num_householder = 2, conv_bias = false } }

  it("a CausalLM saved under fla's and Megatron's names loads back into the same model", function()
    reseed(37)
    local opts = { seed = 4 }
    for k, v in pairs(cfg) do opts[k] = v end
    local lm = nn.CausalLM(opts)
    randomize(lm)
    for name, t in pairs(lm:parameters()) do -- fla's o_norm: one weight shared by the heads
      if name:match("mixer%.norm%.weight$") then t:fill(1.25) end
    end
    local tok = tokens({ 2, 6 }, 7)
    local want = lm:forward(tok):clone()
    for _, format in ipairs({ "fla", "megatron" }) do
      local path = os.tmpname()
      X.save(path, lm, cfg, format)
      local params, config = X.load(path)
      os.remove(path)
      local back = nn.CausalLM(X.causal_lm_options(config))
      assert.are.same(lm:parameter_names(), back:parameter_names())
      back:set_parameters(params)
      assert.are.equal(0, gdp.rel_error(back:forward(tok), want), format)
    end
  end)

  it("gdp.train.step with AdamW and nn.CrossEntropy lowers the loss", function()
    reseed(38)
    local opts = { seed = 5 }
    for k, v in pairs(cfg) do opts[k] = v end
    local lm = nn.CausalLM(opts)
    local opt, crit = optim.AdamW(lm, { lr = 1e-2 }), nn.CrossEntropy()
    local tok = tokens({ 2, 9 }, 7)
    local first, last
    for _ = 1, 8 do
      local r = train.step{ model = lm, optimizer = opt, criterion = crit,
                            batch = { input = tok, target = tok } }
      first, last = first or r.loss, r.loss
    end
    assert.is_true(last < first, string.format("loss %.4f after 8 steps, %.4f at the first", last, first))
    -- the step reads a forward_tensor criterion's loss after the norms: the same steps
    -- as with a criterion that gives numbers
    local function run(criterion)
      reseed(38)
      local m = nn.CausalLM(opts)
      local o = optim.AdamW(m, { lr = 1e-2 })
      local losses = {}
      for i = 1, 3 do
        losses[i] = train.step{ model = m, optimizer = o, criterion = criterion, max_grad_norm = 0.5,
                                batch = { input = tok, target = tok } }.loss
      end
      return losses, m:forward(tok)
    end
    local c = nn.CrossEntropy()
    local numbers = { forward = function(_, ...) return (c:forward(...)) end,
                      backward = function(_, ...) return c:backward(...) end }
    local l1, out1 = run(nn.CrossEntropy())
    local l2, out2 = run(numbers)
    assert.are.same(l2, l1)
    assert.are.equal(0, gdp.rel_error(out1, out2))
  end)
end)

describe("gdp.nn modules: parameters", function()
  it("names come in a stable order that does not depend on the seed or the run", function()
    local a = nn.CausalLM{ vocab = 5, hidden = 8, layers = 2, mixer = MIXER, seed = 1 }
    local b = nn.CausalLM{ vocab = 5, hidden = 8, layers = 2, mixer = MIXER, seed = 2 }
    local names = a:parameter_names()
    assert.are.same(names, b:parameter_names())
    assert.are.equal("embed.weight", names[1])
    assert.are.equal("layers.0.mixer_norm.weight", names[2])
    assert.are.equal("layers.0.mixer.in_proj.weight", names[3])
    assert.are.equal("layers.1.mlp.w_down", names[#names - 2])
    assert.are.equal("norm.weight", names[#names - 1])
    assert.are.equal("lm_head.weight", names[#names])
    local p, g = a:parameters(), a:gradients()
    for _, n in ipairs(names) do
      assert.is_not_nil(p[n], n)
      assert.are.same(p[n]:shape(), g[n]:shape())
    end
    -- the same seed gives the same parameters; another seed others
    local c = nn.CausalLM{ vocab = 5, hidden = 8, layers = 2, mixer = MIXER, seed = 1 }
    assert.are.equal(0, gdp.rel_error(c:parameters()["layers.1.mlp.w_up"], p["layers.1.mlp.w_up"]))
    assert.is_true(gdp.rel_error(b:parameters()["layers.1.mlp.w_up"], p["layers.1.mlp.w_up"]) > 0.1)
  end)

  it("tied embeddings: one parameter, the head's and the embedding's gradients added", function()
    H.reseed(32)
    local emb = nn.Embedding{ num_embeddings = 6, dim = 4, init_std = 1 }
    local head = nn.Linear{ tied_to = emb, bias = false }
    assert.are.same({}, head:parameter_names())
    assert.are.equal(6, head.out_features)
    local tok = tokens({ 5 }, 6)
    local x = emb:forward(tok)
    local dy = gdp.randn({ 5, 6 }, { dtype = "f64" })
    head:forward(x)
    local dx = head:backward(x, dy)
    -- the head's part alone: dy^T x, then the embedding's scatter of dx on top
    local want = gdp.matmul(dy, x, { trans_a = true })
    assert.tensor_near(emb:gradients().weight, want, 1e-12)
    emb:backward(tok, dx)
    want:add_(F.embedding_backward(tok, dx, 6))
    assert.tensor_near(emb:gradients().weight, want, 1e-12)
    local lm = nn.CausalLM{ vocab = 5, hidden = 8, layers = 1, mixer = MIXER, tie_embeddings = true }
    local names = lm:parameter_names()
    assert.are.equal("norm.weight", names[#names])
    assert.is_true(rawequal(lm.lm_head:weight(), lm:parameters()["embed.weight"]))
  end)

  it("backward accumulates; zero_grad resets; set_parameters copies and checks", function()
    H.reseed(33)
    local m = nn.MLP{ dim = 3, hidden = 4 }
    local x, dy = gdp.randn({ 2, 3 }, { dtype = "f64" }), gdp.randn({ 2, 3 }, { dtype = "f64" })
    m:forward(x)
    m:backward(x, dy)
    local once = m:gradients().w_up:clone()
    m:backward(x, dy)
    assert.tensor_near(m:gradients().w_up, once * 2, 1e-14)
    m:zero_grad()
    assert.are.equal(0, m:gradients().w_up:max_abs())
    local other = nn.MLP{ dim = 3, hidden = 4 }
    other:set_parameters(m:parameters())
    assert.tensor_near(other:forward(x), m:forward(x), 1e-15)
    H.expect_error(function() other:set_parameters({ w_up = m:parameters().w_up }) end,
                   "missing parameter 'w_gate'")
    local extra = {}
    for k, v in pairs(m:parameters()) do extra[k] = v end
    extra.bogus = x
    H.expect_error(function() other:set_parameters(extra) end, "unexpected tensor 'bogus'")
    other:set_parameters(extra, false)
    extra.bogus, extra.w_up = nil, gdp.zeros({ 3, 4 }, { dtype = "f64" })
    H.expect_error(function() other:set_parameters(extra) end, "w_up: expected shape [4x3], got [3x4]")
  end)

  it("a backward on another input than the last forward recomputes it", function()
    H.reseed(34)
    local m = nn.Block{ mixer = nn.GatedDeltaProduct(mixer_cfg()), mlp = nn.MLP{ dim = 8 } }
    randomize(m)
    local x1, x2 = gdp.randn({ 5, 1, 8 }, { dtype = "f64" }), gdp.randn({ 5, 1, 8 }, { dtype = "f64" })
    local dy = gdp.randn({ 5, 1, 8 }, { dtype = "f64" })
    m:forward(x2)
    m:zero_grad()
    local dx = m:backward(x2, dy)
    local g = m:gradients()["mlp.w_gate"]:clone()
    m:forward(x1)
    m:zero_grad()
    local dx_again = m:backward(x2, dy) -- the cache holds x1's forward
    assert.tensor_near(dx_again, dx, 1e-14)
    assert.tensor_near(m:gradients()["mlp.w_gate"], g, 1e-14)
    x2:add_(x2) -- written in place: the cache must not be reused
    m:forward(x2)
    m:zero_grad()
    m:backward(x2, dy)
    assert.is_true(gdp.rel_error(m:gradients()["mlp.w_gate"], g) > 1e-3)
  end)

  it("clear_state drops every cache", function()
    local lm = nn.CausalLM{ vocab = 5, hidden = 8, layers = 1, mixer = MIXER }
    lm:forward(tokens({ 4 }, 5))
    assert.is_not_nil(lm.layers:get(1).mixer.cache)
    lm:clear_state()
    assert.is_nil(lm.cache)
    assert.is_nil(lm.layers:get(1).cache)
    assert.is_nil(lm.layers:get(1).mixer.cache)
  end)
end)

describe("gdp.nn modules: CrossEntropy", function()
  it("forward gives the loss as a number and a tensor; backward the functional gradient", function()
    H.reseed(35)
    local crit = nn.CrossEntropy{ ignore_index = 0 }
    local logits = gdp.randn({ 4, 3, 5 }, { dtype = "f64" })
    local tg = tokens({ 4, 3 }, 5)
    local mask = gdp.ones({ 4, 3 }, { dtype = "i32" })
    mask:set(0, 1, 2)
    local loss, t = crit:forward(logits, tg, mask)
    local want, wd, count = F.cross_entropy(logits, tg, { ignore_index = 0, mask = mask })
    assert.are.equal(want, loss)
    assert.are.equal(loss, t:get(1))
    assert.are.equal(count, crit.count)
    assert.are.equal(0, gdp.rel_error(crit:backward(logits, tg, mask), wd))
    -- other targets: recomputed, not the cached gradient
    local tg2 = tokens({ 4, 3 }, 5)
    local _, wd2 = F.cross_entropy(logits, tg2, { ignore_index = 0 })
    assert.are.equal(0, gdp.rel_error(crit:backward(logits, tg2), wd2))
    -- forward_tensor: the same loss left in a tensor, the same cached gradient
    local lt = crit:forward_tensor(logits, tg, mask)
    assert.is_nil(crit.loss)
    assert.is_nil(crit.count)
    assert.are.same({ 1 }, lt:shape())
    assert.are.equal(want, lt:get(1))
    assert.are.equal(count, crit.result:get(2))
    assert.are.equal(0, gdp.rel_error(crit:backward(logits, tg, mask), wd))
  end)

  it("backward knows other targets by their object, not by what their printout shows", function()
    H.reseed(36)
    local crit = nn.CrossEntropy()
    local logits = gdp.randn({ 1001, 4 }, { dtype = "f64" }) -- past 1000 values the printout elides
    local tg = tokens({ 1001 }, 4)
    local values = tg:totable()
    values[500] = (values[500] + 1) % 4 -- a middle value: the printout looks the same
    local other = gdp.tensor(values, { 1001 }, { dtype = "i64" })
    assert.are.equal(tostring(tg), tostring(other))
    assert.are.equal(tg:version(), other:version())
    crit:forward(logits, tg)
    local _, want = F.cross_entropy(logits, other)
    assert.are.equal(0, gdp.rel_error(crit:backward(logits, other), want))
  end)
end)

describe("gdp.nn modules: bad input", function()
  it("constructors name the option, the expected and the actual value", function()
    H.expect_error(function() nn.Linear{ in_features = 0, out_features = 2 } end,
                   "nn.Linear", "in_features must be an integer >= 1, got 0")
    H.expect_error(function() nn.Linear{ out_features = 2 } end, "in_features must be an integer >= 1, got nil")
    H.expect_error(function() nn.Linear{ tied_to = {} } end, "tied_to: expected a module with a parameter 'weight'")
    H.expect_error(function() nn.Linear{ tied_to = nn.Embedding{ num_embeddings = 3, dim = 2 }, out = 4 } end,
                   "out: expected 3 (the tied weight's [3x2]), got 4")
    H.expect_error(function() nn.Embedding{ num_embeddings = 3 } end, "dim must be an integer >= 1, got nil")
    H.expect_error(function() nn.RMSNorm{ dim = 4, eps = -1 } end, "eps: expected a finite number >= 0, got -1")
    H.expect_error(function() nn.MLP{ dim = 4, dtype = "bf16" } end,
                   "dtype: expected \"f64\" or \"f32\" on cpu (bf16 models run on cuda), got bf16")
    H.expect_error(function() nn.MLP{ dim = 4, width = 2 } end, "unknown option 'width'")
    H.expect_error(function() nn.Block{ mixer = 3 } end, "mixer: expected a module")
    H.expect_error(function() nn.Block{ mixer = nn.GatedDeltaProduct(mixer_cfg()), mlp = nn.MLP{ dim = 6 } } end,
                   "mlp: expected dim 8 (the mixer's), got 6")
    H.expect_error(function() nn.Sequential{ nn.RMSNorm{ dim = 2 }, nn.RMSNorm{ dim = 2, dtype = "f32" } } end,
                   "module: expected dtype f64 on cpu (the first module's), got f32 on cpu")
    H.expect_error(function() nn.CausalLM{ vocab = 5, hidden = 8, mixer = { hidden_size = 8 } } end,
                   "mixer.hidden_size: set by the model")
    H.expect_error(function() nn.CrossEntropy{ ignore_index = "x" } end, "ignore_index must be an integer, got")
  end)

  it("forward and backward name the bad argument", function()
    local lin = nn.Linear{ ["in"] = 3, out = 2 }
    H.expect_error(function() lin:forward(gdp.randn({ 2, 4 }, { dtype = "f64" })) end,
                   "nn.Linear:forward", "x: expected [..., 3] (last dim 3), got [2x4]")
    H.expect_error(function() lin:forward(gdp.randn({ 2, 3 }, { dtype = "f32" })) end,
                   "x: expected dtype f64 (the module's), got f32")
    H.expect_error(function() lin:backward(gdp.randn({ 2, 3 }, { dtype = "f64" }), gdp.randn({ 2, 3 }, { dtype = "f64" })) end,
                   "dy: expected [2x2] (x's shape with last dim 2), got [2x3]")
    local emb = nn.Embedding{ num_embeddings = 4, dim = 2 }
    H.expect_error(function() emb:forward(gdp.randn({ 3 }, { dtype = "f64" })) end,
                   "nn.Embedding:forward", "tokens: expected dtype i32 or i64 (token ids), got f64")
    H.expect_error(function() emb:forward(gdp.tensor({ 1, 4 }, { 2 }, { dtype = "i64" })) end,
                   "tokens: expected values in [0, 4) (num_embeddings), got 4 at [1]")
    local lm = nn.CausalLM{ vocab = 5, hidden = 8, layers = 1, mixer = MIXER }
    H.expect_error(function() lm:forward(tokens({ 2, 3, 1 }, 5)) end, "tokens: expected [B,T] or [T], got [2x3x1]")
    H.expect_error(function() lm:forward(tokens({ 2, 3 }, 5), { 0, 3 }) end,
                   "tokens: expected [T] or [1,T] with cu_seqlens (packed sequences), got [2x3]")
    -- a bad token names its place in the [B,T] tokens passed, which the model reads
    -- through a transposed view
    local bad = gdp.tensor({ 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 1, 9, 1, 1, 1 }, { 3, 5 }, { dtype = "i64" })
    H.expect_error(function() lm:forward(bad) end,
                   "got 9 at [1,2] (a permuted view: [2,1] in the tensor it views)")
    H.expect_error(function() lm:forward(gdp.tensor({ 0, 1, 7, 3 }, { 1, 4 }, { dtype = "i32" })) end,
                   "got 7 at [2,0] (a permuted view: [0,2] in the tensor it views)")
    local ok, err = pcall(function() emb:forward(gdp.tensor({ 1, 4 }, { 2, 1 }, { dtype = "i64" })) end)
    assert.is_false(ok)
    assert.is_nil(tostring(err):find("permuted", 1, true), tostring(err)) -- not a view: one position
    local tok = tokens({ 4 }, 5)
    lm:forward(tok)
    H.expect_error(function() lm:backward(tok, gdp.randn({ 4, 6 }, { dtype = "f64" })) end,
                   "dy: expected the output's shape [4x5], got [4x6]")
    local mlp = nn.MLP{ dim = 2 }
    local x = gdp.randn({ 3, 2 }, { dtype = "f64" })
    mlp:forward(x)
    H.expect_error(function() mlp:backward(x, gdp.randn({ 3, 2 }, { dtype = "f32" })) end,
                   "dy: expected dtype f64 (the output's), got f32")
    H.assert_alive()
  end)
end)
