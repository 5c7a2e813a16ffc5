#!/usr/bin/env bash
# Session 8, call 1: main as session 7 left it (its last refactors and the #gpu FORK=2
# spec were never run on a GPU): gdp test --quick, lab check v3 v5, check_reference bf16;
# then Nsight Compute on the saving path's five kernels at 4 x 4096 n = 2 (where the
# 2.2 ms go: stall reasons, DRAM / SM throughput, occupancy) and a library baseline.
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session8/call1.sh
CALL=call1
source tools/device_call.sh
build_gdp_and_lab
timeout 120 $L check v3 v5 > "$OUT/lab_check.log" 2>&1
log "lab check rc=$? $(grep -E 'check:' "$OUT/lab_check.log" | tail -1)"
timeout 200 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1
log "gdp test --quick rc=$? $(tail -1 "$OUT/gdp_test.log")"
for m in bf16 "bf16 --save-for-backward"; do
  left "check_reference $m" || break
  timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype $m > "$OUT/cr.tmp" 2>&1
  log "check_reference $m rc=$? $(tail -1 "$OUT/cr.tmp")"
  { echo "== $m"; cat "$OUT/cr.tmp"; } >> "$OUT/check_reference.log"; rm -f "$OUT/cr.tmp"
done
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --repeat 20 --no-save"
for r in 1 2; do
  left "library" || break
  timeout 60 $B --with-saving --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 2>&1 | grep -E "^  [0-9]" | sed "s/^/[run $r] /" | tee -a "$OUT/call1.log"
done
if left "ncu"; then
  S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
  timeout 240 ncu --clock-control none -k regex:_v3 -c 5 $S $L bench 4 4096 2 v5 --reps 1 > "$OUT/ncu_v5.txt" 2>&1
  log "ncu rc=$?"
  grep -E "^  [a-zA-Z_:<>0-9, ]+v3|Duration|Achieved Occupancy|Registers Per|Dynamic Shared|Compute \(SM\) Throughput|DRAM Throughput|Memory Throughput|L2 Hit|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|Stall" "$OUT/ncu_v5.txt" | sed -E 's/ +/ /g' | head -120
  timeout 120 ncu --clock-control none -k regex:_v3 -c 5 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" $L bench 4 4096 2 v5 --reps 1 > "$OUT/ncu_stalls.txt" 2>&1
  log "ncu stalls rc=$?"
  grep -E "v3|stalled" "$OUT/ncu_stalls.txt" | awk '$NF+0 > 0.3 || /v3/' | sed -E 's/ +/ /g' | head -120
fi
log "done"
