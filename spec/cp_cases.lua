-- Helpers shared by the context-parallel specs (cp_spec.lua on the cpu, cp_cuda_spec.lua
-- on cuda tensors): packings, case labels and the group's verdict on a case's rows.
-- Not a spec file (no _spec suffix): the specs require it.
local M = {}

-- cu_seqlens of a table of sequence lengths.
function M.cumsum(lengths)
  local cu = { 0 }
  for _, l in ipairs(lengths) do cu[#cu + 1] = cu[#cu] + l end
  return cu
end

-- Every rank checks its rows {name, err}; the group agrees on the verdict (an error on
-- all ranks when any rank has a row above tol, naming the rows).  Returns true when
-- every row is within tol, for the spec's own assert.
function M.agree_rows(group, rows, tol, label, seed)
  local bad = {}
  for _, r in ipairs(rows) do
    if not (r.err <= tol) then bad[#bad + 1] = string.format("%s %.3e", r.name, r.err) end
  end
  local ok = #bad == 0
  group:check(ok, string.format("%s: rank %d: %s > %.0e (seed %d)", label, group:rank(),
                                table.concat(bad, ", "), tol, seed))
  return ok
end

-- Sequences that start and end exactly on the boundaries of P ranks, one that crosses
-- them, and empty ones (local length Lc).
function M.boundary_lengths(P, Lc)
  local out = { Lc, 0 }
  if P >= 2 then
    out[#out + 1] = Lc - 2
    out[#out + 1] = 2
  end
  if P >= 3 then out[#out + 1] = Lc * (P - 2) end
  out[#out + 1] = 0
  return out
end

-- A case's label: dtype (default_dtype when the case names none), M, groups, head and
-- state sizes when given, D, the packing, the layout and the switches.
function M.describe_case(c, default_dtype)
  local parts = { c.dtype or default_dtype, "M=" .. (c.M or 2), "ng=" .. (c.ng or 1) }
  if c.P then parts[#parts + 1] = string.format("K=%d V=%d", c.N or 4, c.P) end
  if c.D then parts[#parts + 1] = "D " .. c.D end
  if c.lengths then parts[#parts + 1] = "lengths [" .. table.concat(c.lengths, ",") .. "]"
  else parts[#parts + 1] = string.format("T %d x B %d", c.T, c.B or 2) end
  if c.layout then parts[#parts + 1] = c.layout end
  if c.conv_bias == false then parts[#parts + 1] = "no conv bias" end
  if c.neg then parts[#parts + 1] = "negative eigenvalues" end
  return table.concat(parts, ", ")
end

return M
