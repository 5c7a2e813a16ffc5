#!/usr/bin/env bash
# gpu_branches.sh -- on the GPU machine, validates and times the kernel lab of every tree
# snapshot under .branches/ (tools/snapshot_branches.sh) next to the working tree's own:
# one lab build each (in parallel), then, correctness first for every tree, `lab check`
# against the float64 oracle (variant 3, and variant 5 = v3 saving for backward where the
# tree's lab has it) and racecheck on a small problem; then medians of 10 at the four
# benchmark shapes; then the per-kernel profile at 4 x 4096, n = 2 and the A/Bs a tree's
# switches ask for (found by grepping its kernels): the checks once more with float32
# chunk states (GDP_CUDA_V3_STATE=f32) and in the switches' compare modes (old and new
# kernels byte-identical), the saving pass's BV, GDP_CUDA_V3_GRAD_AHEAD; the settled
# switches' timing A/Bs with SETTLED_AB=1.  Every stage after the
# builds is skipped once BUDGET_S (default 540) seconds have passed, so the call ends
# inside the device's 10-minute limit with what it has.  SKIP_MAIN=1 leaves the working
# tree's own lab out (another script checked it); SKIP_BUILD=1 takes the labs already
# built in /tmp/lab-<name> (tools/gpu_session.sh builds them while it works).  Run from
# the repository root:
#   source .devbundle/env.sh && OUT=$OUT bash tools/gpu_branches.sh      (carry .branches)
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-540}
root=$PWD
t0=$(date +%s)
LOG=$OUT/branches.log
say() { echo "$*" | tee -a "$LOG"; }
left() { [ $(( $(date +%s) - t0 )) -lt "$BUDGET_S" ] || { say "[$(( $(date +%s) - t0 ))s] out of time: skipped $*"; return 1; }; }
trees=()
[ "${SKIP_MAIN:-0}" = 1 ] || trees+=("$root")
for d in "$root"/.branches/*/; do [ -d "$d/kernels" ] && trees+=("${d%/}"); done
name() { [ "$1" = "$root" ] && echo main || basename "$1"; }
lab() { echo "/tmp/lab-$(name "$1")/lab"; }
# variants a tree's lab knows: 5 where the lab has the saving forward
variants() { if grep -q "forward_v3_save" "$1/kernels/bench/gdp_cuda_lab.cu" 2>/dev/null; then echo "v3 v5"; else echo v3; fi; }
# ab_profile PATTERN SHAPES SETTING...: one profiled call (GDP_CUDA_PROFILE=1) of tree $t's
# lab $L per setting and shape, the lines matching PATTERN logged as [LABEL shape]; SHAPES
# separated by '|'; a SETTING is "LABEL" or "LABEL ENV=value ..." (the env it runs under).
ab_profile() {
  local pat=$1 shapes=$2 setting label s; shift 2
  for setting in "$@"; do
    label=${setting%% *}
    left "$label" || return
    IFS='|'; for s in $shapes; do
      IFS=' '
      env ${setting#"$label"} GDP_CUDA_PROFILE=1 timeout 30 $L bench $s $(variants "$t") --reps 2 2>&1 | grep -E "$pat" | grep -v " 0.0000 ms" | sed "s/^/[$label $s] /" | tee -a "$LOG"
    done; IFS=' '
  done
}
# check_with TAG SUFFIX ENV=value...: tree $t's `lab check` under ENV, logged to
# $OUT/check_<tree>_SUFFIX.log; its verdict (and any FAIL lines) as [TAG].
check_with() {
  local tag=$1 log="$OUT/check_${n}_$2.log"; shift 2
  # each takes ~15-60 s: past the budget they are skipped too (session 12's call 1 ran
  # them all after its budget and hit the device's 600 s limit)
  left "[$tag] check" || return 1
  env "$@" timeout 120 $L check $(variants "$t") > "$log" 2>&1
  say "[$tag] check rc=$? $(grep -E 'check:' "$log" | tail -1)"
  grep -E "FAIL" "$log" | head -5 | tee -a "$LOG"
}
# same_bits VAR=value FILE: where tree $t's kernels/cuda/FILE reads VAR, `lab check` once
# more with VAR=value; its per-run error lines must equal the default check's
# ($OUT/check_<tree>.log) digit for digit.
same_bits() {
  local var=${1%%=*}
  grep -q "\"$var\"" "$t/kernels/cuda/$2" || return 0
  local sfx=${var#GDP_CUDA_V3_}_${1#*=}
  local log="$OUT/check_${n}_$sfx.log"
  check_with "${1#GDP_CUDA_V3_}" "$sfx" "$1" || return 0
  if diff <(grep -E "^(chunk|v3|v5)" "$OUT/check_$n.log") <(grep -E "^(chunk|v3|v5)" "$log") > "$log.diff"; then
    say "[${1#GDP_CUDA_V3_}] errors identical to the default's"
  else
    say "[${1#GDP_CUDA_V3_}] errors DIFFER from the default's ($(grep -c '^<' "$log.diff") lines; $log.diff)"
  fi
}
build_all() {
  for t in "${trees[@]}"; do
    ( cd "$t" && bash "$root/tools/gpu_lab_build.sh" "/tmp/lab-$(name "$t")" > "$OUT/build_$(name "$t").log" 2>&1 ) &
  done
  wait
}
if [ "${BUILD_ONLY:-0}" = 1 ]; then build_all; exit 0; fi
[ "${SKIP_BUILD:-0}" = 1 ] || build_all
say "[$(( $(date +%s) - t0 ))s] builds done"
for t in "${trees[@]}"; do
  n=$(name "$t"); L=$(lab "$t")
  say "===== $n $(cut -c1-10 "$t/COMMIT" 2>/dev/null) check ($(variants "$t"))"
  [ -x "$L" ] || { say "BUILD FAILED"; continue; }
  left "check $n" || break
  timeout 120 $L check $(variants "$t") > "$OUT/check_$n.log" 2>&1
  say "check rc=$? $(grep -E 'check:' "$OUT/check_$n.log" | tail -1)"
  grep -E "FAIL" "$OUT/check_$n.log" | head -5 | tee -a "$LOG"
  timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 2 $(variants "$t") --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | tee -a "$LOG"
  # named barriers (bar.sync with an id) inside a block: synccheck too
  if grep -q 'bar.sync 1' "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    timeout 90 compute-sanitizer --tool synccheck $L bench 1 300 2 v3 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[synccheck] /" | tee -a "$LOG"
  fi
  # a prep with two W/U phases (GDP_CUDA_V3_PREP_WU): every prep call of the check runs
  # both and fails unless their panels are byte-identical
  if grep -q GDP_CUDA_V3_PREP_WU "$t/kernels/cuda/gdp_fwd_v3.cu"; then
    check_with PREP_WU=compare wu GDP_CUDA_V3_PREP_WU=compare
  fi
  # chunk states between the kernels: bf16 (the default for bf16 problems since session
  # 5) or float32 (GDP_CUDA_V3_STATE=f32, kept for A/B): the check once more in float32
  if grep -q GDP_CUDA_V3_STATE "$t/kernels/cuda/gdp_fwd_v3.cu"; then
    check_with STATE=f32 s32 GDP_CUDA_V3_STATE=f32
  fi
  # dstate / the recompute's state pass with a new schedule (GDP_CUDA_V3_DSTATE,
  # GDP_CUDA_V3_STATES): =compare runs the old and the new kernel and fails unless their
  # outputs are byte-identical
  if grep -q GDP_CUDA_V3_DSTATE "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    for st in f32 bf16; do
      check_with "DSTATE=compare STATE=$st" dstate_$st GDP_CUDA_V3_STATE=$st GDP_CUDA_V3_DSTATE=compare GDP_CUDA_V3_STATES=compare
    done
  fi
  # dg's P-column sums from the rounded Ps'' (GDP_CUDA_V3_PCOL=f32: the float sums): the
  # check once more the old way, for the errors side by side (check_<tree>_pcol.log)
  if grep -q GDP_CUDA_V3_PCOL "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    check_with PCOL=f32 pcol GDP_CUDA_V3_PCOL=f32
  fi
  # switches that keep an old schedule with the same bits (session 5's lab/next3: the prep's
  # block order / W/U owners, grad_state's dH^T copy, grad_wy's schedule): the check once
  # more on the old path, its error lines diffed against the default run's
  same_bits GDP_CUDA_V3_PREP=old gdp_fwd_v3.cu
  same_bits GDP_CUDA_V3_GSPIPE=old gdp_bwd_v3.cu
  same_bits GDP_CUDA_V3_WY=old gdp_bwd_v3.cu
  same_bits GDP_CUDA_V3_PASSES=old gdp_fwd_v3.cu
  same_bits GDP_CUDA_V3_PASSES=ks2 gdp_fwd_v3.cu
  # the recompute's two state passes on two streams (GDP_CUDA_V3_FORK=1): same kernels,
  # disjoint outputs, so the same bits; memcheck with the passes overlapping
  if grep -q '"GDP_CUDA_V3_FORK"' "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    same_bits GDP_CUDA_V3_FORK=1 gdp_bwd_v3.cu
    GDP_CUDA_V3_FORK=1 timeout 60 compute-sanitizer --tool memcheck $L bench 1 300 2 v3 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[FORK=1 memcheck] /" | tee -a "$LOG"
  fi
  # E3 (lab/e3): grad_state as dstate's programmatic dependent on per-(chunk, head) ready
  # counters (GDP_CUDA_V3_OVERLAP; opt-in since session 7: slower on the H200): the same kernels'
  # arithmetic, so the check's error lines must be identical with =0 (today's path) and =1
  # (on wherever it can be, also in place of the small problems' automatic fork of the
  # recompute's passes); memcheck / racecheck with it on, and with the L2 prefetch of
  # a later block (its slot -> chunk mapping follows the new order).  A counter bug traps
  # (__trap after ~2^24 polls: "unspecified launch failure") instead of hanging.
  if grep -q '"GDP_CUDA_V3_OVERLAP"' "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    same_bits GDP_CUDA_V3_OVERLAP=0 gdp_bwd_v3.cu
    same_bits GDP_CUDA_V3_OVERLAP=1 gdp_bwd_v3.cu
    # the fork beside a 2-stage dstate (fork_mode 2; by default only at 1 x 32768 n = 2):
    # =2 forces it on the check's problems
    same_bits GDP_CUDA_V3_FORK=2 gdp_bwd_v3.cu
    # with main's opt-in programmatic launches at every boundary as well (dstate then
    # waits for the states pass before its trigger; grad_state's overlap kernel skips
    # its wait)
    if grep -q GDP_CUDA_PDL "$t/kernels/cuda/common.cuh" 2>/dev/null; then
      check_with "OVERLAP=1 PDL=1" ovl_pdl GDP_CUDA_V3_OVERLAP=1 GDP_CUDA_PDL=1
      if diff <(grep -E "^(chunk|v3|v5)" "$OUT/check_$n.log") <(grep -E "^(chunk|v3|v5)" "$OUT/check_${n}_ovl_pdl.log") > "$OUT/check_${n}_ovl_pdl.diff"; then
        say "[OVERLAP=1 PDL=1] errors identical to the default's"
      else
        say "[OVERLAP=1 PDL=1] errors DIFFER from the default's ($OUT/check_${n}_ovl_pdl.diff)"
      fi
    fi
    GDP_CUDA_V3_FORK=2 timeout 60 compute-sanitizer --tool memcheck $L bench 1 300 2 v3 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[FORK=2 memcheck] /" | tee -a "$LOG"
    GDP_CUDA_V3_OVERLAP=1 timeout 60 compute-sanitizer --tool memcheck $L bench 1 300 2 $(variants "$t") --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[OVERLAP=1 memcheck] /" | tee -a "$LOG"
    GDP_CUDA_V3_OVERLAP=1 timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 2 $(variants "$t") --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | sed "s/^/[OVERLAP=1 racecheck] /" | tee -a "$LOG"
    GDP_CUDA_V3_OVERLAP=1 GDP_CUDA_V3_GS_AHEAD=5 timeout 60 compute-sanitizer --tool memcheck $L bench 2 300 2 $(variants "$t") --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[OVERLAP=1 GS_AHEAD=5 memcheck] /" | tee -a "$LOG"
  fi
  # the two-warp state pass with four pairs per block (BV = 64)
  if grep -q '"GDP_CUDA_V3_PASSES"' "$t/kernels/cuda/gdp_fwd_v3.cu"; then
    for nn in 1 2; do
      GDP_CUDA_V3_PASSES=ks2 GDP_CUDA_V3_BV=64 timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 $nn v3 --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | sed "s/^/[PASSES=ks2 BV=64 n=$nn racecheck] /" | tee -a "$LOG"
    done
    GDP_CUDA_V3_PASSES=ks2 timeout 60 compute-sanitizer --tool memcheck $L bench 1 300 2 v3 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[PASSES=ks2 memcheck] /" | tee -a "$LOG"
  fi
  # D's rounding residual in the state update (GDP_CUDA_V3_DLO=1, lab/dgk; changes dg,
  # ht and the saving forward's o): the check with it, for the errors side by side
  if grep -q '"GDP_CUDA_V3_DLO"' "$t/kernels/cuda/gdp_fwd_v3.cu"; then
    check_with DLO=1 dlo GDP_CUDA_V3_DLO=1
    GDP_CUDA_V3_DLO=1 timeout 60 compute-sanitizer --tool racecheck $L bench 1 300 2 $(variants "$t") --reps 1 2>&1 | grep -E "RACECHECK SUMMARY" | sed "s/^/[DLO=1 racecheck] /" | tee -a "$LOG"
  fi
  # grad_wy's old and new kernels on the same inputs (dk, dv byte-identical; dbeta, dg
  # within a bf16 step: shared-memory atomics)
  if grep -q '"GDP_CUDA_V3_WY"' "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    check_with WY=compare wycmp GDP_CUDA_V3_WY=compare
  fi
  # a gradient kernel that prefetches a later block's inputs (GDP_CUDA_V3_GS_AHEAD): its
  # addresses, at a distance the small problem reaches (off by default)
  if grep -q GDP_CUDA_V3_GS_AHEAD "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    GDP_CUDA_V3_GS_AHEAD=1 timeout 60 compute-sanitizer --tool memcheck $L bench 1 300 2 v3 --reps 1 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/[GS_AHEAD=1] /" | tee -a "$LOG"
  fi
done
for t in "${trees[@]}"; do
  n=$(name "$t"); L=$(lab "$t"); [ -x "$L" ] || continue
  left "bench $n" || break
  say "===== $n bench"
  for s in "4 4096 1" "4 4096 2" "4 4096 3" "1 32768 2"; do
    timeout 40 $L bench $s $(variants "$t") --reps 10 2>&1 | grep -E "chunk_v3|v3_save|saved" | sed "s/^/[$s] /" | tee -a "$LOG"
  done
done
for t in "${trees[@]}"; do
  n=$(name "$t"); L=$(lab "$t"); [ -x "$L" ] || continue
  left "profile $n" || break
  say "===== $n profile 4 4096 2"
  GDP_CUDA_PROFILE=1 timeout 30 $L bench 4 4096 2 v3 --reps 2 2>&1 | grep -E "^    " | grep -v " 0.0000 ms" | tee -a "$LOG"
  # the forked state passes: medians (a profiled call runs them in order), unset / =1
  if grep -q '"GDP_CUDA_V3_FORK"' "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    for s in "1 32768 2" "4 4096 2" "1 32768 1" "4 4096 1" "4 4096 3"; do
      left "fork $s" || break
      for fk in 0 1 0 1; do
        GDP_CUDA_V3_FORK=$fk timeout 40 $L bench $s v3 --reps 10 2>&1 | grep -E "chunk_v3" | sed "s/^/[FORK=$fk $s] /" | tee -a "$LOG"
      done
    done
  fi
  # E3 overlap (lab/e3): fwd+bwd medians, =0 (today) / =1 (forced; off anyway in a forked
  # recompute); unset is on where the pair fits (4 x 4096 n = 2 among these)
  if grep -q '"GDP_CUDA_V3_OVERLAP"' "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    for s in "4 4096 2" "4 4096 1" "4 4096 3" "1 32768 2" "8 2048 1"; do
      left "overlap $s" || break
      for ov in 0 1 0 1; do
        GDP_CUDA_V3_OVERLAP=$ov timeout 40 $L bench $s $(variants "$t") --reps 10 2>&1 | grep -E "chunk_v3|v3_save|saved" | sed "s/^/[OVERLAP=$ov $s] /" | tee -a "$LOG"
      done
    done
  fi
  # the two-warp state passes (plain: lab/passes5; saving: lab/passes6), old / new / everywhere
  grep -q '"GDP_CUDA_V3_PASSES"' "$t/kernels/cuda/gdp_fwd_v3.cu" &&
    ab_profile "chunk_v3 |v3_saved |state\+output|saving h" "1 32768 2|1 32768 1|4 4096 2|4 4096 1" \
      "PASSES=old GDP_CUDA_V3_PASSES=old" "PASSES=default" "PASSES=ks2 GDP_CUDA_V3_PASSES=ks2"
  # The switches settled in sessions 4 and 5 (state format, W/U phase, dstate schedule,
  # prep solve: results/cuda/session5/6_ab/ has their library A/B): timed again only with
  # SETTLED_AB=1.
  if [ "${SETTLED_AB:-0}" = 1 ]; then
    grep -q GDP_CUDA_V3_STATE "$t/kernels/cuda/gdp_fwd_v3.cu" &&
      ab_profile "state|dstate|gradients" "4 4096 1|4 4096 2|4 4096 3" \
        "STATE=f32 GDP_CUDA_V3_STATE=f32" "STATE=bf16 GDP_CUDA_V3_STATE=bf16"
    grep -q GDP_CUDA_V3_PREP_WU "$t/kernels/cuda/gdp_fwd_v3.cu" &&
      ab_profile "chunk_v3 |v3_saved |prep" "4 4096 1|4 4096 2|4 4096 3" \
        "PREP_WU=old GDP_CUDA_V3_PREP_WU=old" "PREP_WU=new GDP_CUDA_V3_PREP_WU=new"
    grep -q GDP_CUDA_V3_DSTATE "$t/kernels/cuda/gdp_bwd_v3.cu" &&
      ab_profile "chunk_v3 |v3_saved |state gradients|states v3" "4 4096 1|4 4096 2|4 4096 3|1 32768 2" \
        "DSTATE=old GDP_CUDA_V3_DSTATE=old GDP_CUDA_V3_STATES=old" "DSTATE=default"
    grep -q GDP_CUDA_V3_PREP_SOLVE "$t/kernels/cuda/gdp_fwd_v3.cu" &&
      ab_profile "prep" "4 4096 1|4 4096 2|4 4096 3" "PREP_SOLVE=rows GDP_CUDA_V3_PREP_SOLVE=rows" "PREP_SOLVE=default"
  fi
  # session 5's switches: old against new, the kernel each one touches
  grep -q '"GDP_CUDA_V3_PREP"' "$t/kernels/cuda/gdp_fwd_v3.cu" &&
    ab_profile "prep" "4 4096 1|4 4096 2|4 4096 3" "PREP=old GDP_CUDA_V3_PREP=old" "PREP=default"
  grep -q '"GDP_CUDA_V3_GSPIPE"' "$t/kernels/cuda/gdp_bwd_v3.cu" &&
    ab_profile "state part" "4 4096 1|4 4096 2|4 4096 3" "GSPIPE=old GDP_CUDA_V3_GSPIPE=old" "GSPIPE=default"
  grep -q '"GDP_CUDA_V3_WY"' "$t/kernels/cuda/gdp_bwd_v3.cu" &&
    ab_profile "WY part" "4 4096 1|4 4096 2|4 4096 3" "WY=old GDP_CUDA_V3_WY=old" "WY=default"
  grep -q '"GDP_CUDA_V3_DLO"' "$t/kernels/cuda/gdp_fwd_v3.cu" &&
    ab_profile "chunk_v3 |v3_saved |states v3|saving h" "4 4096 2|4 4096 1" "DLO=1 GDP_CUDA_V3_DLO=1" "DLO=default"
  if [ "$(variants "$t")" != v3 ] && left "bv64 n=3"; then
    # the saving pass's value-block width at n = 3 (plain pass's choice vs 64)
    GDP_CUDA_V3_BV=64 GDP_CUDA_PROFILE=1 timeout 30 $L bench 4 4096 3 v5 --reps 2 2>&1 | grep -E "v3_saved |state" | sed "s/^/[BV=64 4 4096 3] /" | tee -a "$LOG"
  fi
  if grep -q GDP_CUDA_V3_GRAD_AHEAD "$t/kernels/cuda/gdp_bwd_v3.cu"; then
    for ga in 0 8 16 33 66 auto; do
      left "grad-ahead $ga" || break
      for s in "4 4096 2" "4 4096 3"; do
        GDP_CUDA_V3_GRAD_AHEAD=$ga timeout 30 $L bench $s v3 --reps 10 2>&1 | grep -E "chunk_v3" | sed "s/^/[ahead=$ga $s] /" | tee -a "$LOG"
      done
    done
  fi
done
say "[$(( $(date +%s) - t0 ))s] done"
