# device_call.sh -- sourced by the per-call device scripts (results/cuda/session*/call*.sh)
# after they set CALL (the call's name): checks OUT and creates it, starts the clock, and
# defines
#   log MSG...   one line, prefixed with the seconds since the start, to stdout and to
#                $OUT/$CALL.log
#   left WHAT    true while the call is inside its budget (BUDGET_S seconds, default
#                540 of the device's 600), else logs "out of time: skipped WHAT" and
#                returns 1, so that a late step is skipped and the logs still come back
#   build_gdp_and_lab   (below)
set -u
OUT=${OUT:?set OUT: the device tool output folder}
CALL=${CALL:?set CALL before sourcing tools/device_call.sh}
mkdir -p "$OUT"
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/$CALL.log"; }
left() { [ $(( $(date +%s) - t0 )) -lt "${BUDGET_S:-540}" ] || { log "out of time: skipped $*"; return 1; }; }
#   build_gdp_and_lab   ./gdp build (log: $OUT/gdp_build.log, ending "rc=N") beside the
#                kernel lab's build (tools/gpu_lab_build.sh into /tmp/lab-main, log
#                $OUT/lab_build.log); sets L=/tmp/lab-main/lab
build_gdp_and_lab() {
  ( ./gdp build > "$OUT/gdp_build.log" 2>&1; echo "rc=$?" >> "$OUT/gdp_build.log" ) &
  bash tools/gpu_lab_build.sh /tmp/lab-main > "$OUT/lab_build.log" 2>&1
  wait
  L=/tmp/lab-main/lab
  log "builds done: gdp $(tail -1 "$OUT/gdp_build.log"), lab $([ -x "$L" ] && echo ok || echo FAILED)"
}
