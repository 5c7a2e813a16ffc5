#!/usr/bin/env python3
"""ncu_lines.py SOURCE_CSV [--top N] [--src-root DIR] -- a readable summary of Nsight Compute's
per-line source page (`ncu --import R --page source --csv --print-source cuda,sass`, as
`KERNELS=<regex> tools/gpu_run.sh profile` writes it), per kernel:

  * the warp stall samples by phase: a phase starts at each `/* ---- NAME` comment of the
    kernel's source file (the kernels mark their phases that way), and every SASS
    instruction counts for the last line of that file before it in address order (inlined
    helpers count for their caller; the compiler moves code, so this is approximate);
  * the top source lines by stall samples, with their three main stall reasons;
  * shared-memory float atomics compiled to compare-and-swap loops (SASS ATOMS.CAST.SPIN),
    by call site.

Standard library only.  Source files are looked up at the CSV's path, else by file name
under --src-root (the profiled tree: line numbers must match)."""
import argparse
import collections
import csv
import os
import re
import sys

STALL = "Warp Stall Sampling (All Samples)"
INSTR = "Instructions Executed"


def short_kernel(name):
    m = re.search(r"(\w+)<", name)
    return m.group(1) if m else name[:60]


def read(path):
    """{kernel: {"sass": {addr: (file, line, text, samples, instr, {stall: n})},
    "lines": {(file, line): (source, samples, instr, {stall: n})}, "paths": {file: path}}}"""
    kernels = collections.OrderedDict()
    cur_path = cur_k = hdr = None
    cur_line = None
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "File Path":
                cur_path = r[1]
                continue
            if r[0] == "Function Name":
                cur_k = kernels.setdefault(r[1], {"sass": {}, "lines": {}, "paths": {}})
                continue
            if r[0] == "Line No":
                hdr = r
                continue
            if hdr is None or cur_k is None:
                continue
            d = dict(zip(hdr, r))

            def num(key):
                try:
                    return float(d.get(key) or 0)
                except ValueError:
                    return 0.0

            stalls = {k[6:]: num(k) for k in hdr if k.startswith("stall_") and "Not Issued" not in k}
            fname = os.path.basename(cur_path)
            cur_k["paths"][fname] = cur_path
            if r[0]:  # a source line
                cur_line = (fname, int(r[0]))
                cur_k["lines"][cur_line] = (r[1], num(STALL), num(INSTR), stalls)
                continue
            try:
                addr = int(r[2], 16)
            except ValueError:
                continue
            if addr not in cur_k["sass"] and cur_line is not None:
                cur_k["sass"][addr] = (cur_line[0], cur_line[1], r[3].strip(), num(STALL), num(INSTR), stalls)
    return kernels


def phases_of(path, kernel):
    """[(line, name)]: the kernel's definition (from its `__global__` line to the first `}` in
    column 0 after it) and the `/* ---- NAME` markers inside it; [] if not found."""
    try:
        with open(path) as f:
            text = f.read().split("\n")
    except OSError:
        return []
    start = None
    for i, t in enumerate(text):
        if re.search(r"\b%s\(" % re.escape(kernel), t) and "__global__" in " ".join(text[max(0, i - 2) : i + 1]):
            start = i
            break
    if start is None:
        return []
    out = [(start + 1, "entry")]
    for i in range(start + 1, len(text)):
        if text[i].startswith("}"):
            break
        m = re.match(r"\s*/\* ---- (.*)", text[i])
        if m:
            out.append((i + 1, re.split(r"[:.;(]", m.group(1))[0].strip()[:40]))
    return out


def top_stalls(stalls, n=3):
    tot = sum(stalls.values()) or 1.0
    return ", ".join(f"{k} {100 * v / tot:.0f}%" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:n] if v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=15)
    here = os.path.dirname(os.path.abspath(__file__))
    default_root = os.path.join(here, "..", "kernels", "cuda")
    ap.add_argument("--src-root", help="where the profiled sources are (the profile's own tree, e.g. a `git archive` of "
                    "its commit); default: the CSV's paths, else this repository's kernels/cuda")
    args = ap.parse_args()
    kernels = read(args.csv)
    if not kernels:
        sys.exit(f"ncu_lines.py: no kernels in {args.csv} (not an ncu source page?)")
    for kname, k in kernels.items():
        sass = k["sass"]
        tot = sum(v[3] for v in sass.values()) or 1.0
        tinstr = sum(v[4] for v in sass.values()) or 1.0
        # the kernel's own file: the one with the most samples among files whose name is not a CUDA header
        per_file = collections.Counter()
        for v in sass.values():
            per_file[v[0]] += v[3]
        own = [f for f, _ in per_file.most_common() if not f.startswith(("cuda_", "sm_", "crt"))]
        print(f"== {short_kernel(kname)}: {tot:.0f} stall samples, {tinstr:.0f} warp instructions")
        print(f"   {kname[:160]}")
        if own:
            main_file = own[0]
            path = k["paths"].get(main_file, "")
            if args.src_root or not os.path.exists(path):
                path = os.path.join(args.src_root or default_root, main_file)
            marks = phases_of(path, short_kernel(kname))
            agg, ins, st = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
            owner = None
            for a in sorted(sass):
                f, ln, _, s, i, stalls = sass[a]
                if f == main_file:
                    owner = ln
                name = "(before the kernel's first line)"
                for start, nm in marks:
                    if owner is not None and owner >= start:
                        name = f"{start}: {nm}"
                agg[name] += s
                ins[name] += i
                for kk, vv in stalls.items():
                    st[name][kk] += vv
            print(f"   phases ({main_file}, '/* ---- ' markers; by SASS address, approximate):")
            for name in sorted(agg, key=lambda nm: int(nm.split(":")[0]) if nm[0].isdigit() else 0):
                print(f"     {name:46s} {100 * agg[name] / tot:5.1f}% samples {100 * ins[name] / tinstr:5.1f}% instr   {top_stalls(st[name])}")
        print(f"   top {args.top} source lines by stall samples:")
        for (f, ln), (src, s, i, stalls) in sorted(k["lines"].items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"     {100 * s / tot:5.1f}% {f}:{ln:<5d} {top_stalls(stalls):40s} {src.strip()[:70]}")
        cas = collections.Counter()
        owner = None
        for a in sorted(sass):
            f, ln, text, s, _, _ = sass[a]
            if not f.startswith(("cuda_", "sm_", "crt")):
                owner = (f, ln)
            if "ATOMS.CAST.SPIN" in text or (f.startswith("sm_20_atomic") and s):
                cas[owner] += s
        if cas:
            print(f"   shared-memory atomics as compare-and-swap loops: {100 * sum(cas.values()) / tot:.1f}% of samples")
            for (f, ln), s in cas.most_common(8):
                print(f"     {100 * s / tot:5.1f}% {f}:{ln}")
        print()


if __name__ == "__main__":
    main()
