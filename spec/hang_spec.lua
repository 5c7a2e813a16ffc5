-- Failures on one rank of a multi-rank job end the whole job promptly with that rank's
-- message, instead of hanging the others in their next collective.  These specs start
-- `mpirun -np 2 ./gdp script.lua` themselves (not tagged #mpi: they must not run inside
-- another mpirun), each under `timeout`, so a regression fails instead of hanging CI.
local H = gdp_test
local root, env = H.root, H.launcher_env
local LIMIT = 60 -- seconds; a healthy failing job ends in a few

-- Runs `body` as a script on 2 ranks; returns the exit status and the output.
local function run_ranks(body)
  local script = os.tmpname() .. ".lua"
  local f = assert(io.open(script, "w"))
  f:write(body)
  f:close()
  local p = assert(io.popen(H.launcher_cmd(2, script, "", LIMIT)))
  local out = p:read("*a")
  p:close()
  os.remove(script)
  return tonumber(out:match("rc=(%d+)%s*$")), out
end

describe("a failure on one rank ends every rank", function()
  local mpi = H.can_mpirun

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
