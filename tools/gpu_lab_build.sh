#!/usr/bin/env bash
# gpu_lab_build.sh DIR -- builds the CUDA kernel lab (kernels/bench/gdp_cuda_lab.cu with
# every GDP kernel variant and the float64 oracle) into DIR/lab with nvcc directly, in
# parallel (the v3 files in their parts, kernels/cuda/parts/), with the ptxas
# register/spill report in DIR/ptxas.log.  Faster than the CMake build on the GPU machine
# and independent of the rest of the tree.  Exit status 1 (and
# the first errors on stderr) when the build fails.
set -u
B=${1:?usage: tools/gpu_lab_build.sh DIR}
mkdir -p "$B"
F="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icore/include -Icore/src -Ikernels -Ikernels/cuda --expt-relaxed-constexpr -lineinfo"
rm -f "$B"/*.o "$B"/ptxas_*.log "$B/lab"
(
  gcc -O2 -fopenmp -Icore/include -Icore/src -Ikernels -c kernels/cpu/gdp_recurrent.c -o "$B/rec.o" &
  for f in gdp_fwd gdp_bwd; do
    nvcc $F -Xptxas -v -c kernels/cuda/$f.cu -o "$B/$f.o" 2>"$B/ptxas_$f.log" &
  done
  # the v3 files in parts, compiled in parallel (kernels/cuda/gdp_v3_split.h)
  for f in kernels/cuda/parts/*.cu; do
    p=$(basename "$f" .cu)
    nvcc $F -Xptxas -v -c "$f" -o "$B/$p.o" 2>"$B/ptxas_$p.log" &
  done
  nvcc $F -c kernels/bench/gdp_cuda_lab.cu -o "$B/lab.o" &
  wait
) >"$B/build.log" 2>&1
cat "$B"/ptxas_*.log >"$B/ptxas.log"
if ! nvcc $F -Xcompiler -fopenmp "$B"/*.o -o "$B/lab" >>"$B/build.log" 2>&1; then
  grep -ih "error" "$B/build.log" "$B/ptxas.log" | head -20 >&2
  exit 1
fi
# Kernels that spill, one line each: bytes, then the kernel (known: opt-in schedules and
# shapes off the benchmark's; kernels/cuda/NOTES.md).  The name is taken from the last
# "Compiling entry function" line before the spill line (session 12 found the earlier
# grep | paste pairing names with the wrong kernels' bytes).
awk '/Compiling entry function/ { match($0, /_Z[A-Za-z0-9_]+/); fn = substr($0, RSTART, RLENGTH) }
     /[1-9][0-9]* bytes spill stores/ { match($0, /[0-9]+ bytes spill stores/); print substr($0, RSTART, RLENGTH) "\t" fn }' \
  "$B/ptxas.log" | sort -u | head -20 >&2
exit 0
