-- The GDP operator through the bindings: golden cases (float64 references made by an
-- independent implementation) in f64 and f32 for both algorithms, and fresh random
-- problems where the chunk algorithm must agree with the float64 recurrence.
local gdp = require("gdp")
local H = gdp_test
local ops = gdp.ops

local TOL = ops.TOLERANCE

-- Checks every output and gradient of the chunk algorithm in `dtype` against the
-- float64 recurrence on the same (float64-generated) inputs.
local function check_against_oracle(args, dtype, extra)
  local ref_args = ops.convert_inputs(args, "f64", "cpu")
  ref_args.algorithm = "recurrent"
  local o_ref, ht_ref = ops.chunk_gated_delta_product(ref_args)
  local g_ref = ops.chunk_gated_delta_product_backward(ref_args)
  local run = ops.convert_inputs(args, dtype, "cpu")
  run.algorithm = "chunk"
  for key, val in pairs(extra or {}) do run[key] = val end
  local o, ht = ops.chunk_gated_delta_product(run)
  local grads = ops.chunk_gated_delta_product_backward(run)
  assert.are.equal(dtype, o:dtype())
  assert.tensor_near(o, o_ref, TOL[dtype])
  if ht_ref then assert.tensor_near(ht, ht_ref, TOL[dtype]) end
  for _, name in ipairs({ "dq", "dk", "dv", "dbeta", "dg", "dh0" }) do
    if g_ref[name] then
      assert.is_not_nil(grads[name], name)
      assert.tensor_near(grads[name], g_ref[name], TOL[dtype])
    else
      assert.is_nil(grads[name], name)
    end
  end
  -- outputs are not trivially zero
  assert.is_true(o_ref:norm() > 0)
  assert.is_true(g_ref.dk:norm() > 0)
  return o_ref, g_ref
end

describe("golden cases", function()
  local files = H.list_files(H.golden_dir, "^gdp_.*%.safetensors$")
  if #files == 0 then
    it("are present", function() pending("no golden fixtures in " .. H.golden_dir) end)
  end
  for _, file in ipairs(files) do
    for _, dtype in ipairs({ "f64", "f32" }) do
      for _, algorithm in ipairs({ "recurrent", "chunk" }) do
        it(string.format("%s %s %s", file:match("[^/]+$"), dtype, algorithm), function()
          local t, meta = gdp.load(file)
          local rows = ops.check_golden_case(t, meta, { dtype = dtype, algorithm = algorithm })
          assert.is_true(#rows >= 6)
          for _, r in ipairs(rows) do
            assert.is_true(r.ok, string.format("%s: %s rel error %.3e > %.0e", file, r.name, r.err, r.tol))
          end
        end)
      end
    end
  end
end)

describe("chunk vs float64 recurrence on fresh random problems", function()
  local cases = {
    { name = "gated n=2 with h0", B = 2, T = 37, H = 3, K = 12, V = 10, n = 2, initial_state = true },
    { name = "Gated DeltaNet n=1", B = 1, T = 70, H = 2, K = 16, V = 8, n = 1 },
    { name = "ungated n=3", B = 2, T = 29, H = 2, K = 8, V = 12, n = 3, gated = false },
    { name = "n=4, negative eigenvalues", B = 1, T = 33, H = 2, K = 10, V = 6, n = 4, beta_max = 2,
      initial_state = true },
    { name = "packed with empty sequences", B = 1, T = 61, H = 2, K = 12, V = 9, n = 2,
      cu_seqlens = { 0, 0, 17, 17, 50, 61, 61 }, initial_state = true },
    { name = "strong decay", B = 1, T = 40, H = 1, K = 8, V = 8, n = 2, g_min = -3, g_max = -0.5 },
  }
  for ci, case in ipairs(cases) do
    for _, dtype in ipairs({ "f64", "f32" }) do
      it(string.format("%s (%s)", case.name, dtype), function()
        H.reseed(100 + ci)
        local cfg = { grads = true }
        for key, val in pairs(case) do if key ~= "name" then cfg[key] = val end end
        local args = ops.random_inputs(cfg)
        check_against_oracle(args, dtype)
      end)
    end
  end

  it("chunk sizes that do not divide T*n agree", function()
    H.reseed(120)
    local args = ops.random_inputs({ B = 1, T = 45, H = 2, K = 8, V = 8, n = 3, grads = true,
                                     initial_state = true })
    for _, cs in ipairs({ 16, 32, 64 }) do
      check_against_oracle(args, "f64", { chunk_size = cs })
    end
  end)

  it("without the in-kernel L2 norm, on unit-norm keys", function()
    H.reseed(121)
    local args = ops.random_inputs({ B = 1, T = 31, H = 2, K = 8, V = 5, n = 2, grads = true,
                                     use_qk_l2norm_in_kernel = false })
    -- normalise k rows on the host: ||k_{t,j,h}|| = 1
    local k = args.k:totable()
    for _, b in ipairs(k) do for _, row in ipairs(b) do for _, head in ipairs(row) do
      local s = 0
      for _, x in ipairs(head) do s = s + x * x end
      s = math.sqrt(s)
      for i = 1, #head do head[i] = head[i] / s end
    end end end
    args.k = gdp.tensor(k, { dtype = "f64" })
    check_against_oracle(args, "f64")
    check_against_oracle(args, "f32")
  end)

  it("packed sequences equal separate runs", function()
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
        -- an empty sequence passes its initial state through
        assert.tensor_near(ht:narrow(1, s, 1), args.initial_state:narrow(1, s, 1), 0)
      end
      start = start + len
    end
  end)

  it("positional arguments like fla's", function()
    H.reseed(123)
    local a = ops.random_inputs({ B = 1, T = 9, H = 1, K = 4, V = 4, n = 2 })
    local o1 = ops.chunk_gated_delta_product(a)
    local o2 = ops.chunk_gated_delta_product(a.q, a.k, a.v, a.g, a.beta,
                                             { num_householder = 2, use_qk_l2norm_in_kernel = true })
    assert.tensor_near(o2, o1, 0)
  end)

  it("K = V = 128, about 300 tokens #slow", function()
    H.reseed(124)
    local args = ops.random_inputs({ B = 1, T = 300, H = 2, K = 128, V = 128, n = 2, grads = true,
                                     initial_state = true, cu_seqlens = { 0, 130, 130, 300 } })
    check_against_oracle(args, "f64")
    check_against_oracle(args, "f32")
  end)
end)
