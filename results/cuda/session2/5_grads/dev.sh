#!/usr/bin/env bash
# gs4 helper device run: old (HEAD) / stage1 / new (tree) labs from a HEAD snapshot; SASS counts, check, timing.
set -u
OUT=${OUT:?}
R=$PWD/build-gs4
B=/tmp/gs4b; mkdir -p $B
H=$R/head
cp kernels/cuda/gdp_bwd_v3.cu $B/new_bwd_v3.cu
cp $R/orig_bwd_v3.cu $B/old_bwd_v3.cu
cp $R/stage1_bwd_v3.cu $B/s1_bwd_v3.cu
F="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I$H/core/include -I$H/core/src -I$H/kernels -I$H/kernels/cuda --expt-relaxed-constexpr -lineinfo"
VERS=${VERS:-old s1 new}
( gcc -O2 -fopenmp -I$H/core/include -I$H/core/src -I$H/kernels -c $H/kernels/cpu/gdp_recurrent.c -o $B/rec.o &
  nvcc $F -c $H/kernels/cuda/gdp_fwd.cu -o $B/f.o &
  nvcc $F -c $H/kernels/cuda/gdp_bwd.cu -o $B/b.o &
  nvcc $F -c $H/kernels/cuda/gdp_fwd_v3.cu -o $B/v3.o &
  for v in $VERS; do nvcc $F -Xptxas -v -c $B/${v}_bwd_v3.cu -o $B/bv3_$v.o 2> $OUT/ptxas_$v.log & done
  nvcc $F -c $H/kernels/bench/gdp_cuda_lab.cu -o $B/lab.o &
  wait ) > $OUT/build.log 2>&1
for v in $VERS; do
  nvcc $F -Xcompiler -fopenmp $B/rec.o $B/f.o $B/b.o $B/v3.o $B/lab.o $B/bv3_$v.o -o $B/lab_$v >> $OUT/build.log 2>&1 || { grep -i error $OUT/build.log | head; exit 1; }
  cuobjdump -sass $B/bv3_$v.o > $B/$v.sass
  python3 $R/sass_count.py $B/$v.sass > $OUT/sass_$v.txt
  grep -E "spill" $OUT/ptxas_$v.log | sort | uniq -c
done
echo "== build ok $(date +%T)"
for v in ${CHECK:-new s1}; do
  timeout 100 $B/lab_$v check v3 > $OUT/check_$v.log 2>&1; echo "check $v rc=$?"
  grep -E "check:" $OUT/check_$v.log
done
grep -E "chunk_v3" $OUT/check_new.log | sed -E 's/ +/ /g' | head -40
echo "== timing $(date +%T)"
for s in "4 4096 2" "4 4096 1" "4 4096 3"; do
  for v in $VERS; do
    echo "-- $v $s"; GDP_CUDA_PROFILE=1 timeout 45 $B/lab_$v bench $s v3 --reps 10 2>&1 | grep -E " fwd |grad_|bwd" | grep -v " 0.0000 ms"
  done
done | tee $OUT/timing.log
echo "== sanitizer $(date +%T)"
timeout 60 compute-sanitizer --tool memcheck $B/lab_new bench 1 300 2 v3 --reps 1 > $OUT/sanitizer.log 2>&1
grep -E "ERROR SUMMARY|Invalid|out of bounds" $OUT/sanitizer.log | head -5
if [ -n "${RACE:-}" ]; then
timeout 90 compute-sanitizer --tool racecheck $B/lab_new bench 1 300 2 v3 --reps 1 > $OUT/racecheck.log 2>&1
grep -E "RACECHECK SUMMARY|hazard" $OUT/racecheck.log | head -5
fi
echo "== end $(date +%T)"
