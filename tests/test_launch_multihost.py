"""Real multi-process launches through launcher.sh and run.sh: two "hosts" on 127.0.0.1 (the SSH
stand-in tests/launch_local_ssh.sh runs each host's command locally in a clean environment), each a
jax process with 4 CPU devices, joined by jax.distributed over gloo into one (2, 2, 2) mesh."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launch_util import ROOT, SECRET, all_text, env, free_port, needs_tmux, sh  # noqa: F401 (env: fixture)

pytestmark = needs_tmux


@pytest.fixture
def two_hosts(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("127.0.0.1\n127.0.0.1\n")
    return f


def launch(env, hosts, tmp_path, name, main_args, main=None, timeout=120):
    extra = ["--main", main] if main else []
    return sh("launcher.sh", "--hosts", hosts, "--name", name, "--coordinator", f"127.0.0.1:{free_port()}",
              "--python", sys.executable, "--log-dir", tmp_path / "host-logs", "--local-logs",
              tmp_path / "local-logs", "--wait", *extra, "--", *main_args, env=env, timeout=timeout)


def test_two_processes_psum_over_gloo(env, two_hosts, tmp_path):
    """The launch machinery end to end with a stand-in program: a psum over all 8 devices of both
    processes gives 1 + 2 + ... + 8 on every device of every process."""
    out = tmp_path / "psum-{pid}.json"
    p = launch(env, two_hosts, tmp_path, "psum", [str(out)], main="tests/launch_psum.py")
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


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "main.py")), reason="main.py not written yet")
def test_two_host_training_matches_single_process(env, two_hosts, tmp_path):
    """A tiny config trained on a (2, 2, 2) mesh spanning two processes (4 devices each) through
    launcher.sh and run.sh checkpoints and logs the same losses as one process with 8 devices."""
    common = ["--preset", "tiny", "--n_device_axis", "2", "2", "2", "--training_steps", "4",
              "--checkpoint_steps", "2", "--output_dir", str(tmp_path / "runs")]
    p = launch(env, two_hosts, tmp_path, "multi", common + ["--name", "multi"], timeout=600)
    assert p.returncode == 0, p.out + all_text(tmp_path / "local-logs")
    run_dir = tmp_path / "runs" / "multi"
    saved = [os.path.join(b, x) for b, ds, fs in os.walk(run_dir) for x in ds + fs]
    assert any("checkpoint" in s or "ckpt" in s for s in saved), saved
    assert SECRET not in p.out + all_text(tmp_path / "host-logs", tmp_path / "local-logs")

    single_env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    single_env.pop("WANDB_API_KEY")
    s = subprocess.run([sys.executable, "main.py", *common, "--name", "single"], cwd=ROOT, env=single_env,
                       capture_output=True, text=True, timeout=600)
    assert s.returncode == 0, s.stdout + s.stderr
    multi, single = read_losses(run_dir / "metrics.jsonl"), read_losses(tmp_path / "runs/single/metrics.jsonl")
    assert multi and sorted(multi) == sorted(single)
    steps = sorted(single)
    np.testing.assert_allclose([multi[k] for k in steps], [single[k] for k in steps], rtol=1e-5, atol=1e-6)
