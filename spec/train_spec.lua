-- gdp.train: the step, runs with records and evaluation, checkpoints, and resume that
-- continues bit for bit (2N steps straight against N steps, a checkpoint, fresh
-- objects and a scrambled RNG, N more steps).
local gdp = require("gdp")
local optim = require("gdp.optim")
local train = require("gdp.train")
local results = require("gdp.results")
local util = require("gdp.util")
local C = require("train_cases")
local H = gdp_test

local IN, OUT, ROWS = 6, 3, 16

local function tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(os.execute("mkdir -p " .. d) == 0)
  return d
end

-- A regression problem: targets from a fixed matrix plus noise, each batch drawn from
-- gdp's RNG (so a resume must restore the RNG to see the same batches).
local function problem(dtype, device)
  local cdt = dtype == "bf16" and "f32" or dtype
  local opts = { dtype = cdt, device = device }
  H.reseed(7)
  local W_true = gdp.randn({ OUT, IN }, opts)
  local function batch()
    local x = gdp.randn({ ROWS, IN }, opts)
    local y = gdp.matmul(x, W_true, { trans_b = true }):add(gdp.randn({ ROWS, OUT }, opts):scale_(0.01))
    return { input = x, target = y, tokens = ROWS }
  end
  return batch
end

local function setup(dtype, seed, device)
  H.reseed(seed or 8)
  local model = C.Affine({ in_dim = IN, out_dim = OUT, dtype = dtype, device = device,
                           grad_dtype = dtype == "bf16" and "f32" or nil })
  local opt = optim.AdamW(model, { lr = 0.05, weight_decay = 0.01, no_decay = { "bias" } })
  return model, opt
end

local function quiet() return io.open("/dev/null", "w") end

describe("train.step", function()
  it("zero_grad, forward, loss, backward, clip, step, schedule: the loss falls", function()
    local batch = problem("f64")
    local model, opt = setup("f64")
    local sched = optim.schedule.cosine({ lr = 0.1, total_steps = 150, warmup_steps = 5 })
    local first, last
    for s = 1, 150 do
      local r = train.step({ model = model, optimizer = opt, criterion = C.MSE(), batch = batch(s),
                             schedule = sched, max_grad_norm = 5.0 })
      assert.are.equal(s, r.step)
      assert.are.equal(sched(s), r.lr)
      assert.are.equal(ROWS, r.tokens)
      first = first or r.loss
      last = r.loss
    end
    assert.are.equal(150, opt:steps())
    assert.is_true(last < 0.05 * first, string.format("loss %g -> %g", first, last))
  end)

  it("gradients are clipped to max_norm before the update", function()
    local batch = problem("f64")
    local model, opt = setup("f64")
    local seen
    train.step({ model = model, optimizer = { steps = function() return 0 end, set_lr = function() end,
                                             get_lr = function() return 0 end,
                                             step = function() seen = optim.clip_grad_norm(model) end },
                 criterion = C.MSE(), batch = batch(1), max_grad_norm = 1e-3 })
    assert.is_true(math.abs(seen - 1e-3) < 1e-8, tostring(seen))
  end)

  it("a non-finite loss stops with the step number", function()
    local model, opt = setup("f64")
    local x = gdp.full({ ROWS, IN }, 0 / 0, { dtype = "f64" })
    H.expect_error(function()
      train.step({ model = model, optimizer = opt, criterion = C.MSE(),
                   batch = { input = x, target = gdp.zeros({ ROWS, OUT }, { dtype = "f64" }) } })
    end, "step 1", "loss is nan")
    assert.are.equal(0, opt:steps())
  end)
end)

describe("train.run", function()
  it("writes results.csv, eval.csv, plot.gp, meta.json and a checkpoint; prints progress lines", function()
    local root = tmpdir()
    local batch = problem("f32")
    local model, opt = setup("f32")
    local run = results.new_run("train_spec", { root = root, config = { what = "spec" } })
    local log_path = root .. "/log.txt"
    local out = io.open(log_path, "w")
    local evals = 0
    local r = train.run({ model = model, optimizer = opt, criterion = C.MSE(), batch = batch, steps = 20,
                          log_every = 5, eval_every = 10, checkpoint_every = 10, run = run, out = out,
                          eval = function(m, step) evals = evals + 1; return { mse = 0.5, step_seen = step } end,
                          config = { hidden = IN } })
    run:finish()
    out:close()
    assert.are.equal(20, r.step)
    assert.are.equal(2, evals)
    local function lines(path)
      local t = {}
      for l in io.lines(path) do t[#t + 1] = l end
      return t
    end
    local csv = lines(run.dir .. "/results.csv")
    assert.are.equal("step,loss,lr,grad_norm,tokens_per_s,elapsed_s,status", csv[1])
    assert.are.equal(5, #csv) -- header + steps 5, 10, 15, 20
    assert.are.equal("20", csv[5]:match("^(%d+),"))
    local ev = lines(run.dir .. "/eval.csv")
    assert.are.equal("step,mse,step_seen", ev[1])
    assert.are.same({ "10,0.5,10", "20,0.5,20" }, { ev[2], ev[3] })
    assert.is_truthy(lines(run.dir .. "/plot.gp")[1])
    local log = table.concat(lines(log_path), "\n")
    assert.is_truthy(log:find("train: step 20/20  loss ", 1, true), log)
    assert.is_truthy(log:find("tok/s  ETA", 1, true), log)
    local _, meta = gdp.load(run.dir .. "/checkpoint.safetensors")
    assert.are.equal("gdp.checkpoint", meta.format)
    assert.are.equal("20", meta.step)
    assert.are.same({ hidden = IN }, util.json_decode(meta.config))
    os.execute("rm -rf " .. root)
  end)

  local resume_cases = { { "f64", "cpu" }, { "f32", "cpu" }, { "bf16", "cpu" }, { "f32", "cuda" }, { "bf16", "cuda" } }
  for _, case in ipairs(resume_cases) do
    local dtype, device = case[1], case[2]
    it(dtype .. " on " .. device .. ": 2N steps straight equal N steps, checkpoint, fresh objects, N more (bitwise)" ..
       (device == "cuda" and " #gpu" or ""), function()
      if not H.need_device(device) then return end
      local N = 7
      local sched = optim.schedule.cosine({ lr = 0.05, total_steps = 2 * N, warmup_steps = 2 })
      local root = tmpdir()
      local path = root .. "/ckpt.safetensors"

      local batch = problem(dtype, device)
      local model_a, opt_a = setup(dtype, nil, device)
      local straight = train.run({ model = model_a, optimizer = opt_a, criterion = C.MSE(), batch = batch,
                                   steps = 2 * N, schedule = sched, max_grad_norm = 0.5, out = quiet() })

      batch = problem(dtype, device)
      local model_b, opt_b = setup(dtype, nil, device)
      local first = train.run({ model = model_b, optimizer = opt_b, criterion = C.MSE(), batch = batch,
                                steps = N, schedule = sched, max_grad_norm = 0.5, checkpoint = path,
                                out = quiet() })
      assert.are.equal(N, first.checkpoint_step)
      -- fresh objects, other initial values, a scrambled RNG stream
      gdp.manual_seed(424242)
      gdp.randn({ 1000 })
      local model_c, opt_c = setup(dtype, 99, device)
      gdp.randn({ 37 })
      local second = train.run({ model = model_c, optimizer = opt_c, criterion = C.MSE(), batch = batch,
                                 steps = 2 * N, schedule = sched, max_grad_norm = 0.5, resume = path,
                                 out = quiet() })
      assert.are.equal(N, second.resumed_from)
      assert.are.equal(2 * N, opt_c:steps())
      for s = 1, N do assert.are.equal(straight.losses[s], first.losses[s], "loss at step " .. s) end
      for s = N + 1, 2 * N do
        assert.are.equal(straight.losses[s], second.losses[s], "loss at step " .. s)
        assert.is_nil(first.losses[s])
      end
      for _, name in ipairs(model_a:parameter_names()) do
        assert.is_true(C.bitwise_equal(model_a:parameters()[name], model_c:parameters()[name]), name)
      end
      for key, t in pairs(opt_a:state_tensors()) do
        assert.is_true(C.bitwise_equal(t, opt_c:state_tensors()[key]), key)
      end
      os.execute("rm -rf " .. root)
    end)
  end

  it("resumes bit for bit in a fresh process", function()
    local root = tmpdir()
    local script = root .. "/resume.lua"
    local f = io.open(script, "w")
    f:write([[
package.path = "./spec/?.lua;" .. package.path
local gdp = require("gdp")
local optim = require("gdp.optim")
local train = require("gdp.train")
local C = require("train_cases")
local mode, path, steps = arg[1], arg[2], tonumber(arg[3])
gdp.manual_seed(mode == "resume" and 5 or 1)
local W_true = gdp.randn({3, 4}, {dtype = "f32"})
if mode == "resume" then W_true = nil end
local saved_w = W_true
local function batch()
  local x = gdp.randn({8, 4}, {dtype = "f32"})
  return {input = x, target = x:narrow(2, 1, 3):scale_(2)}
end
local m = C.Affine({in_dim = 4, out_dim = 3, dtype = "f32"})
local opt = optim.AdamW(m, {lr = 0.02})
local r = train.run({model = m, optimizer = opt, criterion = C.MSE(), batch = batch, steps = steps,
                     checkpoint = mode ~= "straight" and path or nil,
                     resume = mode == "resume" and path or nil, out = io.open("/dev/null", "w")})
local w = m:parameters()["proj.weight"]:flat()
local parts = {}
for i = 1, #w do parts[i] = string.format("%a", w[i]) end
print(string.format("%a", r.losses[steps]) .. " " .. table.concat(parts, ","))
]])
    f:close()
    local function run(mode, steps)
      local p = io.popen(string.format("luajit %s %s %s/ckpt.safetensors %d 2>&1", script, mode, root, steps))
      local text = p:read("*a")
      p:close()
      return text
    end
    local straight = run("straight", 12)
    run("first", 6)
    local resumed = run("resume", 12)
    assert.is_truthy(straight:match("^%S+ %S+"), straight)
    assert.are.equal(straight, resumed)
    os.execute("rm -rf " .. root)
  end)
end)

describe("train checkpoints: bad input", function()
  it("a file that is not a checkpoint, a missing tensor, another optimiser", function()
    local root = tmpdir()
    local model, opt = setup("f64")
    gdp.save(root .. "/plain.safetensors", { x = gdp.zeros({ 2 }) })
    H.expect_error(function() train.load_checkpoint(root .. "/plain.safetensors", { model = model, optimizer = opt }) end,
                   "not a gdp checkpoint", "metadata format = nil")
    train.save_checkpoint(root .. "/ck.safetensors", { model = model, optimizer = opt })
    local sgd = optim.SGD(model, { lr = 0.1, momentum = 0.9 })
    H.expect_error(function() train.load_checkpoint(root .. "/ck.safetensors", { model = model, optimizer = sgd }) end,
                   "of optimiser AdamW, this one is SGD")
    local t, meta = gdp.load(root .. "/ck.safetensors")
    t["optim.proj.weight.exp_avg"] = nil
    gdp.save(root .. "/cut.safetensors", t, meta)
    H.expect_error(function() train.load_checkpoint(root .. "/cut.safetensors", { model = model, optimizer = opt }) end,
                   "missing state tensor 'proj.weight.exp_avg'")
    H.expect_error(function() train.run({ model = model, optimizer = opt, criterion = C.MSE(), batch = function() end,
                                          steps = 3, checkpoint_every = 1 }) end,
                   "checkpoint: expected a path with checkpoint_every")
    os.execute("rm -rf " .. root)
  end)
end)
