#!/usr/bin/env bash
# Session 10, call 2: grad_wy's dVb and W6 products on wgmma (GDP_CUDA_V3_WY_WG=3: three
# blocks per SM at 80 registers, ptxas spills ~52 bytes; =2: two blocks, 128 registers;
# unset: mma.sync).  The lab only (no library build: the lab has every kernel and the
# oracle).  Correctness first: lab check v3 v5 with each mode (K = V = 128 at n = 2 is where
# WG runs: four random problems of the check and its 2600-token sequence), memcheck and
# racecheck on the lab's 1 x 300 n = 2 passes with WG=3; then the lab's fwd+bwd medians
# (plain v3 and saving v5) alternating the three modes, and one profiled call each.
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash results/cuda/session10/call2.sh
CALL=call2
BUDGET_S=${BUDGET_S:-560}
source tools/device_call.sh
bash tools/gpu_lab_build.sh /tmp/lab-main > "$OUT/lab_build.log" 2>&1
rc=$?
L=/tmp/lab-main/lab
log "lab build rc=$rc $([ -x $L ] && echo ok || echo FAILED)"
grep -A4 "grad_wy_kernel_v3ILi128ELi128ELi64ELi32ELb1ELi" /tmp/lab-main/ptxas.log | grep -E "Compiling|spill|Used" | tee -a "$OUT/$CALL.log"
[ -x $L ] || exit 1
for wg in 0 3 2; do
  GDP_CUDA_V3_WY_WG=$wg timeout 100 $L check v3 v5 > "$OUT/lab.tmp" 2>&1
  log "lab check v3 v5 (WY_WG=$wg) rc=$? $(tail -1 "$OUT/lab.tmp")"
  { echo "== WY_WG=$wg"; cat "$OUT/lab.tmp"; } >> "$OUT/lab_check.log"; rm -f "$OUT/lab.tmp"
done
grep -E "n=2.*K=128 V=128" "$OUT/lab_check.log" | head -24 | tee -a "$OUT/$CALL.log"
for tool in memcheck racecheck; do
  left "$tool" || break
  GDP_CUDA_V3_WY_WG=3 timeout 60 compute-sanitizer --tool $tool $L bench 1 300 2 v3 v5 --reps 1 > "$OUT/san.tmp" 2>&1
  log "$tool WY_WG=3 (lab bench 1 300 2 v3 v5) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san.tmp" | tail -1)"
  cat "$OUT/san.tmp" >> "$OUT/sanitizer.log"; rm -f "$OUT/san.tmp"
done
for r in 1 2 3; do
  for wg in 0 3 2; do
    left "bench WY_WG=$wg r$r" || break 2
    GDP_CUDA_V3_WY_WG=$wg timeout 60 $L bench 4 4096 2 v3 v5 --reps 20 2>&1 | grep -E "fwd\+bwd" \
      | sed "s/^/[WY_WG=$wg r$r] /" | tee -a "$OUT/ab.log"
  done
done
for wg in 0 3 2; do
  left "profile WY_WG=$wg" || break
  { echo "== WY_WG=$wg"; GDP_CUDA_V3_WY_WG=$wg GDP_CUDA_PROFILE=1 timeout 60 $L bench 4 4096 2 v5 --reps 2; } >> "$OUT/profiles.log" 2>&1
  log "profile WY_WG=$wg: $(grep -E 'WY part' "$OUT/profiles.log" | tail -1)"
done
[ $rc = 0 ] && rm -f "$OUT/lab_build.log"
log "done"
