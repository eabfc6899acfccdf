"""What makes a plan fit (planning/tradeoffs.py): the settings that trade compute for memory keep the global batch, the
command printed is the one that parses to the chosen config, the choice is the cheapest of the compiled
plans that fit, and the memory a train step plans falls as it should with --grad_step and more micro-batches.
Plans are compiled here on CPU devices (their memory analysis, as a TPU's under --compile_for)."""
import os
import shlex
import subprocess
import sys

import jax
import pytest

import sharding
import utils
from ceiling import CEILING_S
from planning import measure, tradeoffs
from run_util import MESH1, run
from trainer import build_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Activations are most of this model's plan (--remat none keeps every value of the backward): what the
# settings change. 16 sequences per replica in 2 micro-batches on dp=2, pp=2; one (MoE) layer a block, which
# compiles in two thirds of the time of the tiny preset's two.
MODEL = utils.override(utils.PRESETS["tiny"], model_dimension=64, layers_per_block=1, T=128, vocab_size=512,
                       n_device_axis=(2, 2, 1), train_batch_size=16, micro_batch_size=2, remat="none", max_tokens=0)


def mesh_for(cfg):
    return sharding.run_mesh(cfg.run)


def test_every_setting_is_valid_and_keeps_the_global_batch():
    singles, with_compute, pairs = tradeoffs.candidates(MODEL, 8)
    assert [c for c, _ in singles] == [{"remat": "full"}, {"train_batch_size": 8, "grad_step": 2},
                                       {"train_batch_size": 4, "grad_step": 4}, {"micro_batch_size": 4},
                                       {"expert_parallel": True}, {"fsdp_gather": "tick"}]
    assert with_compute == [], "nothing to save compute on: --remat none recomputes nothing"
    full = utils.override(MODEL, remat="full")
    assert [c for c, _ in tradeoffs.candidates(full, 8)[1]] == [
        {"remat": "dots", "train_batch_size": 8, "grad_step": 2}, {"remat": "dots", "train_batch_size": 4, "grad_step": 4},
        {"remat": "dots", "micro_batch_size": 4}, {"remat": "dots", "expert_parallel": True},
        {"remat": "dots", "fsdp_gather": "tick"}]
    assert len(pairs) == 15 - 1, "each two of the six, less --grad_step 2 with --grad_step 4"
    for change, cfg in singles + pairs:
        assert utils.sequences_per_step(cfg) == utils.sequences_per_step(MODEL), change
        assert utils.override(MODEL, **change) == cfg, change


def test_no_setting_is_compiled_that_cannot_change_this_mesh():
    """On one device (a one-chip TPU VM, where each compile takes the chip's compiler most of a minute): no
    micro-batches without a pipeline to fill (one stage keeps them all; the chip planned more with them), no expert
    parallelism without a second dp rank, no FSDP staging without FSDP shards."""
    singles, _, _ = tradeoffs.candidates(utils.override(MODEL, n_device_axis=(1, 1, 1)), 1)
    assert [c for c, _ in singles] == [{"remat": "full"}, {"train_batch_size": 8, "grad_step": 2},
                                       {"train_batch_size": 4, "grad_step": 4}]


def test_the_printed_command_parses_to_the_chosen_config():
    argv = ["--preset", "tiny", "--grad_step", "1", "--remat=dots", "--expert_parallel", "--T", "64", "--name", "a b"]
    change = {"grad_step": 2, "remat": "full", "expert_parallel": True, "train_batch_size": 8}
    line = tradeoffs.command(argv, change)
    assert line == ("python main.py --preset tiny --T 64 --name 'a b' --grad_step 2 --remat full "
                    "--expert_parallel true --train_batch_size 8")
    parsed = utils.config_from_args(shlex.split(line)[2:])
    assert utils.config_from_args(argv) != parsed
    assert parsed == utils.override(utils.config_from_args(argv), **change)


def test_the_choice_is_the_cheapest_compiled_plan_that_fits():
    """The as-given plan on this CPU mesh, a budget below it: the planner compiles the settings, and the one
    it picks fits and costs no more than any other that fits."""
    mesh = mesh_for(MODEL)
    as_given = measure.train_plan(MODEL, mesh).gib
    budget = 0.7 * as_given
    chosen, compiled = tradeoffs.cheapest_fit(MODEL, 8, budget, lambda c: measure.train_plan(c, mesh), say=lambda _: None)
    assert chosen is not None and chosen.gib <= budget < as_given, [(p.changes, p.gib) for p in compiled]
    assert all(tradeoffs.cost(chosen) <= tradeoffs.cost(p) for p in compiled if p.fits(budget))
    assert any(not p.fits(budget) for p in compiled), "a budget every setting meets tests no choice"


def test_grad_step_plans_less_memory_for_the_same_global_batch():
    """--grad_step N with 1/N of the sequences a pass: at most 1/N of the activations (plus a gradient's
    accumulator), never more than one pass of them all."""
    mesh = mesh_for(MODEL)
    plans = {n: measure.train_plan(utils.override(MODEL, train_batch_size=16 // n, grad_step=n), mesh).gib
             for n in (1, 2, 4)}
    assert plans[1] > plans[2] > plans[4], plans
    state = jax.tree.leaves(build_trainer(MODEL, mesh).abstract_state)
    state_gib = sum(measure.shard_bytes(a) for a in state) / measure.GiB
    assert plans[2] - state_gib <= 0.6 * (plans[1] - state_gib), plans


def test_more_micro_batches_never_plan_more_memory():
    mesh = mesh_for(MODEL)
    plans = [measure.train_plan(utils.override(MODEL, micro_batch_size=m), mesh).gib for m in (2, 4, 8)]
    assert plans == sorted(plans, reverse=True), plans


def test_a_run_with_fit_says_its_plan_and_trains_as_given_when_it_fits(cpu_env, tmp_path):
    """... with the train step --fit compiled: jax logs each compile (JAX_LOG_COMPILES), and there is one."""
    proc = run(cpu_env, tmp_path, *MESH1, "--fit", steps=2, extra_env={"JAX_LOG_COMPILES": "1"})
    assert "--fit: the train step plans" in proc.stdout and "the run goes as given" in proc.stdout, proc.stdout[-2000:]
    assert proc.stderr.count("Finished XLA compilation of jit(train_step)") == 1, proc.stderr[-3000:]


@pytest.mark.slow("~10 min: two rehearsals for v4-8, the first compiling 5 settings")
def test_compile_for_prints_a_command_that_fits_and_fit_rehearses_it(tmp_path):
    """A config whose train step does not fit a v4-8: --compile_for names a setting and its command (exit 1);
    that command prints fits (exit 0)."""
    pytest.importorskip("libtpu", reason="pip install -r requirements-tpu.txt")
    args = ["--preset", "tiny", "--n_device_axis", "2", "2", "1", "--T", "2048", "--train_batch_size", "128",
            "--micro_batch_size", "2", "--compile_for", "v4-8"]
    main = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), *a], cwd=tmp_path,
                                     capture_output=True, text=True, timeout=2 * CEILING_S)
    first = main(*args)
    assert first.returncode == 1 and "does not fit: train step" in first.stdout, first.stdout[-3000:]
    command = next(line.strip() for line in first.stdout.splitlines() if line.strip().startswith("python main.py"))
    second = main(*shlex.split(command)[2:])
    assert second.returncode == 0 and "fits on v4-8" in second.stdout, second.stdout[-3000:]

