-- The model layer ops and modules on cuda (#gpu) against the float64 cpu oracle on the
-- same (rounded) inputs and parameters: the SwiGLU gate, the embedding (a token
-- repeated over several backward segments, vocabulary rows never seen), the
-- cross-entropy (ignore_index, mask, large logits) and a tiny CausalLM's logits, loss
-- and every gradient; f32 within 1e-4, bf16 within 1e-2 for the ops and 5e-2 for the
-- model (the mixer's bf16 bound, spec/mixer_cuda_spec.lua); the embedding backward
-- and the loss repeat bit for bit; out-of-range tokens and targets, checked on the
-- device, raise the cpu's errors.  Without a GPU every case is pending with the reason.
local gdp = require("gdp")
local nn = require("gdp.nn")
local F = nn.functional
local H = gdp_test
local ops = require("gdp.ops")

local OP_TOL = { f32 = 1e-4, bf16 = 1e-2 }
local MODEL_TOL = { f32 = 1e-4, bf16 = 5e-2 }

local function on_cuda(t, dtype) return t:to({ dtype = dtype, device = "cuda" }) end
local function ref64(t) return t:to({ dtype = "f64", device = "cpu" }) end

local function ids(n, V, salt)
  local out = {}
  for i = 1, n do out[i] = (i * 7 + salt) % V end
  return out
end

describe("model layer ops on cuda vs the f64 cpu oracle #gpu", function()
  for _, dtype in ipairs({ "f32", "bf16" }) do
    it("silu_mul forward and backward, " .. dtype, function()
      if not H.need_device("cuda") then return end
      H.reseed(51)
      local g = on_cuda(gdp.randn({ 37, 129 }, { dtype = "f64" }) * 3, dtype)
      local u = on_cuda(gdp.randn({ 37, 129 }, { dtype = "f64" }), dtype)
      local d = on_cuda(gdp.randn({ 37, 129 }, { dtype = "f64" }), dtype)
      assert.tensor_near(F.silu_mul(g, u), F.silu_mul(ref64(g), ref64(u)), OP_TOL[dtype])
      local dg, du = F.silu_mul_backward(g, u, d)
      local rg, ru = F.silu_mul_backward(ref64(g), ref64(u), ref64(d))
      assert.are.equal(dtype, dg:dtype())
      assert.tensor_near(dg, rg, OP_TOL[dtype])
      assert.tensor_near(du, ru, OP_TOL[dtype])
    end)

    it("embedding gather and segmented backward, " .. dtype, function()
      if not H.need_device("cuda") then return end
      H.reseed(52)
      local V, D, n = 50, 33, 1500
      local t = ids(n, V - 3, 1) -- rows V-3 .. V-1 never looked up
      for i = 1, 700 do t[i] = 5 end -- one row over three segments of 256
      local tokens = gdp.tensor(t, { 3, n / 3 }, { dtype = "i32" })
      local w = on_cuda(gdp.randn({ V, D }, { dtype = "f64" }), dtype)
      assert.tensor_near(F.embedding(w, tokens), F.embedding(ref64(w), tokens), 0)
      -- tokens on the device as well
      assert.tensor_near(F.embedding(w, tokens:to("cuda")), F.embedding(ref64(w), tokens), 0)
      local dout = on_cuda(gdp.randn({ 3, n / 3, D }, { dtype = "f64" }), dtype)
      local dw = F.embedding_backward(tokens, dout, V)
      assert.are.equal(dtype == "bf16" and "f32" or dtype, dw:dtype())
      assert.tensor_near(dw, F.embedding_backward(tokens, ref64(dout), V), OP_TOL[dtype])
      assert.are.equal(0, gdp.rel_error(F.embedding_backward(tokens, dout, V), dw))
      assert.are.equal(0, ref64(dw):narrow(1, V - 2, 3):max_abs())
    end)

    -- a block per row (517 classes, i64 targets, f32 mask), a thread per row (6, i32, i64)
    for _, c in ipairs({ { R = 301, V = 517, scale = 20, tdt = "i64", mdt = "f32" },
                         { R = 4099, V = 6, scale = 4, tdt = "i32", mdt = "i64" } }) do
      it(string.format("cross-entropy with ignore_index and a mask, V = %d, %s", c.V, dtype), function()
        if not H.need_device("cuda") then return end
        H.reseed(53)
        local R, V = c.R, c.V
        local logits = on_cuda(gdp.randn({ R, V }, { dtype = "f64" }) * c.scale, dtype)
        local t = ids(R, V, 3)
        t[4], t[100] = -100, -100
        local targets = gdp.tensor(t, { R }, { dtype = c.tdt })
        local mk = {}
        for i = 1, R do mk[i] = i % 5 == 0 and 0 or 1 end
        local mask = gdp.tensor(mk, { R }, { dtype = c.mdt })
        local loss, d, count = F.cross_entropy(logits, targets:to("cuda"), { mask = mask:to("cuda") })
        local rloss, rd, rcount = F.cross_entropy(ref64(logits), targets, { mask = mask })
        assert.are.equal(rcount, count)
        assert.is_true(math.abs(loss - rloss) <= OP_TOL[dtype] * math.abs(rloss),
                       string.format("loss %.10g, oracle %.10g", loss, rloss))
        assert.are.equal(dtype, d:dtype())
        assert.tensor_near(d, rd, OP_TOL[dtype])
        -- host targets and mask: the same bits
        local loss2, d2 = F.cross_entropy(logits, targets, { mask = mask })
        assert.are.equal(loss, loss2)
        assert.are.equal(0, gdp.rel_error(d2, d))
        assert.are.equal(loss, (F.cross_entropy(logits, targets, { mask = mask, grad = false })))
      end)
    end
  end
end)

describe("model layer ops check their integer inputs on cuda #gpu", function()
  -- Tokens and targets are validated on the device there (no host pass over them): the
  -- same errors as on the cpu, at the first bad position, wherever the ids live,
  -- reported by the next op that waits on the device (gdp.h, "model layer ops").
  local function waited(f) return function() f(); gdp.device("cuda"):sync() end end

  it("rejects an out-of-range token in the embedding, naming the first position", function()
    if not H.need_device("cuda") then return end
    local w = on_cuda(gdp.randn({ 5, 8 }, { dtype = "f64" }), "bf16")
    local t = {}
    for i = 1, 3000 do t[i] = i % 5 end
    t[2001], t[2500] = 7, -1
    for _, dt in ipairs({ "i32", "i64" }) do
      local tokens = gdp.tensor(t, { 3, 1000 }, { dtype = dt })
      local want = "tokens: expected values in [0, 5) (num_embeddings), got 7 at [2,0]"
      H.expect_error(waited(function() F.embedding(w, tokens:to("cuda")) end), want)
      H.expect_error(function() F.embedding(w, tokens):cpu() end, want)
      H.expect_error(function() F.embedding(ref64(w), tokens) end, want)
      local dout = on_cuda(gdp.randn({ 3, 1000, 8 }, { dtype = "f64" }), "bf16")
      H.expect_error(waited(function() F.embedding_backward(tokens:to("cuda"), dout, 5) end), want)
      H.expect_error(function() F.embedding_backward(tokens, ref64(dout), 5) end, want)
    end
  end)

  it("checks the tokens of an embedding with D = 0 as well (no values to move)", function()
    if not H.need_device("cuda") then return end
    local tokens = gdp.tensor({ 0, 1, 6, 2 }, { 4 }, { dtype = "i64" })
    local want = "tokens: expected values in [0, 5) (num_embeddings), got 6 at [2]"
    local w = on_cuda(gdp.zeros({ 5, 0 }, { dtype = "f64" }), "f32")
    H.expect_error(waited(function() F.embedding(w, tokens:to("cuda")) end), want)
    H.expect_error(function() F.embedding(ref64(w), tokens) end, want)
    local dout = on_cuda(gdp.zeros({ 4, 0 }, { dtype = "f64" }), "f32")
    H.expect_error(waited(function() F.embedding_backward(tokens:to("cuda"), dout, 5) end), want)
    H.expect_error(function() F.embedding_backward(tokens, ref64(dout), 5) end, want)
  end)

  it("queues its checks without waiting, and the next wait reports the first failed one, once", function()
    if not H.need_device("cuda") then return end
    H.reseed(58)
    local ctx = gdp.device("cuda")
    local w = on_cuda(gdp.randn({ 5, 8 }, { dtype = "f64" }), "f32")
    local good = gdp.tensor(ids(600, 5, 1), { 2, 300 }, { dtype = "i32" }):to("cuda")
    local dout = on_cuda(gdp.randn({ 2, 300, 8 }, { dtype = "f64" }), "f32")
    local logits = on_cuda(gdp.randn({ 2, 300, 5 }, { dtype = "f64" }), "f32")
    local crit = nn.CrossEntropy()
    -- a step's checks (embedding forward and backward, the loss's targets) behind a hold:
    -- the host queues them all before the device gets to the first
    local function step()
      F.embedding(w, good)
      crit:forward_tensor(logits, good)
      F.embedding_backward(good, dout, 5)
    end
    step()
    local hold_ms = 300
    local dev, host, note = ops.timed_device(ctx, step, hold_ms)
    assert.is_number(dev, note)
    assert.is_true(host < 0.25 * hold_ms / 1e3, ("the host took %.1f ms to queue three checked ops behind a %d ms hold")
                                                  :format(host * 1e3, hold_ms))
    -- a bad token: the op returns, the next wait (here a later, good op's read back)
    -- reports it with the embedding's message, and the one after is clean
    local t = ids(600, 5, 1)
    t[302] = 9
    local bad = gdp.tensor(t, { 2, 300 }, { dtype = "i64" }):to("cuda")
    local out = F.embedding(w, bad)
    local fine = F.embedding(w, good)
    H.expect_error(function() fine:cpu() end, "gdp_nn_embedding_forward",
                   "tokens: expected values in [0, 5) (num_embeddings), got 9 at [1,1]")
    ctx:sync()
    assert.tensor_near(fine, F.embedding(ref64(w), good:to("cpu")), 1e-6)
    out:free()
    -- a bad target in a loss left on the device: reported when the loss is read
    local tb = ids(600, 5, 1)
    tb[5] = 7
    local lt = crit:forward_tensor(logits, gdp.tensor(tb, { 2, 300 }, { dtype = "i32" }):to("cuda"))
    H.expect_error(function() lt:get(1) end,
                   "targets: expected values in [0, 5) (logits' last dim) or ignore_index = -100, got 7 at [0,4]")
    ctx:sync()
    -- more checks than the slots between two waits: the op that finds them full waits,
    -- and reports the first failure, not a later one
    H.expect_error(function()
      for i = 1, 70 do
        local ti = ids(600, 5, 1)
        ti[i] = 100 + i
        F.embedding(w, gdp.tensor(ti, { 2, 300 }, { dtype = "i32" }):to("cuda"))
      end
    end, "got 101 at [0,0]")
    ctx:sync()
    assert.tensor_near(F.embedding(w, good), F.embedding(ref64(w), good:to("cpu")), 1e-6)
  end)

  it("rejects an out-of-range counted target, not an ignored or masked one", function()
    if not H.need_device("cuda") then return end
    local logits = on_cuda(gdp.randn({ 2, 3, 4 }, { dtype = "f64" }), "f32")
    local t = gdp.tensor({ { 0, 9, 2 }, { 3, 4, 0 } }, { dtype = "i32" })
    local mask = gdp.tensor({ { 1, 0, 1 }, { 1, 1, 1 } }, { dtype = "f32" })
    local want = "targets: expected values in [0, 4) (logits' last dim) or ignore_index = -100, got 4 at [1,1]"
    H.expect_error(function() F.cross_entropy(logits, t:to("cuda"), { mask = mask:to("cuda") }) end, want)
    H.expect_error(function() F.cross_entropy(ref64(logits), t, { mask = mask }) end, want)
    local ok = gdp.tensor({ { 0, 9, 2 }, { 3, -100, 0 } }, { dtype = "i64" })
    local loss, _, count = F.cross_entropy(logits, ok:to("cuda"), { mask = mask:to("cuda") })
    local rloss, _, rcount = F.cross_entropy(ref64(logits), ok, { mask = mask })
    assert.are.equal(4, count)
    assert.are.equal(rcount, count)
    assert.is_true(math.abs(loss - rloss) <= 1e-5 * math.abs(rloss))
  end)

  for _, dtype in ipairs({ "f32", "bf16" }) do
    it("embedding backward over a small vocabulary repeats bit for bit, " .. dtype, function()
      if not H.need_device("cuda") then return end
      H.reseed(57)
      -- the state-tracking shape, scaled down: 6 rows, each over many segments
      local V, D, B, T = 6, 128, 16, 257
      local t = {}
      for i = 1, B * T do t[i] = (i * 5 + math.floor(i / 7)) % V end
      local tokens = gdp.tensor(t, { B, T }, { dtype = "i32" }):to("cuda")
      local dout = on_cuda(gdp.randn({ B, T, D }, { dtype = "f64" }), dtype)
      local dw = F.embedding_backward(tokens, dout, V)
      local again = F.embedding_backward(tokens:to("i64"), dout, V)
      assert.are.equal(0, gdp.rel_error(again, dw))
      assert.are.equal(0, ref64(again):sub(ref64(dw)):max_abs())
      assert.tensor_near(dw, F.embedding_backward(tokens:to("cpu"), ref64(dout), V), OP_TOL[dtype])
    end)
  end
end)

describe("gdp.matmul of bf16 operands into a float32 out #gpu", function()
  it("accumulates in float32 (the bf16 models' weight gradients)", function()
    if not H.need_device("cuda") then return end
    H.reseed(55)
    local a = on_cuda(gdp.randn({ 300, 40 }, { dtype = "f64" }), "bf16")
    local b = on_cuda(gdp.randn({ 300, 24 }, { dtype = "f64" }), "bf16")
    local c0 = gdp.randn({ 40, 24 }, { dtype = "f64" })
    local c = on_cuda(c0, "f32")
    gdp.matmul(a, b, { trans_a = true, out = c, beta = 1 })
    local want = gdp.matmul(ref64(a), ref64(b), { trans_a = true }):add(ref64(c0:to("f32")))
    assert.are.equal("f32", c:dtype())
    assert.tensor_near(c, want, 1e-5)
  end)
end)

describe("nn.CausalLM on cuda vs the f64 cpu model #gpu", function()
  for _, dtype in ipairs({ "f32", "bf16" }) do
    for _, tie in ipairs({ false, true }) do
      it(dtype .. (tie and ", tied embeddings, packed" or ", B = 2"), function()
        if not H.need_device("cuda") then return end
        H.reseed(54)
        local cfg = { vocab = 11, hidden = 32, layers = 2, tie_embeddings = tie, seed = 7,
                      mixer = { num_heads = 2, head_dim = 16, state_dim = 16, num_householder = 2,
                                allow_neg_eigval = true } }
        local ref = nn.CausalLM(cfg)
        cfg.dtype, cfg.device = dtype, "cuda"
        local m = nn.CausalLM(cfg)
        m:set_parameters(ref:parameters())
        ref:set_parameters(m:parameters()) -- the reference sees the rounded values
        local shape, cu = { 2, 19 }, nil
        if tie then shape, cu = { 40 }, { 0, 17, 17, 40 } end
        local n = shape[1] * (shape[2] or 1)
        local tok = gdp.tensor(ids(n, 11, 2), shape, { dtype = "i64" })
        local tg = gdp.tensor(ids(n, 11, 5), shape, { dtype = "i64" })
        local logits = m:forward(tok, cu)
        local rlogits = ref:forward(tok, cu)
        assert.tensor_near(logits, rlogits, MODEL_TOL[dtype], "logits")
        local loss, d = F.cross_entropy(logits, tg)
        local rloss, rd = F.cross_entropy(rlogits, tg)
        assert.is_true(math.abs(loss - rloss) <= MODEL_TOL[dtype] * rloss)
        local rec = H.record_mixer_grads(ref)
        m:backward(tok, d, cu)
        ref:backward(tok, rd, cu)
        -- bf16: the mixers' A_log and dt_bias against their summed terms (helper.lua)
        H.assert_model_grads_near(m:gradients(), ref:gradients(), ref:parameter_names(),
                                  MODEL_TOL[dtype], rec, dtype == "bf16")
      end)
    end
  end
end)
