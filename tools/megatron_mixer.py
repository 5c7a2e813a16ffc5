#!/usr/bin/env python3
"""Times Megatron-Core's GatedDeltaProductMixer (forward, forward+backward, bf16, one GPU) at
the shapes experiments/bench_mixer.lua times, in the same run: the anchor of that benchmark.

  PYTHONPATH=.megatron:.fla python3 tools/megatron_mixer.py --shapes T:B:D:nh:P:ng:N:M[,...]
         [--reps 10] [--warmup 3] [--conv-bias 0|1] [--check]

Needs Megatron-Core's source (its megatron/core folder in an ignored .megatron/megatron/core)
and fla's (fla/__init__.py, utils, ops, modules in .fla), torch and triton, and a CUDA device.
causal_conv1d and mamba_ssm may be absent: Megatron then takes its torch conv path, and the
gated RMSNorm is a torch stand-in with mamba_ssm's semantics (norm after the gate, groups of
d_inner / ngroups, statistics in float32), installed before Megatron is imported.

Prints one JSON object per line: per shape {tool, T, B, D, nh, P, ng, N, M, fwd_ms,
fwdbwd_ms (medians of CUDA-event times over --reps on fresh inputs), peak_bytes
(torch.cuda.max_memory_allocated during one forward+backward minus the memory allocated
before it: the activations and gradients of the step), params, device, torch}, or
{error: ...}.  --check prints {"ok": true, ...} when everything imports and a device is there.
"""
import argparse
import json
import os
import sys
import types


def fail(msg):
    print(json.dumps({"error": msg}), flush=True)
    sys.exit(1)


try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except Exception as e:  # noqa: BLE001
    fail("torch: %s" % e)


class GatedRMSNorm(nn.Module):
    """mamba_ssm's RMSNorm(x * silu(z)) over groups (norm_before_gate=False), in float32."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size or hidden_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        if self.norm_before_gate:
            raise NotImplementedError("norm_before_gate=True")
        dt = x.dtype
        x = x.float()
        if z is not None:
            x = x * F.silu(z.float())
        shape = x.shape
        xg = x.reshape(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        xg = xg * torch.rsqrt((xg * xg).mean(-1, keepdim=True) + self.eps)
        return (xg.reshape(shape) * self.weight.float()).to(dt)


def install_stand_ins():
    try:
        import mamba_ssm.ops.triton.layernorm_gated  # noqa: F401
        return "mamba_ssm"
    except Exception:  # noqa: BLE001
        pass
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
                 "mamba_ssm.ops.triton.layernorm_gated"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["mamba_ssm.ops.triton.layernorm_gated"].RMSNorm = GatedRMSNorm
    return "torch stand-in"


def import_megatron():
    # one process, one GPU: no NVLink multicast
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    norm = install_stand_ins()
    import fla.ops.common.chunk_o as chunk_o
    # fla refuses its gated backward on Triton 3.6 + Hopper unless told the version is new
    chunk_o.TRITON_ABOVE_3_7_1 = True
    import megatron.core.ssm.packed_seq_helpers as psh
    psh.check_fla_sequence_packing_support = lambda: (True, None)
    import megatron.core.ssm.gated_delta_product as mixer_mod
    mixer_mod.check_fla_sequence_packing_support = lambda: (True, None)
    return mixer_mod, norm


def setup_parallel():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)


def make_mixer(mixer_mod, T, B, D, nh, P, ng, N, M, conv_bias):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=D, num_attention_heads=nh,
                            mamba_num_heads=nh, mamba_head_dim=P, mamba_num_groups=ng,
                            mamba_state_dim=N, gdp_num_householder=M,
                            params_dtype=torch.bfloat16, bf16=True)
    sub = mixer_mod.GatedDeltaProductMixerSubmodules(in_proj=ColumnParallelLinear,
                                                     out_proj=RowParallelLinear)
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    return mixer_mod.GatedDeltaProductMixer(cfg, sub, D, d_conv=4, conv_bias=conv_bias,
                                            layer_number=1, pg_collection=pg).cuda()


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def bench(mixer_mod, shape, reps, warmup, conv_bias):
    T, B, D, nh, P, ng, N, M = shape
    m = make_mixer(mixer_mod, T, B, D, nh, P, ng, N, M, conv_bias)

    def inputs():
        x = torch.randn(T, B, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, B, D, device="cuda", dtype=torch.bfloat16)
        return x, dy

    for _ in range(warmup):
        x, dy = inputs()
        out, _ = m(x)
        out.backward(dy)
    m.zero_grad(set_to_none=False)
    torch.cuda.synchronize()

    fwd, fb = [], []
    for _ in range(reps):
        x, dy = inputs()  # fresh inputs, drawn outside the timed region
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        out, _ = m(x)
        ev[1].record()
        out.backward(dy)
        ev[2].record()
        torch.cuda.synchronize()
        fwd.append(ev[0].elapsed_time(ev[1]))
        fb.append(ev[0].elapsed_time(ev[2]))
        del out, x, dy

    # memory of one step: what a forward+backward allocates beyond parameters and grads
    x, dy = inputs()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, _ = m(x)
    out.backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return dict(tool="megatron GatedDeltaProductMixer", T=T, B=B, D=D, nh=nh, P=P, ng=ng, N=N,
                M=M, conv_bias=bool(conv_bias), reps=reps, fwd_ms=median(fwd),
                fwdbwd_ms=median(fb), peak_bytes=int(peak),
                params=sum(p.numel() for p in m.parameters()),
                device=torch.cuda.get_device_name(0), torch=torch.__version__)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096:4:2048:16:128:4:128:2,4096:4:2048:16:128:4:128:3",
                    help="T:B:D:nh:P:ng:N:M, comma-separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--conv-bias", type=int, default=1)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    shapes = []
    for s in a.shapes.split(","):
        v = [int(x) for x in s.split(":")]
        if len(v) != 8:
            fail("--shapes: expected T:B:D:nh:P:ng:N:M, got %s" % s)
        shapes.append(v)
    if not torch.cuda.is_available():
        fail("no CUDA device visible to torch")
    try:
        mixer_mod, norm = import_megatron()
    except Exception as e:  # noqa: BLE001
        fail("importing Megatron-Core / fla (PYTHONPATH=%s): %s: %s"
             % (os.environ.get("PYTHONPATH", ""), type(e).__name__, e))
    if a.check:
        print(json.dumps({"ok": True, "norm": norm, "torch": torch.__version__,
                          "device": torch.cuda.get_device_name(0)}), flush=True)
        return
    setup_parallel()
    for shape in shapes:
        try:
            r = bench(mixer_mod, shape, a.reps, a.warmup, a.conv_bias != 0)
            r["norm"] = norm
        except Exception as e:  # noqa: BLE001
            r = {"error": "%s: %s" % (type(e).__name__, e), "shape": shape}
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
