#!/usr/bin/env bash
# Session 10, call 1 (on branch lab/bwdtu plus the wgmma probe): first, the wgmma probe
# (kernels/bench/wgmma_probe.cu: the SW128 panel layout and the descriptors of
# kernels/cuda/wgmma_sm90.cuh against a CPU product, one planted mistake that must fail);
# then tools/gpu_bwd_tu.sh (the recompute backward's states pass forming U = Tu V: build,
# lab check in both U modes, the U specs, check_reference bf16, memcheck / racecheck,
# the A/B on the device timer, a profiled call each way, its profiles merged into one file
# because the device returns at most 8).
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session10/call1.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
F="-O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icore/include -Icore/src -Ikernels -Ikernels/cuda"
{ nvcc $F kernels/bench/wgmma_probe.cu -o /tmp/wgmma_probe && timeout 30 /tmp/wgmma_probe; echo "probe rc=$?"; } > "$OUT/probe.log" 2>&1
cat "$OUT/probe.log"
BUDGET_S=530 bash tools/gpu_bwd_tu.sh
{ for m in tv panel; do echo "== U=$m"; cat "$OUT/profile_$m.log"; done; } > "$OUT/profiles.log" 2>/dev/null
rm -f "$OUT/profile_tv.log" "$OUT/profile_panel.log"
ls "$OUT"
