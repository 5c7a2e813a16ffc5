-- The model layer ops (gdp.h, "model layer ops"; gdp.nn.functional) on the cpu against
-- plain float64 Lua loops written here (the oracles): the SwiGLU gate, the embedding
-- gather and its backward, the cross-entropy with ignore_index and a mask, and the
-- plain RMSNorm.  f64 within 1e-12, f32 within 1e-5 of the oracle; strided inputs,
-- odd sizes, i32 and i64 indices; every bad argument is an error naming it, the
-- expected and the actual value.
local gdp = require("gdp")
local F = require("gdp.nn.functional")
local H = gdp_test

local TOL = { f64 = 1e-12, f32 = 1e-5 }

local function rows_of(t)
  local v = t:to({ dtype = "f64", device = "cpu" }):contiguous():flat()
  return v
end

-- tensor of `shape` from a flat Lua array
local function from(flat, shape, dtype)
  return gdp.tensor(flat, shape, { dtype = dtype or "f64" })
end

local function sigmoid(x) return 1 / (1 + math.exp(-x)) end

describe("nn.functional.silu_mul", function()
  for _, dtype in ipairs({ "f64", "f32" }) do
    it("matches the float64 oracle forward and backward, " .. dtype .. ", strided", function()
      H.reseed(11)
      -- transposed views: the op copies to contiguous inside
      local gate = gdp.randn({ 13, 7 }, { dtype = "f64" }):mul(2):transpose(1, 2):to(dtype)
      local up = gdp.randn({ 7, 13 }, { dtype = dtype })
      local dout = gdp.randn({ 7, 13 }, { dtype = dtype })
      local g, u, d = rows_of(gate), rows_of(up), rows_of(dout)
      local want, wdg, wdu = {}, {}, {}
      for i = 1, #g do
        local s = sigmoid(g[i])
        want[i] = g[i] * s * u[i]
        wdu[i] = d[i] * g[i] * s
        wdg[i] = d[i] * u[i] * s * (1 + g[i] * (1 - s))
      end
      assert.tensor_near(F.silu_mul(gate, up), from(want, { 7, 13 }), TOL[dtype])
      local dg, du = F.silu_mul_backward(gate, up, dout)
      assert.are.equal(dtype, dg:dtype())
      assert.tensor_near(dg, from(wdg, { 7, 13 }), TOL[dtype])
      assert.tensor_near(du, from(wdu, { 7, 13 }), TOL[dtype])
    end)
  end

  it("rejects mismatched shapes and integer dtypes, naming the argument", function()
    local a = gdp.randn({ 3, 4 }, { dtype = "f64" })
    H.expect_error(function() F.silu_mul(a, gdp.randn({ 4, 3 }, { dtype = "f64" })) end,
                   "up: expected the shape of gate, [3x4], got [4x3]")
    H.expect_error(function() F.silu_mul(a:to("i32"), a) end, "gate: expected dtype f64 or f32", "got i32")
    H.expect_error(function() F.silu_mul_backward(a, a, gdp.randn({ 3 }, { dtype = "f64" })) end,
                   "d_out: expected the shape of gate")
  end)
end)

describe("nn.functional.embedding", function()
  for _, c in ipairs({ { dtype = "f64", idx = "i64" }, { dtype = "f32", idx = "i32" } }) do
    it("gathers and scatter-adds as the oracle, " .. c.dtype .. " weights, " .. c.idx .. " tokens", function()
      H.reseed(12)
      local V, D = 11, 5
      local weight = gdp.randn({ V, D }, { dtype = c.dtype })
      local ids = {}
      for i = 1, 3 * 9 do ids[i] = math.random(0, V - 1) end
      ids[4], ids[20] = V - 1, 0 -- both ends of the range
      -- a transposed token view [9,3] of a [3,9] tensor
      local tokens = from(ids, { 3, 9 }, c.idx):transpose(1, 2)
      local tid = rows_of(tokens)
      local w = rows_of(weight)
      local out = F.embedding(weight, tokens)
      assert.are.same({ 9, 3, D }, out:shape())
      local want = {}
      for i = 1, #tid do
        for j = 1, D do want[(i - 1) * D + j] = w[tid[i] * D + j] end
      end
      assert.tensor_near(out, from(want, { 9, 3, D }), TOL[c.dtype])
      local dout = gdp.randn({ 9, 3, D }, { dtype = c.dtype })
      local d = rows_of(dout)
      local wd = {}
      for i = 1, V * D do wd[i] = 0 end
      for i = 1, #tid do
        for j = 1, D do wd[tid[i] * D + j] = wd[tid[i] * D + j] + d[(i - 1) * D + j] end
      end
      local dw = F.embedding_backward(tokens, dout, V)
      assert.are.equal(c.dtype, dw:dtype())
      assert.tensor_near(dw, from(wd, { V, D }), TOL[c.dtype])
      -- rows never looked up get exact zeros; a rerun is bit-identical
      assert.are.equal(0, gdp.rel_error(F.embedding_backward(tokens, dout, V), dw))
    end)
  end

  it("takes 1-D and 0-d token tensors", function()
    local weight = gdp.randn({ 4, 3 }, { dtype = "f64" })
    local row = F.embedding(weight, gdp.tensor({ 2 }, { 1 }, { dtype = "i64" }))
    assert.are.same({ 1, 3 }, row:shape())
    assert.tensor_near(row:view(3), weight:select(1, 3), 0)
    local scalar = F.embedding(weight, gdp.tensor(3, {}, { dtype = "i32" }))
    assert.are.same({ 3 }, scalar:shape())
    assert.tensor_near(scalar, weight:select(1, 4), 0)
  end)

  it("rejects tokens out of range, naming the position, and bad shapes", function()
    local weight = gdp.randn({ 5, 2 }, { dtype = "f64" })
    H.expect_error(function() F.embedding(weight, gdp.tensor({ { 0, 1 }, { 5, 2 } }, { dtype = "i64" })) end,
                   "tokens: expected values in [0, 5) (num_embeddings), got 5 at [1,0]")
    -- a transposed view: its position and the viewed tensor's; a 3-dim permutation too
    local base = gdp.tensor({ { 0, 1, 2 }, { 3, 4, 7 } }, { dtype = "i64" })
    H.expect_error(function() F.embedding(weight, base:transpose(1, 2)) end,
                   "got 7 at [2,1] (a permuted view: [1,2] in the tensor it views)")
    local cube = gdp.zeros({ 2, 3, 4 }, { dtype = "i32" })
    cube:set(6, 2, 3, 1) -- [1,2,0] 0-based
    H.expect_error(function() F.embedding(weight, cube:permute(3, 1, 2)) end,
                   "got 6 at [0,1,2] (a permuted view: [1,2,0] in the tensor it views)")
    H.expect_error(function() F.embedding_backward(base:transpose(1, 2), gdp.zeros({ 3, 2, 2 }, { dtype = "f64" }), 5) end,
                   "got 7 at [2,1] (a permuted view: [1,2] in the tensor it views)")
    H.expect_error(function() F.embedding(weight, gdp.tensor({ -1 }, { 1 }, { dtype = "i32" })) end,
                   "got -1 at [0]")
    H.expect_error(function() F.embedding(weight, gdp.tensor({ 1 }, { 1 }, { dtype = "f64" })) end,
                   "tokens: expected dtype i32 or i64, got f64")
    H.expect_error(function() F.embedding(gdp.randn({ 5 }, { dtype = "f64" }), gdp.tensor({ 1 }, { 1 }, { dtype = "i32" })) end,
                   "weight: expected 2 dims [V,D], got [5]")
    local tok = gdp.tensor({ 1, 2 }, { 2 }, { dtype = "i32" })
    H.expect_error(function() F.embedding_backward(tok, gdp.randn({ 3, 2 }, { dtype = "f64" }), 5) end,
                   "tokens: expected the leading dims of d_out, [3], got [2]")
    H.expect_error(function() F.embedding_backward(tok, gdp.randn({ 2 }, { dtype = "f64" }), 5) end,
                   "d_out: expected tokens' shape [2] then D (2 dims), got [2]")
    H.expect_error(function() F.embedding_backward(tok, gdp.randn({ 2, 3 }, { dtype = "f64" }), 2) end,
                   "tokens: expected values in [0, 2) (num_embeddings), got 2 at [1]")
    H.expect_error(function() F.embedding_backward(tok, gdp.randn({ 2, 3 }, { dtype = "f64" }), 0) end,
                   "num_embeddings must be an integer >= 1, got 0")
  end)
end)

-- The oracle: mean over counted rows of logsumexp - x[target], and its gradient.
local function xent_oracle(x, V, targets, mask, ignore)
  local rows = #targets
  local loss, count, grad = 0, 0, {}
  for r = 1, rows do
    local counted = targets[r] ~= ignore and (mask == nil or mask[r] ~= 0)
    if counted then count = count + 1 end
  end
  for r = 1, rows do
    local counted = targets[r] ~= ignore and (mask == nil or mask[r] ~= 0)
    local m = -math.huge
    for j = 1, V do m = math.max(m, x[(r - 1) * V + j]) end
    local s = 0
    for j = 1, V do s = s + math.exp(x[(r - 1) * V + j] - m) end
    local lse = m + math.log(s)
    for j = 1, V do
      local g = 0
      if counted then
        g = (math.exp(x[(r - 1) * V + j] - lse) - (j - 1 == targets[r] and 1 or 0)) / count
      end
      grad[(r - 1) * V + j] = g
    end
    if counted then loss = loss + (lse - x[(r - 1) * V + targets[r] + 1]) end
  end
  return count > 0 and loss / count or 0, grad, count
end

describe("nn.functional.cross_entropy", function()
  for _, dtype in ipairs({ "f64", "f32" }) do
    it("matches the oracle with ignore_index and a mask, " .. dtype, function()
      H.reseed(13)
      local B, T, V = 3, 7, 13
      -- large logits: a naive exp would overflow; the op subtracts the max
      local logits = (gdp.randn({ B, T, V }, { dtype = "f64" }) * 30):to(dtype)
      local tg, mk = {}, {}
      for i = 1, B * T do
        tg[i] = math.random(0, V - 1)
        mk[i] = (i % 4 == 0) and 0 or 1
      end
      tg[2], tg[9] = -100, -100
      tg[5] = V - 1
      local targets = from(tg, { B, T }, "i64")
      local mask = from(mk, { B, T }, "f32")
      local x = rows_of(logits)
      local want, wgrad, wcount = xent_oracle(x, V, tg, mk, -100)
      local loss, dlogits, count = F.cross_entropy(logits, targets, { mask = mask })
      assert.are.equal(wcount, count)
      assert.is_true(math.abs(loss - want) <= TOL[dtype] * math.abs(want),
                     string.format("loss %.15g, oracle %.15g", loss, want))
      assert.are.equal(dtype, dlogits:dtype())
      assert.tensor_near(dlogits, from(wgrad, { B, T, V }), TOL[dtype])
      -- no mask, another ignore_index, targets as i32
      local tg2 = {}
      for i = 1, B * T do tg2[i] = tg[i] == -100 and 3 or tg[i] end
      local want2, wgrad2 = xent_oracle(x, V, tg2, nil, 3)
      local loss2, d2 = F.cross_entropy(logits, from(tg2, { B, T }, "i32"), { ignore_index = 3 })
      assert.is_true(math.abs(loss2 - want2) <= TOL[dtype] * math.abs(want2))
      assert.tensor_near(d2, from(wgrad2, { B, T, V }), TOL[dtype])
      local loss3, d3 = F.cross_entropy(logits, targets, { mask = mask, grad = false })
      assert.are.equal(loss, loss3)
      assert.is_nil(d3)
      -- the same left in a tensor (no read back): [2] float64, the loss and the count
      local r, d4 = F.cross_entropy_result(logits, targets, { mask = mask })
      assert.are.same({ 2 }, r:shape())
      assert.are.equal("f64", r:dtype())
      assert.are.equal(loss, r:get(1))
      assert.are.equal(count, r:get(2))
      assert.are.equal(0, gdp.rel_error(d4, dlogits))
      local r5, d5 = F.cross_entropy_result(logits, from(tg2, { B, T }, "i32"), { ignore_index = 3, grad = false })
      assert.are.equal(loss2, r5:get(1))
      assert.is_nil(d5)
    end)
  end

  it("is the mean of finite differences of its own loss (f64)", function()
    H.reseed(14)
    local logits = gdp.randn({ 6, 5 }, { dtype = "f64" })
    local targets = gdp.tensor({ 0, 4, -100, 2, 2, 1 }, { 6 }, { dtype = "i64" })
    local _, d = F.cross_entropy(logits, targets)
    local h, worst = 1e-6, 0
    for r = 1, 6 do
      for j = 1, 5 do
        local keep = logits:get(r, j)
        logits:set(keep + h, r, j)
        local lp = F.cross_entropy(logits, targets, { grad = false })
        logits:set(keep - h, r, j)
        local lm = F.cross_entropy(logits, targets, { grad = false })
        logits:set(keep, r, j)
        worst = math.max(worst, math.abs((lp - lm) / (2 * h) - d:get(r, j)))
      end
    end
    assert.is_true(worst < 1e-8, "worst finite-difference error " .. worst)
  end)

  it("gives loss 0, count 0 and zero gradients when no row counts", function()
    local logits = gdp.randn({ 2, 3 }, { dtype = "f64" })
    local loss, d, count = F.cross_entropy(logits, gdp.tensor({ -100, -100 }, { 2 }, { dtype = "i64" }))
    assert.are.equal(0, loss)
    assert.are.equal(0, count)
    assert.are.equal(0, d:max_abs())
    local r = F.cross_entropy_result(logits, gdp.tensor({ -100, -100 }, { 2 }, { dtype = "i64" }))
    assert.are.equal(0, r:get(1))
    assert.are.equal(0, r:get(2))
  end)

  it("rejects bad targets, shapes and options, naming them", function()
    local logits = gdp.randn({ 2, 3, 4 }, { dtype = "f64" })
    local t = gdp.tensor({ { 0, 1, 2 }, { 3, 4, 0 } }, { dtype = "i64" })
    H.expect_error(function() F.cross_entropy(logits, t) end,
                   "targets: expected values in [0, 4) (logits' last dim) or ignore_index = -100, got 4 at [1,1]")
    H.expect_error(function() F.cross_entropy(logits, gdp.tensor({ 0, 1 }, { 2 }, { dtype = "i64" })) end,
                   "targets: expected the leading dims of logits, [2x3], got [2]")
    H.expect_error(function() F.cross_entropy(logits, t:to("f32")) end, "targets: expected dtype i32 or i64, got f32")
    local ok_t = gdp.tensor({ { 0, 1, 2 }, { 3, 0, 0 } }, { dtype = "i64" })
    H.expect_error(function() F.cross_entropy(logits, ok_t, { mask = gdp.ones({ 3, 2 }) }) end,
                   "mask: expected the shape of targets, [2x3], got [3x2]")
    H.expect_error(function() F.cross_entropy(logits, ok_t, { ignore_index = 0.5 }) end,
                   "ignore_index must be an integer, got 0.5")
    H.expect_error(function() F.cross_entropy(logits, ok_t, { weights = 1 }) end, "unknown option 'weights'")
    H.expect_error(function() F.cross_entropy(gdp.randn({ 2, 0 }, { dtype = "f64" }), gdp.tensor({ 0, 0 }, { 2 }, { dtype = "i64" })) end,
                   "logits: expected [..., V] with V >= 1 classes, got [2x0]")
  end)
end)

describe("nn.functional.rms_norm", function()
  for _, dtype in ipairs({ "f64", "f32" }) do
    it("matches the oracle forward and backward, " .. dtype, function()
      H.reseed(15)
      local R, D, eps = 5, 9, 1e-5
      local x = gdp.randn({ R, D }, { dtype = dtype })
      local w = gdp.rand({ D }, { dtype = dtype }) + 0.5
      local dy = gdp.randn({ R, D }, { dtype = dtype })
      local xs, ws, ds = rows_of(x), rows_of(w), rows_of(dy)
      local want, wdx, wdw = {}, {}, {}
      for j = 1, D do wdw[j] = 0 end
      for r = 0, R - 1 do
        local ss = 0
        for j = 1, D do ss = ss + xs[r * D + j] ^ 2 end
        local rstd = 1 / math.sqrt(ss / D + eps)
        local c = 0
        for j = 1, D do c = c + ds[r * D + j] * ws[j] * xs[r * D + j] * rstd end
        c = c / D
        for j = 1, D do
          local i = r * D + j
          want[i] = xs[i] * rstd * ws[j]
          wdx[i] = rstd * (ds[i] * ws[j] - xs[i] * rstd * c)
          wdw[j] = wdw[j] + ds[i] * xs[i] * rstd
        end
      end
      assert.tensor_near(F.rms_norm(x, w, eps), from(want, { R, D }), TOL[dtype])
      local dx, dw = F.rms_norm_backward(x, w, eps, dy)
      assert.tensor_near(dx, from(wdx, { R, D }), TOL[dtype])
      assert.tensor_near(dw, from(wdw, { D }), TOL[dtype])
    end)
  end
end)

describe("gdp.matmul of bf16 operands into a float32 out", function()
  it("is refused on the cpu (no bf16 matmul there; spec/nn_cuda_spec.lua checks cuda)", function()
    local a = gdp.zeros({ 2, 2 }, { dtype = "bf16" })
    H.expect_error(function() gdp.matmul(a, a, { out = gdp.zeros({ 2, 2 }, { dtype = "f32" }) }) end,
                   "matmul is not implemented for bf16 on cpu")
    H.expect_error(function() gdp.matmul(a, a, { out = gdp.zeros({ 2, 2 }, { dtype = "f64" }) }) end,
                   "out and a must have the same dtype, got f64 and bf16")
  end)
end)
