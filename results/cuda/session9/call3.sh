#!/usr/bin/env bash
# Session 9, call 3: U = Tu V formed in the forward's state passes (GDP_CUDA_V3_U, default
# tv for the plain and the saving forward; =panel the old U through memory) and the Tu^T
# prep at five blocks per SM (GDP_CUDA_V3_PREP_FIVE; default at n = 3 only).  Checks
# first (lab check of the defaults, FIVE=1 and U=panel; the GDP_CUDA_V3_U specs), the
# A/Bs on the device timer, then the issue's benchmark with fla in the same run (fla's
# Triton kernels compiled during our build), memcheck on the lab's small passes (defaults,
# FIVE=1), check_reference bf16 plain / saving, racecheck (defaults, FIVE=1).
# Device (carry [".devbundle", ".fla"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session9/call3.sh
CALL=call3
BUDGET_S=${BUDGET_S:-575}
source tools/device_call.sh
SHAPES=4x4096x1,4x4096x2,4x4096x3,1x32768x2
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR
( PYTHONPATH=$PWD/.fla:${PYTHONPATH:-} timeout 400 python3 tools/fla_bench.py --shapes $SHAPES --H 16 --K 128 --V 128 \
    --reps 2 --warmup 2 --final-state --no-queued > /tmp/fla_warm.json 2> /tmp/fla_warm.err; echo "fla warm-up rc=$?" > /tmp/fla_warm.rc ) &
FLA=$!
build_gdp_and_lab
export GDP_LIB=$PWD/build/libgdp.so
wait $FLA; log "$(cat /tmp/fla_warm.rc) $(tail -1 /tmp/fla_warm.err)"
for m in default FIVE=1 U=panel; do
  case $m in default) e="";; FIVE=1) e="GDP_CUDA_V3_PREP_FIVE=1";; U=panel) e="GDP_CUDA_V3_U=panel";; esac
  env $e timeout 100 $L check v3 v5 > "$OUT/lab.tmp" 2>&1
  log "lab check v3 v5 ($m) rc=$? $(tail -1 "$OUT/lab.tmp")"
  { echo "== $m"; cat "$OUT/lab.tmp"; } >> "$OUT/lab_check.log"; rm -f "$OUT/lab.tmp"
done
timeout 120 busted --filter "GDP_CUDA_V3_U" spec/cuda_spec.lua > "$OUT/spec.log" 2>&1
log "busted GDP_CUDA_V3_U specs rc=$? $(tail -1 "$OUT/spec.log")"
grep -E "saved vs recompute" "$OUT/spec.log" >> "$OUT/$CALL.log"
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --no-save --no-ceilings --with-saving --repeat 15"
for r in 1 2; do
  for m in U=tv U=panel FIVE=1 FIVE=0; do
    left "A/B $m r$r" || break 2
    case $m in U=tv) e="GDP_CUDA_V3_U=tv";; U=panel) e="GDP_CUDA_V3_U=panel";; FIVE=1) e="GDP_CUDA_V3_PREP_FIVE=1";; FIVE=0) e="GDP_CUDA_V3_PREP_FIVE=0";; esac
    env $e timeout 60 $B --shapes 4x4096x2,4x4096x3 2>&1 | grep -E "^(# BxTxn|  [0-9]+x)" | sed "s/^/[$m r$r] /" | tee -a "$OUT/ab.log"
  done
done
if left "bench with fla"; then
  timeout 200 ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --shapes $SHAPES \
    --against-fla --with-saving --repeat 30 --json > "$OUT/bench_gdp.json" 2> "$OUT/bench_gdp.log"
  log "bench with fla rc=$?"
  cat "$OUT/bench_gdp.log"
fi
san() { # san TOOL MODE
  local e=""; [ "$2" = FIVE=1 ] && e="GDP_CUDA_V3_PREP_FIVE=1"
  env $e timeout 60 compute-sanitizer --tool $1 $L bench 1 300 3 v3 v5 --reps 1 > "$OUT/san.tmp" 2>&1
  log "$1 ($2; lab bench 1 300 3 v3 v5) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san.tmp" | tail -1)"
  cat "$OUT/san.tmp" >> "$OUT/sanitizer.log"; rm -f "$OUT/san.tmp"
}
left "memcheck" && san memcheck default
left "memcheck FIVE=1" && san memcheck FIVE=1
for m in "bf16" "bf16 --save-for-backward"; do
  left "check_reference $m" || break
  timeout 60 ./gdp experiments/check_reference.lua --device cuda --dtype $m > "$OUT/cr.tmp" 2>&1
  log "check_reference $m rc=$? $(tail -1 "$OUT/cr.tmp")"
  { echo "== $m"; cat "$OUT/cr.tmp"; } >> "$OUT/check_reference.log"; rm -f "$OUT/cr.tmp"
done
left "racecheck" && san racecheck default
left "racecheck FIVE=1" && san racecheck FIVE=1
# the device returns at most 8 files: the build logs only when a build failed
grep -q "rc=0" "$OUT/gdp_build.log" && [ -x "$L" ] && rm -f "$OUT/gdp_build.log" "$OUT/lab_build.log"
log "done"
