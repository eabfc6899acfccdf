"""launcher.sh --retries: the supervisor that relaunches a run after a preemption and leaves a bug alone.
Hosts are 127.0.0.1 through the SSH stand-in (tests/launch_local_ssh.sh); the TPU's state comes from a
fake `gcloud` on PATH."""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import launch_util
from launch_util import all_text, free_port, main_process, needs_tmux, sh
from ceiling import CEILING_S

pytestmark = needs_tmux


def test_a_run_that_fails_the_same_way_twice_is_not_retried_again(tmux_env, tmp_path):
    runs = tmp_path / "runs.txt"
    bad = tmp_path / "bad.py"
    bad.write_text(f"open({str(runs)!r}, 'a').write('run\\n')\n"
                   "print('step      3 | loss 7.0000 | val 7.1000', flush=True)\nraise SystemExit(1)\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("hostE\n")
    p = sh("launcher.sh", "--hosts", hosts, "--name", "bug", "--retries", "3", "--python", sys.executable,
           "--main", bad, "--log-dir", tmp_path / "logs", "--local-logs", tmp_path / "ll", env=tmux_env,
           timeout=CEILING_S, check=1)
    assert "launcher.sh: retry 1 of 3 after: host 0 hostE: FAILED, exit status 1 at step 3" in p.out, p.out
    assert "the run failed the same way twice (host 0 hostE: FAILED, exit status 1 at step 3)" in p.out
    assert runs.read_text().count("run") == 2 and "retry 2 of" not in p.out


FAKE_GCLOUD = """#!/bin/sh
# gcloud compute tpus tpu-vm describe NAME --zone Z --format=...: two workers on 127.0.0.1; the state is
# READY until $PREEMPTED exists (the test's preemption), then PREEMPTED until $CREATED exists (what
# --recreate makes)
echo "$*" >> "$GCLOUD_LOG"
case "$*" in
  *"value(state)"*) if [ -e "$PREEMPTED" ] && [ ! -e "$CREATED" ]; then echo PREEMPTED; else echo READY; fi ;;
  *) echo "127.0.0.1;127.0.0.1" ;;
esac
"""
SMALL = [*launch_util.SMALL, "--checkpoint_steps", "1"]
STEPS = 16                  # checkpoints every 10 x --checkpoint_steps: at 10 and the last step


def losses(path):
    """(step, loss) of every step record metrics.jsonl holds, in order (after a restart, the redone steps
    twice)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_a_preempted_run_comes_back_by_itself_with_the_same_losses(tmux_env, launch_cache, tmp_path):
    """Worker 1 of a fake TPU goes away (its process killed, the TPU PREEMPTED) after the checkpoint of step
    10: the supervisor recreates the TPU, sets up its hosts and relaunches; the run resumes from step 10
    and the steps it does again have the losses they had, bit for bit, up to its last step."""


    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    env = dict(tmux_env, **launch_util.ONE_DEVICE, PATH=f"{bin_dir}:{tmux_env['PATH']}", GCLOUD_LOG=str(tmp_path / "gcloud.log"),
               PREEMPTED=str(tmp_path / "preempted"), CREATED=str(tmp_path / "created"), LAUNCHER_POLL_S="1")

    def launch(name, *extra):
        return ["launcher.sh", "--tpu", "fake", "--zone", "us-z1", "--name", name, "--coordinator",
                f"127.0.0.1:{free_port()}", "--python", sys.executable, "--log-dir", tmp_path / f"{name}-host-logs",
                "--local-logs", tmp_path / f"{name}-logs", *extra, *launch_cache, "--", *SMALL, "--training_steps", str(STEPS),
                "--output_dir", tmp_path / "runs"]

    recreate = f"echo creating the TPU again; touch {tmp_path / 'created'}"
    setup = f"echo set up >> {tmp_path / 'setup.log'}"               # on each host, over the SSH stand-in
    cmd = launch("preempted", "--retries", "2", "--recreate", recreate, "--setup", setup)
    supervisor = subprocess.Popen([os.path.join(os.path.dirname(os.path.dirname(__file__)), cmd[0]), *map(str, cmd[1:])],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, ckpt = tmp_path / "runs" / "preempted" / "metrics.jsonl", tmp_path / "runs" / "preempted" / "checkpoints"
    deadline = time.time() + CEILING_S
    while not (ckpt.is_dir() and "10" in os.listdir(ckpt) and metrics.exists() and len(losses(metrics)) >= 12):
        assert supervisor.poll() is None and time.time() < deadline, supervisor.stdout.read()
        time.sleep(0.5)
    host1 = main_process("preempted", 1)
    assert host1 is not None
    (tmp_path / "preempted").touch()                       # the TPU is preempted: its worker 1 goes away
    host1.kill()
    out, _ = supervisor.communicate(timeout=CEILING_S)
    assert supervisor.returncode == 0, out
    assert re.search(r"launcher.sh: retry 1 of 2 after: host 1 127\.0\.0\.1: FAILED, exit status \d+ at step \d+", out), out
    assert f"launcher.sh: TPU 'fake' is PREEMPTED; recreating it (--recreate): {recreate}\n    creating the TPU again\n" in out
    assert "launcher.sh: TPU 'fake' is READY\nlauncher.sh: setting up the 2 host(s) of the new TPU (--setup)" in out
    assert (tmp_path / "setup.log").read_text() == "set up\n" * 2, out
    assert "launcher.sh: run 'preempted' finished (attempts: 2)" in out, out
    logged = losses(metrics)
    restart = [i for i, (step, _) in enumerate(logged) if step == 11][1]        # the resumed session's first
    first, resumed = logged[:restart], logged[restart:]
    assert [s for s, _ in first] == list(range(1, len(first) + 1)) and len(first) >= 12, logged
    assert [s for s, _ in resumed] == list(range(11, STEPS + 1)), logged
    np.testing.assert_array_equal(resumed[:len(first) - 10], first[10:])      # the steps done again: same losses
    logs = all_text(tmp_path / "preempted-logs")
    assert "resumed from" in logs and "redone after the restart" in logs and "run goodput over 2 sessions" in logs
    print(out, *re.findall(r"^(?:resumed from|goodput|run goodput) .*$", logs, re.M), sep="\n")
