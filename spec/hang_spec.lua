-- Failures on one rank of a multi-rank job end the whole job promptly with that rank's
-- message, instead of hanging the others in their next collective.  These specs start
-- `mpirun -np 2 ./gdp script.lua` themselves (not tagged #mpi: they must not run inside
-- another mpirun), each under `timeout`, so a regression fails instead of hanging CI.
local root = os.getenv("GDP_ROOT") or "."
-- the launcher must use this run's build (not build a default one): GDP_LIB's folder
local build = (os.getenv("GDP_LIB") or ""):match("^(.*)/[^/]+$")
local env = build and string.format("GDP_BUILD_DIR=%q ", build) or ""
do -- and configure it as it is (a CPU-only build stays one: no reconfigure, no CUDA build)
  local f = build and io.open(build .. "/CMakeCache.txt", "r")
  if f then
    if f:read("*a"):find("GDP_CUDA:BOOL=OFF", 1, true) then env = env .. "GDP_NO_CUDA=1 " end
    f:close()
  end
end
local LIMIT = 60 -- seconds; a healthy failing job ends in a few

local function have_mpi()
  local ok = os.execute("command -v mpirun >/dev/null 2>&1")
  if not (ok == true or ok == 0) then return false end
  local f = io.open((os.getenv("GDP_LIB") or ""):gsub("libgdp%.so$", "CMakeCache.txt"), "r")
  if not f then return false end
  local cache = f:read("*a")
  f:close()
  return cache:find("GDP_MPI:BOOL=ON", 1, true) ~= nil
end

-- Runs `body` as a script on 2 ranks; returns the exit status and the output.
local function run_ranks(body)
  local script = os.tmpname() .. ".lua"
  local f = assert(io.open(script, "w"))
  f:write(body)
  f:close()
  local version = io.popen("mpirun --version 2>&1"):read("*a")
  local cmd = string.format(env .. "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " ..
                            "timeout -k 5 %d mpirun -np 2 %s %s/gdp %s 2>&1; echo \"rc=$?\"", LIMIT,
                            version:find("Open MPI", 1, true) and "--oversubscribe" or "", root, script)
  local p = assert(io.popen(cmd))
  local out = p:read("*a")
  p:close()
  os.remove(script)
  return tonumber(out:match("rc=(%d+)%s*$")), out
end

describe("a failure on one rank ends every rank", function()
  local mpi = have_mpi()

  it("an uncaught error before a collective", function()
    if not mpi then return pending("no mpirun or built without MPI") end
    local rc, out = run_ranks([[
local c = require("gdp").comm.world()
if c:rank() == 1 then error("boom on rank one") end
c:barrier()
]])
    assert.is_true(rc ~= 0 and rc ~= 124 and rc ~= 137, "exit status " .. tostring(rc) .. ":\n" .. out)
    assert.truthy(out:find("rank 1 of 2: [^\n]*boom on rank one"), out)
  end)

  it("os.exit with a failing status before a collective", function()
    if not mpi then return pending("no mpirun or built without MPI") end
    local rc, out = run_ranks([[
local c = require("gdp").comm.world()
if c:rank() == 0 then os.exit(3) end
c:barrier()
]])
    assert.is_true(rc ~= 0 and rc ~= 124 and rc ~= 137, "exit status " .. tostring(rc) .. ":\n" .. out)
    assert.truthy(out:find("rank 0 of 2 failed (exit status 3)", 1, true), out)
  end)
end)

describe("./gdp", function()
  it("says what is wrong with a missing script (exit 2)", function()
    local p = io.popen(env .. root .. "/gdp /nonexistent/nosuch.lua 2>&1; echo \"rc=$?\"")
    local out = p:read("*a")
    p:close()
    assert.truthy(out:find("no such file", 1, true), out)
    assert.truthy(out:find("rc=2", 1, true), out)
  end)

  it("prints its version", function()
    local p = io.popen(env .. root .. "/gdp --version 2>&1")
    local out = p:read("*a")
    p:close()
    assert.truthy(out:match("^gdp %d+%.%d+"), out)
  end)
end)
