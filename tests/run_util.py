"""Helpers shared by the tests that run main.py as a user would, a subprocess on CPU: TINY_FLAGS (a run of
small_configs' model), the meshes MESH1 and MESH8, `run` (to its end) and `start` (in the background), waiting on
a run's metrics.jsonl and checkpoints, SPAN (a span of time in a log line), `unoptimized` (XLA at -O0) and
`mount` (a read-only or full directory for a run to meet)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from ceiling import CEILING_S
from small_configs import SMALL_FLAGS
from xla_cpu import UNOPTIMIZED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_FLAGS = SMALL_FLAGS + ("--vocab_size 100277 --micro_batch_size 2 --model_dtype float32 --val_batch_size 2 "
                            "--eval_steps 1 --max_tokens 0 --checkpoint_steps 1 --bias_update_rate 1e-2").split() + [
    "--eval_tasks", ""]            # tasks cost each run seconds: test_tasks.py and the goodput test score them
N = 20              # steps; checkpoints every 10 x --checkpoint_steps = 10 steps, so at 10 and 20
# (1,1,1) with 8 sequences per replica and (2,2,2) with 4 see the same global batch of 8; each keeps the
# validation set it had when --val_batch_size counted per replica (2 on (1,1,1), 2 x 2 on (2,2,2)).
MESH1 = "--n_device_axis 1 1 1 --train_batch_size 8".split()
MESH8 = "--n_device_axis 2 2 2 --train_batch_size 4 --val_batch_size 4 --cpu_devices 8".split()
SPAN = r"\d+(\.\d)? (s|min|h)"      # a span of time in a log line (metrics.duration: minutes past 120 s, as when loaded)


def unoptimized(env):
    """env's XLA flags with XLA at -O0 and its elemental fusion emitters (xla_cpu.UNOPTIMIZED), for a run of a
    program no other test compiles: a cold compile of the training step takes seconds that way where -O2 takes
    minutes (loaded), and a run of a few steps never earns -O2's compile back
    (docs/performance-log.md#2026-12-07-suite-time). Programs the suite shares stay at -O2: the persistent cache
    holds them once, and -O0 runs their many steps slower."""
    return {"XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {UNOPTIMIZED}".strip()}


def run(cpu_env, out, *args, steps=N, extra_env=None, expect=0, timeout=CEILING_S):
    e = dict(cpu_env, **(extra_env or {}))
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, "--output_dir", str(out), "--name", "run",
           "--training_steps", str(steps), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != expect:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}, expected {expect}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def start(cpu_env, out, log, *args, steps=100_000):
    """main.py in the background, its stdout and stderr in the files LOG.out and LOG.err."""
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, "--output_dir", str(out), "--name", "run",
           "--training_steps", str(steps), *args]
    with open(f"{log}.out", "w") as stdout, open(f"{log}.err", "w") as stderr:
        return subprocess.Popen(cmd, cwd=REPO, env=cpu_env, stdout=stdout, stderr=stderr)


def wait_for(proc, log, condition, what, timeout=CEILING_S):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"exit {proc.returncode} before {what}:\n{open(f'{log}.err').read()[-3000:]}"
        if condition():
            return
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no {what} in {timeout} s")


def records(out, name="run"):
    """metrics.jsonl's records (a line cut short by a SIGKILL is skipped)."""
    path = os.path.join(out, name, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().splitlines()
    result = []
    for line in lines:
        try:
            result.append(json.loads(line))
        except ValueError:
            pass
    return result


def last_step(out):
    return max([r["step"] for r in records(out) if "loss" in r], default=0)


def wait_for_step(proc, out, log, step):
    """Until metrics.jsonl shows `step` (the process is then inside the training loop)."""
    wait_for(proc, log, lambda: last_step(out) >= step, f"step {step}")


def checkpoints(out):
    path = os.path.join(out, "run", "checkpoints")
    return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def mount(*args):
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount here ({proc.stderr.strip()}): a read-only or full directory needs a mount")


def assert_final_line_compares_with_the_unigram_entropy(stdout):
    """main.py's final line says how far the val cross-entropy is below (or above) the unigram entropy, the gap
    unsigned and the word true."""
    m = re.search(r"^final: val cross-entropy ([\d.]+) nats.*unigram entropy of the training tokens ([\d.]+) nats \| "
                  r"([\d.]+) nats (below|above) it \|", stdout, re.M)
    assert m, stdout[-2000:]
    val, entropy, gap = (float(m[i]) for i in (1, 2, 3))
    assert m[4] == ("below" if val <= entropy else "above") and abs(gap - abs(entropy - val)) <= 2e-4, m[0]
