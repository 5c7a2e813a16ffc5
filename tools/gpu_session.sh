#!/usr/bin/env bash
# gpu_session.sh check|lab|bench -- device calls that re-establish, on the H200, what the
# CUDA issue asks for, each well inside the 10-minute limit of one call.  Run from the
# repository root:
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_session.sh check   (~7.5 min)
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_session.sh lab     (~8 min)
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_session.sh bench   (~6 min; carry .fla)
# check: the kernel lab's check of variants 3, 5 (3 saving for backward) and 2 against the
#        float64 oracle, `./gdp test --quick` (every suite, #gpu specs included),
#        check_reference --device cuda in bf16, f32 and bf16 saving for backward,
#        memcheck and racecheck on small problems, the lab's medians and per-kernel
#        times at the four benchmark shapes, and any lab branches under .branches/
#        (tools/gpu_branches.sh).
# lab:   for kernel work between full checks: the lab's check of variants 3 and 5,
#        memcheck/racecheck, `./gdp test --quick`, lab branches under .branches/ (checks
#        first, then timings), the lab's medians and per-kernel times, and bench_gdp (the
#        library, no fla) at the four shapes, plain and saving for backward (JSON).
# bench: bench_gdp at the issue's four shapes, plain and saving for backward, with fla in
#        the same run (JSON).
# Logs go to $OUT (at most 8 files come back from a call).
set -u
MODE=${1:?usage: tools/gpu_session.sh check|lab|bench}
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
LOG=$OUT/session.log
t0=$(date +%s)
stamp() { echo "--- [$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
stamp "$MODE on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
B=/tmp/gdp-lab
SHAPES="4 4096 1|4 4096 2|4 4096 3|1 32768 2"

# The stages run most-important first; `left NEED what` skips a stage that would end past
# BUDGET_S (default 520) seconds, taking NEED seconds (its usual time on the H200, a bit
# over), so the call ends inside the device's 10-minute limit.  (Session 4's first call
# checked only the elapsed time at each stage's start and ran past 600 s in the last one.)
BUDGET_S=${BUDGET_S:-520}
left() {
  local need=$1; shift
  [ $(( $(date +%s) - t0 + need )) -le "$BUDGET_S" ] || { stamp "out of time: skipped $* (needs ~${need}s)"; return 1; }
}
# The lab's medians of 10 (to the log) and one profiled call per shape (profile.log),
# variants 3 and 5 at the four benchmark shapes.
lab_medians_and_profile() {
  local s
  IFS='|'; for s in $SHAPES; do
    IFS=' '; left 45 "medians and profile at $s" || break
    echo "-- $s" >> "$OUT/profile.log"
    timeout 40 $B/lab bench $s v3 v5 --reps 10 2>&1 | grep -E "chunk_v3|v3_saved" | sed "s/^/[$s] /" | tee -a "$LOG"
    GDP_CUDA_PROFILE=1 timeout 40 $B/lab bench $s v3 v5 --reps 2 2>&1 | grep -vE "^device| 0.0000 ms" >> "$OUT/profile.log"
  done; IFS=' '
}

if [ "$MODE" = check ]; then
  # lab branches snapshotted under .branches/ (tools/snapshot_branches.sh) are built on
  # the side and checked and timed at the end (tools/gpu_branches.sh; logs in one tarball)
  nbr=$(ls -d .branches/*/kernels 2>/dev/null | wc -l)
  if [ "$nbr" -gt 0 ]; then
    mkdir -p "$OUT/branches"
    ( SKIP_MAIN=1 BUILD_ONLY=1 OUT=$OUT/branches bash tools/gpu_branches.sh > /dev/null 2>&1 ) &
    brpid=$!
  fi
  stamp "build the lab"
  bash tools/gpu_lab_build.sh $B 2>&1 | tee -a "$LOG"
  [ -x $B/lab ] || { stamp "LAB BUILD FAILED"; exit 1; }
  ( ./gdp build > "$OUT/gdp_build.log" 2>&1; echo "gdp build rc=$?" >> "$LOG" ) &
  gbpid=$!
  stamp "lab check v3 v5 v2 (v5 = v3 saving for backward)"
  timeout 150 $B/lab check v3 v5 v2 > "$OUT/lab_check.log" 2>&1; echo "lab check rc=$?" | tee -a "$LOG"
  grep -E "check:|FAIL" "$OUT/lab_check.log" | tee -a "$LOG"
  wait $gbpid
  if left 90 "./gdp test --quick"; then
    stamp "./gdp test --quick"
    timeout 240 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1; echo "gdp test rc=$?" | tee -a "$LOG"
    grep -E "^  .* (ok|FAILED)$|passed, [0-9]+ failed|save_for_backward.*worst|skipping" "$OUT/gdp_test.log" | tee -a "$LOG"
  fi
  if left 40 "check_reference"; then
    stamp "check_reference --device cuda"
    for run in "bf16" "f32" "bf16 --save-for-backward"; do
      echo "== $run" >> "$OUT/check_cuda.log"
      timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype $run >> "$OUT/check_cuda.log" 2>&1
      echo "check_reference $run rc=$? $(tail -1 "$OUT/check_cuda.log")" | tee -a "$LOG"
    done
  fi
  if left 100 "compute-sanitizer"; then
    stamp "compute-sanitizer (1 x 300, n = 2 and 3, v3 and v5)"
    for n in 2 3; do
      timeout 60 compute-sanitizer --tool memcheck $B/lab bench 1 300 $n v3 v5 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | tee -a "$LOG"
      timeout 90 compute-sanitizer --tool racecheck $B/lab bench 1 300 $n v3 v5 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | tee -a "$LOG"
    done
  fi
  # lab branches before main's medians: new work's checks and timings matter more than a
  # re-timing of main (session 12's call 1 reached them with no budget left)
  if [ "$nbr" -gt 0 ]; then
    wait $brpid
    if left 120 "lab branches"; then
      stamp "lab branches"
      SKIP_MAIN=1 SKIP_BUILD=1 BUDGET_S=$(( BUDGET_S - 60 - ($(date +%s) - t0) )) OUT=$OUT/branches bash tools/gpu_branches.sh 2>&1 | tee -a "$LOG"
    fi
    cp "$OUT/branches/branches.log" "$OUT/branches.log" 2>/dev/null
    tar czf "$OUT/branches.tgz" -C "$OUT" branches && rm -rf "$OUT/branches"
  fi
  if left 60 "profile"; then
    stamp "lab medians and per-kernel profile (one synchronised call per kernel)"
    lab_medians_and_profile
  fi
  stamp "done"
  exit 0
fi

if [ "$MODE" = lab ]; then
  nbr=$(ls -d .branches/*/kernels 2>/dev/null | wc -l)
  mkdir -p "$OUT/branches"
  ( SKIP_MAIN=1 BUILD_ONLY=1 OUT=$OUT/branches bash tools/gpu_branches.sh > /dev/null 2>&1 ) &
  brpid=$!
  ( ./gdp build > "$OUT/gdp_build.log" 2>&1; echo "gdp build rc=$?" >> "$LOG" ) &
  gbpid=$!
  stamp "build the lab"
  bash tools/gpu_lab_build.sh $B 2>&1 | tee -a "$LOG"
  [ -x $B/lab ] || { stamp "LAB BUILD FAILED"; exit 1; }
  stamp "lab check v3 v5"
  timeout 120 $B/lab check v3 v5 > "$OUT/lab_check.log" 2>&1; echo "lab check rc=$?" | tee -a "$LOG"
  grep -E "check:|FAIL" "$OUT/lab_check.log" | tee -a "$LOG"
  stamp "compute-sanitizer (1 x 300, n = 2, v3 and v5)"
  timeout 60 compute-sanitizer --tool memcheck $B/lab bench 1 300 2 v3 v5 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | tee -a "$LOG"
  timeout 90 compute-sanitizer --tool racecheck $B/lab bench 1 300 2 v3 v5 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | tee -a "$LOG"
  wait $gbpid
  if left 90 "./gdp test --quick"; then
    stamp "./gdp test --quick"
    timeout 200 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1; echo "gdp test rc=$?" | tee -a "$LOG"
    grep -E "^  .* (ok|FAILED)$|passed, [0-9]+ failed|FAILED  \]|save_for_backward.*worst|skipping" "$OUT/gdp_test.log" | tee -a "$LOG"
  fi
  wait $brpid
  if [ "$nbr" -gt 0 ] && left 60 "lab branches"; then
    stamp "lab branches (checks, then timings)"
    SKIP_MAIN=1 SKIP_BUILD=1 BUDGET_S=$(( BUDGET_S - 240 - ($(date +%s) - t0) )) OUT=$OUT/branches bash tools/gpu_branches.sh 2>&1 | tee -a "$LOG"
  fi
  if left 60 "lab medians and profile"; then
    stamp "lab medians (10) and per-kernel profile"
    lab_medians_and_profile
    echo "-- 4 4096 2 without U's residual (GDP_CUDA_V3_ULO=0)" >> "$OUT/profile.log"
    GDP_CUDA_V3_ULO=0 GDP_CUDA_PROFILE=1 timeout 40 $B/lab bench 4 4096 2 v3 v5 --reps 2 2>&1 | grep -vE "^device| 0.0000 ms" >> "$OUT/profile.log"
  fi
  if left 90 "bench_gdp"; then
    stamp "bench_gdp (library, no fla), plain and saving"
    timeout 120 ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 \
      --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 --repeat 20 --json --no-save --with-saving \
      > "$OUT/bench_gdp.json" 2>> "$OUT/bench_gdp.log"
    echo "bench_gdp rc=$?" | tee -a "$LOG"
  fi
  tail -12 "$OUT/bench_gdp.log" 2>/dev/null >> "$LOG"
  cp "$OUT/branches/branches.log" "$OUT/branches.log" 2>/dev/null
  tar czf "$OUT/more.tgz" -C "$OUT" branches profile.log gdp_build.log bench_gdp.log 2>/dev/null &&
    rm -rf "$OUT/branches" "$OUT/gdp_build.log" "$OUT/bench_gdp.log"
  stamp "done"
  exit 0
fi

if [ "$MODE" = bench ]; then
  stamp "./gdp build"
  ./gdp build > "$OUT/gdp_build.log" 2>&1 || { stamp "BUILD FAILED"; tail -20 "$OUT/gdp_build.log"; exit 1; }
  stamp "bench_gdp with fla (fla's first Triton compile takes minutes)"
  timeout 450 ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 \
    --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 --against-fla --with-saving --repeat 30 --json \
    > "$OUT/bench_gdp.json" 2> "$OUT/bench_gdp.log"
  echo "bench_gdp rc=$?" | tee -a "$LOG"
  tail -8 "$OUT/bench_gdp.log" | tee -a "$LOG"
  stamp "done"
  exit 0
fi
echo "unknown mode $MODE (check|bench)" >&2
exit 2
