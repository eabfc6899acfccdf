"""What main.py prints and writes about a run, seen from outside, on one run stopped (SIGTERM) in the middle of an
interval and resumed to its end in a terminal:

- in a terminal (a pty) every headline starts a line of its own: the progress bar is cleared before it;
- the MFU formula's long line is printed once per run directory, at its fresh start, not at a resume;
- the first interval after the resume holds its steps since the resume alone, and its record and line say so
  (`partial`), with no idle expert flagged over those few steps;
- each session (the stopped one, the finished one) ends metrics.jsonl's part with one goodput record;
- a damaged metrics.jsonl (a byte that is not UTF-8, a line `5`, a tasks record whose acc is null, one without
  its fields) is read by the resume and plot.py alike, each bad line skipped with one warning naming it, and
  the resume trains the same losses.
"""
import fcntl
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from ceiling import CEILING_S
from run_util import MESH1, REPO, TINY_FLAGS, checkpoints, records, run, start, wait_for_step

import metrics
import rundir

INTERVAL, END = 8, 16             # --checkpoint_steps and the resumed run's --training_steps: intervals end at 8, 16
RESUMED = [*MESH1, "--checkpoint_steps", str(INTERVAL), "--max_tokens", "4", "--eval_tasks", "kjv_endings",
           "--eval_tasks_limit", "4"]
FORMULA = "MFU = tokens/s x model FLOPs per token"


def in_a_terminal(cpu_env, out, *args, steps):
    """main.py as run_util.run starts it, its stdout and stderr a terminal (a pty, 120 columns): (its exit status,
    the bytes the terminal got)."""
    main, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, "--output_dir", str(out), "--name", "run",
           "--training_steps", str(steps), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env, stdin=terminal, stdout=terminal, stderr=terminal,
                            start_new_session=True)
    os.close(terminal)
    got, deadline = b"", time.time() + CEILING_S
    while time.time() < deadline:
        if select.select([main], [], [], 1)[0]:
            try:
                data = os.read(main, 1 << 16)
            except OSError:                  # EIO: the process and its children closed the terminal
                data = b""
            if not data:
                break
            got += data
    os.close(main)
    return proc.wait(timeout=CEILING_S), got


def screen(output):
    """The lines a terminal shows for `output` (no escape sequences): a carriage return goes back to the start
    of the line, where what follows overwrites it; a newline starts the next line."""
    text = output.decode()
    assert "\x1b" not in text, "an escape sequence: screen() does not know what the terminal makes of it"
    lines, line, column = [], [], 0
    for char in text:
        if char == "\n":
            lines.append("".join(line).rstrip())
            line, column = [], 0
        elif char == "\r":
            column = 0
        else:
            line[column:column + 1] = [char]
            column += 1
    return lines + ["".join(line).rstrip()]


def by_session(recs):
    """metrics.jsonl's records split where each session (process run) starts: its start or resume event."""
    sessions = []
    for r in recs:
        if r.get("event") in ("start", "resume"):
            sessions.append([])
        sessions[-1].append(r)
    return sessions


def losses(out):
    """Per-step training loss, the last record of a step winning (read as the resume reads, damaged or not)."""
    return {r["step"]: r["loss"] for r in rundir.metrics_records(str(out / "run")) if "loss" in r}


@pytest.fixture(scope="module")
def stopped(cpu_env, tmp_path_factory):
    """(run directory's parent, the step its stop saved, its stdout): SIGTERM once step 10 is written, in the
    interval 9-16 (given more steps than it lives for; the schedule does not depend on --training_steps)."""
    out = tmp_path_factory.mktemp("stopped")
    log = out / "log"
    proc = start(cpu_env, out, log, *MESH1, "--checkpoint_steps", str(INTERVAL), steps=10 * END)
    wait_for_step(proc, out, log, 10)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=CEILING_S) == 0, open(f"{log}.err").read()[-3000:]
    saved = max(checkpoints(out))
    assert 10 <= saved < END, f"stopped at step {saved}: too late for a partial interval"
    return out, saved, open(f"{log}.out").read()


@pytest.fixture(scope="module")
def resumed(cpu_env, stopped, tmp_path_factory):
    """(a copy of the stopped run resumed to its end in a terminal, with a sample and a task: the run directory's
    parent, the bytes its terminal got)."""
    out = tmp_path_factory.mktemp("resumed")
    shutil.copytree(stopped[0] / "run", out / "run")
    status, output = in_a_terminal(cpu_env, out, *RESUMED, steps=END)
    assert status == 0, output.decode()[-4000:]
    return out, output


def test_headlines_start_a_line_of_their_own_in_a_terminal(resumed):
    lines = screen(resumed[1])
    headlines = ("jaxformer started", f"step {END:>6} |", f"task @ {END}:", f"sample @ {END}:", "run goodput over",
                 "final:")
    for headline in headlines:
        where = [line.index(headline) for line in lines if headline in line]
        assert where and set(where) == {0}, (headline, [line for line in lines if headline in line])


def test_the_mfu_formula_is_printed_at_a_fresh_start_only(stopped, resumed):
    assert stopped[2].count(FORMULA) == 1
    assert FORMULA not in resumed[1].decode()


def test_the_first_interval_after_a_resume_is_labelled_partial(stopped, resumed):
    (out, output), saved = resumed, stopped[1]
    intervals = {r["step"]: r for r in records(out) if "val_loss" in r}
    assert (intervals[INTERVAL]["steps"], intervals[INTERVAL]["partial"]) == (INTERVAL, False)
    assert (intervals[END]["steps"], intervals[END]["partial"]) == (END - saved, True)
    [line] = [line for line in screen(output) if line.startswith(f"step {END:>6} |")]
    assert line.endswith(f" | partial interval: steps {saved + 1}-{END} of {INTERVAL + 1}-{END}, the others trained "
                         f"before the resume"), line
    assert "routed no token" not in output.decode()


def test_an_idle_expert_is_flagged_over_a_whole_interval_not_a_partial_one():
    idle = " (routed no token this interval: MoE layer 0 expert 3)"
    assert metrics.load_words(float("inf"), idle, partial=False) == f"load max/min inf{idle}"
    assert metrics.load_words(float("inf"), idle, partial=True) == "load max/min n/a"
    assert metrics.load_words(2.5, None, partial=True) == "load max/min 2.50"


def test_each_session_ends_with_one_goodput_record(stopped, resumed):
    first, second = by_session(records(resumed[0]))
    for session, end in ((first, stopped[1]), (second, END)):
        assert [r["step"] for r in session if "wall_s" in r] == [end], session
        assert [r["step"] for r in session if "run_wall_s" in r] == [end], session


def test_damaged_metrics_lines_are_skipped_with_a_warning_each_by_the_resume_and_plot(cpu_env, stopped, resumed,
                                                                                     tmp_path):
    shutil.copytree(stopped[0] / "run", tmp_path / "run")
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    damaged = [b'{"step": 3, "time": 1.0, "loss": 2.0, "note": "\xff"}\n', b"5\n",
               b'{"step": 8, "time": 1.0, "task": "kjv_endings", "acc": null, "bpb": 3.0}\n',
               b'{"step": 8, "time": 1.0, "task": "kjv_endings"}\n']
    path.write_bytes(b"".join(lines[:4] + damaged + lines[4:]))
    numbers = range(5, 5 + len(damaged))           # the damaged lines' numbers, counted from 1

    def assert_warned_once(stderr):
        for n in numbers:
            assert stderr.count(f"{path} line {n}: ") == 1, (n, stderr[-3000:])
        assert "Traceback" not in stderr and stderr.count("metrics.jsonl line") == len(damaged), stderr[-3000:]

    proc = run(cpu_env, tmp_path, *RESUMED, steps=END)
    assert_warned_once(proc.stderr)
    assert f"{path} line 5: not UTF-8 (byte 0xff at column 48); skipped" in proc.stderr
    again = losses(tmp_path)
    assert {s: again[s] for s in range(stopped[1] + 1, END + 1)} == {
        s: loss for s, loss in losses(resumed[0]).items() if s > stopped[1]}
    plotted = subprocess.run([sys.executable, os.path.join(REPO, "plot.py"), str(tmp_path / "run")], cwd=REPO,
                             env=cpu_env, capture_output=True, text=True, timeout=CEILING_S)
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert_warned_once(plotted.stderr)
    for name in ("loss.png", "tasks.png"):
        assert (tmp_path / "run" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
