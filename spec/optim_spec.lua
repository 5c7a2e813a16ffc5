-- gdp.optim: AdamW and SGD against float64 references written element by element
-- (several steps, weight decay, bias correction, momentum, Nesterov), bf16 parameters
-- with float32 masters, the no-decay list, schedules, global-norm clipping and bad input.
local gdp = require("gdp")
local optim = require("gdp.optim")
local lib = require("gdp.lib")
local C = require("train_cases")
local H = gdp_test

-- Draws fresh gradients (of the gradients' dtype) for every parameter.
local function random_grads(model, scale)
  for _, g in pairs(model:gradients()) do g:copy(gdp.randn(g:shape(), { dtype = "f64" }):scale_(scale or 1)) end
end

-- Runs `steps` optimiser steps on `model` with fresh gradients and the same steps on
-- host references; returns the max relative error over the parameters (of the masters
-- for bf16) and the optimiser.
local function run_against_reference(model, make, ref_step, hyper, steps, no_decay)
  local opt = make(model)
  local p = C.host(model:parameters())
  local s1, s2 = {}, {}
  for name, v in pairs(p) do
    s1[name], s2[name] = {}, {}
    for i = 1, #v do s1[name][i], s2[name][i] = 0, 0 end
  end
  for t = 1, steps do
    random_grads(model)
    local g = C.host(model:gradients()) -- the gradient values the kernel reads
    for name in pairs(p) do
      local h = setmetatable({ weight_decay = no_decay[name] and 0 or hyper.weight_decay }, { __index = hyper })
      ref_step(p[name], g[name], s1[name], s2[name], h, t)
    end
    opt:step()
  end
  local worst = 0
  for name, ref in pairs(p) do
    local st = opt.state[name]
    local actual = (st.master or model:parameters()[name]):double():flat()
    worst = math.max(worst, C.max_rel(actual, ref))
  end
  return worst, opt
end

local ADAMW = { lr = 0.01, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, weight_decay = 0.1 }

local function adamw(model)
  return optim.AdamW(model, { lr = ADAMW.lr, betas = { ADAMW.beta1, ADAMW.beta2 }, eps = ADAMW.eps,
                              weight_decay = ADAMW.weight_decay, no_decay = { "bias", "norm.weight" } })
end
local NO_DECAY = { ["proj.bias"] = true, ["norm.weight"] = true }

describe("optim.AdamW", function()
  for _, case in ipairs({ { dtype = "f64", tol = 1e-13 }, { dtype = "f32", tol = 3e-6 } }) do
    it(case.dtype .. ": 6 steps equal the float64 reference (bias correction, decay, no_decay)", function()
      H.reseed(11)
      local m = C.Affine({ in_dim = 7, out_dim = 5, dtype = case.dtype })
      local err = run_against_reference(m, adamw, function(p, g, s1, s2, h, t)
        C.adamw_ref(p, g, s1, s2, h, t)
      end, ADAMW, 6, NO_DECAY)
      assert.is_true(err <= case.tol, string.format("relative error %.3e > %.0e", err, case.tol))
    end)
  end

  for _, grad_dtype in ipairs({ "bf16", "f32" }) do
    it("bf16 params, " .. grad_dtype .. " grads: f32 masters follow the reference, params = masters in bf16", function()
      H.reseed(12)
      local m = C.Affine({ in_dim = 9, out_dim = 3, dtype = "bf16", grad_dtype = grad_dtype })
      local err, opt = run_against_reference(m, adamw, function(p, g, s1, s2, h, t)
        C.adamw_ref(p, g, s1, s2, h, t)
      end, ADAMW, 5, NO_DECAY)
      assert.is_true(err <= 3e-6, string.format("masters: relative error %.3e", err))
      for name, p in pairs(m:parameters()) do
        local st = opt.state[name]
        assert.are.equal("f32", st.master:dtype())
        assert.are.equal("f32", st.exp_avg:dtype())
        assert.is_true(C.bitwise_equal(p, st.master:bf16()), name .. ": param is not the rounded master")
      end
    end)
  end

  it("a bf16 param written between steps re-seeds its master", function()
    H.reseed(13)
    local m = C.Affine({ in_dim = 4, out_dim = 2, dtype = "bf16" })
    local opt = adamw(m)
    random_grads(m)
    opt:step()
    local w = m:parameters()["proj.weight"]
    w:fill(0.5)
    random_grads(m)
    local g = C.host(m:gradients())["proj.weight"]
    local st = opt.state["proj.weight"]
    local p = {}
    local s1, s2 = st.exp_avg:double():flat(), st.exp_avg_sq:double():flat()
    for i = 1, #g do p[i] = 0.5 end
    C.adamw_ref(p, g, s1, s2, ADAMW, 2)
    opt:step()
    assert.is_true(C.max_rel(st.master:double():flat(), p) <= 3e-6)
  end)

  it("the update runs the same with 1 and 2 threads (bitwise)", function()
    local results = {}
    for _, threads in ipairs({ 1, 2 }) do
      H.reseed(14)
      gdp.device("cpu"):set_num_threads(threads)
      local m = C.Affine({ in_dim = 300, out_dim = 300, dtype = "f32" }) -- above the parallel threshold
      local opt = adamw(m)
      for _ = 1, 2 do random_grads(m); opt:step() end
      results[threads] = m:parameters()["proj.weight"]
    end
    gdp.device("cpu"):set_num_threads(0)
    assert.is_true(C.bitwise_equal(results[1], results[2]))
  end)
end)

describe("optim.SGD", function()
  local cases = {
    { name = "plain", h = { lr = 0.05, weight_decay = 0 } },
    { name = "momentum, dampening, weight decay", h = { lr = 0.05, momentum = 0.9, dampening = 0.2, weight_decay = 0.01 } },
    { name = "nesterov", h = { lr = 0.05, momentum = 0.8, nesterov = true, weight_decay = 0.01 } },
  }
  for _, case in ipairs(cases) do
    for _, dtype in ipairs({ "f64", "f32" }) do
      it(case.name .. ", " .. dtype .. ": 5 steps equal the float64 reference", function()
        H.reseed(21)
        local m = C.Affine({ in_dim = 6, out_dim = 4, dtype = dtype })
        local h = case.h
        local err = run_against_reference(m, function(model)
          return optim.SGD(model, { lr = h.lr, momentum = h.momentum, dampening = h.dampening,
                                    nesterov = h.nesterov, weight_decay = h.weight_decay,
                                    no_decay = { "bias", "norm.weight" } })
        end, function(p, g, s1, _, hh, t) C.sgd_ref(p, g, s1, hh, t) end, h, 5, NO_DECAY)
        local tol = dtype == "f64" and 1e-13 or 2e-6
        assert.is_true(err <= tol, string.format("relative error %.3e > %.0e", err, tol))
      end)
    end
  end

  it("bf16 params keep f32 masters", function()
    H.reseed(22)
    local m = C.Affine({ in_dim = 5, out_dim = 3, dtype = "bf16", grad_dtype = "f32" })
    local h = { lr = 0.1, momentum = 0.9, weight_decay = 0 }
    local err, opt = run_against_reference(m, function(model)
      return optim.SGD(model, { lr = h.lr, momentum = h.momentum })
    end, function(p, g, s1, _, hh, t) C.sgd_ref(p, g, s1, hh, t) end, h, 4, {})
    assert.is_true(err <= 2e-6, string.format("relative error %.3e", err))
    for name, p in pairs(m:parameters()) do
      assert.is_true(C.bitwise_equal(p, opt.state[name].master:bf16()), name)
    end
  end)
end)

describe("optim.schedule", function()
  local S = optim.schedule
  it("constant, linear warmup and cosine give their values", function()
    assert.are.equal(0.3, S.constant({ lr = 0.3 })(17))
    local w = S.linear_warmup({ lr = 1.0, warmup_steps = 4 })
    assert.are.same({ 0.25, 0.5, 0.75, 1, 1, 1 }, { w(1), w(2), w(3), w(4), w(5), w(100) })
    local c = S.cosine({ lr = 1.0, total_steps = 12, warmup_steps = 2, min_lr = 0.1 })
    assert.are.equal(0.5, c(1))
    assert.are.equal(1.0, c(2))
    -- halfway through the decay: min_lr + (lr - min_lr) / 2
    assert.is_true(math.abs(c(7) - 0.55) < 1e-15)
    assert.is_true(math.abs(c(12) - 0.1) < 1e-15)
    assert.is_true(math.abs(c(50) - 0.1) < 1e-15)
    -- decreasing after the warmup
    for s = 3, 12 do assert.is_true(c(s) < c(s - 1)) end
    local c0 = S.cosine({ lr = 2.0, total_steps = 4 })
    assert.is_true(math.abs(c0(1) - (1 + math.cos(math.pi / 4))) < 1e-15)
  end)

  it("bad arguments are errors naming them", function()
    H.expect_error(function() S.cosine({ lr = 1, total_steps = 5, warmup_steps = 5 }) end,
                   "warmup_steps", "fewer than total_steps = 5", "got 5")
    H.expect_error(function() S.cosine({ lr = 1, total_steps = 5, min_lr = 2 }) end, "min_lr", "at most lr = 1")
    H.expect_error(function() S.linear_warmup({ lr = -1, warmup_steps = 2 }) end, "lr", ">= 0", "got -1")
    H.expect_error(function() S.constant({ lr = 1 })(0) end, "step", ">= 1", "got 0")
    H.expect_error(function() S.constant({ lr = 1, lrr = 2 }) end, "unknown option 'lrr'")
  end)
end)

describe("optim.clip_grad_norm", function()
  it("returns the global norm and scales the gradients to max_norm", function()
    H.reseed(31)
    local m = C.Affine({ in_dim = 8, out_dim = 4, dtype = "f64" })
    random_grads(m, 3)
    local host = C.host(m:gradients())
    local sumsq = 0
    for _, v in pairs(host) do for i = 1, #v do sumsq = sumsq + v[i] * v[i] end end
    local norm = optim.clip_grad_norm(m, 1.0)
    assert.is_true(math.abs(norm - math.sqrt(sumsq)) <= 1e-12 * norm)
    assert.is_true(norm > 1)
    local after = optim.clip_grad_norm(m)
    assert.is_true(math.abs(after - norm / (norm + 1e-6)) <= 1e-12)
    -- below max_norm: unchanged
    local before = C.host(m:gradients())
    optim.clip_grad_norm(m, 10)
    for name, v in pairs(C.host(m:gradients())) do assert.are.same(before[name], v) end
  end)

  it("a non-finite norm is returned and leaves the gradients alone", function()
    local m = C.Affine({ in_dim = 3, out_dim = 2, dtype = "f32" })
    random_grads(m)
    m:gradients()["proj.bias"]:set(0 / 0, 1)
    local w = C.host(m:gradients())["proj.weight"]
    local norm = optim.clip_grad_norm(m, 1e-3)
    assert.is_true(norm ~= norm)
    assert.are.same(w, C.host(m:gradients())["proj.weight"])
  end)
end)

describe("optim bad input", function()
  local m
  before_each(function() m = C.Affine({ in_dim = 3, out_dim = 2, dtype = "f32" }) end)

  it("hyperparameters out of range name the argument", function()
    H.expect_error(function() optim.AdamW(m, { lr = -1 }) end, "optim.AdamW", "lr", "got -1")
    H.expect_error(function() optim.AdamW(m, { lr = 1, betas = { 1, 0.9 } }) end, "beta1", "[0, 1)", "got 1")
    H.expect_error(function() optim.AdamW(m, { lr = 1, eps = 0 }) end, "eps", "> 0")
    H.expect_error(function() optim.AdamW(m, { lr = 1, weight_decay = -0.1 }) end, "weight_decay")
    H.expect_error(function() optim.SGD(m, { lr = 1, nesterov = true }) end, "nesterov", "momentum > 0")
    H.expect_error(function() optim.AdamW(m, { lr = 1, betass = {} }) end, "unknown option 'betass'")
    H.expect_error(function() optim.AdamW({}, { lr = 1 }) end, "model", "parameter_names")
  end)

  it("a no_decay entry that names no parameter is an error", function()
    H.expect_error(function() optim.AdamW(m, { lr = 1, weight_decay = 0.1, no_decay = { "baias" } }) end,
                   "no_decay[1]", "'baias' names no parameter", "proj.bias")
  end)

  it("the C updates check shapes, dtypes, masters, memory sharing and ranges", function()
    local p = gdp.zeros({ 4 }, { dtype = "f32" })
    local g = gdp.zeros({ 4 }, { dtype = "f32" })
    local m1, m2 = gdp.zeros({ 4 }, { dtype = "f32" }), gdp.zeros({ 4 }, { dtype = "f32" })
    local function adam(pp, gg, a, b, master, lr, b1, b2, eps, wd, step)
      local rc = lib.gdp_optim_adamw_step(pp, gg, a, b, master, lr or 1e-3, b1 or 0.9, b2 or 0.999,
                                          eps or 1e-8, wd or 0, step or 1)
      return tonumber(rc), require("ffi").string(lib.gdp_last_error())
    end
    local function fails(needles, ...)
      local rc, msg = adam(...)
      assert.are_not.equal(0, rc, "expected a failure with: " .. table.concat(needles, ", "))
      for _, n in ipairs(needles) do
        assert.is_truthy(msg:find(n, 1, true), "message lacks '" .. n .. "': " .. msg)
      end
    end
    fails({ "grad", "param's shape [4]", "got [5]" }, p, gdp.zeros({ 5 }, { dtype = "f32" }), m1, m2)
    fails({ "grad", "expected dtype f32", "got f64" }, p, gdp.zeros({ 4 }, { dtype = "f64" }), m1, m2)
    fails({ "exp_avg", "expected dtype f32", "got f64" }, p, g, gdp.zeros({ 4 }, { dtype = "f64" }), m2)
    fails({ "exp_avg_sq", "NULL" }, p, g, m1, nil)
    fails({ "exp_avg", "shares memory with param" }, p, g, p, m2)
    fails({ "exp_avg and exp_avg_sq share memory" }, p, g, m1, m1)
    fails({ "master", "expected NULL for a f32 param" }, p, g, m1, m2, gdp.zeros({ 4 }, { dtype = "f32" }))
    local pb = gdp.zeros({ 4 }, { dtype = "bf16" })
    fails({ "master", "bf16 param needs its float32 master" }, pb, gdp.zeros({ 4 }, { dtype = "bf16" }), m1, m2)
    fails({ "step", ">= 1", "got 0" }, p, g, m1, m2, nil, 1e-3, 0.9, 0.999, 1e-8, 0, 0)
    fails({ "beta2", "got 1.5" }, p, g, m1, m2, nil, 1e-3, 0.9, 1.5)
    fails({ "lr", "expected a number in [0, inf)", "nan" }, p, g, m1, m2, nil, 0 / 0)
    local wide = gdp.zeros({ 4, 2 }, { dtype = "f32" })
    fails({ "param", "contiguous" }, wide:transpose(1, 2), gdp.zeros({ 2, 4 }, { dtype = "f32" }),
          gdp.zeros({ 2, 4 }, { dtype = "f32" }), gdp.zeros({ 2, 4 }, { dtype = "f32" }))
    local rc, msg = tonumber(lib.gdp_optim_sgd_step(p, g, nil, nil, 0.1, 0.9, 0, 0, 0, 1)),
                    require("ffi").string(lib.gdp_last_error())
    assert.are_not.equal(0, rc)
    assert.is_truthy(msg:find("momentum_buffer: expected a tensor when momentum > 0", 1, true), msg)
    H.assert_alive()
  end)
end)

describe("optim on cuda #gpu", function()
  -- Every update on cuda gives the bits of the CPU kernel (optim_cuda.h: no contraction,
  -- correctly rounded sqrt and division on both).
  for _, case in ipairs({ { "f64", "f64" }, { "f32", "f32" }, { "bf16", "bf16" }, { "bf16", "f32" } }) do
    local dtype, grad_dtype = case[1], case[2]
    for _, kind in ipairs({ "AdamW", "SGD" }) do
      it(kind .. " " .. dtype .. " params, " .. grad_dtype .. " grads: cuda equals cpu bitwise", function()
        if not H.need_device("cuda") then return end
        local models, opts = {}, {}
        for _, dev in ipairs({ "cpu", "cuda" }) do
          H.reseed(41)
          -- odd sizes; the cuda model gets the cpu model's values
          local mm = C.Affine({ in_dim = 1031, out_dim = 3, dtype = dtype, grad_dtype = grad_dtype, device = dev })
          models[dev] = mm
          if dev == "cuda" then mm:set_parameters(models.cpu:parameters()) end
          opts[dev] = kind == "AdamW" and adamw(mm)
                      or optim.SGD(mm, { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 0.01 })
        end
        for _ = 1, 3 do
          for name, g in pairs(models.cpu:gradients()) do
            g:copy(gdp.randn(g:shape(), { dtype = "f64" }))
            models.cuda:gradients()[name]:copy(g)
          end
          opts.cpu:step()
          opts.cuda:step()
        end
        for name, p in pairs(models.cpu:parameters()) do
          assert.is_true(C.bitwise_equal(p, models.cuda:parameters()[name]:cpu()), name)
          local a, b = opts.cpu.state[name], opts.cuda.state[name]
          if a.master then assert.is_true(C.bitwise_equal(a.master, b.master:cpu()), name .. " master") end
        end
      end)
    end
  end
end)
