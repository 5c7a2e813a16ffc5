-- op_fingerprint.lua -- bit-level fingerprints of the operator's outputs and gradients,
-- to prove that a refactor moved no bit: run it before and after on the same device and
-- compare the two JSON files (--compare OLD NEW exits 1 on any difference).
--
--   ./gdp tools/op_fingerprint.lua [--device cuda] [--dtype bf16] [--out FILE]
--   ./gdp tools/op_fingerprint.lua --compare before.json after.json
--
-- Cases: the benchmark shapes (H = 16, K = V = 128; 4x4096 n = 1, 2, 3 and 1x32768 n = 2)
-- on inputs drawn from fixed seeds, and every operator golden case's inputs; each through
-- the plain path and the saving path (save_for_backward = true).  A fingerprint is two
-- 32-bit hashes over the tensor's bytes, so equal fingerprints mean equal bits (up to a
-- collision), not merely small errors.
local gdp = require("gdp")
local ffi = require("ffi")
local bit = require("bit")
local util = require("gdp.util")

local function hash_tensor(t)
  if t == nil then return "nil" end
  local c = t:to({ device = "cpu", copy = true }):contiguous()
  local nbytes = c:numel() * ({ f64 = 8, f32 = 4, bf16 = 2, i32 = 4, i64 = 8 })[c:dtype()]
  local p = ffi.cast("const uint8_t *", c:data())
  local h1, h2 = 0x811c9dc5, 0x1b873593
  local words = math.floor(nbytes / 4)
  local w32 = ffi.cast("const int32_t *", p)
  for i = 0, words - 1 do
    local w = w32[i]
    h1 = bit.tobit(bit.bxor(h1, w) * 16777619 % 4294967296)
    h2 = bit.tobit(bit.rol(bit.bxor(h2, w), 13) + 0x5bd1e995 + i)
  end
  for i = words * 4, nbytes - 1 do h1 = bit.tobit(bit.bxor(h1, p[i]) * 16777619 % 4294967296) end
  c:free()
  return string.format("%08x%08x", h1 % 4294967296, h2 % 4294967296)
end

local NAMES = { "o", "ht", "dq", "dk", "dv", "dbeta", "dg", "dh0" }

local function run_case(args)
  local out = {}
  for _, save in ipairs({ false, true }) do
    local a = {}
    for key, val in pairs(args) do a[key] = val end
    a.save_for_backward = save or nil
    local o, ht, saved = gdp.ops.chunk_gated_delta_product(a)
    a.save_for_backward, a.saved = nil, saved
    local grads = gdp.ops.chunk_gated_delta_product_backward(a)
    if saved then saved:free() end
    local got = { o = o, ht = ht }
    for key, val in pairs(grads) do got[key] = val end
    local row = {}
    for _, name in ipairs(NAMES) do
      if got[name] ~= nil then row[name] = hash_tensor(got[name]); got[name]:free() end
    end
    out[save and "saving" or "plain"] = row
  end
  return out
end

local function collect(device, dtype)
  local cases = {}
  local SHAPES = { { 4, 4096, 1 }, { 4, 4096, 2 }, { 4, 4096, 3 }, { 1, 32768, 2 } }
  for i, s in ipairs(SHAPES) do
    gdp.manual_seed(1000 + i)
    local args = gdp.ops.random_inputs { B = s[1], T = s[2], H = 16, K = 128, V = 128, n = s[3],
                                         dtype = dtype, device = device, grads = true }
    local name = string.format("%dx%dx%d", s[1], s[2], s[3])
    cases[name] = run_case(args)
    gdp.ops.free_all(args)
    io.stderr:write("fingerprinted " .. name .. "\n")
  end
  local here = debug.getinfo(1, "S").source:match("^@(.*)/tools/[^/]*$") or "."
  local golden = here .. "/spec/fixtures/golden"
  local p = io.popen("ls " .. golden .. "/gdp_*.safetensors")
  for file in p:lines() do
    local t, meta = gdp.load(file)
    local args = {
      q = t.q, k = t.k, v = t.v, g = t.g, beta = t.beta, initial_state = t.h0,
      cu_seqlens = t.cu_seqlens, ["do"] = t["do"], dht = t.dht,
      num_householder = tonumber(meta.num_householder), scale = tonumber(meta.scale),
      use_qk_l2norm_in_kernel = meta.use_qk_l2norm == "true", output_final_state = t.ht ~= nil,
    }
    args = gdp.ops.convert_inputs(args, dtype, device)
    cases[file:match("([^/]+)%.safetensors$")] = run_case(args)
  end
  p:close()
  return cases
end

local function read_json(path)
  local f = assert(io.open(path, "r"))
  local s = f:read("*a")
  f:close()
  return util.json_decode(s)
end

local args, files = util.parse_args(arg, { device = "cuda", dtype = "bf16", out = "", compare = false },
                                    { usage = "./gdp tools/op_fingerprint.lua [--device D --dtype T --out F] | --compare OLD NEW" })
if args.compare then
  local a, b = read_json(files[1]), read_json(files[2])
  local diffs, n = 0, 0
  for case, modes in pairs(a.cases) do
    for mode, row in pairs(modes) do
      for name, h in pairs(row) do
        n = n + 1
        local other = b.cases[case] and b.cases[case][mode] and b.cases[case][mode][name]
        if other ~= h then
          diffs = diffs + 1
          print(string.format("DIFFERS %s %s %s: %s vs %s", case, mode, name, h, tostring(other)))
        end
      end
    end
  end
  print(string.format("op_fingerprint compare: %d of %d tensors differ", diffs, n))
  os.exit(diffs == 0 and 0 or 1)
end

local doc = { tool = "op_fingerprint", device = args.device, dtype = args.dtype,
              git_sha = util.capture("git rev-parse --short HEAD 2>/dev/null"), cases = collect(args.device, args.dtype) }
local text = util.json_encode(doc)
if args.out ~= "" then
  local f = assert(io.open(args.out, "w"))
  f:write(text, "\n")
  f:close()
  print("op_fingerprint: wrote " .. args.out)
else
  print(text)
end
