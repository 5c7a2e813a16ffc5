#!/usr/bin/env bash
# Session 7, call 2: programmatic dependent launches between the v3 kernels
# (GDP_CUDA_PDL, default on) and the sequential passes at the largest shared-memory
# carveout (GDP_CUDA_V3_SEQ_CARVEOUT, default on) -- correctness first (lab check with
# and without PDL: the same error lines; racecheck, memcheck), then A/Bs in the lab and
# the library, then the per-kernel split at 4 x 4096 (profiled: PDL off there).
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session7/call2.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/call2.log"; }
left() { [ $(( $(date +%s) - t0 )) -lt "${BUDGET_S:-540}" ] || { log "out of time: skipped $*"; return 1; }; }
( ./gdp build > "$OUT/gdp_build.log" 2>&1; echo "rc=$?" >> "$OUT/gdp_build.log" ) &
bash tools/gpu_lab_build.sh /tmp/lab-main > "$OUT/lab_build.log" 2>&1
wait
log "builds done: $(tail -1 "$OUT/gdp_build.log")"
L=/tmp/lab-main/lab
for pdl in 1 0; do
  GDP_CUDA_PDL=$pdl timeout 120 $L check v3 v5 > "$OUT/lab_check_pdl$pdl.log" 2>&1
  log "lab check PDL=$pdl rc=$? $(grep -E 'check:' "$OUT/lab_check_pdl$pdl.log" | tail -1)"
done
if diff <(grep -E "^(chunk|v3|v5)" "$OUT/lab_check_pdl1.log") <(grep -E "^(chunk|v3|v5)" "$OUT/lab_check_pdl0.log") > /dev/null; then
  log "PDL=0 error lines identical to PDL=1's"; else log "PDL=0 error lines DIFFER"; fi
for n in 1 2; do
  timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 $n v3 v5 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | sed "s/^/[racecheck n=$n] /" | tee -a "$OUT/call2.log"
done
timeout 60 compute-sanitizer --tool memcheck $L bench 2 300 2 v3 v5 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[memcheck] /" | tee -a "$OUT/call2.log"
GDP_CUDA_V3_FORK=1 timeout 60 compute-sanitizer --tool memcheck $L bench 1 300 2 v3 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[memcheck FORK=1] /" | tee -a "$OUT/call2.log"
log "sanitizers done"
for rep in 1 2; do
  for pdl in 1 0; do
    left "lab bench" || break
    for s in "4 4096 2" "4 4096 1" "4 4096 3" "1 32768 2"; do
      GDP_CUDA_PDL=$pdl timeout 40 $L bench $s v3 v5 --reps 10 2>&1 | grep -E "chunk_v3|v3_save|saved" | sed "s/^/[PDL=$pdl $s] /" >> "$OUT/lab_pdl_ab.log"
    done
  done
done
log "lab A/B done"
left "gdp test" && { timeout 200 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1; log "gdp test --quick rc=$? $(tail -1 "$OUT/gdp_test.log")"; }
for m in bf16 "bf16 --save-for-backward"; do
  left "check_reference" || break
  timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype $m > "$OUT/check_reference.log.tmp" 2>&1
  log "check_reference $m rc=$? $(tail -1 "$OUT/check_reference.log.tmp")"
  { echo "== $m"; cat "$OUT/check_reference.log.tmp"; } >> "$OUT/check_reference.log"; rm -f "$OUT/check_reference.log.tmp"
done
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --repeat 20 --no-save"
for run in pdl1 pdl0 pdl1 pdl0; do
  left "library PDL $run" || break
  case $run in pdl1) E="GDP_CUDA_PDL=1" ;; pdl0) E="GDP_CUDA_PDL=0" ;; esac
  env $E timeout 60 $B --with-saving --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 2>&1 | grep -E "^  [0-9]" | sed "s/^/[$run] /" >> "$OUT/library_pdl_ab.log"
done
for run in cv1 cv0 cv1 cv0 cv1 cv0; do
  left "carveout $run" || break
  case $run in cv1) E="GDP_CUDA_V3_SEQ_CARVEOUT=1" ;; cv0) E="GDP_CUDA_V3_SEQ_CARVEOUT=0" ;; esac
  env $E timeout 60 $B --shapes 1x32768x3,1x32768x1 2>&1 | grep -E "^  [0-9]" | sed "s/^/[$run] /" >> "$OUT/library_carveout_ab.log"
done
log "library A/B done"
if left "profile"; then
  for s in "4 4096 2" "4 4096 1" "4 4096 3" "1 32768 2"; do
    GDP_CUDA_PROFILE=1 timeout 40 $L bench $s v3 v5 --reps 2 2>&1 | grep -vE "^device| 0.0000 ms" | sed "s/^/[$s] /" >> "$OUT/profile.txt"
  done
fi
log "done"
