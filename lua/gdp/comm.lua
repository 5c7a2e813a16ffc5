-- gdp.comm: communicators and collectives on cpu and cuda tensors (MPI underneath; cuda
-- tensors over NCCL when every rank has its own GPU, else host-staged MPI; see
-- c:backend()).  One process per rank, launched by mpirun:
--
--   mpirun -np 4 ./gdp script.lua
--
--   local c = gdp.comm.world()               -- size 1 (no MPI) outside mpirun
--   local all = c:allgather(t)               -- [c:size(), ...t's shape]
--   local y = c:all_to_all(x)                -- equal split of dim 1
--   local y = c:all_to_all(x, {2, 0, 1}, {1, 1, 1})  -- rows sent to / received from each rank
--   c:all_reduce(t, "sum")                   -- in place; "sum" | "max" | "min"
--   c:broadcast(t, 0)                        -- from rank 0
--   c:sendrecv(t, next_rank, r, prev_rank)   -- -1 (or nil) for no partner
--   c:check(ok, "why")                       -- raises on every rank if any rank's ok is false
--   local a, b = c:pcall(fn, ...)            -- a local failure in fn is raised on every rank
--   c:agree("config", {B, T, H})             -- raises on every rank if any value differs
--   local sub = c:split(c:rank() % 2)        -- even and odd ranks
--
-- Ranks are 0-based (MPI's numbering) in Lua too; tensor dims stay 1-based.  Every
-- collective must be called by every rank of the communicator, in the same order.
-- The C collectives agree on their arguments first (one small all-gather of each call's
-- status, dtype, op, root and shape), so a bad or mismatched argument on one rank is an
-- error on every rank naming the field.  Measured benchmarks may opt out with
-- c:set_check(false) (collective) or GDP_COMM_CHECK=0 on every rank.  Checks made here
-- in Lua before the C call are local: when inputs may differ between ranks, run the
-- code under c:pcall so that no rank is left waiting.
--
-- In a multi-rank job an uncaught error or os.exit with a failing status on one rank
-- ends every rank (MPI_Abort) with that rank's message; see M.abort.
--
-- A communicator is the C handle itself (gdp_comm *, with methods through
-- ffi.metatype), so it can be passed straight to lib.gdp_comm_* functions; it is freed
-- by the garbage collector or at once by c:free().
local ffi = require("ffi")
local lib = require("gdp.lib")
local tensor = require("gdp.tensor")
local util = require("gdp.util")

local argerror, check, call_outputs = tensor.argerror, tensor.check, tensor.call_outputs
local tensor_arg = tensor.tensor_arg

local M = {}

local Comm_ptr = ffi.typeof("gdp_comm *")
local comm_box = ffi.typeof("gdp_comm *[1]")
local tensor_box = ffi.typeof("gdp_tensor *[1]")
local i64_array = ffi.typeof("int64_t[?]")

local REDUCE_OPS = {
  sum = lib.GDP_REDUCE_OP_SUM,
  max = lib.GDP_REDUCE_OP_MAX,
  min = lib.GDP_REDUCE_OP_MIN,
}

local freed = setmetatable({}, { __mode = "k" })

local function typename(x)
  if type(x) == "cdata" then return tostring(ffi.typeof(x)) end
  return type(x)
end

local function pack(...)
  return { n = select("#", ...), ... }
end

local function own(handle)
  if handle == nil then return nil end
  return ffi.gc(handle, lib.gdp_comm_free)
end

local function live(c, fn)
  if not ffi.istype(Comm_ptr, c) then
    argerror("comm." .. fn, "expected a communicator as self (call it as c:" .. fn ..
             "(...)), got " .. typename(c))
  end
  if freed[c] then
    argerror("comm." .. fn, "communicator was freed with :free() and cannot be used")
  end
  return c
end

local function int_arg(fn, what, x, lo, hi)
  return util.int_arg("comm." .. fn, what, x, lo, hi)
end

-- A new tensor of t's dtype and context with the given shape (a Lua table).
local function new_like(fn, t, shape)
  local nd = #shape
  local arr = i64_array(math.max(nd, 1))
  for i = 1, nd do arr[i - 1] = shape[i] end
  local box = tensor_box()
  return call_outputs("comm." .. fn, "gdp_tensor_empty", { box }, lib.gdp_tensor_ctx(t), lib.gdp_tensor_dtype(t), nd,
             arr, box)
end

------------------------------------------------------------------------------- job abort

-- Ends every rank of a multi-rank MPI job at once with msg on stderr (MPI_Abort), and
-- returns false when no such job is running (then the caller exits as usual).  Exiting
-- normally would run MPI_Finalize at exit, which waits for the other ranks while they
-- wait for this one in a collective: the job would hang instead of failing.
function M.abort(code, msg)
  if type(code) ~= "number" then code = 1 end
  return lib.gdp_comm_abort(code, msg ~= nil and tostring(msg) or nil) ~= 0
end

-- os.exit with a failing status (false or a non-zero number) aborts the job; installed
-- once MPI runs with more than one rank (busted and scripts exit through os.exit).
local exit_wrapped = false
local function wrap_exit()
  if exit_wrapped then return end
  exit_wrapped = true
  local real_exit = os.exit
  os.exit = function(code, close) -- luacheck: ignore (a deliberate global)
    local failing = code == false or (type(code) == "number" and code ~= 0)
    if failing then M.abort(type(code) == "number" and code or 1, nil) end
    return real_exit(code, close)
  end
end

------------------------------------------------------------------------------- creation

-- The process-wide world communicator (size 1 and no MPI outside mpirun).
function M.world()
  local box = comm_box()
  check(lib.gdp_comm_world(box), "comm.world")
  local w = own(box[0])
  if lib.gdp_comm_is_mpi(w) == 1 and lib.gdp_comm_size(w) > 1 then wrap_exit() end
  return w
end

-- A new size-1 communicator that never touches MPI.
function M.self()
  local box = comm_box()
  check(lib.gdp_comm_self(box), "comm.self")
  return own(box[0])
end

function M.is_comm(x)
  return ffi.istype(Comm_ptr, x) and not freed[x]
end

------------------------------------------------------------------------------- methods

local C = {}
M.methods = C

function C.rank(c) return lib.gdp_comm_rank(live(c, "rank")) end
function C.size(c) return lib.gdp_comm_size(live(c, "size")) end
function C.is_mpi(c) return lib.gdp_comm_is_mpi(live(c, "is_mpi")) == 1 end

-- How c moves tensors: backend() is the cuda transport once one is chosen ("nccl",
-- "mpi-staged", "self-staged"), else "mpi" or "self" (cpu tensors).  backend(device)
-- ("cpu", "cuda", "cuda:<i>") answers for that device; for cuda it chooses the
-- transport if no collective has yet (collective when NCCL is built in: call it on
-- every rank).  "mpi-staged" copies each buffer to the host and back; it is what runs
-- when ranks share a GPU (NCCL refuses that).
function C.backend(c, device)
  live(c, "backend")
  if device == nil then
    local t = ffi.string(lib.gdp_comm_cuda_transport(c))
    if t ~= "" then return t end
    device = "cpu"
  end
  if type(device) ~= "string" then
    argerror("comm.backend", "device: expected \"cpu\", \"cuda\" or \"cuda:<i>\", got " .. typename(device))
  end
  local kind, index = device:match("^(%a+):?(%d*)$")
  local types = { cpu = lib.GDP_DEVICE_CPU, cuda = lib.GDP_DEVICE_CUDA }
  if kind == nil or types[kind] == nil then
    argerror("comm.backend", "device: expected \"cpu\", \"cuda\" or \"cuda:<i>\", got \"" .. device .. "\"")
  end
  local name = ffi.new("const char *[1]")
  check(lib.gdp_comm_backend(c, types[kind], tonumber(index) or 0, name), "comm.backend")
  return ffi.string(name[0])
end

-- Releases the handle now (idempotent); the MPI communicator goes with its last reference.
function C.free(c)
  if not ffi.istype(Comm_ptr, c) or freed[c] then return end
  freed[c] = true
  lib.gdp_comm_free(ffi.gc(c, nil))
end

function C.is_freed(c) return freed[c] == true end

-- Collective: turns the collectives' argument agreement off (false) or on (true).
function C.set_check(c, on)
  live(c, "set_check")
  if type(on) ~= "boolean" then argerror("comm.set_check", "on: expected a boolean, got " .. typename(on)) end
  check(lib.gdp_comm_set_check(c, on and 1 or 0), "comm.set_check")
  return c
end

function C.check_enabled(c) return lib.gdp_comm_check_enabled(live(c, "check_enabled")) == 1 end

-- Collective: ranks passing the same color >= 0 form a communicator ordered by key
-- (default: the rank in c); a negative color returns nil (this rank joins none).
function C.split(c, color, key)
  live(c, "split")
  int_arg("split", "color", color, -2147483648, 2147483647)
  if key == nil then key = lib.gdp_comm_rank(c) end
  int_arg("split", "key", key, -2147483648, 2147483647)
  local box = comm_box()
  check(lib.gdp_comm_split(c, color, key, box), "comm.split")
  return own(box[0])
end

-- New tensor [size, ...t's shape] holding every rank's t.
function C.allgather(c, t)
  live(c, "allgather")
  tensor_arg(t, "comm.allgather", "t")
  local shape = { lib.gdp_comm_size(c) }
  for i, s in ipairs(t:shape()) do shape[i + 1] = s end
  local out = new_like("allgather", t, shape)
  check(lib.gdp_comm_allgather(c, out, t), "comm.allgather")
  return out
end

-- Into an existing out [size, ...t's shape]; t may be out[rank + 1] itself (in place).
function C.allgather_into(c, out, t)
  live(c, "allgather_into")
  tensor_arg(out, "comm.allgather_into", "out")
  tensor_arg(t, "comm.allgather_into", "t")
  check(lib.gdp_comm_allgather(c, out, t), "comm.allgather_into")
  return out
end

local function rows_array(fn, what, rows, n)
  if type(rows) ~= "table" or #rows ~= n then
    argerror("comm." .. fn, string.format("%s: expected a table of %d row counts (one per rank), got %s",
                                          what, n, type(rows) == "table" and (#rows .. " entries") or typename(rows)))
  end
  local arr, sum = i64_array(n), 0
  for j = 1, n do
    local r = rows[j]
    util.int_arg("comm." .. fn, string.format("%s[%d]", what, j), r, 0)
    arr[j - 1] = r
    sum = sum + r
  end
  return arr, sum
end

-- all_to_all(t): dim 1 of t split into `size` equal blocks, block j to rank j; the
-- result (t's shape) holds block i from rank i.
-- all_to_all(t, send_rows, recv_rows): send_rows[j + 1] consecutive rows of t go to
-- rank j, recv_rows[j + 1] rows come from rank j (tables of `size` counts).  Without
-- recv_rows, the counts are exchanged first (one more collective).
function C.all_to_all(c, t, send_rows, recv_rows)
  live(c, "all_to_all")
  tensor_arg(t, "comm.all_to_all", "t")
  if send_rows == nil then
    if recv_rows ~= nil then argerror("comm.all_to_all", "recv_rows given without send_rows") end
    local out = new_like("all_to_all", t, t:shape())
    check(lib.gdp_comm_alltoall(c, out, t), "comm.all_to_all")
    return out
  end
  local n = lib.gdp_comm_size(c)
  local sr = rows_array("all_to_all", "send_rows", send_rows, n)
  if recv_rows == nil then
    local counts = tensor.tensor(send_rows, { dtype = "i64" })
    local got = C.all_to_all(c, counts)
    recv_rows = got:totable()
  end
  local rr, rsum = rows_array("all_to_all", "recv_rows", recv_rows, n)
  local shape = t:shape()
  if #shape < 1 then argerror("comm.all_to_all", "t: expected at least 1 dim, got a 0-dim tensor") end
  shape[1] = rsum
  local out = new_like("all_to_all", t, shape)
  check(lib.gdp_comm_alltoallv(c, out, rr, t, sr), "comm.all_to_all")
  return out
end

-- In place; op "sum" (default), "max" or "min".  Returns t.
function C.all_reduce(c, t, op)
  live(c, "all_reduce")
  tensor_arg(t, "comm.all_reduce", "t")
  local code = REDUCE_OPS[op or "sum"]
  if code == nil then
    argerror("comm.all_reduce", "op: expected \"sum\", \"max\" or \"min\", got " ..
             (type(op) == "string" and ("'" .. op .. "'") or typename(op)))
  end
  check(lib.gdp_comm_allreduce(c, t, code), "comm.all_reduce")
  return t
end

-- t on every rank becomes root's t (root default 0).  Returns t.
function C.broadcast(c, t, root)
  live(c, "broadcast")
  tensor_arg(t, "comm.broadcast", "t")
  root = root or 0
  int_arg("broadcast", "root", root, 0, lib.gdp_comm_size(c) - 1)
  check(lib.gdp_comm_broadcast(c, t, root), "comm.broadcast")
  return t
end

function C.send(c, t, peer, tag)
  live(c, "send")
  tensor_arg(t, "comm.send", "t")
  int_arg("send", "peer", peer, 0, lib.gdp_comm_size(c) - 1)
  int_arg("send", "tag", tag or 0, 0, 2147483647)
  check(lib.gdp_comm_send(c, t, peer, tag or 0), "comm.send")
end

-- Receives into t (exactly the sent number of elements).  Returns t.
function C.recv(c, t, peer, tag)
  live(c, "recv")
  tensor_arg(t, "comm.recv", "t")
  int_arg("recv", "peer", peer, 0, lib.gdp_comm_size(c) - 1)
  int_arg("recv", "tag", tag or 0, 0, 2147483647)
  check(lib.gdp_comm_recv(c, t, peer, tag or 0), "comm.recv")
  return t
end

-- Sends send_t to dst and receives recv_t from src at once; dst or src -1 (or nil)
-- skips that half (the ends of a chain).  Returns recv_t.
function C.sendrecv(c, send_t, dst, recv_t, src, tag)
  live(c, "sendrecv")
  local size = lib.gdp_comm_size(c)
  dst = dst == nil and -1 or dst
  src = src == nil and -1 or src
  int_arg("sendrecv", "dst", dst, -1, size - 1)
  int_arg("sendrecv", "src", src, -1, size - 1)
  if dst >= 0 then tensor_arg(send_t, "comm.sendrecv", "send_t") end
  if src >= 0 then tensor_arg(recv_t, "comm.sendrecv", "recv_t") end
  int_arg("sendrecv", "tag", tag or 0, 0, 2147483647)
  check(lib.gdp_comm_sendrecv(c, dst >= 0 and send_t or nil, dst, src >= 0 and recv_t or nil, src,
                              tag or 0), "comm.sendrecv")
  return recv_t
end

function C.barrier(c)
  check(lib.gdp_comm_barrier(live(c, "barrier")), "comm.barrier")
end

-- Collective: raises the same error on every rank when any rank passes ok == false
-- (or nil); the message names the failing ranks and the first one's msg.
function C.check(c, ok, msg)
  live(c, "check")
  local status = ok and lib.GDP_OK or lib.GDP_ERR_INVALID_ARG
  local text = ok and "" or tostring(msg or "check failed")
  check(lib.gdp_comm_agree_status(c, status, text), "comm.check")
  return true
end

-- Runs fn(...) under pcall on this rank, then agrees: returns fn's results when it
-- succeeded on every rank, else raises on every rank the first failing rank's error
-- (a gdp error keeps its status).
function C.pcall(c, fn, ...)
  live(c, "pcall")
  local res = pack(pcall(fn, ...))
  local status, text = lib.GDP_OK, ""
  if not res[1] then
    local err = res[2]
    status = tensor.is_error(err) and err.code or lib.GDP_ERR_INVALID_ARG
    text = tostring(err)
  end
  check(lib.gdp_comm_agree_status(c, status, text), "comm.pcall")
  return unpack(res, 2, res.n)
end

-- Collective: raises on every rank unless every rank passes the same integers (a Lua
-- table of numbers or booleans); `what` names them in the message.
function C.agree(c, what, values)
  live(c, "agree")
  what = tostring(what or "values")
  local n, arr, bad = 0, nil, nil
  if type(values) ~= "table" then
    bad = "values: expected a table of integers, got " .. typename(values)
  else
    n = #values
    arr = i64_array(math.max(n, 1))
    for i = 1, n do
      local v = values[i]
      if type(v) == "boolean" then v = v and 1 or 0 end
      if type(v) ~= "number" or v ~= math.floor(v) or math.abs(v) > 2 ^ 53 then
        bad = string.format("%s[%d]: expected an integer, got %s", what, i, tostring(values[i]))
        break
      end
      arr[i - 1] = v
    end
  end
  -- the local check is agreed first, so a rank with bad values cannot leave the others waiting
  check(lib.gdp_comm_agree_status(c, bad and lib.GDP_ERR_INVALID_ARG or lib.GDP_OK,
                                  bad and ("gdp.comm.agree: " .. bad) or ""), "comm.agree")
  check(lib.gdp_comm_agree_values(c, what, arr, n), "comm.agree")
  return true
end

-- Payload bytes of this rank since the last reset (see gdp.h): sent/received count
-- traffic to and from other ranks; the _incl_self pair also counts this rank's own
-- block (docs/design.md's per-rank volume formulas count that way).
function C.bytes(c)
  live(c, "bytes")
  return {
    sent = tonumber(lib.gdp_comm_bytes_sent(c)),
    received = tonumber(lib.gdp_comm_bytes_received(c)),
    sent_incl_self = tonumber(lib.gdp_comm_bytes_sent_incl_self(c)),
    received_incl_self = tonumber(lib.gdp_comm_bytes_received_incl_self(c)),
  }
end

function C.reset_bytes(c)
  lib.gdp_comm_reset_counters(live(c, "reset_bytes"))
end

local comm_mt = {
  __index = C,
  __tostring = function(c)
    if freed[c] then return "gdp.Comm<freed>" end
    return string.format("gdp.Comm<%s, rank %d of %d>", lib.gdp_comm_is_mpi(c) == 1 and "mpi" or "no mpi",
                         lib.gdp_comm_rank(c), lib.gdp_comm_size(c))
  end,
}
ffi.metatype("struct gdp_comm", comm_mt)

return M
