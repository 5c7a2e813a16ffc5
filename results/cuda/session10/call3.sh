#!/usr/bin/env bash
# Session 10, call 3: main after the bwd-tu merge (and the opt-in wgmma grad_wy, off by
# default): the library build (fla's Triton kernels compiled meanwhile), the whole
# `./gdp test --quick` on the GPU, the issue's benchmark with fla in the same run,
# check_reference bf16 / bf16 saving / f32; then, if time is left, WY_WG=3 against the
# default on the library's device timer.
# Device (carry [".devbundle", ".fla"]; .fla = fla-org/flash-linear-attention at bc3b101d,
# fla/__init__.py, fla/utils, fla/ops, fla/modules):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session10/call3.sh
CALL=call3
BUDGET_S=${BUDGET_S:-500}
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
[ $rc = 0 ] || exit 1
export GDP_LIB=$PWD/build/libgdp.so
timeout 200 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1
log "gdp test --quick rc=$? $(tail -1 "$OUT/gdp_test.log")"
wait $FLA; log "$(cat /tmp/fla_warm.rc) $(tail -1 /tmp/fla_warm.err)"
if left "bench with fla"; then
  timeout 200 ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --shapes $SHAPES \
    --against-fla --with-saving --repeat 30 --json > "$OUT/bench_gdp.json" 2> "$OUT/bench_gdp.log"
  log "bench with fla rc=$?"
  cat "$OUT/bench_gdp.log"
fi
for m in "bf16" "bf16 --save-for-backward" "f32"; do
  left "check_reference $m" || break
  timeout 60 ./gdp experiments/check_reference.lua --device cuda --dtype $m > "$OUT/cr.tmp" 2>&1
  log "check_reference $m rc=$? $(tail -1 "$OUT/cr.tmp")"
  { echo "== $m"; cat "$OUT/cr.tmp"; } >> "$OUT/check_reference.log"; rm -f "$OUT/cr.tmp"
done
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --no-save --no-ceilings --with-saving --repeat 20"
for r in 1 2; do
  for wg in 0 3; do
    left "A/B WY_WG=$wg r$r" || break 2
    GDP_CUDA_V3_WY_WG=$wg timeout 60 $B --shapes 4x4096x2,4x4096x1 2>&1 | grep -E "^(# BxTxn|  [0-9]+x)" \
      | sed "s/^/[WY_WG=$wg r$r] /" | tee -a "$OUT/ab.log"
  done
done
[ $rc = 0 ] && rm -f "$OUT/gdp_build.log"
log "done"
