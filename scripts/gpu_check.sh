#!/usr/bin/env bash
# The one command to run on a GPU machine: install the bundled wheels, print versions and the
# device, then, each stage under its own timeout and all inside --budget seconds, run
#   the recipe users train with (1.3b, packed documents, bf16, `auto` kernels) and it with fp8,
#   benchmarks/kernels.py, the Pallas attention's configurations swept against cuDNN
#   (benchmarks/flash_sweep.py) and the `auto` table they write, the XLA GPU flags peers set (each on
#   and off), the gpu-marked tests, meshtrain bench + its jax and PyTorch baselines at 125m and
#   1.3b (benchmarks/e2e.py), bf16 against fp8 at 350m, and 1.3b with the Pallas kernels;
# write every JSON line and the whole log under $OUT (a local folder when $OUT is unset) and
# print a summary table last.
#
#   bash scripts/gpu_check.sh [--budget SECONDS] [--dry-run] [--python PY] [--wheels DIR]
#                             [--no-profile] [--stages recipe_1.3b,...] [--resume RESULTS]
#
# Stages, in this order (most wanted first): recipe_1.3b, recipe_1.3b_fp8, kernels, flash_sweep,
# auto_table, xla_flags, gpu_tests, bench_1.3b (bench_1.3b_small if it fails), bench_125m,
# precision_350m_bf16, precision_350m_fp8, bench_1.3b_pallas. A 540 s budget may not reach the
# last ones: --resume with the results.jsonl of the earlier run (committed under
# benchmarks/results/) skips the stages that finished there, and --stages picks some.
#
# On a machine with an NVIDIA GPU, with the wheels of `make gpu-bundle` in .whl/ beside it:
#   bash scripts/gpu_check.sh --budget 540
#
# --dry-run: the same stages on CPU with tiny sizes (Pallas in interpret mode, the kernels
# benchmark's --selftest); tests/test_gpu_kit.py runs it in CI.
#
# Files under $OUT (at most 8, at most 2 folders deep, so they are easy to copy back):
#   gpu_check.log   everything every stage printed, prefixed by the stage
#   results.jsonl   every JSON line, and one {"stage", "status", "seconds"} line per stage
#   summary.txt     the table printed last
#   auto_table.json kernels/auto_table.json with this GPU's kernel rows merged in (commit the
#                   results under benchmarks/results/, then scripts/auto_table.py --merge)
#   trace_1.3b.*    the jax.profiler trace of three 1.3b steps (xplane.pb, Perfetto .json.gz)
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUDGET=540
DRY=0
PROFILE=1
PYTHON="${PYTHON:-python3}"
STAGES=""  # empty: all
RESUME=""  # an earlier run's results.jsonl: its finished stages are skipped
WHEELS="$ROOT/.whl"
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --python) PYTHON="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --no-profile) PROFILE=0; shift ;;
    --stages) STAGES=",$2,"; shift 2 ;;
    --resume) RESUME="$2"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_check: --budget needs whole seconds" >&2; exit 2 ;; esac
if [ -n "$RESUME" ] && [ ! -f "$RESUME" ]; then
  echo "gpu_check: --resume $RESUME: no such file (give an earlier run's results.jsonl)" >&2
  exit 2
fi

OUT="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
RESULTS="$OUT/results.jsonl"
SUMMARY="$OUT/summary.txt"
: > "$LOG"
: > "$RESULTS"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
RESERVE=10  # seconds kept for the summary

say() { echo "[gpu_check] $*" | tee -a "$LOG" >&2; }
record() {  # stage status seconds
  printf '{"stage": "%s", "status": "%s", "seconds": %s}\n' "$1" "$2" "$3" >> "$RESULTS"
}
STATUS_OF=()

# stage NAME MAX_SECONDS CMD...: runs CMD under `timeout` (at most MAX_SECONDS, never past the
# budget), appends its output to the log and its JSON lines to results.jsonl.
stage() {
  local name="$1" max="$2"; shift 2
  local now left limit rc t0 status
  case "$name" in install|env|import) ;; *)
    if [ -n "$STAGES" ] && [[ "$STAGES" != *",$name,"* ]]; then return 0; fi
    if [ -n "$RESUME" ] && grep -q "^{\"stage\": \"$name\", \"status\": \"ok\"" "$RESUME"; then
      say "$name: done in $RESUME"
      record "$name" "done earlier" 0
      STATUS_OF+=("$name=done earlier")
      return 0
    fi ;;
  esac
  now=$(date +%s)
  left=$(( BUDGET - (now - START) - RESERVE ))
  limit=$(( max < left ? max : left ))
  if [ "$limit" -lt 15 ]; then
    say "$name: skipped (budget: ${left} s left)"
    record "$name" "skipped: budget" 0
    STATUS_OF+=("$name=skipped")
    return 0
  fi
  say "$name: up to ${limit} s: $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
  rc=$?
  sed "s/^/[$name] /" "$WORK/$name.err" >> "$LOG"
  sed "s/^/[$name] /" "$WORK/$name.out" >> "$LOG"
  grep '^{' "$WORK/$name.out" >> "$RESULTS"
  case $rc in
    0) status=ok ;;
    124|137) status="timeout after ${limit} s" ;;
    5) status="no tests collected" ;;
    *) status="failed (exit $rc)" ;;
  esac
  record "$name" "$status" $(( $(date +%s) - t0 ))
  STATUS_OF+=("$name=$status")
  say "$name: $status"
  [ "$rc" -ne 0 ] && tail -n 5 "$WORK/$name.err" | sed "s/^/    /" >&2
  return 0
}
ok() { printf '%s\n' "${STATUS_OF[@]}" | grep -qx "$1=ok"; }

# --- install: the carried wheels, then meshtrain from this checkout; never jax ----------------
SITE="$WORK/site"
mkdir -p "$SITE"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Never import this checkout's meshtrain/ folder as the package (its meshtrain.kernels lives in
# kernels/ only once installed): no script or current directory at the front of sys.path.
export PYTHONSAFEPATH=1
t0=$(date +%s)
install_rc=0
shopt -s nullglob
carried=("$WHEELS"/*.whl)
if [ ${#carried[@]} -gt 0 ]; then
  say "install: ${#carried[@]} carried wheels from $WHEELS into $SITE"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${carried[@]}" >> "$LOG" 2>&1 || install_rc=$?
  fallback=()
  for name in flax optax orbax-checkpoint; do
    if [ -n "$("$PYTHON" "$ROOT/scripts/gpu_env.py" unmet "$name")" ]; then
      wheel=("$WHEELS"/fallback/"${name//-/_}"-*.whl)
      [ ${#wheel[@]} -gt 0 ] && fallback+=("${wheel[@]}")
    fi
  done
  if [ ${#fallback[@]} -gt 0 ]; then
    say "install: the image's version is outside pyproject's range; carried: ${fallback[*]##*/}"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${fallback[@]}" >> "$LOG" 2>&1 || install_rc=$?
  fi
else
  say "install: no wheels in $WHEELS; using the environment as it is"
fi
if "$PYTHON" -c "import meshtrain, os, sys; sys.exit(not os.path.realpath(meshtrain.__file__).startswith('$ROOT/'))" 2>/dev/null; then
  say "install: meshtrain already imports from this checkout"
else
  build=()
  [ -d "$WHEELS/build" ] && build=(--find-links "$WHEELS/build")
  say "install: meshtrain from $ROOT into $SITE"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    "${build[@]}" --target "$SITE" "$ROOT" >> "$LOG" 2>&1 || install_rc=$?
fi
if compgen -G "$SITE/jax*" > /dev/null || compgen -G "$SITE/numpy*" > /dev/null; then
  say "install: refusing: the carried wheels put jax or numpy into $SITE"
  install_rc=3
fi
shopt -u nullglob
record install "$([ $install_rc -eq 0 ] && echo ok || echo "failed (exit $install_rc)")" \
  $(( $(date +%s) - t0 ))

# --- versions and device -----------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  # a dry run checks that every stage works, not how fast: XLA's cheap CPU compiles
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
else
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"  # tests/conftest.py defaults to cpu
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
fi
stage env 60 "$PYTHON" "$ROOT/scripts/gpu_env.py" versions
grep '"stage": "env"' "$RESULTS" | head -n 1 >&2
stage import 60 "$PYTHON" -c "
import json, grain, jax, tyro, meshtrain, meshtrain.bench, meshtrain.cli, meshtrain.kernels
print(json.dumps({'stage': 'import', 'jax': jax.__version__, 'jax_file': jax.__file__,
                  'meshtrain_file': meshtrain.__file__, 'grain_file': grain.__file__,
                  'tyro_file': tyro.__file__}))"

# --- the stages --------------------------------------------------------------------------------
cd "$ROOT" || exit 2
mapfile -t GPU_TESTS < <(grep -l "pytest.mark.gpu" tests/test_*.py)
if [ "$DRY" = 1 ]; then
  SIZE_A=(--size tiny) SIZE_B=(--size tiny) SIZE_P=(--size tiny) SIZE_Q=(--size tiny)
  SIZE_F=(--size tiny)
  STEPS=(--steps 2 --warmup 1)
  PALLAS=(--attention pallas --norm pallas --loss pallas)
  KERNELS=(--selftest)
  SWEEP=(--selftest)
else
  SIZE_A=(--size 125m) SIZE_B=(--size 1.3b --seq-len 2048 --dtype bfloat16)
  SIZE_P=(--size 350m) SIZE_Q=(--size 1.3b --seq-len 2048)  # the recipe, by --precision
  SIZE_F=(--size 350m --seq-len 2048)  # the XLA flags, each a fresh compile
  # 1.3b at batch 8 without remat needs about 77 GiB: it ran on an H200 (141 GB) and ran out of
  # memory on an H100 (80 GB). Below 100 GB of GPU memory the 1.3b stages recompute each block.
  GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  if [ -n "$GPU_MIB" ] && [ "${GPU_MIB%%[^0-9]*}" -lt 100000 ] 2>/dev/null; then
    say "1.3b stages: --remat full (the GPU has ${GPU_MIB} MiB)"
    SIZE_B+=(--remat full)
    SIZE_Q+=(--remat full)
  fi
  STEPS=(--steps 10 --warmup 3)
  PALLAS=(--attention pallas --norm pallas --loss pallas)
  KERNELS=(--warmup 3 --reps 10)
  SWEEP=(--budget 200)
fi
PROF=()
[ "$PROFILE" = 1 ] && PROF=(--profile "$WORK/trace_b" --profile-steps 3)

AUTO=(--packed --attention auto --norm auto --loss auto)  # the recipe: what users train with
stage recipe_1.3b 240 "$PYTHON" -m meshtrain.cli bench "${SIZE_Q[@]}" "${AUTO[@]}" \
  --precision bf16 "${STEPS[@]}"
stage recipe_1.3b_fp8 180 "$PYTHON" -m meshtrain.cli bench "${SIZE_Q[@]}" "${AUTO[@]}" \
  --precision fp8 "${STEPS[@]}"
stage kernels 240 "$PYTHON" benchmarks/kernels.py "${KERNELS[@]}"
stage flash_sweep 240 "$PYTHON" benchmarks/flash_sweep.py "${SWEEP[@]}"
cp "$ROOT/kernels/auto_table.json" "$OUT/auto_table.json"
stage auto_table 30 "$PYTHON" scripts/auto_table.py "$RESULTS" --merge --out "$OUT/auto_table.json"
stage xla_flags 300 "$PYTHON" benchmarks/xla_flags.py "${SIZE_F[@]}" --packed --precision bf16 \
  "${STEPS[@]}" --only none,latency_hiding_scheduler,no_triton_gemm,maxtext
stage gpu_tests 120 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider "${GPU_TESTS[@]}"
stage bench_1.3b 300 "$PYTHON" benchmarks/e2e.py "${SIZE_B[@]}" "${STEPS[@]}" "${PROF[@]}"
if [ -z "$STAGES" ] || [[ "$STAGES" == *",bench_1.3b,"* ]] && ! ok bench_1.3b; then
  # out of memory, most likely: half the batch, full remat
  stage bench_1.3b_small 240 "$PYTHON" benchmarks/e2e.py "${SIZE_B[@]}" "${STEPS[@]}" \
    --batch 4 --remat full --torch off
fi
stage bench_125m 150 "$PYTHON" benchmarks/e2e.py "${SIZE_A[@]}" "${STEPS[@]}"
stage precision_350m_bf16 120 "$PYTHON" -m meshtrain.cli bench "${SIZE_P[@]}" --precision bf16 \
  "${STEPS[@]}"
stage precision_350m_fp8 120 "$PYTHON" -m meshtrain.cli bench "${SIZE_P[@]}" --precision fp8 \
  "${STEPS[@]}"
stage bench_1.3b_pallas 150 "$PYTHON" benchmarks/e2e.py "${SIZE_B[@]}" "${STEPS[@]}" \
  "${PALLAS[@]}" --torch off --no-jax-baseline

# --- the trace, copied up into $OUT (2 folders deep at most) -----------------------------------
if [ -d "$WORK/trace_b" ]; then
  while IFS= read -r f; do
    size=$(stat -c %s "$f")
    case "$f" in
      *.xplane.pb) dest="$OUT/trace_1.3b.xplane.pb" ;;
      *perfetto_trace.json.gz) dest="$OUT/trace_1.3b.perfetto.json.gz" ;;
      *) continue ;;
    esac
    if [ "$size" -le $(( 15 * 1024 * 1024 )) ]; then cp "$f" "$dest"; else
      say "trace: $(basename "$f") is $(( size / 1048576 )) MiB, over the 16 MiB per-file limit; not kept"
    fi
  done < <(find "$WORK/trace_b" -type f)
fi

# --- summary, last ------------------------------------------------------------------------------
"$PYTHON" "$ROOT/scripts/gpu_env.py" summary "$RESULTS" > "$SUMMARY" 2>> "$LOG"
echo "elapsed $(( $(date +%s) - START )) s of a ${BUDGET} s budget; files in $OUT" >> "$SUMMARY"
cat "$SUMMARY"
# Exit 0 when the kit itself worked (install and import); a failed stage is a result, and the
# summary and results.jsonl say which.
[ $install_rc -eq 0 ] && ok import
