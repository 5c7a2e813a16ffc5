#!/usr/bin/env bash
# gpu_ab.sh prepare REV | run [DIR] -- times the operator of an earlier commit against the
# working tree in one GPU call, interleaved (old, new, old, new), so that machine-to-machine
# drift cancels: the check that a refactor moved no number.
#
#   prepare REV  here, before the call: REV's tree into .ab/ (ignored; carry it with
#                .devbundle).
#   run [DIR]    on the GPU machine, after `source .devbundle/env.sh`: builds both (in
#                parallel), then bench_gdp ours-only at SHAPES (default the README's
#                recompute shapes) with --with-saving, twice each; rows prefixed old1, new1,
#                old2, new2 in DIR/ab.log (default $OUT).  The columns are bench_gdp's.
set -u
case ${1:-} in
prepare)
  rev=${2:?usage: tools/gpu_ab.sh prepare REV}
  rm -rf .ab && mkdir .ab && git archive "$rev" | tar -x -C .ab && rm -rf .ab/results &&
    git rev-parse --short "$rev" >.ab/REV && echo "gpu_ab: $(cat .ab/REV) in .ab/ ($(du -sh .ab | cut -f1))"
  exit
  ;;
run) ;;
*)
  echo "usage: tools/gpu_ab.sh prepare REV | run [DIR]" >&2
  exit 2
  ;;
esac
DIR=${2:-${OUT:-$PWD/gpu_out}}
mkdir -p "$DIR"
LOG=$DIR/ab.log
SHAPES=${SHAPES:-4x4096x2,4x4096x3,1x32768x2}
[[ -f .ab/REV ]] || { echo "gpu_ab: no .ab/REV: run 'tools/gpu_ab.sh prepare REV' first" >&2; exit 2; }
echo "# gpu_ab.sh run: old $(cat .ab/REV), new $(git rev-parse --short HEAD 2>/dev/null || echo 'working tree'), shapes $SHAPES" | tee "$LOG"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
(GDP_BUILD_DIR=/tmp/ab-new ./gdp build >"$DIR/build_new.log" 2>&1; echo "new build rc=$?" >>"$LOG") &
(cd .ab && GDP_BUILD_DIR=/tmp/ab-old ./gdp build >"$DIR/build_old.log" 2>&1; echo "old build rc=$?" >>"$LOG") &
wait
BENCH="experiments/bench_gdp.lua --device cuda --dtype bf16 --H 16 --K 128 --V 128 --shapes $SHAPES --with-saving --repeat 30"
for r in 1 2; do
  for t in old new; do
    echo "== $t$r: ./gdp $BENCH" >>"$LOG"
    if [[ $t == old ]]; then (cd .ab && GDP_BUILD_DIR=/tmp/ab-old ./gdp $BENCH); else GDP_BUILD_DIR=/tmp/ab-new ./gdp $BENCH; fi 2>&1 |
      grep -E "^# (BxTxn|shape) |^  [0-9]" | sed "s/^/$t$r /" | tee -a "$LOG"
  done
done
