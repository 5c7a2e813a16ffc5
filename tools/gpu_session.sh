#!/usr/bin/env bash
# gpu_session.sh check|bench -- the two device calls that re-establish, on the H200, what
# the CUDA issue asks for, each well inside the 10-minute limit of one call.  Run from the
# repository root:
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_session.sh check   (~5 min)
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_session.sh bench   (~6 min; carry .fla)
# check: the kernel lab's check of variants 3 and 2 against the float64 oracle, memcheck and
#        racecheck on small problems, the lab's per-kernel times at the four benchmark
#        shapes, `./gdp test --quick` (every suite, #gpu specs included), and
#        check_reference --device cuda in bf16 and f32.
# bench: bench_gdp at the issue's four shapes with fla in the same run (JSON).
# Logs go to $OUT (at most 8 files come back from a call).
set -u
MODE=${1:?usage: tools/gpu_session.sh check|bench}
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
LOG=$OUT/session.log
t0=$(date +%s)
stamp() { echo "--- [$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
stamp "$MODE on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
B=/tmp/gdp-lab
SHAPES="4 4096 1|4 4096 2|4 4096 3|1 32768 2"

if [ "$MODE" = check ]; then
  stamp "build the lab"
  bash tools/gpu_lab_build.sh $B 2>&1 | tee -a "$LOG"
  [ -x $B/lab ] || { stamp "LAB BUILD FAILED"; exit 1; }
  ( ./gdp build > "$OUT/gdp_build.log" 2>&1; echo "gdp build rc=$?" >> "$LOG" ) &
  stamp "lab check v3 v2"
  timeout 120 $B/lab check v3 v2 > "$OUT/lab_check.log" 2>&1; echo "lab check rc=$?" | tee -a "$LOG"
  grep -E "check:" "$OUT/lab_check.log" | tee -a "$LOG"
  stamp "compute-sanitizer (1 x 300, n = 2 and 3)"
  for n in 2 3; do
    timeout 60 compute-sanitizer --tool memcheck $B/lab bench 1 300 $n v3 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | tee -a "$LOG"
    timeout 90 compute-sanitizer --tool racecheck $B/lab bench 1 300 $n v3 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | tee -a "$LOG"
  done
  stamp "lab per-kernel profile (one synchronised call per kernel)"
  IFS='|'; for s in $SHAPES; do
    IFS=' '; echo "-- $s" >> "$OUT/profile.log"
    GDP_CUDA_PROFILE=1 timeout 40 $B/lab bench $s v3 --reps 3 2>&1 | grep -vE "^device| 0.0000 ms" >> "$OUT/profile.log"
  done; IFS=' '
  wait
  stamp "./gdp test --quick"
  timeout 300 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1; echo "gdp test rc=$?" | tee -a "$LOG"
  grep -E "^  .* (ok|FAILED)$|passed, [0-9]+ failed" "$OUT/gdp_test.log" | tee -a "$LOG"
  stamp "check_reference --device cuda"
  for dt in bf16 f32; do
    timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype $dt > "$OUT/check_cuda_$dt.log" 2>&1
    echo "check_reference $dt rc=$? $(tail -1 "$OUT/check_cuda_$dt.log")" | tee -a "$LOG"
  done
  stamp "done"
  exit 0
fi

if [ "$MODE" = bench ]; then
  stamp "./gdp build"
  ./gdp build > "$OUT/gdp_build.log" 2>&1 || { stamp "BUILD FAILED"; tail -20 "$OUT/gdp_build.log"; exit 1; }
  stamp "bench_gdp with fla (fla's first Triton compile takes minutes)"
  timeout 450 ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 \
    --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 --against-fla --repeat 30 --json \
    > "$OUT/bench_gdp.json" 2> "$OUT/bench_gdp.log"
  echo "bench_gdp rc=$?" | tee -a "$LOG"
  tail -8 "$OUT/bench_gdp.log" | tee -a "$LOG"
  stamp "done"
  exit 0
fi
echo "unknown mode $MODE (check|bench)" >&2
exit 2
