#!/usr/bin/env bash
# Session 12, call 2 (warm machine after call 1, which built /tmp/gdp-lab/lab from main and
# /tmp/lab-lab-next12/lab from lab/next12): A/B medians of 10, both labs, two rounds, the
# four benchmark shapes; then each lab's per-kernel profile.  The call ran past its 300 s
# limit in the second round (each lab bench call takes ~19 s with its warm-up): ab.log
# holds what it had.
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session12/call2.sh
OUT=${OUT:?set OUT}
for r in 1 2; do
  for L in /tmp/gdp-lab/lab /tmp/lab-lab-next12/lab; do
    echo "== $L round $r"
    for s in "4 4096 2" "4 4096 1" "4 4096 3" "1 32768 2"; do
      timeout 40 $L bench $s v3 v5 --reps 10 2>&1 | grep -E "chunk_v3|saved_s16 fwd" | sed "s/^/[$s] /"
    done
  done
done 2>&1 | tee "$OUT/ab.log"
