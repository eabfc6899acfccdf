"""Real multi-process launches through launcher.sh and run.sh: two "hosts" on 127.0.0.1 (the SSH
stand-in tests/launch_local_ssh.sh runs each host's command locally in a clean environment), each a
jax process with 4 CPU devices joined by jax.distributed over gloo into one (2, 2, 2) mesh (the
stop-agreement test: one device each, launch_util.SMALL)."""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from launch_util import ONE_DEVICE, ROOT, SECRET, SMALL, all_text, free_port, needs_tmux, sh
from ceiling import CEILING_S

# 2 processes against 1 on one mesh, fp32: the collectives sum in another order (measured: at most
# 8.4e-8, one ulp, over 4 steps); a wrong shard of the data or of the state moves the loss by ~1e-2.
RTOL = 1e-6

pytestmark = needs_tmux


@pytest.fixture
def two_hosts(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("127.0.0.1\n127.0.0.1\n")
    return f


def launch(tmux_env, hosts, tmp_path, name, main_args, main=None, timeout=CEILING_S, extra=()):
    extra = [*extra, *(["--main", main] if main else [])]
    return sh("launcher.sh", "--hosts", hosts, "--name", name, "--coordinator", f"127.0.0.1:{free_port()}",
              "--python", sys.executable, "--log-dir", tmp_path / "host-logs", "--local-logs",
              tmp_path / "local-logs", "--wait", *extra, "--", *main_args, env=tmux_env, timeout=timeout)


def test_two_processes_psum_over_gloo(tmux_env, two_hosts, tmp_path):
    """The launch machinery end to end with a stand-in program: a psum over all 8 devices of both
    processes gives 1 + 2 + ... + 8 on every device of every process."""
    out = tmp_path / "psum-{pid}.json"
    p = launch(tmux_env, two_hosts, tmp_path, "psum", [str(out)], main="tests/launch_psum.py")
    assert p.returncode == 0, p.out + all_text(tmp_path / "local-logs")
    for pid in (0, 1):
        r = json.loads((tmp_path / f"psum-{pid}.json").read_text())
        assert r["process_id"] == pid and r["process_count"] == 2
        assert r["device_count"] == 8 and r["local_device_count"] == 4
        assert r["psum"] == [36.0] * 4
        assert r["wandb_key_set"], "WANDB_API_KEY was not forwarded to the host"
    logs = all_text(tmp_path / "host-logs", tmp_path / "local-logs")
    assert "run.sh: exit status 0" in logs and "JAX_COORDINATOR_ADDRESS" not in p.out
    assert SECRET not in p.out + logs
    assert sorted(os.listdir(tmp_path / "local-logs")) == ["0-127.0.0.1.log", "1-127.0.0.1.log"]


def read_losses(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow("~1-2 min; test_gcs's two processes give one process's losses, and the supervisor and stop "
                  "tests launch two hosts, in default CI")
def test_two_host_training_matches_single_process(tmux_env, launch_cache, two_hosts, tmp_path):
    """A tiny config trained on a (2, 2, 2) mesh spanning two processes (4 devices each) through
    launcher.sh and run.sh checkpoints and logs the same losses as one process with 8 devices, in
    fp32: one program on other collectives (gloo's) gives the same numbers. (In bf16 a one-ulp
    difference can flip a routing choice: the losses then differ by ~3e-5 after 4 steps, bf16's own
    noise, which says nothing about the processes. The supervisor and hang tests train 2-process bf16
    runs over gloo.)"""
    common = ["--preset", "tiny", "--model_dtype", "float32", "--n_device_axis", "2", "2", "2", "--T", "32",
              "--train_batch_size", "2",
              "--val_batch_size", "4", "--eval_steps", "1", "--max_tokens", "0", "--eval_tasks", "", "--training_steps", "4",
              "--checkpoint_steps", "2", "--output_dir", str(tmp_path / "runs")]
    p = launch(tmux_env, two_hosts, tmp_path, "multi", common + ["--name", "multi"], timeout=CEILING_S, extra=launch_cache)
    assert p.returncode == 0, p.out + all_text(tmp_path / "local-logs")
    run_dir = tmp_path / "runs" / "multi"
    saved = [os.path.join(b, x) for b, ds, fs in os.walk(run_dir) for x in ds + fs]
    assert any("checkpoint" in s or "ckpt" in s for s in saved), saved
    assert SECRET not in p.out + all_text(tmp_path / "host-logs", tmp_path / "local-logs")

    single_env = dict(tmux_env, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    single_env.pop("WANDB_API_KEY")
    s = subprocess.run([sys.executable, "main.py", *common, "--name", "single"], cwd=ROOT, env=single_env,
                       capture_output=True, text=True, timeout=CEILING_S)
    assert s.returncode == 0, s.stdout + s.stderr
    multi, single = read_losses(run_dir / "metrics.jsonl"), read_losses(tmp_path / "runs/single/metrics.jsonl")
    assert multi and sorted(multi) == sorted(single)
    steps = sorted(single)
    np.testing.assert_allclose([multi[k] for k in steps], [single[k] for k in steps], rtol=RTOL, atol=0)


def status(tmux_env, where, name):
    return sh("launcher.sh", "--status", name, *where, env=tmux_env, check=0).stdout


def wait_for(tmux_env, where, name, pattern, timeout):
    deadline = time.time() + timeout
    while not re.search(pattern, shown := status(tmux_env, where, name)):
        assert time.time() < deadline, f"no {pattern!r} within {timeout} s:\n{shown}"
        time.sleep(2)
    return shown


def test_stop_on_one_host_is_agreed_without_a_per_step_sync(tmux_env, launch_cache, two_hosts, tmp_path):
    """SIGTERM to process 1 only: both processes stop and save at the same step and exit 0, and the
    training driver synchronised the processes far less often than once a step (it used to gather
    the stop flag every step, which waits for the device and undoes the one-step-ahead dispatch)."""
    where = ["--hosts", two_hosts, "--log-dir", tmp_path / "host-logs"]
    count = tmp_path / "count-{pid}.json"
    # Checks every 10 s after the probe at step 5: the SIGTERM, 10 s after the first step, is agreed at the check
    # after it, about step 15 at a step a second (3 syncs); a step of 2.5 s (a loaded machine) leaves 4 steps a
    # check. (20 s made the run wait twice as long for that check.)
    p = sh("launcher.sh", *where, "--name", "agree", "--coordinator", f"127.0.0.1:{free_port()}",
           "--python", sys.executable, "--main", "tests/launch_count_allgather.py",
           "--local-logs", tmp_path / "local-logs", "--env", "JAXFORMER_STOP_CHECK_S=10",
           "--env", f"COUNT_OUT={count}", *launch_cache,
           "--", *SMALL, "--training_steps", "100000", "--checkpoint_steps", "1000",
           "--output_dir", tmp_path / "runs", "--name", "agree", env=dict(tmux_env, **ONE_DEVICE), timeout=CEILING_S)
    assert p.returncode == 0, p.out
    assert p.stdout.count("main.py passed start-up") == 2
    time.sleep(10)                                     # some steps, then SIGTERM to process 1 alone
    p = sh("run.sh", "127.0.0.1", "--name", "agree", "--index", "1", "--log-dir", tmp_path / "host-logs",
           "--stop", "--timeout", "300", env=tmux_env, check=0, timeout=330)
    assert "exit status 0" in p.stdout, p.out
    shown = wait_for(tmux_env, where, "agree", r"host 0 127\.0\.0\.1: ended", 120)
    assert "host 0 127.0.0.1: ended, exit status 0 |" in shown, shown
    ckpt = tmp_path / "runs" / "agree" / "checkpoints"
    steps = sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())
    assert len(steps) == 1 and 0 < steps[0] < 100000, steps       # one save, at the agreed step
    for pid in (0, 1):                                           # the old code: one call a step
        calls = json.loads((tmp_path / f"count-{pid}.json").read_text())["driver_allgather_calls"]
        assert 1 <= calls and 2 * calls <= steps[0], f"process {pid}: {calls} syncs in {steps[0]} steps"
    assert SECRET not in all_text(tmp_path / "host-logs", tmp_path / "local-logs")


def test_missing_host_times_out_with_one_line(tmux_env, tmp_path):
    """One of two processes never starts: main.py on the other one used to wait in
    jax.distributed.initialize with no message; now it exits after JAXFORMER_INIT_TIMEOUT with one
    line naming the coordinator and how many processes joined."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\nunreachable-1\n")
    port = free_port()
    p = sh("launcher.sh", "--hosts", hosts, "--name", "lonely", "--coordinator", f"127.0.0.1:{port}",
           "--keep-going", "--python", sys.executable, "--log-dir", tmp_path / "host-logs",
           "--local-logs", tmp_path / "local-logs", "--env", "JAXFORMER_INIT_TIMEOUT=5", "--", "--preset", "tiny",
           env=tmux_env, timeout=CEILING_S, check=1)
    assert "host 1 unreachable-1: FAILED, unreachable over SSH" in p.stderr
    assert "host 0 127.0.0.1: FAILED, exit status 1" in p.stderr, p.out
    log = (tmp_path / "host-logs" / "lonely-0.log").read_text()
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert errors == [f"error: jax.distributed: not every process joined within 5 s (JAXFORMER_INIT_TIMEOUT): "
                      f"1 of 2 processes joined the coordinator at 127.0.0.1:{port} (this process); start the "
                      f"missing host(s), or check JAX_NUM_PROCESSES"], log
    assert errors[0] in p.stderr                                      # the launcher shows it
