#!/usr/bin/env bash
# One GPU call's measurement for docs/performance.md (written for one H200; any single NVIDIA GPU works),
# packed in ONE archive (the device tool brings back at most 8 files), its summary table printed last.
#
#   bash scripts/gpu_bench.sh [RESULT_DIR]        (default: $OUT if set, else ./bench_results)
#
# On a machine with a copy of the tree and no .git, name the commit: COMMIT=$(git rev-parse --short HEAD) bash ...
#
# 1. Finds a Python whose JAX sees a GPU: $PYTHON, then python3, then the venv $GPU_VENV
#    (default /tmp/jaxformer-gpu-venv). If none does, it creates that venv and installs jax[cuda12] at
#    the version pinned in requirements.txt (plus optax at its pin): from wheels in ./.whl when that
#    folder exists (no network needed), else from the package index.
#    That Python's flax/optax/orbax are its own (a GPU image brings its own JAX); if this repo's modules
#    do not import with them, the pinned pure-Python wheels in ./.gpu_wheels (when present) are put
#    first on PYTHONPATH and the import is tried again. To carry them (a machine with no network):
#      pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu_wheels \
#        flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8
# 2. Runs bench.py, mesh 1 1 1, T 1024, --micro_batch_size 1 (no pipeline on one device), in this order:
#      tiny_sanity   the tiny preset; if it fails nothing else runs
#      b32_auto      moe1B, 32 sequences, the default --remat auto: the headline
#      b32_full      the same with --remat full
#      b32_dropless  the headline with --moe_impl ragged --capacity_factor 0
#      b8_full       8 sequences, --remat full: the setting of the 2026-11-30 baseline
#    Each moe1B run writes its train step's HLO as the GPU compiled it, autotuned (--dump_hlo), and traces
#    --steps more steps, keeping every kernel's time per step (--profile: kernels.json).
# 3. Packs everything (JSON lines, logs, HLO, kernel times, versions, the refit, the summary) into
#    RESULT_DIR/gpu_bench.tar.gz, the only file it leaves there, then prints the summary table last.
#    Refit the estimate from it: python scripts/refit_estimate.py RESULT_DIR/gpu_bench.tar.gz [--write]
#
# Rehearsal on a CPU: STANDIN=1 bash scripts/gpu_bench.sh /tmp/r runs the same flow with
# scripts/gpu_bench_standin.py in place of bench.py (a canned program whose kernels run at planted speeds).
#
# Everything runs inside BUDGET_S (default 540 s: one command of the device tool runs 600 s at most):
# every run is under `timeout`, capped by what is left; a run that times out or fails is reported so.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
RESULT_DIR=${1:-${OUT:-bench_results}}
mkdir -p "$RESULT_DIR"
START=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
GPU_VENV=${GPU_VENV:-/tmp/jaxformer-gpu-venv}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
STANDIN=${STANDIN:-}
PIN_JAX=$(sed -n 's/^jax==//p' requirements.txt)
PIN_OPTAX=$(sed -n 's/^optax==//p' requirements.txt)
WORK=$(mktemp -d)/gpu_bench
mkdir -p "$WORK"
# The archive, written however the script ends (a failed sanity run included)
pack() { tar -czf "$RESULT_DIR/gpu_bench.tar.gz" -C "$(dirname "$WORK")" gpu_bench; }
trap pack EXIT
export PYTHONUNBUFFERED=1
[ -n "$STANDIN" ] && export ALLOW_CPU=1

left() { echo $((BUDGET_S - ($(date +%s) - START))); }
# cap SECONDS: the smaller of SECONDS and the budget left minus a reserve for the refit, summary and archive
cap() { local l; l=$(($(left) - 40)); if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi; }

gpu_python() {
  "$1" - <<'EOF' >/dev/null 2>&1
import jax, optax  # noqa: F401
import os
assert jax.default_backend() == "gpu" or os.environ.get("ALLOW_CPU"), jax.default_backend()
EOF
}

echo "== python with a GPU JAX"
PY=""
for candidate in ${PYTHON:-} python3 "$GPU_VENV/bin/python"; do
  if command -v "$candidate" >/dev/null 2>&1 && timeout 60 bash -c "$(declare -f gpu_python); gpu_python $candidate"; then
    PY=$candidate
    break
  fi
done
if [ -z "$PY" ]; then
  echo "no GPU JAX found; installing jax[cuda12]==$PIN_JAX optax==$PIN_OPTAX into $GPU_VENV"
  python3 -m venv "$GPU_VENV" || exit 1
  if [ -d .whl ]; then
    PIP_SRC=(--no-index --find-links .whl)
  else
    PIP_SRC=()
  fi
  timeout "$(cap 180)" "$GPU_VENV/bin/pip" install -q "${PIP_SRC[@]}" "jax[cuda12]==$PIN_JAX" "optax==$PIN_OPTAX" \
    || echo "install failed (no network? put the wheels in ./.whl)"
  if timeout 60 bash -c "$(declare -f gpu_python); gpu_python $GPU_VENV/bin/python"; then
    PY=$GPU_VENV/bin/python
  else
    echo "FATAL: no Python with a GPU JAX; nothing measured"
    exit 1
  fi
fi

echo "== this repo's modules under $PY"
if ! "$PY" -c "import main, bench" 2>"$WORK/import.log"; then
  tail -n 3 "$WORK/import.log"
  if [ -d .gpu_wheels ]; then
    echo "retrying with the pinned wheels in .gpu_wheels"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/jaxformer-site .gpu_wheels/*.whl
    export PYTHONPATH=/tmp/jaxformer-site${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$PY" -c "import main, bench" || { echo "FATAL: main.py and bench.py do not import under $PY"; exit 1; }
fi
BENCH=(bench.py)
[ -n "$STANDIN" ] && BENCH=(scripts/gpu_bench_standin.py)

echo "== versions"
{
  "$PY" - "$PY" "$PIN_JAX" <<'EOF'
import sys, jax, jaxlib, optax, flax, orbax.checkpoint as ocp
py, pin = sys.argv[1:]
print("python", sys.version.split()[0], "|", py)
print("jax", jax.__version__, "| jaxlib", jaxlib.__version__, "| flax", flax.__version__, "| optax", optax.__version__,
      "| orbax", ocp.__version__, "| pinned jax", pin + ("" if jax.__version__ == pin else " (DIFFERS from the pin)"))
print("devices", jax.devices())
EOF
  nvidia-smi || echo "nvidia-smi not available"
} 2>&1 | tee "$WORK/versions.txt"
if [ -z "${COMMIT:-}" ]; then
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
  [ -n "$(git status --porcelain 2>/dev/null)" ] && COMMIT="$COMMIT+changes"
fi
DATE=$(date -u +%Y-%m-%d)
echo "commit $COMMIT, $DATE"

# run NAME CAP_SECONDS ARGS...: one step benchmark into WORK/NAME.{json,log,status}
FLAGS_JSON=""
run() {
  local name=$1 limit
  limit=$(cap "$2")
  shift 2
  FLAGS_JSON="$FLAGS_JSON\"$name\": \"$*\", "
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped (budget spent)"
    echo "skipped: budget spent" >"$WORK/$name.status"
    return
  fi
  echo "== $name (timeout ${limit}s): ${BENCH[*]} $*"
  timeout "$limit" "$PY" "${BENCH[@]}" "$@" >"$WORK/$name.json" 2>"$WORK/$name.log"
  local rc=$?
  tail -n 3 "$WORK/$name.log"
  cat "$WORK/$name.json"
  case $rc in
    0) echo ok >"$WORK/$name.status" ;;
    124) echo "timed out after ${limit}s" >"$WORK/$name.status" ;;
    *) echo "failed (exit $rc): $(tail -n 1 "$WORK/$name.log")" >"$WORK/$name.status" ;;
  esac
}
# moe NAME CAP_SECONDS ARGS...: a moe1B run that also keeps its HLO and every kernel's time
moe() {
  local name=$1 limit=$2 trace=/tmp/jaxformer-trace-$1
  shift 2
  run "$name" "$limit" --preset moe1B --n_device_axis 1 1 1 --micro_batch_size 1 --steps "$STEPS" --warmup "$WARMUP" \
    --dump_hlo "$WORK/$name.hlo.txt" --profile "$trace" "$@"
  [ -f "$trace/kernels.json" ] && cp "$trace/kernels.json" "$WORK/$name.kernels.json"
  rm -rf "$trace"
}

RUNS=(tiny_sanity b32_auto b32_full b32_dropless b8_full)
run tiny_sanity 90 --preset tiny --n_device_axis 1 1 1 --steps "$STEPS" --warmup "$WARMUP"
if [ "$(cat "$WORK/tiny_sanity.status")" != ok ]; then
  echo "FATAL: the tiny sanity run failed; nothing else runs"; tail -n 30 "$WORK/tiny_sanity.log"; exit 1
fi
moe b32_auto 150 --train_batch_size 32
moe b32_full 120 --train_batch_size 32 --remat full
moe b32_dropless 120 --train_batch_size 32 --moe_impl ragged --capacity_factor 0
moe b8_full 100 --train_batch_size 8 --remat full
echo "{\"commit\": \"$COMMIT\", \"date\": \"$DATE\", \"python\": \"$PY\", \"flags\": {${FLAGS_JSON%, }}}" >"$WORK/meta.json"

echo
echo "== the estimate refitted on these runs (python scripts/refit_estimate.py gpu_bench.tar.gz)"
timeout "$(($(left) > 30 ? $(left) - 25 : 5))" "$PY" scripts/refit_estimate.py "$WORK" 2>&1 | tee "$WORK/refit.txt"

"$PY" - "$WORK" "${RUNS[@]}" >"$WORK/summary.txt" <<'EOF'
import json, os, sys

d, names = sys.argv[1], sys.argv[2:]
cols = ["run", "status", "step s (med)", "tokens/s", "MFU datasheet", "MFU meas", "matmul TF/s", "kernels ms", "peak GiB",
        "compile s", "device"]
rows = []
for n in names:
    path = lambda ext: os.path.join(d, n + ext)
    status = open(path(".status")).read().strip() if os.path.exists(path(".status")) else "not run"
    r, kernels = {}, None
    try:
        r = json.loads([line for line in open(path(".json")) if line.startswith("{")][-1])
    except (OSError, IndexError, ValueError):
        pass
    if os.path.exists(path(".kernels.json")):
        kernels = sum(k["ms_per_step"] for k in json.load(open(path(".kernels.json")))["kernels"])
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
    num = lambda v, f: "-" if v is None else format(v, f)
    rows.append([n, status[:40], num(r.get("step_time_median_s"), ".4f"), num(r.get("tokens_per_s"), ",.0f"),
                 pct(r.get("mfu")), pct(r.get("mfu_vs_measured_peak")),
                 num(r["matmul_peak_flops"] / 1e12 if r.get("matmul_peak_flops") else None, ".1f"), num(kernels, ".1f"),
                 num(r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None, ".1f"),
                 num(r.get("compile_s"), ".1f"), r.get("device_kind", "-")])
widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
for row in [cols, ["-" * w for w in widths], *rows]:
    print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
EOF
trap - EXIT
pack
echo
echo "== archive: $RESULT_DIR/gpu_bench.tar.gz ($(du -k "$RESULT_DIR/gpu_bench.tar.gz" | cut -f1) KiB)"
echo "== summary ($(($(date +%s) - START)) s in all; MFU datasheet: of the GPU's bf16 datasheet peak, 989 TFLOP/s on an H200; meas: of the 8192^3 GEMM timed in the same run)"
cat "$WORK/summary.txt"
