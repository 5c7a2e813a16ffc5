#!/usr/bin/env bash
# Session 9, call 2: branch lab/savetu -- the saving forward forms U = Tu V in its state
# pass (GDP_CUDA_V3_SAVE_U, default tv; =ulo the old U + residual round trip), on top of
# lab/slices (GDP_CUDA_V3_GRAD_SLICES, call 1 lost its n = 2 rows).  In order of need:
# lab check v3 v5 (tv), the SAVE_U specs (both modes against the float64 recurrence),
# the A/B on the device timer, per-kernel profiles, memcheck / racecheck on the lab's
# bench 1 x 300 (n = 2, 3) with tv, check_reference bf16 saving, lab check with ulo, slices at n = 2.
# (The switch was renamed after this call: GDP_CUDA_V3_SAVE_U=tv|ulo is now GDP_CUDA_V3_U=tv|panel,
# and tv also covers the plain forward; re-running this script on main, read it so.)
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session9/call2.sh
CALL=call2
BUDGET_S=${BUDGET_S:-570}
source tools/device_call.sh
build_gdp_and_lab
export GDP_LIB=$PWD/build/libgdp.so
timeout 100 $L check v3 v5 > "$OUT/lab_check_tv.log" 2>&1
log "lab check v3 v5 (SAVE_U=tv) rc=$? $(tail -1 "$OUT/lab_check_tv.log")"
left "specs" && { timeout 120 busted --filter "SAVE_U" spec/cuda_spec.lua > "$OUT/spec.log" 2>&1
  log "busted SAVE_U specs rc=$? $(tail -1 "$OUT/spec.log")"; grep -E "saved vs recompute" "$OUT/spec.log" | tee -a "$OUT/$CALL.log"; }
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --no-save --no-ceilings --with-saving"
for r in 1 2; do
  for m in tv ulo; do
    left "A/B $m r$r" || break 2
    GDP_CUDA_V3_SAVE_U=$m timeout 60 $B --repeat 20 --shapes 4x4096x2,4x4096x1 2>&1 \
      | grep -E "^(# BxTxn|  [0-9]+x)" | sed "s/^/[SAVE_U=$m r$r] /" | tee -a "$OUT/save_u_ab.log"
  done
done
for m in tv ulo; do
  left "profile $m" || break
  GDP_CUDA_V3_SAVE_U=$m GDP_CUDA_PROFILE=1 timeout 60 $L bench 4 4096 2 v5 --reps 2 > "$OUT/profile_$m.log" 2>&1
  log "profile $m rc=$?"
done
for tool in memcheck racecheck; do
  for n in 2 3; do
    left "$tool n=$n" || break 2
    timeout 60 compute-sanitizer --tool $tool $L bench 1 300 $n v5 --reps 1 > "$OUT/san.tmp" 2>&1
    log "$tool (lab bench 1 300 $n v5, SAVE_U=tv) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san.tmp" | tail -1)"
    cat "$OUT/san.tmp" >> "$OUT/sanitizer.log"; rm -f "$OUT/san.tmp"
  done
done
left "check_reference" && { timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype bf16 --save-for-backward > "$OUT/check_reference.log" 2>&1
  log "check_reference bf16 saving (tv) rc=$? $(tail -1 "$OUT/check_reference.log")"; }
left "lab check ulo" && { GDP_CUDA_V3_SAVE_U=ulo timeout 100 $L check v5 > "$OUT/lab_check_ulo.log" 2>&1
  log "lab check v5 (SAVE_U=ulo) rc=$? $(tail -1 "$OUT/lab_check_ulo.log")"; }
for s in 1 8; do
  left "slices $s" || break
  GDP_CUDA_V3_GRAD_SLICES=$s timeout 60 $B --repeat 20 --shapes 4x4096x2,4x4096x1 2>&1 \
    | grep -E "^  [0-9]+x" | sed "s/^/[SLICES=$s] /" | tee -a "$OUT/$CALL.log"
done
log "done"
