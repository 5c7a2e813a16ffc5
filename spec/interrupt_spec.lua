-- Cancellation (gdp.h "interrupts"): a long CPU op stops when the interrupt flag is
-- set mid-op (the test hook gdp_interrupt_request_after counts kernel polls), raises
-- GDP_ERR_INTERRUPTED, leaks nothing and leaves the library usable; a flag that lands
-- while a call's outputs are being wrapped is raised only once they are owned.
local gdp = require("gdp")
local H = gdp_test
local lib = gdp.lib

local function live_after_collect()
  collectgarbage("collect")
  collectgarbage("collect")
  return gdp.memory_live_bytes("cpu")
end

local function inputs(algorithm)
  H.reseed(31)
  local a = gdp.ops.random_inputs { T = 600, K = 16, V = 16, H = 2, n = 2, dtype = "f64", grads = true,
                                    initial_state = true }
  a.algorithm, a.chunk_size = algorithm, 16
  return a
end

describe("interrupts", function()
  after_each(function() lib.gdp_interrupt_clear() end)

  for _, algorithm in ipairs({ "chunk", "recurrent" }) do
    it("stop the " .. algorithm .. " operator mid-op, forward and backward, without a leak", function()
      local a = inputs(algorithm)
      local ref = gdp.ops.chunk_gated_delta_product(a)
      local live = live_after_collect()
      lib.gdp_interrupt_request_after(3)
      H.expect_error(function() return gdp.ops.chunk_gated_delta_product(a) end,
                     "gdp.chunk_gated_delta_product", "GDP_ERR_INTERRUPTED", "interrupted")
      assert.are.equal(0, lib.gdp_interrupt_requested(), "the raised error consumes the flag")
      lib.gdp_interrupt_request_after(3)
      H.expect_error(function() return gdp.ops.chunk_gated_delta_product_backward(a) end,
                     "GDP_ERR_INTERRUPTED", "interrupted")
      assert.are.equal(live, live_after_collect())
      -- the next call runs, and gives the same bits as before
      assert.are.equal(0, gdp.rel_error(gdp.ops.chunk_gated_delta_product(a), ref))
    end)
  end

  it("stop the mixer layer's forward and backward", function()
    local m = gdp.nn.GatedDeltaProduct { hidden_size = 16, num_heads = 2, head_dim = 8, num_groups = 1,
                                         state_dim = 8, num_householder = 2, dtype = "f64", seed = 3 }
    local x = gdp.randn({ 300, 1, 16 }, { dtype = "f64" })
    local live = live_after_collect()
    lib.gdp_interrupt_request_after(2)
    H.expect_error(function() return m:forward(x) end, "GDP_ERR_INTERRUPTED")
    assert.are.equal(live, live_after_collect())
    local out = m:forward(x)
    lib.gdp_interrupt_request_after(2)
    H.expect_error(function() return m:backward(x, out) end, "GDP_ERR_INTERRUPTED")
    assert.truthy(m:backward(x, out))
  end)

  it("a flag set during a call that does not poll is raised after its output is owned", function()
    local live = live_after_collect()
    lib.gdp_interrupt_request()
    H.expect_error(function() return gdp.zeros({ 1000, 100 }) end, "gdp.zeros", "GDP_ERR_INTERRUPTED",
                   "interrupted (Ctrl-C)")
    assert.are.equal(0, lib.gdp_interrupt_requested())
    assert.are.equal(live, live_after_collect())
    H.assert_alive()
  end)

  it("matmul polls once per call", function()
    local a = gdp.randn({ 8, 8 }, { dtype = "f64" })
    local out = gdp.zeros({ 8, 8 }, { dtype = "f64" })
    lib.gdp_interrupt_request()
    H.expect_error(function() return gdp.matmul(a, a, { out = out }) end, "gdp.matmul", "GDP_ERR_INTERRUPTED")
    assert.truthy(gdp.matmul(a, a))
  end)
end)
