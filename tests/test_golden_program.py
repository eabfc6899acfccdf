"""The compiled program is what the code says, not an accident: the lowered training and eval steps of a
few configs, as StableHLO text (no source locations, so it depends on the code and the pinned jax
alone, not on the machine), equal the goldens in tests/golden/programs/. A change that keeps the math
(a refactor, a move between files) keeps them; a change that alters the program updates them on
purpose, in the same commit, saying why:

    python tests/test_golden_program.py --update        # rewrites tests/golden/programs/*.stablehlo.gz

On a mismatch the test prints a unified diff of the first differing lines.
"""
import difflib
import gzip
import os
import sys

import pytest

if __name__ == "__main__":          # run as a script: the environment conftest.py gives the tests
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from trainer import abstract_step_args, build_trainer
import sharding
import utils

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "programs")
# The tiny preset, with a small vocabulary so that the programs stay small; each case adds flags.
BASE = ["--preset", "tiny", "--vocab_size", "1000", "--T", "32", "--train_batch_size", "4", "--val_batch_size", "8",
        "--micro_batch_size", "2", "--dropout_rate", "0.1", "--max_tokens", "8"]
CASES = {
    "fp32-111": ["--model_dtype", "float32", "--n_device_axis", "1", "1", "1"],
    "fp32-222": ["--model_dtype", "float32", "--n_device_axis", "2", "2", "2"],
    "bf16-111": ["--n_device_axis", "1", "1", "1"],
    "bf16-222": ["--n_device_axis", "2", "2", "2"],
    "bf16-412-ep": ["--n_device_axis", "4", "1", "2", "--expert_parallel", "true"],
    "bf16-121-r2": ["--n_device_axis", "1", "2", "1", "--blocks", "4", "--pipeline_repeats", "2"],
    "bf16-111-remat": ["--n_device_axis", "1", "1", "1", "--remat", "full"],      # moe1B's per-layer remat
    "bf16-222-2slices": ["--n_device_axis", "2", "2", "2", "--n_slices", "2"],      # dp 2 = 2 slices of 1
}


def programs(case):
    """{"train": StableHLO text, "eval": StableHLO text} of main.py's jitted steps for CASES[case]."""
    cfg = utils.config_from_args(BASE + CASES[case])
    utils.validate(cfg, jax.device_count())
    mesh = sharding.run_mesh(cfg.run)
    trainer = build_trainer(cfg, mesh)
    train_args, eval_args = abstract_step_args(cfg, trainer)
    return {"train": trainer.step.lower(*train_args).as_text(), "eval": trainer.eval_step.lower(*eval_args).as_text()}


def golden_path(case, step):
    return os.path.join(GOLDEN, f"{case}.{step}.stablehlo.gz")


@pytest.mark.parametrize("case", sorted(CASES))
def test_lowered_steps_equal_the_goldens(case):
    for step, text in programs(case).items():
        with gzip.open(golden_path(case, step), "rt") as f:
            golden = f.read()
        if text != golden:
            diff = list(difflib.unified_diff(golden.splitlines(), text.splitlines(), "golden", "now", n=2, lineterm=""))
            changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
            pytest.fail(f"the {step} step of {case} ({' '.join(CASES[case])}) is not its golden program: {changed} "
                        f"lines differ. If the change is meant, run python tests/test_golden_program.py --update and "
                        f"say why in the commit.\n" + "\n".join(line[:200] for line in diff[:80]))


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(__doc__)
    os.makedirs(GOLDEN, exist_ok=True)
    for case in sorted(CASES):
        for step, text in programs(case).items():
            tmp = golden_path(case, step) + ".tmp"
            with gzip.GzipFile(tmp, "wb", mtime=0) as f:      # mtime 0: the same text, the same bytes
                f.write(text.encode())
            os.replace(tmp, golden_path(case, step))
            print(f"{golden_path(case, step)}: {len(text):,} characters")
