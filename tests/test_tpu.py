"""On a TPU chip, what the CPU suite cannot prove: the memory plan (`--compile_for`, `--fit` and main.py read
measure.planned_gib) against what the chip holds and what its compiler refuses, fp32 that is fp32, a step too large
for the chip in one line, and a stop on the chip resumed bit for bit. Skipped unless JAXFORMER_TPU_TESTS=1 (CI
has no TPU); on a TPU VM, from the repository root, in 8:40 on one v5e (the chip's checks 3.6 minutes, each
out-of-memory line 1-2, the stop 2.3; docs/performance-log.md#2026-12-06-tpu-memory-plans):

    JAXFORMER_TPU_TESTS=1 python -m pytest -q -p no:xdist tests/test_tpu.py

One process at a time can hold a chip: this one stays on the CPU and every check runs the chip in a
subprocess (tests/chip_checks.py, main.py, bench.py)."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from ceiling import CEILING_S
from chip_checks import PLAN_TOLERANCE, V5E_HELD, V5E_REFUSED
from run_util import MESH1, REPO, last_step, records, run, start, wait_for_step

pytestmark = pytest.mark.skipif(os.environ.get("JAXFORMER_TPU_TESTS") != "1",
                                reason="on a TPU chip only (JAXFORMER_TPU_TESTS=1)")
CHECKS = os.path.join(REPO, "tests", "chip_checks.py")
# Two that fit and two the compiler refuses, a change of batch, micro-batch and remat each (the other cases of
# V5E_HELD and V5E_REFUSED are the CPU's: tests/test_pod.py); each chip check costs a compile of MODEL.
FITS = list(V5E_HELD)[:2]
REFUSED = [case for case in V5E_REFUSED if "--train_batch_size 12" not in case]
# A step the chip's compiler refuses (every activation of 255 sequences of 2048 kept); the odd batch leaves the
# planner one setting to compile (--remat full, which fits): each costs the chip's compiler most of a minute
TOO_LARGE = ("--model_dimension 256 --n_head 4 --blocks 1 --layers_per_block 2 --T 2048 --latent_dim 64 --q_latent_dim 64 "
             "--dhR 32 --n_experts 4 --n_device_axis 1 1 1 --train_batch_size 255 --micro_batch_size 1 --remat none "
             "--val_batch_size 8 --eval_tasks= --max_tokens 0").split()


@pytest.fixture(scope="module")
def tpu_env(cpu_env):
    """A subprocess's environment on the TPU: cpu_env's, less JAX_PLATFORMS=cpu."""
    return {k: v for k, v in cpu_env.items() if k != "JAX_PLATFORMS"}


def checks(env, *args):
    return subprocess.Popen([sys.executable, CHECKS, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def results(proc):
    stdout, stderr = proc.communicate(timeout=CEILING_S)
    assert proc.returncode == 0, stderr[-4000:]
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def chip(tpu_env, cpu_env):
    """{memory case or "fp32": chip_checks' result, "cpu_fp32": the CPU's}: the chip's checks in one process (its
    runtime started once), the CPU's fp32 beside it."""
    on_chip = checks(tpu_env, *FITS, *REFUSED, "fp32", "attention", "grouped", "optimizer")
    on_cpu = checks(cpu_env, "fp32")
    chip_results, cpu_results = results(on_chip), results(on_cpu)
    return {r.get("case", r.get("check", "fp32")): r for r in chip_results} | {"cpu_fp32": cpu_results[0]}


@pytest.mark.parametrize("case", FITS)
def test_a_plan_that_fits_is_what_the_chip_holds(chip, case):
    result = chip[case]
    assert not result["refused"] and result["planned_gib"] <= result["usable_gib"], result
    assert abs(result["planned_gib"] - result["held_gib"]) <= PLAN_TOLERANCE * result["held_gib"], result


@pytest.mark.parametrize("case", REFUSED)
def test_a_plan_over_the_chip_is_refused_by_its_compiler(chip, case):
    result = chip[case]
    assert result["refused"] and result["needed_gib"] > 15.75, result


def test_fp32_on_the_chip_is_the_cpus_fp32(chip):
    on_chip, cpu = chip["fp32"], chip["cpu_fp32"]
    assert (on_chip["platform"], cpu["platform"]) == ("tpu", "cpu")
    for (loss, norm), (cpu_loss, cpu_norm) in zip(on_chip["steps"], cpu["steps"]):
        assert abs(loss - cpu_loss) <= 1e-6 * cpu_loss and abs(norm - cpu_norm) <= 1e-6 * cpu_norm, (on_chip, cpu)


def test_the_attention_kernel_is_no_further_from_fp32_than_xlas_attention(chip):
    """engine/tpu_attention.py in bf16 on the chip, at the one-chip preset's shapes: its output and gradients no
    further from fp32 than XLA's bf16 attention (the path it replaces), give or take the blocks' other order."""
    result = chip["attention"]
    assert result["platform"] == "tpu"
    for widths in ("192/64", "64/64"):
        kernel, xla = result["errors"][f"kernel {widths}"], result["errors"][f"xla {widths}"]
        assert all(k <= 2 * x + 1e-3 for k, x in zip(kernel, xla)), (widths, kernel, xla)


def test_the_grouped_matmuls_are_fp32_sums_of_bf16_products(chip):
    """--moe_impl ragged's three grouped products on the chip, lax.ragged_dot_general's and megablox's, equal an
    fp32 product per group of the same bf16 operands, with rows past the groups (dropped choices: 0) and an
    empty group."""
    result = chip["grouped"]
    assert result["platform"] == "tpu"
    assert all(error <= 1e-4 for error in result["errors"].values()), result["errors"]


def test_the_one_pass_update_is_the_chains_on_the_chip(chip):
    """engine/tpu_update.py's kernel on the chip, the tiny preset's first step in fp32: every leaf of the state as
    optax's chain, fused by XLA, leaves it, to the rounding of the chip's division and square root."""
    result = chip["optimizer"]
    assert result["platform"] == "tpu"
    assert max(result["shares"].values()) <= 1e-5, result["shares"]


ONE_LINE = re.compile(r"error: out of memory: the train step needs [\d.]+ GiB a device, the TPU v5 lite devices have "
                      r"[\d.]+ GiB each \([\d.]+ GiB short\); it fits with (?P<flags>--.+) \([\d.]+ GiB, FLOPs "
                      r"[\d.]+x the model's\): python (?P<program>\w+\.py) .+")


@pytest.mark.parametrize("program", ["main.py", "bench.py"])
def test_a_step_too_large_for_the_chip_is_one_line_naming_a_setting_that_fits(tpu_env, tmp_path, program):
    args = ["--output_dir", str(tmp_path), "--name", "run"] if program == "main.py" else ["--steps", "1"]
    proc = subprocess.run([sys.executable, os.path.join(REPO, program), *TOO_LARGE, *args], cwd=tmp_path, env=tpu_env,
                          capture_output=True, text=True, timeout=CEILING_S)
    # the TPU runtime's own log lines (absl's, I/W/E and a date) may come after the error, as it shuts down
    lines = [line for line in proc.stderr.splitlines() if not re.match(r"[IWE]\d{4} |WARNING: All log messages", line)]
    errors = [line for line in lines if line.startswith("error:")]
    assert proc.returncode == 1 and errors == lines[-1:], proc.stderr[-3000:]
    assert (m := ONE_LINE.fullmatch(errors[0])) and m["program"] == program, errors[0]
    assert "Traceback" not in proc.stderr
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert not [f for f in written if "checkpoints" in f or ".tmp" in f], written


def test_a_stop_on_the_chip_resumes_bit_for_bit(tpu_env, tmp_path):
    """SIGTERM mid-run on the chip saves; the same command resumes, and every step's loss and grad norm equal an
    uninterrupted run's."""
    run(tpu_env, tmp_path / "whole", *MESH1, steps=100)
    out, log = tmp_path / "stopped", tmp_path / "stopped.log"
    proc = start(tpu_env, out, log, *MESH1, steps=100)
    wait_for_step(proc, out, log, 5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=CEILING_S) == 0, open(f"{log}.err").read()[-3000:]
    stopped = last_step(out)
    assert stopped < 100, "the run ended before the stop: nothing resumed"
    run(tpu_env, out, *MESH1, steps=100)
    curve = lambda path: {r["step"]: (r["loss"], r["grad_norm"]) for r in records(path) if "loss" in r}
    assert curve(out) == curve(tmp_path / "whole") and len(curve(out)) == 100
