-- check_reference: runs golden reference cases through gdp and reports the relative
-- error of every output and gradient against the file's float64 values.
--
--   ./gdp experiments/check_reference.lua [--device cpu|cuda] [--dtype f64|f32|bf16]
--         [--algorithm auto|chunk|recurrent] [--save-for-backward] FILE...
--
-- Without FILE, every *.safetensors in spec/fixtures/golden/.  Exits 1 when any error
-- exceeds the dtype's tolerance (f64 1e-10, f32 1e-4, bf16 1e-2) or is NaN, or when a
-- case fails to run; 2 on a usage error (a FILE that cannot be read, a device that is
-- not there).  The case format is described in spec/fixtures/golden/README.md
-- (operator cases: q, k, v, beta, g, h0, cu_seqlens, do, dht and the references).
-- --save-for-backward: the forward saves for backward and the backward reads what it
-- kept (cuda variant 3's saving path; elsewhere nothing is kept and it recomputes).
-- Mixer-layer cases (mixer_*.safetensors, holding in_proj.weight) run through
-- gdp.nn.GatedDeltaProduct and check out, grad.x and every grad.<param>: on the cpu in
-- f64/f32, on cuda in f32/bf16 (the layer's dtypes there; f64 on cuda is skipped).
-- Their bf16 rows also print the bf16 storage floor (gdp.nn.golden): the error of the
-- float64 layer whose stage outputs are rounded to bf16, so that a failing row at its
-- floor reads as the cost of bf16 storage, not of the kernels.

local config = {
  device = "cpu",        -- cpu | cuda | cuda:<i>
  dtype = "f64",         -- f64 | f32 | bf16: inputs are converted from the file's f64
  algorithm = "auto",    -- auto | chunk | recurrent
  fixtures = "spec/fixtures/golden",
  tol = 0,               -- 0: the dtype's tolerance
  save_for_backward = false, -- the operator cases' forwards save for the backward
}

local gdp = require("gdp")
local util = require("gdp.util")

local opts, files = util.parse_args(arg, config, {
  usage = "./gdp experiments/check_reference.lua [options] FILE...",
  description = "Checks gdp's operator against golden float64 reference cases.",
  help = {
    { "device", "device to run on" },
    { "dtype", "dtype of the inputs" },
    { "algorithm", "operator algorithm" },
    { "fixtures", "folder searched when no FILE is given" },
    { "tol", "relative-error tolerance; 0: f64 1e-10, f32 1e-4, bf16 1e-2 (operator dbeta, dg, dh0: 2e-2)" },
    { "save_for_backward", "operator cases: the forward saves, the backward reads it" },
  },
  choices = { dtype = { "f64", "f32", "bf16" }, algorithm = { "auto", "chunk", "recurrent" } },
})

if #files == 0 then
  local p = io.popen("ls -1 " .. util.shell_quote(opts.fixtures) .. "/*.safetensors 2>/dev/null")
  for line in p:lines() do files[#files + 1] = line end
  p:close()
  if #files == 0 then
    io.stderr:write("check_reference: no FILE given and no *.safetensors in ", opts.fixtures, "\n")
    os.exit(2)
  end
end

-- A FILE that cannot be read is a usage error (exit 2), not a failed case.
for _, path in ipairs(files) do
  local f, why = io.open(path, "rb")
  if not f then
    io.stderr:write("check_reference: cannot read ", path, ": ", (tostring(why):gsub("^.-: ", "")), "\n")
    os.exit(2)
  end
  f:close()
end

local tol = opts.tol > 0 and opts.tol or gdp.ops.TOLERANCE[opts.dtype]
-- the operator's bound per tensor (gdp.ops.tolerance) unless --tol sets one
local operator_tol = opts.tol > 0 and opts.tol or nil

-- A checker returns rows {tensor =, err =, tol =, status =, note =} for one case.
local function check_operator(t, meta)
  local rows, times = gdp.ops.check_golden_case(t, meta, {
    dtype = opts.dtype, device = opts.device, algorithm = opts.algorithm, tol = operator_tol,
    save_for_backward = opts.save_for_backward,
  })
  local out = {}
  for _, r in ipairs(rows) do
    out[#out + 1] = { tensor = r.name, err = r.err, tol = r.tol, status = r.ok and "PASS" or "FAIL" }
  end
  return out, string.format("fwd %.1f ms, bwd %.1f ms", times.fwd_ms, times.bwd_ms)
end

local function check_mixer(t, meta)
  local on_cuda = opts.device:match("^cuda") ~= nil
  local dtypes = on_cuda and { f32 = true, bf16 = true } or { f64 = true, f32 = true }
  if not dtypes[opts.dtype] then
    return { { tensor = "-", status = "skipped",
               note = "the mixer layer takes " .. (on_cuda and "f32/bf16 on cuda" or "f64/f32 on the cpu") ..
                      " (got " .. opts.device .. ", " .. opts.dtype .. ")" } }
  end
  local rows, times = require("gdp.nn.golden").check_case(t, meta, {
    dtype = opts.dtype, device = opts.device, tol = tol,
  })
  local out = {}
  for _, r in ipairs(rows) do
    -- Below f64, err is against the float64 layer on the rounded inputs (gdp.nn.golden).
    local note = opts.dtype ~= "f64" and string.format("vs file %.2e", r.err_file) or nil
    if r.err_floor then note = note .. string.format("; bf16 storage floor %.2e", r.err_floor) end
    out[#out + 1] = { tensor = r.name, err = r.err, tol = r.tol, status = r.ok and "PASS" or "FAIL",
                      note = note }
  end
  return out, string.format("fwd %.1f ms, bwd %.1f ms", times.fwd_ms, times.bwd_ms)
end

local CHECKERS = {
  operator = check_operator,
  mixer = check_mixer,
}

local function case_kind(path, t, meta)
  if t["in_proj.weight"] or meta.d_model or path:match("mixer_[^/]*$") then return "mixer" end
  return "operator"
end

util.device_or_exit("check_reference", opts.device)

-- Every run is recorded like the other studies' (experiments/runs/check_reference/...):
-- meta.json (the options, status) and results.csv, one row per checked tensor.
local run = require("gdp.results").new_run("check_reference", { config = opts, args = arg })
local csv = run:csv({ "file", "kind", "tensor", "rel_err", "tol", "status", "note" })

print(string.format("# gdp %s, device %s, dtype %s, algorithm %s, tolerance %.0e",
                    gdp.version, opts.device, opts.dtype, opts.algorithm, tol))

local table_rows = {}
local failures, checked, skipped = 0, 0, 0
for _, path in ipairs(files) do
  local name = path:match("[^/]+$")
  local ok, err = pcall(function()
    -- loaded on the cpu: the checker moves what it needs to the device
    local t, meta = gdp.load(path)
    local kind = case_kind(path, t, meta)
    local rows, note = CHECKERS[kind](t, meta)
    for _, r in ipairs(rows) do
      local notes = {}
      if r.note then notes[#notes + 1] = r.note end
      if note then notes[#notes + 1] = note end
      table_rows[#table_rows + 1] = { name, kind, r.tensor, r.err or "", r.tol or "", r.status,
                                      table.concat(notes, "; ") }
      if r.status == "FAIL" then failures = failures + 1 end
      if r.status == "PASS" then checked = checked + 1 end
      if r.status == "skipped" then skipped = skipped + 1 end
      note = nil -- once per case
    end
  end)
  if not ok then
    failures = failures + 1
    table_rows[#table_rows + 1] = { name, "?", "-", "", "", "ERROR", tostring(err) }
  end
end

print(util.format_table({ "file", "kind", "tensor", "rel_err", "tol", "status", "note" }, table_rows, "%.2e"))
print(string.format("# %d checked, %d failed, %d skipped", checked, failures, skipped))
for _, r in ipairs(table_rows) do
  csv:row({ file = r[1], kind = r[2], tensor = r[3], rel_err = r[4], tol = r[5], status = r[6], note = r[7] })
end
run:finish({ checked = checked, failed = failures, skipped = skipped,
             status = failures == 0 and "ok" or "failed",
             reason = failures > 0 and (failures .. " tensors out of tolerance or errors") or nil })
os.exit(failures > 0 and 1 or 0)
