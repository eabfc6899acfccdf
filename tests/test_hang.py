"""The hang watchdog (--hang_timeout, multihost.Watchdog), from outside the process as a user meets a
hang: two jax processes joined over gloo on 127.0.0.1 (4 CPU devices each, one (2, 2, 2) mesh), one of
them stopped with SIGSTOP mid-run. The other waits in a collective that never returns; the watchdog
writes every thread's stack to its log and ends it with exit 3. SIGUSR1 writes the stacks on demand."""
import os
import re
import signal
import subprocess
import sys
import time

from launch_util import ROOT, free_port

SMALL = ["--preset", "tiny", "--n_device_axis", "2", "2", "2", "--T", "32", "--train_batch_size", "2",
         "--val_batch_size", "4", "--eval_steps", "1", "--max_tokens", "0", "--training_steps", "100000",
         "--checkpoint_steps", "1000"]
TIMEOUT_S = 20


def start_process(cpu_env, pid, port, out, log):
    env = dict(cpu_env, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_NUM_PROCESSES="2",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_ID=str(pid))
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "main.py"), *SMALL, "--output_dir", str(out),
                             "--name", "hang", "--hang_timeout", str(TIMEOUT_S)],
                            cwd=out.parent, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_until(proc, path, pattern, timeout):
    deadline = time.time() + timeout
    while not re.search(pattern, text := path.read_text(errors="replace")):
        assert proc.poll() is None, f"exited {proc.returncode} before {pattern!r}:\n{text[-3000:]}"
        assert time.time() < deadline, f"no {pattern!r} within {timeout} s:\n{text[-3000:]}"
        time.sleep(0.5)
    return text


def test_a_stopped_host_ends_the_other_with_its_stacks_and_sigusr1_dumps_them_on_demand(cpu_env, tmp_path):
    port, logs, procs = free_port(), [tmp_path / f"{pid}.log" for pid in (0, 1)], []
    try:
        for pid in (0, 1):
            with open(logs[pid], "w") as log:
                procs.append(start_process(cpu_env, pid, port, tmp_path / "runs", log))
        for pid in (0, 1):
            wait_until(procs[pid], logs[pid], f"jaxformer started: process {pid} of 2", 600)
        # SIGUSR1: the stacks now, and the run goes on
        procs[0].send_signal(signal.SIGUSR1)
        wait_until(procs[0], logs[0], r"Current thread 0x[0-9a-f]+ \(most recent call first\)", 30)
        time.sleep(TIMEOUT_S / 2)
        assert procs[0].poll() is None and procs[1].poll() is None, "SIGUSR1 ended the run"

        procs[1].send_signal(signal.SIGSTOP)                       # host 1 hangs
        stopped_at = time.time()
        returncode = procs[0].wait(timeout=TIMEOUT_S + 120)
        waited = time.time() - stopped_at
        text = logs[0].read_text(errors="replace")
        assert returncode == 3, text[-3000:]
        # the clock runs from the last progress, at most a step before the stop
        assert TIMEOUT_S - 5 <= waited <= TIMEOUT_S + 60, waited
        assert re.search(rf"error: process 0 of 2 made no progress for {TIMEOUT_S} s \(--hang_timeout\) after: "
                         r"training step \d+", text), text[-3000:]
        dump = text[text.index("made no progress"):]
        assert "Thread 0x" in dump and 'File "' in dump and "main.py" in dump, dump[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=60)
