-- tools/fla_state_tracking.py's own group tables (its --train data, independent of
-- gdp's generator): S3, S4 and S5 are groups of the right order, with the identity
-- first and not abelian.  Python only, no torch: runs everywhere.
local sh = gdp_test.sh

describe("tools/fla_state_tracking.py group tables", function()
  it("S3, S4, S5: closed, associative, identity first, inverses, not abelian", function()
    local script = [==[
import random, sys
sys.path.insert(0, "tools")
from fla_state_tracking import group_table
random.seed(7)
for task, order in (("S3", 6), ("S4", 24), ("S5", 120)):
    t = group_table(task)
    assert len(t) == order and all(len(r) == order and set(r) == set(range(order)) for r in t), task
    assert all(t[0][j] == j and t[j][0] == j for j in range(order)), task + ": identity"
    assert all(any(t[a][b] == 0 for b in range(order)) for a in range(order)), task + ": inverses"
    for _ in range(3000):
        a, b, c = (random.randrange(order) for _ in range(3))
        assert t[t[a][b]][c] == t[a][t[b][c]], task + ": associativity"
    assert any(t[a][b] != t[b][a] for a in range(order) for b in range(order)), task + ": abelian"
print("group tables ok")
]==]
    local path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write(script)
    f:close()
    local out, rc = sh("python3 -B " .. path)
    os.remove(path)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("group tables ok", 1, true), out)
  end)

  it("an unknown task is refused by name", function()
    local out, rc = sh("python3 -B -c 'import sys; sys.path.insert(0, \"tools\"); " ..
                       "from fla_state_tracking import group_table; group_table(\"Z7\")'")
    assert.are_not.equal(0, rc, out)
    assert.truthy(out:find("--task: expected S3, S4 or S5, got Z7", 1, true), out)
  end)
end)
