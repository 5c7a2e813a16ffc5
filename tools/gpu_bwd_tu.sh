#!/usr/bin/env bash
# gpu_bwd_tu.sh -- the first device run of branch lab/bwdtu: the recompute backward's
# states pass forms U = Tu V too (bwd_states_kernel_v3's TU, where its value block is at
# least C wide: 4 x 4096 n = 1, 2).  Build, correctness (lab check v3 v5 with the defaults
# and with GDP_CUDA_V3_U=panel, the GDP_CUDA_V3_U specs, check_reference bf16),
# compute-sanitizer on the lab's 1 x 300 plain passes, then the A/B on the device timer
# and one profiled call each way.  About 7 minutes on a fresh machine.
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_bwd_tu.sh
CALL=bwd_tu
BUDGET_S=${BUDGET_S:-560}
source tools/device_call.sh
build_gdp_and_lab
export GDP_LIB=$PWD/build/libgdp.so
for m in tv panel; do
  GDP_CUDA_V3_U=$m timeout 100 $L check v3 v5 > "$OUT/lab.tmp" 2>&1
  log "lab check v3 v5 (U=$m) rc=$? $(tail -1 "$OUT/lab.tmp")"
  { echo "== U=$m"; cat "$OUT/lab.tmp"; } >> "$OUT/lab_check.log"; rm -f "$OUT/lab.tmp"
done
timeout 120 busted --filter "GDP_CUDA_V3_U" spec/cuda_spec.lua > "$OUT/spec.log" 2>&1
log "busted GDP_CUDA_V3_U specs rc=$? $(tail -1 "$OUT/spec.log")"
grep -E "saved vs recompute" "$OUT/spec.log" | tee -a "$OUT/$CALL.log"
timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype bf16 > "$OUT/check_reference.log" 2>&1
log "check_reference bf16 rc=$? $(tail -1 "$OUT/check_reference.log")"
for tool in memcheck racecheck; do
  for n in 1 2; do
    left "$tool n=$n" || break 2
    timeout 60 compute-sanitizer --tool $tool $L bench 1 300 $n v3 --reps 1 > "$OUT/san.tmp" 2>&1
    log "$tool (lab bench 1 300 $n v3) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san.tmp" | tail -1)"
    cat "$OUT/san.tmp" >> "$OUT/sanitizer.log"; rm -f "$OUT/san.tmp"
  done
done
# two shapes: with one, bench_gdp prints a report instead of the table filtered for here
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --no-save --no-ceilings --with-saving --repeat 20"
for r in 1 2 3; do
  for m in tv panel; do
    left "A/B U=$m r$r" || break 2
    GDP_CUDA_V3_U=$m timeout 60 $B --shapes 4x4096x2,4x4096x1 2>&1 | grep -E "^(# BxTxn|  [0-9]+x)" \
      | sed "s/^/[U=$m r$r] /" | tee -a "$OUT/ab.log"
  done
done
for m in tv panel; do
  left "profile U=$m" || break
  GDP_CUDA_V3_U=$m GDP_CUDA_PROFILE=1 timeout 60 $L bench 4 4096 2 v3 --reps 2 > "$OUT/profile_$m.log" 2>&1
  log "profile U=$m rc=$?"
done
grep -q "rc=0" "$OUT/gdp_build.log" && [ -x "$L" ] && rm -f "$OUT/gdp_build.log" "$OUT/lab_build.log"
log "done"
