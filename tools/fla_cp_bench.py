#!/usr/bin/env python3
"""fla_cp_bench.py -- the context-parallel anchors of experiments/bench_cp.lua (issue 23's
two-GPU run): fla's two ways of running a GDP operator over a sequence split across
ranks, timed at bench_cp's shapes, one process per GPU, over NCCL; ONE JSON object on
stdout from rank 0 (progress on stderr).

  chunkwise  fla's KCP (fla.ops.cp): fla has no CP for chunk_gated_delta_product, so the
             operator runs as chunk_gated_delta_rule on the expanded stream of n steps per
             token -- q on each token's last step, the gate on its first, zeros elsewhere,
             as fla's own chunk_gated_delta_product expands it -- with cp_context built
             from the global cu_seqlens; the outputs are the last steps' rows.  The
             expansion and the row selection are inside the timed region.
  headwise   one all-to-all (torch.distributed.nn, differentiable) of q, k, v, g, beta from
             a sequence shard of all heads to the whole sequence of H / cp heads,
             chunk_gated_delta_product there, one all-to-all of o back.
  plain      (world size 1 only) chunk_gated_delta_product on the rank's tokens: the
             cp = 1 baseline of the weak-scaling efficiency t(cp = 1) / t(cp).

Inputs as bench_cp draws them (not the same numbers): bf16, B = 1, one sequence of
tokens_per_rank x cp tokens, q, k, v ~ N(0, 1), g = -0.1 U(0, 1), beta ~ U(0, 1),
use_qk_l2norm_in_kernel, scale K^-0.5.  Every rank draws the same global batch from
--seed and takes its shard.  A time is the slowest rank's median over --reps repeats, each
started after a barrier and ended by a device synchronisation (as bench_cp's); fwd and
fwd+bwd (backward of sum(o * do) into q, k, v, g, beta).  --check first compares each
mode's outputs and input gradients on every rank's shard with fla's own
chunk_gated_delta_product on the whole global batch (max |a - b| / max |b| over the
ranks, reported per row; a row above 2e-2 makes the exit status 1).

usage: mpirun -np P python3 tools/fla_cp_bench.py [--n 1,2] [--tokens-per-rank 16384,4096]
           [--H 16] [--K 128] [--V 128] [--modes chunkwise,headwise] [--reps 15]
           [--warmup 3] [--seed 1] [--check]
       (PYTHONPATH=.fla; rank and size from Open MPI's or torchrun's environment;
       MASTER_ADDR / MASTER_PORT default 127.0.0.1:29517)

Output: {"tool", "world", "fla_commit", "torch", "triton", "device", "H", "K", "V",
"reps", "warmup", "seed", "rows": [{"mode", "n", "tokens_per_rank", "T", "fwd_ms",
"fwdbwd_ms", "fwd_min_ms", "fwdbwd_min_ms", "check_rel_err" (null without --check),
"error" (instead of times when the mode failed)}, ...]}
"""
import argparse
import json
import os
import statistics
import sys


def env_int(*names, default):
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return default


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,2")
    ap.add_argument("--tokens-per-rank", default="16384,4096")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--modes", default="chunkwise,headwise")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fla_bench import load_fla  # fla's operator, its Triton 3.6 guard set as fla_bench sets it
    chunk_gated_delta_product = load_fla()
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    rank = env_int("OMPI_COMM_WORLD_RANK", "RANK", default=0)
    world = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", default=1)
    local = env_int("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", default=rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(local % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    except TypeError:  # a torch without device_id
        dist.init_process_group("nccl", rank=rank, world_size=world)
    H, K, V = args.H, args.K, args.V
    if H % world:
        raise SystemExit(f"--H {H}: headwise needs H divisible by the world size {world}")
    scale = K ** -0.5
    modes = args.modes.split(",")
    if world == 1 and "plain" not in modes:
        modes = ["plain"] + modes

    def global_batch(T, n):
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        def r(*s):
            return torch.randn(*s, device=dev, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        def u(*s):
            return torch.rand(*s, device=dev, generator=gen, dtype=torch.float32)
        x = {"q": r(1, T, H, K), "k": r(1, T * n, H, K), "v": r(1, T * n, H, V),
             "g": (-0.1 * u(1, T, H)).to(torch.bfloat16), "beta": u(1, T * n, H).to(torch.bfloat16),
             "do": r(1, T, H, V)}
        return x

    def shard(x, n, Lc):
        out = {}
        for name, t in x.items():
            per = n if name in ("k", "v", "beta") else 1
            out[name] = t[:, rank * Lc * per:(rank + 1) * Lc * per].contiguous()
        return out

    def leaves(x):
        return {name: (t.detach().clone().requires_grad_(name != "do")) for name, t in x.items()}

    def run_plain(x, n, ctx):
        o, _ = chunk_gated_delta_product(x["q"], x["k"], x["v"], x["g"], x["beta"], num_householder=n,
                                         scale=scale, use_qk_l2norm_in_kernel=True)
        return o

    def run_chunkwise(x, n, ctx):
        q, g = x["q"], x["g"]
        Lc = q.shape[1]
        qe = q.new_zeros(1, Lc, n, H, K)
        qe[:, :, n - 1] = q
        ge = g.new_zeros(1, Lc, n, H, dtype=torch.float32)
        ge[:, :, 0] = g.float()
        o, _ = chunk_gated_delta_rule(qe.view(1, Lc * n, H, K), x["k"], x["v"], ge.view(1, Lc * n, H),
                                      x["beta"], scale=scale, use_qk_l2norm_in_kernel=True, cp_context=ctx)
        return o.view(1, Lc, n, H, V)[:, :, n - 1]

    def seq_to_heads(t):
        # [1, L, H, ...] sequence shard of all heads -> [1, L * world, H / world, ...]
        parts = torch.stack(t.chunk(world, dim=2), 0).contiguous()  # [world, 1, L, H/w, ...]
        out = dnn.all_to_all_single(torch.empty_like(parts), parts)
        return torch.cat(out.unbind(0), dim=1)

    def heads_to_seq(t):
        parts = torch.stack(t.chunk(world, dim=1), 0).contiguous()  # [world, 1, L, H/w, ...]
        out = dnn.all_to_all_single(torch.empty_like(parts), parts)
        return torch.cat(out.unbind(0), dim=2)

    def run_headwise(x, n, ctx):
        ins = [seq_to_heads(x[name]) for name in ("q", "k", "v", "g", "beta")]
        o, _ = chunk_gated_delta_product(*ins, num_householder=n, scale=scale, use_qk_l2norm_in_kernel=True)
        return heads_to_seq(o)

    RUN = {"plain": run_plain, "chunkwise": run_chunkwise, "headwise": run_headwise}

    def rel_err(a, b):
        e = torch.tensor([(a.float() - b.float()).abs().max().item(), b.float().abs().max().item()],
                         device=dev, dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        return (e[0] / e[1]).item() if e[1] > 0 else e[0].item()

    def check(mode, n, Lc):
        gx = leaves(global_batch(Lc * world, n))
        ref = run_plain(gx, n, None)
        (ref.float() * gx["do"].float()).sum().backward()
        x = leaves(shard({k: t.detach() for k, t in gx.items()}, n, Lc))
        ctx = build_cp_context(torch.tensor([0, Lc * world * n], device=dev, dtype=torch.int64),
                               group=dist.group.WORLD) if mode == "chunkwise" else None
        o = RUN[mode](x, n, ctx)
        (o.float() * x["do"].float()).sum().backward()
        sx = shard({k: (t.grad if t.grad is not None else t).detach() for k, t in gx.items()}, n, Lc)
        errs = {"o": rel_err(o, shard({"q": ref.detach()}, n, Lc)["q"])}
        for name in ("q", "k", "v", "g", "beta"):
            errs["d" + name] = rel_err(x[name].grad, sx[name])
        return errs

    def timed(mode, n, Lc, backward):
        x = leaves(shard(global_batch(Lc * world, n), n, Lc))
        ctx = build_cp_context(torch.tensor([0, Lc * world * n], device=dev, dtype=torch.int64),
                               group=dist.group.WORLD) if mode == "chunkwise" else None
        ts = []
        for i in range(args.warmup + args.reps):
            for t in x.values():
                t.grad = None
            dist.barrier()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            o = RUN[mode](x, n, ctx)
            if backward:
                o.backward(x["do"])
            b.record()
            torch.cuda.synchronize()
            if i >= args.warmup:
                ts.append(a.elapsed_time(b))
        m = torch.tensor([statistics.median(ts), min(ts)], device=dev, dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return m[0].item(), m[1].item()

    import time
    t_start = time.time()

    def progress(what):
        if rank == 0:
            log(f"fla_cp_bench [{time.time() - t_start:.0f}s] {what}")

    progress(f"world {world}, modes {','.join(modes)}")
    rows, bad = [], False
    for tpr in [int(s) for s in args.tokens_per_rank.split(",")]:
        for n in [int(s) for s in args.n.split(",")]:
            for mode in modes:
                row = {"mode": mode, "n": n, "tokens_per_rank": tpr, "T": tpr * world, "check_rel_err": None}
                progress(f"{mode} n={n} {tpr}/rank (the first call of a (K, n) compiles and autotunes)")
                try:
                    if args.check:
                        row["check_rel_err"] = check(mode, n, tpr)
                        bad = bad or max(row["check_rel_err"].values()) > 2e-2
                    row["fwd_ms"], row["fwd_min_ms"] = timed(mode, n, tpr, False)
                    row["fwdbwd_ms"], row["fwdbwd_min_ms"] = timed(mode, n, tpr, True)
                except Exception as e:  # a failed mode is a row with its error; the rest run
                    row["error"] = f"{type(e).__name__}: {e}"
                    bad = True
                if rank == 0:
                    log(f"fla_cp {mode} n={n} {tpr}/rank world={world}: " +
                        (row.get("error") or f"fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwdbwd_ms']:.3f} ms"
                         + (f", check {max(row['check_rel_err'].values()):.2e}" if row["check_rel_err"] else "")))
                rows.append(row)

    if rank == 0:
        import triton
        commit_file = os.path.join(os.environ.get("PYTHONPATH", ".fla").split(":")[0], "COMMIT")
        commit = open(commit_file).read().strip() if os.path.exists(commit_file) else None
        print(json.dumps({"tool": "fla_cp_bench", "world": world, "fla_commit": commit,
                          "torch": torch.__version__, "triton": triton.__version__,
                          "device": torch.cuda.get_device_name(), "H": H, "K": K, "V": V,
                          "reps": args.reps, "warmup": args.warmup, "seed": args.seed, "rows": rows},
                         indent=1))
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
