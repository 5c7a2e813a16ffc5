-- gdp.cp.shard: which tokens each context-parallel rank holds, and the copies that move
-- tensors between the global (natural token order) and the rank-local layouts.
--
--   local shard = require("gdp.cp.shard")
--   local x_local = shard.split(x, cp, rank, {layout = "zigzag", cu_seqlens = cu})
--   local x_again = shard.gather(x_local, group, {layout = "zigzag", cu_seqlens = cu})
--
-- Layouts (docs/design.md section 4), on the token dim (`dim`, default 1: sequence-major
-- [T,B,...] tensors; 2 for batch-major [B,T,...]):
--   contiguous  rank r holds tokens [r T/cp, (r+1) T/cp) of the (packed) stream;
--               T % cp == 0.  Chunkwise CP always uses it.
--   zigzag      a sequence of length L is cut into 2cp chunks c_0..c_{2cp-1} and rank r
--               holds [c_r, c_{2cp-1-r}] (Megatron's attention load balancing);
--               L % 2cp == 0.  With cu_seqlens (packed, B = 1) every sequence is
--               zigzagged on its own and the rank's local stream is the concatenation,
--               sequence by sequence, of its two chunks; empty sequences are allowed.
--
-- A layout is described by `blocks`: for each rank, the list of {start, length} runs of
-- global (0-based) token indices it holds, in its local order.  Every helper here is
-- built on that one description, so the split, the gather and headwise CP's undo/redo
-- of the gathered order cannot disagree.
local tensor = require("gdp.tensor")
local util = require("gdp.util")

local argerror = tensor.argerror

local M = {}

M.LAYOUTS = { zigzag = true, contiguous = true }

local is_int = util.is_int

-- Runs fn(...) locally under pcall, then agrees over `group` (collective, comm:pcall):
-- a failure on any rank is raised on every rank, so that bad input cannot leave some
-- ranks waiting in a collective.  Returns fn's results.
function M.agreed(group, fn, ...)
  return group:pcall(fn, ...)
end

-- Collective: true on every rank when `flag` is true on every rank (a decision that
-- changes which collectives follow, e.g. recomputing a forward, must be the same on
-- all ranks).
function M.all_true(group, flag)
  local t = tensor.tensor({ flag and 1 or 0 }, { dtype = "i32" })
  group:all_reduce(t, "min")
  return t:flat()[1] == 1
end

-- Local check of a CP layer's rank-local input x [T/cp, B, hidden] (dtype of the module;
-- at least `min_tokens` tokens when given).  Not collective: callers run it under agreed().
function M.check_layer_input(m, fn, x, min_tokens)
  tensor.tensor_arg(x, fn, "x")
  if x:dim() ~= 3 or x:size(3) ~= m.hidden_size then
    argerror(fn, string.format("x: expected the rank-local [T/cp,B,%d], got %s", m.hidden_size,
                               tensor.shape_str(x:shape())))
  end
  if x:dtype() ~= m.dtype then
    argerror(fn, string.format("x: expected dtype %s (the module's), got %s", m.dtype, x:dtype()))
  end
  if min_tokens and x:size(1) < min_tokens then
    argerror(fn, string.format("x: every rank must hold at least %d token(s) (T/cp >= %d), got %s",
                               min_tokens, min_tokens, tensor.shape_str(x:shape())))
  end
end

-- Collective: checks that the upstream gradient dy of a CP layer's backward has the
-- shape of the layer's rank-local input x, failing on every rank otherwise.
function M.agree_dy(group, fn, dy, x)
  M.agreed(group, function()
    tensor.tensor_arg(dy, fn, "dy")
    local want, got = tensor.shape_str(x:shape()), tensor.shape_str(dy:shape())
    if want ~= got then argerror(fn, string.format("dy: expected the shape of x %s, got %s", want, got)) end
  end)
end

-- Collective: ranks agree on the local token tensor's leading shape [T/cp, B], on whether
-- the input is packed (cu_seqlens given) and on the global cu_seqlens themselves.
function M.agree_tokens(group, fn, x, cu)
  group:agree(fn .. ": local shape [T/cp, B], packed input (1: cu_seqlens given, 0: not) " ..
              "and the number of cu_seqlens entries",
              { x:size(1), x:size(2), cu and 1 or 0, cu and #cu or 0 })
  if cu ~= nil then group:agree(fn .. ": the global cu_seqlens (the same on every rank)", cu) end
end

-- Global sequence boundaries as a Lua table of numbers (from a table or an int tensor).
function M.seqlens_table(cu, fn, what)
  if cu == nil then return nil end
  what = what or "cu_seqlens"
  if tensor.is_tensor(cu) then
    if cu:dim() ~= 1 then
      argerror(fn, string.format("%s: expected a 1-D integer tensor, got shape %s", what,
                                 tensor.shape_str(cu:shape())))
    end
    return cu:flat()
  end
  if type(cu) ~= "table" then
    argerror(fn, string.format("%s: expected a table of integers or an int tensor, got %s", what, type(cu)))
  end
  return cu
end

-- Checks global cu_seqlens against a token count: starts at 0, non-decreasing, ends at
-- T.  Returns nil or the problem.
function M.seqlens_problem(cu, T, what)
  what = what or "cu_seqlens"
  if #cu < 2 then
    return string.format("%s: expected at least 2 entries [0, ..., T], got %d", what, #cu)
  end
  for i = 1, #cu do
    if not is_int(cu[i]) then
      return string.format("%s[%d]: expected an integer, got %s", what, i, util.describe(cu[i]))
    end
  end
  if cu[1] ~= 0 then return string.format("%s[1]: expected 0, got %d", what, cu[1]) end
  for i = 2, #cu do
    if cu[i] < cu[i - 1] then
      return string.format("%s: expected non-decreasing values, got %d after %d at entry %d",
                           what, cu[i], cu[i - 1], i)
    end
  end
  if T ~= nil and cu[#cu] ~= T then
    return string.format("%s: expected the last entry to be the global token count %d, got %d",
                         what, T, cu[#cu])
  end
  return nil
end

-- Returns nil or why `layout` cannot shard T global tokens over cp ranks.
function M.layout_problem(T, cp, layout, cu)
  if not M.LAYOUTS[layout] then
    return string.format("layout: expected \"zigzag\" or \"contiguous\", got %s", tostring(layout))
  end
  if cu ~= nil then
    local p = M.seqlens_problem(cu, T)
    if p then return p end
  end
  if layout == "contiguous" then
    if T % cp ~= 0 then
      return string.format("contiguous layout: the token count %d is not divisible by cp = %d", T, cp)
    end
    return nil
  end
  if cu == nil then
    if T % (2 * cp) ~= 0 then
      return string.format("zigzag layout: the sequence length %d is not divisible by 2*cp = %d " ..
                           "(pad it, or use the contiguous layout)", T, 2 * cp)
    end
    return nil
  end
  for s = 1, #cu - 1 do
    local len = cu[s + 1] - cu[s]
    if len % (2 * cp) ~= 0 then
      return string.format("zigzag layout (packed): sequence %d has length %d, not divisible by " ..
                           "2*cp = %d (pad every sequence to a multiple of 2*cp, or use the " ..
                           "contiguous layout)", s, len, 2 * cp)
    end
  end
  return nil
end

-- The runs {start, length} (0-based global token indices) rank `rank` holds, in its
-- local order.  The layout must be valid (layout_problem(...) == nil).
function M.rank_blocks(T, cp, rank, layout, cu)
  local out = {}
  if layout == "contiguous" then
    local n = T / cp
    out[1] = { rank * n, n }
  elseif cu == nil then
    local c = T / (2 * cp)
    out[1] = { rank * c, c }
    out[2] = { (2 * cp - 1 - rank) * c, c }
  else
    for s = 1, #cu - 1 do
      local len = cu[s + 1] - cu[s]
      if len > 0 then
        local c = len / (2 * cp)
        out[#out + 1] = { cu[s] + rank * c, c }
        out[#out + 1] = { cu[s] + (2 * cp - 1 - rank) * c, c }
      end
    end
  end
  return out
end

-- All ranks' runs as moves {local_start, global_start, length}, where local_start is the
-- position in the rank-concatenated ("gathered") order: rank r's local tokens occupy
-- [r T/cp, (r+1) T/cp).  Adjacent runs are merged (a contiguous layout is one move per
-- rank, or a single move for the whole tensor).
function M.moves(T, cp, layout, cu)
  local moves = {}
  local n = T / cp
  for r = 0, cp - 1 do
    local pos = r * n
    for _, b in ipairs(M.rank_blocks(T, cp, r, layout, cu)) do
      local last = moves[#moves]
      if last and last[1] + last[3] == pos and last[2] + last[3] == b[1] then
        last[3] = last[3] + b[2]
      elseif b[2] > 0 then
        moves[#moves + 1] = { pos, b[1], b[2] }
      end
      pos = pos + b[2]
    end
  end
  return moves
end

local function check_dim(fn, x, dim)
  util.int_arg(fn, "dim", dim, 1, x:dim())
end

local function shape_with(x, dim, n)
  local s = x:shape()
  s[dim] = n
  return s
end

-- Moves the blocks of x along `dim` between gathered (rank-concatenated) order and
-- natural order; `to_natural` picks the direction.  One routine for both, so that the
-- undo and the redo can never disagree about where a block goes.
local function reorder(x, cp, opts, fn, to_natural)
  opts = opts or {}
  local dim = opts.dim or 1
  local T = x:size(dim)
  local layout = opts.layout or "zigzag"
  if layout == "contiguous" then return x end
  local out = tensor.empty(x:shape(), { dtype = x:dtype(), device = x:device() })
  for _, m in ipairs(M.moves(T, cp, layout, M.seqlens_table(opts.cu_seqlens, fn))) do
    local from, to = m[1], m[2] -- gathered offset, natural offset, length m[3]
    if not to_natural then from, to = to, from end
    out:narrow(dim, to + 1, m[3]):copy(x:narrow(dim, from + 1, m[3]))
  end
  return out
end

-- Gathered order -> natural order along `dim`: the headwise "undo".
function M.undo_order(x, cp, opts)
  return reorder(x, cp, opts, "cp.shard.undo_order", true)
end

-- Natural order -> gathered order along `dim`: the headwise "redo".
function M.redo_order(x, cp, opts)
  return reorder(x, cp, opts, "cp.shard.redo_order", false)
end

-- Rank `rank`'s local part of a global tensor x (token dim `dim`): a new contiguous
-- tensor with T/cp tokens.  opts: layout ("contiguous"), cu_seqlens (global, packed),
-- dim (1).
function M.split(x, cp, rank, opts)
  local fn = "cp.shard.split"
  opts = opts or {}
  tensor.tensor_arg(x, fn, "x")
  local dim = opts.dim or 1
  check_dim(fn, x, dim)
  local layout = opts.layout or "contiguous"
  local cu = M.seqlens_table(opts.cu_seqlens, fn)
  util.int_arg(fn, "cp", cp, 1, util.INT_MAX)
  util.int_arg(fn, "rank", rank, 0, cp - 1)
  local T = x:size(dim)
  local problem = M.layout_problem(T, cp, layout, cu)
  if problem then argerror(fn, problem) end
  local out = tensor.empty(shape_with(x, dim, T / cp), { dtype = x:dtype(), device = x:device() })
  local pos = 0
  for _, b in ipairs(M.rank_blocks(T, cp, rank, layout, cu)) do
    if b[2] > 0 then out:narrow(dim, pos + 1, b[2]):copy(x:narrow(dim, b[1] + 1, b[2])) end
    pos = pos + b[2]
  end
  return out
end

-- The local parts of every rank: {[1] = rank 0's, ...}.
function M.split_all(x, cp, opts)
  local out = {}
  for r = 0, cp - 1 do out[r + 1] = M.split(x, cp, r, opts) end
  return out
end

-- The global tensor from every rank's local part (a collective over `group`: every
-- rank gets the whole tensor).  opts as in split.
function M.gather(x_local, group, opts)
  local fn = "cp.shard.gather"
  opts = opts or {}
  tensor.tensor_arg(x_local, fn, "x_local")
  local dim = opts.dim or 1
  check_dim(fn, x_local, dim)
  local cp = group:size()
  local all = group:allgather(x_local:contiguous()) -- [cp, ..., Tl, ...]
  local Tl = x_local:size(dim)
  -- Move the rank dim next to the token dim, then merge them: the gathered order.
  local perm = {}
  for d = 2, dim do perm[#perm + 1] = d end
  perm[#perm + 1] = 1
  for d = dim + 1, x_local:dim() + 1 do perm[#perm + 1] = d end
  local gathered = all:permute(perm):reshape(shape_with(x_local, dim, cp * Tl))
  local layout = opts.layout or "contiguous"
  local cu = M.seqlens_table(opts.cu_seqlens, fn)
  local problem = M.layout_problem(cp * Tl, cp, layout, cu)
  if problem then argerror(fn, problem) end
  return M.undo_order(gathered, cp, { dim = dim, layout = layout, cu_seqlens = cu })
end

return M
