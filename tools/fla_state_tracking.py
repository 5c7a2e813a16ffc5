#!/usr/bin/env python3
"""fla_state_tracking.py -- the authors' stack for experiments/state_tracking.lua --speed:
fla's GatedDeltaProductForCausalLM in PyTorch at the state-tracking config (one layer,
hidden 128, 8 heads x 32, no short conv, no output gate, no forget gate, x4 SwiGLU, bf16,
AdamW), timing whole training steps (zero_grad, forward, cross-entropy over every
position, backward, optimiser step) on random tokens, and printing ONE JSON object on
stdout: {"tool", "fla_commit", "torch", "device", "rows": [{"nh", "beta_max", "batch",
"length", "vocab", "steps", "step_ms", "step_min_ms", "tokens_per_s"}]}.

usage: PYTHONPATH=.fla python3 tools/fla_state_tracking.py --nh 1,2,3,4
           [--beta-max 2] [--vocab 120] [--batch 2048] [--length 128] [--steps 20]
           [--warmup 5] [--hidden 128] [--heads 8] [--head-dim 32]

fla's source needs fla/layers and fla/models here (transformers installed), besides the
operator benchmark's fla/ops, fla/modules and fla/utils.
"""
import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nh", default="1,2,3,4")
    ap.add_argument("--beta-max", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=120)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    # Triton 3.6 on Hopper: fla refuses its gated backward unless told the version is fine
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True
    from fla.models import GatedDeltaProductConfig, GatedDeltaProductForCausalLM

    # <fla copy>/fla/ops/common/chunk_o.py -> <fla copy>/COMMIT (written when the copy was made)
    copy_root = os.path.abspath(chunk_o.__file__)
    for _ in range(4):
        copy_root = os.path.dirname(copy_root)
    commit_file = os.path.join(copy_root, "COMMIT")
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else None
    dev = torch.device("cuda")
    rows = []
    for nh in [int(x) for x in a.nh.split(",")]:
        cfg = GatedDeltaProductConfig(
            hidden_size=a.hidden, num_heads=a.heads, head_dim=a.head_dim, expand_v=1.0,
            use_output_gate=False, use_short_conv=False, use_forget_gate=False,
            allow_neg_eigval=a.beta_max == 2, num_householder=nh, num_hidden_layers=1,
            hidden_ratio=4, vocab_size=a.vocab, fuse_cross_entropy=False, tie_word_embeddings=False)
        model = GatedDeltaProductForCausalLM(cfg).to(dev, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=1e-6)
        x = torch.randint(0, a.vocab, (a.batch, a.length), device=dev)
        y = torch.randint(0, a.vocab, (a.batch, a.length), device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), y.reshape(-1))
            loss.backward()
            opt.step()

        for _ in range(a.warmup):
            step()
        times = []
        for _ in range(a.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        med = times[len(times) // 2]
        rows.append({"nh": nh, "beta_max": a.beta_max, "batch": a.batch, "length": a.length,
                     "vocab": a.vocab, "steps": a.steps, "step_ms": med * 1e3,
                     "step_min_ms": times[0] * 1e3, "tokens_per_s": a.batch * a.length / med})
        print(f"fla_state_tracking: nh={nh} {med * 1e3:.2f} ms/step", file=sys.stderr)
        del model, opt
        torch.cuda.empty_cache()
    print(json.dumps({"tool": "fla_state_tracking", "fla_commit": commit, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
