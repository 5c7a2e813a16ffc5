#!/usr/bin/env bash
# Session 11, call 5 (the session's last ~250 device seconds): lab/wynorm against main (with
# lab/slots merged), one lab build each in parallel.  lab/wynorm: grad_wy's kn l2 norms the
# forward prep's way (16 lanes a row, 16-byte accesses, four shuffles) instead of a warp per
# row (2-byte accesses, five shuffles, eight rows in turn): the norms and the gate cumsum
# held ~16% of grad_wy's warp stall samples in call 2's profile.  Check first, then the
# per-kernel profiles and the A/B medians, then the sanitizers, as long as time is left.
# Device (carry [".devbundle", ".branches"]; .branches/s11-main = main at the branch point,
# made by tools/snapshot_branches.sh s11-main):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session11/call5.sh
CALL=call5
BUDGET_S=${BUDGET_S:-190}
source tools/device_call.sh
( cd .branches/s11-main && bash tools/gpu_lab_build.sh /tmp/lab-base > "$OUT/build_base.log" 2>&1 ) &
bash tools/gpu_lab_build.sh /tmp/lab-norm > "$OUT/build_norm.log" 2>&1
wait
LB=/tmp/lab-base/lab LN=/tmp/lab-norm/lab
log "builds: base $([ -x $LB ] && echo ok || echo FAILED), norm $([ -x $LN ] && echo ok || echo FAILED)"
[ -x $LN ] || { tail -20 "$OUT/build_norm.log"; exit 1; }
timeout 40 $LN check v3 v5 > "$OUT/check_norm.log" 2>&1
log "norm: lab check rc=$? $(grep -E 'check:' "$OUT/check_norm.log" | tail -1)"
grep -E "FAIL" "$OUT/check_norm.log" | head -5 | tee -a "$OUT/$CALL.log"
for t in base norm; do
  left "profile $t" || break
  GDP_CUDA_PROFILE=1 timeout 20 /tmp/lab-$t/lab bench 4 4096 2 v3 v5 --reps 2 2>&1 | grep -E "chunk gradients|v3_saved_s16 fwd|chunk_v3_s16 fwd" | sed "s/^/[profile $t] /" | tee -a "$OUT/$CALL.log"
done
for r in 1 2; do
  for t in base norm; do
    left "A/B $t r$r" || break 2
    timeout 20 /tmp/lab-$t/lab bench 4 4096 2 v3 v5 --reps 10 2>&1 | grep -E "chunk_v3|v3_saved" | grep -v " vs " | sed "s/^/[$t r$r] /" | tee -a "$OUT/$CALL.log"
  done
done
if left "memcheck"; then
  timeout 40 compute-sanitizer --tool memcheck $LN bench 1 300 2 v3 v5 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[memcheck n=2] /" | tee -a "$OUT/$CALL.log"
fi
if left "racecheck"; then
  timeout 40 compute-sanitizer --tool racecheck $LN bench 1 300 2 v3 v5 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | sed "s/^/[racecheck n=2] /" | tee -a "$OUT/$CALL.log"
fi
log "done"
