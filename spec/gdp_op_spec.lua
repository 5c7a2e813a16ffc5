-- The GDP operator on every device: the case table (op_cases.lua) and the golden cases
-- (spec/fixtures/golden/gdp_*, float64 references made by independent implementations)
-- against float64, within ops.tolerance per dtype and tensor; the CUDA dispatch contract (which
-- algorithm takes which shape, chunk_size); and behaviour the table does not cover
-- (packing equals separate runs, fla's positional form).  cuda parts are tagged #gpu and
-- pending, with the reason, where the library sees no GPU.
local gdp = require("gdp")
local H = gdp_test
local ops = gdp.ops
local cases = require("op_cases")


local function same_bits(a, b, what)
  assert.are.same(a:cpu():totable(), b:cpu():totable(), what)
end

for _, dev in ipairs(H.DEVICES) do
  local device = dev.name

  describe("GDP operator case table on " .. device .. dev.tag, function()
    for _, case in ipairs(cases.gdp) do
      for _, dtype in ipairs(cases.dtypes(case, device)) do
        local runs = cases.gdp_runs(case, dtype, device)
        local names = {}
        for i, r in ipairs(runs) do names[i] = cases.run_label(r) end
        it(string.format("%s %s: %s", cases.label(case), dtype, table.concat(names, "; ")), function()
          if not H.need_device(device) then return end
          H.reseed(case.salt)
          local args = cases.gdp_inputs(case)
          local gate_dtype = cases.gate_dtype(case, dtype)
          local ref = cases.gdp_oracle(args, dtype, gate_dtype)
          assert.is_true(ref.o:norm() > 0 and ref.grads.dk:norm() > 0, "the oracle's results are zero")
          local plain = {}
          for i, run in ipairs(runs) do
            local what = names[i] .. ": "
            local o, ht, grads, bytes = cases.gdp_run(args, dtype, device, run, gate_dtype)
            assert.are.equal(dtype, o:dtype(), what .. "o's dtype")
            if grads.dg then assert.are.equal(gate_dtype, grads.dg:dtype(), what .. "dg's dtype") end
            local fast = run.algorithm ~= "recurrent" and cases.fast_path(case, dtype)
            local path = device == "cpu" and "chunked" or (fast and "fast chunked" or "recurrent")
            assert.are.equal(path, ops.last_path(device), what .. "gdp.ops.last_path")
            assert.truthy(o:device():find("^" .. device), what .. "o on " .. o:device())
            assert.tensor_near(o, ref.o, ops.tolerance(dtype, "o"), what .. "o")
            assert.tensor_near(ht, ref.ht, ops.tolerance(dtype, "ht"), what .. "ht")
            for _, name in ipairs(cases.GRADS) do
              if ref.grads[name] then
                assert.is_not_nil(grads[name], what .. name)
                assert.tensor_near(grads[name], ref.grads[name], ops.tolerance(dtype, name), what .. name)
              else
                assert.is_nil(grads[name], what .. name)
              end
            end
            if run.save then
              -- the fast path keeps its panels and states; everything else recomputes
              local keeps = device == "cuda" and run.algorithm ~= "recurrent" and cases.fast_path(case, dtype)
              if keeps then
                assert.is_true(bytes > 0, what .. "the fast path kept nothing")
              else
                assert.are.equal(0, bytes, what .. "saved bytes")
              end
            else
              plain[run.algorithm] = { o = o, grads = grads }
            end
          end
          -- where the fast path takes the shape, "auto" is that path: the same bits
          if plain.chunk and plain.auto then
            same_bits(plain.auto.o, plain.chunk.o, "auto vs chunk: o")
            for _, name in ipairs(cases.GRADS) do
              if plain.auto.grads[name] then
                same_bits(plain.auto.grads[name], plain.chunk.grads[name], "auto vs chunk: " .. name)
              end
            end
          end
        end)
      end
    end
  end)

  -- Golden cases: per device the dtypes and algorithms it has.  cpu: the oracle itself
  -- ("recurrent" computes in float64 whatever the dtype, so once) and the chunk kernels
  -- (bf16 computes in f32 under "auto"); its saving path recomputes, bit for bit
  -- (test_gdp_saved.c).  cuda: "auto" only (a golden shape outside the fast path makes
  -- "chunk" an error there), plain and saving.
  local golden_runs = {
    cpu = { { "f64", "recurrent" }, { "f64", "chunk" }, { "f32", "chunk" }, { "bf16", "auto" } },
    cuda = { { "f32", "auto" }, { "bf16", "auto" }, { "bf16", "auto", true } },
  }
  describe("golden cases on " .. device .. dev.tag, function()
    local files = H.list_files(H.golden_dir, "^gdp_.*%.safetensors$")
    if device == "cpu" then
      it("are present", function()
        assert.is_true(#files >= 8, "expected the 8 shipped gdp_*.safetensors in " .. H.golden_dir)
      end)
    end
    for _, file in ipairs(files) do
      for _, run in ipairs(golden_runs[device]) do
        local dtype, algorithm, save = run[1], run[2], run[3]
        it(string.format("%s %s %s%s", file:match("[^/]+$"), dtype, algorithm, save and ", saving" or ""), function()
          if not H.need_device(device) then return end
          local t, meta = gdp.load(file)
          local rows = ops.check_golden_case(t, meta, { dtype = dtype, algorithm = algorithm, device = device,
                                                        save_for_backward = save })
          assert.is_true(#rows >= 6)
          for _, r in ipairs(rows) do
            assert.is_true(r.ok, string.format("%s: %s rel error %.3e > %.0e", file, r.name, r.err, r.tol))
          end
        end)
      end
    end
  end)
end

-- The CUDA dispatch contract: "chunk" means the fast path and is an error naming its
-- shapes elsewhere ("auto" then runs the recurrent kernels); chunk_size is honoured or
-- rejected, never ignored (the fast path's chunk is fixed by n).
describe("cuda dispatch: algorithm and chunk_size #gpu", function()
  local outside = {
    { name = "bf16 K=V=64 n=9", dtype = "bf16", K = 64, V = 64, n = 9 },
    { name = "bf16 K=32 V=272 n=2", dtype = "bf16", K = 32, V = 272, n = 2 },
    { name = "bf16 K=256 V=272 n=3", dtype = "bf16", K = 256, V = 272, n = 3 },
    { name = "f32 K=V=64 n=2", dtype = "f32", K = 64, V = 64, n = 2 },
  }
  for i, s in ipairs(outside) do
    it("\"chunk\" outside the fast path is an error naming it; \"auto\" runs (" .. s.name .. ")", function()
      if not H.need_device("cuda") then return end
      H.reseed(2000 + i)
      local args = ops.random_inputs({ B = 1, T = 70, H = 2, K = s.K, V = s.V, n = s.n, grads = true,
                                       initial_state = true, cu_seqlens = { 0, 30, 30, 70 } })
      local dev = ops.convert_inputs(args, s.dtype, "cuda")
      dev.algorithm = "chunk"
      local text = H.expect_error(function() ops.chunk_gated_delta_product(dev) end, "chunk")
      io.stderr:write("  " .. s.name .. ", chunk: " .. text:gsub("\n.*", "") .. "\n")
      H.expect_error(function() ops.chunk_gated_delta_product_backward(dev) end, "chunk")
      dev.algorithm = "auto"
      local ref = cases.gdp_oracle(args, s.dtype)
      local o, ht = ops.chunk_gated_delta_product(dev)
      assert.tensor_near(o, ref.o, ops.tolerance(s.dtype, "o"))
      assert.tensor_near(ht, ref.ht, ops.tolerance(s.dtype, "ht"))
      local grads = ops.chunk_gated_delta_product_backward(dev)
      assert.tensor_near(grads.dk, ref.grads.dk, ops.tolerance(s.dtype, "dk"))
      assert.tensor_near(grads.dg, ref.grads.dg, ops.tolerance(s.dtype, "dg"))
    end)
  end

  it("a chunk_size the fast path does not take is an error naming chunk_size", function()
    if not H.need_device("cuda") then return end
    H.reseed(2010)
    local args = ops.random_inputs({ B = 1, T = 70, H = 2, K = 64, V = 64, n = 2, grads = true })
    local dev = ops.convert_inputs(args, "bf16", "cuda")
    for _, algorithm in ipairs({ "auto", "chunk" }) do
      dev.algorithm, dev.chunk_size = algorithm, 37
      local text = H.expect_error(function() ops.chunk_gated_delta_product(dev) end, "chunk_size")
      io.stderr:write("  chunk_size 37, " .. algorithm .. ": " .. text:gsub("\n.*", "") .. "\n")
      H.expect_error(function() ops.chunk_gated_delta_product_backward(dev) end, "chunk_size")
    end
    -- without chunk_size the same problem runs
    dev.chunk_size = nil
    assert.are.equal("cuda:0", ops.chunk_gated_delta_product(dev):device())
    H.assert_alive()
  end)
end)

describe("GDP operator behaviour (cpu)", function()
  it("packed sequences equal separate runs; an empty one passes its initial state through", function()
    H.reseed(122)
    local lens = { 7, 0, 12 }
    local args = ops.random_inputs({ B = 1, T = 19, H = 2, K = 6, V = 5, n = 2, initial_state = true,
                                     cu_seqlens = { 0, 7, 7, 19 } })
    local o, ht = ops.chunk_gated_delta_product(args)
    local start = 0
    for s, len in ipairs(lens) do
      if len > 0 then
        local sub = {
          q = args.q:narrow(2, start + 1, len), k = args.k:narrow(2, 2 * start + 1, 2 * len),
          v = args.v:narrow(2, 2 * start + 1, 2 * len), g = args.g:narrow(2, start + 1, len),
          beta = args.beta:narrow(2, 2 * start + 1, 2 * len),
          initial_state = args.initial_state:narrow(1, s, 1), output_final_state = true,
          use_qk_l2norm_in_kernel = true,
        }
        local os_, hts = ops.chunk_gated_delta_product(sub)
        assert.tensor_near(os_, o:narrow(2, start + 1, len), 1e-12)
        assert.tensor_near(hts, ht:narrow(1, s, 1), 1e-12)
      else
        assert.tensor_near(ht:narrow(1, s, 1), args.initial_state:narrow(1, s, 1), 0)
      end
      start = start + len
    end
  end)

  -- The CUDA fast path runs K and V between its instances' widths on zero-padded copies
  -- (K = 48 at 64, V = 80 at 128: kernels/cuda/gdp/chunk_shapes.cu); that rests on this:
  -- the float64 operator on the padded problem gives the unpadded one's outputs and
  -- gradients in the real columns.
  it("zero-padding K from 48 to 64 and V from 80 to 128 changes no output or gradient of the real columns", function()
    H.reseed(124)
    local K, V, KP, VP, n = 48, 80, 64, 128, 4
    local args = ops.random_inputs({ B = 1, T = 23, H = 2, K = K, V = V, n = n, initial_state = true,
                                     grads = true, beta_max = 2, cu_seqlens = { 0, 0, 9, 23 } })
    -- the real K's scale on both (the CUDA padding keeps the problem's scale too)
    args.algorithm, args.scale = "recurrent", 1 / math.sqrt(K)
    local function widen(t, dims)
      local shape = t:shape()
      for d, w in pairs(dims) do shape[d] = w end
      local z = gdp.zeros(shape, { dtype = t:dtype() })
      local view = z
      for d, _ in pairs(dims) do view = view:narrow(d, 1, t:size(d)) end
      view:copy(t)
      return z
    end
    local padded = {}
    for key, val in pairs(args) do padded[key] = val end
    padded.q, padded.k = widen(args.q, { [4] = KP }), widen(args.k, { [4] = KP })
    padded.v, padded["do"] = widen(args.v, { [4] = VP }), widen(args["do"], { [4] = VP })
    padded.initial_state = widen(args.initial_state, { [3] = KP, [4] = VP })
    padded.dht = widen(args.dht, { [3] = KP, [4] = VP })
    local o, ht = ops.chunk_gated_delta_product(args)
    local po, pht = ops.chunk_gated_delta_product(padded)
    local tol = 1e-12
    assert.tensor_near(po:narrow(4, 1, V), o, tol)
    assert.tensor_near(pht:narrow(3, 1, K):narrow(4, 1, V), ht, tol)
    assert.are.equal(0, po:narrow(4, V + 1, VP - V):norm())
    local g = ops.chunk_gated_delta_product_backward(args)
    local pg = ops.chunk_gated_delta_product_backward(padded)
    assert.tensor_near(pg.dq:narrow(4, 1, K), g.dq, tol)
    assert.tensor_near(pg.dk:narrow(4, 1, K), g.dk, tol)
    assert.tensor_near(pg.dv:narrow(4, 1, V), g.dv, tol)
    assert.tensor_near(pg.dbeta, g.dbeta, tol)
    assert.tensor_near(pg.dg, g.dg, tol)
    assert.tensor_near(pg.dh0:narrow(3, 1, K):narrow(4, 1, V), g.dh0, tol)
    assert.is_true(g.dg:norm() > 0 and g.dk:norm() > 0)
  end)

  -- It runs n = 5..8 (chunk_shapes.cu) as tokens of fewer steps: n = 5 padded with
  -- an identity step (beta 0, k 0, v 0) to 6, split into 2 tokens of 3 steps, the gate on
  -- the first, the query (and dO) on the second.  The float64 operator on that rewritten
  -- problem gives the problem's outputs and gradients back.
  it("n = 5 as 2 tokens of 3 steps (one identity step added) gives the same outputs and gradients", function()
    H.reseed(125)
    local n, np, m, T, Hh, K, V = 5, 6, 2, 13, 2, 8, 6
    local cu = { 0, 5, 5, 13 }
    local args = ops.random_inputs({ B = 1, T = T, H = Hh, K = K, V = V, n = n, initial_state = true,
                                     grads = true, beta_max = 2, cu_seqlens = cu })
    args.algorithm, args.scale = "recurrent", 1 / math.sqrt(K)
    local split = { num_householder = np / m, use_qk_l2norm_in_kernel = true, output_final_state = true,
                    algorithm = "recurrent", scale = args.scale, initial_state = args.initial_state,
                    dht = args.dht, cu_seqlens = {} }
    for i, c in ipairs(cu) do split.cu_seqlens[i] = c * m end
    local function zeros_like(t, rows) -- t [1, R, ...] -> zeros [1, rows, ...]
      local shape = t:shape()
      shape[2] = rows
      return gdp.zeros(shape, { dtype = t:dtype() })
    end
    split.q, split["do"], split.g = zeros_like(args.q, T * m), zeros_like(args["do"], T * m), zeros_like(args.g, T * m)
    split.k, split.v, split.beta = zeros_like(args.k, T * np), zeros_like(args.v, T * np), zeros_like(args.beta, T * np)
    for t = 0, T - 1 do
      split.q:narrow(2, t * m + m, 1):copy(args.q:narrow(2, t + 1, 1))
      split["do"]:narrow(2, t * m + m, 1):copy(args["do"]:narrow(2, t + 1, 1))
      split.g:narrow(2, t * m + 1, 1):copy(args.g:narrow(2, t + 1, 1))
      for _, key in ipairs({ "k", "v", "beta" }) do
        split[key]:narrow(2, t * np + 1, n):copy(args[key]:narrow(2, t * n + 1, n))
      end
    end
    local o, ht = ops.chunk_gated_delta_product(args)
    local so, sht = ops.chunk_gated_delta_product(split)
    local g = ops.chunk_gated_delta_product_backward(args)
    local sg = ops.chunk_gated_delta_product_backward(split)
    local tol = 1e-12
    assert.tensor_near(sht, ht, tol)
    assert.tensor_near(sg.dh0, g.dh0, tol)
    for t = 0, T - 1 do
      assert.tensor_near(so:narrow(2, t * m + m, 1), o:narrow(2, t + 1, 1), tol)
      assert.tensor_near(sg.dq:narrow(2, t * m + m, 1), g.dq:narrow(2, t + 1, 1), tol)
      assert.tensor_near(sg.dg:narrow(2, t * m + 1, 1), g.dg:narrow(2, t + 1, 1), tol)
      for _, key in ipairs({ "dk", "dv", "dbeta" }) do
        assert.tensor_near(sg[key]:narrow(2, t * np + 1, n), g[key]:narrow(2, t * n + 1, n), tol)
      end
    end
    assert.is_true(g.dg:norm() > 0 and g.dk:norm() > 0)
  end)

  -- ... and V = 256 as two problems on the value columns' halves: the state's columns
  -- evolve independently, so o, ht, dv, dh0 are the halves' and dq, dk, dbeta, dg their
  -- sums.
  it("a problem on two halves of its value columns gives its outputs and gradients", function()
    H.reseed(126)
    local V, VH = 12, 6
    local args = ops.random_inputs({ B = 1, T = 21, H = 2, K = 5, V = V, n = 3, initial_state = true,
                                     grads = true, cu_seqlens = { 0, 8, 8, 21 } })
    args.algorithm = "recurrent"
    local o, ht = ops.chunk_gated_delta_product(args)
    local g = ops.chunk_gated_delta_product_backward(args)
    local sums = {}
    for part = 0, 1 do
      local half = {}
      for key, val in pairs(args) do half[key] = val end
      half.v = args.v:narrow(4, part * VH + 1, VH):contiguous()
      half["do"] = args["do"]:narrow(4, part * VH + 1, VH):contiguous()
      half.initial_state = args.initial_state:narrow(4, part * VH + 1, VH):contiguous()
      half.dht = args.dht:narrow(4, part * VH + 1, VH):contiguous()
      local ho, hht = ops.chunk_gated_delta_product(half)
      local hg = ops.chunk_gated_delta_product_backward(half)
      assert.tensor_near(ho, o:narrow(4, part * VH + 1, VH), 1e-12)
      assert.tensor_near(hht, ht:narrow(4, part * VH + 1, VH), 1e-12)
      assert.tensor_near(hg.dv, g.dv:narrow(4, part * VH + 1, VH), 1e-12)
      assert.tensor_near(hg.dh0, g.dh0:narrow(4, part * VH + 1, VH), 1e-12)
      for _, name in ipairs({ "dq", "dk", "dbeta", "dg" }) do
        sums[name] = sums[name] and sums[name] + hg[name] or hg[name]
      end
    end
    for _, name in ipairs({ "dq", "dk", "dbeta", "dg" }) do assert.tensor_near(sums[name], g[name], 1e-12) end
  end)

  it("positional arguments like fla's", function()
    H.reseed(123)
    local a = ops.random_inputs({ B = 1, T = 9, H = 1, K = 4, V = 4, n = 2 })
    local o1 = ops.chunk_gated_delta_product(a)
    local o2 = ops.chunk_gated_delta_product(a.q, a.k, a.v, a.g, a.beta,
                                             { num_householder = 2, use_qk_l2norm_in_kernel = true })
    assert.tensor_near(o2, o1, 0)
    assert.is_true(o1:norm() > 0)
  end)
end)

describe("chunk_gated_delta_product_dh0 (cpu)", function()
  it("is the full backward's dh0, with or without initial_state, packed with empty sequences", function()
    H.reseed(5100)
    local args = ops.random_inputs({ B = 1, T = 23, H = 2, K = 5, V = 4, n = 2, grads = true, initial_state = true,
                                     cu_seqlens = { 0, 7, 7, 23 }, beta_max = 2 })
    local full = ops.chunk_gated_delta_product_backward(args).dh0
    assert.tensor_near(ops.chunk_gated_delta_product_dh0(args), full, 1e-14, "dh0")
    args.initial_state = nil
    local only = ops.chunk_gated_delta_product_dh0(args)
    assert.are.same({ 3, 2, 5, 4 }, only:shape())
    assert.tensor_near(only, full, 1e-14, "dh0 without initial_state")
  end)
  it("names a missing do", function()
    local args = ops.random_inputs({ B = 1, T = 4, H = 1, K = 3, n = 1 })
    local ok, err = pcall(ops.chunk_gated_delta_product_dh0, args)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("chunk_gated_delta_product_dh0", 1, true), tostring(err))
    assert.is_truthy(tostring(err):find("do", 1, true), tostring(err))
  end)
end)
