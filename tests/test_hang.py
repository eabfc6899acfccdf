"""A hung host, as a user meets it on a pod: two jax processes joined over gloo on 127.0.0.1 (one CPU device
each, a (2, 1, 1) mesh: launch_util.SMALL), started by launcher.sh on loopback, one of them stopped with
SIGSTOP mid-run.
The other waits in a collective that never returns; its watchdog (--hang_timeout, multihost.Watchdog)
writes every thread's stack to its log and ends it with exit 3, and the launcher names the host that
stopped. Before that, --status shows each host's newest step and --stacks gets every host's stacks
(SIGUSR1) while the run goes on."""
import os
import re
import subprocess
import sys
import time

import launch_util
from launch_util import ROOT, free_port, main_process, needs_tmux, sh
from ceiling import CEILING_S
from run_util import SPAN

pytestmark = needs_tmux

SMALL = [*launch_util.SMALL, "--training_steps", "100000", "--checkpoint_steps", "5"]
# The watchdog's clock starts at the first step, after every program is compiled (main.compile_programs: the
# eval step and the sampler too), so it sees steps, interval evaluations and saves alone: 1.4 s the longest gap
# of a run alone. 10 s is 7 x that, for the rest of the suite beside it on two cores (30 s was set when the first
# interval's eval compile fell inside the clock; 15 s failed once then); every second of it is waited for after
# the SIGSTOP.
TIMEOUT_S = 10


def processes():
    return subprocess.run(["ps", "-eo", "pid,ppid,stat,etime,args", "--forest"], capture_output=True, text=True).stdout


def logs(tmp_path):
    return "".join(f"\n==> {p} <==\n" + p.read_text(errors="replace")[-3000:]
                   for d in ("host-logs", "logs") for p in sorted((tmp_path / d).glob("*")) if p.is_file())


def test_a_stopped_host_is_named_after_the_others_watchdog_ends_them(tmux_env, launch_cache, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.1\n")
    where = ["--hosts", hosts, "--log-dir", tmp_path / "host-logs"]
    # LAUNCHER_HANG_GRACE_S: how long the launcher waits, after host 0's watchdog, for host 1's own, which a
    # stopped process never runs: all waited for
    env = dict(tmux_env, **launch_util.ONE_DEVICE, LAUNCHER_HANG_GRACE_S="2", RUN_STACKS_WAIT_S="3")
    cmd = [os.path.join(ROOT, "launcher.sh"), *map(str, where), "--name", "hang", "--coordinator",
           f"127.0.0.1:{free_port()}", "--python", sys.executable, "--local-logs", str(tmp_path / "logs"), "--wait",
           *launch_cache, "--", *SMALL, "--hang_timeout", str(TIMEOUT_S), "--output_dir", str(tmp_path / "runs")]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + CEILING_S
        host0_line = (r"host 0 127\.0\.0\.1: running \| step \d+, no step for \d+ s \(.*\) \| logged: step +\d+ "
                      r"\| loss [0-9.]+ \| log changed \d+ s ago\n +goodput \d+% of " + SPAN + ": startup")
        while True:       # both hosts past the first interval: host 0's step line logged, its goodput noted
            status = sh("launcher.sh", "--status", "hang", *where, env=env, check=0).out
            if status.count("no step for") == 2 and re.search(host0_line, status):
                break
            assert launcher.poll() is None and time.time() < deadline, status + launcher.stdout.read()
            time.sleep(1)

        stacks = sh("launcher.sh", "--stacks", "hang", *where, env=env, check=0).out     # SIGUSR1: the run goes on
        for i in (0, 1):
            assert re.search(rf"host {i} 127\.0\.0\.1: stacks of pid \d+ \(SIGUSR1\)", stacks), stacks
        assert stacks.count("(most recent call first):") >= 4 and "main.py" in stacks, stacks

        host1 = main_process("hang", 1)
        host1.suspend()                                                       # SIGSTOP: host 1 hangs
        stopped_at = time.time()
        host0 = main_process("hang", 0)
        host0.wait(timeout=CEILING_S)
        ended = time.time()
        # the clock runs from host 0's last progress (its heartbeat's time), which may follow the stop by a step
        # or an evaluation. Only the lower bound is timed: that the watchdog, not anything else, ended host 0 is
        # its exit status below (an upper bound failed at 95 s on CI's loaded machine).
        beat = (tmp_path / "host-logs" / "hang-0.heartbeat").read_text()
        last_progress = float(re.search(r"^time (\S+)$", beat, re.M).group(1))
        assert ended - last_progress >= TIMEOUT_S - 1, (ended - last_progress, ended - stopped_at)
        try:
            out, _ = launcher.communicate(timeout=CEILING_S)
        except subprocess.TimeoutExpired:
            launcher.kill()
            raise AssertionError(launcher.communicate()[0] + processes() + logs(tmp_path)) from None
        assert launcher.returncode == 1, out + logs(tmp_path)
        # the stop falls in a step or in an interval's evaluation, checkpoint and sample
        assert re.search(r"host 0 127\.0\.0\.1: FAILED, exit status 3 \(its hang watchdog: no progress for --hang_timeout "
                         rf"s\); its stacks are in .*/0-127\.0\.0\.1\.log after:\n    error: process 0 of 2 made no progress "
                         rf"for {TIMEOUT_S} s \(--hang_timeout\) after: (training step \d+|the evaluation, checkpoint and "
                         r"sample after step \d+)", out), out + logs(tmp_path)
        assert ("host 1 127.0.0.1: HUNG, its program did not end by its own watchdog as host 0's did (run.sh --stacks: "
                "no stacks: pid ") in out and "it is stopped (process state T" in out, out

        after = sh("launcher.sh", "--stacks", "hang", *where, env=env, check=0).out     # the dump host 0 left
        dump = after[after.index("host 0 127.0.0.1: the program is not running; the newest stack dump"):]
        assert "made no progress" in dump and "Thread 0x" in dump and 'File "' in dump, after
        print(status, stacks, out, after, sep="\n")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in (0, 1):
            proc = main_process("hang", pid)
            if proc is not None:
                proc.resume()
                proc.kill()
