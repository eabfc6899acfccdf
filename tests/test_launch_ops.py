"""launcher.sh as an operator meets it at pod scale: a host is ok only once main.py passed start-up,
a failure stops the other hosts, one run name, several hosts need a coordinator, hosts files and
usage errors, --status and --stop, and debug_tpu.sh's exit status. Hosts are loopback through
tests/launch_local_ssh.sh; programs are tests/launch_standin.py (fast, no jax) except where main.py's
own behaviour is the point."""
import re
import sys
import time

import pytest

from ceiling import CEILING_S
from launch_util import needs_tmux, sessions, sh, tmux

pytestmark = needs_tmux
STANDIN = "tests/launch_standin.py"


@pytest.fixture
def run(tmux_env, tmp_path):
    """launcher.sh with the host list `hosts`, logs under tmp_path, python = this interpreter."""
    def launch(hosts, *args, main=STANDIN, check=None, timeout=90):
        f = tmp_path / "hosts"
        f.write_text("".join(h + "\n" for h in hosts))
        where = ["--hosts", f, "--log-dir", tmp_path / "host-logs"]
        if args and args[0] in ("--status", "--stop"):
            return sh("launcher.sh", *args[:2], *where, *args[2:], env=tmux_env, check=check, timeout=timeout)
        return sh("launcher.sh", *where, "--python", sys.executable, "--main", main,
                  "--local-logs", tmp_path / "local-logs", *args, env=tmux_env, check=check, timeout=timeout)
    return launch


def test_main_exiting_at_start_is_a_failure(run, tmp_path):
    """Problem 1: main.py exiting 2 on a bad flag was reported "ok" with exit 0."""
    p = run(["localhost"], "--", "--n_head", "3", main="main.py", check=1)
    assert "host 0 localhost: FAILED, exit status 2" in p.stderr
    assert re.search(r"n_head.*3", p.stderr), p.stderr              # main.py's own error, from the host's log
    assert "1 of 1 host(s) failed: localhost" in p.stderr and ": ok" not in p.out


def test_ok_only_after_start_up_and_timeout(run, tmux_env, tmp_path):
    p = run(["localhost"], "--name", "up", "--", "ready", check=0)
    assert "host 0 localhost: ok, main.py passed start-up" in p.stdout
    assert "jaxformer started: process 0 of 1" in (tmp_path / "host-logs" / "up-0.log").read_text()
    assert sessions(tmux_env) == ["up-0"]
    p = run(["localhost"], "--name", "slow", "--timeout", "2", "--", "hang", check=1)
    assert "host 0 localhost: FAILED, no start-up within 2 s (--timeout)" in p.stderr
    assert "stopping the run on the other host(s)" in p.stderr      # the timed-out host itself is stopped
    assert sessions(tmux_env) == ["up-0"]


def test_failure_stops_the_hosts_that_started(run, tmux_env, tmp_path):
    """Problem 4: after one host failed, the others were left running."""
    coord = ["--coordinator", "127.0.0.1:1"]
    p = run(["hostA", "hostB", "unreachable-1"], "--name", "part", *coord, "--", "ready", "ready", "ready",
            check=1)
    assert "host 2 unreachable-1: FAILED, unreachable over SSH" in p.stderr
    assert "stopping the run on the other host(s)" in p.stderr
    assert "1 of 3 host(s) failed: unreachable-1" in p.stderr
    assert sessions(tmux_env) == []
    p = run(["hostA", "hostB"], "--name", "crash", *coord, "--", "ready", "fail:3", check=1)
    assert "host 1 hostB: FAILED, exit status 3" in p.stderr
    assert "the stand-in fails before start-up" in p.stderr          # last lines of the host's log
    assert sessions(tmux_env) == []
    p = run(["hostA", "hostB"], "--name", "keep", *coord, "--keep-going", "--", "ready", "fail:3", check=1)
    assert "stopping" not in p.out and sessions(tmux_env) == ["keep-0"]


def test_status_and_stop(run, tmux_env, tmp_path):
    run(["hostA", "hostB"], "--name", "ops", "--coordinator", "127.0.0.1:1", "--", "ready", "ready", check=0)
    p = run(["hostA", "hostB"], "--status", "ops", check=0)
    lines = p.stdout.splitlines()
    assert lines[0] == "launcher.sh: run 'ops' on 2 host(s)"
    assert re.fullmatch(r"host 0 hostA: running \| step 12 \| loss 7.2500 \| log changed \d+ s ago", lines[1])
    assert lines[2].startswith("host 1 hostB: running | step 12 | loss 7.2500")
    p = run(["hostA", "hostB"], "--stop", "ops", "--timeout", "30", check=0)
    assert re.search(r"host 0 hostA: SIGTERM to pid \d+; session 'ops-0' ended, exit status 143", p.stdout)
    assert "host 1 hostB: SIGTERM to pid" in p.stdout and sessions(tmux_env) == []
    p = run(["hostA", "hostB"], "--status", "ops", check=0)
    assert "host 1 hostB: ended, exit status 143 | step 12" in p.stdout
    p = run(["hostA"], "--status", "nothing", check=0)
    assert "host 0 hostA: not running (no tmux session 'nothing-0') | no log at" in p.stdout


def test_one_run_name(tmux_env, tmp_path):
    """Problem 2: the launcher's --name named the tmux session but not main.py's run directory."""
    f = tmp_path / "hosts"
    f.write_text("h0\n")
    p = sh("launcher.sh", "--hosts", f, "--name", "exp1", "--dry-run", "--", "--preset", "tiny", env=tmux_env, check=0)
    assert "session 'exp1-0'" in p.out and "main.py --preset tiny --name exp1" in p.out
    p = sh("launcher.sh", "--hosts", f, "--name", "exp1", "--dry-run", "--", "--name", "exp1", env=tmux_env, check=0)
    assert p.out.count("--name exp1") == 1                            # not given twice
    p = sh("launcher.sh", "--hosts", f, "--name", "exp1", "--", "--name=exp2", env=tmux_env, check=2)
    assert p.stderr == ("launcher.sh: error: --name 'exp1' differs from main.py's --name 'exp2' after --; "
                        "give the run one name\n")
    p = sh("run.sh", "h0", "--dry-run", "--main", STANDIN, env=tmux_env, check=0)   # another program: untouched
    assert "launch_standin.py" in p.out and "--name" not in p.out


def test_several_hosts_need_a_coordinator(tmux_env, tmp_path):
    """Problem 3: several hosts without --coordinator silently started independent copies."""
    f = tmp_path / "hosts"
    f.write_text("h0\nh1\n")
    p = sh("launcher.sh", "--hosts", f, "--dry-run", env=tmux_env, check=2)
    assert p.stderr.count("\n") == 1 and "2 hosts and no --coordinator" in p.stderr
    assert "independent run" in p.stderr
    p = sh("launcher.sh", "--hosts", f, "--coordinator", "auto", "--dry-run", env=tmux_env, check=0)
    assert "JAX_COORDINATOR_ADDRESS" not in p.out and "## host 1: h1" in p.out
    p = sh("launcher.sh", "--hosts", f, "--coordinator", "h0:1234", "--dry-run", env=tmux_env, check=0)
    assert "JAX_COORDINATOR_ADDRESS=h0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1" in p.out


def test_hosts_files_and_usage_errors(tmux_env, tmp_path):
    """Problem 5: CRLF hosts, a line of several words silently cut, and bash's own exit 1 for a
    missing option value."""
    f = tmp_path / "hosts"
    f.write_bytes(b"# pod\r\nhost-a\r\n\r\nuser@host-b  # second\r\n")
    p = sh("launcher.sh", "--hosts", f, "--coordinator", "host-a:1", "--dry-run", env=tmux_env, check=0)
    assert "on 2 host(s): host-a user@host-b\n" in p.out and "\r" not in p.out
    f.write_text("host-a\nhost c with spaces\n")
    for script in ["launcher.sh", "debug_tpu.sh"]:
        p = sh(script, "--hosts", f, "--dry-run", env=tmux_env, check=2)
        assert p.stderr == (f"{script}: error: hosts file '{f}' line 2: 'host c with spaces' is not one "
                            "[user@]host\n")
    for script, args in [("launcher.sh", ["--hosts"]), ("launcher.sh", ["--hosts", f, "--name"]),
                         ("debug_tpu.sh", ["--session"]), ("run.sh", ["h0", "--index"]),
                         ("run.sh", ["h0", "--dir", "--dry-run"]), ("launcher.sh", [])]:
        p = sh(script, *args, env=tmux_env, check=2)
        assert p.stdout == "" and p.stderr.count("\n") == 1, (script, args, p.stderr)
        assert p.stderr.startswith(f"{script}: error: ") and "see --help" in p.stderr, p.stderr


def test_debug_tpu_shows_the_commands_exit_status(tmux_env, tmp_path):
    """Problem 6: the pane printed echo's exit status, so `-- false` showed 0."""
    f = tmp_path / "hosts"
    f.write_text("h0\n")
    sh("debug_tpu.sh", "--hosts", f, "--session", "st", "--no-attach", "--", "sh", "-c", "exit 7",
       env=tmux_env, check=0)
    deadline, shown = time.time() + CEILING_S, ""
    while "exit status" not in shown and time.time() < deadline:
        shown = tmux(tmux_env, "capture-pane", "-p", "-t", "=st:run.0").stdout
        time.sleep(0.2)
    assert "[debug_tpu.sh: h0: exit status 7]" in shown, shown
    sh("debug_tpu.sh", "--kill", "--session", "st", env=tmux_env, check=0)
