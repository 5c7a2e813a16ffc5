#!/usr/bin/env bash
# Session 11, call 3: lab/slots against main, one lab build each (in parallel).  lab/slots:
# grad_state and grad_wy sum their cross-warp float terms (dgc, dbeta, z, the l2-norm dots)
# in partial-sum slots with one writer each, not in shared-memory float atomics (which are
# compare-and-swap loops on sm_90: ~10% / ~5% of the kernels' warp stall samples in call 2's
# ncu profile), and grad_wy deals its W4 / W5 tiles so that the two warps with two tiles
# get cheap ones (the barrier after W5: ~8% of the samples).  Correctness first (lab check
# v3 v5 against the float64 oracle; the old grad_wy schedule compared with the new), then
# the A/B medians, then compute-sanitizer, then the per-kernel profiles.
# Device (carry [".devbundle", ".branches"]; .branches/s11-base = main at the branch point,
# made by tools/snapshot_branches.sh s11-base):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session11/call3.sh
CALL=call3
BUDGET_S=${BUDGET_S:-520}
source tools/device_call.sh
( cd .branches/s11-base && bash tools/gpu_lab_build.sh /tmp/lab-base > "$OUT/build_base.log" 2>&1 ) &
bash tools/gpu_lab_build.sh /tmp/lab-slots > "$OUT/build_slots.log" 2>&1
wait
LB=/tmp/lab-base/lab LS=/tmp/lab-slots/lab
log "builds: base $([ -x $LB ] && echo ok || echo FAILED), slots $([ -x $LS ] && echo ok || echo FAILED)"
[ -x $LS ] || { tail -20 "$OUT/build_slots.log"; exit 1; }
timeout 150 $LS check v3 v5 > "$OUT/check_slots.log" 2>&1
log "slots: lab check rc=$? $(grep -E 'check:' "$OUT/check_slots.log" | tail -1)"
grep -E "FAIL" "$OUT/check_slots.log" | head -5 | tee -a "$OUT/$CALL.log"
# A/B medians of 10, alternating, at the issue's shape
for r in 1 2; do
  for t in base slots; do
    left "A/B $t r$r" || break 2
    L=/tmp/lab-$t/lab
    timeout 40 $L bench 4 4096 2 v3 v5 --reps 10 2>&1 | grep -E "chunk_v3|v3_saved" | grep -v " vs " | sed "s/^/[$t r$r] /" | tee -a "$OUT/$CALL.log"
  done
done
if left "sanitizers"; then
  for n in 2 3; do
    timeout 60 compute-sanitizer --tool memcheck $LS bench 1 300 $n v3 v5 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[memcheck n=$n] /" | tee -a "$OUT/$CALL.log"
    timeout 90 compute-sanitizer --tool racecheck $LS bench 1 300 $n v3 v5 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | sed "s/^/[racecheck n=$n] /" | tee -a "$OUT/$CALL.log"
  done
fi
# the old grad_wy schedule against the new, same inputs (dk, dv bytes equal; dbeta, dg within a bf16 step)
if left "WY=compare"; then
  GDP_CUDA_V3_WY=compare timeout 100 $LS check v3 v5 > "$OUT/check_slots_wycompare.log" 2>&1
  log "slots WY=compare: lab check rc=$? $(grep -E 'check:' "$OUT/check_slots_wycompare.log" | tail -1)"
fi
for t in base slots; do
  left "profile $t" || break
  echo "== $t" >> "$OUT/profile.log"
  GDP_CUDA_PROFILE=1 timeout 30 /tmp/lab-$t/lab bench 4 4096 2 v3 v5 --reps 2 2>&1 | grep -vE "^device| 0.0000 ms" >> "$OUT/profile.log"
done
for s in "4 4096 1" "4 4096 3" "1 32768 2"; do
  for t in base slots; do
    left "medians $t $s" || break 2
    timeout 40 /tmp/lab-$t/lab bench $s v3 v5 --reps 10 2>&1 | grep -E "chunk_v3|v3_saved" | grep -v " vs " | sed "s/^/[$t $s] /" | tee -a "$OUT/$CALL.log"
  done
done
grep -B2 -E "[1-9][0-9]* bytes spill" /tmp/lab-slots/ptxas.log | grep -oE "_Z[A-Za-z0-9_]+|[0-9]+ bytes spill stores" | paste - - > "$OUT/spills_slots.txt"
log "done"
