#!/usr/bin/env bash
# One device call (session 3): validates and times the lab's variant 3 with the new
# chunked backward (kernels/cuda/gdp_bwd_v3.cu: v3 recompute + register-resident reverse
# state-gradient pass + the v3 per-chunk gradient kernels, state part and WY part, from
# float32 h / dH) against the float64 oracle, variant 2, and variant 3 with variant 2's
# gradient kernel (GDP_CUDA_V3_GRAD=v2, "chunk_v3_gradv2").  About 3-4 minutes.  Run from the repository root on the
# GPU machine:
#   source .devbundle/env.sh && OUT=<dir> bash tools/gpu_bwd_v3_check.sh
set -u
OUT=${OUT:?set OUT}
B=/tmp/lbv3
echo "== build (ptxas report in $OUT/ptxas.log)"
bash tools/gpu_lab_build.sh $B || exit 1
cp $B/ptxas.log $OUT/ptxas.log
L=$B/lab

echo "== lab check: variant 3 (fwd v3 + bwd v3) and variant 2, vs the float64 oracle"
timeout 75 $L check v3 v2 > $OUT/check.log 2>&1; echo "check rc=$?"
grep -E "^device|check:" $OUT/check.log
grep -E "chunk_v3" $OUT/check.log | sed -E 's/ +/ /g' | head -40
echo "== the same with variant 2's gradient kernel under variant 3 (bf16 h, dH)"
GDP_CUDA_V3_GRAD=v2 timeout 75 $L check v3 > $OUT/check_gradv2.log 2>&1; echo "check rc=$?"
grep -E "check:" $OUT/check_gradv2.log

echo "== compute-sanitizer memcheck on a small problem (variant 3)"
timeout 40 compute-sanitizer --tool memcheck $L bench 1 300 2 v3 --reps 1 > $OUT/sanitizer.log 2>&1
grep -E "ERROR SUMMARY|Invalid|out of bounds" $OUT/sanitizer.log | head -5
timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 2 v3 --reps 1 > $OUT/racecheck.log 2>&1
grep -E "RACECHECK SUMMARY|hazard" $OUT/racecheck.log | head -5

echo "== lab bench (median of 10): variants 2 and 3"
for s in "4 4096 2" "4 4096 1" "4 4096 3" "1 32768 2"; do
  timeout 45 $L bench $s v2 v3 --reps 10 --json $OUT/lab.jsonl 2>&1 | grep -v "^device"
  GDP_CUDA_V3_GRAD=v2 timeout 45 $L bench $s v3 --reps 10 --json $OUT/lab.jsonl 2>&1 | grep -v "^device"
done | tee $OUT/bench_lab.log
echo "== per kernel (one synchronised call each), 4 x 4096 n = 2 and 1 x 32768 n = 2"
for s in "4 4096 2" "1 32768 2"; do
  echo "-- $s"; GDP_CUDA_PROFILE=1 timeout 40 $L bench $s v2 v3 --reps 2 2>&1 | grep -E "per kernel|ms" | grep -v " 0.0000 ms"
done | tee $OUT/profile.log
echo "== value-block width of the v3 sequential kernels at 4 x 4096 n = 2 and 1 x 32768 n = 2"
for s in "4 4096 2" "1 32768 2"; do
  for bv in 16 32 64; do echo "BV=$bv $s"; GDP_CUDA_V3_BV=$bv timeout 30 $L bench $s v3 --reps 5 2>&1 | grep " fwd "; done
done | tee $OUT/bv_sweep.log
