-- A few small forward+backward passes on cuda (bf16, K = V = 128, n = 1..3, plain and
-- saving for backward) for compute-sanitizer: the v3 kernels at odd lengths, nothing
-- timed.  ./gdp results/cuda/session8/small_passes.lua [device, default cuda]
local gdp = require("gdp")
local ops = gdp.ops
local device = arg[1] or "cuda"
gdp.manual_seed(8)
for _, n in ipairs({ 1, 2, 3 }) do
  for _, save in ipairs({ false, true }) do
    local args = ops.random_inputs({ B = 2, T = 203, H = 2, K = 128, V = 128, n = n, dtype = "bf16",
                                     device = device, grads = true, output_final_state = true })
    args.save_for_backward = save or nil
    local o, ht, saved = ops.chunk_gated_delta_product(args)
    args.saved = saved
    local grads = ops.chunk_gated_delta_product_backward(args)
    gdp.device(device):sync()
    print(string.format("n=%d save=%s: |o| %.4g, |dk| %.4g", n, tostring(save), o:norm(), grads.dk:norm()))
    o:free(); if ht then ht:free() end
    if saved then saved:free() end
    args.saved, args.save_for_backward = nil, nil
    ops.free_all(grads); ops.free_all(args)
  end
end
