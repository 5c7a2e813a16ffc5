#!/usr/bin/env bash
# One device call (session 1, end): validates and times the lab's chunked-forward
# variant 3/4 (kernels/cuda/gdp_fwd_v3.cu) against the float64 oracle and variant 2,
# then checks the library side: ctest -L cuda (incl. bf16 matmul) and bench_gdp's
# in-run ceilings.  Run from the repository root on the GPU machine:
#   source .devbundle/env.sh && OUT=<dir> bash tools/gpu_v3_check.sh
set -u
OUT=${OUT:?set OUT}
B=/tmp/l3; mkdir -p $B
F="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icore/include -Icore/src -Ikernels -Ikernels/cuda --expt-relaxed-constexpr"
( gcc -O2 -fopenmp -Icore/include -Icore/src -Ikernels -c kernels/cpu/gdp_recurrent.c -o $B/rec.o &
  nvcc $F -c kernels/cuda/gdp_fwd.cu -o $B/f.o &
  nvcc $F -c kernels/cuda/gdp_bwd.cu -o $B/b.o &
  nvcc $F -Xptxas -v -c kernels/cuda/gdp_fwd_v3.cu -o $B/v3.o &
  nvcc $F -c kernels/bench/gdp_cuda_lab.cu -o $B/lab.o &
  ./gdp build > $OUT/gdp_build.log 2>&1 &
  wait ) > $OUT/build.log 2>&1
nvcc $F -Xcompiler -fopenmp $B/*.o -o $B/lab >> $OUT/build.log 2>&1 || { grep -i error $OUT/build.log | head -20; exit 1; }
L=$B/lab
echo "== lab check (v3 = new prep + new state pass, v4 = old prep + new state pass)"
timeout 60 $L check v3 v4 > $OUT/check.log 2>&1
grep -E "^device|check:" $OUT/check.log
grep -E "chunk_v3|oldprep" $OUT/check.log | sed -E 's/ dq=.*//; s/ +/ /g'
echo "== lab bench"
for s in "4 4096 2" "1 32768 2"; do timeout 40 $L bench $s v2 v3 v4 --reps 10 2>&1 | grep -v "^device"; done | tee $OUT/bench_lab.log
GDP_CUDA_PROFILE=1 timeout 30 $L bench 4 4096 2 v3 v4 --reps 2 2>&1 | grep -E "fwd (prep|state)" | grep -v " 0.0000 ms"
for bv in 16 32 64; do echo "BV=$bv"; GDP_CUDA_V3_BV=$bv timeout 30 $L bench 4 4096 2 v3 --reps 10 2>&1 | grep " fwd "; done
echo "== library: ctest -L cuda, bench_gdp ceilings"
tail -3 $OUT/gdp_build.log
ctest --test-dir build -L cuda --output-on-failure > $OUT/ctest_cuda.log 2>&1; grep -E "tests passed|matmul bf16|Failed" $OUT/ctest_cuda.log
build/test_cuda_tensor 2>&1 | grep -E "matmul|passed" | tail -3
./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --B 4 --T 4096 --H 16 --n 2 --algorithm chunk --no-save > $OUT/bench_gdp_cuda.log 2>&1; tail -4 $OUT/bench_gdp_cuda.log
