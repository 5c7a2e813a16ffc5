-- Every bad input gives a Lua error that names the argument and the expected and
-- actual values, and the library keeps working afterwards.
local gdp = require("gdp")
local H = gdp_test
local ops = gdp.ops

-- A small valid problem: B = 2, T = 5, H = 3, K = 4, V = 6, n = 2, f64.
local B, T, NH, K, V, n = 2, 5, 3, 4, 6, 2

local function valid_args()
  H.reseed(11)
  return ops.random_inputs({ B = B, T = T, H = NH, K = K, V = V, n = n, dtype = "f64",
                             initial_state = true, grads = true })
end

local function with(overrides)
  local args = valid_args()
  for key, val in pairs(overrides) do
    if val == "nil" then args[key] = nil else args[key] = val end
  end
  return args
end

local function f64(...) return gdp.randn({ ... }, { dtype = "f64" }) end

-- Expects both passes to fail on `args` with messages containing the needles, then
-- checks that a valid call still works.
local function expect_op_error(args, ...)
  local needles = { ... }
  H.expect_error(function() return ops.chunk_gated_delta_product(args) end, unpack(needles))
  H.expect_error(function() return ops.chunk_gated_delta_product_backward(args) end, unpack(needles))
  local o = ops.chunk_gated_delta_product(valid_args())
  assert.are.same({ B, T, NH, V }, o:shape())
  H.assert_alive()
end

describe("operator argument errors", function()
  it("the valid problem runs", function()
    local o, ht = ops.chunk_gated_delta_product(valid_args())
    assert.are.same({ B, T, NH, V }, o:shape())
    assert.are.same({ B, NH, K, V }, ht:shape())
    local grads = ops.chunk_gated_delta_product_backward(valid_args())
    assert.are.same({ B, T * n, NH, K }, grads.dk:shape())
  end)

  it("missing or non-tensor arguments", function()
    expect_op_error(with({ q = "nil" }), "gdp.chunk_gated_delta_product", "q: expected a gdp tensor, got nil")
    expect_op_error(with({ v = 3 }), "v: expected a gdp tensor, got number")
    expect_op_error(with({ beta = { 1, 2 } }), "beta: expected a gdp tensor, got table")
    H.expect_error(function() return ops.chunk_gated_delta_product_backward(with({ ["do"] = "nil" })) end,
                   "do: expected a gdp tensor, got nil")
    H.expect_error(function() return ops.chunk_gated_delta_product(42) end, "q: expected a gdp tensor, got number")
    H.expect_error(function() return ops.chunk_gated_delta_product() end, "expected an argument table")
  end)

  it("wrong ranks", function()
    expect_op_error(with({ q = f64(B, T, NH * K) }), "q: expected 4 dims [B,T,H,K]", "[2x5x12]")
    expect_op_error(with({ k = f64(B, T * n, NH * K) }), "k: expected 4 dims [B,T*n,H,K]", "[2x10x12]")
    expect_op_error(with({ v = f64(B, T * n, NH * V) }), "v: expected 4 dims", "[2x10x18]")
    expect_op_error(with({ beta = f64(B, T * n) }), "GDP_ERR_SHAPE", "beta", "[2x10]")
  end)

  it("mismatched K, V, H, B between q, k, v, beta, g", function()
    expect_op_error(with({ k = f64(B, T * n, NH, K + 1) }), "GDP_ERR_SHAPE", "k: expected", "[2x10x3x5]")
    expect_op_error(with({ k = f64(B, T * n, NH + 1, K) }), "GDP_ERR_SHAPE", "k: expected", "[2x10x4x4]")
    expect_op_error(with({ v = f64(B, T * n, NH + 1, V) }), "GDP_ERR_SHAPE", "v: expected", "[2x10x4x6]")
    expect_op_error(with({ v = f64(B + 1, T * n, NH, V) }), "GDP_ERR_SHAPE", "v: expected", "[3x10x3x6]")
    expect_op_error(with({ beta = f64(B, T * n, NH + 1) }), "GDP_ERR_SHAPE", "beta: expected", "[2x10x4]")
    expect_op_error(with({ g = f64(B, T * n, NH) }), "GDP_ERR_SHAPE", "g: expected", "[2x10x3]")
    expect_op_error(with({ initial_state = f64(B, NH, V, K) }), "GDP_ERR_SHAPE", "h0", "[2x3x6x4]")
    H.expect_error(function() return ops.chunk_gated_delta_product_backward(with({ ["do"] = f64(B, T, NH, V + 1) })) end,
                   "GDP_ERR_SHAPE", "d_o", "[2x5x3x7]")
    H.expect_error(function() return ops.chunk_gated_delta_product_backward(with({ dht = f64(B, NH, K, V + 1) })) end,
                   "GDP_ERR_SHAPE", "dht", "[2x3x4x7]")
    H.assert_alive()
  end)

  it("num_householder < 1 or not matching k's length", function()
    expect_op_error(with({ num_householder = 0 }), "num_householder must be an integer >= 1, got 0")
    expect_op_error(with({ num_householder = -2 }), "num_householder must be an integer >= 1, got -2")
    expect_op_error(with({ num_householder = 1.5 }), "num_householder must be an integer >= 1, got 1.5")
    expect_op_error(with({ num_householder = 3 }), "k: expected T*num_householder = 5*3 = 15 rows",
                    "got 10", "num_householder 2 would match")
    -- k's length not a multiple of T, n left to inference
    local args = with({ num_householder = "nil", k = f64(B, 7, NH, K) })
    expect_op_error(args, "k: expected T*n rows (T = 5 from q), got 7 rows")
  end)

  it("cu_seqlens not non-decreasing, not starting at 0, not ending at T, with B != 1", function()
    local function packed(cu)
      H.reseed(12)
      local a = ops.random_inputs({ B = 1, T = 8, H = 2, K = 4, V = 3, n = 2, dtype = "f64", grads = true })
      a.cu_seqlens = cu
      return a
    end
    expect_op_error(packed({ 0, 5, 3, 8 }), "GDP_ERR_INVALID_ARG", "cu_seqlens: expected non-decreasing values")
    expect_op_error(packed({ 0, 3, 7 }), "cu_seqlens: expected the last entry = T = 8", "got 7")
    expect_op_error(packed({ 1, 3, 8 }), "cu_seqlens: expected cu_seqlens[0] = 0, got 1")
    expect_op_error(packed({ 0, 2.5, 8 }), "cu_seqlens[2] must be an integer", "got 2.5")
    expect_op_error(packed(gdp.tensor({ 0, 3, 8 }, { dtype = "f32" })), "GDP_ERR_DTYPE",
                    "cu_seqlens: expected dtype i32 or i64, got f32")
    expect_op_error(with({ cu_seqlens = { 0, 2, 5 } }), "cu_seqlens: packed sequences need B = 1",
                    "B = 2")
    -- valid: an empty sequence in the middle
    local o = ops.chunk_gated_delta_product(packed({ 0, 3, 3, 8 }))
    assert.are.same({ 1, 8, 2, 3 }, o:shape())
  end)

  it("wrong dtypes", function()
    local args = valid_args()
    expect_op_error(with({ k = args.k:float() }), "GDP_ERR_DTYPE", "k: expected dtype f64", "got f32")
    expect_op_error(with({ q = args.q:to("i32") }), "GDP_ERR_DTYPE", "q: expected dtype f64, f32 or bf16, got i32")
    expect_op_error(with({ initial_state = args.initial_state:bf16() }), "GDP_ERR_DTYPE", "h0", "got bf16")
    expect_op_error(with({ g = args.g:float() }), "GDP_ERR_DTYPE", "g: expected dtype f64 (q's), got f32")
    -- beside bf16 tokens g may be f32 (the bf16 mixer's gate), nothing else
    local b = with({ q = args.q:bf16(), k = args.k:bf16(), v = args.v:bf16(), beta = args.beta:bf16() })
    expect_op_error(b, "GDP_ERR_DTYPE", "g: expected dtype bf16 (q's) or f32, got f64")
  end)

  it("bad options", function()
    expect_op_error(with({ algorithm = "fast" }), "algorithm: expected \"auto\", \"chunk\" or \"recurrent\"", "fast")
    expect_op_error(with({ num_housholder = 2 }), "unknown option 'num_housholder'")
    expect_op_error(with({ scale = -1 }), "scale: expected a finite number > 0", "got -1")
    expect_op_error(with({ chunk_size = 0 }), "chunk_size must be an integer >= 1, got 0")
  end)

  it("errors carry a code, a name, the C message and the caller's position", function()
    -- (not `return f()`: a tail call leaves no frame for the position to point at)
    local bad = with({ k = f64(B, T * n, NH, K + 1) })
    local _, err = H.expect_error(function() local o = ops.chunk_gated_delta_product(bad); return o end)
    assert.is_true(gdp.is_error(err))
    assert.are.equal("GDP_ERR_SHAPE", err.name)
    assert.are.equal(gdp.lib.GDP_ERR_SHAPE, err.code)
    assert.are.equal("chunk_gated_delta_product", err.fn)
    assert.truthy(err.where:match("errors_spec%.lua:%d+$"), err.where)
    assert.truthy(tostring(err):match("^spec/errors_spec%.lua:%d+: gdp%.chunk_gated_delta_product: GDP_ERR_SHAPE: "))
    -- Lua-side checks point at the caller's line too
    local text = H.expect_error(function() local v = gdp.zeros(2):narrow(1, 2, 5); return v end)
    assert.truthy(text:match("errors_spec%.lua:%d+: gdp%.narrow: "), text)
  end)
end)

describe("tensor argument errors", function()
  it("name the argument and the expected and actual values", function()
    H.expect_error(function() return gdp.zeros({ 2, -1 }) end, "gdp.zeros", "size of dim 2 must be an integer >= 0", "got -1")
    H.expect_error(function() return gdp.zeros(2, { dtype = "f16" }) end, "dtype: expected one of", "'f16'")
    H.expect_error(function() return gdp.zeros(2, { dtpye = "f64" }) end, "unknown option 'dtpye'")
    H.expect_error(function() return gdp.zeros(2, { device = "tpu" }) end, "device: expected", "'tpu'")
    H.expect_error(function() return gdp.tensor({ { 1, 2 }, { 3 } }) end, "data[2]: expected 2 entries", "got 1")
    H.expect_error(function() return gdp.tensor({ 1, "x" }) end, "data[2]: expected a number, got string")
    H.expect_error(function() return gdp.tensor({ 1, 2, 3 }, { 2, 2 }) end, "expected 4 values for shape [2x2], got 3")
    H.expect_error(function() return gdp.zeros(2, 3):view(4) end, "GDP_ERR_SHAPE", "[4]", "[2x3]")
    H.expect_error(function() return gdp.zeros(2, 3):size(3) end, "dim: expected an integer in 1..2", "got 3")
    H.expect_error(function() return gdp.zeros(2, 3):select(1, 3) end, "index into dim 1 (of size 2) must be an integer in [1, 2]", "got 3")
    H.expect_error(function() return gdp.zeros(2, 3):permute(1) end, "perm: expected 2 dims, got 1")
    H.expect_error(function() return gdp.zeros(2, 3):copy(gdp.zeros(3, 2)) end, "GDP_ERR_SHAPE")
    H.expect_error(function() return #gdp.tensor(1) end, "0-dim")
    H.assert_alive()
  end)

  it("devices that do not exist", function()
    if gdp.has_cuda() then
      H.expect_error(function() return gdp.device("cuda", 99) end, "GDP_ERR_INVALID_ARG")
    else
      local _, err = H.expect_error(function() return gdp.zeros(2, { device = "cuda" }) end)
      assert.is_true(gdp.is_error(err))
      assert.truthy(err.name == "GDP_ERR_UNSUPPORTED" or err.name == "GDP_ERR_INVALID_ARG"
                    or err.name == "GDP_ERR_CUDA", err.name)
    end
    H.assert_alive()
  end)

  it("the device timer on the cpu, and a hold that is not a number", function()
    local cpu = gdp.device("cpu")
    local _, err = H.expect_error(function() cpu:timer_start(20) end, "timer_start", "no device timer on cpu")
    assert.are.equal("GDP_ERR_UNSUPPORTED", err.name)
    H.expect_error(function() cpu:timer_start(0) end, "hold_ms must be in (0, 10000]")
    H.expect_error(function() cpu:timer_start("20") end, "gdp.timer_start", "hold_ms: expected a number", "string")
    H.expect_error(function() gdp.ops.timed_device(cpu, function() end) end, "no device timer on cpu")
    H.assert_alive()
  end)
end)

describe("file errors", function()
  local tmp = os.tmpname()
  after_each(function() os.remove(tmp) end)

  it("a missing file", function()
    local _, err = H.expect_error(function() return gdp.load("/nonexistent/dir/case.safetensors") end,
                                  "gdp.load", "GDP_ERR_IO", "/nonexistent/dir/case.safetensors")
    assert.are.equal("GDP_ERR_IO", err.name)
    H.assert_alive()
  end)

  it("corrupt files", function()
    local function write(bytes)
      local f = assert(io.open(tmp, "wb"))
      f:write(bytes)
      f:close()
    end
    local function header(json)
      local n = #json
      local len = string.char(n % 256, math.floor(n / 256) % 256, 0, 0, 0, 0, 0, 0)
      return len .. json
    end
    local cases = {
      "",                                                   -- empty
      "abc",                                                -- shorter than the length prefix
      string.char(255, 255, 255, 255, 255, 255, 255, 127) .. "{}", -- absurd header length
      header("{not json"),                                  -- bad JSON
      header('{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}') .. "12345678", -- truncated data
      header('{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}') .. string.rep("\0", 16), -- size mismatch
    }
    for i, bytes in ipairs(cases) do
      write(bytes)
      local _, err = H.expect_error(function() return gdp.load(tmp) end, "gdp.load")
      assert.is_true(gdp.is_error(err), "case " .. i .. ": " .. tostring(err))
      assert.truthy(err.name == "GDP_ERR_IO" or err.name == "GDP_ERR_UNSUPPORTED",
                    "case " .. i .. ": " .. tostring(err))
      H.assert_alive()
    end
  end)

  it("bad save arguments", function()
    H.expect_error(function() gdp.save(tmp, { x = 1 }) end, "tensors.x: expected a gdp tensor, got number")
    H.expect_error(function() gdp.save(tmp, { x = gdp.zeros(1) }, { k = {} }) end,
                   "metadata.k: expected a string, number or boolean, got table")
    H.expect_error(function() gdp.save("/nonexistent/dir/x.safetensors", { x = gdp.zeros(1) }) end,
                   "gdp.save", "GDP_ERR_IO")
    H.assert_alive()
  end)
end)
