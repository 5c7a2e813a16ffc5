-- gdp.data: the state-tracking tasks against a plain Lua oracle (the groups built here
-- by recursion and cycle counts, products composed here, tokens recomputed from the raw
-- Philox block), the stream's reproducibility rules, cuda against cpu (#gpu), and the
-- sequence accuracy against a Lua count.
local ffi = require("ffi")
local gdp = require("gdp")
local data = require("gdp.data")
local lib = gdp.lib
local H = gdp_test

------------------------------------------------------------------------------- oracle

-- All permutations of {0..k-1} in lexicographic order (recursion: smallest first).
local function permutations(k)
  local out, cur, used = {}, {}, {}
  local function rec(i)
    if i > k then
      local p = {}
      for j = 1, k do p[j] = cur[j] end
      out[#out + 1] = p
      return
    end
    for v = 0, k - 1 do
      if not used[v] then
        used[v], cur[i] = true, v
        rec(i + 1)
        used[v] = false
      end
    end
  end
  rec(1)
  return out
end

-- Even: k minus the number of cycles is even.
local function is_even(p)
  local seen, cycles = {}, 0
  for i = 0, #p - 1 do
    if not seen[i] then
      cycles = cycles + 1
      local j = i
      while not seen[j] do seen[j], j = true, p[j + 1] end
    end
  end
  return (#p - cycles) % 2 == 0
end

local GROUPS = { S3 = { 3, false }, S4 = { 4, false }, A5 = { 5, true }, S5 = { 5, false } }

-- {elements = list of perms, index = key -> 0-based index} of a permutation task.
local function group(task)
  local k, even = GROUPS[task][1], GROUPS[task][2]
  local g = { elements = {}, index = {} }
  for _, p in ipairs(permutations(k)) do
    if not even or is_even(p) then
      g.elements[#g.elements + 1] = p
      g.index[table.concat(p, ",")] = #g.elements - 1
    end
  end
  return g
end

-- Labels of one row of tokens: y_t = y_{t-1} * x_t, (p * q)(i) = q(p(i)).
local function oracle_labels(task, row, modulus)
  local out = {}
  if task == "parity" or task == "modular_addition" then
    local m, s = task == "parity" and 2 or modulus, 0
    for t, x in ipairs(row) do
      s = (s + x) % m
      out[t] = s
    end
    return out
  end
  local g = group(task)
  local k = #g.elements[1]
  local y = {}
  for i = 1, k do y[i] = i - 1 end -- identity
  for t, x in ipairs(row) do
    local q, nxt = g.elements[x + 1], {}
    for i = 1, k do nxt[i] = q[y[i] + 1] end
    y = nxt
    out[t] = g.index[table.concat(y, ",")]
  end
  return out
end

-- Token t (0-based) of sequence s from the raw Philox block, as gdp.h documents it.
local function oracle_token(seed, s, t, n)
  local ctr, key, out = ffi.new("uint32_t[4]"), ffi.new("uint32_t[2]"), ffi.new("uint32_t[4]")
  local blk = math.floor(t / 4)
  ctr[0], ctr[1] = blk % 2 ^ 32, math.floor(blk / 2 ^ 32)
  ctr[2], ctr[3] = s % 2 ^ 32, math.floor(s / 2 ^ 32) + 2 ^ 31
  key[0], key[1] = seed % 2 ^ 32, math.floor(seed / 2 ^ 32)
  lib.gdp_philox4x32_10(ctr, key, out)
  return math.floor(tonumber(out[t % 4]) * n / 2 ^ 32)
end

local SIZES = { parity = 2, S3 = 6, S4 = 24, A5 = 60, S5 = 120 }

local CASES = {
  { task = "parity" }, { task = "modular_addition", modulus = 5 },
  { task = "modular_addition", modulus = 97 }, { task = "S3" }, { task = "S4" },
  { task = "A5" }, { task = "S5" },
}

local function case_name(c)
  return c.task .. (c.modulus and (" mod " .. c.modulus) or "")
end

------------------------------------------------------------------------------- specs

describe("gdp.data.state_tracking", function()
  for ci, c in ipairs(CASES) do
    it(case_name(c) .. ": tokens follow the documented stream, labels are prefix products", function()
      local seed, offset, B, T = 1000 + ci, 2 ^ 33 + 7 * ci, 3, 37
      local tok, lab = data.state_tracking{ task = c.task, modulus = c.modulus, batch = B,
                                            length = T, seed = seed, offset = offset }
      assert.are.equal("i32", tok:dtype())
      assert.are.same({ B, T }, tok:shape())
      assert.are.same({ B, T }, lab:shape())
      local n = c.modulus or SIZES[c.task]
      assert.are.equal(n, data.num_classes(c.task, c.modulus))
      local tt, lt = tok:totable(), lab:totable()
      for b = 1, B do
        local want = {}
        for t = 1, T do want[t] = oracle_token(seed, offset + b - 1, t - 1, n) end
        assert.are.same(want, tt[b])
        assert.are.same(oracle_labels(c.task, tt[b], c.modulus), lt[b])
      end
    end)
  end

  it("draws every element about equally often (S5: 24000 tokens)", function()
    local tok, lab = data.state_tracking{ task = "S5", batch = 120, length = 200, seed = 5 }
    local count_t, count_l = {}, {}
    for _, row in ipairs(tok:totable()) do
      for _, x in ipairs(row) do count_t[x] = (count_t[x] or 0) + 1 end
    end
    for _, row in ipairs(lab:totable()) do
      for _, x in ipairs(row) do count_l[x] = (count_l[x] or 0) + 1 end
    end
    for e = 0, 119 do
      -- expected 200 each, sd ~14: [120, 280] fails by chance with probability < 1e-6
      assert.is_true((count_t[e] or 0) >= 120 and (count_t[e] or 0) <= 280,
                     string.format("token %d drawn %d times", e, count_t[e] or 0))
      assert.is_true((count_l[e] or 0) >= 120 and (count_l[e] or 0) <= 280,
                     string.format("label %d seen %d times", e, count_l[e] or 0))
    end
  end)

  it("is reproducible: same (seed, offset) same data, prefixes and offsets line up", function()
    local a = data.state_tracking{ task = "A5", batch = 5, length = 50, seed = 9, offset = 0 }
    local b = data.state_tracking{ task = "A5", batch = 5, length = 50, seed = 9, offset = 0 }
    assert.are.same(a:totable(), b:totable())
    -- a shorter draw is the prefix of a longer one
    local short = data.state_tracking{ task = "A5", batch = 5, length = 13, seed = 9 }
    assert.are.same(a:narrow(2, 1, 13):totable(), short:totable())
    -- offset 2 starts at row 3 of offset 0
    local shifted = data.state_tracking{ task = "A5", batch = 3, length = 50, seed = 9, offset = 2 }
    assert.are.same(a:narrow(1, 3, 3):totable(), shifted:totable())
    -- another seed, other data
    local other = data.state_tracking{ task = "A5", batch = 5, length = 50, seed = 10 }
    assert.are_not.same(a:totable(), other:totable())
  end)

  it("does not depend on the thread count", function()
    local ctx = gdp.device("cpu")
    local saved = ctx:num_threads()
    ctx:set_num_threads(1)
    local t1, l1 = data.state_tracking{ task = "S4", batch = 300, length = 40, seed = 3 }
    ctx:set_num_threads(4)
    local t4, l4 = data.state_tracking{ task = "S4", batch = 300, length = 40, seed = 3 }
    ctx:set_num_threads(saved)
    assert.are.same(t1:totable(), t4:totable())
    assert.are.same(l1:totable(), l4:totable())
  end)

  it("keeps its stream apart from the random fills of the same seed", function()
    -- a fill's block b is counter {b, 0, 0, 0}; sequence 0's block 0 is {0, 0, 0, 2^31}
    local ctx = gdp.device("cpu")
    ctx:manual_seed(77)
    local u = gdp.rand({ 4 }, { dtype = "f64" }):totable()
    local tok = data.state_tracking{ task = "modular_addition", modulus = 2 ^ 31 - 1, batch = 1,
                                     length = 4, seed = 77 }:totable()[1]
    for i = 1, 4 do
      assert.are_not.equal(math.floor(u[i] * (2 ^ 31 - 1)), tok[i])
    end
  end)

  it("makes empty sets", function()
    local t, l = data.state_tracking{ task = "S3", batch = 0, length = 5, seed = 1 }
    assert.are.same({ 0, 5 }, t:shape())
    t, l = data.state_tracking{ task = "parity", batch = 3, length = 0, seed = 1 }
    assert.are.same({ 3, 0 }, l:shape())
  end)

  it("rejects bad arguments, naming them", function()
    local function err(opts, pat)
      local ok, e = pcall(data.state_tracking, opts)
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find(pat, 1, true), tostring(e))
    end
    err({ task = "S6", batch = 1, length = 1, seed = 1 }, "task: expected one of parity")
    err({ task = "modular_addition", batch = 1, length = 1, seed = 1 }, "modulus must be an integer >= 2")
    err({ task = "S3", modulus = 3, batch = 1, length = 1, seed = 1 }, "modulus: only task modular_addition")
    err({ task = "S3", batch = -1, length = 1, seed = 1 }, "batch must be an integer >= 0, got -1")
    err({ task = "S3", batch = 1, length = 2.5, seed = 1 }, "length must be an integer >= 0, got 2.5")
    err({ task = "S3", batch = 1, length = 1 }, "seed: expected an integer >= 0")
    err({ task = "S3", batch = 2000, length = 1, seed = 1, offset = 2 ^ 63 - 1024 }, "offset + batch <= 2^63")
    err({ task = "S3", batch = 1, length = 1, seed = 1, lenght = 3 }, "lenght")
    local ok, e = pcall(data.num_classes, "modular_addition", 2 ^ 31)
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("modulus: expected 2..2147483647", 1, true), tostring(e))
  end)
end)

describe("gdp.data.permutation", function()
  for task in pairs(GROUPS) do
    it(task .. ": lexicographic numbering, identity 0" .. (task == "A5" and ", even only" or ""), function()
      local g = group(task)
      assert.are.equal(SIZES[task], #g.elements)
      for e = 0, #g.elements - 1 do
        assert.are.same(g.elements[e + 1], data.permutation(task, e))
      end
      local ok, err = pcall(data.permutation, task, #g.elements)
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find("index: expected 0.." .. (#g.elements - 1), 1, true))
    end)
  end
  it("refuses the cyclic tasks", function()
    local ok, err = pcall(data.permutation, "parity", 0)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("expected a permutation group", 1, true))
  end)
end)

describe("gdp.data.state_tracking on cuda #gpu", function()
  for _, c in ipairs(CASES) do
    it(case_name(c) .. ": the same bits as the cpu", function()
      if not H.need_device("cuda") then return end
      -- more sequences than one block of threads, an odd length
      local opts = { task = c.task, modulus = c.modulus, batch = 301, length = 131, seed = 4,
                     offset = 12345 }
      local tc, lc = data.state_tracking(opts)
      opts.device = "cuda"
      local tg, lg = data.state_tracking(opts)
      assert.are.equal("cuda:0", tg:device())
      assert.are.same(tc:totable(), tg:to("cpu"):totable())
      assert.are.same(lc:totable(), lg:to("cpu"):totable())
    end)
  end
end)

describe("gdp.data.sequence_accuracy", function()
  -- labels with some tokens wrong, seeded from the spec's seed
  local function corrupted(B, T, C, p_wrong)
    math.randomseed(H.seed)
    local lab, pred = {}, {}
    for b = 1, B do
      lab[b], pred[b] = {}, {}
      for t = 1, T do
        lab[b][t] = math.random(0, C - 1)
        pred[b][t] = math.random() < p_wrong and (lab[b][t] + 1) % C or lab[b][t]
      end
    end
    return lab, pred
  end

  local function oracle(lab, pred)
    local B, T = #lab, #lab[1]
    local cum, per = {}, {}
    for t = 1, T do
      local right, all = 0, 0
      for b = 1, B do
        local ok_prefix = true
        for u = 1, t do ok_prefix = ok_prefix and pred[b][u] == lab[b][u] end
        if pred[b][t] == lab[b][t] then right = right + 1 end
        if ok_prefix then all = all + 1 end
      end
      per[t], cum[t] = right / B, all / B
    end
    return cum, per
  end

  it("from classes: cumulative and per-token fractions", function()
    local lab, pred = corrupted(23, 17, 6, 0.03)
    local acc = data.sequence_accuracy(gdp.tensor(pred, { dtype = "i64" }), gdp.tensor(lab, { dtype = "i32" }))
    local cum, per = oracle(lab, pred)
    assert.are.same(cum, acc.cumulative)
    assert.are.same(per, acc.per_token)
    local mean = 0
    for t = 1, 17 do mean = mean + per[t] / 17 end
    assert.is_true(math.abs(acc.token - mean) < 1e-12)
    -- the case is not trivial: some sequence fails, and the curve falls
    assert.is_true(acc.cumulative[17] < acc.cumulative[1])
  end)

  it("from scores: the argmax over the last dim, first of equal maxima, NaN never wins", function()
    local B, T, C = 4, 5, 3
    local lab, pred = corrupted(B, T, C, 0.2)
    local scores = {}
    for b = 1, B do
      scores[b] = {}
      for t = 1, T do
        local row = {}
        for c = 1, C do row[c] = -math.random() end
        row[pred[b][t] + 1] = 1
        scores[b][t] = row
      end
    end
    scores[1][1] = { 0 / 0, 2, 2 } -- NaN first, then a tie: class 1
    pred[1][1] = 1
    local acc = data.sequence_accuracy(gdp.tensor(scores, { dtype = "f32" }), gdp.tensor(lab, { dtype = "i32" }))
    local cum, per = oracle(lab, pred)
    assert.are.same(cum, acc.cumulative)
    assert.are.same(per, acc.per_token)
  end)

  it("rejects mismatched shapes and dtypes", function()
    local lab = gdp.zeros({ 2, 3 }, { dtype = "i32" })
    local function err(pred, labels, pat)
      local ok, e = pcall(data.sequence_accuracy, pred, labels)
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find(pat, 1, true), tostring(e))
    end
    err(gdp.zeros({ 2, 4 }, { dtype = "i32" }), lab, "predictions: expected int32/int64 classes [B,T] = [2,3]")
    err(gdp.zeros({ 2, 3 }, { dtype = "f32" }), lab, "predictions: expected")
    err(lab, gdp.zeros({ 2, 3 }, { dtype = "f32" }), "labels: expected int32 or int64 [B,T]")
    err(lab, nil, "labels: expected a gdp tensor")
  end)
end)
