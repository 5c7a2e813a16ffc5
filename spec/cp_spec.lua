-- Context parallelism (gdp.cp): headwise all-to-all (GDPContextParallel) and chunkwise
-- state passing (gdp_chunkwise_context_parallel), against the cp = 1 layer and operator
-- on the same global batch.  Real processes: run under mpirun (./gdp test runs the #mpi
-- specs with -np 2 and -np 4); without mpirun the world is one rank and every case
-- still runs (at cp = 1).  Every rank builds the global batch from the same seed,
-- runs the cp = 1 reference itself, and checks its own shard; the verdict of each case
-- is agreed over the group (group:check), so a failure on one rank fails the case on
-- all ranks instead of leaving them waiting in the next collective.
local gdp = require("gdp")
local nn = require("gdp.nn")
local cp = require("gdp.cp")
local shard = cp.shard
local H = gdp_test
local cp_cases = require("cp_cases")

local group = gdp.comm.world()
local P, RANK = group:size(), group:rank()
local cumsum = cp_cases.cumsum
local function expect_rows(rows, tol, label)
  assert.is_true(cp_cases.agree_rows(group, rows, tol, label, H.seed))
end
local function boundary_lengths(Lc) return cp_cases.boundary_lengths(P, Lc) end
local function describe_case(c) return cp_cases.describe_case(c, "f64") end
local TOL = { f64 = 1e-10, f32 = 1e-4 }
-- Several ranks share few cores (CI: 4 ranks on 2): one thread per rank, or BLAS and
-- OpenMP threads oversubscribe the cores and every collective waits (7x slower).
if P > 1 then gdp.device("cpu"):set_num_threads(1) end


local function rel(a, b) return H.rel_error(a, b) end


-- Runs fn on every rank, expects an error on every rank whose text has all needles,
-- then checks that the group still works.
local function expect_error_everywhere(fn, ...)
  local ok, err = pcall(fn)
  local text = tostring(err)
  local missing
  for i = 1, select("#", ...) do
    local needle = select(i, ...)
    if not text:find(needle, 1, true) then missing = needle end
  end
  local good = (not ok) and missing == nil
  group:check(good, string.format("rank %d: expected an error mentioning %q, got %s", RANK,
                                  tostring(missing), ok and "success" or text))
  -- the group is still in step: one more collective gives everyone's rank
  local ranks = group:allgather(gdp.tensor({ RANK }, { 1 }, { dtype = "f64" })):flat()
  for r = 1, P do assert.are.equal(r - 1, ranks[r]) end
  H.assert_alive()
  return text
end

------------------------------------------------------------------------------- the layer

-- Builds the cp = 1 layer and the CP layer from one seed, runs both on the global batch
-- (each rank its shard), returns rows {name, err} for out, dx, every parameter gradient
-- and the gathered output.
local function layer_rows(mode, c)
  local cfg = {
    hidden_size = c.hidden or 8, num_heads = c.nh or 4, head_dim = c.P or 3, num_groups = c.ng or 1,
    state_dim = c.N or 4, num_householder = c.M or 2, D = c.D or false, dtype = c.dtype or "f64",
    seed = c.seed or 5, allow_neg_eigval = c.neg or false, conv_bias = c.conv_bias ~= false,
  }
  local ref = nn.GatedDeltaProduct(cfg)
  cfg.cp_mode, cfg.cp_group, cfg.cp_layout = mode, group, c.layout
  local m = nn.GatedDeltaProduct(cfg)
  local cu = c.lengths and cumsum(c.lengths) or nil
  local T = cu and cu[#cu] or c.T
  local B = cu and 1 or (c.B or 2)
  H.reseed(c.salt or 0)
  local x = gdp.randn({ T, B, cfg.hidden_size }, { dtype = cfg.dtype })
  local dy = gdp.randn({ T, B, cfg.hidden_size }, { dtype = cfg.dtype })
  local out_ref = ref:forward(x, cu)
  local dx_ref = ref:backward(x, dy, cu)
  local sopts = { layout = m.cp_layout, cu_seqlens = cu }
  local xl = shard.split(x, P, RANK, sopts)
  local out = m:forward(xl, cu)
  local dx = m:backward(xl, shard.split(dy, P, RANK, sopts), cu)
  local rows = {
    { name = "out", err = rel(out, shard.split(out_ref, P, RANK, sopts)) },
    { name = "dx", err = rel(dx, shard.split(dx_ref, P, RANK, sopts)) },
    { name = "out (gathered)", err = rel(shard.gather(out, group, sopts), out_ref) },
  }
  for _, name in ipairs(m:parameter_names()) do
    rows[#rows + 1] = { name = "grad " .. name, err = rel(m:gradients()[name], ref:gradients()[name]) }
  end
  assert.is_true(out_ref:norm() > 0 and dx_ref:norm() > 0)
  return rows
end


-- Random packings: n sequences (some empty) cutting T tokens at random points.
local function random_lengths(T, n, multiple)
  local units = T / multiple
  local cuts = {}
  for i = 1, n - 1 do cuts[i] = math.random(0, units) end
  table.sort(cuts)
  local lengths, prev = {}, 0
  for _, c in ipairs(cuts) do
    lengths[#lengths + 1] = (c - prev) * multiple
    prev = c
  end
  lengths[#lengths + 1] = (units - prev) * multiple
  return lengths
end


describe("cp metadata and sharding #mpi", function()
  it("packed_sequence_cp_metadata reproduces docs/design.md's example (lengths [5,4,7], cp 4)", function()
    local want = { { 0, 2, { 0, 4 } }, { 0, 3, { 0, 1, 4 } }, { 1, 4, { 0, 1, 4 } }, { 2, 4, { 0, 4 } } }
    for r = 0, 3 do
      local meta = cp.packed_sequence_cp_metadata({ 0, 5, 9, 16 }, 4, r)
      assert.are.same({ want[r + 1][1], want[r + 1][2] }, { meta.preceding_rank_start, meta.following_rank_stop })
      -- docs/design.md lists (p, f); the seeds' test convention is (p, f - 1)
      assert.are.same(({ { 0, 1 }, { 0, 2 }, { 1, 3 }, { 2, 3 } })[r + 1],
                      { meta.preceding_rank_start, meta.following_rank_stop - 1 })
      assert.are.same(want[r + 1][3], meta.local_cu_seqlens)
    end
  end)

  it("metadata agrees with token ownership on random packings", function()
    math.randomseed(H.seed)
    for _ = 1, 200 do
      local ncp = math.random(1, 6)
      local Lc = math.random(1, 7)
      local lengths = random_lengths(ncp * Lc, math.random(1, 6), 1)
      local cu = cumsum(lengths)
      local seq_of = {}
      for s = 1, #cu - 1 do for t = cu[s], cu[s + 1] - 1 do seq_of[t] = s end end
      for r = 0, ncp - 1 do
        local meta = cp.packed_sequence_cp_metadata(cu, ncp, r)
        local p, f = meta.preceding_rank_start, meta.following_rank_stop
        assert.is_true(0 <= p and p <= r and r < f and f <= ncp)
        local a, b = r * Lc, (r + 1) * Lc - 1
        -- p: the rank of the first token of my first sequence; f - 1: of my last one's last
        assert.are.equal(math.floor(cu[seq_of[a]] / Lc), p)
        assert.are.equal(math.floor((cu[seq_of[b] + 1] - 1) / Lc) + 1, f)
        -- local boundaries: one per sequence touching the shard, ending at Lc
        local lcu = meta.local_cu_seqlens
        assert.are.equal(0, lcu[1])
        assert.are.equal(Lc, lcu[#lcu])
        local touching = 0
        for s = 1, #cu - 1 do
          if cu[s + 1] > cu[s] and cu[s] <= b and cu[s + 1] > a then touching = touching + 1 end
        end
        assert.are.equal(touching, #lcu - 1)
        assert.are.equal(a - cu[seq_of[a]], meta.tokens_before)
      end
    end
  end)

  it("zigzag order: natural chunk i sits at gathered index 2i (i < cp) or 4cp-2i-1", function()
    for ncp = 1, 4 do
      local c = 3
      local T = 2 * ncp * c
      local x = gdp.arange(0, T, 1, { dtype = "f64" }):view(T, 1)
      local gathered = shard.redo_order(x, ncp, { layout = "zigzag" })
      local vals = gathered:flat()
      for i = 0, 2 * ncp - 1 do
        local gi = i < ncp and 2 * i or 4 * ncp - 2 * i - 1
        assert.are.equal(i * c, vals[gi * c + 1])
      end
      assert.are.same(x:flat(), shard.undo_order(gathered, ncp, { layout = "zigzag" }):flat())
    end
  end)

  it("split and gather round trip (contiguous, zigzag, packed zigzag with empty sequences)", function()
    H.reseed(1)
    local cases = {
      { layout = "contiguous", T = 6 * P },
      { layout = "zigzag", T = 4 * P },
      { layout = "zigzag", lengths = { 2 * P, 0, 6 * P, 0, 4 * P } },
    }
    local rows = {}
    for i, c in ipairs(cases) do
      local cu = c.lengths and cumsum(c.lengths)
      local T = cu and cu[#cu] or c.T
      local x = gdp.randn({ T, cu and 1 or 2, 3 }, { dtype = "f64" })
      local opts = { layout = c.layout, cu_seqlens = cu }
      local xl = shard.split(x, P, RANK, opts)
      assert.are.equal(T / P, xl:size(1))
      rows[#rows + 1] = { name = "case " .. i, err = rel(shard.gather(xl, group, opts), x) }
    end
    expect_rows(rows, 0, "split/gather")
  end)

  it("conv halo: the previous ranks' last W-1 tokens, cut at sequence starts", function()
    for _, Lc in ipairs({ 5, 2, 1 }) do
      local T = Lc * P
      local x = gdp.arange(1, T + 1, 1, { dtype = "f64" }):view(T, 1, 1)
      local xl = shard.split(x, P, RANK)
      local R = 3
      local rows = {}
      for _, valid in ipairs({ math.min(R, RANK * Lc), math.min(R, RANK * Lc, 1) }) do
        local halo = cp.conv_halo_exchange(group, xl, R, valid)
        if valid == 0 then
          assert.is_nil(halo)
        else
          rows[#rows + 1] = { name = "halo Lc " .. Lc, err = rel(halo, x:narrow(1, RANK * Lc - valid + 1, valid)) }
        end
      end
      if #rows == 0 then rows[1] = { name = "none", err = 0 } end
      expect_rows(rows, 0, "conv halo")
    end
  end)
end)

------------------------------------------------------------------------------- operator level

describe("gdp_chunkwise_context_parallel vs the cp = 1 operator #mpi", function()
  local function run(c)
    local n, dtype = c.n or 2, c.dtype or "f64"
    local cu = c.lengths and cumsum(c.lengths)
    local T = cu and cu[#cu] or c.T
    H.reseed(c.salt or 3)
    local args = gdp.ops.random_inputs{ B = cu and 1 or 2, T = T, H = 2, K = 5, V = 3, n = n,
                                        dtype = dtype, cu_seqlens = cu, grads = true }
    args.dht, args.output_final_state = nil, false
    local o_ref = gdp.ops.chunk_gated_delta_product(args)
    local g_ref = gdp.ops.chunk_gated_delta_product_backward(args)
    local meta = cu and cp.packed_sequence_cp_metadata(cu, P, RANK) or cp.unpacked_cp_metadata(T / P, P, RANK)
    local Lc, a = meta.local_len, meta.shard_start
    local function tok(x, mult) return x:narrow(2, mult * a + 1, mult * Lc) end
    local o, saved = cp.gdp_chunkwise_context_parallel(tok(args.q, 1), tok(args.k, n), tok(args.v, n),
      tok(args.g, 1), tok(args.beta, n), meta.local_cu_seqlens, n, nil, group, cp.cpu_backend(),
      meta.preceding_rank_start, meta.following_rank_stop, { use_qk_l2norm_in_kernel = true })
    local g = saved:backward(tok(args["do"], 1))
    expect_rows({
      { name = "o", err = rel(o, tok(o_ref, 1)) },
      { name = "dq", err = rel(g.dq, tok(g_ref.dq, 1)) },
      { name = "dk", err = rel(g.dk, tok(g_ref.dk, n)) },
      { name = "dv", err = rel(g.dv, tok(g_ref.dv, n)) },
      { name = "dg", err = rel(g.dg, tok(g_ref.dg, 1)) },
      { name = "dbeta", err = rel(g.dbeta, tok(g_ref.dbeta, n)) },
    }, TOL[dtype], "chunkwise operator")
  end

  local cases = {
    { lengths = { 5, 4, 7 }, n = 2 },
    { lengths = { 5, 4, 7 }, n = 3, dtype = "f32" },
    { T = 20 * P, n = 1 },
    { T = 30 * P, n = 3, dtype = "f32" },
    { lengths = boundary_lengths(6), n = 2 },
    { lengths = { 37 * P, 0, 13 * P, 30 * P }, n = 3 }, -- crosses 64-step chunks
  }
  for i, c in ipairs(cases) do
    local T = c.lengths and cumsum(c.lengths)[#c.lengths + 1] or c.T
    it(string.format("%s n=%d %s", c.lengths and ("lengths [" .. table.concat(c.lengths, ",") .. "]")
                     or ("T " .. c.T .. " x B 2"), c.n, c.dtype or "f64"), function()
      if T % P ~= 0 then pending("token count not divisible by " .. P) return end
      c.salt = 10 + i
      run(c)
    end)
  end
end)

describe("GDPContextParallel all-to-alls #mpi", function()
  -- <pre(x), y> == <x, pre_backward(y)> summed over ranks (and the same for post): the
  -- backward is the adjoint of the forward, whatever the layout, groups or packing.
  local configs = {
    { nh = 4, ng = 1, M = 2, layout = "zigzag", lengths = { 2 * P, 0, 4 * P } },
    { nh = 4, ng = 4, M = 3, layout = "contiguous", lengths = { 3, P * 4 - 3 } },
    { nh = 8, ng = 2, M = 1, layout = "zigzag", T = 2 * P },
  }
  for i, c in ipairs(configs) do
    it(string.format("pre/post_conv_ssm backward is the adjoint (nh %d, ng %d, M %d, %s)",
                     c.nh, c.ng, c.M, c.layout), function()
      if c.nh % P ~= 0 or (c.ng < P and P % c.ng ~= 0) or (c.ng >= P and c.ng % P ~= 0) then
        pending("heads/groups do not divide over " .. P .. " ranks")
        return
      end
      local N, Pd = 2, 3
      local hcp = cp.GDPContextParallel(group, c.nh * Pd, c.nh, c.ng, N, c.M, Pd, nil, nil, nil, nil,
                                        false, { layout = c.layout })
      local cu = c.lengths and cumsum(c.lengths)
      local T = cu and cu[#cu] or c.T
      local Bn = cu and 1 or 2
      H.reseed(40 + i)
      local width = hcp.off.width
      local x = gdp.randn({ T / P, Bn, width }, { dtype = "f64" })
      local sums = {}
      for _, skip_z in ipairs({ false, true }) do
        local y = hcp:pre_conv_ssm(x, { cu_seqlens = cu, skip_z = skip_z })
        local w = gdp.randn(y:shape(), { dtype = "f64" })
        local xb = hcp:pre_conv_ssm_backward(w, { cu_seqlens = cu, skip_z = skip_z })
        sums[#sums + 1] = y:dot(w) - x:dot(xb)
      end
      local yh = gdp.randn({ T, Bn, 5 }, { dtype = "f64" })
      local ys = hcp:post_conv_ssm(yh, { cu_seqlens = cu })
      assert.are.same({ T / P, Bn, 5 * P }, ys:shape())
      local v = gdp.randn(ys:shape(), { dtype = "f64" })
      sums[#sums + 1] = ys:dot(v) - yh:dot(hcp:post_conv_ssm_backward(v, { cu_seqlens = cu }))
      local t = group:all_reduce(gdp.tensor(sums, { #sums }, { dtype = "f64" }), "sum")
      local rows = {}
      for j, d in ipairs(t:flat()) do rows[j] = { name = "adjoint " .. j, err = math.abs(d) } end
      expect_rows(rows, 1e-9, "adjoint")
    end)
  end

  it("pre_conv_ssm gives this rank's heads of every Householder copy, natural order", function()
    if 4 % P ~= 0 then pending("4 heads over " .. P .. " ranks") return end
    local nh, ng, N, Pd, Mh = 4, 1, 2, 2, 2
    local hcp = cp.GDPContextParallel{ cp_group = group, d_inner_local_tp = nh * Pd, nheads_local_tp = nh,
                                       ngroups_local_tp = ng, d_state = N, num_householder = Mh,
                                       headdim = Pd }
    local T = 2 * P
    H.reseed(50)
    local zx = gdp.randn({ T, 1, hcp.off.width }, { dtype = "f64" })
    local y = hcp:pre_conv_ssm(shard.split(zx, P, RANK, { layout = "zigzag" }))
    local dl = nh * Pd / P
    local rows = {}
    for m = 0, Mh - 1 do
      local want = zx:narrow(3, hcp.off.V + m * nh * Pd + RANK * dl + 1, dl)
      rows[#rows + 1] = { name = "V copy " .. m, err = rel(y:narrow(3, dl + m * dl + 1, dl), want) }
    end
    expect_rows(rows, 0, "pre_conv_ssm")
  end)
end)

------------------------------------------------------------------------------- layer equivalence

describe("nn.GatedDeltaProduct with cp_mode = \"chunkwise\" equals cp = 1 #mpi", function()
  local cases = {
    { T = 13 * P, B = 2, M = 2, ng = 1 },
    { lengths = { 5, 4, 7 }, M = 3, ng = 2, D = "head" },
    { lengths = { 5, 4, 7 }, M = 1, ng = 4, D = "channel", dtype = "f32" },
    { lengths = boundary_lengths(6), M = 2, ng = 1, D = "channel" },
    { lengths = { 1, 2, 0, 1 }, M = 2, ng = 2 },                         -- T/cp < W-1: halo over ranks
    { lengths = { 37 * P, 11 * P, 0, 16 * P }, M = 3, ng = 1, D = "head" }, -- crosses 64-step chunks
    { lengths = { 37 * P, 11 * P, 0, 16 * P }, M = 2, ng = 4, dtype = "f32" },
    { lengths = { 3 * P, 5 * P }, M = 2, ng = 2, conv_bias = false, neg = true },
  }
  math.randomseed(H.seed + 7)
  for k = 1, 3 do
    local Lc = math.random(2, 9)
    cases[#cases + 1] = { lengths = random_lengths(Lc * P, math.random(1, 5), 1), M = math.random(1, 3),
                          ng = ({ 1, 2, 4 })[math.random(1, 3)], D = ({ false, "head", "channel" })[math.random(1, 3)],
                          dtype = k == 3 and "f32" or "f64", random = true }
  end
  for i, c in ipairs(cases) do
    it(describe_case(c) .. (c.random and " (random packing)" or ""), function()
      local T = c.lengths and cumsum(c.lengths)[#c.lengths + 1] or c.T
      if T % P ~= 0 then pending("token count not divisible by " .. P) return end
      c.salt = 100 + i
      expect_rows(layer_rows("chunkwise", c), TOL[c.dtype or "f64"], "chunkwise layer " .. i)
    end)
  end
end)

describe("nn.GatedDeltaProduct with cp_mode = \"headwise\" equals cp = 1 #mpi", function()
  local Z = 2 * P -- zigzag unit
  local cases = {
    { T = 3 * Z, B = 2, M = 2, ng = 1, layout = "zigzag" },                          -- ng < cp
    { lengths = { 2 * Z, 0, Z, 3 * Z }, M = 3, ng = 4, D = "head", layout = "zigzag" }, -- ng >= cp
    { lengths = { 2 * Z, 0, Z, 3 * Z }, M = 1, ng = 2, D = "channel", layout = "zigzag", dtype = "f32" },
    { lengths = { 5, 4, 7 }, M = 2, ng = 2, D = "channel", layout = "contiguous" },
    { T = 5 * P, B = 2, M = 3, ng = 1, layout = "contiguous", dtype = "f32" },
    { lengths = { 12 * Z, 5 * Z }, M = 3, ng = 1, D = "head", layout = "zigzag" },   -- crosses 64-step chunks
    { lengths = { Z, 2 * Z }, M = 2, ng = 2, conv_bias = false, neg = true, layout = "zigzag" },
  }
  math.randomseed(H.seed + 11)
  for k = 1, 3 do
    cases[#cases + 1] = { lengths = random_lengths(Z * math.random(1, 5), math.random(1, 4), Z),
                          M = math.random(1, 3), ng = ({ 1, 2, 4 })[math.random(1, 3)],
                          D = ({ false, "head", "channel" })[math.random(1, 3)], layout = "zigzag",
                          dtype = k == 3 and "f32" or "f64", random = true }
  end
  for i, c in ipairs(cases) do
    it(describe_case(c) .. (c.random and " (random packing)" or ""), function()
      local T = c.lengths and cumsum(c.lengths)[#c.lengths + 1] or c.T
      local ng = c.ng or 1
      if 4 % P ~= 0 or T % P ~= 0 or (ng < P and P % ng ~= 0) or (ng >= P and ng % P ~= 0) then
        pending("heads, groups or tokens do not divide over " .. P .. " ranks")
        return
      end
      c.salt = 200 + i
      expect_rows(layer_rows("headwise", c), TOL[c.dtype or "f64"], "headwise layer " .. i)
    end)
  end
end)

------------------------------------------------------------------------------- bad input

describe("bad input is an error on every rank, never a hang #mpi", function()
  local function layer(cfg)
    local base = { hidden_size = 8, num_heads = 2 * P, head_dim = 2, num_groups = 1, state_dim = 2,
                   num_householder = 2, dtype = "f64", seed = 1, cp_group = group }
    for k, v in pairs(cfg) do base[k] = v end
    return nn.GatedDeltaProduct(base)
  end

  it("headwise: heads not divisible by cp", function()
    if P == 1 then pending("needs cp > 1") return end
    expect_error_everywhere(function() layer{ cp_mode = "headwise", num_heads = P + 1 } end,
                            "not divisible by the cp size")
  end)

  it("headwise: groups neither a multiple nor a divisor of cp", function()
    if P == 1 then pending("needs cp > 1") return end
    -- P + 1 groups: more than cp, and not a multiple of it
    expect_error_everywhere(function()
      layer{ cp_mode = "headwise", num_heads = P * (P + 1), num_groups = P + 1 }
    end, "ngroups_local_tp = " .. (P + 1))
  end)

  it("headwise zigzag: a sequence length not divisible by 2*cp", function()
    if P == 1 then pending("needs cp > 1") return end
    local m = layer{ cp_mode = "headwise" }
    local cu = { 0, 2 * P + 1, 4 * P }
    local x = gdp.randn({ 4, 1, 8 }, { dtype = "f64" })
    expect_error_everywhere(function() m:forward(x, cu) end, "not divisible by 2*cp")
  end)

  it("cu_seqlens missing on some ranks only (packed input)", function()
    if P == 1 then pending("needs cp > 1") return end
    for _, mode in ipairs({ "headwise", "chunkwise" }) do
      local m = layer{ cp_mode = mode }
      local x = gdp.randn({ 4, 1, 8 }, { dtype = "f64" })
      expect_error_everywhere(function() m:forward(x, RANK == 0 and { 0, 4 * P } or nil) end, "cu_seqlens")
    end
  end)

  it("a bad local input on one rank only", function()
    for _, mode in ipairs({ "headwise", "chunkwise" }) do
      local m = layer{ cp_mode = mode }
      local x = gdp.randn({ 4, 1, RANK == P - 1 and 7 or 8 }, { dtype = "f64" })
      expect_error_everywhere(function() m:forward(x) end, "x: expected")
    end
  end)

  it("a bad dy on one rank only, in the layer backward", function()
    for _, mode in ipairs({ "headwise", "chunkwise" }) do
      local m = layer{ cp_mode = mode }
      local x = gdp.randn({ 4, 1, 8 }, { dtype = "f64" })
      m:forward(x)
      local bad_shape = gdp.randn({ 4, 1, RANK == P - 1 and 7 or 8 }, { dtype = "f64" })
      expect_error_everywhere(function() m:backward(x, bad_shape) end, "dy: expected the shape of x")
      local bad_dtype = gdp.randn({ 4, 1, 8 }, { dtype = RANK == P - 1 and "f32" or "f64" })
      expect_error_everywhere(function() m:backward(x, bad_dtype) end, "dy: expected dtype f64")
    end
  end)

  it("x written in place on one rank only: every rank recomputes the forward", function()
    for _, mode in ipairs({ "headwise", "chunkwise" }) do
      local m = layer{ cp_mode = mode }
      local x = gdp.randn({ 4, 1, 8 }, { dtype = "f64" })
      local dy = gdp.randn({ 4, 1, 8 }, { dtype = "f64" })
      m:forward(x)
      if RANK == P - 1 then x:narrow(1, 1, 1):fill(0.25) end
      local dx = m:backward(x, dy)
      local m2 = layer{ cp_mode = mode }
      local want = m2:backward(x, dy)
      local err = rel(dx, want)
      group:check(err <= 1e-13, string.format("%s: rank %d: dx off by %.3e", mode, RANK, err))
    end
  end)

  it("a configuration field that differs on one rank is named", function()
    if P == 1 then pending("needs cp > 1") return end
    for _, mode in ipairs({ "headwise", "chunkwise" }) do
      expect_error_everywhere(function()
        layer{ cp_mode = mode, cp_reduce_grads = RANK ~= P - 1 }
      end, "configuration differs across ranks: cp_reduce_grads")
      expect_error_everywhere(function()
        layer{ cp_mode = mode, norm_eps = RANK == P - 1 and 1e-6 or 1e-5 }
      end, "configuration differs across ranks: norm_eps")
    end
  end)

  it("conv halo exchange: x of another shape on one rank", function()
    if P == 1 then pending("needs cp > 1") return end
    local x = gdp.randn({ RANK == P - 1 and 3 or 4, 1, 2 }, { dtype = "f64" })
    expect_error_everywhere(function() cp.conv_halo_exchange(group, x, 3, RANK == 0 and 0 or 3) end,
                            "differ across ranks")
  end)

  it("chunkwise: packed token count not divisible by cp", function()
    if P == 1 then pending("needs cp > 1") return end
    local m = layer{ cp_mode = "chunkwise" }
    local x = gdp.randn({ 3, 1, 8 }, { dtype = "f64" })
    expect_error_everywhere(function() m:forward(x, { 0, 3 * P + 1 }) end, "cu_seqlens")
  end)

  local function op_inputs()
    local args = gdp.ops.random_inputs{ B = 1, T = 4, H = 1, K = 2, V = 2, n = 1, dtype = "f64", grads = true }
    return args
  end

  it("chunkwise: p/f out of bounds on one rank", function()
    local a = op_inputs()
    expect_error_everywhere(function()
      cp.gdp_chunkwise_context_parallel(a.q, a.k, a.v, a.g, a.beta, { 0, 4 }, 1, nil, group, nil,
                                        RANK == 0 and 1 or 0, P)
    end, "expected 0 <= p <= rank < f <= cp")
  end)

  it("chunkwise: p/f inconsistent between ranks", function()
    if P == 1 then pending("needs cp > 1") return end
    local a = op_inputs()
    -- rank 0 says its last sequence goes on to rank 1; rank 1 says its first starts on itself
    expect_error_everywhere(function()
      cp.gdp_chunkwise_context_parallel(a.q, a.k, a.v, a.g, a.beta, { 0, 4 }, 1, nil, group, nil,
                                        RANK, RANK == 0 and 2 or RANK + 1)
    end, "inconsistent sequence spans")
  end)

  it("chunkwise: wrong d_o shape in the backward on one rank", function()
    local a = op_inputs()
    local _, saved = cp.gdp_chunkwise_context_parallel(a.q, a.k, a.v, a.g, a.beta, nil, 1, nil, group, nil,
                                                       0, P)
    local d_o = RANK == 0 and gdp.randn({ 1, 3, 1, 2 }, { dtype = "f64" }) or a["do"]
    expect_error_everywhere(function() saved:backward(d_o) end, "d_o: expected the shape of o")
  end)
end)

------------------------------------------------------------------------------- backend runs

-- The chunkwise backend's runs per stage, counted by wrapping gdp.ops on one process: no
-- rank runs the operator after the forward all-gather (a start that reaches it is added
-- as O S_in from its first sequence's transition, which unpacked is part of the local
-- run and packed a run of its own), and the backward summary runs only
-- the dh0 pass (its M^T is that forward transition), whatever the rank's position; no
-- rank runs the backward twice.
describe("chunkwise backend: what runs after the all-gathers", function()
  local ops = gdp.ops
  local T, Hh, K, V, n = 12, 2, 4, 3, 2
  local B = 1
  local function inputs(need_fwd, need_bwd)
    local function r(...) return gdp.randn({ ... }, { dtype = "f64" }) end
    return {
      q = r(B, T, Hh, K), k = r(B, n * T, Hh, K), v = r(B, n * T, Hh, V),
      g = gdp.rand({ B, T, Hh }, { dtype = "f64" }):scale_(-0.1), beta = gdp.rand({ B, n * T, Hh }, { dtype = "f64" }),
      num_householder = n, scale = 0.5, use_qk_l2norm_in_kernel = true,
      need_forward_summary = need_fwd, need_backward_summary = need_bwd,
    }
  end
  local function counting(fn)
    local names = { "chunk_gated_delta_product", "chunk_gated_delta_product_backward",
                    "chunk_gated_delta_product_dh0" }
    local saved, counts = {}, {}
    for _, name in ipairs(names) do
      saved[name], counts[name] = ops[name], 0
      ops[name] = function(...)
        counts[name] = counts[name] + 1
        return saved[name](...)
      end
    end
    local ok, err = pcall(fn, counts)
    for _, name in ipairs(names) do ops[name] = saved[name] end
    assert(ok, err)
  end
  -- last rank (no forward summary read), first rank (nothing reaches it), a middle rank
  -- (also with two batch columns: their starts' outputs are one batched product each)
  for _, c in ipairs({ { false, true, "last" }, { true, false, "first" }, { true, true, "middle" },
                       { true, true, "middle (B = 2)", 2 } }) do
    it(string.format("%s rank: forward runs before the all-gather only, o = the run from S_in", c[3]), function()
      gdp.manual_seed(H.seed)
      B = c[4] or 1
      local inp = inputs(c[1], c[2])
      local backend = cp.cpu_backend()
      counting(function(counts)
        local _, ctx = backend:forward_prepare(inp)
        local before = counts.chunk_gated_delta_product
        -- one run: unpacked, the transition (where a start reaches the rank) rides along
        -- on K more value columns of the local run
        assert.are.equal(1, before, "operator runs before the all-gather")
        local S_in = gdp.randn({ 1, B, Hh, K, V + K }, { dtype = "f64" })
        local preceding = c[2] and S_in or S_in:narrow(1, 1, 0)
        local o, saved = backend:forward_apply(ctx, preceding)
        assert.are.equal(before, counts.chunk_gated_delta_product)
        -- the reference: one run from S_in (zero where nothing reaches the rank)
        local h0 = c[2] and S_in:select(1, 1):narrow(4, 1, V):contiguous() or nil
        local want = ops.chunk_gated_delta_product({
          q = inp.q, k = inp.k, v = inp.v, g = inp.g, beta = inp.beta, num_householder = n,
          scale = 0.5, use_qk_l2norm_in_kernel = true, initial_state = h0 })
        assert.is_true(rel(o, want) < 1e-12, "o differs from the run from S_in: " .. rel(o, want))
        local fwd_runs = counts.chunk_gated_delta_product
        local d_o = gdp.randn({ B, T, Hh, V }, { dtype = "f64" })
        local summary, bwd_ctx = backend:backward_prepare(d_o, saved)
        assert.are.equal(fwd_runs, counts.chunk_gated_delta_product)
        -- the dh0 pass where a start reaches the rank, the backward after the all-gather
        -- (also on the last rank: run here, it would hold up the others' backward)
        assert.are.equal(c[2] and 1 or 0, counts.chunk_gated_delta_product_dh0)
        assert.are.equal(0, counts.chunk_gated_delta_product_backward)
        if c[2] then
          local dh0 = ops.chunk_gated_delta_product_dh0({
            q = inp.q, k = inp.k, v = inp.v, g = inp.g, beta = inp.beta, num_householder = n,
            scale = 0.5, use_qk_l2norm_in_kernel = true, ["do"] = d_o })
          local gamma = summary:narrow(4, 1, V)
          assert.is_true(rel(gamma, dh0) < 1e-12, "gamma differs from the dh0 pass: " .. rel(gamma, dh0))
        end
        local grads = backend:backward_apply(bwd_ctx, summary:narrow(1, 1, 0):view(0, B, Hh, K, V + K))
        assert.are.equal(1, counts.chunk_gated_delta_product_backward)
        assert.is_not_nil(grads.dq)
      end)
    end)
  end

  -- packed, a start reaching the first of two local sequences and the last going on: the
  -- last sequence starts here, so no one reads this rank's M and none is computed
  it("packed middle rank: two runs before the all-gather, M left zero, o = the run from S_in", function()
    gdp.manual_seed(H.seed)
    B = 1
    local inp = inputs(true, true)
    inp.cu_seqlens = { 0, 5, T }
    local backend = cp.cpu_backend()
    counting(function(counts)
      local summary, ctx = backend:forward_prepare(inp)
      assert.are.equal(2, counts.chunk_gated_delta_product, "operator runs before the all-gather")
      assert.are.equal(0, summary:narrow(4, V + 1, K):norm())
      local S_in = gdp.randn({ 1, 1, Hh, K, V + K }, { dtype = "f64" })
      local o = backend:forward_apply(ctx, S_in)
      assert.are.equal(2, counts.chunk_gated_delta_product)
      local h0 = gdp.zeros({ 2, Hh, K, V }, { dtype = "f64" })
      h0:select(1, 1):copy(S_in:select(1, 1):select(1, 1):narrow(3, 1, V))
      local want, ht = ops.chunk_gated_delta_product({
        q = inp.q, k = inp.k, v = inp.v, g = inp.g, beta = inp.beta, num_householder = n,
        scale = 0.5, use_qk_l2norm_in_kernel = true, cu_seqlens = inp.cu_seqlens, initial_state = h0,
        output_final_state = true })
      assert.is_true(rel(o, want) < 1e-12, "o differs from the run from S_in: " .. rel(o, want))
      -- dS: the last sequence's final state from zero, which S_in does not reach
      local dS = summary:select(1, 1):narrow(3, 1, V)
      assert.is_true(rel(dS, ht:select(1, 2)) < 1e-12, "dS differs: " .. rel(dS, ht:select(1, 2)))
    end)
  end)

  -- The compositions against one 2-D product per batch column and head: summaries
  -- [np, Nb, H, K, V+K] with S <- M_j S + dS_j over j = 2..np (prefix) or dS <- M_j dS +
  -- gamma_j over j = np-1..1 (suffix).
  local function per_head(summaries, Vv, Kk, suffix)
    local np = summaries:size(1)
    local first, last, step = 2, np, 1
    if suffix then first, last, step = np - 1, 1, -1 end
    local S = summaries:select(1, suffix and np or 1):narrow(4, 1, Vv):clone()
    for j = first, last, step do
      local sj = summaries:select(1, j)
      local S_new = sj:narrow(4, 1, Vv):clone()
      for b = 1, S:size(1) do
        for h = 1, S:size(2) do
          gdp.matmul(sj:select(1, b):select(1, h):narrow(2, Vv + 1, Kk), S:select(1, b):select(1, h),
                     { out = S_new:select(1, b):select(1, h), beta = 1 })
        end
      end
      S = S_new
    end
    return S
  end
  -- Nb = 1 and 3 batch columns, contiguous summaries (every head of every column in one
  -- batched product) and summaries whose columns do not merge with the heads (one per column)
  local function summaries_cases(dtype)
    local Vv, Kk, Hn = 5, 4, 3
    local cases = {}
    for _, nb in ipairs({ 1, 3 }) do
      cases[#cases + 1] = { gdp.randn({ 4, nb, Hn, Kk, Vv + Kk }, { dtype = dtype }), nb .. " column(s), contiguous" }
      cases[#cases + 1] = { gdp.randn({ 4, Hn, nb, Kk, Vv + Kk }, { dtype = dtype }):transpose(2, 3),
                            nb .. " column(s), heads outside the columns" }
    end
    return cases, Vv, Kk
  end

  it("compose_prefix and compose_suffix equal the per-head products", function()
    H.reseed(81)
    for _, dtype in ipairs({ "f64", "f32" }) do
      local cases, Vv, Kk = summaries_cases(dtype)
      for _, c in ipairs(cases) do
        -- the cpu runs the same 2-D products per head, batched or not: the same bits
        assert.are.equal(0, rel(cp.chunkwise.compose_prefix(c[1], Vv, Kk), per_head(c[1], Vv, Kk, false)),
                         dtype .. " prefix, " .. c[2])
        assert.are.equal(0, rel(cp.chunkwise.compose_suffix(c[1], Vv, Kk), per_head(c[1], Vv, Kk, true)),
                         dtype .. " suffix, " .. c[2])
      end
    end
  end)

  it("compose_prefix and compose_suffix on cuda equal the cpu's #gpu", function()
    if not H.need_device("cuda") then return end
    H.reseed(82)
    for _, dtype in ipairs({ "f64", "f32" }) do
      local cases, Vv, Kk = summaries_cases(dtype)
      local tol = dtype == "f64" and 1e-12 or 1e-5
      for _, c in ipairs(cases) do
        -- the same view of a device copy of the summaries' base
        local d = c[1]:is_contiguous() and c[1]:cuda() or c[1]:transpose(2, 3):cuda():transpose(2, 3)
        for _, suffix in ipairs({ false, true }) do
          local fn = suffix and cp.chunkwise.compose_suffix or cp.chunkwise.compose_prefix
          assert.tensor_near(fn(d, Vv, Kk):cpu(), fn(c[1], Vv, Kk), tol,
                             string.format("%s %s, %s", dtype, suffix and "suffix" or "prefix", c[2]))
        end
      end
    end
  end)
end)
