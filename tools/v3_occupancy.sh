#!/usr/bin/env bash
# v3_occupancy.sh [PTXAS_LOG] -- per-SM resources of every variant-3 launch at the
# benchmark shapes (kernels/bench/v3_occupancy.cu; host only, no GPU).  PTXAS_LOG: a
# tools/gpu_lab_build.sh DIR/ptxas.log of this tree (default /tmp/lab-p7b/ptxas.log).
# V3OCC_CHECK=1 first compiles the layout checks (the kernel sources included, every
# re-derived shared-memory size static_asserted equal; PTX only, ~2.5 min each).
set -eu
LOG=${1:-/tmp/lab-p7b/ptxas.log}
OUT=${V3OCC_DIR:-/tmp/v3occ}
mkdir -p "$OUT"
F="-std=c++17 -Icore/include -Icore/src -Ikernels -Ikernels/cuda --expt-relaxed-constexpr"
if [ "${V3OCC_CHECK:-0}" = 1 ]; then
  for c in FWD BWD; do
    nvcc $F -gencode=arch=compute_90a,code=compute_90a -DV3OCC_CHECK_$c -c kernels/bench/v3_occupancy.cu \
      -o "$OUT/check_$c.o"
  done
  echo "layout checks: fwd and bwd sizes equal" >&2
fi
nvcc -O2 $F kernels/bench/v3_occupancy.cu -o "$OUT/v3_occupancy"
"$OUT/v3_occupancy" "$LOG"
