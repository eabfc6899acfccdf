"""Compile a tree's training step for one H200 on this CPU (XLA:GPU given measure.H200_DESCRIPTION, no GPU) and
write what scripts/refit_estimate.py reads: RUN_DIR/NAME.hlo.txt (the optimized per-device HLO) and
RUN_DIR/NAME.json (the flags, the tree's commit, XLA's memory plan and, with --step_s and --timed, the step time
measured for that program on an H200 and the day it was). This is how the estimate is calibrated on the programs that were timed: check
the measured commit out with `git worktree add /tmp/measured COMMIT` and compile its steps with --tree.

  .venv-gpu/bin/python scripts/compile_h200.py RUN_DIR NAME [--tree DIR] [--trace_backend gpu] [--step_s S --timed DAY] \\
      -- --preset moe1B --n_device_axis 1 1 1 --train_batch_size 8 --micro_batch_size 1 --remat full

--tree DIR compiles DIR's modules (its utils.config_from_args and bench.build_step) instead of this repo's.
--trace_backend gpu: trees older than the accelerator's program (2026-12-01) chose cuDNN attention and bf16
operands by jax.default_backend() while tracing, which is "cpu" here; this makes it answer "gpu", as it did
on the H200 that timed them.
"""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402

import hardware  # noqa: E402
from planning import measure  # noqa: E402


def use_tree(tree):
    """Import the project's modules from `tree` from now on: this repo's leave sys.modules (jax and the
    other installed packages stay, a virtualenv inside the repo included)."""
    for name, module in list(sys.modules.items()):
        path = os.path.relpath(os.path.abspath(getattr(module, "__file__", None) or "/"), REPO)
        if not path.startswith("..") and "site-packages" not in path:
            del sys.modules[name]
    sys.path.remove(REPO)
    sys.path.insert(0, tree)


def make_mesh(shape, devices):
    """The tree's mesh function: sharding.make_mesh now, model.make_mesh before sharding.py existed."""
    import importlib
    for module in ("sharding", "model"):
        try:
            return importlib.import_module(module).make_mesh(shape, devices)
        except (ImportError, AttributeError):
            continue
    raise SystemExit("the tree has neither sharding.make_mesh nor model.make_mesh")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("name")
    parser.add_argument("--tree", default=REPO, help="the source tree to compile (default: this repo)")
    parser.add_argument("--trace_backend", choices=("gpu",), help="jax.default_backend() while tracing")
    parser.add_argument("--step_s", type=float, help="the step time measured for this program on an H200")
    parser.add_argument("--timed", help="the day it was measured (YYYY-MM-DD)")
    args = parser.parse_args(ours)
    tree = os.path.abspath(args.tree)
    measure.compile_only_cuda()
    devices = measure.target_devices(hardware.compile_target("h200"))
    if tree != REPO:
        use_tree(tree)
    if args.trace_backend:
        jax.default_backend = lambda: args.trace_backend
    import bench
    import utils as tree_utils
    cfg = tree_utils.config_from_args(flags)
    step, _, _, abstract_args = bench.build_step(cfg, make_mesh(cfg.run.n_device_axis, devices))
    wall = time.perf_counter()
    compiled = step.lower(*abstract_args()).compile()
    wall = time.perf_counter() - wall
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, args.name + ".hlo.txt"), "w") as f:
        f.write(compiled.as_text())
    mem = compiled.memory_analysis()
    commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"name": args.name, "source": "deviceless XLA:GPU compile (no autotuning)", "tree": commit or tree,
              "flags": flags, "env": {k: v for k, v in os.environ.items() if k.startswith("JAX_DEFAULT_PRNG")},
              "jax_version": jax.__version__, "compile_s": wall,
              "compiled_memory_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                           + mem.temp_size_in_bytes - mem.alias_size_in_bytes),
              "step_time_median_s": args.step_s, "timed": args.timed}
    with open(os.path.join(args.run_dir, args.name + ".json"), "w") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
