"""Launch scripts (setup_tpu.sh, launcher.sh, run.sh, debug_tpu.sh): help, dry runs, bad input,
tmux layout and cleanup, secrets. Hosts are simulated by tests/launch_local_ssh.sh (SSH=...), which
runs the "remote" command on this machine in a clean environment; a host named unreachable* fails
with exit 255 like ssh. Every test gets its own tmux server and kills it afterwards."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from ceiling import CEILING_S
from launch_util import (LIB, LOCAL_SSH, ROOT, SCRIPTS, SECRET, all_text, needs_tmux,
                         path_without, sessions, sh, tmux)

pytestmark = needs_tmux


@pytest.fixture
def hosts(tmp_path):
    def make(*names):
        f = tmp_path / f"hosts{len(names)}"
        f.write_text("# test hosts\n\n" + "".join(f"{n}   # host\n" for n in names))
        return f
    return make


def test_shellcheck_clean():
    if not shutil.which("shellcheck"):
        pytest.skip("needs shellcheck (CI installs it: apt-get install shellcheck)")
    p = subprocess.run(["shellcheck", *SCRIPTS, LIB, "tests/launch_local_ssh.sh"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_strict_mode_and_nothing_hard_coded(script):
    text = open(os.path.join(ROOT, script)).read()
    assert "set -euo pipefail" in text
    assert os.access(os.path.join(ROOT, script), os.X_OK)
    assert not re.findall(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b", text), "hard-coded IP"
    assert "gs://" not in text and "API_KEY=" not in text.replace("$WANDB_API_KEY", "")
    assert "reset --hard" not in text and "rm -rf" not in text


def test_lib_is_sourced_not_run():
    text = open(os.path.join(ROOT, LIB)).read()
    assert not os.access(os.path.join(ROOT, LIB), os.X_OK) and "set -" not in text   # caller's options
    assert not re.findall(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b", text), "hard-coded IP"
    for script in ["launcher.sh", "run.sh", "debug_tpu.sh"]:
        assert f"/{LIB}\"" in open(os.path.join(ROOT, script)).read(), script


def lib(snippet, tmp_path):
    """Run a bash snippet with launch_lib.sh sourced and the scripts' die/usage; .out = stdout + stderr."""
    prog = (f"set -euo pipefail; die() {{ echo \"t: error: $*\" >&2; exit 2; }}; usage() {{ echo USAGE; }}\n"
            f". {LIB}\n{snippet}")
    p = subprocess.run(["bash", "-c", prog], cwd=ROOT, capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}"))
    p.out = p.stdout + p.stderr
    return p


def test_lib_resolve_hosts(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# c\n  user@h0  # first\n\n\th1\t\nh2")           # no final newline
    p = lib(f'resolve_hosts {f} "" "" ""; printf "<%s>" "${{hosts[@]}}"', tmp_path)
    assert p.returncode == 0 and p.out == "<user@h0><h1><h2>", p.out
    for args, code, msg in [(f"{f} pod z ''", 2, "t: error: give --hosts or --tpu, not both\n"),
                            ("'' pod '' ''", 2, "t: error: --tpu needs --zone\n"),
                            ("'' '' '' ''", 2, "t: error: missing --hosts FILE or --tpu NAME --zone ZONE (see --help)\n")]:
        p = lib(f"resolve_hosts {args}; echo unreached", tmp_path)
        assert (p.returncode, p.out) == (code, msg), p.out
    (tmp_path / "gcloud").write_text('#!/bin/sh\necho "$*" >&2\necho "10.1.0.2;10.1.0.3,10.1.0.4"\n')
    (tmp_path / "gcloud").chmod(0o755)
    p = lib('resolve_hosts "" pod us-z1 my-proj; printf "<%s>" "${hosts[@]}"', tmp_path)
    assert p.returncode == 0, p.out
    assert p.stdout == "<10.1.0.2><10.1.0.3><10.1.0.4>"
    assert "describe pod --zone us-z1 --project my-proj --format=" in p.stderr


def test_lib_run_name_from_args(tmp_path):
    for name, args, want in [("", "", "jaxformer"), ("", "--preset tiny --name a --name=b.c", "b.c"),
                             ("", "--name=x --name y", "y"), ("", "--name", "jaxformer"),
                             ("given", "--name given", "given")]:
        p = lib(f"name={name}; run_name_from_args {args}; echo \"<$name>\"", tmp_path)
        assert (p.returncode, p.out) == (0, f"<{want}>\n"), (name, args, p.out)
    p = lib("name=''; run_name_from_args --name 'a b'; echo unreached", tmp_path)
    assert p.returncode == 2
    assert p.out == "t: error: run name may hold only letters, digits, '_', '.', '-': 'a b'\n"
    p = lib("name=given; run_name_from_args --name other; echo unreached", tmp_path)
    assert (p.returncode, p.out) == (2, "t: error: --name 'given' differs from main.py's --name 'other' after --; "
                                        "give the run one name\n")


def test_scripts_run_from_any_cwd(tmux_env, hosts, tmp_path):
    p = sh("launcher.sh", "--hosts", hosts("h0"), "--dry-run", "--", "--name", "r", env=tmux_env, check=0, cwd=tmp_path)
    assert "## host 0: h0" in p.out and "session 'r-0'" in p.out
    p = sh("run.sh", "hostA", "--dry-run", env=tmux_env, check=0, cwd=tmp_path)
    assert "session 'jaxformer'" in p.out and f"{ROOT}/logs/jaxformer.log" in p.out
    p = sh("debug_tpu.sh", "--hosts", hosts("h0"), "--dry-run", env=tmux_env, check=0, cwd=tmp_path)
    assert "window run pane 0 (h0)" in p.out and f"cd {ROOT}" in p.out


@pytest.mark.parametrize("script,words", [
    ("setup_tpu.sh", ["--venv", "--accelerator", "--dry-run", "--bashrc", "--wandb-login"]),
    ("launcher.sh", ["--hosts", "--tpu", "--zone", "--coordinator", "--commit", "--wait", "--dry-run"]),
    ("run.sh", ["HOST", "--name", "--coordinator", "--commit", "--force", "--dry-run", "SSH"]),
    ("debug_tpu.sh", ["--hosts", "--tpu", "--session", "--kill", "--dry-run", "monitor"])])
def test_help(script, words, tmux_env):
    p = sh(script, "--help", env=tmux_env, check=0)
    assert p.stdout.startswith(f"usage: {script}")
    for w in words:
        assert w in p.stdout, w


def test_run_dry_run_shows_command_not_secret(tmux_env, tmp_path):
    p = sh("run.sh", "hostA", "--index", 1, "--num-processes", 2, "--coordinator", "hostA:1234",
           "--dir", tmp_path, "--dry-run", "--", "--preset", "tiny", "--name", "exp1", env=tmux_env, check=0)
    out = p.out
    assert "session 'exp1-1'" in out and f"{tmp_path}/logs/exp1-1.log" in out
    assert "JAX_COORDINATOR_ADDRESS=hostA:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1" in out
    assert "main.py --preset tiny --name exp1" in out and LOCAL_SSH in out
    assert "values withheld): WANDB_API_KEY" in out and SECRET not in out
    assert sessions(tmux_env) == []


def test_launcher_dry_run_and_tpu_hosts(tmux_env, hosts, tmp_path):
    p = sh("launcher.sh", "--hosts", hosts("h0", "h1"), "--coordinator", "h0:1234", "--dry-run", "--", "--name", "r",
           env=tmux_env, check=0)
    assert "## host 0: h0" in p.out and "## host 1: h1" in p.out
    assert "session 'r-0'" in p.out and "session 'r-1'" in p.out and SECRET not in p.out
    # --tpu: workers come from `gcloud compute tpus tpu-vm describe` (a fake gcloud here)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text('#!/bin/sh\necho "$*" >> "$GCLOUD_LOG"\necho "10.1.0.2;10.1.0.3"\n')
    (bin_dir / "gcloud").chmod(0o755)
    e = dict(tmux_env, PATH=f"{bin_dir}:{tmux_env['PATH']}", GCLOUD_LOG=str(tmp_path / "gcloud.log"))
    del e["SSH"]
    p = sh("launcher.sh", "--tpu", "pod", "--zone", "us-z1", "--dry-run", env=e, check=0)
    assert "describe pod --zone us-z1" in (tmp_path / "gcloud.log").read_text()
    assert "run 'jaxformer' on 2 host(s): 10.1.0.2 10.1.0.3" in p.out
    assert "tpu-vm ssh pod --zone us-z1 --worker 1 --command" in p.out


@pytest.mark.parametrize("script", ["launcher.sh", "debug_tpu.sh"])
def test_missing_or_empty_hosts_file(script, tmux_env, tmp_path):
    p = sh(script, "--hosts", tmp_path / "nope", env=tmux_env, check=2)
    assert "hosts file" in p.stderr and "not found" in p.stderr
    empty = tmp_path / "empty"
    empty.write_text("# nobody\n\n   \n")
    p = sh(script, "--hosts", empty, env=tmux_env, check=2)
    assert "lists no hosts" in p.stderr
    p = sh(script, env=tmux_env, check=2)
    assert "missing --hosts FILE or --tpu" in p.stderr
    assert sessions(tmux_env) == []


def test_unreachable_host(tmux_env, hosts, tmp_path):
    p = sh("run.sh", "unreachable-9", env=tmux_env, check=255)
    assert "cannot reach unreachable-9 over SSH" in p.stderr
    p = sh("launcher.sh", "--hosts", hosts("unreachable-1"), "--local-logs", tmp_path / "ll", env=tmux_env, check=1)
    assert "host 0 unreachable-1: FAILED, unreachable over SSH (exit 255)" in p.stderr
    assert "1 of 1 host(s) failed: unreachable-1" in p.stderr
    assert (tmp_path / "ll" / "0-unreachable-1.log").exists()


def test_tmux_missing(tmux_env, hosts, tmp_path):
    no_tmux = path_without(tmp_path, "tmux")
    p = sh("run.sh", "hostB", "--dir", ROOT, env=dict(tmux_env, LOCAL_SSH_PATH=no_tmux), check=4)
    assert "error on hostB: tmux is not installed" in p.stderr
    p = sh("debug_tpu.sh", "--hosts", hosts("h"), env=dict(tmux_env, PATH=no_tmux), check=2)
    assert "tmux is not installed here" in p.stderr
    assert sessions(tmux_env) == []


def test_no_checkout(tmux_env, tmp_path):
    p = sh("run.sh", "hostC", "--dir", tmp_path / "absent", env=tmux_env, check=3)
    assert "no checkout at" in p.stderr


def test_session_already_running_then_force(tmux_env, tmp_path):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n")
    args = ["hostD", "--name", "busy", "--python", sys.executable, "--main", sleeper,
            "--log-dir", tmp_path / "logs"]
    sh("run.sh", *args, env=tmux_env, check=0)
    assert sessions(tmux_env) == ["busy"]
    p = sh("run.sh", *args, env=tmux_env, check=7)
    assert "tmux session 'busy' is already running" in p.stderr and "--force" in p.stderr
    pid = tmux(tmux_env, "display-message", "-p", "-t", "=busy:", "#{pane_pid}").stdout.strip()
    sh("run.sh", *args, "--force", env=tmux_env, check=0)
    assert sessions(tmux_env) == ["busy"]
    assert pid and tmux(tmux_env, "display-message", "-p", "-t", "=busy:", "#{pane_pid}").stdout.strip() != pid


def test_wait_reports_program_failure(tmux_env, hosts, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nprint('key set:', bool(os.environ.get('WANDB_API_KEY')))\nsys.exit(3)\n")
    p = sh("launcher.sh", "--hosts", hosts("hostE", "unreachable-2"), "--name", "bad", "--wait", "--keep-going",
           "--coordinator", "hostE:1234",
           "--python", sys.executable, "--main", bad, "--log-dir", tmp_path / "logs",
           "--local-logs", tmp_path / "ll", env=tmux_env, check=1)
    assert "host 0 hostE: FAILED, exit status 3" in p.stderr and "host 1 unreachable-2: FAILED" in p.stderr
    assert "2 of 2 host(s) failed: hostE unreachable-2" in p.stderr
    host_log = (tmp_path / "logs" / "bad-0.log").read_text()
    assert "key set: True" in host_log and "run.sh: exit status 3" in host_log
    assert SECRET not in p.out + all_text(tmp_path / "logs", tmp_path / "ll")
    assert sessions(tmux_env) == []


def test_commit_checks_out_only_a_clean_checkout(tmux_env, tmp_path):
    repo = tmp_path / "repo"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "prog.py").write_text("print('version one')\n")
    subprocess.run(git + ["add", "prog.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    first = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "prog.py").write_text("print('version two')\n")
    subprocess.run(git + ["commit", "-qam", "two"], check=True)
    args = ["hostF", "--dir", repo, "--python", sys.executable, "--main", "prog.py", "--wait"]
    (repo / "prog.py").write_text("print('local edit')\n")               # dirty: refused, untouched
    p = sh("run.sh", *args, "--name", "c1", "--commit", first, env=tmux_env, check=5)
    assert "has local changes" in p.stderr and (repo / "prog.py").read_text() == "print('local edit')\n"
    p = sh("run.sh", *args, "--name", "c2", env=tmux_env, check=0)             # "as is" runs the edit
    assert "local edit" in p.stdout
    subprocess.run(git + ["checkout", "-q", "prog.py"], check=True)
    p = sh("run.sh", *args, "--name", "c3", "--commit", first, env=tmux_env, check=0)
    assert "version one" in p.stdout and f"commit {first[:7]}" in p.stdout


def test_debug_tpu_layout_and_cleanup(tmux_env, hosts, tmp_path):
    f = hosts("h0", "h1", "h2")
    p = sh("debug_tpu.sh", "--hosts", f, "--session", "dbg", "--dir", tmp_path, "--no-attach", "--",
           "echo", "hello from", "$(hostname)", env=tmux_env, check=0)
    assert sessions(tmux_env) == ["dbg"]
    panes = tmux(tmux_env, "list-panes", "-s", "-t", "=dbg", "-F", "#{window_name} #{pane_index}").stdout.split("\n")
    assert sorted(x for x in panes if x) == ["monitor 0", "monitor 1", "monitor 2", "run 0", "run 1", "run 2"]
    assert tmux(tmux_env, "show-options", "-w", "-t", "=dbg:run", "synchronize-panes").stdout.strip().endswith("on")
    deadline = time.time() + CEILING_S
    while True:
        shown = [tmux(tmux_env, "capture-pane", "-p", "-t", f"=dbg:run.{i}").stdout for i in range(3)]
        if all("exit status 0" in s for s in shown) or time.time() > deadline:
            break
        time.sleep(0.2)
    for i, s in enumerate(shown):
        assert "hello from $(hostname)" in s and f"h{i}: exit status 0" in s, s   # quoted: not expanded
    monitor = tmux(tmux_env, "list-panes", "-t", "=dbg:monitor", "-F", "#{pane_dead}").stdout.split()
    assert monitor == ["0", "0", "0"]
    p = sh("debug_tpu.sh", "--hosts", f, "--session", "dbg", "--no-attach", env=tmux_env, check=2)
    assert "tmux session 'dbg' already exists" in p.stderr
    sh("debug_tpu.sh", "--hosts", f, "--session", "dbg", "--no-attach", "--force", env=tmux_env, check=0)
    sh("debug_tpu.sh", "--kill", "--session", "dbg", env=tmux_env, check=0)
    assert sessions(tmux_env) == []
    p = sh("debug_tpu.sh", "--hosts", f, "--dry-run", "--", "python", "main.py", env=tmux_env, check=0)
    assert p.out.count("window run pane") == 3 and p.out.count("window monitor pane") == 3
    assert SECRET not in p.out and sessions(tmux_env) == []


# ---- setup_tpu.sh, against a fake python/pip that only records what it was asked to do ----
FAKE_PY = """#!/bin/bash
echo "$0 $*" >> "$FAKE_LOG"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
"""


@pytest.fixture
def fake_setup(tmp_path):
    py = tmp_path / "fakepython"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# user's own bashrc\n")
    log = tmp_path / "calls.log"
    env = dict(os.environ, HOME=str(home), FAKE_LOG=str(log))
    env.pop("WANDB_API_KEY", None)
    venv = tmp_path / "venv"
    return py, venv, home, log, env


def test_setup_is_idempotent(fake_setup):
    py, venv, home, log, env = fake_setup
    args = ["--python", py, "--venv", venv, "--accelerator", "tpu", "--bashrc"]
    p = sh("setup_tpu.sh", *args, env=env, check=0)
    calls = log.read_text()
    assert f"-m venv {venv}" in calls and "-m pip install --quiet -r" in calls
    assert "-r " + os.path.join(ROOT, "requirements-tpu.txt") in calls     # requirements.txt + the pinned libtpu
    bashrc = (home / ".bashrc").read_text()
    assert bashrc.startswith("# user's own bashrc\n") and bashrc.count("setup_tpu.sh") == 1
    p = sh("setup_tpu.sh", *args, env=env, check=0)
    assert log.read_text() == calls, "second run called pip or venv again"
    assert (home / ".bashrc").read_text() == bashrc
    assert "reusing virtualenv" in p.stdout and "already installed" in p.stdout
    sh("setup_tpu.sh", *args[:4], "--accelerator", "cpu", env=env, check=0)   # other extra: reinstall
    assert "requirements-tpu" not in log.read_text()[len(calls):] and "-r" in log.read_text()[len(calls):]


def test_setup_dry_run_changes_nothing(fake_setup):
    py, venv, home, log, env = fake_setup
    p = sh("setup_tpu.sh", "--python", py, "--venv", venv, "--accelerator", "cuda", "--bashrc",
           "--dry-run", env=env, check=0)
    assert "jax[cuda12]==0.10.2" in p.stdout and "append to ~/.bashrc" in p.stdout
    assert not log.exists() and not venv.exists()
    assert (home / ".bashrc").read_text() == "# user's own bashrc\n"
    p = sh("setup_tpu.sh", "--wandb-login", "--venv", venv, env=env, check=2)
    assert "needs WANDB_API_KEY" in p.stderr
    p = sh("setup_tpu.sh", "--accelerator", "abacus", env=env, check=2)
    assert "--accelerator must be" in p.stderr
    p = sh("setup_tpu.sh", "--venv", env=env, check=2)           # a missing value: one line, exit 2
    assert p.stderr.strip() == "setup_tpu.sh: error: --venv needs a value (see --help)"
