#!/usr/bin/env bash
# Session 7, call 1: main as committed (lab/passes7 merged in session 6, lab/occ's host-only
# tool) on the H200 -- what session 6 left unrun: the lab check of the merged tree (with
# FORK=1 same bits, memcheck), the #gpu specs new in 45b3c40 (FORK / PASSES A/B), the
# library's default fork rule against FORK=0 / FORK=1 at the shapes it decides, and the
# per-kernel split at 4 x 4096 n = 2 (plain and saving).  Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session7/call1.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/call1.log"; }
# both builds at once (CPU only)
( ./gdp build > "$OUT/gdp_build.log" 2>&1; echo "rc=$?" >> "$OUT/gdp_build.log" ) &
bash tools/gpu_lab_build.sh /tmp/lab-main > "$OUT/lab_build.log" 2>&1
wait
log "builds done: $(tail -1 "$OUT/gdp_build.log")"
L=/tmp/lab-main/lab
timeout 120 $L check v3 v5 > "$OUT/lab_check.log" 2>&1
log "lab check rc=$? $(grep -E 'check:' "$OUT/lab_check.log" | tail -1)"
GDP_CUDA_V3_FORK=1 timeout 120 $L check v3 v5 > "$OUT/lab_check_fork1.log" 2>&1
log "lab check FORK=1 rc=$? $(grep -E 'check:' "$OUT/lab_check_fork1.log" | tail -1)"
if diff <(grep -E "^(chunk|v3|v5)" "$OUT/lab_check.log") <(grep -E "^(chunk|v3|v5)" "$OUT/lab_check_fork1.log") > /dev/null; then
  log "FORK=1 error lines identical to the default's"; else log "FORK=1 error lines DIFFER"; fi
for s in "4 4096 2" "4 4096 1" "1 32768 2"; do
  GDP_CUDA_PROFILE=1 timeout 40 $L bench $s v3 v5 --reps 2 2>&1 | grep -vE "^device| 0.0000 ms" | sed "s/^/[$s] /" >> "$OUT/profile.log"
done
log "profile done"
timeout 200 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1
log "gdp test --quick rc=$? $(tail -1 "$OUT/gdp_test.log")"
grep -E "FORK|PASSES|skip|#gpu" "$OUT/gdp_test.log" | head -20 >> "$OUT/call1.log"
timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype bf16 > "$OUT/check_reference_bf16.log" 2>&1
log "check_reference bf16 rc=$? $(tail -1 "$OUT/check_reference_bf16.log")"
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --repeat 20 --no-save"
for run in default fork0 fork1 default fork0 fork1; do
  [ $(( $(date +%s) - t0 )) -lt 540 ] || { log "out of time at $run"; break; }
  case $run in default) E="" ;; fork0) E="GDP_CUDA_V3_FORK=0" ;; fork1) E="GDP_CUDA_V3_FORK=1" ;; esac
  env $E timeout 60 $B --shapes 1x32768x1,1x32768x2,1x32768x3,2x8192x1,4x4096x2 2>&1 | grep -E "^  [0-9]" | sed "s/^/[$run] /" >> "$OUT/fork_rule.log"
done
log "done"
