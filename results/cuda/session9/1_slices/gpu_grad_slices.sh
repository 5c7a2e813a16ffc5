#!/usr/bin/env bash
# gpu_grad_slices.sh -- the A/B of GDP_CUDA_V3_GRAD_SLICES (the per-chunk gradients in
# chunk ranges over two streams; kernels/cuda/NOTES.md, session 8) on the GPU machine:
# build, gdp test --quick (the #gpu spec compares S = 1, 3, 64), then bench_gdp at the
# issue's shapes with S = 1, 2, 4, 8 alternating, three rounds; the figures to compare
# are dev_fb / sv_dev_fb (device timer).  About 6-7 minutes on a fresh machine.
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_grad_slices.sh
CALL=grad_slices
source tools/device_call.sh
./gdp build > "$OUT/gdp_build.log" 2>&1
log "gdp build rc=$? $(tail -1 "$OUT/gdp_build.log")"
# only the spec that compares S = 1, 3, 64 (the whole suite passed on main in session 8)
timeout 180 busted --filter "GRAD_SLICES" spec/cuda_spec.lua > "$OUT/gdp_test.log" 2>&1
log "busted GRAD_SLICES spec rc=$? $(tail -1 "$OUT/gdp_test.log")"
grep -E "GRAD_SLICES" "$OUT/gdp_test.log" | tee -a "$OUT/$CALL.log"
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --no-save --no-ceilings --with-saving"
# the issue's shape first, alternating S each round, then the other shapes once at S = 1 / 8
for r in 1 2 3; do
  for s in 1 4 8 16 2; do
    left "slices $s round $r" || break 2
    GDP_CUDA_V3_GRAD_SLICES=$s timeout 60 $B --repeat 30 --shapes 4x4096x2 2>&1 \
      | grep -E "^(# BxTxn|  [0-9]+x)" | sed "s/^/[S=$s r$r] /" | tee -a "$OUT/slices_ab.log"
  done
done
for s in 1 8; do
  left "slices $s other shapes" || break
  GDP_CUDA_V3_GRAD_SLICES=$s timeout 90 $B --repeat 20 --shapes 4x4096x1,4x4096x3,1x32768x2 2>&1 \
    | grep -E "^(# BxTxn|  [0-9]+x)" | sed "s/^/[S=$s] /" | tee -a "$OUT/slices_ab.log"
done
log "done"
