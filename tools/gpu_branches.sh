#!/usr/bin/env bash
# gpu_branches.sh -- on the GPU machine, validates and times the kernel lab of every tree
# snapshot under .branches/ (tools/snapshot_branches.sh) next to the working tree's own:
# one lab build each (in parallel), `lab check v3` against the float64 oracle, racecheck on
# a small problem, then medians of 10 at the four benchmark shapes and the per-kernel
# profile at 4 x 4096, n = 2.  Run from the repository root:
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_branches.sh      (carry .branches)
set -u
OUT=${OUT:?set OUT}
root=$PWD
trees=("$root")
for d in "$root"/.branches/*/; do [ -d "$d/kernels" ] && trees+=("${d%/}"); done
name() { [ "$1" = "$root" ] && echo main || basename "$1"; }
for t in "${trees[@]}"; do
  ( cd "$t" && bash "$root/tools/gpu_lab_build.sh" "/tmp/lab-$(name "$t")" > "$OUT/build_$(name "$t").log" 2>&1 ) &
done
wait
for t in "${trees[@]}"; do
  n=$(name "$t"); L=/tmp/lab-$n/lab
  echo "===== $n $(cat "$t/COMMIT" 2>/dev/null | cut -c1-10)" | tee -a "$OUT/branches.log"
  [ -x "$L" ] || { echo "BUILD FAILED" | tee -a "$OUT/branches.log"; continue; }
  timeout 90 $L check v3 > "$OUT/check_$n.log" 2>&1
  echo "check rc=$? $(grep -E 'check:' "$OUT/check_$n.log")" | tee -a "$OUT/branches.log"
  timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 2 v3 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | tee -a "$OUT/branches.log"
  for s in "4 4096 1" "4 4096 2" "4 4096 3" "1 32768 2"; do
    timeout 30 $L bench $s v3 --reps 10 2>&1 | grep -E "chunk_v3" | sed "s/^/[$s] /" | tee -a "$OUT/branches.log"
  done
  GDP_CUDA_PROFILE=1 timeout 30 $L bench 4 4096 2 v3 --reps 2 2>&1 | grep -E "^    " | grep -v " 0.0000 ms" | tee -a "$OUT/branches.log"
done
