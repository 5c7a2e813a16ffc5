#!/usr/bin/env bash
# Session 11, call 4: main with lab/slots merged (call 3): the library build (fla's Triton
# kernels compiled meanwhile), the issue's benchmark with fla in the same run,
# check_reference --device cuda in bf16, bf16 saving for backward and f32, then
# `./gdp test --quick` (every suite, #gpu specs included) if time is left.
# Device (carry [".devbundle", ".fla"]; .fla = fla-org/flash-linear-attention at bc3b101d,
# fla/__init__.py, fla/utils, fla/ops, fla/modules):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session11/call4.sh
CALL=call4
BUDGET_S=${BUDGET_S:-470}
source tools/device_call.sh
SHAPES=4x4096x1,4x4096x2,4x4096x3,1x32768x2
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR
( PYTHONPATH=$PWD/.fla:${PYTHONPATH:-} timeout 400 python3 tools/fla_bench.py --shapes $SHAPES --H 16 --K 128 --V 128 \
    --reps 2 --warmup 2 --final-state --no-queued > /tmp/fla_warm.json 2> /tmp/fla_warm.err; echo "fla warm-up rc=$?" > /tmp/fla_warm.rc ) &
FLA=$!
./gdp build > "$OUT/gdp_build.log" 2>&1
rc=$?
log "gdp build rc=$rc"
[ $rc = 0 ] || { tail -30 "$OUT/gdp_build.log"; exit 1; }
export GDP_LIB=$PWD/build/libgdp.so
wait $FLA; log "$(cat /tmp/fla_warm.rc) $(tail -1 /tmp/fla_warm.err)"
timeout 200 ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --shapes $SHAPES \
  --against-fla --with-saving --repeat 30 --json > "$OUT/bench_gdp.json" 2> "$OUT/bench_gdp.log"
log "bench with fla rc=$?"
cat "$OUT/bench_gdp.log"
for m in "bf16" "bf16 --save-for-backward" "f32"; do
  left "check_reference $m" || break
  timeout 60 ./gdp experiments/check_reference.lua --device cuda --dtype $m > "$OUT/cr.tmp" 2>&1
  log "check_reference $m rc=$? $(tail -1 "$OUT/cr.tmp")"
  { echo "== $m"; cat "$OUT/cr.tmp"; } >> "$OUT/check_reference.log"; rm -f "$OUT/cr.tmp"
done
if left "gdp test --quick"; then
  timeout $(( BUDGET_S + 60 - ($(date +%s) - t0) )) ./gdp test --quick > "$OUT/gdp_test.log" 2>&1
  log "gdp test --quick rc=$? $(tail -1 "$OUT/gdp_test.log")"
fi
[ $rc = 0 ] && rm -f "$OUT/gdp_build.log"
log "done"
