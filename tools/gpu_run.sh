#!/usr/bin/env bash
# gpu_run.sh check|bench|flawarm|profile|study|census|cp [DIR] -- the device run: on the GPU machine, from the
# repository root, after `source .devbundle/env.sh`.  Logs go to DIR (default $OUT, else
# ./gpu_out); each mode keeps to BUDGET_S seconds (default 540, inside a 10-minute call),
# skipping a late step with a line saying so rather than running past it.
#
#   check    ./gdp build, ./gdp test --quick (every suite; on a GPU the cuda ctests, the
#            lab check dev.lab_check and the #gpu specs among them; the sanitizer pass is
#            CPU-only and left to CI), the cuda comm and CP specs over a one-rank NCCL
#            communicator (GDP_COMM_NCCL=2), check_reference --device cuda in bf16, f32 and
#            bf16 --save-for-backward, then compute-sanitizer memcheck and racecheck on
#            the lab's small problems and on the mixer and model layer kernels' C tests,
#            memcheck on the tensor ops' C test.                              ~7 minutes
#   bench    ./gdp build, then bench_gdp --against-fla --set issue22 (the README's
#            command: 11 shapes, 4 head sizes, one packed), plain and saving for backward
#            (JSON in DIR/bench_gdp.json).  fla's source in .fla/ (carry it); a warm
#            Triton cache in .fla/triton_cache.tgz saves fla's minutes of first compile
#            and autotune per head size, and SAVE_CACHE=1 writes one to DIR
#            (in parts of 15 MB: .fla/triton_cache.tgz.00, .01, ... are read back).  ~5 minutes
#            with a warm cache; a cold one takes longer than the budget: fill it first
#            with flawarm.
#   flawarm  fla_bench.py alone at the same shapes (one repeat, no queued timing, no
#            build), to fill the Triton cache (compiled kernels, autotune choices) that
#            bench then finds warm.  Stopped at the budget it keeps what it finished, so
#            the next call carries on: on the same machine (TRITON_CACHE_DIR, default
#            /tmp/triton_cache, stays) or with SAVE_CACHE=1 and the tgz carried back.
#            "fla warm" once every shape ran.               up to the budget per call
#   profile  ./gdp build, the lab's medians and per-kernel times (GDP_CUDA_PROFILE=1) at
#            the same shapes, the kernels' registers, stack and local memory (cuobjdump),
#            and where ncu is found, Nsight Compute's speed of light, launch statistics
#            and occupancy on one forward+backward (NCU_SHAPE, default "4 4096 2";
#            NCU_VARIANT, default chunk_saving).  KERNELS=<ncu regex> adds the full set with
#            source counters for those kernels: the details page, the per-line source page
#            and tools/ncu_lines.py's summary of it (the report itself stays in
#            NCU_DIR, default /tmp/gdp-ncu, too large to come back).       ~3-6 minutes
#   study    ./gdp build, then the state-tracking grid (experiments/state_tracking.lua
#            --device cuda --dtype bf16, STUDY_ARGS added: e.g. "--tasks S3 --seeds 1")
#            with --time_budget set to what is left of BUDGET_S less STUDY_SLACK (default
#            40 s: a config running at the budget stops at its next evaluation, 100 steps
#            or ~3 s on, with a checkpoint that the resume continues), resuming STUDY_RESUME (a run folder
#            carried back from an earlier call, e.g. results/...) where given; the run
#            folder comes back as DIR/state_tracking_run.tgz, to commit and to resume from.
#   census   ./gdp build, then Nsight Compute's GPU time of every kernel of state-tracking
#            training steps (experiments/state_tracking.lua --speed: 3 warm-up and 4 timed
#            steps of one n_h; CENSUS_ARGS, default "--tasks S3 --nh 2 --beta_max 2"),
#            summed per kernel by tools/ncu_census.py into DIR/census.txt (ms per step).
#            The unprofiled step's time minus that sum is the GPU's idle time.  ~2 minutes
#   cp       issue 23's run, for nvidia-h200-x2 (one GPU per rank, NCCL; on one GPU the
#            two-rank gdp steps run host-staged and fla's two-rank anchors are skipped, the
#            log says so): ./gdp build; the cuda comm and CP specs at -np 2 (both modes'
#            equivalence with cp = 1, f32 and bf16, packed; a rank that disagrees ends every
#            rank with an error); bench_comm -np 2 (8 B to 256 MB, DIR/bench_comm.json); bench_cp at -np 1
#            (DIR/bench_cp1.json) and -np 2 against it (DIR/bench_cp2.json: 16384 and 4096
#            tokens per rank, n = 1, 2, both modes and targets, the stage profile); fla's
#            anchors (tools/fla_cp_bench.py: KCP and all-to-all around fla's operator) at
#            -np 1 and -np 2 (DIR/fla_cp1.json, fla_cp2.json).  fla's source in .fla/.  ~8 minutes
#
# Environment: GDP_BUILD_DIR as for ./gdp (default ./build), BUDGET_S, GDP_GIT_SHA (the
# tree's commit, for a copy without its history).  Exit status 3 when a step was skipped
# for time (the log names it), 1 when the build failed.
set -u
MODE=${1:-}
case $MODE in check | bench | flawarm | profile | study | census | cp) ;; *)
  echo "usage: tools/gpu_run.sh check|bench|flawarm|profile|study|census|cp [DIR]" >&2
  exit 2
  ;;
esac
DIR=${2:-${OUT:-$PWD/gpu_out}}
mkdir -p "$DIR"
BUILD=${GDP_BUILD_DIR:-$PWD/build}
LAB=$BUILD/dev/gdp_cuda_lab
LOG=$DIR/run.log
BUDGET_S=${BUDGET_S:-540}
SHAPES="4x4096x1,4x4096x2,4x4096x3,1x32768x2" # the lab's shapes for profile (issue 22's first four)
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$LOG"; }
# left NEED WHAT: true when a step of about NEED seconds still ends inside the budget.
left() {
  local need=$1
  shift
  (($(date +%s) - t0 + need <= BUDGET_S)) && return 0
  say "out of time: skipped $* (needs ~${need}s)"
  skipped=$((skipped + 1))
  return 1
}
skipped=0
# run NAME TIMEOUT CMD...: CMD's output to DIR/NAME.log (appended), its status to run.log.
run() {
  local name=$1 limit=$2 rc
  shift 2
  echo "== $*" >>"$DIR/$name.log"
  timeout -k 10 "$limit" "$@" >>"$DIR/$name.log" 2>&1
  rc=$?
  ((rc == 124 || rc == 137)) && say "$name: timed out after ${limit}s"
  say "$name rc=$rc: $*"
  return $rc
}

say "gpu_run.sh $MODE on $(hostname), git ${GDP_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo '?')}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader 2>&1 | tee -a "$LOG"
nvcc --version 2>/dev/null | tail -1 | tee -a "$LOG"

if [[ $MODE != flawarm ]]; then
  run build 400 ./gdp build || {
    tail -20 "$DIR/build.log" | tee -a "$LOG"
    exit 1
  }
fi

if [[ $MODE == check ]]; then
  if left 240 "./gdp test --quick"; then
    run test 300 ./gdp test --quick
    grep -E "dev\.|c\.test_cuda|tests passed|^  .* (ok|FAILED)$|passed, [0-9]+ failed" "$DIR/test.log" | tee -a "$LOG"
  fi
  # NCCL on one GPU: a one-rank NCCL communicator (GDP_COMM_NCCL=2) through the cuda comm
  # and CP specs (ranks sharing the GPU above use host staging)
  if left 60 "the NCCL path (one rank)"; then
    run nccl 90 env GDP_COMM_NCCL=2 GDP_NUM_THREADS=1 LUA_PATH="$PWD/lua/?.lua;$PWD/lua/?/init.lua;$BUILD/lua/?.lua;${LUA_PATH:-;}" \
      GDP_LIB="$BUILD/libgdp.so" mpirun -np 1 busted --lua=luajit --tags=mpi spec/comm_cuda_spec.lua spec/cp_cuda_spec.lua
    grep -E "PASSED|FAILED|nccl" "$DIR/nccl.log" | tail -3 | tee -a "$LOG"
  fi
  for args in "bf16" "f32" "bf16 --save-for-backward"; do
    left 40 "check_reference $args" || break
    # shellcheck disable=SC2086 # the dtype and its flag are two words
    run check_reference 90 ./gdp experiments/check_reference.lua --device cuda --dtype $args
    tail -1 "$DIR/check_reference.log" | tee -a "$LOG"
  done
  for n in 2 3; do
    for tool in memcheck racecheck; do
      left 60 "compute-sanitizer $tool n=$n" || break 2
      run sanitizer 90 compute-sanitizer --tool $tool "$LAB" bench 1 300 $n chunk chunk_saving --reps 1
      grep -E "(ERROR|RACECHECK) SUMMARY" "$DIR/sanitizer.log" | tail -1 | tee -a "$LOG"
    done
  done
  # the mixer kernels (conv1d, output norm, input stage) and the model layer ops
  # (embedding, cross-entropy, their deferred index checks) through their C tests
  for t in test_cuda_mixer test_cuda_nn; do
    for tool in memcheck racecheck; do
      left 40 "compute-sanitizer $tool on $t" || break 2
      run sanitizer 60 compute-sanitizer --tool $tool "$BUILD/$t"
      grep -E "(ERROR|RACECHECK) SUMMARY" "$DIR/sanitizer.log" | tail -1 | tee -a "$LOG"
    done
  done
  # the tensor ops (copies, fills, row paths, sums, matmuls); its out-of-memory checks
  # fail allocations on purpose (API errors not reported) and its timer bounds mean
  # nothing under the sanitizer (GDP_TEST_NO_TIMINGS)
  if left 60 "compute-sanitizer memcheck on test_cuda_tensor"; then
    GDP_TEST_NO_TIMINGS=1 run sanitizer 90 compute-sanitizer --tool memcheck --leak-check full \
      --report-api-errors no "$BUILD/test_cuda_tensor"
    grep -E "ERROR SUMMARY|LEAK SUMMARY|passed" "$DIR/sanitizer.log" | tail -3 | tee -a "$LOG"
  fi
fi

if [[ $MODE == bench || $MODE == flawarm ]]; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
  mkdir -p "$TRITON_CACHE_DIR"
  # the cache comes in parts (triton_cache.tgz.00, .01, ...: the device tool returns files of
  # at most 16 MiB) or whole
  if compgen -G ".fla/triton_cache.tgz.[0-9]*" >/dev/null; then
    cat .fla/triton_cache.tgz.[0-9]* | tar -xz -C "$TRITON_CACHE_DIR"
  elif [[ -f .fla/triton_cache.tgz ]]; then
    tar -xzf .fla/triton_cache.tgz -C "$TRITON_CACHE_DIR"
  fi
fi

if [[ $MODE == flawarm ]]; then
  items=$(luajit -e "package.path = 'lua/?.lua;' .. package.path
    io.write(require('gdp.bench_shapes').SETS.issue22)")
  say "fla warm-up at $items"
  # --final-state as bench_gdp asks: fla compiles another kernel variant without it
  PYTHONPATH=$PWD/.fla${PYTHONPATH:+:$PYTHONPATH} timeout -k 10 $((BUDGET_S - ($(date +%s) - t0) - 30)) \
    python3 tools/fla_bench.py --shapes "$items" --reps 1 --warmup 1 --no-queued --final-state \
    >"$DIR/fla_warm.json" 2>"$DIR/fla_warm.log"
  rc=$?
  grep "^fla " "$DIR/fla_warm.log" | tee -a "$LOG"
  if ((rc == 0)); then say "fla warm: every shape ran"; else say "fla warm-up stopped (rc=$rc): call again to carry on"; fi
fi

if [[ $MODE == bench ]]; then
  if left 300 "bench_gdp --against-fla"; then
    say "bench_gdp --against-fla --set issue22"
    timeout -k 10 $((BUDGET_S - ($(date +%s) - t0) - 20)) \
      ./gdp experiments/bench_gdp.lua --device cuda --dtype bf16 --set issue22 --against-fla --with-saving \
      --repeat 30 --json >"$DIR/bench_gdp.json" 2>"$DIR/bench_gdp.log"
    say "bench_gdp rc=$?"
    grep -vE "^\s*$" "$DIR/bench_gdp.log" | tail -22 | tee -a "$LOG"
  fi
fi
if [[ ($MODE == bench || $MODE == flawarm) && ${SAVE_CACHE:-0} == 1 ]]; then
  tar -cz -C "$TRITON_CACHE_DIR" . | split -b 15M -d - "$DIR/triton_cache.tgz." &&
    say "Triton cache: $DIR/triton_cache.tgz.* ($(cat "$DIR"/triton_cache.tgz.* | wc -c) bytes; copy the parts to .fla/)"
fi

if [[ $MODE == profile ]]; then
  IFS=, read -ra shapes <<<"$SHAPES"
  for s in "${shapes[@]}"; do
    IFS=x read -r b t n <<<"$s"
    left 40 "lab bench at $s" || break
    run bench_lab 60 "$LAB" bench "$b" "$t" "$n" chunk chunk_saving --reps 30 --json "$DIR/lab.jsonl"
    grep -E "^  (chunk|chunk_saving) " "$DIR/bench_lab.log" | tail -2 | sed "s/^/[$s] /" | tee -a "$LOG"
    run profile 60 env GDP_CUDA_PROFILE=1 "$LAB" bench "$b" "$t" "$n" chunk chunk_saving
  done
  # Registers, stack and local memory (spills) per kernel, from the build's own objects.
  if command -v cuobjdump >/dev/null 2>&1; then
    cuobjdump --dump-resource-usage "$BUILD/libgdp_kernels_cuda.a" >"$DIR/resource_usage.txt" 2>&1
    say "cuobjdump rc=$?; kernels with stack or local memory:"
    awk '/Function/ { fn = $2 } /STACK:[1-9]|LOCAL:[1-9]/ { print fn, $0 }' "$DIR/resource_usage.txt" |
      head -20 | tee -a "$LOG"
  fi
  if command -v ncu >/dev/null 2>&1; then
    read -r b t n <<<"${NCU_SHAPE:-4 4096 2}"
    var=${NCU_VARIANT:-chunk_saving}
    if left 120 "ncu launch statistics"; then
      run ncu_launch 180 ncu --profile-from-start off --section SpeedOfLight --section LaunchStats \
        --section Occupancy "$LAB" bench "$b" "$t" "$n" "$var" --reps 1
      grep -E "^  [a-zA-Z_].*\(|Duration|Registers Per Thread|Dynamic Shared Memory Per Block|Theoretical Occupancy|Achieved Occupancy|Block Limit" \
        "$DIR/ncu_launch.log" | sed -E 's/ +/ /g' >"$DIR/ncu_launch_summary.txt"
      say "ncu launch summary: $(grep -c Duration "$DIR/ncu_launch_summary.txt") kernels in ncu_launch_summary.txt"
    fi
    if [[ -n ${KERNELS:-} ]] && left 240 "ncu source profile of $KERNELS"; then
      NCU_DIR=${NCU_DIR:-/tmp/gdp-ncu}
      mkdir -p "$NCU_DIR"
      run ncu_source 300 ncu --profile-from-start off --set full --import-source yes \
        --section SourceCounters --section WarpStateStats --kernel-name "regex:$KERNELS" \
        -f -o "$NCU_DIR/source" "$LAB" bench "$b" "$t" "$n" "$var" --reps 1
      ncu --import "$NCU_DIR/source.ncu-rep" --page details >"$DIR/ncu_details.txt" 2>&1
      ncu --import "$NCU_DIR/source.ncu-rep" --page source --csv --print-source cuda,sass >"$NCU_DIR/source.csv" 2>&1
      python3 tools/ncu_lines.py "$NCU_DIR/source.csv" >"$DIR/ncu_lines.txt" 2>&1
      say "ncu source: details, lines rc=$? (report and CSV in $NCU_DIR)"
    fi
  else
    say "ncu not found: no Nsight Compute sections"
  fi
fi
if [[ $MODE == study ]]; then
  slack=${STUDY_SLACK:-40}
  left_s=$((BUDGET_S - ($(date +%s) - t0) - slack))
  if ((left_s < 60)); then
    say "out of time: the study needs more than ${slack}s of slack and 60s to run"
    skipped=$((skipped + 1))
  else
    runs=$(mktemp -d)
    say "state_tracking grid for ${left_s}s${STUDY_RESUME:+, resuming $STUDY_RESUME}: ${STUDY_ARGS:-}"
    # shellcheck disable=SC2086 # STUDY_ARGS is a list of options
    GDP_RUNS_DIR=$runs timeout -k 10 $((left_s + slack)) ./gdp experiments/state_tracking.lua \
      --device cuda --dtype bf16 --time_budget "$left_s" ${STUDY_RESUME:+--resume "$STUDY_RESUME"} \
      ${STUDY_ARGS:-} >"$DIR/state_tracking.log" 2>&1
    say "state_tracking rc=$?"
    grep -E "^#|^  [A-Za-z]|not started|paused|run ok|failed" "$DIR/state_tracking.log" | tail -60 | tee -a "$LOG"
    run_dir=$(find "$runs" -mindepth 2 -maxdepth 2 -type d | head -1)
    if [[ -n $run_dir ]]; then
      tar -cz -C "$(dirname "$run_dir")" "$(basename "$run_dir")" >"$DIR/state_tracking_run.tgz"
      say "run folder: $DIR/state_tracking_run.tgz ($(basename "$run_dir"))"
    fi
  fi
fi
if [[ $MODE == census ]]; then
  if ! command -v ncu >/dev/null 2>&1; then
    say "ncu not found: no census"
  elif left 120 "the kernel census"; then
    # shellcheck disable=SC2086 # CENSUS_ARGS is a list of options
    run census_ncu 300 ncu --csv --clock-control none --metrics gpu__time_duration.sum \
      ./gdp experiments/state_tracking.lua --device cuda --dtype bf16 --speed --speed_steps 4 \
      ${CENSUS_ARGS:---tasks S3 --nh 2 --beta_max 2}
    python3 tools/ncu_census.py "$DIR/census_ncu.log" --per 7 >"$DIR/census.txt" 2>&1
    head -25 "$DIR/census.txt" | tee -a "$LOG"
  fi
fi
if [[ $MODE == cp ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  say "cp: $gpus GPU(s); two ranks $( ((gpus >= 2)) && echo "over NCCL" || echo "host-staged on one GPU")"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  specs_env=(env GDP_NUM_THREADS=1 LUA_PATH="$PWD/lua/?.lua;$PWD/lua/?/init.lua;$BUILD/lua/?.lua;${LUA_PATH:-;}"
    GDP_LIB="$BUILD/libgdp.so")
  if left 90 "the cuda comm and CP specs at -np 2"; then
    run cp_specs 150 "${specs_env[@]}" mpirun -np 2 busted --lua=luajit --tags=mpi spec/comm_cuda_spec.lua spec/cp_cuda_spec.lua
    grep -E "PASSED|FAILED|nccl" "$DIR/cp_specs.log" | sort | uniq -c | tee -a "$LOG"
  fi
  if left 60 "bench_comm at -np 2"; then
    run bench_comm 120 sh -c "mpirun -np 2 ./gdp experiments/bench_comm.lua --device cuda -b 8 -e 256M -f 4 --json > '$DIR/bench_comm.json'"
    tail -3 "$DIR/bench_comm.log" | tee -a "$LOG"
  fi
  if left 150 "bench_cp at -np 1 and -np 2"; then
    run bench_cp 120 sh -c "mpirun -np 1 ./gdp experiments/bench_cp.lua --json > '$DIR/bench_cp1.json'"
    run bench_cp 240 sh -c "mpirun -np 2 ./gdp experiments/bench_cp.lua --baseline '$DIR/bench_cp1.json' --json > '$DIR/bench_cp2.json'"
    grep -E "^# (target|layer|operator)|^ *(layer|operator) " "$DIR/bench_cp.log" | tail -24 | tee -a "$LOG"
  fi
  for np in 1 2; do
    if ((np == 2 && gpus < 2)); then
      say "fla_cp_bench at -np 2 skipped: NCCL needs one GPU per rank ($gpus here)"
      continue
    fi
    left 120 "fla_cp_bench at -np $np" || break
    run fla_cp 240 sh -c "PYTHONPATH='$PWD/.fla' mpirun -np $np python3 tools/fla_cp_bench.py --check > '$DIR/fla_cp$np.json'"
    grep "^fla_cp " "$DIR/fla_cp.log" | tail -8 | tee -a "$LOG"
  done
fi
# a step skipped for time is a run that did not check what it names: say so, exit 3
if ((skipped > 0)); then
  say "done, but $skipped step(s) skipped for time (above): raise BUDGET_S"
  exit 3
fi
say "done"
