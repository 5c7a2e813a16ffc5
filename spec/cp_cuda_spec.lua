-- Both context-parallel strategies on cuda tensors (#gpu #mpi: `./gdp test` runs these
-- under `mpirun -np 2` and `-np 4` on a machine with a GPU and a CUDA build, every rank
-- on the one GPU, so the collectives are host-staged; elsewhere #gpu specs are skipped
-- and the launcher says so).  Each case: the cp = 1 cuda layer and the CP cuda layer
-- built from one seed, the same global batch; every rank checks the output, the input
-- gradient and every parameter gradient of its shard (f32 <= 1e-4, bf16 <= 1e-2
-- relative), and the group agrees on the verdict.
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
local function describe_case(c) return cp_cases.describe_case(c, "f32") end
local TOL = { f32 = 1e-4, bf16 = 1e-2 }
if P > 1 then gdp.device("cpu"):set_num_threads(1) end



local function layer_rows(mode, c)
  local dtype = c.dtype or "f32"
  local cfg = {
    hidden_size = c.hidden or 8, num_heads = c.nh or 4, head_dim = c.P or 3, num_groups = c.ng or 1,
    state_dim = c.N or 4, num_householder = c.M or 2, D = c.D or false, dtype = dtype,
    device = "cuda", seed = c.seed or 5, allow_neg_eigval = c.neg or false,
  }
  local ref = nn.GatedDeltaProduct(cfg)
  cfg.cp_mode, cfg.cp_group, cfg.cp_layout = mode, group, c.layout
  local m = nn.GatedDeltaProduct(cfg)
  local cu = c.lengths and cumsum(c.lengths) or nil
  local T = cu and cu[#cu] or c.T
  local B = cu and 1 or (c.B or 2)
  H.reseed(c.salt or 0)
  -- drawn on the cpu (the same values on every rank), then moved
  local x = gdp.randn({ T, B, cfg.hidden_size }, { dtype = "f32" }):to({ device = "cuda", dtype = dtype })
  local dy = gdp.randn({ T, B, cfg.hidden_size }, { dtype = "f32" }):to({ device = "cuda", dtype = dtype })
  local out_ref = ref:forward(x, cu)
  local dx_ref = ref:backward(x, dy, cu)
  local sopts = { layout = m.cp_layout, cu_seqlens = cu }
  local xl = shard.split(x, P, RANK, sopts)
  local out = m:forward(xl, cu)
  local dx = m:backward(xl, shard.split(dy, P, RANK, sopts), cu)
  assert.are.equal("cuda", out:device():match("^%a+"))
  local rows = {
    { name = "out", err = H.rel_error(out, shard.split(out_ref, P, RANK, sopts)) },
    { name = "dx", err = H.rel_error(dx, shard.split(dx_ref, P, RANK, sopts)) },
  }
  for _, name in ipairs(m:parameter_names()) do
    rows[#rows + 1] = { name = "grad " .. name, err = H.rel_error(m:gradients()[name], ref:gradients()[name]) }
  end
  return rows
end



describe("nn.GatedDeltaProduct on cuda, cp_mode = \"chunkwise\", equals cp = 1 #gpu #mpi", function()
  local cases = {
    { T = 13 * P, B = 2, M = 2, ng = 1 },
    { lengths = { 5, 4, 7 }, M = 3, ng = 2, D = "head" },
    { lengths = { 5, 4, 7 }, M = 1, ng = 4, D = "channel" },
    { lengths = boundary_lengths(6), M = 2, ng = 1, D = "channel" },
    { lengths = { 1, 2, 0, 1 }, M = 2, ng = 2 },
    { lengths = { 37 * P, 11 * P, 0, 16 * P }, M = 3, ng = 1, D = "head" },
    { lengths = boundary_lengths(8), M = 2, ng = 2, dtype = "bf16" },
    { lengths = { 37 * P, 0, 27 * P }, M = 1, ng = 1, dtype = "bf16", D = "head" },
    -- K = V = 64, bf16: the split-column summaries take the fast path
    { lengths = { 70 * P, 0, 58 * P }, M = 2, ng = 1, nh = 4, P = 64, N = 64, hidden = 64, dtype = "bf16" },
    { T = 64 * P, B = 2, M = 3, ng = 2, nh = 4, P = 64, N = 64, hidden = 64, dtype = "bf16" },
  }
  for i, c in ipairs(cases) do
    it(describe_case(c), function()
      local T = c.lengths and cumsum(c.lengths)[#c.lengths + 1] or c.T
      if T % P ~= 0 then pending("token count not divisible by " .. P) return end
      c.salt = 300 + i
      expect_rows(layer_rows("chunkwise", c), TOL[c.dtype or "f32"], "cuda chunkwise layer " .. i)
    end)
  end
end)

describe("nn.GatedDeltaProduct on cuda, cp_mode = \"headwise\", equals cp = 1 #gpu #mpi", function()
  local Z = 2 * P -- zigzag unit
  local cases = {
    { T = 3 * Z, B = 2, M = 2, ng = 1, layout = "zigzag" },
    { lengths = { 2 * Z, 0, Z, 3 * Z }, M = 3, ng = 4, D = "head", layout = "zigzag" },
    { lengths = { 2 * Z, 0, Z, 3 * Z }, M = 1, ng = 2, D = "channel", layout = "zigzag" },
    { lengths = { 5, 4, 7 }, M = 2, ng = 2, D = "channel", layout = "contiguous" },
    { lengths = { 12 * Z, 5 * Z }, M = 3, ng = 1, D = "head", layout = "zigzag", dtype = "bf16" },
    { lengths = { Z, 0, 2 * Z }, M = 2, ng = 2, neg = true, layout = "zigzag", dtype = "bf16" },
    { lengths = { 8 * Z, 0, 4 * Z }, M = 2, ng = 4, nh = 4, P = 64, N = 64, hidden = 64,
      layout = "zigzag", dtype = "bf16" },
  }
  for i, c in ipairs(cases) do
    it(describe_case(c), function()
      local T = c.lengths and cumsum(c.lengths)[#c.lengths + 1] or c.T
      local ng = c.ng or 1
      local nh = c.nh or 4
      if nh % P ~= 0 or T % P ~= 0 or (ng < P and P % ng ~= 0) or (ng >= P and ng % P ~= 0) then
        pending("heads, groups or tokens do not divide over " .. P .. " ranks")
        return
      end
      c.salt = 400 + i
      expect_rows(layer_rows("headwise", c), TOL[c.dtype or "f32"], "cuda headwise layer " .. i)
    end)
  end
end)
