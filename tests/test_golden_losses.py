"""The embedded default's first steps still train as they did: the losses of `python main.py`'s first
steps (the tiny preset on the bundled corpus, here in fp32, on one device) equal those recorded in
tests/golden/losses/tiny_fp32.json, to a relative 3e-7 (3.6e-6 at a loss of 12).

The tolerance was measured (docs/performance-log.md#2026-12-01-golden-losses-issue-26): another x86 instruction set
(--xla_cpu_max_isa=SSE4_2 instead of AVX-512, or AVX2) or 8 simulated devices instead of 1 moves these
losses by at most 1e-6, while one changed op moves them by more (the exact GELU for the tanh one in the
dense FFN: 1.1e-5; RMSNorm's epsilon 1e-5 for 1e-6: 7.7e-4). A change meant to alter the training
updates the file in the same commit, saying why:

    python tests/test_golden_losses.py --update
"""
import json
import os
import sys

if __name__ == "__main__":          # run as a script: the environment conftest.py gives the tests
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "losses", "tiny_fp32.json")
STEPS, RTOL = 8, 3e-7


def first_losses(steps=STEPS):
    """The training losses of the tiny preset's first `steps` steps in fp32, as main.py trains them."""
    import dataset
    import main
    from trainer import build_trainer
    import sharding
    import utils
    cfg = utils.config_from_args(["--model_dtype", "float32"])
    trainer = build_trainer(cfg, sharding.run_mesh(cfg.run))
    train_ds = main.load_data(cfg, trainer.data_sharding)[0]
    loader = dataset.BatchLoader(train_ds, cfg.model.T, utils.global_batch(cfg), trainer.data_sharding, cfg.run.seed)
    state, losses = trainer.fresh_state(cfg.run.seed), []
    for step in range(steps):
        x, y = loader.batch(step)
        state, metrics = trainer.step(state, ((x,), (y,)))
        losses.append(float(metrics["loss"]))
    return losses


def test_the_first_steps_train_as_recorded(bundled_shards):
    with open(GOLDEN) as f:
        golden = json.load(f)
    np.testing.assert_allclose(first_losses(), golden, rtol=RTOL, err_msg=(
        "the tiny preset's first losses moved; if the change is meant, run python tests/test_golden_losses.py "
        "--update and say why in the commit"))


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(__doc__)
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    losses = first_losses()
    with open(f"{GOLDEN}.tmp", "w") as f:
        json.dump(losses, f, indent=1)
    os.replace(f"{GOLDEN}.tmp", GOLDEN)
    print(f"{GOLDEN}: {losses}")
