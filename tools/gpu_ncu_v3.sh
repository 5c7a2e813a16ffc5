#!/usr/bin/env bash
# Nsight Compute on the nine v3 kernels of one forward + backward at 4 x 4096, n = 2
# (bf16, H = 16, K = V = 128) and the forward prep at n = 1, 3.  About 2 minutes.
#   source .devbundle/env.sh && OUT=<dir> bash tools/gpu_ncu_v3.sh
set -u
OUT=${OUT:?set OUT}
B=/tmp/lncu
bash tools/gpu_lab_build.sh $B || exit 1
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
timeout 200 ncu --clock-control none -k regex:_v3 -c 9 $S $B/lab bench 4 4096 2 v3 --reps 1 > $OUT/ncu_v3.txt 2>&1
echo "ncu rc=$?"
grep -E "^  [a-z_]+.*v3|Duration|Achieved Occupancy|Registers Per|Dynamic Shared|Block Limit (Reg|Shared)|Compute \(SM\) Throughput|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A" $OUT/ncu_v3.txt | sed -E 's/ +/ /g' | head -150
