#!/usr/bin/env python3
"""fla_bench.py -- times fla's chunk_gated_delta_product (the side-by-side anchor of
kernels/bench/gdp_cuda_lab.cu) at the same shapes, on the GPU, and prints JSON.

Inputs as the lab draws them: bf16, use_qk_l2norm_in_kernel, gated (g = logsigmoid),
beta = sigmoid, no initial state, no final state.  Median of CUDA-event timings after
warm-up; inputs larger than the L2 at the benchmark shapes, so no rotation is needed.

usage: PYTHONPATH=.fla python3 tools/fla_bench.py [--shapes 4x4096x2,1x32768x2] [--reps 30]
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def load_fla():
    import fla.ops.common.chunk_o as chunk_o
    # Triton 3.6 on Hopper: fla refuses its gated backward unless told the Triton bug
    # it guards against is absent (../shared/device/README.md); gradients were checked.
    chunk_o.TRITON_ABOVE_3_7_1 = True
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    return chunk_gated_delta_product


def time_ms(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times), max(times)


def bench(op, B, T, n, H, K, V, reps, warmup, seed):
    torch.manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, K, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, T * n, H, K, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, T * n, H, V, device=dev, dtype=dt, requires_grad=True)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev, dtype=torch.float32)).to(dt).requires_grad_()
    beta = torch.rand(B, T * n, H, device=dev, dtype=dt).sigmoid().requires_grad_()
    do = torch.randn(B, T, H, V, device=dev, dtype=dt)

    def fwd():
        with torch.no_grad():
            op(q, k, v, g, beta, num_householder=n, use_qk_l2norm_in_kernel=True)

    def fwdbwd():
        o, _ = op(q, k, v, g, beta, num_householder=n, use_qk_l2norm_in_kernel=True)
        o.backward(do)

    f = time_ms(fwd, reps, warmup)
    fb = time_ms(fwdbwd, reps, warmup)
    return {"B": B, "T": T, "n": n, "H": H, "K": K, "V": V,
            "fwd_ms": f[0], "fwd_min_ms": f[1], "fwdbwd_ms": fb[0], "fwdbwd_min_ms": fb[1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096x1,4x4096x2,4x4096x3,1x32768x2",
                    help="comma-separated BxTxn")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    op = load_fla()
    rows = []
    for s in a.shapes.split(","):
        B, T, n = (int(x) for x in s.split("x"))
        r = bench(op, B, T, n, a.H, a.K, a.V, a.reps, a.warmup, a.seed)
        rows.append(r)
        print(f"fla B={B} T={T} n={n}: fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwdbwd_ms']:.3f} ms",
              file=sys.stderr, flush=True)
    print(json.dumps({"tool": "fla chunk_gated_delta_product", "dtype": "bf16",
                      "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
