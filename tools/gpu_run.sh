#!/usr/bin/env bash
# gpu_run.sh -- the one script a GPU-machine call runs for the GDP CUDA kernels:
# build the kernel lab, validate every variant against the float64 oracle, time them
# next to fla's chunk_gated_delta_product in the same call, and write logs and JSON
# under $OUT (at most 8 files come back).
#
#   source .devbundle/env.sh && tools/gpu_run.sh [full|quick] [extra steps...]
#     full   : check (all shapes), bench at the 4 anchor shapes, fla, summary
#     quick  : a shorter check, bench at 4x4096 n=2 only, fla at that shape
#   extra steps: ceilings (torch copy + bf16 matmul), sanitizer (memcheck + racecheck
#   on a small problem), ctest (core/tests/test_cuda_tensor via CMake, if it builds),
#   profile (per-kernel times), norec (no recurrent variant in bench)
# Run from the repository root.  Env: OUT (output folder; default ./gpu_out).
set -u
MODE=${1:-full}
shift || true
STEPS=" $* "
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
: >"$LOG"
say() { echo "$@" | tee -a "$LOG"; }
t0=$(date +%s)
stamp() { say "--- [$(( $(date +%s) - t0 ))s] $*"; }

stamp "gpu_run.sh $MODE $STEPS on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
nvcc --version | tail -1 | tee -a "$LOG"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/git HEAD /' | tee -a "$LOG"

# ---------------------------------------------------------------- build (nvcc directly:
# only the lab's own sources, so half-written files elsewhere cannot break it)
B=build-gpulab
stamp "build"
bash tools/gpu_lab_build.sh $B 2>&1 | tee -a "$LOG"
[ -x $B/lab ] || { stamp "BUILD FAILED"; exit 1; }
LAB=$B/lab

stamp "selftest (CPU mirror of the chunk algebra vs the oracle)"
$LAB selftest 2>&1 | tail -3 | tee -a "$LOG"

# ---------------------------------------------------------------- validation
stamp "check"
if [ "$MODE" = quick ]; then
  timeout 200 $LAB quick 2>&1 | tee "$OUT/check.log" | grep -E "!|check:|device:" | tee -a "$LOG"
else
  timeout 240 $LAB check 2>&1 | tee "$OUT/check.log" | grep -E "!|check:|device:" | tee -a "$LOG"
fi

if [[ "$STEPS" == *" sanitizer "* ]]; then
  stamp "compute-sanitizer memcheck + racecheck (small problem)"
  {
    timeout 150 compute-sanitizer --tool memcheck --leak-check no $LAB small 2>&1 | tail -8
    timeout 150 compute-sanitizer --tool racecheck $LAB small 2>&1 | tail -6
  } | tee "$OUT/sanitizer.log" | tee -a "$LOG"
fi

if [[ "$STEPS" == *" ceilings "* ]]; then
  stamp "ceilings (torch)"
  python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import torch, statistics
def bench(fn, reps=10):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16); y = torch.empty_like(x)
ms = bench(lambda: y.copy_(x)); print(f"ceiling copy: {2 * x.numel() * 2 / ms / 1e9:.2f} TB/s (read+write, 1 GiB)")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
ms = bench(lambda: a @ b); print(f"ceiling bf16 matmul: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s (8192^3, random)")
EOF
fi

if [[ "$STEPS" == *" ctest "* ]]; then
  stamp "core/tests/test_cuda_tensor (CMake, GDP_CUDA=ON)"
  {
    cmake -S . -B build-gpu -DGDP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null 2>&1 \
      && cmake --build build-gpu -j16 --target test_cuda_tensor 2>&1 | grep -E "error|Error" | head -20 \
      && (cd . && ./build-gpu/test_cuda_tensor 2>&1 | tail -25)
    echo "test_cuda_tensor exit: $?"
  } 2>&1 | tee -a "$LOG"
fi

# ---------------------------------------------------------------- timing
if [ "$MODE" = quick ]; then SHAPES="4x4096x2"; else SHAPES="4x4096x2 4x4096x1 4x4096x3 1x32768x2"; fi
rm -f "$OUT/lab.jsonl"
stamp "bench (lab)"
for s in $SHAPES; do
  IFS=x read -r Bb Tt Nn <<<"$s"
  VAR="v1 v2"
  if [[ "$STEPS" == *" norec "* ]] || [ "$s" != "4x4096x2" ]; then VAR="v2"; fi
  if [[ "$STEPS" == *" profile "* ]]; then export GDP_CUDA_PROFILE=1; fi
  timeout 120 $LAB bench $Bb $Tt $Nn $VAR --reps 30 --json "$OUT/lab.jsonl" 2>&1 | tee -a "$OUT/bench.log" | tee -a "$LOG"
  unset GDP_CUDA_PROFILE
done
if [ "$MODE" != quick ]; then
  for bv in 32 16; do   # the value-block width the chooser did not pick, for comparison
    GDP_CUDA_BV=$bv timeout 60 $LAB bench 4 4096 2 v2 --reps 30 --json "$OUT/lab.jsonl" 2>&1 | grep -v "^device" | tee -a "$OUT/bench.log" | tee -a "$LOG"
  done
fi

stamp "fla (same shapes, same call)"
FLA_SHAPES=$(echo $SHAPES | tr ' ' ',')
# Triton's compile cache travels in .fla/triton_cache.tgz (fla's first compile costs minutes)
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR
[ -f .fla/triton_cache.tgz ] && tar -xzf .fla/triton_cache.tgz -C $TRITON_CACHE_DIR
PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.fla:${PYTHONPATH:-} timeout 300 python3 tools/fla_bench.py --shapes "$FLA_SHAPES" --reps 30 \
  >"$OUT/fla.json" 2>"$OUT/fla.err.txt"
tail -8 "$OUT/fla.err.txt" | tee -a "$LOG"
rm -f "$OUT/fla.err.txt"
if [[ "$STEPS" == *" savecache "* ]]; then
  tar -czf "$OUT/triton_cache.tgz" -C $TRITON_CACHE_DIR . && ls -la "$OUT/triton_cache.tgz" | tee -a "$LOG"
fi

stamp "summary"
python3 - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"
import json, sys, os
out = sys.argv[1]
fla = {}
try:
    for r in json.load(open(os.path.join(out, "fla.json")))["rows"]:
        fla[(r["B"], r["T"], r["n"])] = r
except Exception as e:
    print("no fla numbers:", e)
print(f"{'shape':>12} {'variant':>9} {'fwd ms':>8} {'fwd+bwd':>8} | {'fla fwd':>8} {'fla f+b':>8} | {'x fwd':>6} {'x f+b':>6}")
for line in open(os.path.join(out, "lab.jsonl")):
    r = json.loads(line)
    key = (r["B"], r["T"], r["n"])
    f = fla.get(key)
    ff = f"{f['fwd_ms']:8.3f} {f['fwdbwd_ms']:8.3f}" if f else f"{'-':>8} {'-':>8}"
    ratio = f"{f['fwd_ms'] / r['fwd_ms']:6.2f} {f['fwdbwd_ms'] / r['fwdbwd_ms']:6.2f}" if f else ""
    print(f"{r['B']}x{r['T']} n={r['n']} {r['variant']:>9} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} | {ff} | {ratio}")
EOF
stamp "done"
