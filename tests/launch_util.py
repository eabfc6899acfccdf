"""Shared helpers for the launch-script tests: run the scripts with the local SSH stand-in, each test
with its own tmux server (TMUX_TMPDIR), killed afterwards so no session outlives a test."""
import os
import shutil
import socket
import subprocess
import sys

import pytest

from run_util import unoptimized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_SSH = os.path.join(ROOT, "tests", "launch_local_ssh.sh")
SCRIPTS = ["setup_tpu.sh", "launcher.sh", "run.sh", "debug_tpu.sh"]
LIB = "launch_lib.sh"   # sourced by launcher.sh, run.sh and debug_tpu.sh, not run on its own
SECRET = "wandb-secret-0123456789abcdef"


def launch_env(tmp_path, **extra):
    """Environment for a script under test: local SSH runner, private tmux server, 4 CPU devices per
    process, a fake WANDB_API_KEY that must never show up in any output."""
    tmux_dir = tmp_path / "tmux"
    tmux_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMUX", "JAX_", "SSH"))}
    env.update(SSH=LOCAL_SSH, TMUX_TMPDIR=str(tmux_dir), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4", WANDB_API_KEY=SECRET,
               WANDB_MODE="offline", TERM="xterm")
    env.update(extra)
    return env


# The runs the launch rehearsals start (a hang, a preemption, a stop agreed across hosts): two processes of
# one CPU device each on a (2, 1, 1) mesh, so that dp's collectives cross the processes over gloo, with the
# smallest config that trains on the bundled corpus. ONE_DEVICE: their environment's part (launch_env gives 4
# devices each), with XLA at -O0 (run_util.unoptimized): conftest's launch_cache gives process 0 the programs
# an earlier run compiled, but never process 1 (jax writes the persistent cache from process 0 only, and on CPU
# each process' key holds its own topology), so every session waits for process 1's cold compile of the
# training step, seconds at -O0 where -O2 takes 30-50; their few steps run slower, which costs less
# (test_hang 121 -> 95 s, the supervisor's preemption 105 -> 88 s, the stop agreement 104 -> 69 s).
SMALL = ["--preset", "tiny", "--n_device_axis", "2", "1", "1", "--T", "32", "--train_batch_size", "2",
         "--val_batch_size", "4", "--eval_steps", "1", "--max_tokens", "0", "--eval_tasks", ""]
ONE_DEVICE = unoptimized({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (CI installs it)")


def sh(script, *args, env, timeout=60, check=None, cwd=ROOT):
    """Run ROOT/script args in cwd; return CompletedProcess with .out = stdout + stderr."""
    p = subprocess.run([os.path.join(ROOT, script), *map(str, args)], cwd=cwd, env=env, timeout=timeout,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    p.out = p.stdout + p.stderr
    if check is not None:
        assert p.returncode == check, f"{script} {args}: exit {p.returncode}\n{p.out}"
    return p


def tmux(env, *args):
    return subprocess.run(["tmux", *args], env=env, capture_output=True, text=True, timeout=30)


def sessions(env):
    p = tmux(env, "list-sessions", "-F", "#{session_name}")
    return p.stdout.split() if p.returncode == 0 else []


def kill_tmux(env):
    tmux(env, "kill-server")


def path_without(tmp_path, *names):
    """A PATH directory holding every command of this machine's PATH except `names`."""
    d = tmp_path / ("path-without-" + "-".join(names))
    d.mkdir()
    for p in os.environ["PATH"].split(os.pathsep) + [os.path.dirname(sys.executable)]:
        if not os.path.isdir(p):
            continue
        for name in os.listdir(p):
            if name not in names and not (d / name).exists() and os.access(os.path.join(p, name), os.X_OK):
                (d / name).symlink_to(os.path.join(p, name))
    assert shutil.which("tmux", path=str(d)) is None or "tmux" not in names
    return str(d)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_text(*dirs):
    """Every file's text under dirs, concatenated (to check that no secret leaked into a log)."""
    chunks = []
    for d in dirs:
        for base, _, files in os.walk(d):
            for f in files:
                with open(os.path.join(base, f), errors="replace") as fh:
                    chunks.append(fh.read())
    return "\n".join(chunks)


def main_process(name, process_id):
    """The psutil.Process of run `name`'s main.py that is jax process `process_id`, or None."""
    import psutil
    for proc in psutil.process_iter(["cmdline", "environ"]):
        cmd, env = proc.info["cmdline"] or [], proc.info["environ"] or {}
        if any(c.endswith("main.py") for c in cmd) and name in cmd and env.get("JAX_PROCESS_ID") == str(process_id):
            return proc
    return None
