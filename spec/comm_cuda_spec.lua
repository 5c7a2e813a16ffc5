-- gdp.comm on cuda tensors (#gpu #mpi: `./gdp test` runs these under `mpirun -np 2` and
-- `-np 4` on a machine with a GPU and a CUDA build; elsewhere the launcher skips #gpu
-- specs and says so).  All ranks share one GPU there, so the transport must be host
-- staging ("mpi-staged"): NCCL refuses ranks on one GPU.  Values are checked against
-- the same collective on cpu tensors.
local gdp = require("gdp")
local tensor = require("gdp.tensor")

local function values(t) return t:flat() end

local function same(a, b, tol)
  local x, y = values(a), values(b)
  assert.are.equal(#x, #y)
  for i = 1, #x do
    if math.abs(x[i] - y[i]) > (tol or 0) then
      error(string.format("element %d: %.9g vs %.9g", i, x[i], y[i]))
    end
  end
end

-- Rank-dependent values: rank r, element i -> r * 1000 + i (exact in bf16 up to 256).
local function ranked(shape, dtype, r, device)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  local v = {}
  for i = 1, n do v[i] = dtype == "bf16" and (r * 16 + (i % 16)) or (r * 1000 + i) end
  return tensor.tensor(v, shape, { dtype = dtype, device = device or "cuda" })
end

describe("gdp.comm on cuda tensors #gpu #mpi", function()
  local c, r, n

  before_each(function()
    c = gdp.comm.world()
    r, n = c:rank(), c:size()
  end)

  -- The transport a cuda communicator of `size` ranks picks here.
  local function transport(size)
    return (os.getenv("GDP_COMM_NCCL") == "2" and size == 1) and "nccl" or "mpi-staged"
  end

  -- Ranks sharing one GPU stage through the host; one rank with GDP_COMM_NCCL=2 runs
  -- every spec below over a one-rank NCCL communicator instead (the NCCL path on one GPU).
  it("chooses its transport: mpi-staged on a shared GPU, nccl for one rank with GDP_COMM_NCCL=2", function()
    local want = transport(n)
    assert.are.equal("mpi", c:backend("cpu"))
    assert.are.equal(want, c:backend("cuda"))
    assert.are.equal(want, c:backend())
  end)

  for _, dtype in ipairs({ "f32", "bf16" }) do
    it("allgather, in place and not (" .. dtype .. ")", function()
      local t = ranked({ 3, 5 }, dtype, r)
      local all = c:allgather(t)
      assert.are.equal("cuda", all:device():match("^%a+"))
      same(all, c:allgather(t:to({ device = "cpu" })))
      local out = tensor.zeros({ n, 3, 5 }, { dtype = dtype, device = "cuda" })
      out:select(1, r + 1):copy(t)
      c:allgather_into(out, out:select(1, r + 1))
      same(out, all)
    end)

    it("all-to-all, equal and unequal (" .. dtype .. ")", function()
      local x = ranked({ 2 * n, 4 }, dtype, r)
      same(c:all_to_all(x), c:all_to_all(x:to({ device = "cpu" })))
      -- rank r sends j + 1 rows to rank j and receives r + 1 rows from each
      local send, recv, rows = {}, {}, 0
      for j = 0, n - 1 do
        send[j + 1] = j + 1
        recv[j + 1] = r + 1
        rows = rows + j + 1
      end
      local y = ranked({ rows, 3 }, dtype, r)
      local got = c:all_to_all(y, send, recv)
      assert.are.same({ n * (r + 1), 3 }, got:shape())
      same(got, c:all_to_all(y:to({ device = "cpu" }), send, recv))
    end)

    it("all-reduce sum, max, min and broadcast (" .. dtype .. ")", function()
      for _, op in ipairs({ "sum", "max", "min" }) do
        local t = ranked({ 7 }, dtype, r)
        local h = t:to({ device = "cpu" })
        c:all_reduce(t, op)
        c:all_reduce(h, op)
        same(t, h)
      end
      local b = ranked({ 2, 3 }, dtype, r)
      c:broadcast(b, n - 1)
      same(b, ranked({ 2, 3 }, dtype, n - 1, "cpu"))
    end)
  end

  it("non-contiguous cuda tensors", function()
    local base = ranked({ 4, 6 }, "f32", r)
    local t = base:transpose(1, 2) -- [6, 4], strided
    same(c:allgather(t), c:allgather(t:to({ device = "cpu" })))
    local h = t:to({ device = "cpu" })
    c:all_reduce(t, "sum")
    c:all_reduce(h, "sum")
    same(t, h)
  end)

  it("send/recv around a ring, and a split", function()
    local nxt, prv = (r + 1) % n, (r - 1) % n
    local t = ranked({ 5 }, "f32", r)
    local got = tensor.zeros({ 5 }, { dtype = "f32", device = "cuda" })
    c:sendrecv(t, nxt, got, prv)
    same(got, ranked({ 5 }, "f32", prv, "cpu"))
    local sub = c:split(r % 2)
    local g = sub:allgather(ranked({ 2 }, "f32", r))
    assert.are.equal(sub:size(), g:size(1))
    assert.are.equal(transport(sub:size()), sub:backend("cuda"))
    c:barrier()
  end)

  it("a dtype or shape that differs on one rank is an error on every rank", function()
    if n < 2 then
      pending("needs two ranks or more (one rank cannot disagree with another)")
      return
    end
    local dtype = r == n - 1 and "bf16" or "f32"
    local t = tensor.zeros({ 4 }, { dtype = dtype, device = "cuda" })
    local ok, err = pcall(function() return c:allgather(t) end)
    assert.is_false(ok)
    assert.matches("dtype", tostring(err))
    local u = tensor.zeros({ r == 0 and 3 or 4 }, { dtype = "f32", device = "cuda" })
    ok, err = pcall(function() c:all_reduce(u, "sum") end)
    assert.is_false(ok)
    assert.matches("shape", tostring(err))
    -- a cuda tensor on one rank and a cpu tensor on another
    local w = tensor.zeros({ 4 }, { dtype = "f32", device = r == 0 and "cpu" or "cuda" })
    ok, err = pcall(function() c:broadcast(w, 0) end)
    assert.is_false(ok)
    assert.matches("device", tostring(err))
    c:barrier() -- every rank is still in step
  end)

  it("a bad token queued on one rank ends the next collective on every rank with its message", function()
    if n < 2 or transport(n) ~= "mpi-staged" then
      pending("needs two ranks or more, host-staged (the index check is read at the staging wait)")
      return
    end
    local F = require("gdp.nn.functional")
    local w = ranked({ 5, 4 }, "f32", 0) -- the same on every rank
    local tok = tensor.tensor({ 0, 1, r == n - 1 and 7 or 2 }, { 3 }, { dtype = "i32" }):to("cuda")
    local h = F.embedding(w, tok) -- the check's verdict is not read yet
    local ok, err = pcall(function() return c:allgather(h) end)
    assert.is_false(ok)
    assert.matches("got 7 at %[2%]", tostring(err))
    c:barrier() -- every rank is still in step
    local good = tensor.tensor({ 0, 1, 2 }, { 3 }, { dtype = "i32" })
    same(c:allgather(F.embedding(w, good:to("cuda"))), c:allgather(F.embedding(w:to({ device = "cpu" }), good)))
  end)
end)
