#!/usr/bin/env bash
# gpu_ncu_source.sh -- where grad_state and grad_wy spend their cycles, line by line: one
# Nsight Compute profile of each (the saving path at 4 x 4096 n = 2, lab variant 5) with
# the full section set, source import and warp-state sampling, saved as a report, and
# printed as the per-line source page (CUDA lines with their SASS).  Session 10's reading
# (NOTES.md "Session 10") is that a grad_wy block lives ~24 us, i.e. ~2.8k instructions
# per warp at ~16 cycles each; this says which lines those are.  ~3-4 minutes after the
# lab build.
# Device (carry [".devbundle"]):
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_ncu_source.sh
# Files back: ncu_source.log (this script's log), grad.ncu-rep (open in Nsight Compute),
# grad_source.csv (per-line metrics), grad_details.txt (the sections as text).
CALL=ncu_source
BUDGET_S=${BUDGET_S:-560}
source tools/device_call.sh
L=${L:-/tmp/lab-main/lab}
if [ ! -x "$L" ]; then
  bash tools/gpu_lab_build.sh /tmp/lab-main > "$OUT/lab_build.log" 2>&1
  log "lab build rc=$?"
  [ -x "$L" ] || exit 1
  rm -f "$OUT/lab_build.log"
fi
# --launch-skip 2: the first forward+backward is the warm-up; one launch of each kernel
timeout 300 ncu --set full --import-source yes --section SourceCounters --section WarpStateStats \
  --kernel-name regex:"grad_(wy|state)_kernel" --launch-skip 2 --launch-count 2 \
  -f -o "$OUT/grad" $L bench 4 4096 2 v5 --reps 1 > "$OUT/ncu_run.tmp" 2>&1
log "ncu rc=$? $(grep -c '==PROF== Profiling' "$OUT/ncu_run.tmp") kernels profiled"
tail -5 "$OUT/ncu_run.tmp" | tee -a "$OUT/$CALL.log"; rm -f "$OUT/ncu_run.tmp"
left "details page" && { ncu --import "$OUT/grad.ncu-rep" --page details > "$OUT/grad_details.txt" 2>&1; log "details rc=$?"; }
left "source page" && { ncu --import "$OUT/grad.ncu-rep" --page source --csv --print-source cuda,sass \
  > "$OUT/grad_source.csv" 2>&1; log "source page rc=$? $(wc -l < "$OUT/grad_source.csv") lines"; }
ls -la "$OUT" | tee -a "$OUT/$CALL.log"
log "done"
