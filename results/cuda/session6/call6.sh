#!/usr/bin/env bash
# Session 6's last device call, kept as the command behind 5_passes7/: lab/passes7 (main +
# lab/passes6's two-warp saving state pass + the forked recompute state passes,
# GDP_CUDA_V3_FORK=1) validated in the kernel lab and, built as the library from the same
# tree, timed against main's paths in the same call.  Locally:
#   bash tools/snapshot_branches.sh lab/passes7
# device (carry [".devbundle", ".branches"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session6/call6.sh
set -u
OUT=${OUT:?set OUT}
t0=$(date +%s)
snap=.branches/lab-passes7
[ -d "$snap/kernels" ] || { echo "no $snap (tools/snapshot_branches.sh lab/passes7)"; exit 1; }
# the library of the branch: this tree with the snapshot's kernels/ and core/ over it
lib=/tmp/gdp-passes7
rm -rf "$lib" && mkdir -p "$lib"
tar cf - --exclude=./.branches --exclude=./build . | tar xf - -C "$lib"
cp -a "$snap/kernels" "$snap/core" "$lib/"
(cd "$lib" && ./gdp build > "$OUT/gdp_build.log" 2>&1; echo "gdp build rc=$? at $(($(date +%s) - t0))s" >> "$OUT/gdp_build.log") &
# lab build, checks, then lab timings until the budget (tools/gpu_branches.sh)
SKIP_MAIN=1 BUDGET_S=${LAB_BUDGET_S:-360} OUT=/tmp/br bash tools/gpu_branches.sh > "$OUT/branches.log" 2>&1
wait
echo "[$(($(date +%s) - t0))s] library" >> "$OUT/branches.log"
cd "$lib" || exit 1
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 --repeat 20 --no-save --with-saving"
for run in default fork passes_old default fork; do
  case $run in
    default) E="" ;;
    fork) E="GDP_CUDA_V3_FORK=1" ;;
    passes_old) E="GDP_CUDA_V3_PASSES=old" ;;
  esac
  env $E timeout 60 $B 2>&1 | grep -E "^  [0-9]" | sed "s/^/[$run] /" >> "$OUT/library_ab.log"
done
# FORK=1 in the recompute backward; the saving forward+backward (the two-warp saving pass
# runs where choose_ks2 takes it; the lab check above covers it with PASSES=ks2)
for run in "bf16 FORK=1" "bf16 --save-for-backward"; do
  echo "== $run" >> "$OUT/check_cuda.log"
  case $run in *FORK=1) E="GDP_CUDA_V3_FORK=1" ;; *) E="" ;; esac
  env $E timeout 60 ./gdp experiments/check_reference.lua --device cuda --dtype ${run% FORK=1} >> "$OUT/check_cuda.log" 2>&1
  echo "check_reference $run rc=$? $(tail -1 "$OUT/check_cuda.log")" >> "$OUT/library_ab.log"
done
echo "[$(($(date +%s) - t0))s] done" >> "$OUT/library_ab.log"
tar czf "$OUT/br.tgz" -C /tmp br
