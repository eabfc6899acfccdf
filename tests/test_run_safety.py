"""A run never loses work (issue 13), driven as a user would: main.py as a subprocess, faults made from
outside it (signals, a read-only mount, a full tmpfs, a second run in the same directory).

- a changed model flag exits 2 touching nothing; --restart moves the old run aside; unreadable
  checkpoints everywhere stop the run instead of training from 0
- Ctrl-C saves and exits 0, a second Ctrl-C exits at once; one run per directory (a lock)
- a closed terminal (a pty, a tmux pane: with nohup the run goes on; plain, or behind a parent that eats
  the hangup, it saves and exits 0) and a stdout pipe nobody reads any more
- an empty prompt samples from <|endoftext|>; a prompt too long is refused at start; a sample that fails
  is a warning after the checkpoint; an expert with no tokens prints inf
- a checkpoint directory that could not take a save (a file, read-only, full) is refused at start in one
  line; a disk that fills up while a checkpoint is written stops the run at once in one line
- the data position is in sequences: a new batch layout resumes right after the last sequence
- --sample on (1,1,1) from a run trained on (2,2,2), writing nothing
- the run directory read-only or full mid-run: one warning, no record lost, the spill written by the next
  start; unusable at start (read-only, a file): exit 2 in one line; --output_dir file:///path is that path;
  a garbage lock, metrics.jsonl cut mid-line and a session that overlapped the last one are taken as they are
"""
import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from launch_util import kill_tmux, needs_tmux, tmux
from run_util import (MESH1, MESH8, REPO, TINY_FLAGS, checkpoints, last_step, mount, records, run, start, wait_for,
                      wait_for_step, unoptimized)
from ceiling import CEILING_S


def snapshot(path):
    """Every file under path with its size and mtime: equal snapshots mean nothing was touched."""
    return {os.path.join(root, n): (os.stat(os.path.join(root, n)).st_size, os.stat(os.path.join(root, n)).st_mtime_ns)
            for root, _, names in os.walk(path) for n in names}


def meta(out, step, name="run"):
    with open(os.path.join(out, name, "checkpoints", str(step), "meta", "metadata")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def trained(cpu_env, tmp_path_factory):
    """A finished 2-step run on (1,1,1): checkpoint at step 2."""
    out = tmp_path_factory.mktemp("trained")
    run(cpu_env, out, *MESH1, steps=2)
    return out


def newest_checkpoint(out):
    return max(checkpoints(out))


# a closed terminal is told by its hangup or by the first write to it after it went, whichever the run
# meets first (Python runs a signal handler between bytecodes; a progress-bar thread may write before)
TERMINAL_GONE = ("SIGHUP", "stdout lost (EIO)")


def stop_causes(out):
    """(step, cause) of each stop metrics.jsonl records."""
    return [(r["step"], r["cause"]) for r in records(out) if r.get("event") == "stop"]


# ---------------------------------------------------------------------------------------------------------
# 1. a changed model flag


def test_a_finished_run_started_again_has_nothing_to_do_and_writes_nothing(cpu_env, trained, tmp_path):
    """The same command after the last step: one line saying so, exit 0, nothing compiled (no first
    step, no evaluation, no sample) and nothing appended to metrics.jsonl or samples.txt."""
    shutil.copytree(trained / "run", tmp_path / "run")
    before = snapshot(tmp_path)
    start = time.time()
    proc = run(cpu_env, tmp_path, *MESH1, "--max_tokens", "4", steps=2)
    print(f"\nthe finished run started again took {time.time() - start:.1f} s")
    assert f"{tmp_path}/run/checkpoints/2 ends this run (--training_steps 2" in proc.stdout
    assert "nothing to do" in proc.stdout and "jaxformer started" not in proc.stdout
    assert "sample @" not in proc.stdout and "final:" not in proc.stdout
    assert snapshot(tmp_path) == before


def test_changed_model_flag_exits_2_and_touches_nothing_then_restart_moves_the_run_aside(cpu_env, trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    before = snapshot(tmp_path)
    proc = run(cpu_env, tmp_path, *MESH1, "--model_dimension", "64", "--n_head", "4", "--dropout_rate", "0.1",
               "--pipeline_repeats", "2", steps=4, expect=2)
    assert "--model_dimension: 32 in the checkpoint, 64 now" in proc.stderr
    assert "--pipeline_repeats: 1 in the checkpoint, 2 now" in proc.stderr     # stored as [R, blocks/R, ...]
    assert "--n_head: 2 in the checkpoint, 4 now" in proc.stderr
    assert "--dropout_rate: 0.0 in the checkpoint, 0.1 now" in proc.stderr
    assert "--restart" in proc.stderr
    assert snapshot(tmp_path) == before

    # A change that keeps every shape is a note, not an error (dropout may change on resume) -- here with
    # --restart, which sets the old run aside and starts from step 0.
    proc = run(cpu_env, tmp_path, *MESH1, "--restart", "--dropout_rate", "0.1", steps=1,
               extra_env=unoptimized(cpu_env))
    replaced = os.listdir(tmp_path / "run" / "replaced")
    assert len(replaced) == 1
    old = tmp_path / "run" / "replaced" / replaced[0]
    assert sorted(os.listdir(old)) == ["checkpoints", "metrics.jsonl"]
    assert os.listdir(old / "checkpoints") == ["2"]
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["1"]
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [1]       # no mix with the old run

    # Every checkpoint unreadable: an error naming each, nothing moved, no training from step 0.
    for root, _, names in os.walk(tmp_path / "run" / "checkpoints" / "1" / "state"):
        for name in names:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage")
    before = snapshot(tmp_path)
    proc = run(cpu_env, tmp_path, *MESH1, "--dropout_rate", "0.1", steps=2, expect=2)
    assert "no checkpoint in" in proc.stderr and "step 1:" in proc.stderr and "--restart" in proc.stderr
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------------------
# 2 and 5. Ctrl-C, and one run per directory


def test_ctrl_c_saves_and_exits_0_a_second_exits_at_once_and_a_second_run_is_refused(cpu_env, tmp_path):
    log = tmp_path / "first"
    first = start(cpu_env, tmp_path, log, *MESH1)
    wait_for_step(first, tmp_path, log, 2)
    # 5: a second run in the same directory is refused at start, naming the holder.
    proc = run(cpu_env, tmp_path, *MESH1, expect=2)
    assert f"pid {first.pid} on {socket.gethostname()}" in proc.stderr
    # 2: Ctrl-C finishes the step, saves, says where, exits 0.
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=CEILING_S) == 0, open(f"{log}.err").read()[-3000:]
    stdout, stderr = open(f"{log}.out").read(), open(f"{log}.err").read()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    saved = max(r["step"] for r in records(tmp_path) if "loss" in r)
    assert f"SIGINT: checkpoint of step {saved} written to {tmp_path}/run/checkpoints/{saved}" in stdout
    assert newest_checkpoint(tmp_path) == saved
    assert not os.path.exists(tmp_path / "run" / "lock")

    # Ctrl-C while the training step compiles (a cold compilation cache: seconds of XLA, where Python's signal
    # handlers wait): the first says so at once, the second exits 130 at once in one line, without saving.
    log = tmp_path / "second"
    second = start(cpu_env | {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cold")}, tmp_path, log, *MESH1)
    wait_for(second, log, lambda: "compiling the training step" in open(f"{log}.out").read(), "the compile")
    second.send_signal(signal.SIGINT)
    wait_for(second, log, lambda: "Ctrl-C: XLA is compiling the training step, which cannot be interrupted; then "
                                  "the step runs, the run saves and exits; Ctrl-C again to exit now without saving"
                                  in open(f"{log}.err").read(), "the first Ctrl-C's line")
    second.send_signal(signal.SIGINT)
    assert second.wait(timeout=CEILING_S) == 130
    stderr = open(f"{log}.err").read()
    assert stderr.endswith("Ctrl-C: XLA is compiling the training step, which cannot be interrupted; then the step "
                           "runs, the run saves and exits; Ctrl-C again to exit now without saving\n\nCtrl-C again: "
                           "exiting now without saving (exit 130); the newest checkpoint is the one to resume "
                           "from\n"), stderr[-3000:]
    assert "jaxformer started" not in open(f"{log}.out").read()           # it never got to its first step
    assert newest_checkpoint(tmp_path) == saved

    # Its lock is left behind by a process that is gone: the next run takes it over and resumes.
    assert json.load(open(tmp_path / "run" / "lock"))["pid"] == second.pid
    latest = newest_checkpoint(tmp_path)
    proc = run(cpu_env, tmp_path, *MESH1, steps=latest + 1)
    assert f"taking over {tmp_path}/run/lock" in proc.stdout
    assert f"resumed from {tmp_path}/run/checkpoints/{latest}: step {latest}," in proc.stdout


def test_a_stop_saves_first_and_evaluates_only_when_asked(cpu_env, tmp_path):
    """SIGTERM mid-interval (--checkpoint_steps 50, samples on, no evaluation yet): after the signal the run
    compiles nothing before its checkpoint is written and said, records the stop and its cause, and
    neither evaluates nor samples. Resumed with --eval_on_stop and stopped again: the evaluation, the task's
    scores and the sample come after the save, and compile nothing (compiled with the train step). XLA's
    compile log and the lines show it."""
    env = cpu_env | {"JAX_LOG_COMPILES": "1"}
    for session, extra in enumerate(([], ["--eval_on_stop", "--eval_tasks", "kjv_endings", "--eval_tasks_limit", "3"])):
        log, begun = tmp_path / f"session{session}.log", len(records(tmp_path))
        with open(log, "w") as f:             # one file, so stdout's lines and the compile log keep their order
            proc = subprocess.Popen(main_py(tmp_path) + ["--checkpoint_steps", "50", "--max_tokens", "4", *extra],
                                    cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        wait_until(lambda: len([r for r in records(tmp_path)[begun:] if "loss" in r]) >= 2, "two steps")
        signalled = os.path.getsize(log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=CEILING_S) == 0, log.read_text()[-3000:]
        after = log.read_text()[signalled:]
        saved = last_step(tmp_path)
        written = after.index(f"SIGTERM: checkpoint of step {saved} written to {tmp_path}/run/checkpoints/{saved} "
                              f"(the same command resumes it)")
        assert "Compiling jit(" not in after[:written], after[:written][-3000:]
        session_records = records(tmp_path)[begun:]
        last = max(i for i, r in enumerate(session_records) if "loss" in r)
        later = session_records[last + 1:]
        assert later[0] == {"step": saved, "time": later[0]["time"], "event": "stop", "cause": "SIGTERM"}, later
        evaluated = [r["step"] for r in later if "val_loss" in r]
        if not extra:
            assert evaluated == [] and "jit(eval_step)" not in after and "sample @" not in after
            assert meta(tmp_path, saved)["val_loss"] is None
        else:
            assert evaluated == [saved] and "val_loss" in later[1]
            assert [(r["step"], r["examples"]) for r in later if r.get("task") == "kjv_endings"] == [(saved, 3)]
            assert "Compiling " not in after and written < after.index(f"step {saved:>6} | loss") < \
                after.index(f"task @ {saved}: kjv_endings: acc") < after.index(f"sample @ {saved}")
        assert "run_goodput" in later[-1]


# ---------------------------------------------------------------------------------------------------------
# 3. the prompt, a failed sample, and the expert-load line


def _controlling_terminal():
    """In the child: a new session whose controlling terminal is its stdin (the pty's slave side)."""
    import fcntl
    import termios
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_a_closed_terminal_saves_and_exits_0(cpu_env, tmp_path):
    """The run's terminal closes (a pseudo-terminal whose master side this test closes, as a terminal
    window or an SSH session does): the kernel sends SIGHUP, the run finishes its step, writes the
    checkpoint, releases the lock and exits 0, although what it prints to is gone."""
    import pty
    import select
    import threading
    master, slave = pty.openpty()
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, "--output_dir", str(tmp_path), "--name", "run",
           "--training_steps", "100000", *MESH1]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env, stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=_controlling_terminal)
    os.close(slave)
    printed, done = [], threading.Event()

    def drain():                     # a terminal that nobody reads fills up and blocks the writer
        while not done.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    printed.append(os.read(master, 65536))
                except OSError:
                    return
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.time() + CEILING_S
        while last_step(tmp_path) < 2:
            assert proc.poll() is None and time.time() < deadline, b"".join(printed).decode(errors="replace")[-3000:]
            time.sleep(0.05)
    finally:
        done.set()
        reader.join()
        os.close(master)                 # the terminal goes away: SIGHUP to the session's leader, main.py
    assert proc.wait(timeout=CEILING_S) == 0
    saved = max(r["step"] for r in records(tmp_path) if "loss" in r)
    assert checkpoints(tmp_path)[-1] == saved >= 2
    assert not os.path.exists(tmp_path / "run" / "lock")
    # why it stopped, where a lost terminal can't say (CI saw the EIO first once)
    assert stop_causes(tmp_path) in ([(saved, cause)] for cause in TERMINAL_GONE)


# the wrapper: SIGHUP ignored in itself, the default in its child; it records the child's exit status
EATER = ("import signal, subprocess, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
         "rc = subprocess.call(sys.argv[2:], preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL)); "
         "open(sys.argv[1], 'w').write(str(rc))")


def main_py(out):
    return [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, *MESH1, "--output_dir", str(out), "--name",
            "run", "--training_steps", "100000"]


def process_of(out):
    """The main.py process training into `out`, or None."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if any(c.endswith("main.py") for c in cmd) and str(out) in cmd:
            return proc
    return None


def wait_until(condition, what, timeout=CEILING_S):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


@needs_tmux
def test_a_closed_tmux_pane_leaves_nohup_training_and_otherwise_saves_and_exits_0(cpu_env, tmp_path):
    """A run's tmux pane is closed (`tmux kill-session`: the pane, its window, the tmux server or the SSH
    session that held it goes), three ways a user starts main.py in it:

    - `nohup python main.py ... &` at the pane's shell: nohup ignores SIGHUP and the run goes on training
      (main.py used to replace nohup's SIG_IGN with its stop handler, and stopped);
    - `python main.py ...` at the pane's shell: the shell passes the hangup on, the run saves and exits 0;
    - behind a parent that ignores the hangup itself (a wrapper, some shells), so that none reaches
      main.py: its next write to the dead terminal fails with EIO, the same hangup: it saves and exits 0
      (it used to die in tqdm with exit 1, losing every step since its last checkpoint)."""
    env = dict(cpu_env, TMUX_TMPDIR=str(tmp_path / "tmux"), TERM="xterm", HOME=str(tmp_path))
    os.makedirs(env["TMUX_TMPDIR"])
    runs = {name: tmp_path / name for name in ("nohup", "plain", "eater")}
    for out in runs.values():
        os.makedirs(out)
    quoted = lambda cmd: " ".join(map(shlex.quote, cmd))
    try:
        for name in ("nohup", "plain"):          # typed at an interactive shell in the pane
            assert tmux(env, "new-session", "-d", "-s", name, "-x", "200", "-y", "50", "-c", str(runs[name]),
                        "bash --norc --noprofile -i").returncode == 0
        tmux(env, "send-keys", "-t", "plain", quoted(main_py(runs["plain"])), "Enter")
        # the others once the first has compiled its steps, from the compilation cache (cpu_env's)
        wait_until(lambda: last_step(runs["plain"]) >= 1, "step 1 of the plain run")
        tmux(env, "send-keys", "-t", "nohup", f"nohup {quoted(main_py(runs['nohup']))} &", "Enter")
        status = tmp_path / "eater.status"
        assert tmux(env, "new-session", "-d", "-s", "eater", "-x", "200", "-y", "50", "-c", str(runs["eater"]),
                    quoted([sys.executable, "-c", EATER, str(status), *main_py(runs["eater"])])).returncode == 0
        for name, out in runs.items():
            wait_until(lambda: last_step(out) >= 2, f"step 2 of the {name} run")
        procs = {name: process_of(out) for name, out in runs.items()}
        assert None not in procs.values(), procs
        for name in runs:
            assert tmux(env, "kill-session", "-t", name).returncode == 0

        for name in ("plain", "eater"):          # each saves the step it was at and exits
            procs[name].wait(timeout=CEILING_S)
            out = runs[name]
            assert checkpoints(out)[-1] == last_step(out) >= 2, (name, checkpoints(out), last_step(out))
            assert not os.path.exists(out / "run" / "lock"), name           # released at a normal exit
            assert records(out)[-1].get("run_goodput") is not None, name     # the stop's last record
        assert stop_causes(runs["plain"]) in ([(last_step(runs["plain"]), cause)] for cause in TERMINAL_GONE)
        assert stop_causes(runs["eater"]) == [(last_step(runs["eater"]), "stdout lost (EIO)")]
        assert status.read_text() == "0"

        at_kill = last_step(runs["nohup"])
        wait_until(lambda: last_step(runs["nohup"]) >= at_kill + 3, "the nohup run training on after the kill")
        assert procs["nohup"].is_running()
        procs["nohup"].send_signal(signal.SIGTERM)
        procs["nohup"].wait(timeout=CEILING_S)
        printed = (runs["nohup"] / "nohup.out").read_text()
        saved = checkpoints(runs["nohup"])[-1]
        assert f"SIGTERM: checkpoint of step {saved} written" in printed, printed[-3000:]
        assert saved == last_step(runs["nohup"])
    finally:
        for out in runs.values():
            proc = process_of(out)
            if proc is not None:
                proc.kill()
        kill_tmux(env)


def test_stdout_a_pipe_nobody_reads_any_more_is_a_hangup(cpu_env, tmp_path):
    """main.py | tee LOG, and the tee goes (killed with its pane): the next print fails with EPIPE, and the
    run saves and exits 0 instead of dying in a print."""
    out = tmp_path / "run-out"
    os.makedirs(out)
    proc = subprocess.Popen(main_py(out), cwd=REPO, env=cpu_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: last_step(out) >= 2, "step 2")
        proc.stdout.close()                 # the reader is gone: its end of the pipe is closed
        assert proc.wait(timeout=CEILING_S) == 0
    finally:
        proc.kill()
    assert checkpoints(out)[-1] == last_step(out) >= 2
    assert stop_causes(out) == [(last_step(out), "stdout lost (EPIPE)")]


def test_empty_prompt_samples_and_a_failed_sample_is_a_warning_after_the_checkpoint(cpu_env, tmp_path):
    os.makedirs(tmp_path / "run" / "samples.txt")           # writing a sample fails: it is a directory
    # 64 experts, one per token, and 32 tokens a step: at least 32 experts get no token.
    proc = run(cpu_env, tmp_path, *MESH1, "--max_tokens", "4", "--prompt", "", "--n_experts", "64", "--k", "1", "--train_batch_size", "1",
               "--micro_batch_size", "1", steps=2, extra_env=unoptimized(cpu_env))     # a config of this test's own
    assert "sample @ 2:\n" in proc.stdout                    # sampled from <|endoftext|>, printed as text
    # samples.txt cannot be written: a warning, and the sample spilled to a file named at exit
    assert f"WARNING: could not write {tmp_path}/run/samples.txt ([Errno 21] Is a directory" in proc.stderr
    assert f"2 record(s) could not be written to {tmp_path}/run/samples.txt ([Errno 21]" in proc.stderr
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    assert "load max/min inf (routed no token this interval: MoE layer 0 expert " in proc.stdout
    assert all(r["expert_load_spread"] is None and min(r["idle_expert_fraction"]) >= 0.5
               for r in records(tmp_path) if "val_loss" in r)


@pytest.mark.parametrize("repeats, advice", [(7, "lower --max_tokens (to at most 3)"),    # 29 tokens
                                              (8, "shorten --prompt to fewer than 32 tokens or raise --T")])  # 33
def test_prompt_too_long_for_T_is_refused_at_start(cpu_env, tmp_path, repeats, advice):
    """A prompt that leaves room for fewer new tokens than asked, and one that fills --T by itself (the
    advice used to be "at most -29")."""
    proc = run(cpu_env, tmp_path, *MESH1, "--max_tokens", "4", "--prompt",
               "And God said, " * repeats, steps=2, expect=2)
    assert "--prompt is " in proc.stderr and "--T 32" in proc.stderr and advice in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "run")


# ---------------------------------------------------------------------------------------------------------
# 4. save errors


def _refused_at_start(cpu_env, out, expected):
    """The run stops before its first step: exit 2, one line naming the checkpoint directory, nothing
    written to its run directory."""
    before = snapshot(out)
    proc = run(cpu_env, out, *MESH1, steps=4, expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: the checkpoints could not be saved in {out}/run/checkpoints ({expected}"), errors
    assert "jaxformer started" not in proc.stdout and snapshot(out) == before


def test_a_checkpoint_directory_that_cannot_take_a_save_is_refused_at_start(cpu_env, trained, tmp_path):
    """A file named checkpoints, a read-only checkpoints directory, a disk without room for one checkpoint:
    found at start, not at the first save after every step before it. The same directory writable again:
    the run resumes from its checkpoint."""
    os.makedirs(tmp_path / "file" / "run")
    (tmp_path / "file" / "run" / "checkpoints").write_text("")
    _refused_at_start(cpu_env, tmp_path / "file", f"[Errno 17] File exists: '{tmp_path}/file/run/checkpoints'")

    shutil.copytree(trained / "run", tmp_path / "ro" / "run")
    ckpts = tmp_path / "ro" / "run" / "checkpoints"
    mount("--bind", "-o", "ro", str(ckpts), str(ckpts))
    try:
        _refused_at_start(cpu_env, tmp_path / "ro", f"[Errno 30] Read-only file system: '{ckpts}/.write-test-")
    finally:
        subprocess.run(["umount", str(ckpts)], check=True)

    full = tmp_path / "full"
    os.makedirs(full)
    used = sum(s for s, _ in snapshot(trained).values())
    mount("-t", "tmpfs", "-o", f"size={used + (2 << 20)}", "tmpfs", str(full))
    try:
        shutil.copytree(trained / "run", full / "run")
        _refused_at_start(cpu_env, full, "[Errno 28] No space left on device (")
    finally:
        subprocess.run(["umount", str(full)], check=True)

    proc = run(cpu_env, tmp_path / "ro", *MESH1, steps=3)
    assert f"resumed from {ckpts}/2: step 2," in proc.stdout


def test_disk_full_while_a_checkpoint_is_written_stops_at_once_in_one_line(cpu_env, tmp_path):
    """The disk fills up while the step-20 checkpoint is being written, after the free-space check
    that precedes each save (here: the run is stopped as its temporary checkpoint directory appears,
    the tmpfs filled from outside, the run continued). Exit 1 within two steps, one line, no traceback,
    no partial checkpoint left, step 10's checkpoint kept."""
    disk = tmp_path / "disk"
    os.makedirs(disk)
    mount("-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk))
    try:
        log = tmp_path / "log"
        proc = start(cpu_env, disk, log, *MESH1, steps=40)
        partial = disk / "run" / "checkpoints" / "20.orbax-checkpoint-tmp"
        deadline = time.time() + CEILING_S
        while not os.path.exists(partial):
            assert proc.poll() is None and time.time() < deadline, open(f"{log}.err").read()[-3000:]
            time.sleep(0.001)
        proc.send_signal(signal.SIGSTOP)
        with open(disk / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=CEILING_S) == 1
        stderr = open(f"{log}.err").read()
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: could not save a checkpoint in {disk}/run/checkpoints: [Errno 28] No space left "
                          f"on device"], stderr[-3000:]
        assert "Traceback" not in stderr and len(stderr.splitlines()) < 10, stderr[-3000:]
        assert sorted(os.listdir(disk / "run" / "checkpoints")) == ["10"]
        assert last_step(disk) <= 22
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


# ---------------------------------------------------------------------------------------------------------
# 6. the data position


# The resumed runs do not learn (lr 1e-30: the parameters stay those of step 2, bit for bit; the routing bias
# stays too), and the MoE is dropless, so a step's cross-entropy is the mean of its sequences' and depends
# only on which sequences it saw. Step 2 itself trained with a large lr, so that sequences differ clearly.
FROZEN = "--max_lr 1e-30 --min_lr 0 --end_lr 0 --weight_decay 0 --bias_update_rate 0 --checkpoint_steps 100".split()
DROPLESS = ["--capacity_factor", "0"]


def ce(out, after):
    """Per-step training cross-entropy of the steps after `after` (the resumed ones)."""
    return {r["step"]: r["ce"] for r in records(out) if "ce" in r and r["step"] > after}


def test_new_batch_layout_resumes_after_the_last_sequence_consumed(cpu_env, tmp_path):
    cpu_env = cpu_env | unoptimized(cpu_env)            # three configurations of this test's own
    run(cpu_env, tmp_path / "first", *MESH1, *DROPLESS, "--train_batch_size", "4", "--max_lr", "0.02",
        "--warmup_steps", "0", steps=2)
    assert meta(tmp_path / "first", 2)["sequences"] == 8
    for name in ("one", "six"):
        shutil.copytree(tmp_path / "first" / "run", tmp_path / name / "run")
    # One sequence per step: the cross-entropy of each of sequences 8..19 in turn.
    run(cpu_env, tmp_path / "one", *DROPLESS, *FROZEN, "--train_batch_size", "1", "--micro_batch_size", "1",
        steps=14)
    # dp 2 x 1 sequence x 3 accumulation steps: 6 sequences a step, 8..13 and 14..19.
    run(cpu_env, tmp_path / "six", *DROPLESS, *FROZEN, "--n_device_axis", "2", "1", "1", "--cpu_devices", "2",
        "--train_batch_size", "1", "--micro_batch_size", "1", "--grad_step", "3", steps=4)
    one, six = ce(tmp_path / "one", after=2), ce(tmp_path / "six", after=2)
    assert sorted(one) == list(range(3, 15)) and sorted(six) == [3, 4]
    per_sequence = np.array([one[s] for s in range(3, 15)])
    assert np.ptp(per_sequence) > 0.05                          # the test can tell sequences apart
    np.testing.assert_allclose([six[3], six[4]], [per_sequence[:6].mean(), per_sequence[6:].mean()], rtol=1e-4)
    assert meta(tmp_path / "one", 14)["sequences"] == meta(tmp_path / "six", 4)["sequences"] == 20


# ---------------------------------------------------------------------------------------------------------
# 7. --sample


def test_sample_from_a_run_trained_on_222_on_111_writes_nothing(cpu_env, tmp_path):
    run(cpu_env, tmp_path, *MESH8, steps=1)
    before = snapshot(tmp_path)
    cmd = [sys.executable, os.path.join(REPO, "main.py"), "--output_dir", str(tmp_path), "--name", "run", "--sample",
           "--prompt", "And God said,", "--max_tokens", "6"]
    # the sampler at XLA -O0: compiled for this test alone, and run once
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env | unoptimized(cpu_env), capture_output=True, text=True,
                          timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"sample @ 1 of {tmp_path}/run/checkpoints:\nAnd God said," in proc.stdout
    assert "read only" not in proc.stderr, proc.stderr       # Orbax's notes on the read-only manager it was asked for
    assert snapshot(tmp_path) == before
    proc = subprocess.run(cmd[:5] + ["nothing", "--sample"], cwd=REPO, env=cpu_env, capture_output=True, text=True,
                          timeout=CEILING_S)
    assert proc.returncode == 2 and "--sample: no readable checkpoint in" in proc.stderr
    assert not os.path.exists(tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------------------
# 8. the run directory itself: read-only or full mid-run, unusable at start, a file:// URL


def _lines(text, prefix):
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_run_dir_turned_read_only_mid_run_fails_in_one_line_losing_no_record(cpu_env, tmp_path):
    """--output_dir as a file:// URL is the local path it names. The run directory turns read-only mid-run:
    one warning, the records wait in memory; the next save fails in one line (exit 1) and at exit the records
    that could not be written are spilled to $JAXFORMER_CACHE/unwritten, named in one line; no traceback.
    Started again there, or with --output_dir read-only or a file, the run is refused (exit 2) in one line."""
    out, run_dir, log = tmp_path / "out", tmp_path / "out" / "run", tmp_path / "first"
    first = start(cpu_env, f"file://{out}", log, *MESH1)
    wait_for_step(first, out, log, 2)
    mount("--bind", "-o", "ro", str(run_dir), str(run_dir))
    try:
        assert first.wait(timeout=CEILING_S) == 1, open(f"{log}.err").read()[-3000:]
        err = open(f"{log}.err").read()
        assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
        errors, warnings = _lines(err, "error:"), _lines(err, "WARNING:")
        assert len(errors) == 1 and errors[0].startswith(
            f"error: could not save the checkpoint of step 10 in {run_dir}/checkpoints: [Errno 30] Read-only file "
            f"system"), err[-3000:]
        spills = glob.glob(os.path.join(cpu_env["JAXFORMER_CACHE"], "unwritten", f"*-{first.pid}-metrics.jsonl"))
        assert len(spills) == 1 and len(warnings) == 2, err[-3000:]
        assert warnings[0].startswith(f"WARNING: could not write {run_dir}/metrics.jsonl ([Errno 30] Read-only")
        assert f"could not be written to {run_dir}/metrics.jsonl ([Errno 30] Read-only file system" in warnings[1]
        assert f"they are in {spills[0]}: the next start of this run on this host writes them there first" in warnings[1]
        with open(spills[0]) as f:
            spilled = [json.loads(line) for line in f]
        steps = [r["step"] for r in records(out) + spilled if "loss" in r]
        assert steps == list(range(1, 11)) and records(out), steps

        proc = run(cpu_env, out, *MESH1, expect=2)            # resumed on the read-only directory
        errors = _lines(proc.stderr, "error:")
        assert len(errors) == 1 and errors[0].startswith(
            f"error: cannot write the run directory {run_dir} ([Errno 30] Read-only file system: '{run_dir}/lock.")
        assert errors[0].endswith("); --output_dir must be a directory this process can write"), errors
        proc = run(cpu_env, run_dir, *MESH1, expect=2)        # --output_dir read-only
        assert _lines(proc.stderr, "error:")[0].startswith(
            f"error: cannot create the run directory {run_dir}/run ([Errno 30] Read-only file system")
    finally:
        subprocess.run(["umount", str(run_dir)], check=True)
    proc = run(cpu_env, out, *MESH1, steps=1)       # writable again: the spill goes in first
    assert f"wrote {len(spilled)} record(s) an earlier process could not write to {run_dir}/metrics.jsonl" in proc.stdout
    assert [r["step"] for r in records(out) if "loss" in r] == list(range(1, 11)) + [1]
    assert not glob.glob(f"{spills[0]}*")
    (tmp_path / "afile").write_text("")
    proc = run(cpu_env, tmp_path / "afile", *MESH1, expect=2)  # --output_dir a file
    assert _lines(proc.stderr, "error:") == [
        f"error: cannot create the run directory {tmp_path}/afile/run ([Errno 20] Not a directory: "
        f"'{tmp_path}/afile/run'); --output_dir must be a directory this process can write, or a URL (gs://bucket/runs)"]
    assert "Traceback" not in proc.stderr


def test_full_disk_mid_run_keeps_the_records_until_there_is_room(cpu_env, tmp_path):
    """The run directory's disk fills up mid-run: one warning, no half-written record; the records wait in
    memory and are written once there is room again; SIGTERM then saves and exits 0."""
    out, log = tmp_path / "out", tmp_path / "log"
    os.makedirs(out)
    mount("-t", "tmpfs", "-o", "size=256m", "tmpfs", str(out))
    try:
        proc = start(cpu_env, out, log, *MESH1, "--checkpoint_steps", "5")     # no save before step 50
        wait_for_step(proc, out, log, 2)
        with open(out / "filler", "wb", buffering=0) as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 20))
        wait_for(proc, log, lambda: "No space left on device" in open(f"{log}.err").read(), "the full-disk warning")
        os.remove(out / "filler")
        wait_for_step(proc, out, log, last_step(out) + 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=CEILING_S) == 0, open(f"{log}.err").read()[-3000:]
        err = open(f"{log}.err").read()
        assert "Traceback" not in err and _lines(err, "WARNING:") == [
            f"WARNING: could not write {out}/run/metrics.jsonl ([Errno 28] No space left on device); keeping its "
            f"records in memory and trying again with the next record"], err[-3000:]
        with open(out / "run" / "metrics.jsonl") as f:
            lines = [json.loads(line) for line in f]                           # every line whole
        steps = [r["step"] for r in lines if "loss" in r]
        assert steps == list(range(1, max(steps) + 1)) and max(steps) < 50
    finally:
        subprocess.run(["umount", str(out)], check=True)


def test_a_run_dir_left_odd_by_a_crash_or_a_deleted_lock_is_taken_as_it_is(cpu_env, tmp_path):
    """What a killed process or a hand that deleted a live run's lock leaves: a lock file that is no lock
    record, metrics.jsonl cut mid-line, and a previous session whose last record is later than this
    session's start (both ran at once). The warning names the lock without "pid None on None", the new
    records start on a line of their own, and no negative time down is reported."""
    run_dir = tmp_path / "run"
    os.makedirs(run_dir)
    (run_dir / "lock").write_bytes(b"\x00\x17not json")
    now = time.time()
    earlier = [{"step": 0, "time": now - 100, "event": "start", "process_start": now - 110},
               {"step": 1, "time": now + 60, "loss": 7.0}]
    cut = '{"step": 2, "time": 1, "lo'
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier) + cut)
    proc = run(cpu_env, tmp_path, *MESH1, steps=1)
    assert f"WARNING: taking over {run_dir}/lock: it holds no lock record this code can read" in proc.stdout
    assert "pid None" not in proc.stdout
    assert re.search(r"started \d+ s before the previous session's last record \(two sessions at once", proc.stdout)
    assert "down before this session" not in proc.stdout
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines[2] == cut and all(json.loads(line) for line in lines[3:]) and len(lines) > 4, lines
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [1, 1]
    goodput = [r for r in records(tmp_path) if "down_s" in r][-1]
    assert goodput["down_s"] == 0, goodput
