#!/usr/bin/env bash
# Session 7, call 3: lab/e3 merged -- grad_state as dstate's programmatic dependent on
# per-(chunk, head) ready counters, beside a 2-stage dstate (GDP_CUDA_V3_OVERLAP; default
# on where the pair fits) -- plus the sequential passes' max-shared carveout
# (GDP_CUDA_V3_SEQ_CARVEOUT).  Correctness first: lab check with OVERLAP unset / =0 / =1
# (error lines identical), racecheck / memcheck with it on; then the library (gdp test,
# check_reference plain and saving) and its A/Bs; then the per-kernel split.
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session7/call3.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/call3.log"; }
left() { [ $(( $(date +%s) - t0 )) -lt "${BUDGET_S:-500}" ] || { log "out of time: skipped $*"; return 1; }; }
( ./gdp build > "$OUT/gdp_build.log" 2>&1; echo "rc=$?" >> "$OUT/gdp_build.log" ) &
bash tools/gpu_lab_build.sh /tmp/lab-main > "$OUT/lab_build.log" 2>&1
wait
log "builds done: $(tail -1 "$OUT/gdp_build.log")"
L=/tmp/lab-main/lab
for ov in default 0 1; do
  case $ov in default) E="" ;; *) E="GDP_CUDA_V3_OVERLAP=$ov" ;; esac
  env $E timeout 120 $L check v3 v5 > "$OUT/lab_check_ovl_$ov.log" 2>&1
  log "lab check OVERLAP=$ov rc=$? $(grep -E 'check:' "$OUT/lab_check_ovl_$ov.log" | tail -1)"
done
for ov in 0 1; do
  if diff <(grep -E "^(chunk|v3|v5)" "$OUT/lab_check_ovl_default.log") <(grep -E "^(chunk|v3|v5)" "$OUT/lab_check_ovl_$ov.log") > /dev/null; then
    log "OVERLAP=$ov error lines identical to the default's"; else log "OVERLAP=$ov error lines DIFFER"; fi
done
for n in 2 1; do
  GDP_CUDA_V3_OVERLAP=1 timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 $n v3 v5 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | sed "s/^/[OVERLAP=1 racecheck n=$n] /" | tee -a "$OUT/call3.log"
done
GDP_CUDA_V3_OVERLAP=1 timeout 60 compute-sanitizer --tool memcheck $L bench 2 300 2 v3 v5 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[OVERLAP=1 memcheck] /" | tee -a "$OUT/call3.log"
log "sanitizers done"
timeout 200 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1
log "gdp test --quick rc=$? $(tail -1 "$OUT/gdp_test.log")"
for m in bf16 "bf16 --save-for-backward"; do
  for ov in default 0; do
    left "check_reference" || break
    case $ov in default) E="" ;; *) E="GDP_CUDA_V3_OVERLAP=$ov" ;; esac
    env $E timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype $m > "$OUT/cr.tmp" 2>&1
    log "check_reference $m OVERLAP=$ov rc=$? $(tail -1 "$OUT/cr.tmp")"
    { echo "== $m OVERLAP=$ov"; cat "$OUT/cr.tmp"; } >> "$OUT/check_reference.log"; rm -f "$OUT/cr.tmp"
  done
done
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --repeat 20 --no-save"
for run in ovl ovl0 ovl ovl0 ovl ovl0; do
  left "library $run" || break
  case $run in ovl) E="" ;; ovl0) E="GDP_CUDA_V3_OVERLAP=0" ;; esac
  env $E timeout 60 $B --with-saving --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 2>&1 | grep -E "^  [0-9]" | sed "s/^/[$run] /" >> "$OUT/library_overlap_ab.log"
done
# the forks at 1 x 32768 (n = 2 now beside a 2-stage dstate) against none, and the
# sequential passes' carveout left to the driver
for run in def fork0 cv0 def fork0 cv0 def cv0; do
  left "fork/carveout $run" || break
  case $run in def) E="" ;; fork0) E="GDP_CUDA_V3_FORK=0" ;; cv0) E="GDP_CUDA_V3_SEQ_CARVEOUT=0" ;; esac
  env $E timeout 60 $B --shapes 1x32768x1,1x32768x2,1x32768x3 2>&1 | grep -E "^  [0-9]" | sed "s/^/[$run] /" >> "$OUT/library_fork_carveout_ab.log"
done
log "library A/B done"
if left "json"; then
  timeout 60 $B --with-saving --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 --json > "$OUT/bench_gdp.json" 2> "$OUT/bench_gdp.log"
fi
if left "profile"; then
  for s in "4 4096 2" "4 4096 1" "4 4096 3" "1 32768 2"; do
    GDP_CUDA_PROFILE=1 timeout 40 $L bench $s v3 v5 --reps 2 2>&1 | grep -vE "^device| 0.0000 ms" | sed "s/^/[$s] /" >> "$OUT/profile.txt"
  done
fi
log "done"
