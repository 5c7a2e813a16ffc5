-- busted helper (see .busted): loads gdp, fixes and prints the seed, registers
-- assert.tensor_near, and provides the global `gdp_test` with helpers shared by the
-- specs.  GDP_TEST_SEED=<n> reruns with another seed.
local gdp = require("gdp")
local say = require("say")
local luassert = require("luassert")

local seed = tonumber(os.getenv("GDP_TEST_SEED")) or 20250611
gdp.manual_seed(seed)
io.stderr:write(string.format("gdp specs: seed %d (set GDP_TEST_SEED to change), libgdp %s, devices %s\n",
                              seed, gdp.version, table.concat(gdp.devices(), " ")))

local H = {}
_G.gdp_test = H
H.seed = seed

-- The specs' shared modules (op_cases.lua) live beside them.
package.path = "./spec/?.lua;" .. package.path

-- Every device a spec runs on, with the busted tag that CPU-only runs exclude
-- (./gdp test passes --exclude-tags=gpu without a GPU and says so).
H.DEVICES = { { name = "cpu", tag = "" }, { name = "cuda", tag = " #gpu" } }

-- True when the library can run on `device`; otherwise marks the running test pending
-- with the reason (a run that did not exclude #gpu shows why it did nothing).
function H.need_device(device)
  if device == "cpu" then return true end
  if device == "cuda" and gdp.has_cuda() then return true end
  -- busted puts `pending` in the spec file's environment, not in this one's
  getfenv(2).pending("no " .. device .. " device (gdp.devices(): " .. table.concat(gdp.devices(), " ") .. ")")
  return false
end

-- Reseeds from the base seed and a per-test salt so that a test's random inputs do
-- not depend on which tests ran before it.
function H.reseed(salt)
  gdp.manual_seed(seed + (salt or 0))
end

-- ||actual - ref|| / ||ref|| after bringing both to f64 on the cpu (rel_error itself
-- may require one dtype and device).
function H.rel_error(actual, ref)
  if actual:dtype() ~= ref:dtype() or actual:device() ~= ref:device() then
    actual = actual:to({ dtype = "f64", device = "cpu" })
    ref = ref:to({ dtype = "f64", device = "cpu" })
  end
  return gdp.rel_error(actual, ref)
end

-- assert.tensor_near(actual, ref, rtol[, what]): same shape and ||a - ref|| / ||ref||
-- <= rtol (NaN never passes); `what` names the result in the message.
local function tensor_near(state, arguments)
  local actual, ref, rtol = arguments[1], arguments[2], arguments[3] or 1e-10
  local what = arguments[4] and (tostring(arguments[4]) .. ": ") or ""
  local msg
  if not gdp.is_tensor(actual) or not gdp.is_tensor(ref) then
    msg = string.format("expected two gdp tensors, got %s and %s", type(actual), type(ref))
  else
    local sa, sr = actual:shape(), ref:shape()
    if table.concat(sa, "x") ~= table.concat(sr, "x") then
      msg = string.format("shapes differ: actual [%s], ref [%s]", table.concat(sa, "x"), table.concat(sr, "x"))
    else
      local err = H.rel_error(actual, ref)
      if err ~= err or not (err <= rtol) then
        msg = string.format("relative error %.3e > rtol %.1e (actual %s, ref %s, seed %d)",
                            err, rtol, actual:description(), ref:description(), seed)
      else
        msg = string.format("relative error %.3e <= rtol %.1e", err, rtol)
        arguments.nofmt = { true }
        arguments[1], arguments.n = msg, 1
        return true
      end
    end
  end
  arguments.nofmt = { true }
  arguments[1], arguments.n = what .. msg, 1
  return false
end

say:set("assertion.tensor_near.positive", "Expected tensors to be near:\n%s")
say:set("assertion.tensor_near.negative", "Expected tensors not to be near:\n%s")
luassert:register("assertion", "tensor_near", tensor_near,
                  "assertion.tensor_near.positive", "assertion.tensor_near.negative")

-- The GDP mixer's gate parameters A_log and dt_bias have per-head gradients that are
-- sums over every token: dA_log_h = sum_t dg_t g_t and ddt_bias_h = sum_t dg_t dg_t/da_t
-- (g = -exp(A_log) softplus(a + dt_bias)).  With mixed signs such a sum can cancel to a
-- small fraction of its terms, and then a relative error of the sum measures the
-- cancellation, not the computation: bf16 errors of ~1e-2 per term became 6e-2 of a
-- two-head dt_bias gradient on the H200.  These gradients are held instead to
-- max_h |actual_h - ref_h| / sum_t |term_t,h| <= rtol: every token's term within rtol,
-- whatever the cancellation (errors aligned over all tokens would reach rtol; a term
-- lost or of the wrong sign goes past it).
H.GATE_SUM_PARAMS = { A_log = true, dt_bias = true }

local function host_values(t) return t:to({ dtype = "f64", device = "cpu" }):contiguous():flat() end

-- Per head, sum over tokens of |term| for "A_log" and "dt_bias" of a float64 cpu
-- GatedDeltaProduct whose cached forward is the one `dy` [T,B,D] is the output
-- gradient of.  Reruns the out and operator backward stages (the gradients the module
-- holds are restored).
function H.gate_term_scales(mixer, dy)
  local c = assert(mixer.cache, "gate_term_scales: the mixer has no cached forward")
  assert(c.inp.g ~= nil, "gate_term_scales: the mixer has no forget gate")
  local grads, kept = mixer:gradients(), {}
  for name, t in pairs(grads) do kept[name] = t:clone() end
  local d_o = mixer:out_backward(c.saved, c.parts.z, c.inp.x_v, dy)
  local dg = host_values(mixer:ssm_backward(c.inp, c.cu, d_o).dg) -- [B,T,nh]
  for name, t in pairs(grads) do t:copy(kept[name]) end
  local g = host_values(c.inp.g) -- [B,T,nh]
  local a = host_values(c.parts.a:permute(2, 1, 3)) -- [B,T,nh]
  local A_log, dt = host_values(mixer.params["A_log"]), host_values(mixer.params["dt_bias"])
  local nh = #A_log
  local S = { A_log = {}, dt_bias = {} }
  for h = 1, nh do S.A_log[h], S.dt_bias[h] = 0, 0 end
  for i = 1, #dg do
    local h = (i - 1) % nh + 1
    local x = a[i] + dt[h]
    local sig = 1 / (1 + math.exp(-x))
    S.A_log[h] = S.A_log[h] + math.abs(dg[i] * g[i])
    S.dt_bias[h] = S.dt_bias[h] + math.abs(dg[i] * math.exp(A_log[h]) * sig)
  end
  return S
end

-- Asserts max_h |actual_h - ref_h| / scale_h <= rtol (scale from gate_term_scales).
function H.assert_gate_sum_near(actual, ref, scale, rtol, what)
  local x, y = host_values(actual), host_values(ref)
  assert(#x == #y and #x == #scale, string.format("%s: %d values, %d reference values, %d scales", what, #x, #y, #scale))
  local worst = 0
  for h = 1, #x do
    assert(scale[h] > 0, string.format("%s: head %d has no gate terms (scale 0)", what, h))
    local e = math.abs(x[h] - y[h]) / scale[h]
    if not (e <= worst) then worst = e end
  end
  assert(worst <= rtol, string.format("%s: error %.3e of the summed terms > rtol %.1e (relative error of the sum %.3e, seed %d)",
                                      what, worst, rtol, H.rel_error(actual, ref), seed))
end

-- Makes every GatedDeltaProduct inside `model` (a module tree through .children, or the
-- mixer itself) record the output gradient its backward gets: returns
-- {[prefix] = {module = mixer, dy = <set by each backward>}}, prefix its parameter-name
-- prefix ("" for the model itself, "layers.0.mixer." ...).
function H.record_mixer_grads(model)
  local rec = {}
  local function visit(m, prefix)
    local cls = getmetatable(m)
    if cls and cls.__name == "GatedDeltaProduct" then
      local entry = { module = m }
      rec[prefix] = entry
      m.backward = function(self, x, dy, ...)
        entry.dy = dy
        return cls.backward(self, x, dy, ...)
      end
    end
    for _, child in ipairs(m.children or {}) do visit(child[2], prefix .. child[1] .. ".") end
  end
  visit(model, "")
  return rec
end

-- Checks the gradients of `names` of a model against its float64 cpu reference
-- (H.record_mixer_grads(ref) set up before the backward): tensor_near within rtol (a
-- number, or a table: rtol[name], else rtol.default), but the mixers' A_log and
-- dt_bias against their summed terms when sum_terms is set.
function H.assert_model_grads_near(g, rg, names, rtol, rec, sum_terms)
  local scales = {}
  for prefix, entry in pairs(rec or {}) do
    if sum_terms and entry.module.cache and entry.module.cache.inp.g ~= nil then
      scales[prefix] = H.gate_term_scales(entry.module, entry.dy)
    end
  end
  for _, name in ipairs(names) do
    local prefix, leaf = name:match("^(.-)([^.]+)$")
    local tol = rtol
    if type(rtol) == "table" then tol = rtol[name] or rtol.default end
    if sum_terms and H.GATE_SUM_PARAMS[leaf] and scales[prefix] then
      H.assert_gate_sum_near(g[name], rg[name], scales[prefix][leaf], tol, name)
    else
      luassert.tensor_near(g[name], rg[name], tol, name)
    end
  end
end

-- Calls fn, expects an error, and checks that its text (tostring: gdp error tables
-- have a __tostring) contains every plain substring given.  Returns the error text.
function H.expect_error(fn, ...)
  local ok, err = pcall(fn)
  assert(not ok, "expected an error, but the call succeeded")
  local text = tostring(err)
  for i = 1, select("#", ...) do
    local needle = select(i, ...)
    if not text:find(needle, 1, true) then
      error(string.format("error message lacks %q:\n  %s", needle, text), 2)
    end
  end
  return text, err
end

-- Relative error of central differences against the analytic gradient over `samples`
-- random entries of a contiguous tensor p (modified in place and restored).  fourth:
-- the fourth-order stencil (f(x-2h) - 8 f(x-h) + 8 f(x+h) - f(x+2h)) / 12h with h =
-- 1e-4 instead of the second-order one with h = 1e-5: for strongly curved losses
-- whose small gradients the second-order rounding and truncation would swamp.
function H.fd_error(loss, p, grad, samples, fourth)
  local flat, gflat = p:view(p:numel()), grad:contiguous():view(grad:numel())
  local n = p:numel()
  local h = fourth and 1e-4 or 1e-5
  local function at(i, x)
    flat:set(x, i)
    return loss()
  end
  local num, den = 0, 0
  for s = 1, math.min(samples, n) do
    local i = samples >= n and s or math.random(n)
    local keep = flat:get(i)
    local fd
    if fourth then
      fd = (at(i, keep - 2 * h) - 8 * at(i, keep - h) + 8 * at(i, keep + h) - at(i, keep + 2 * h))
           / (12 * h)
    else
      fd = (at(i, keep + h) - at(i, keep - h)) / (2 * h)
    end
    flat:set(keep, i)
    local g = gflat:get(i)
    num = num + (fd - g) ^ 2
    den = den + g * g
  end
  if den == 0 then return num == 0 and 0 or math.huge end
  return math.sqrt(num / den)
end

-- A quick check that the library still works (after an error).
function H.assert_alive()
  local t = gdp.tensor({ 1, 2, 3 }, { dtype = "f64" })
  luassert.are.equal(6, t:sum())
  luassert.are.equal(14, (t * t):sum())
end

-- Folder of the golden operator cases copied into the project.
H.golden_dir = os.getenv("GDP_GOLDEN_DIR") or "spec/fixtures/golden"

-- Running the launcher from a spec (`./gdp script.lua`, or `mpirun -np N ./gdp ...`):
-- the environment prefix that makes it use this run's build (GDP_LIB's folder, not a
-- default one) configured as it is (a CPU-only build stays one), and whether a
-- multi-rank run can start here (mpirun and an MPI build).  Such specs are not tagged
-- #mpi: they must not run inside another mpirun.
H.root = os.getenv("GDP_ROOT") or "."
do
  local build = (os.getenv("GDP_LIB") or ""):match("^(.*)/[^/]+$")
  local env = build and string.format("GDP_BUILD_DIR=%q ", build) or ""
  local cache = ""
  local f = build and io.open(build .. "/CMakeCache.txt", "r")
  if f then
    cache = f:read("*a")
    f:close()
  end
  if cache:find("GDP_CUDA:BOOL=OFF", 1, true) then env = env .. "GDP_NO_CUDA=1 " end
  H.launcher_env = env
  local ok = os.execute("command -v mpirun >/dev/null 2>&1")
  H.can_mpirun = (ok == true or ok == 0) and cache:find("GDP_MPI:BOOL=ON", 1, true) ~= nil
end

-- The command line of `./gdp script args` on np ranks (np nil: no mpirun), as root too,
-- under `timeout` (limit seconds), stderr with stdout, ending in "rc=<exit status>".
function H.launcher_cmd(np, script, args, limit)
  local mpi = ""
  if np then
    local version = io.popen("mpirun --version 2>&1"):read("*a")
    mpi = string.format("mpirun -np %d %s ", np, version:find("Open MPI", 1, true) and "--oversubscribe" or "")
  end
  return string.format(H.launcher_env .. "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " ..
                       "timeout -k 5 %d %s%s/gdp %s %s 2>&1; echo \"rc=$?\"", limit or 60, mpi, H.root,
                       script, args or "")
end

-- Runs cmd in a shell, stderr with stdout: returns that output and the exit status.
function H.sh(cmd)
  local p = assert(io.popen("{ " .. cmd .. "; } 2>&1; echo \"rc=$?\""))
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("rc=(%d+)%s*$"))
  return (out:gsub("rc=%d+%s*$", "")), rc
end

function H.list_files(dir, pattern)
  local out = {}
  local p = io.popen("ls -1 " .. dir .. " 2>/dev/null")
  if p then
    for line in p:lines() do
      if line:match(pattern) then out[#out + 1] = dir .. "/" .. line end
    end
    p:close()
  end
  table.sort(out)
  return out
end

return H
