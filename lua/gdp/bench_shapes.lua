-- gdp.bench_shapes: the shape items of experiments/bench_gdp.lua --shapes, its named
-- sets (--set), and the lengths of a packed item.  tools/fla_bench.py --shapes parses the
-- same items and draws the same lengths (its parse_shapes / packed_lengths);
-- spec/bench_fla_spec.lua checks that the two agree.
--
--   item := [H<h>K<k>V<v>:]<B>x<T>x<n>             B sequences of T tokens each
--         | [H<h>K<k>V<v>:]packed<N>mean<L>x<n>    N sequences of random lengths with
--                                                  mean L, packed into one row (B = 1,
--                                                  cu_seqlens)
--
-- Every number is a positive integer without leading zeros; n is the Householder steps
-- per token.  The prefix gives the item its own heads (H heads of key size K, value size
-- V); without it the item takes the common ones (--H, --K, --V).  A packed item's lengths
-- are uniform on [1, 2L - 1] (so their mean is L): length i (i = 1..N) is
-- 1 + x_i mod (2L - 1), x_i the i-th output of splitmix64 started from the seed (--seed);
-- the same seed gives the same lengths to gdp and to fla.
--
--   local shapes, err = bench_shapes.parse("4x4096x2,H8K32V32:packed100mean50x4",
--                                          { H = 16, K = 128, V = 128 }, 1234)
--   shapes[1] --> {B = 4, T = 4096, n = 2, H = 16, K = 128, V = 128, packed = false,
--                  seqs = 4, tokens = 16384, label = "4x4096x2"}
--   shapes[2] --> {B = 1, T = <sum of the lengths>, n = 4, H = 8, K = 32, V = 32,
--                  packed = true, seqs = 100, mean_len = 50, tokens = T, lengths = {...},
--                  len_min =, len_max =, cu_seqlens = {0, ...},
--                  label = "H8K32V32:packed100mean50x4"}
-- A shape's label is its item in canonical form, the prefix written only when its heads
-- are not the common ones: the key by which bench_gdp finds fla's row for it.
local bit = require("bit")

local M = {}

M.SYNTAX = "[H<h>K<k>V<v>:]<B>x<T>x<n> or [H<h>K<k>V<v>:]packed<N>mean<L>x<n> (positive integers), " ..
           "such as 4x4096x2, H8K32V32:256x512x4 or packed1000mean200x2"

-- Named sets (--set NAME): items as above, each with its heads.
M.SETS = {
  -- issue 22: the issue's four shapes at H = 16, K = V = 128, longer and many short
  -- sequences, a packed batch of 1000 sequences (mean 200), DeltaProduct's state-tracking
  -- head size (K = V = 32), the largest head (256) and a many-head one (32 x 64)
  issue22 = table.concat({
    "H16K128V128:4x4096x1", "H16K128V128:4x4096x2", "H16K128V128:4x4096x3", "H16K128V128:1x32768x2",
    "H16K128V128:1x65536x2", "H16K128V128:64x1024x3", "H16K128V128:packed1000mean200x2",
    "H8K32V32:256x512x4", "H8K32V32:256x512x2",
    "H8K256V256:2x4096x2",
    "H32K64V64:8x2048x2",
  }, ","),
}

-- The positive integer a digit string spells (no sign, no leading zero), or nil.
local function positive(s)
  if not (s and s:match("^[1-9]%d*$")) then return nil end
  local x = tonumber(s)
  return x <= 2 ^ 53 and x or nil
end

local function valid_seed(seed)
  return type(seed) == "number" and seed == math.floor(seed) and seed >= 0 and seed <= 2 ^ 53
end

-- N lengths uniform on [1, 2 * mean - 1] from splitmix64 started at seed (an integer
-- in [0, 2^53]; the state is its value as a 64-bit unsigned integer).
function M.packed_lengths(count, mean, seed)
  if not valid_seed(seed) then
    error(string.format("bench_shapes.packed_lengths: seed: expected an integer in [0, 2^53], got %s",
                        tostring(seed)), 2)
  end
  local span = 2 * mean - 1
  local x = 0ULL + seed
  local out = {}
  for i = 1, count do
    x = x + 0x9E3779B97F4A7C15ULL
    local z = x
    z = bit.bxor(z, bit.rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
    z = bit.bxor(z, bit.rshift(z, 27)) * 0x94D049BB133111EBULL
    z = bit.bxor(z, bit.rshift(z, 31))
    out[i] = 1 + tonumber(z % span)
  end
  return out
end

-- The heads of shape s as "H16K128V128".
function M.head_text(s) return string.format("H%dK%dV%d", s.H, s.K, s.V) end

-- The item of shape s without its heads: "4x4096x2" or "packed1000mean200x2".
function M.body(s)
  return s.packed and string.format("packed%dmean%dx%d", s.seqs, s.mean_len, s.n)
    or string.format("%dx%dx%d", s.B, s.T, s.n)
end

-- The item of shape s in canonical form, its heads written unless they are common's.
function M.label(s, common)
  local same = s.H == common.H and s.K == common.K and s.V == common.V
  return same and M.body(s) or (M.head_text(s) .. ":" .. M.body(s))
end

-- Comma-separated items -> an array of shapes (see the header), or nil and a message
-- naming the bad item and the syntax.  common = {H =, K =, V =}: the heads of items
-- without a prefix; seed: the packed lengths' seed.
function M.parse(text, common, seed)
  local shapes, seen = {}, {}
  for item in (text .. ","):gmatch("([^,]*),") do
    local s = item:match("^%s*(.-)%s*$")
    local h, k, v, body = s:match("^H(%w-)K(%w-)V(%w-):(.*)$")
    if not body then h, k, v, body = nil, nil, nil, s end
    local shape
    local H, K, V = common.H, common.K, common.V
    if body ~= s then H, K, V = positive(h), positive(k), positive(v) end
    if H and K and V then
      local b, t, n = body:match("^(%w+)x(%w+)x(%w+)$")
      local N, L, pn = body:match("^packed(%w-)mean(%w-)x(%w+)$")
      if N then
        N, L, pn = positive(N), positive(L), positive(pn)
        if N and L and pn then
          if not valid_seed(seed) then
            return nil, string.format("--seed: the packed item '%s' needs an integer seed in [0, 2^53], got %s",
                                      item, tostring(seed))
          end
          local lengths = M.packed_lengths(N, L, seed)
          local cu, lo, hi = { 0 }, math.huge, 0
          for i = 1, N do
            cu[i + 1] = cu[i] + lengths[i]
            lo, hi = math.min(lo, lengths[i]), math.max(hi, lengths[i])
          end
          shape = { B = 1, T = cu[N + 1], n = pn, packed = true, seqs = N, mean_len = L, lengths = lengths,
                    cu_seqlens = cu, len_min = lo, len_max = hi }
        end
      elseif b then
        b, t, n = positive(b), positive(t), positive(n)
        if b and t and n then shape = { B = b, T = t, n = n, packed = false, seqs = b } end
      end
    end
    if not shape then
      return nil, string.format("--shapes: bad item '%s' in '%s': expected comma-separated items %s",
                                item, text, M.SYNTAX)
    end
    shape.H, shape.K, shape.V = H, K, V
    shape.tokens = shape.B * shape.T
    shape.label = M.label(shape, common)
    if seen[shape.label] then
      return nil, string.format("--shapes: item '%s' in '%s' is the shape of an earlier item (%s): " ..
                                "each shape once", item, text, shape.label)
    end
    seen[shape.label] = true
    shapes[#shapes + 1] = shape
  end
  return shapes
end

return M
