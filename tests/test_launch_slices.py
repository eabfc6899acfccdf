"""launcher.sh --tpu NAME1,NAME2: one run over several TPU slices. Two fake TPUs of 2 workers each, tpu-a
(slice 0) and tpu-b (slice 1), come from a fake `gcloud` on PATH that reads them from files, and whose
`tpu-vm ssh NAME --worker W` runs the command through the SSH stand-in (tests/launch_local_ssh.sh) as host
NAME-wW, so the 4 hosts are reached the way real TPU workers are. Programs are tests/launch_standin.py,
which prints the MEGASCALE_* and JAX_* environment its host got."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ceiling import CEILING_S
from launch_util import LOCAL_SSH, ROOT, needs_tmux, sessions, sh

pytestmark = needs_tmux
STANDIN = "tests/launch_standin.py"
TPUS = {"tpu-a": "10.0.0.1 10.0.0.2", "tpu-b": "10.0.1.1 10.0.1.2"}
HOSTS = [("tpu-a", 0, "10.0.0.1"), ("tpu-a", 1, "10.0.0.2"), ("tpu-b", 0, "10.0.1.1"), ("tpu-b", 1, "10.0.1.2")]

FAKE_GCLOUD = r"""#!/usr/bin/env bash
# gcloud compute tpus tpu-vm describe|ssh NAME ..., for the TPUs of $FAKE_TPUS: NAME/type, NAME/ips (its
# workers' IPs on one line) and NAME/state (READY when absent); no NAME/: NOT_FOUND. Calls go to $GCLOUD_LOG.
set -euo pipefail
echo "$*" >> "$GCLOUD_LOG"
verb=$4 name=$5 dir=$FAKE_TPUS/$5
[[ -d $dir ]] || { echo "ERROR: (gcloud.compute.tpus.tpu-vm.$verb) NOT_FOUND: $name" >&2; exit 1; }
if [[ $verb == ssh ]]; then                  # ... --worker W --command CMD
  shift 5
  while [[ $1 != --worker ]]; do shift; done
  [[ $3 == --command ]] && exec "$LOCAL_SSH" "$name-w$2" "$4"
fi
case $* in
  *"value(state)"*) cat "$dir/state" 2>/dev/null || echo READY ;;
  *"value(acceleratorType)"*) cat "$dir/type" ;;
  *"value(networkEndpoints[].ipAddress)"*) tr ' ' ';' < "$dir/ips" ;;
  *) echo "fake gcloud: unexpected call: $*" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def env(tmux_env, tmp_path):
    """The launch environment with the fake gcloud and its two TPUs (no SSH: hosts are reached by gcloud)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    for name, ips in TPUS.items():
        (tmp_path / "tpus" / name).mkdir(parents=True)
        (tmp_path / "tpus" / name / "type").write_text("v4-16\n")
        (tmp_path / "tpus" / name / "ips").write_text(ips + "\n")
    e = dict(tmux_env, PATH=f"{bin_dir}:{tmux_env['PATH']}", FAKE_TPUS=str(tmp_path / "tpus"),
             GCLOUD_LOG=str(tmp_path / "gcloud.log"), LOCAL_SSH=LOCAL_SSH,
             LOCAL_SSH_TRACE=str(tmp_path / "reached"), LAUNCHER_POLL_S="0.2")
    del e["SSH"]
    return e


def launcher(env, *args, check=None, tpus="tpu-a,tpu-b"):
    return sh("launcher.sh", "--tpu", tpus, "--zone", "z1", *args, env=env, check=check, timeout=CEILING_S)


def start_args(tmp_path, name="ms"):
    return ["--name", name, "--python", sys.executable, "--main", STANDIN, "--log-dir", tmp_path / "host-logs",
            "--local-logs", tmp_path / "local-logs"]


def reached(tmp_path):
    """The hosts the SSH stand-in ran a command on since the last call (NAME-wW each), sorted; then forgets them."""
    trace = tmp_path / "reached"
    names = sorted(trace.read_text().split()) if trace.exists() else []
    trace.write_text("")
    return names


def environments(tmp_path, name="ms"):
    """environments[i]: host i's stand-in environments, one dict per launch, in order (JAX_PLATFORMS left out)."""
    result = []
    for i in range(len(HOSTS)):
        log = tmp_path / "host-logs" / f"{name}-{i}.log"
        lines = [line.split()[2:] for line in (log.read_text() if log.exists() else "").splitlines()
                 if line.startswith("stand-in environment:")]
        result.append([{k: v for k, v in (kv.split("=", 1) for kv in words) if k != "JAX_PLATFORMS"}
                       for words in lines])
    return result


def expected_environment(i, coordinator_ip):
    return {"MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator_ip}:8081", "MEGASCALE_PORT": "8081",
            "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": str(i // 2),
            "JAX_COORDINATOR_ADDRESS": f"{coordinator_ip}:8476", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": str(i)}


def test_each_host_gets_its_slice_and_process(env, tmp_path):
    """(a) host i = slice i // 2, worker i % 2 = jax process i, reached through its own TPU and worker, with
    slice 0 worker 0's IP as both coordinators; main.py is given --n_slices 2; one TPU: nothing of this."""
    p = launcher(env, "--dry-run", "--", "--preset", "tiny", check=0)
    assert p.stdout.startswith("# launcher.sh --dry-run: run 'jaxformer' on 4 host(s) of 2 TPU slices (tpu-a tpu-b): "
                               "10.0.0.1 10.0.0.2 10.0.1.1 10.0.1.2\n"), p.out
    sections = p.stdout.split("## host ")[1:]
    assert len(sections) == 4
    for i, ((tpu, worker, ip), text) in enumerate(zip(HOSTS, sections)):
        assert text.startswith(f"{i}: {ip} (TPU {tpu} worker {worker}, slice {i // 2})\n"), text
        assert f"gcloud compute tpus tpu-vm ssh {tpu} --zone z1 --worker {worker} --command" in text
        assert f"session 'jaxformer-{i}'" in text
        assert f"export MEGASCALE_SLICE_ID={i // 2}" in text and f"JAX_PROCESS_ID={i}" in text
        assert "main.py --preset tiny --n_slices 2 --name jaxformer" in text
    p = launcher(env, "--dry-run", "--", "--n_slices=2", check=0)           # given: kept, not given twice
    assert "main.py --n_slices=2 --name jaxformer" in p.stdout and "--n_slices 2" not in p.stdout

    launcher(env, *start_args(tmp_path), "--", "ready", "ready", "ready", "ready", check=0)
    assert reached(tmp_path) == ["tpu-a-w0", "tpu-a-w1", "tpu-b-w0", "tpu-b-w1"]
    assert environments(tmp_path) == [[expected_environment(i, "10.0.0.1")] for i in range(4)]
    assert sessions(env) == ["ms-0", "ms-1", "ms-2", "ms-3"]

    p = launcher(env, "--dry-run", "--", "--preset", "tiny", tpus="tpu-a", check=0)
    assert "run 'jaxformer' on 2 host(s): 10.0.0.1 10.0.0.2\n" in p.stdout and "tpu-vm ssh tpu-a --zone z1 --worker 1" in p.out
    assert "MEGASCALE" not in p.out and "n_slices" not in p.out and "JAX_COORDINATOR_ADDRESS" not in p.out


def test_status_and_stop_span_every_slice(env, tmp_path):
    """(b) --status and --stop reach the 4 hosts of both TPUs; the stop ends every session."""
    launcher(env, *start_args(tmp_path), "--", "ready", "ready", "ready", "ready", check=0)
    reached(tmp_path)
    where = ["--log-dir", tmp_path / "host-logs"]
    p = launcher(env, "--status", "ms", *where, check=0)
    assert reached(tmp_path) == ["tpu-a-w0", "tpu-a-w1", "tpu-b-w0", "tpu-b-w1"]
    lines = p.stdout.splitlines()
    assert lines[0] == "launcher.sh: run 'ms' on 4 host(s) of 2 TPU slices (tpu-a tpu-b)"
    for i, (_, _, ip) in enumerate(HOSTS):
        assert lines[1 + i].startswith(f"host {i} {ip}: running | step 12 | loss 7.2500"), p.stdout
    p = launcher(env, "--stop", "ms", *where, "--timeout", "60", check=0)
    assert reached(tmp_path) == ["tpu-a-w0", "tpu-a-w1", "tpu-b-w0", "tpu-b-w1"]
    for i, (_, _, ip) in enumerate(HOSTS):
        assert re.search(rf"^host {i} {re.escape(ip)}: SIGTERM to pid \d+; session 'ms-{i}' ended", p.stdout, re.M), p.stdout
    assert sessions(env) == []


def test_a_relaunch_after_a_preemption_computes_every_host_environment_anew(env, tmp_path):
    """(c) slice 0 is preempted (its worker 0's program killed, gcloud says PREEMPTED): --recreate makes it
    again with new IPs (TPU_NAME says which), --setup runs on its 2 new hosts, and the relaunch gives all 4
    hosts, those of the slice that stayed too, the new coordinator IP."""
    tpus, done = tmp_path / "tpus", tmp_path / "done"
    recreate = ('printf "10.0.9.1 10.0.9.2\\n" > "$FAKE_TPUS/${TPU_NAME:?}/ips"; rm "$FAKE_TPUS/$TPU_NAME/state";'
                ' echo recreated "$TPU_NAME"')
    setup = f"echo set up >> {tmp_path / 'setup.log'}"
    cmd = [os.path.join(ROOT, "launcher.sh"), "--tpu", "tpu-a,tpu-b", "--zone", "z1", "--retries", "1",
           "--recreate", recreate, "--setup", setup, *map(str, start_args(tmp_path)), "--", *[f"until:{done}"] * 4]
    supervisor = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: all(len(e) == 1 for e in environments(tmp_path)) and (tmp_path / "host-logs" / "ms-0.pid").exists(),
                 supervisor)
        (tpus / "tpu-a" / "state").write_text("PREEMPTED\n")
        os.kill(int((tmp_path / "host-logs" / "ms-0.pid").read_text()), signal.SIGKILL)
        wait_for(lambda: all(len(e) == 2 for e in environments(tmp_path)), supervisor)
        done.touch()
        out, _ = supervisor.communicate(timeout=CEILING_S)
    finally:
        supervisor.kill()
    assert supervisor.returncode == 0, out
    assert environments(tmp_path) == [[expected_environment(i, "10.0.0.1"), expected_environment(i, "10.0.9.1")]
                                      for i in range(4)]
    assert re.search(r"launcher.sh: retry 1 of 1 after: host 0 10\.0\.0\.1: FAILED, exit status 137 at step 12\n", out), out
    assert ("launcher.sh: TPU 'tpu-a' is PREEMPTED; recreating it (--recreate): "
            f"{recreate}\n    recreated tpu-a\nlauncher.sh: TPU 'tpu-a' is READY\n"
            "launcher.sh: setting up the 2 host(s) of the new TPU (--setup)") in out, out
    assert "launcher.sh: TPU 'tpu-b' is READY\n" in out and "recreated tpu-b" not in out
    set_up = re.findall(r"tpu-vm ssh (\S+) --zone z1 --worker (\d) --command bash -c 'cd && \{ echo set up",
                        (tmp_path / "gcloud.log").read_text())
    assert sorted(set_up) == [("tpu-a", "0"), ("tpu-a", "1")] and (tmp_path / "setup.log").read_text() == "set up\n" * 2
    assert "launcher.sh: run 'ms' finished (attempts: 2)" in out


def wait_for(condition, supervisor):
    """Wait until condition() holds; fail at once when the supervisor ends first."""
    deadline = time.time() + CEILING_S
    while not condition():
        if supervisor.poll() is not None or time.time() > deadline:
            supervisor.kill()
            pytest.fail(f"launcher.sh ended or timed out first:\n{supervisor.communicate()[0]}")
        time.sleep(0.2)


@pytest.mark.parametrize("tpus,main_args,error", [
    ("tpu-a,tpu-b", [], "the TPUs of one run must be of one type: 'tpu-a' is v4-16, 'tpu-b' is v5p-16"),
    ("tpu-a,tpu-c", ["--n_slices", "3"], "main.py's --n_slices 3 differs from the 2 TPU(s) of --tpu tpu-a,tpu-c "
                                         "(one slice per TPU)"),
    ("tpu-a,tpu-c", ["--n_slices=1"], "main.py's --n_slices 1 differs from the 2 TPU(s) of --tpu tpu-a,tpu-c "
                                      "(one slice per TPU)"),
    ("tpu-a", ["--n_slices", "2"], "main.py's --n_slices 2 differs from the 1 TPU(s) of --tpu tpu-a (one slice per TPU)"),
    ("tpu-a,,tpu-c", [], "--tpu takes NAME or NAME1,NAME2,... (no empty names), got 'tpu-a,,tpu-c'"),
    ("tpu-a,tpu-a", [], "--tpu names TPU 'tpu-a' twice")])
def test_bad_slices_exit_2_with_one_line(env, tmp_path, tpus, main_args, error):
    """(d) TPUs of different types, a --n_slices that is not the number of TPUs, a bad --tpu list: exit 2 with
    one line, nothing started. (tpu-c: a v4-16 like tpu-a.)"""
    (tmp_path / "tpus" / "tpu-b" / "type").write_text("v5p-16\n")
    (tmp_path / "tpus" / "tpu-c").mkdir()
    (tmp_path / "tpus" / "tpu-c" / "type").write_text("v4-16\n")
    (tmp_path / "tpus" / "tpu-c" / "ips").write_text("10.0.2.1 10.0.2.2\n")
    p = launcher(env, "--dry-run", "--", *main_args, tpus=tpus, check=2)         # main.py: its --n_slices checked
    assert (p.stdout, p.stderr) == ("", f"launcher.sh: error: {error}\n")
    assert reached(tmp_path) == [] and sessions(env) == []
