"""Every test sees 8 simulated CPU devices (set before JAX is imported anywhere), and the fixtures the
test modules share.

- `jaxformer_cache`: one cache directory for the session (bundled shards, wandb files), never ~/.cache.
- `bundled_shards`: the bundled corpus tokenized once per session into it (dataset.ensure_bundled_shards).
- `src`, `reference_run`: a small gzipped JSON Lines source (data_util.tokenize_docs) and its
  uninterrupted tokenization in shards of data_util.SHARD tokens (1 val shard, the rest train), what the
  crash-resume tests compare against byte for byte.
- `cpu_env`: the environment for a subprocess of this repository on CPU (main.py, bench.py, ...): no
  inherited JAXFORMER_/WANDB_ variables or device-count flag, wandb disabled, unbuffered output, the
  session's cache directory and its persistent XLA compilation cache (XLA_CACHE, this process' too).
- `gcs_emulator`: a local GCS server (data/emulator.py) for a test module, this process pointed at it;
  the value is the environment that points a subprocess at it.
- `tmux_env`: tests/launch_util.py's environment for a launch script, its private tmux server killed
  afterwards (no session may outlive the test); `launch_cache`: launcher.sh flags that give the
  processes it starts the same compilation cache.

README runs the suite as `pytest -n 2 --dist loadfile`: each test module on one pytest-xdist worker, so its
module-scoped fixtures (a trained run, an export, a bucket's shards) are built once. (`--dist loadgroup` with
`xdist_group` marks no longer groups: xdist 3.8 names a group by rewriting `item._nodeid`, which pytest 9 does
not read, so it dealt every test apart.) xdist deals the modules in collection order, and the modules that take
minutes (LONGEST_FIRST) come first: dealt by their number of tests, as xdist would, the long ones with few tests
(test_hang, test_launch_supervisor) came last, one running alone at the end while the other worker sat idle.
"""
import atexit
import gzip
import json
import os
import shutil
import signal
import sys
import tempfile

import pytest

from xla_cpu import UNOPTIMIZED

os.environ["JAX_PLATFORMS"] = "cpu"
# Ctrl-C heard, in this process and the ones it starts, as in a terminal's foreground: a suite started in the
# background (nohup, `&`) inherits SIGINT ignored, which main.py rightly keeps, and its Ctrl-C test would hang.
signal.signal(signal.SIGINT, signal.default_int_handler)
# One persistent XLA compilation cache for the session, in this process, in its subprocesses (cpu_env) and in the
# pytest-xdist workers, which inherit it from the process that made it (pytest's own, which imports this file
# before it starts them): a program compiled once (a trainer built again, main.py started again, on either
# worker) is read back, not compiled again.
XLA_CACHE = os.environ.get("JAXFORMER_TESTS_XLA_CACHE")
if XLA_CACHE is None:
    XLA_CACHE = os.environ["JAXFORMER_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxformer-xla-cache-")
    atexit.register(shutil.rmtree, XLA_CACHE, True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=XLA_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"])
# XLA at -O0 with its elemental fusion emitters (xla_cpu.UNOPTIMIZED) in this process only: the in-process tests
# mostly compile, which that does 2-3x faster, while its programs run slower, which would cost the main.py
# subprocesses' shared programs more than it saves, and --compile_for must plan what a pod runs. XLA reads its
# flags once, when its first backend starts, so the environment subprocesses inherit is put back right after
# (docs/performance-log.md#2026-12-03-suite-time).
SUBPROCESS_XLA_FLAGS = os.environ["XLA_FLAGS"]
os.environ["XLA_FLAGS"] = f"{SUBPROCESS_XLA_FLAGS} {UNOPTIMIZED}"
import jax
jax.devices()
os.environ["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The modules that take minutes, longest first (each alone, with --durations, 2026-12-07: test_run_safety 10 minutes
# under load, test_launch_multihost 2); the rest follow in their order. A module missing here is dealt later, not lost.
LONGEST_FIRST = ("test_run_safety.py", "test_model.py", "test_main.py", "test_gcs.py", "test_tasks.py", "test_pod.py",
                 "test_planner.py", "test_stop_points.py", "test_spikes.py", "test_launch_supervisor.py",
                 "test_accelerator_program.py", "test_hang.py", "test_tpu_attention.py", "test_bench.py",
                 "test_newcomer.py", "test_convert.py", "test_run_output.py", "test_harness_tasks.py", "test_fit.py",
                 "test_launch_multihost.py")


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.option.loadscopereorder = False      # deal the modules in collection order (LONGEST_FIRST's)
    # a deprecated optax call is code to update (optax.global_norm warned 78 times a CI run), not noise
    config.addinivalue_line("filterwarnings", "error::DeprecationWarning:optax")
    config.addinivalue_line("markers", "slow(cost): an opt-in check, run with JAXFORMER_SLOW_TESTS=1; cost says what "
                                       "it takes")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow are skipped unless JAXFORMER_SLOW_TESTS=1, the one place that says so; the modules in
    LONGEST_FIRST's order ahead of the rest (a stable sort: each module's tests keep theirs)."""
    for item in items:
        if (slow := item.get_closest_marker("slow")) is not None and os.environ.get("JAXFORMER_SLOW_TESTS") != "1":
            item.add_marker(pytest.mark.skip(reason=f"opt-in (JAXFORMER_SLOW_TESTS=1): {slow.args[0]}"))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def jaxformer_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jaxformer_cache"))


@pytest.fixture(scope="session")
def bundled_shards(jaxformer_cache):
    import dataset
    return dataset.ensure_bundled_shards(jaxformer_cache)


@pytest.fixture(scope="session")
def src(tmp_path_factory):
    from data_util import tokenize_docs
    path = tmp_path_factory.mktemp("src") / "docs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for t in tokenize_docs():
            f.write(json.dumps({"text": t, "meta": 1}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def reference_run(src, tmp_path_factory):
    from data import shards
    from data_util import SHARD
    out = str(tmp_path_factory.mktemp("ref") / "out")
    shards.tokenize(out, shards.make_plan(src, val_shards=1), SHARD)
    return out


@pytest.fixture(scope="session")
def cpu_env(jaxformer_cache):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "JAXFORMER_"))}
    e.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", WANDB_MODE="disabled", JAXFORMER_CACHE=jaxformer_cache,
             XLA_FLAGS=" ".join(f for f in e.get("XLA_FLAGS", "").split() if "device_count" not in f))
    return e


@pytest.fixture(scope="session")
def launch_cache(cpu_env):
    """launcher.sh flags that give the processes it starts cpu_env's persistent compilation cache: a run
    launched again (a relaunch after a preemption, the next test's hosts) reuses the programs compiled."""
    names = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
    return [a for name in names for a in ("--env", f"{name}={cpu_env[name]}")]


@pytest.fixture(scope="module")
def gcs_emulator():
    from data import emulator
    proc, url = emulator.start(bucket="jaxformer")
    restore = emulator.point_this_process_at(url)
    yield emulator.emulator_env(url)
    proc.terminate()
    proc.wait(timeout=30)
    restore()


@pytest.fixture
def tmux_env(tmp_path):
    import launch_util
    e = launch_util.launch_env(tmp_path)
    yield e
    launch_util.kill_tmux(e)
    assert launch_util.sessions(e) == [], "a tmux session outlived the test"
