-- The mixer ops' case table (op_cases.lua: conv1d + SiLU, the beta and decay gates,
-- gated RMSNorm, the D skip, repeat_heads) on every device: each result in each dtype
-- against the float64 cpu run of the same case, within ops.TOLERANCE.  A device whose
-- backend has no mixer kernels yet answers GDP_ERR_UNSUPPORTED: its cases are pending,
-- with that reason.  cuda parts are tagged #gpu.
local gdp = require("gdp")
local H = gdp_test
local cases = require("op_cases")

for _, dev in ipairs(H.DEVICES) do
  local device = dev.name
  describe("mixer op case table on " .. device .. dev.tag, function()
    for _, case in ipairs(cases.mixer) do
      for _, dtype in ipairs(cases.MIXER_DTYPES[device]) do
        it(case.name .. " " .. dtype, function()
          if not H.need_device(device) then return end
          H.reseed(case.salt)
          local inputs = case.inputs()
          local ref = case.run(inputs)
          local ok, got = pcall(case.run, cases.convert(inputs, dtype, device))
          if not ok and type(got) == "table" and got.name == "GDP_ERR_UNSUPPORTED" and device ~= "cpu" then
            pending(tostring(got))
            return
          end
          assert(ok, tostring(got))
          local n = 0
          for name, r in pairs(ref) do
            n = n + 1
            assert.is_not_nil(got[name], name)
            assert.are.equal(dtype, got[name]:dtype(), name)
            assert.truthy(got[name]:device():find("^" .. device), name)
            assert.is_true(r:norm() > 0, name .. " of the float64 run is zero")
            assert.tensor_near(got[name], r, gdp.ops.TOLERANCE[dtype], name)
          end
          for name in pairs(got) do assert.is_not_nil(ref[name], name) end
          assert.is_true(n >= 2)
        end)
      end
    end
  end)
end
