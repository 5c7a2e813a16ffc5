#!/usr/bin/env bash
# Session 8, call 2: dKnA as bf16 between grad_state and grad_wy (GDP_CUDA_V3_DKNA,
# default bf16 in this tree; =f32 the old float32) and grad_wy's early L2 prefetches
# (GDP_CUDA_V3_WY_PF bit mask, default 7 = all; ncu in call 1 read 1.44 GB of DRAM for
# grad_wy against ~1.11 GB of inputs and outputs).  Correctness first (lab check both
# ways, gdp test, check_reference), then DRAM bytes per kernel by ncu, library A/B.
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session8/call2.sh
CALL=call2
source tools/device_call.sh
build_gdp_and_lab
for d in bf16 f32; do
  GDP_CUDA_V3_DKNA=$d timeout 120 $L check v3 v5 > "$OUT/lab_check_$d.log" 2>&1
  log "lab check DKNA=$d rc=$? $(grep -E 'check:' "$OUT/lab_check_$d.log" | tail -1)"
done
# dk is the only output dKnA reaches: its column side by side, then any other difference
paste -d'|' <(grep -E "^(chunk|v3)" "$OUT/lab_check_f32.log" | grep -oE "dk=[0-9.e+-]+") \
            <(grep -E "^(chunk|v3)" "$OUT/lab_check_bf16.log" | grep -oE "dk=[0-9.e+-]+") | tr '\n' ' ' | sed 's/^/dk f32|bf16: /' | tee -a "$OUT/call2.log"; echo
diff <(grep -E "^(chunk|v3)" "$OUT/lab_check_f32.log" | sed -E 's/ dk=[^ ]+//') <(grep -E "^(chunk|v3)" "$OUT/lab_check_bf16.log" | sed -E 's/ dk=[^ ]+//') > /dev/null \
  && log "lab check: every error but dk identical" || log "lab check: errors other than dk DIFFER"
timeout 200 ./gdp test --quick > "$OUT/gdp_test.log" 2>&1
log "gdp test --quick rc=$? $(tail -1 "$OUT/gdp_test.log")"
for m in bf16 "bf16 --save-for-backward"; do
  timeout 90 ./gdp experiments/check_reference.lua --device cuda --dtype $m > "$OUT/cr.tmp" 2>&1
  log "check_reference $m rc=$? $(tail -1 "$OUT/cr.tmp") worst dk: $(grep -E ' dk ' "$OUT/cr.tmp" | awk '{print $4}' | sort -g | tail -1)"
  { echo "== $m"; cat "$OUT/cr.tmp"; } >> "$OUT/check_reference.log"; rm -f "$OUT/cr.tmp"
done
# DRAM bytes and time of the two per-chunk gradient kernels (saving backward, 4x4096 n=2)
for cfg in "f32 7" "bf16 7" "bf16 6" "bf16 2" "bf16 0"; do
  set -- $cfg
  left "ncu $cfg" || break
  GDP_CUDA_V3_DKNA=$1 GDP_CUDA_V3_WY_PF=$2 timeout 90 ncu --clock-control none -k regex:grad_ -c 2 \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum $L bench 4 4096 2 v5 --reps 1 2>&1 \
    | grep -v "==PROF==" | grep -E "grad_|dram__|gpu__time" | sed -E 's/ +/ /g; s/\(GdpArgs.*//' | paste -d' ' - - - - | sed "s/^/[DKNA=$1 PF=$2] /" | tee -a "$OUT/call2.log"
done
B="./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --repeat 20 --no-save"
for r in 1 2; do
  for cfg in "f32 7 0" "bf16 7 0" "bf16 6 0" "bf16 2 0" "bf16 0 0" "bf16 7 auto"; do
    set -- $cfg
    left "library $cfg" || break 2
    GDP_CUDA_V3_DKNA=$1 GDP_CUDA_V3_WY_PF=$2 GDP_CUDA_V3_GS_AHEAD=$3 timeout 60 $B --with-saving --shapes 4x4096x1,4x4096x2,4x4096x3,1x32768x2 2>&1 \
      | grep -E "^  [0-9]" | sed "s/^/[DKNA=$1 PF=$2 AHEAD=$3 r$r] /" | tee -a "$OUT/library_ab.log"
  done
done
if left "profile"; then
  GDP_CUDA_PROFILE=1 timeout 40 $L bench 4 4096 2 v3 v5 --reps 2 2>&1 | grep -vE "^device| 0.0000 ms" | tee "$OUT/profile.txt"
fi
log "done"
