#!/usr/bin/env bash
# One-shot GPU measurement for docs/performance.md (written for one H200; any single NVIDIA GPU works).
#
#   bash scripts/gpu_bench.sh [RESULT_DIR]        (default: $OUT if set, else ./bench_results)
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
# 2. Prints versions, nvidia-smi and jax.devices().
# 3. Runs bench.py: the tiny preset (sanity; if it fails nothing else runs), then moe1B on mesh 1 1 1
#    with 8 sequences of 1024 tokens per step (--micro_batch_size 1: no pipeline on one device) under
#    --remat full, a profile of that step (bench.py --profile: device op time per step by name),
#    --remat dots, --moe_impl ragged (sorted tokens + lax.ragged_dot) against the per-expert buffers,
#    then 32 and 64 sequences while the budget lasts.
#    Each run is one JSON line in RESULT_DIR/<name>.json, its log in RESULT_DIR/<name>.log (moe1B's
#    says which attention kernel cuDNN took: "attention: cuDNN's fused kernel, v 64 wide as it is").
# 4. Prints a summary table LAST (also saved as RESULT_DIR/summary.txt).
#
# Dry run on a CPU (checks the script's flow only): ALLOW_CPU=1 STEPS=2 MOE_EXTRA="--model_dimension 48
# --blocks 2 --layers_per_block 2 --T 32 --vocab_size 1000 --max_tokens 8 --cpu_devices 1" bash scripts/gpu_bench.sh /tmp/r
#
# The whole script stays under 8 minutes: every step runs under `timeout`, capped by what is left of
# a 7.5-minute budget; a step that times out or fails is reported as such in the table.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
RESULT_DIR=${1:-${OUT:-bench_results}}
mkdir -p "$RESULT_DIR"
START=$(date +%s)
BUDGET_S=${BUDGET_S:-450}
GPU_VENV=${GPU_VENV:-/tmp/jaxformer-gpu-venv}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
PIN_JAX=$(sed -n 's/^jax==//p' requirements.txt)
PIN_OPTAX=$(sed -n 's/^optax==//p' requirements.txt)
export PYTHONUNBUFFERED=1

left() { echo $((BUDGET_S - ($(date +%s) - START))); }
# cap SECONDS: the smaller of SECONDS and the budget left minus a reserve for the summary
cap() { local l; l=$(($(left) - 15)); if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi; }

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
if ! "$PY" -c "import main, bench" 2>"$RESULT_DIR/import.log"; then
  tail -n 3 "$RESULT_DIR/import.log"
  if [ -d .gpu_wheels ]; then
    echo "retrying with the pinned wheels in .gpu_wheels"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/jaxformer-site .gpu_wheels/*.whl
    export PYTHONPATH=/tmp/jaxformer-site${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$PY" -c "import main, bench" || { echo "FATAL: main.py and bench.py do not import under $PY"; exit 1; }
fi

echo "== versions"
"$PY" - <<EOF
import sys, jax, jaxlib, optax, flax, orbax.checkpoint as ocp
print("python", sys.version.split()[0], "|", "$PY")
print("jax", jax.__version__, "| jaxlib", jaxlib.__version__, "| flax", flax.__version__, "| optax", optax.__version__,
      "| orbax", ocp.__version__, "| pinned jax $PIN_JAX" + ("" if jax.__version__ == "$PIN_JAX" else " (DIFFERS from the pin)"))
print("devices", jax.devices())
EOF
nvidia-smi || echo "nvidia-smi not available"
git log -1 --format='commit %H %cd' 2>/dev/null || true
date -u +'date %Y-%m-%dT%H:%M:%SZ'

# run NAME CAP_SECONDS ARGS...: one bench.py run into RESULT_DIR/NAME.json (+ .log)
run() {
  local name=$1 limit
  limit=$(cap "$2")
  shift 2
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped (budget spent)"
    echo "skipped: budget spent" >"$RESULT_DIR/$name.status"
    return
  fi
  echo "== $name (timeout ${limit}s): bench.py $*"
  timeout "$limit" "$PY" bench.py "$@" >"$RESULT_DIR/$name.json" 2>"$RESULT_DIR/$name.log"
  local rc=$?
  tail -n 3 "$RESULT_DIR/$name.log"
  cat "$RESULT_DIR/$name.json"
  case $rc in
    0) echo ok >"$RESULT_DIR/$name.status" ;;
    124) echo "timed out after ${limit}s" >"$RESULT_DIR/$name.status" ;;
    *) echo "failed (exit $rc): $(tail -n 1 "$RESULT_DIR/$name.log")" >"$RESULT_DIR/$name.status" ;;
  esac
}

MOE=(--preset moe1B --n_device_axis 1 1 1 --train_batch_size 8 --micro_batch_size 1 --steps "$STEPS" --warmup "$WARMUP")
# shellcheck disable=SC2206  # MOE_EXTRA is a list of flags, split on purpose
MOE+=(${MOE_EXTRA:-})
RUNS=(tiny_sanity moe1B_remat_full moe1B_profile moe1B_remat_dots moe1B_ragged_remat_dots moe1B_b32_remat_full
      moe1B_b64_remat_full)
run tiny_sanity 90 --preset tiny --n_device_axis 1 1 1 --steps "$STEPS" --warmup "$WARMUP"
if [ "$(cat "$RESULT_DIR/tiny_sanity.status")" != ok ]; then
  echo "FATAL: the tiny sanity run failed; nothing else runs"; tail -n 30 "$RESULT_DIR/tiny_sanity.log"; exit 1
fi
run moe1B_remat_full 120 "${MOE[@]}" --remat full
# where the step's time goes: the device's op time per step by name (the trace stays on the machine)
run moe1B_profile 120 "${MOE[@]}" --remat full --steps 3 --profile /tmp/jaxformer-trace
sed -n '/^device op time per step/,$p' "$RESULT_DIR/moe1B_profile.log"
run moe1B_remat_dots 120 "${MOE[@]}" --remat dots
# the sorted grouped-matmul experts against the per-expert buffers above
run moe1B_ragged_remat_dots 120 "${MOE[@]}" --remat dots --moe_impl ragged
# more tokens per step (--remat none does not fit 141 GB even at 16 sequences: measured 2026-11-30)
run moe1B_b32_remat_full 100 "${MOE[@]}" --remat full --train_batch_size 32
run moe1B_b64_remat_full 100 "${MOE[@]}" --remat full --train_batch_size 64

echo
echo "== summary ($(($(date +%s) - START)) s total)"
"$PY" - "$RESULT_DIR" "${RUNS[@]}" <<'EOF' | tee "$RESULT_DIR/summary.txt"
import json, os, sys

d, names = sys.argv[1], sys.argv[2:]
cols = ["run", "status", "tokens/s", "step s (med)", "compile s", "MFU spec", "MFU meas", "matmul TF/s",
        "peak GiB", "device"]
rows = []
for n in names:
    status = open(os.path.join(d, n + ".status")).read().strip() if os.path.exists(os.path.join(d, n + ".status")) else "not run"
    r = {}
    try:
        r = json.loads([l for l in open(os.path.join(d, n + ".json")) if l.startswith("{")][-1])
    except Exception:
        pass
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
    num = lambda v, f: "-" if v is None else format(v, f)
    rows.append([n, status[:40], num(r.get("tokens_per_s"), ",.0f"), num(r.get("step_time_median_s"), ".4f"),
                 num(r.get("compile_s"), ".1f"), pct(r.get("mfu_vs_spec_peak")), pct(r.get("mfu_vs_measured_peak")),
                 num(r["matmul_peak_flops"] / 1e12 if r.get("matmul_peak_flops") else None, ".1f"),
                 num(r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None, ".1f"),
                 r.get("device_kind", "-")])
widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
for row in [cols, ["-" * w for w in widths], *rows]:
    print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
EOF
