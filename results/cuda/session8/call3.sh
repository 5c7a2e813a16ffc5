#!/usr/bin/env bash
# Session 8, call 3: the tree as committed (dKnA in bf16 and no early grad_wy prefetches
# by default; the device timer gdp_ctx_timer_start/_stop, gdp.ops.timed_device, and
# bench_gdp's dev_fb columns): gdp test --quick (the C timer test and the #gpu
# timed_device spec among them), check_reference bf16 / f32 / bf16 saving,
# compute-sanitizer memcheck and racecheck on small passes, the DKNA A/B on the device
# timer, then the issue's benchmark with fla in the same run.  fla's Triton kernels are
# compiled during our build (a throwaway fla run into the same TRITON_CACHE_DIR).
# Device (carry [".devbundle", ".fla"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session8/call3.sh
CALL=call3
BUDGET_S=${BUDGET_S:-480}
source tools/device_call.sh
SHAPES=4x4096x1,4x4096x2,4x4096x3,1x32768x2
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR
( PYTHONPATH=$PWD/.fla:${PYTHONPATH:-} timeout 400 python3 tools/fla_bench.py --shapes $SHAPES --H 16 --K 128 --V 128 \
    --reps 2 --warmup 2 --final-state --no-queued > /tmp/fla_warm.json 2> /tmp/fla_warm.err; echo "fla warm-up rc=$?" > /tmp/fla_warm.rc ) &
FLA=$!
./gdp build > "$OUT/gdp_build.log" 2>&1
log "gdp build rc=$? $(tail -1 "$OUT/gdp_build.log")"
# nothing else on the GPU while we test and time
wait $FLA; log "$(cat /tmp/fla_warm.rc) $(tail -2 /tmp/fla_warm.err | tr '\n' ' ')"
# CHECKS=0: skip gdp test and check_reference (the second attempt of this call: the
# first ran them on the same library, then lost its later steps to a quoting bug in
# tools/device_call.sh -- 3a_checks/)
if [ "${CHECKS:-1}" = 1 ]; then
timeout 200 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1
log "gdp test --quick rc=$? $(tail -1 "$OUT/gdp_test.log")"
grep -E "test_cuda_tensor|timed_device" "$OUT/gdp_test.log" | head -4 | tee -a "$OUT/call3.log"
for m in bf16 f32 "bf16 --save-for-backward"; do
  timeout 120 ./gdp experiments/check_reference.lua --device cuda --dtype $m > "$OUT/cr.tmp" 2>&1
  log "check_reference $m rc=$? $(tail -1 "$OUT/cr.tmp") worst dk: $(grep -E ' dk ' "$OUT/cr.tmp" | awk '{print $4}' | sort -g | tail -1)"
  { echo "== $m"; cat "$OUT/cr.tmp"; } >> "$OUT/check_reference.log"; rm -f "$OUT/cr.tmp"
done
fi
# the issue's benchmark first (the call's deliverable), then the sanitizers and the A/B
if left "bench with fla"; then
  timeout 300 ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --shapes $SHAPES \
    --against-fla --with-saving --repeat 30 --json > "$OUT/bench_gdp.json" 2> "$OUT/bench_gdp.log"
  log "bench with fla rc=$?"
  cat "$OUT/bench_gdp.log"
fi
for tool in memcheck racecheck; do
  left "$tool" || break
  timeout 90 compute-sanitizer --tool $tool --target-processes all ./gdp results/cuda/session8/small_passes.lua > "$OUT/san.tmp" 2>&1
  log "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san.tmp" | tail -1) passes: $(grep -c '^n=' "$OUT/san.tmp")"
  cat "$OUT/san.tmp" >> "$OUT/sanitizer.log"; rm -f "$OUT/san.tmp"
done
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --no-save --no-ceilings"
for r in 1 2; do
  for d in bf16 f32; do
    left "DKNA A/B" || break 2
    GDP_CUDA_V3_DKNA=$d timeout 60 $B --with-saving --repeat 20 --shapes 4x4096x2,1x32768x2 2>&1 | grep -E "^  [0-9]" | sed "s/^/[DKNA=$d r$r] /" | tee -a "$OUT/dkna_ab.log"
  done
done
log "done"
