#!/usr/bin/env python3
"""fla_bench.py -- times fla's chunk_gated_delta_product (the side-by-side anchor of
kernels/bench/gdp_cuda_lab.cu and of experiments/bench_gdp.lua --against-fla) at the same
shapes, on the GPU, and prints ONE JSON object on stdout (progress goes to stderr).

Inputs as the lab and bench_gdp --against-fla draw them: bf16, use_qk_l2norm_in_kernel,
gated (g = logsigmoid(N(0, 1))), beta = sigmoid(U(0, 1)), no initial state; no final state
unless --final-state (then ht is returned and the backward also takes a dht).  Median of
CUDA-event timings after warm-up; the gradients of the leaves are cleared before each
repeat, outside the timed region, so no repeat pays for accumulating into .grad.  Inputs
are larger than the L2 at the benchmark shapes, so no rotation is needed.

usage: PYTHONPATH=.fla python3 tools/fla_bench.py [--shapes 4x4096x2,1x32768x2] [--H 16]
           [--K 128] [--V 128] [--reps 30] [--warmup 5] [--seed 1234] [--final-state]
       python3 tools/fla_bench.py --check    # prints "ok" or what is missing (exit 1)

--shapes: comma-separated BxTxn (batch x tokens per sequence x Householder steps), the
syntax of bench_gdp.lua --shapes.  Output: {"tool", "dtype", "fla_version", "fla_commit",
"fla_path", "torch", "triton", "python", "device", "final_state", "H", "K", "V", "reps",
"warmup", "rows": [{"B", "T", "n", "H", "K", "V", "fwd_ms", "fwd_min_ms", "fwdbwd_ms",
"fwdbwd_min_ms"}, ...]}; times in milliseconds, medians unless named _min_.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys

SHAPE_RE = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)x([1-9][0-9]*)$")


def parse_shapes(text):
    """'4x4096x2,1x32768x2' -> [(4, 4096, 2), (1, 32768, 2)]; ValueError names the bad item."""
    shapes = []
    for item in text.split(","):
        m = SHAPE_RE.match(item.strip())
        if not m:
            raise ValueError(f"--shapes: expected comma-separated BxTxn items of positive "
                             f"integers such as 4x4096x2, got '{item}' in '{text}'")
        shapes.append(tuple(int(x) for x in m.groups()))
    return shapes


def check():
    """What this tool needs, in the order it needs it; returns None or what is missing."""
    import importlib
    for name in ("torch", "triton", "fla"):
        try:
            importlib.import_module(name)
        except Exception as e:  # an import can fail with more than ImportError
            return f"cannot import {name}: {type(e).__name__}: {e}"
    import torch
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (fla's kernels are Triton, GPU only)"
    try:
        load_fla()
    except Exception as e:
        return f"cannot load fla.ops.gated_delta_product: {type(e).__name__}: {e}"
    return None


def load_fla():
    import fla.ops.common.chunk_o as chunk_o
    # Triton 3.6 on Hopper: fla refuses its gated backward unless told the Triton bug
    # it guards against is absent (../shared/device/README.md); gradients were checked.
    chunk_o.TRITON_ABOVE_3_7_1 = True
    from fla.ops.gated_delta_product import chunk_gated_delta_product
    return chunk_gated_delta_product


def fla_facts():
    """fla's version, the commit of its copy when one is recorded, and where it is."""
    import fla
    root = os.path.dirname(os.path.dirname(os.path.abspath(fla.__file__)))
    commit = os.environ.get("FLA_COMMIT")
    if not commit:
        for name in ("COMMIT", "FLA_COMMIT", ".fla_commit"):
            path = os.path.join(root, name)
            if os.path.isfile(path):
                with open(path) as f:
                    commit = f.read().strip() or None
                break
    if not commit and os.path.exists(os.path.join(root, ".git")):
        try:
            commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
        except Exception:
            commit = None
    return {"fla_version": getattr(fla, "__version__", None), "fla_commit": commit, "fla_path": root}


def time_ms(fn, reps, warmup, reset):
    import torch
    for _ in range(warmup):
        reset()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        reset()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times), max(times)


def bench(op, B, T, n, H, K, V, reps, warmup, seed, final_state):
    import torch
    import torch.nn.functional as F
    torch.manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, K, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, T * n, H, K, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, T * n, H, V, device=dev, dtype=dt, requires_grad=True)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev, dtype=torch.float32)).to(dt).requires_grad_()
    beta = torch.rand(B, T * n, H, device=dev, dtype=dt).sigmoid().requires_grad_()
    do = torch.randn(B, T, H, V, device=dev, dtype=dt)
    dht = torch.randn(B, H, K, V, device=dev, dtype=torch.float32) if final_state else None
    leaves = (q, k, v, g, beta)

    def reset():
        for t in leaves:
            t.grad = None

    def fwd():
        with torch.no_grad():
            op(q, k, v, g, beta, num_householder=n, use_qk_l2norm_in_kernel=True,
               output_final_state=final_state)

    def fwdbwd():
        o, ht = op(q, k, v, g, beta, num_householder=n, use_qk_l2norm_in_kernel=True,
                   output_final_state=final_state)
        if final_state:
            torch.autograd.backward((o, ht), (do, dht))
        else:
            o.backward(do)

    f = time_ms(fwd, reps, warmup, reset)
    fb = time_ms(fwdbwd, reps, warmup, reset)
    row = {"B": B, "T": T, "n": n, "H": H, "K": K, "V": V,
           "fwd_ms": f[0], "fwd_min_ms": f[1], "fwdbwd_ms": fb[0], "fwdbwd_min_ms": fb[1]}
    del q, k, v, g, beta, do, dht, leaves
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description="Times fla's chunk_gated_delta_product; JSON on stdout.")
    ap.add_argument("--shapes", default="4x4096x1,4x4096x2,4x4096x3,1x32768x2",
                    help="comma-separated BxTxn (batch x tokens x Householder steps)")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--final-state", action="store_true",
                    help="return ht and take a dht in the backward (bench_gdp's default)")
    ap.add_argument("--check", action="store_true",
                    help="print 'ok' or what is missing (exit status 1), time nothing")
    a = ap.parse_args()
    if a.check:
        problem = check()
        print("ok" if problem is None else problem, flush=True)
        sys.exit(0 if problem is None else 1)
    try:
        shapes = parse_shapes(a.shapes)
    except ValueError as e:
        ap.error(str(e))
    if a.reps < 1 or a.warmup < 0:
        ap.error(f"--reps must be >= 1 and --warmup >= 0, got {a.reps} and {a.warmup}")

    import torch
    import triton
    op = load_fla()
    rows = []
    for B, T, n in shapes:
        r = bench(op, B, T, n, a.H, a.K, a.V, a.reps, a.warmup, a.seed, a.final_state)
        rows.append(r)
        print(f"fla B={B} T={T} n={n}: fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwdbwd_ms']:.3f} ms",
              file=sys.stderr, flush=True)
    out = {"tool": "fla chunk_gated_delta_product", "dtype": "bf16",
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "device": torch.cuda.get_device_name(),
           "final_state": a.final_state, "H": a.H, "K": a.K, "V": a.V, "reps": a.reps,
           "warmup": a.warmup, "seed": a.seed, "rows": rows}
    out.update(fla_facts())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
