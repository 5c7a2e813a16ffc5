#!/usr/bin/env bash
# gpu_ncu_source.sh -- where grad_state and grad_wy spend their cycles, line by line: one
# Nsight Compute profile of each (the saving path at 4 x 4096 n = 2, lab variant 5) with
# the full section set, source import and warp-state sampling, saved as a report, and
# printed as the per-line source page (CUDA lines with their SASS).  Session 10's reading
# (NOTES.md "Session 10") is that a grad_wy block lives ~24 us, i.e. ~2.8k instructions
# per warp at ~16 cycles each; this says which lines those are.  ~3-4 minutes after the
# lab build.
# Other kernels: KERNELS (an ncu --kernel-name regex), NAME (the files' prefix) and
# PER_PASS (how many launches of them one forward+backward makes: the first pass's are
# skipped as warm-up, the second's profiled), e.g. the saving forward and dstate:
#   KERNELS='(^|[^_a-z])(prep|state_ks2|state|dstate)_kernel_v3' NAME=seq PER_PASS=3
# (the names' left edge matters: session 12 ran 'prep_kernel_v3|...|state_kernel_v3|...',
# which grad_state_kernel_v3 matches too, so the skip count was off and ncu profiled
# grad_state, the prep and the saving state pass instead of the prep, the state pass and
# dstate; the anchored form above has not yet been run)
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_ncu_source.sh
# Files back: ncu_source.log (this script's log), NAME.ncu-rep (open in Nsight Compute; over
# the device tool's size limit, it stays there), NAME_source.csv (per-line metrics),
# NAME_details.txt (the sections as text), NAME_lines.txt (tools/ncu_lines.py: stall
# samples per phase and per line, compare-and-swap atomics).
CALL=ncu_source
BUDGET_S=${BUDGET_S:-560}
KERNELS=${KERNELS:-grad_(wy|state)_kernel}
NAME=${NAME:-grad}
PER_PASS=${PER_PASS:-2}
source tools/device_call.sh
L=${L:-/tmp/lab-main/lab}
if [ ! -x "$L" ]; then
  bash tools/gpu_lab_build.sh /tmp/lab-main > "$OUT/lab_build.log" 2>&1
  log "lab build rc=$?"
  [ -x "$L" ] || exit 1
  rm -f "$OUT/lab_build.log"
fi
# --launch-skip PER_PASS: the first forward+backward is the warm-up; one launch of each kernel
timeout 300 ncu --set full --import-source yes --section SourceCounters --section WarpStateStats \
  --kernel-name regex:"$KERNELS" --launch-skip "$PER_PASS" --launch-count "$PER_PASS" \
  -f -o "$OUT/$NAME" $L bench 4 4096 2 v5 --reps 1 > "$OUT/ncu_run.tmp" 2>&1
log "ncu rc=$? $(grep -c '==PROF== Profiling' "$OUT/ncu_run.tmp") kernels profiled"
tail -5 "$OUT/ncu_run.tmp" | tee -a "$OUT/$CALL.log"; rm -f "$OUT/ncu_run.tmp"
left "details page" && { ncu --import "$OUT/$NAME.ncu-rep" --page details > "$OUT/${NAME}_details.txt" 2>&1; log "details rc=$?"; }
left "source page" && { ncu --import "$OUT/$NAME.ncu-rep" --page source --csv --print-source cuda,sass \
  > "$OUT/${NAME}_source.csv" 2>&1; log "source page rc=$? $(wc -l < "$OUT/${NAME}_source.csv") lines"; }
left "summary" && { python3 tools/ncu_lines.py "$OUT/${NAME}_source.csv" > "$OUT/${NAME}_lines.txt" 2>&1; log "ncu_lines rc=$?"; }
ls -la "$OUT" | tee -a "$OUT/$CALL.log"
log "done"
