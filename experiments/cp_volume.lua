-- cp_volume: bytes each context-parallel strategy moves per layer and direction as the
-- sequence length and cp grow, counted by the comm layer (gdp_comm_bytes_*: payload sent
-- to and received from other ranks), against the formulas.
--
--   mpirun -np N ./gdp experiments/cp_volume.lua [--T 64,256,1024,4096] [--dtype f32]
--
-- The world is split into groups of every cp that divides N (cp = 1, 2, 4 for N = 4);
-- each group runs the layer forward and backward on one sequence of T tokens (B = 1).
-- Per rank and direction, received bytes (the maximum over ranks; e = element size):
--   headwise:  (cp-1) * T/cp * B * (w_local + d_inner/cp) * e, with w_local the local
--              V, K, Q, b, a width (the all-to-all of the in_proj output; z stays local)
--              plus the reverse all-to-all of y: grows linearly with T.
--   chunkwise: (cp-1) * B * H * K * (V+K) * e (the one all-gather of [dS | M]) plus the
--              conv halo (W-1) * B * conv_dim * e: independent of T.  docs/design.md's
--              4 * cp * H * K * (K+V) counts the gathered buffer including the rank's own
--              block (float32): the comm layer's received_incl_self counter, checked
--              to equal it plus the halo (column chunkwise_fwd_recv_incl_self_bytes).
-- Setup checks (shape agreement) and the parameter-gradient all-reduce (the same for
-- both strategies) are reported in their own columns.  Exits 1 if a measurement differs
-- from its formula.

local config = {
  T = "64,256,1024,4096",  -- global sequence lengths
  dtype = "f32",           -- f32 (float32 summaries, as docs/design.md) | f64
  hidden = 64, heads = 8, head_dim = 16, groups = 2, state_dim = 16, householder = 2,
  conv_width = 4,
  seed = 1,
}

local gdp = require("gdp")
local util = require("gdp.util")
local results = require("gdp.results")
local nn = require("gdp.nn")
local cp = require("gdp.cp")

local opts = util.parse_args(arg, config, {
  usage = "mpirun -np N ./gdp experiments/cp_volume.lua [options]",
  description = "Bytes moved per layer and direction by headwise and chunkwise CP.",
  help = { { "T", "comma-separated global sequence lengths" }, { "dtype", "layer dtype" } },
  choices = { dtype = { "f32", "f64" } },
})

local world = gdp.comm.world()
local N, wrank = world:size(), world:rank()
if N > 1 then gdp.device("cpu"):set_num_threads(1) end
local e = opts.dtype == "f64" and 8 or 4

local Ts = {}
for x in opts.T:gmatch("[^,]+") do Ts[#Ts + 1] = tonumber(x) end

local run = results.new_run("cp_volume", { config = opts, seed = opts.seed, args = arg,
                                           extra = { world_size = N } })
local columns = { "cp", "T", "tokens_per_rank", "headwise_fwd_recv_bytes", "headwise_bwd_recv_bytes",
                  "headwise_formula_bytes", "chunkwise_fwd_recv_bytes", "chunkwise_bwd_recv_bytes",
                  "chunkwise_formula_bytes", "chunkwise_design_bytes", "chunkwise_fwd_recv_incl_self_bytes",
                  "check_bytes",
                  "grad_reduce_bytes", "match", "status", "error" }
local csv = run:csv(columns)
local cps = {}
for c = 1, N do if N % c == 0 then cps[#cps + 1] = c end end
local largest = cps[#cps]
local csv_largest = run:csv(columns, "largest_cp.csv")

local H, K, V, M = opts.heads, opts.state_dim, opts.head_dim, opts.householder
local d_inner = H * V
local ng = opts.groups
local conv_dim = M * d_inner + (M + 1) * ng * K
local W = opts.conv_width

local function headwise_formula(c, T)
  if c == 1 then return 0 end
  local ngl = ng >= c and ng / c or 1
  local wl = M * d_inner / c + (M + 1) * ngl * K + (M + 1) * H / c
  return (c - 1) * (T / c) * 1 * (wl + d_inner / c) * e
end

local function halo_bytes(c, T)
  if c == 1 then return 0 end
  local Lc = T / c
  local Lt, J = math.min(Lc, W - 1), math.ceil((W - 1) / Lc)
  return J * Lt * 1 * conv_dim * e
end

local function chunkwise_formula(c, T)
  if c == 1 then return 0 end
  return (c - 1) * 1 * H * K * (V + K) * e + halo_bytes(c, T)
end

local function measure(group, mode, T)
  local m = nn.GatedDeltaProduct{
    hidden_size = opts.hidden, num_heads = H, head_dim = V, num_groups = ng, state_dim = K,
    num_householder = M, conv_width = W, dtype = opts.dtype, seed = opts.seed,
    cp_mode = mode, cp_group = group,
  }
  local c = group:size()
  gdp.manual_seed(opts.seed + T)
  local x = gdp.randn({ T, 1, opts.hidden }, { dtype = opts.dtype })
  local dy = gdp.randn({ T, 1, opts.hidden }, { dtype = opts.dtype })
  local sopts = { layout = m.cp_layout }
  local xl = cp.shard.split(x, c, group:rank(), sopts)
  m:forward(xl)
  m:backward(xl, cp.shard.split(dy, c, group:rank(), sopts))
  return m.cp_bytes
end

local function world_max(vals)
  return world:all_reduce(gdp.tensor(vals, { #vals }, { dtype = "f64" }), "max"):flat()
end

local mismatches = 0
local table_rows = {}
for _, c in ipairs(cps) do
  local group = world:split(math.floor(wrank / c), wrank % c)
  for _, T in ipairs(Ts) do
    local row = { cp = c, T = T, tokens_per_rank = T / c }
    local ok, err = pcall(function()
      local hb = measure(group, "headwise", T)
      local cb = measure(group, "chunkwise", T)
      local mx = world_max({ hb.forward_received, hb.backward_received, cb.forward_received,
                             cb.backward_received, math.max(hb.forward_check, cb.forward_check),
                             hb.grad_reduce, cb.forward_received_incl_self })
      row.headwise_fwd_recv_bytes, row.headwise_bwd_recv_bytes = mx[1], mx[2]
      row.chunkwise_fwd_recv_bytes, row.chunkwise_bwd_recv_bytes = mx[3], mx[4]
      row.check_bytes, row.grad_reduce_bytes = mx[5], mx[6]
      row.headwise_formula_bytes = headwise_formula(c, T)
      row.chunkwise_formula_bytes = chunkwise_formula(c, T)
      row.chunkwise_design_bytes = c > 1 and 4 * c * H * K * (K + V) or 0
      row.chunkwise_fwd_recv_incl_self_bytes = mx[7]
      local match = mx[1] == row.headwise_formula_bytes and mx[2] == row.headwise_formula_bytes
                and mx[3] == row.chunkwise_formula_bytes and mx[4] == row.chunkwise_formula_bytes
                and (c == 1 or e ~= 4 or mx[7] == row.chunkwise_design_bytes + halo_bytes(c, T))
      row.match = match and "yes" or "no"
      if not match then mismatches = mismatches + 1 end
      row.status = "ok"
    end)
    if not ok then
      row.status, row.error = "error", tostring(err)
      mismatches = mismatches + 1
    end
    csv:row(row)
    if c == largest then csv_largest:row(row) end
    table_rows[#table_rows + 1] = { c, T, row.headwise_fwd_recv_bytes or "-", row.headwise_bwd_recv_bytes or "-",
                                    row.headwise_formula_bytes or "-", row.chunkwise_fwd_recv_bytes or "-",
                                    row.chunkwise_bwd_recv_bytes or "-", row.chunkwise_formula_bytes or "-",
                                    row.chunkwise_design_bytes or "-", row.match or row.error }
  end
end

if wrank == 0 then
  print(string.format("# cp_volume: world %d, %s, hidden %d, heads %d x %d, groups %d x %d, M %d, W %d; " ..
                      "bytes received per rank (max over ranks)", N, opts.dtype, opts.hidden, H, V, ng, K, M, W))
  print(util.format_table({ "cp", "T", "hw_fwd", "hw_bwd", "hw_formula", "cw_fwd", "cw_bwd", "cw_formula",
                            "cw_design", "match" }, table_rows, "%.4g"))
end
run:plot({ x = "T", y = { "headwise_fwd_recv_bytes", "headwise_bwd_recv_bytes", "chunkwise_fwd_recv_bytes",
                          "chunkwise_bwd_recv_bytes", "chunkwise_design_bytes" },
           csv = "largest_cp.csv", logx = true, logy = true, xlabel = "sequence length T (tokens)",
           ylabel = "bytes received per rank per layer", title = "cp_volume at cp = " .. largest })
run:finish({ mismatches = mismatches, status = mismatches == 0 and "ok" or "failed",
             reason = mismatches > 0 and (mismatches .. " volumes differ from the formula") or nil })
os.exit(mismatches == 0 and 0 or 1, true)
