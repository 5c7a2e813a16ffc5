-- gdp.nn.profile: per-module exclusive times of a model's forward and backward, with
-- the model's results unchanged and the model restored by detach.
local gdp = require("gdp")
local nn = require("gdp.nn")
local profile = require("gdp.nn.profile")

local function tiny_lm()
  return nn.CausalLM{ vocab = 7, hidden = 16, layers = 2, seed = 5, dtype = "f64",
                      mixer = { num_heads = 2, head_dim = 8, state_dim = 8, num_householder = 2 } }
end

describe("gdp.nn.profile", function()
  it("times every module and mixer stage without changing a bit, and detaches", function()
    gdp_test.reseed(81)
    local tok = gdp.tensor({ 1, 2, 3, 4, 5, 6, 0, 1, 2, 3 }, { 10 }, { dtype = "i64" })
    local a, b = tiny_lm(), tiny_lm()
    local la = a:forward(tok)
    local dla = gdp.randn(la:shape(), { dtype = "f64" })
    a:backward(tok, dla)

    local p = profile.attach(b)
    local t0 = gdp.time()
    local lb = b:forward(tok)
    b:backward(tok, dla)
    local wall = (gdp.time() - t0) * 1e3
    p:detach()

    assert.are.equal(0, gdp.rel_error(lb, la))
    for _, name in ipairs(a:parameter_names()) do
      assert.are.equal(0, gdp.rel_error(b:gradients()[name], a:gradients()[name]), name)
    end
    local rows, by, total = p:report(), {}, 0
    for _, r in ipairs(rows) do
      by[r.name] = r
      assert.is_true(r.ms >= 0 and r.calls == 1, r.name)
      total = total + r.ms
    end
    for _, name in ipairs({ "model forward", "model backward", "embed forward", "layers.0 forward",
                            "layers.1.mixer forward", "layers.1.mixer ssm_forward",
                            "layers.0.mixer ssm_inputs_backward", "layers.1.mlp backward", "lm_head forward" }) do
      assert.truthy(by[name], name .. " has no row")
    end
    -- exclusive times add up to at most the profiled wall time
    assert.is_true(total <= wall * (1 + 1e-9), string.format("rows %.3f ms > wall %.3f ms", total, wall))
    assert.truthy(p:format():find("layers.1.mixer ssm_forward", 1, true))
    -- detached: no instance fields left behind
    assert.is_nil(rawget(b, "forward"))
    assert.is_nil(rawget(b, "backward"))
    assert.has_error(function() profile.attach(42) end)
  end)
end)
