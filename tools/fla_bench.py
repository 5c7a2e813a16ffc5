#!/usr/bin/env python3
"""fla_bench.py -- times fla's chunk_gated_delta_product (the side-by-side anchor of
dev/cuda/gdp_cuda_lab.cu and of experiments/bench_gdp.lua --against-fla) at the same
shapes, on the GPU, and prints ONE JSON object on stdout (progress goes to stderr).

Inputs as the lab and bench_gdp --against-fla draw them: bf16, use_qk_l2norm_in_kernel,
gated (g = logsigmoid(N(0, 1))), beta = sigmoid(U(0, 1)), no initial state; no final state
unless --final-state (then ht is returned and the backward also takes a dht).  Median of
CUDA-event timings after warm-up; the gradients of the leaves are cleared before each
repeat, outside the timed region, so no repeat pays for accumulating into .grad.  Inputs
are larger than the L2 at the benchmark shapes, so no rotation is needed.

Two timings of each pass.  "Eager" (fwd_ms, fwdbwd_ms): events around the Python call as
a training loop issues it, so when the host launches fla's ~30 Triton kernels and the
autograd graph slower than the GPU runs them, host time is inside.  "Queued"
(fwd_queued_ms, fwdbwd_queued_ms): the stream is first held by a ~20 ms spin kernel
(torch.cuda._sleep), so the whole pass is launched before the GPU reaches it and the
events see GPU time only; fwd_host_ms / fwdbwd_host_ms are the host's launch times
(perf_counter around the call).  When a pass synchronises with the GPU inside (the host
then waits for the spin), its host time reaches the spin and the queued figure is
dropped with a note in queued_note.  --no-queued skips this timing.

Packed items (cu_seqlens): q, k, v, g, beta are [1, total tokens, ...], fla gets the
offsets on the device and, where its signature takes them, on the host (cu_seqlens_cpu);
if a pass still reads them back from the device, its queued figure is dropped as above.

usage: PYTHONPATH=.fla python3 tools/fla_bench.py [--shapes ITEM,...] [--H 16] [--K 128]
           [--V 128] [--reps 30] [--warmup 5] [--seed 1234] [--final-state] [--no-queued]
       python3 tools/fla_bench.py --check    # prints "ok" or what is missing (exit 1)
       python3 tools/fla_bench.py --parse-only --shapes ITEM,...   # the parsed shapes, no torch

--shapes: the items of bench_gdp.lua --shapes (lua/gdp/bench_shapes.lua):
  [H<h>K<k>V<v>:]<B>x<T>x<n>           B sequences of T tokens, n Householder steps
  [H<h>K<k>V<v>:]packed<N>mean<L>x<n>  N sequences of random lengths, mean L, packed (B = 1)
positive integers without leading zeros; the prefix gives the item its own heads (else
--H, --K, --V).  Packed lengths are uniform on [1, 2L - 1]: length i is 1 + x_i mod
(2L - 1), x_i the i-th output of splitmix64 started from --seed, as bench_gdp draws them.
One process times every item: Triton's autotuner keeps its choices per kernel and key
(fla's keys: H, K, V, the chunk size, some also B or varlen; n is a compile-time constant
of the deltaproduct kernels, so by these keys a new n compiles but does not re-tune;
warmup_s says what each row paid), and with fla's FLA_CACHE_RESULTS=1 (its default) on
disk under TRITON_CACHE_DIR too, next to the compiled kernels, so a warm cache skips both.

Output: {"tool", "dtype", "fla_version", "fla_commit", "fla_path", "torch", "triton",
"python", "device", "final_state", "H", "K", "V", "reps", "warmup", "seed", "rows":
[{"shape" (the item, canonical), "B", "T", "n", "H", "K", "V", "packed", "seqs",
"mean_len", "tokens", "lengths" (packed: the N lengths, else null), "fwd_ms",
"fwd_min_ms", "fwdbwd_ms", "fwdbwd_min_ms", "warmup_s" (wall seconds of the untimed
warm-up: compile and autotune land there), "fwd_queued_ms", "fwdbwd_queued_ms",
"fwd_host_ms", "fwdbwd_host_ms", "queued_note"}, ...]}; times in milliseconds, medians
unless named _min_; the queued fields are null (with queued_note saying why) when that
timing was skipped or invalid.  For a packed item B = 1 and T = tokens.  A shape that
failed has no times and "error" (the exception) instead; the others still run.
"""
import argparse
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys

NUM = r"([1-9][0-9]*)"
HEAD_RE = re.compile(rf"^H{NUM}K{NUM}V{NUM}:(.*)$")
PLAIN_RE = re.compile(rf"^{NUM}x{NUM}x{NUM}$")
PACKED_RE = re.compile(rf"^packed{NUM}mean{NUM}x{NUM}$")
SYNTAX = ("[H<h>K<k>V<v>:]<B>x<T>x<n> or [H<h>K<k>V<v>:]packed<N>mean<L>x<n> (positive integers), "
          "such as 4x4096x2, H8K32V32:256x512x4 or packed1000mean200x2")
MASK64 = (1 << 64) - 1


def packed_lengths(count, mean, seed):
    """count lengths uniform on [1, 2 * mean - 1]: 1 + x_i mod (2 * mean - 1), x_i the
    i-th output of splitmix64 started from seed (lua/gdp/bench_shapes.lua draws the same)."""
    span = 2 * mean - 1
    x = seed & MASK64
    out = []
    for _ in range(count):
        x = (x + 0x9E3779B97F4A7C15) & MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        out.append(1 + z % span)
    return out


def label(s, H, K, V):
    """The item of shape s in canonical form, its heads written unless they are H, K, V."""
    body = (f"packed{s['seqs']}mean{s['mean_len']}x{s['n']}" if s["packed"]
            else f"{s['B']}x{s['T']}x{s['n']}")
    return body if (s["H"], s["K"], s["V"]) == (H, K, V) else f"H{s['H']}K{s['K']}V{s['V']}:{body}"


def parse_shapes(text, H, K, V, seed):
    """Comma-separated items (the syntax above) -> shape dicts {shape (the canonical item),
    B, T, n, H, K, V, packed, seqs, mean_len, tokens, lengths}; ValueError names the bad
    item and the syntax.  Items without a head prefix take H, K, V; packed lengths come
    from seed."""
    def numbers(groups):
        # as bench_gdp: positive integers that a double holds exactly, else not an item
        xs = tuple(int(x) for x in groups)
        return xs if max(xs) <= 2 ** 53 else None

    shapes, seen = [], set()
    for item in text.split(","):
        body, heads = item.strip(), (H, K, V)
        m = HEAD_RE.match(body)
        if m:
            heads, body = numbers(m.groups()[:3]), m.group(4)
        plain, packed = PLAIN_RE.match(body), PACKED_RE.match(body)
        plain, packed = plain and numbers(plain.groups()), packed and numbers(packed.groups())
        if heads and plain:
            B, T, n = plain
            s = {"B": B, "T": T, "n": n, "packed": False, "seqs": B, "mean_len": None, "lengths": None}
        elif heads and packed:
            N, L, n = packed
            lengths = packed_lengths(N, L, seed)
            s = {"B": 1, "T": sum(lengths), "n": n, "packed": True, "seqs": N, "mean_len": L,
                 "lengths": lengths}
        else:
            raise ValueError(f"--shapes: bad item '{item}' in '{text}': expected comma-separated items {SYNTAX}")
        s["H"], s["K"], s["V"] = heads
        s["tokens"] = s["B"] * s["T"]
        s["shape"] = label(s, H, K, V)
        if s["shape"] in seen:
            raise ValueError(f"--shapes: item '{item}' in '{text}' is the shape of an earlier item "
                             f"({s['shape']}): each shape once")
        seen.add(s["shape"])
        shapes.append(s)
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
    # it guards against is absent; so set, its gradients agree with a float64
    # reference to about 5e-3 at K = 128.
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
    """Median, min and max event ms of fn over reps after warmup untimed calls, and the
    warm-up's wall seconds (where Triton compiles and autotunes on a kernel's first call)."""
    import time
    import torch
    t0 = time.perf_counter()
    for _ in range(warmup):
        reset()
        fn()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
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
    return statistics.median(times), min(times), max(times), warm_s


# The spin that holds the stream while a queued pass is launched: long against any
# pass's host time here (a few ms), short enough that 2 x reps of them stay cheap.
QUEUE_SPIN_MS = 20.0


def spin_cycles_per_ms():
    """GPU clock cycles per millisecond of torch.cuda._sleep, measured with events."""
    import torch
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # first call loads the kernel
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / max(a.elapsed_time(b), 1e-3)


def time_queued_ms(fn, reps, reset, cycles_per_ms):
    """Median GPU-only ms of fn (the stream held by a spin while fn launches), median host
    ms of launching it, and None or a note when the queued figure is not valid."""
    import time
    import torch
    gpu, host = [], []
    for _ in range(reps):
        reset()
        torch.cuda.synchronize()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(QUEUE_SPIN_MS * cycles_per_ms))
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b))
    note = None
    if statistics.median(host) > 0.5 * QUEUE_SPIN_MS:
        note = (f"host time {statistics.median(host):.2f} ms reaches the {QUEUE_SPIN_MS:.0f} ms spin: "
                "the pass waits for the GPU inside, so the queued figure would include host gaps")
    return statistics.median(gpu), statistics.median(host), note


def bench(op, s, reps, warmup, seed, final_state, cycles_per_ms, queued_off):
    """Times fla at shape s (a parse_shapes dict); returns its row."""
    import inspect
    import torch
    import torch.nn.functional as F
    torch.manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    B, T, n, H, K, V = s["B"], s["T"], s["n"], s["H"], s["K"], s["V"]
    q = torch.randn(B, T, H, K, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, T * n, H, K, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, T * n, H, V, device=dev, dtype=dt, requires_grad=True)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev, dtype=torch.float32)).to(dt).requires_grad_()
    beta = torch.rand(B, T * n, H, device=dev, dtype=dt).sigmoid().requires_grad_()
    do = torch.randn(B, T, H, V, device=dev, dtype=dt)
    varlen = {}
    if s["packed"]:
        cu = [0, *itertools.accumulate(s["lengths"])]
        varlen["cu_seqlens"] = torch.tensor(cu, dtype=torch.long, device=dev)
        # the host copy spares fla reading the offsets back from the device, where it takes one
        try:
            takes_host_copy = "cu_seqlens_cpu" in inspect.signature(op).parameters
        except (TypeError, ValueError):
            takes_host_copy = False
        if takes_host_copy:
            varlen["cu_seqlens_cpu"] = torch.tensor(cu, dtype=torch.long)
    dht = torch.randn(s["seqs"], H, K, V, device=dev, dtype=torch.float32) if final_state else None
    leaves = (q, k, v, g, beta)

    def reset():
        for t in leaves:
            t.grad = None

    def fwd():
        with torch.no_grad():
            op(q, k, v, g, beta, num_householder=n, use_qk_l2norm_in_kernel=True,
               output_final_state=final_state, **varlen)

    def fwdbwd():
        o, ht = op(q, k, v, g, beta, num_householder=n, use_qk_l2norm_in_kernel=True,
                   output_final_state=final_state, **varlen)
        if final_state:
            torch.autograd.backward((o, ht), (do, dht))
        else:
            o.backward(do)

    f = time_ms(fwd, reps, warmup, reset)
    fb = time_ms(fwdbwd, reps, warmup, reset)
    row = {"shape": s["shape"], "B": B, "T": T, "n": n, "H": H, "K": K, "V": V, "packed": s["packed"],
           "seqs": s["seqs"], "mean_len": s["mean_len"], "tokens": s["tokens"], "lengths": s["lengths"],
           "fwd_ms": f[0], "fwd_min_ms": f[1], "fwdbwd_ms": fb[0], "fwdbwd_min_ms": fb[1],
           "warmup_s": f[3] + fb[3],
           "fwd_queued_ms": None, "fwdbwd_queued_ms": None, "fwd_host_ms": None,
           "fwdbwd_host_ms": None, "queued_note": queued_off}
    if cycles_per_ms:
        # the eager figures stand whatever happens here
        try:
            fq = time_queued_ms(fwd, reps, reset, cycles_per_ms)
            fbq = time_queued_ms(fwdbwd, reps, reset, cycles_per_ms)
            row.update({"fwd_host_ms": fq[1], "fwdbwd_host_ms": fbq[1],
                        "queued_note": "; ".join(x for x in (fq[2], fbq[2]) if x) or None})
            if fq[2] is None:
                row["fwd_queued_ms"] = fq[0]
            if fbq[2] is None:
                row["fwdbwd_queued_ms"] = fbq[0]
        except Exception as e:  # noqa: BLE001 -- reported in the row, eager times kept
            row["queued_note"] = f"queued timing failed: {type(e).__name__}: {e}"
    del q, k, v, g, beta, do, dht, leaves, varlen
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description="Times fla's chunk_gated_delta_product; JSON on stdout.")
    ap.add_argument("--shapes", default="4x4096x1,4x4096x2,4x4096x3,1x32768x2",
                    help=f"comma-separated items {SYNTAX}")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--final-state", action="store_true",
                    help="return ht and take a dht in the backward (bench_gdp's default)")
    ap.add_argument("--no-queued", action="store_true",
                    help="skip the queued (GPU-only) timing of each pass")
    ap.add_argument("--check", action="store_true",
                    help="print 'ok' or what is missing (exit status 1), time nothing")
    ap.add_argument("--parse-only", action="store_true",
                    help="print the parsed shapes as JSON ({\"rows\": [...]}, no times) and exit; "
                         "needs no torch")
    a = ap.parse_args()
    if a.check:
        problem = check()
        print("ok" if problem is None else problem, flush=True)
        sys.exit(0 if problem is None else 1)
    if not 0 <= a.seed <= 2 ** 53:
        ap.error(f"--seed: expected an integer in [0, 2^53], got {a.seed}")
    try:
        shapes = parse_shapes(a.shapes, a.H, a.K, a.V, a.seed)
    except ValueError as e:
        ap.error(str(e))
    if a.parse_only:
        print(json.dumps({"H": a.H, "K": a.K, "V": a.V, "seed": a.seed, "rows": shapes}))
        return
    if a.reps < 1 or a.warmup < 0:
        ap.error(f"--reps must be >= 1 and --warmup >= 0, got {a.reps} and {a.warmup}")

    import torch
    import triton
    op = load_fla()
    cycles_per_ms, queued_off = None, "skipped (--no-queued)"
    if not a.no_queued:
        try:
            cycles_per_ms = spin_cycles_per_ms()
        except Exception as e:  # noqa: BLE001 -- the eager timing does not need the spin
            queued_off = f"no spin kernel: {type(e).__name__}: {e}"
    rows = []
    for s in shapes:
        try:
            r = bench(op, s, a.reps, a.warmup, a.seed, a.final_state, cycles_per_ms, queued_off)
        except Exception as e:  # noqa: BLE001 -- one shape's failure (an OOM, a limit of fla's) is its row's
            rows.append({**s, "error": f"{type(e).__name__}: {e}"})
            print(f"fla {s['shape']}: {rows[-1]['error']}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
            continue
        rows.append(r)
        queued = ("" if r["fwdbwd_queued_ms"] is None else
                  f"; queued (GPU only) fwd+bwd {r['fwdbwd_queued_ms']:.3f} ms, host {r['fwdbwd_host_ms']:.3f} ms")
        print(f"fla {s['shape']} (B={s['B']} T={s['T']} H={s['H']} K={s['K']} V={s['V']}): "
              f"fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwdbwd_ms']:.3f} ms{queued}; warm-up {r['warmup_s']:.1f} s"
              + (f" ({r['queued_note']})" if r["queued_note"] else ""), file=sys.stderr, flush=True)
    out = {"tool": "fla chunk_gated_delta_product", "dtype": "bf16",
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "device": torch.cuda.get_device_name(),
           "final_state": a.final_state, "H": a.H, "K": a.K, "V": a.V, "reps": a.reps,
           "warmup": a.warmup, "seed": a.seed, "rows": rows}
    out.update(fla_facts())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
