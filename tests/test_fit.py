"""A run that cannot fit this machine refuses before it allocates (fit.check_fits), and its plan is a lower
bound of what the compiled step needs, so that a run which fits is never refused.

The model that cannot fit is sized from this machine's memory: routed experts enough for all of its RAM in
parameters alone (4x that planned, with the optimizer state and gradients), its largest array half of it
and so allocatable, so that a run without the check fills memory (it did, silently: issue 46). main.py
runs as a subprocess watched for its resident memory and killed past RSS_LIMIT."""
import math
import os
import re
import subprocess
import sys
import time

import jax
import psutil
import pytest

import hardware
import sharding
import utils
from ceiling import CEILING_S
from planning import fit, measure
from small_configs import SMALL_FLAGS
from trainer import abstract_step_args, build_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
RSS_LIMIT = 3 * GiB      # imports and shapes take a few hundred MiB; a run allocating its state passes this
D = 2048                 # each routed expert's two matrices: 8 D^2 fp32 params, 128 MiB in each of 2 blocks


def too_big_for_this_machine():
    experts = math.ceil(psutil.virtual_memory().total / (2 * 8 * D * D * 4))
    return (f"--model_dimension {D} --n_head 16 --n_experts {experts} --blocks 2 --layers_per_block 2 --T 64 "
            f"--n_device_axis 1 1 1 --max_tokens 0").split()


@pytest.mark.parametrize("fit_flag", [[], ["--fit"]], ids=["as-given", "fit"])
def test_a_run_that_cannot_fit_refuses_in_one_line_before_it_allocates(cpu_env, bundled_shards, tmp_path, fit_flag):
    """With --fit too, and before any compile: its state alone is over the memory, which no setting changes."""
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *too_big_for_this_machine(), "--data_dir", bundled_shards,
           "--output_dir", str(tmp_path), "--name", "big", *fit_flag]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched, peak, deadline = psutil.Process(proc.pid), 0, time.time() + CEILING_S
    try:
        while proc.poll() is None and peak <= RSS_LIMIT and time.time() < deadline:
            try:
                peak = max(peak, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        stdout, stderr = proc.communicate()
    assert peak <= RSS_LIMIT, (f"main.py grew to {peak / GiB:.1f} GiB without refusing:\n"
                               f"{stdout[-2000:]}{stderr[-2000:]}")
    assert proc.returncode == 2, f"exit {proc.returncode}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this run (--preset tiny) needs at least "), stderr
    assert "GiB of available host memory" in lines[0] and "--compile_for v5litepod-1" in lines[0], lines[0]
    # the smaller presets whose plan takes at most half the host's available memory: the one-chip preset's
    # (about 10 GiB) does where 20 GiB or more are free
    smaller = re.search(r"pick a smaller model \(--preset ([\w-]+(?: or [\w-]+)*)\)", lines[0])
    assert smaller and smaller[1] in ("tiny or dsv3-tiny", "tiny or dsv3-tiny or moe1B-v5e-1"), lines[0]
    assert "--force" in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "big"), "the refused run touched its run directory"


def test_force_skips_the_check_and_the_plan_is_a_lower_bound_of_the_compiled_step():
    big = utils.config_from_args(too_big_for_this_machine())
    forced = utils.override(big, force=True)
    fit.check_fits(forced, build_trainer(forced, sharding.make_mesh((1, 1, 1))))    # no RunRefused
    # small_configs' model with a small vocabulary (a quicker compile) and activations the larger part of the plan,
    # on a 3-D mesh, every layer recomputed: the least a step keeps
    cfg = utils.config_from_args(SMALL_FLAGS + "--T 128 --vocab_size 1024 --train_batch_size 16 --val_batch_size 16 "
                                               "--remat full --n_device_axis 2 2 2".split())
    mesh = sharding.run_mesh(cfg.run)
    trainer = build_trainer(cfg, mesh)
    fit.check_fits(cfg, trainer)
    compiled = measure.planned_gib(trainer.step.lower(*abstract_step_args(cfg, trainer)[0]).compile().memory_analysis(), "cpu") * GiB
    plan = fit.planned_bytes(cfg, trainer)
    assert plan["params"] == plan["gradients"] and plan["optimizer state"] >= 2 * plan["params"], plan
    assert plan["activations"] > plan["params"], plan
    assert 0 < sum(plan.values()) <= compiled, (plan, compiled)
    assert jax.device_count() == 8


def test_a_step_the_devices_cannot_hold_is_one_line_naming_the_cheapest_setting_that_fits():
    """fit.does_not_fit, the line main.py and bench.py end with when the compiler refuses a step for want of
    memory (on a TPU; tests/test_tpu.py meets it there): the shortfall against what the devices have, and the
    cheapest setting that fits, compiled here (planning/tradeoffs.py), with its command."""
    # two settings to compile, --remat full and --expert_parallel (one pass of the micro-batches leaves no
    # --grad_step, the weights already gathered a tick at a time)
    cfg = utils.config_from_args(SMALL_FLAGS + "--T 64 --vocab_size 1024 --train_batch_size 2 --micro_batch_size 2 "
                                               "--fsdp_gather tick --n_device_axis 2 1 1".split())
    mesh = sharding.run_mesh(cfg.run)
    have = fit.device_memory(mesh)
    needed = have.gib_each + 1          # a GiB more than each device's share of this host's memory
    said = []
    line = fit.does_not_fit(cfg, mesh, needed, ["--remat", "none", "--micro_batch_size", "2"], said.append)
    assert said[0].startswith(f"out of memory: the train step needs {needed:.2f} GiB a device") and len(said) > 1
    m = re.fullmatch(r"out of memory: the train step needs ([\d.]+) GiB a device, the 2 CPU devices share [\d.]+ GiB "
                     r"of available host memory \([\d.]+ GiB short\); it fits with (--.+) \([\d.]+ GiB, FLOPs [\d.]+x "
                     r"the model's\): (python main.py .+)", line)
    assert m and float(m[1]) == round(needed, 2) and m[3].endswith(" " + m[2]), line


def test_remat_auto_keeps_every_activation_on_a_tpu_where_that_fits():
    """--remat auto for a v5e (libtpu's compiler, here on the CPU): none, the layers traced apart with nothing
    recomputed, where that step's plan fits the budget (the config then says none, its step compiled, as a run trains
    with it), else auto as given (dots); on the CPU auto as given, nothing compiled."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")          # other test processes may hold libtpu
    cfg = utils.config_from_args([*SMALL_FLAGS, "--remat", "auto", "--n_device_axis", "1", "1", "1",
                                  "--train_batch_size", "4", "--micro_batch_size", "1"])
    mesh, said = measure.target_mesh(cfg, hardware.tpu_slice("v5e-1")), []
    settled, plan = fit.settle_auto_remat(cfg, mesh, said.append, budget_gib=15.75)
    assert settled.model.remat == "none" and isinstance(plan.trainer.step, jax.stages.Compiled), said
    assert said == [f"--remat auto: none (every activation kept), the train step planning {plan.gib:.2f} of 15.75 "
                    "GiB a device"]
    assert fit.settle_auto_remat(cfg, mesh, said.append, budget_gib=plan.gib / 2) == (cfg, None)
    assert said[-1].startswith("--remat auto: dots (none, every activation kept, would need"), said
    assert fit.settle_auto_remat(cfg, sharding.make_mesh((1, 1, 1)), said.append) == (cfg, None) and len(said) == 2
