#!/usr/bin/env bash
# Session 12, call 4 (carry .devbundle, .fla): main with lab/next12 merged -- the issue's
# benchmark with fla in the same run, then check_reference --device cuda and `./gdp test
# --quick` (the #gpu specs, the bitwise-reproducibility spec among them) on the same build.
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session12/call4.sh
set -u
OUT=${OUT:?set OUT}
bash tools/gpu_session.sh bench
LOG=$OUT/session.log
for run in "bf16" "f32" "bf16 --save-for-backward"; do
  echo "== $run" >> "$OUT/check_cuda.log"
  timeout 60 ./gdp experiments/check_reference.lua --device cuda --dtype $run >> "$OUT/check_cuda.log" 2>&1
  echo "check_reference $run rc=$? $(tail -1 "$OUT/check_cuda.log")" | tee -a "$LOG"
done
timeout 100 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1; echo "gdp test rc=$?" | tee -a "$LOG"
grep -E "^  .* (ok|FAILED)$|passed, [0-9]+ failed|reproducible|skipping" "$OUT/gdp_test.log" | tee -a "$LOG"
