#!/usr/bin/env bash
# Session 12, call 3 (warm machine, the labs of call 1): memcheck / racecheck of lab/next12
# at n = 2 and 3 (call 1's branch stage ran racecheck at n = 2 only, and ran out of time
# before memcheck), then both labs' per-kernel profiles at 4 x 4096 n = 2 (one
# synchronised call per kernel; plain, then saving).  Output: 3_sanitize_profile/output.txt.
#   source .devbundle/env.sh && bash results/cuda/session12/call3.sh
L=/tmp/lab-lab-next12/lab
for n in 2 3; do
  timeout 60 compute-sanitizer --tool memcheck $L bench 1 300 $n v3 v5 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[n=$n memcheck] /"
done
timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 3 v3 v5 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | sed "s/^/[n=3 racecheck] /"
for L in /tmp/gdp-lab/lab /tmp/lab-lab-next12/lab; do
  echo "== profile $L"
  GDP_CUDA_PROFILE=1 timeout 30 $L bench 4 4096 2 v3 v5 --reps 2 2>&1 | grep -E "^    " | grep -v " 0.0000 ms"
done
