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

--train instead trains that model on a group word problem to the end, as the study does
(a fixed training set of --train-seqs sequences at --length, reshuffled every epoch; AdamW
lr 1e-3 on a cosine schedule over --epochs; pure bf16 weights, no clipping, as the
authors; --bos puts a start token in front with its label ignored), evaluating every
--eval-every steps on --eval-batch fresh sequences at --eval-len and stopping at 0.99:
the authors' stack on the same task, to tell a setup that cannot learn a task from a
model that does not.  Its rows: {"task", "nh", "beta_max", "bos", "steps", "loss",
"train_s", "curve": [[step, loss, acc_at_length...]], "acc": {length: cumulative
sequence accuracy}}.  The data come from this script's own generator (permutation
composition, label = the prefix product), independent of gdp's.

  PYTHONPATH=.fla python3 tools/fla_state_tracking.py --train --task S5 --nh 4 --bos

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
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--task", default="S5")
    ap.add_argument("--bos", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--train-seqs", type=int, default=99000)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--eval-batch", type=int, default=2048)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--early-stop", type=float, default=0.99)
    ap.add_argument("--time-budget", type=float, default=0.0)
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
    if a.train:
        rows = [train(a, torch, F, GatedDeltaProductConfig, GatedDeltaProductForCausalLM, dev, int(nh))
                for nh in a.nh.split(",")]
        print(json.dumps({"tool": "fla_state_tracking", "mode": "train", "fla_commit": commit,
                          "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                          "args": vars(a), "rows": rows}))
        return
    rows = []
    for nh in [int(x) for x in a.nh.split(",")]:
        model, opt = model_and_optimizer(a, torch, GatedDeltaProductConfig, GatedDeltaProductForCausalLM,
                                         dev, nh, a.vocab)
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


def model_and_optimizer(a, torch, Config, Model, dev, nh, vocab):
    """The study's model (one layer; no short conv, output gate or forget gate; x4 SwiGLU)
    in bf16 and its AdamW."""
    cfg = Config(
        hidden_size=a.hidden, num_heads=a.heads, head_dim=a.head_dim, expand_v=1.0,
        use_output_gate=False, use_short_conv=False, use_forget_gate=False,
        allow_neg_eigval=a.beta_max == 2, num_householder=nh, num_hidden_layers=1,
        hidden_ratio=4, vocab_size=vocab, fuse_cross_entropy=False, tie_word_embeddings=False)
    model = Model(cfg).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=1e-6)
    return model, opt


def group_table(task):
    """The multiplication table of S3, S4 or S5 (elements: permutations in lexicographic
    order; (p q)(i) = p[q[i]]) as a list of rows."""
    import itertools
    degree = {"S3": 3, "S4": 4, "S5": 5}.get(task)
    if degree is None:
        raise SystemExit(f"fla_state_tracking: --task: expected S3, S4 or S5, got {task}")
    perms = list(itertools.permutations(range(degree)))
    index = {p: i for i, p in enumerate(perms)}
    return [[index[tuple(p[q[i]] for i in range(degree))] for q in perms] for p in perms]


def word_problems(torch, table, count, length, gen, dev):
    """count sequences of uniform group elements and their prefix products."""
    x = torch.randint(0, table.shape[0], (count, length), generator=gen, device=dev)
    y = torch.empty_like(x)
    y[:, 0] = x[:, 0]
    for t in range(1, length):
        y[:, t] = table[y[:, t - 1], x[:, t]]
    return x, y


def cumulative_accuracy(torch, pred, y):
    """For each prefix length t, the fraction of sequences with every label up to t right."""
    return torch.cumprod((pred == y).float(), dim=1).mean(dim=0)


def train(a, torch, F, Config, Model, dev, nh):
    table = torch.tensor(group_table(a.task), device=dev)
    vocab = table.shape[0]
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    x_train, y_train = word_problems(torch, table, a.train_seqs, a.length, gen, dev)
    gen.manual_seed(2)
    x_test, y_test = word_problems(torch, table, a.eval_batch, a.eval_len, gen, dev)
    torch.manual_seed(a.seed)
    model, opt = model_and_optimizer(a, torch, Config, Model, dev, nh, vocab + (1 if a.bos else 0))
    per_epoch = (a.train_seqs + a.batch - 1) // a.batch
    total = a.epochs * per_epoch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)

    def with_bos(x):
        if not a.bos:
            return x
        start = torch.full((x.shape[0], 1), vocab, dtype=x.dtype, device=dev)
        return torch.cat([start, x], dim=1)

    def logits_of(x):
        out = model(input_ids=with_bos(x)).logits
        return out[:, 1:] if a.bos else out

    lengths = sorted({min(a.length, a.eval_len), min(256, a.eval_len), a.eval_len})

    def evaluate():
        model.eval()
        with torch.no_grad():
            pred = torch.cat([logits_of(x_test[i:i + 256]).argmax(-1)
                              for i in range(0, a.eval_batch, 256)])
        model.train()
        acc = cumulative_accuracy(torch, pred, y_test)
        return {t: float(acc[t - 1]) for t in lengths}

    curve, step, loss_value = [], 0, float("nan")
    t0 = time.perf_counter()
    stop = False
    for epoch in range(a.epochs):
        order = torch.randperm(a.train_seqs, device=dev)
        for b in range(per_epoch):
            idx = order[b * a.batch:(b + 1) * a.batch]
            opt.zero_grad(set_to_none=True)
            logits = logits_of(x_train[idx])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y_train[idx].reshape(-1))
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step == 1:  # fla's Triton compile and autotune happen here, minutes per new (K, n)
                torch.cuda.synchronize()
                print(f"fla_state_tracking: {a.task} nh={nh} first step done after "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
            if step % a.eval_every == 0 or step == total:
                loss_value = float(loss)
                acc = evaluate()
                curve.append([step, loss_value] + [acc[t] for t in lengths])
                print(f"fla_state_tracking: {a.task} nh={nh} step {step}/{total} loss {loss_value:.4f} "
                      + " ".join(f"acc@{t} {acc[t]:.3f}" for t in lengths), file=sys.stderr)
                if a.early_stop > 0 and acc[a.eval_len] >= a.early_stop:
                    stop = True
                if a.time_budget > 0 and time.perf_counter() - t0 > a.time_budget:
                    stop = True
            if stop:
                break
        if stop:
            break
    acc = evaluate()
    row = {"task": a.task, "nh": nh, "beta_max": a.beta_max, "bos": a.bos, "seed": a.seed,
           "steps": step, "steps_planned": total, "loss": loss_value,
           "train_s": time.perf_counter() - t0, "lengths": lengths, "curve": curve,
           "acc": {str(t): acc[t] for t in lengths}}
    del model, opt
    torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    main()
