-- gdp.comm: the size-1 path (untagged, every run) and the collectives across real
-- processes (#mpi: `./gdp test` runs them under `mpirun -np 2` and `-np 4` with
-- --tags=mpi).  Inputs are rank-dependent integers, exact in every dtype, and results
-- are compared exactly (nccl-tests style).
--
-- Under mpirun every rank runs every test.  A plain assert fails on one rank only and
-- would leave the others waiting in the next collective, so the #mpi tests check
-- through c:check (collective): a failure on any rank fails the test on every rank,
-- with that rank's message, and the ranks stay in step.
local gdp = require("gdp")
local H = gdp_test

local DTYPES = { "f64", "f32", "bf16", "i32", "i64" }

-- An integer code as a value exact in dtype (bf16 holds integers up to 256 exactly).
local function val(dtype, code)
  if dtype == "bf16" then return (code % 239) - 119 end
  return code
end

-- Exact comparison of t's values with a flat table: nil when equal, else a message.
local function diff(t, want, what)
  local got = t:flat()
  if #got ~= #want then
    return string.format("%s: %d values, expected %d", what, #got, #want)
  end
  for i = 1, #want do
    if got[i] ~= want[i] then
      return string.format("%s: value %d is %s, expected %s", what, i, tostring(got[i]), tostring(want[i]))
    end
  end
  return nil
end

-- Collective assertions: every rank fails together, with the first failing rank's
-- message.  expect(c, msg) passes when msg is nil (diff's result); expect_that(c, cond, msg).
local function expect(c, msg)
  c:check(msg == nil, msg)
end

local function expect_that(c, cond, msg)
  c:check(cond and true or false, msg)
end

local function expect_error_everywhere(c, fn, ...)
  local ok, err = pcall(fn)
  local text = tostring(err)
  local missing
  for i = 1, select("#", ...) do
    local needle = select(i, ...)
    if not text:find(needle, 1, true) then missing = needle end
  end
  if ok then
    expect(c, "expected an error on rank " .. c:rank() .. ", but the call succeeded")
  elseif missing then
    expect(c, string.format("rank %d: error lacks %q: %s", c:rank(), missing, text))
  else
    expect(c, nil)
  end
  return text
end

describe("gdp.comm on one rank", function()
  it("self is a size-1 communicator without MPI", function()
    local c = gdp.comm.self()
    assert.are.equal(0, c:rank())
    assert.are.equal(1, c:size())
    assert.is_false(c:is_mpi())
    assert.truthy(tostring(c):find("rank 0 of 1", 1, true))
    c:free()
    c:free() -- idempotent
    assert.is_true(c:is_freed())
    H.expect_error(function() return c:size() end, "freed")
  end)

  it("backend names the transport per device", function()
    local c = gdp.comm.self()
    assert.are.equal("self", c:backend())
    assert.are.equal("self", c:backend("cpu"))
    assert.are.equal("self-staged", c:backend("cuda")) -- chooses (no communication at size 1)
    assert.are.equal("self-staged", c:backend())
    H.expect_error(function() return c:backend("tpu") end, "expected \"cpu\"")
    H.expect_error(function() return c:backend(3) end, "device")
  end)

  it("world outside mpirun is size 1", function()
    if os.getenv("OMPI_COMM_WORLD_SIZE") or os.getenv("PMI_SIZE") then
      pending("launched by mpirun")
      return
    end
    local w = gdp.comm.world()
    assert.are.equal(1, w:size())
    assert.are.equal(0, w:rank())
    assert.is_false(w:is_mpi())
  end)

  it("collectives are copies of the local values", function()
    local c = gdp.comm.self()
    for _, dt in ipairs(DTYPES) do
      local t = gdp.tensor({ 1, -2, 3, 4, -5, 6 }, { 2, 3 }, { dtype = dt })
      local g = c:allgather(t)
      assert.are.same({ 1, 2, 3 }, g:shape())
      assert.are.same({ 1, -2, 3, 4, -5, 6 }, g:flat())
      local a = c:all_to_all(t)
      assert.are.same(t:flat(), a:flat())
      local v = c:all_to_all(t, { 2 }, { 2 })
      assert.are.same(t:flat(), v:flat())
      local v2 = c:all_to_all(t, { 2 }) -- recv_rows exchanged
      assert.are.same(t:flat(), v2:flat())
      c:all_reduce(t, "sum")
      c:all_reduce(t, "max")
      assert.are.same({ 1, -2, 3, 4, -5, 6 }, t:flat())
      c:broadcast(t, 0)
      local r = gdp.zeros({ 6 }, { dtype = dt })
      c:sendrecv(t:view(6), 0, r, 0, 3)
      assert.are.same({ 1, -2, 3, 4, -5, 6 }, r:flat())
    end
    c:barrier()
  end)

  it("counts bytes: nothing to other ranks, the own block in the _incl_self pair", function()
    local c = gdp.comm.self()
    local t = gdp.zeros({ 3, 5 }, { dtype = "f32" })
    c:reset_bytes()
    c:allgather(t)
    assert.are.same({ sent = 0, received = 0, sent_incl_self = 60, received_incl_self = 60 }, c:bytes())
    c:reset_bytes()
    assert.are.same({ sent = 0, received = 0, sent_incl_self = 0, received_incl_self = 0 }, c:bytes())
  end)

  it("check, pcall and agree on one rank", function()
    local c = gdp.comm.self()
    assert.is_true(c:check(true))
    H.expect_error(function() c:check(false, "the input is bad") end,
                   "gdp.comm.check", "GDP_ERR_INVALID_ARG", "rank 0", "the input is bad")
    local a, b, cc = c:pcall(function(x) return x + 1, nil, "z" end, 1)
    assert.are.equal(2, a)
    assert.is_nil(b)
    assert.are.equal("z", cc)
    -- a gdp error keeps its status through pcall
    H.expect_error(function() c:pcall(function() return gdp.zeros({ 2 }):view(3) end) end,
                   "gdp.comm.pcall", "GDP_ERR_")
    H.expect_error(function() c:pcall(function() error("plain failure") end) end,
                   "GDP_ERR_INVALID_ARG", "plain failure")
    assert.is_true(c:agree("config", { 1, 2, 3, true }))
    H.expect_error(function() c:agree("config", { 1, 2.5 }) end, "config[2]: expected an integer, got 2.5")
  end)

  it("rejects bad arguments with messages", function()
    local c = gdp.comm.self()
    local t = gdp.zeros({ 4 })
    H.expect_error(function() c:all_reduce(t, "prod") end, "gdp.comm.all_reduce", "op:", "'prod'")
    H.expect_error(function() c:broadcast(t, 1) end, "root must be an integer in [0, 0], got 1")
    H.expect_error(function() c:all_to_all(t, { 1, 2 }, { 1, 2 }) end, "send_rows: expected a table of 1 row counts")
    H.expect_error(function() c:all_to_all(t, { -1 }, { 4 }) end, "send_rows[1] must be an integer >= 0")
    H.expect_error(function() c:all_to_all(t, { 3 }, { 3 }) end, "gdp.comm.all_to_all", "GDP_ERR_SHAPE", "send_rows sum to 3")
    H.expect_error(function() c:allgather_into(gdp.zeros({ 2, 4 }), t) end, "GDP_ERR_SHAPE", "out: expected [1, *in.shape]")
    H.expect_error(function() c:send(t, 0) end, "GDP_ERR_UNSUPPORTED", "use sendrecv")
    H.expect_error(function() c:split(1.5) end, "color must be an integer")
    H.expect_error(function() gdp.comm.methods.rank(nil) end, "expected a communicator as self")
    H.expect_error(function() c:allgather({}) end, "gdp.comm.allgather", "expected a gdp tensor")
    assert.is_nil(c:split(-1))
    assert.are.equal(1, c:split(5):size())
    H.assert_alive()
  end)
end)

describe("gdp.comm across ranks #mpi", function()
  local c = gdp.comm.world()
  local R, N = c:rank(), c:size()

  it("world is the mpirun job", function()
    local env = tonumber(os.getenv("OMPI_COMM_WORLD_SIZE") or os.getenv("PMI_SIZE") or "")
    expect_that(c, env == nil or env == N, string.format("world size %d, mpirun started %s", N, tostring(env)))
    expect_that(c, c:is_mpi() or N == 1, "world is not an MPI communicator")
    local again = gdp.comm.world()
    expect_that(c, again:size() == N and again:rank() == R, "a second world() differs")
  end)

  it("backend: mpi for cpu tensors", function()
    expect_that(c, c:backend("cpu") == (c:is_mpi() and "mpi" or "self"), "backend(\"cpu\") is " .. c:backend("cpu"))
  end)

  it("allgather, out of place and in place, every dtype", function()
    for _, dt in ipairs(DTYPES) do
      local mine, want = {}, {}
      for i = 1, 6 do mine[i] = val(dt, 1000 * R + 7 * i) end
      for r = 0, N - 1 do
        for i = 1, 6 do want[r * 6 + i] = val(dt, 1000 * r + 7 * i) end
      end
      local t = gdp.tensor(mine, { 2, 3 }, { dtype = dt })
      local g = c:allgather(t)
      expect(c, diff(g, want, "allgather " .. dt))
      local out = gdp.zeros({ N, 2, 3 }, { dtype = dt })
      out:select(1, R + 1):copy(t)
      c:allgather_into(out, out:select(1, R + 1))
      expect(c, diff(out, want, "allgather in place " .. dt))
      -- a strided input
      local wide = gdp.zeros({ 3, 2 }, { dtype = dt })
      wide:copy(t:view(3, 2))
      local strided = wide:transpose(1, 2)
      local want_t = {}
      for r = 0, N - 1 do
        for i = 1, 6 do want_t[r * 6 + i] = val(dt, 1000 * r + 7 * ({ 1, 3, 5, 2, 4, 6 })[i]) end
      end
      expect(c, diff(c:allgather(strided), want_t, "allgather strided " .. dt))
    end
  end)

  it("all_to_all: equal split, unequal split with zero rows, counts exchanged", function()
    for _, dt in ipairs(DTYPES) do
      -- equal: 2 rows of 3 per rank; row k of the block for rank j encodes (R, j, k, col)
      local mine, want = {}, {}
      for j = 0, N - 1 do
        for k = 0, 1 do
          for col = 0, 2 do
            mine[#mine + 1] = val(dt, 10000 * R + 1000 * j + 10 * k + col)
            want[#want + 1] = val(dt, 10000 * j + 1000 * R + 10 * k + col)
          end
        end
      end
      local t = gdp.tensor(mine, { 2 * N, 3 }, { dtype = dt })
      expect(c, diff(c:all_to_all(t), want, "all_to_all equal " .. dt))
      -- unequal: (R + 2j) % 3 rows to rank j, zeros included
      local send_rows, recv_rows, sv, rv = {}, {}, {}, {}
      for j = 0, N - 1 do
        send_rows[j + 1] = (R + 2 * j) % 3
        recv_rows[j + 1] = (j + 2 * R) % 3
        for k = 0, send_rows[j + 1] - 1 do
          for col = 0, 1 do sv[#sv + 1] = val(dt, 10000 * R + 1000 * j + 10 * k + col) end
        end
        for k = 0, recv_rows[j + 1] - 1 do
          for col = 0, 1 do rv[#rv + 1] = val(dt, 10000 * j + 1000 * R + 10 * k + col) end
        end
      end
      local nrows = #sv / 2
      local u = gdp.tensor(sv, { nrows, 2 }, { dtype = dt })
      local got = c:all_to_all(u, send_rows, recv_rows)
      expect(c, diff(got, rv, "all_to_all unequal " .. dt))
      expect_that(c, got:size(1) == #rv / 2, "all_to_all unequal: wrong row count")
      expect(c, diff(c:all_to_all(u, send_rows), rv, "all_to_all unequal, counts exchanged " .. dt))
    end
  end)

  it("all_reduce sum/max/min, contiguous and strided", function()
    for _, dt in ipairs(DTYPES) do
      for _, op in ipairs({ "sum", "max", "min" }) do
        local function code(r, i) return ((r * 31 + i * 17) % 61) - 30 end
        local mine, want = {}, {}
        for i = 1, 7 do
          mine[i] = code(R, i)
          local acc = code(0, i)
          for r = 1, N - 1 do
            local x = code(r, i)
            acc = op == "sum" and acc + x or op == "max" and math.max(acc, x) or math.min(acc, x)
          end
          want[i] = acc
        end
        local t = gdp.tensor(mine, { dtype = dt })
        c:all_reduce(t, op)
        expect(c, diff(t, want, "all_reduce " .. op .. " " .. dt))
        local base = gdp.zeros({ 7, 2 }, { dtype = dt })
        local col = base:select(2, 2)
        col:copy(gdp.tensor(mine, { dtype = dt }))
        c:all_reduce(col, op)
        expect(c, diff(col, want, "all_reduce strided " .. op .. " " .. dt))
        expect_that(c, base:select(2, 1):max_abs() == 0, "all_reduce wrote outside the view")
      end
    end
  end)

  it("broadcast from every root", function()
    for root = 0, N - 1 do
      local t = gdp.tensor({ R, 2 * R, 3 * R, -R }, { dtype = "i64" })
      c:broadcast(t, root)
      expect(c, diff(t, { root, 2 * root, 3 * root, -root }, "broadcast from " .. root))
    end
  end)

  it("sendrecv around a ring and along a chain, send/recv pairs", function()
    local nxt, prv = (R + 1) % N, (R + N - 1) % N
    local function msg(r) -- rank r's message: 2 + r values
      local m = {}
      for i = 1, 2 + r do m[i] = 100 * r + i end
      return m
    end
    local s = gdp.tensor(msg(R), { dtype = "f64" })
    local r = gdp.zeros({ 2 + prv }, { dtype = "f64" })
    c:sendrecv(s, nxt, r, prv, 5)
    expect(c, diff(r, msg(prv), "sendrecv ring"))
    local r2 = gdp.zeros({ 2 + prv }, { dtype = "f64" })
    c:sendrecv(s, R + 1 < N and R + 1 or -1, R > 0 and r2 or nil, R > 0 and R - 1 or nil, 6)
    if R > 0 then expect(c, diff(r2, msg(prv), "sendrecv chain")) else expect(c, nil) end
    if N >= 2 then
      local r3 = gdp.zeros({ 2 + prv }, { dtype = "f64" })
      if R % 2 == 0 then
        c:send(s, nxt, 9)
        c:recv(r3, prv, 9)
      else
        c:recv(r3, prv, 9)
        c:send(s, nxt, 9)
      end
      expect(c, diff(r3, msg(prv), "send/recv ring"))
    end
  end)

  it("split into even and odd ranks, collectives inside", function()
    local sub = c:split(R % 2)
    local size = math.floor(N / 2) + ((R % 2 == 0) and (N % 2) or 0)
    expect_that(c, sub:size() == size and sub:rank() == math.floor(R / 2),
                string.format("split: rank %d of %d, expected %d of %d", sub:rank(), sub:size(),
                              math.floor(R / 2), size))
    local want = {}
    for i = 0, size - 1 do want[i + 1] = R % 2 + 2 * i end
    local g = sub:allgather(gdp.tensor({ R }, { dtype = "i32" }))
    expect(c, diff(g, want, "allgather in the group"))
    local sum = 0
    for _, x in ipairs(want) do sum = sum + x end
    local t = gdp.tensor({ R }, { dtype = "f64" })
    sub:all_reduce(t)
    expect(c, diff(t, { sum }, "all_reduce in the group"))
    local rev = c:split(0, -R)
    expect_that(c, rev:rank() == N - 1 - R, "split by key -rank: wrong order")
    local none = c:split(R == 0 and -1 or 1)
    expect_that(c, (R == 0) == (none == nil), "split with a negative color")
    sub:free()
    rev:free()
    if none then none:free() end
  end)

  it("check raises on every rank when one rank fails", function()
    local bad = N - 1
    local text = expect_error_everywhere(c, function()
      c:check(R ~= bad, "rank " .. R .. " saw a bad shape")
    end, "gdp.comm.check", "GDP_ERR_INVALID_ARG", "ranks " .. bad .. ")", "rank " .. bad .. " saw a bad shape")
    expect_that(c, text:find("1 of " .. N .. " ranks failed", 1, true), "message: " .. text)
    expect_that(c, c:check(true), "check(true)")
  end)

  it("pcall turns a local failure into an error on every rank", function()
    -- a gdp error on rank 0 only (a bad view): every rank gets GDP_ERR_SHAPE
    expect_error_everywhere(c, function()
      c:pcall(function()
        if R == 0 then return gdp.zeros({ 2 }):view(3) end
        return gdp.zeros({ 2 })
      end)
    end, "gdp.comm.pcall", "GDP_ERR_SHAPE", "ranks 0)")
    -- a plain Lua error on the last rank
    expect_error_everywhere(c, function()
      c:pcall(function()
        if R == N - 1 then error("no such file") end
      end)
    end, "GDP_ERR_INVALID_ARG", "no such file")
    local a, b = c:pcall(function() return R, "ok" end)
    expect_that(c, a == R and b == "ok", "pcall results")
  end)

  it("agree detects differing values and counts on every rank", function()
    expect_that(c, c:agree("config", { 4, 5, 6 }), "agree on equal values")
    if N == 1 then -- (busted without mpirun) values cannot differ across one rank
      return
    end
    expect_error_everywhere(c, function()
      c:agree("config", { 4, 5, R == N - 1 and 7 or 6 })
    end, "GDP_ERR_INVALID_ARG", "config differ across ranks", "rank " .. (N - 1) .. ": [4, 5, 7]")
    expect_error_everywhere(c, function()
      c:agree("shape", R == 0 and { 1, 2 } or { 1, 2, 3 })
    end, "GDP_ERR_INVALID_ARG", "different or invalid numbers of values")
  end)

  it("agree fails on every rank when one rank passes a non-integer", function()
    expect_error_everywhere(c, function()
      c:agree("shape", { 1, R == N - 1 and 0.5 or 1 })
    end, "GDP_ERR_INVALID_ARG", "shape[2]: expected an integer, got 0.5")
  end)

  it("byte counters follow docs/design.md's volume formula", function()
    -- the chunkwise strategy's all-gather of float32 [H, K, K+V] summaries: received per
    -- rank, counting all cp blocks, is 4 * cp * H * K * (K + V) bytes
    local Hh, K, V = 3, 4, 5
    local summary = gdp.zeros({ Hh, K, K + V }, { dtype = "f32" })
    c:reset_bytes()
    c:allgather(summary)
    local b = c:bytes()
    local formula = 4 * N * Hh * K * (K + V)
    local block = 4 * Hh * K * (K + V)
    expect_that(c, b.received_incl_self == formula and b.sent_incl_self == formula and
                   b.received == formula - block and b.sent == formula - block,
                string.format("bytes %d/%d (incl. self %d/%d), formula %d", b.sent, b.received,
                              b.sent_incl_self, b.received_incl_self, formula))
    -- all_to_all: the other ranks' blocks
    c:reset_bytes()
    c:all_to_all(gdp.zeros({ 2 * N, 3 }, { dtype = "f64" }))
    b = c:bytes()
    local per = 2 * 3 * 8
    expect_that(c, b.sent == (N - 1) * per and b.received == (N - 1) * per and
                   b.sent_incl_self == N * per and b.received_incl_self == N * per,
                string.format("all_to_all bytes %d/%d", b.sent, b.received))
  end)
end)
