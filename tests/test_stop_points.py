"""A stop reaches its checkpoint within seconds wherever it lands, and no task score is lost (issue 58), driven
from outside as a user meets it: main.py as a subprocess, XLA's compile log and stdout in one file (so their
order is kept), a SIGTERM the moment an event marks the point (a record in metrics.jsonl, a line in the log, a
checkpoint directory), then the time to "checkpoint of step N written" against 5 s plus one of the run's own
steps, what ran between the signal and the save (nothing after it, but with --eval_on_stop what the interval
left, once), that nothing compiled once the first step was dispatched (the evaluation, the tasks' score steps
and the sampler are compiled with the train step), and the same command resuming where the stop left tasks.

The points: mid-interval; the first interval's end, during its long evaluation; during task scoring after a
checkpoint; during the first sample; during a save; the two in the middle of an interval's work again with
--eval_on_stop. A SIGKILL mid task scoring, then a SIGTERM while the resume scores what was lost: every task's
record of that checkpoint is there once in the end.
"""
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ceiling import CEILING_S
from run_util import MESH1, REPO, TINY_FLAGS, checkpoints, records, run

STOP_S = 5            # a stop's checkpoint is written within this plus one step
# in this order: the first short (24 examples), the second long enough to land a signal in (40 of 207)
TASK_FILES = "tests/harness_tasks/kjv_choice.yaml,kjv_endings,tests/harness_tasks/kjv_next.yaml"
TASKS = ("--eval_tasks", TASK_FILES, "--eval_tasks_limit", "40")
TASK_NAMES = ("kjv_choice", "kjv_endings", "kjv_next")
WRITTEN = re.compile(r"SIGTERM: checkpoint of step (\d+) written to \S+ \(the same command resumes it\)")


def step_record(step):
    return lambda r: r.get("step") == step and "loss" in r


@dataclasses.dataclass(frozen=True)
class Point:
    flags: tuple
    when: object            # (run directory, log so far) -> whether the point is reached
    forbidden: tuple        # what never comes between the signal and the save: lines (regexes) of work a stop leaves
    saved: range            # the steps whose checkpoint the stop may write
    under_way: str = None   # the line that ends the work the signal may land in and cannot cut short (one task):
                            # the bound counts from it
    after_save: tuple = ()  # with --eval_on_stop: the lines of what the interval left, after the save
    resumes: bool = False   # the same command resumes here: where the stop left tasks or came during a save (a
                            # plain stop's checkpoint resumes exactly in test_main)

    @property
    def eval_on_stop(self):
        return "--eval_on_stop" in self.flags


def has_record(match):
    return lambda out, log: any(match(r) for r in records(out))


def has_checkpoint_dir(step):
    """The checkpoint of `step` begun: its directory, temporary while Orbax writes it."""
    def begun(out, log):
        path = os.path.join(out, "run", "checkpoints")
        return os.path.isdir(path) and any(re.match(fr"{step}\b", d) for d in os.listdir(path))
    return begun


ANY_COMPILE = r"Compiling "
POINTS = {
    # the existing behaviour, kept: steps in flight finish, nothing else runs
    "mid-interval": Point(("--checkpoint_steps", "50"), has_record(step_record(3)), (ANY_COMPILE,), range(4, 50)),
    # step 10's record appears as the first interval ends and its evaluation begins (10 batches of 64, compiled
    # before the first step, as the sample is): the stop comes between two batches, the evaluation's line never
    "interval end, during eval": Point(("--checkpoint_steps", "10", "--val_batch_size", "64", "--eval_steps", "10",
                                        "--max_tokens", "8"), has_record(step_record(10)),
                                       (ANY_COMPILE, r"step +10 \|", r"sample @ 10"), range(10, 11)),
    # the first task's record at step 10's checkpoint: the second is being scored, the third never is
    "during task scoring": Point(("--checkpoint_steps", "1", "--max_tokens", "8", *TASKS),
                                 has_record(lambda r: r.get("step") == 10 and "task" in r),
                                 (ANY_COMPILE, r"task @ 10: kjv_next", r"sample @ 10"),
                                 range(10, 11), r"task @ 10: kjv_endings", resumes=True),
    # the first sample runs after step 5's interval record, in milliseconds (compiled before the first step): the
    # stop saves step 5 after it, or step 6 if it came once the sample was done
    "during sample": Point(("--checkpoint_steps", "5", "--max_tokens", "16"),
                           has_record(lambda r: r.get("step") == 5 and "val_loss" in r), (ANY_COMPILE,), range(5, 7)),
    # step 10's checkpoint being written (training goes on meanwhile): its own or a step's just after
    "during a save": Point(("--checkpoint_steps", "1"), has_checkpoint_dir(10), (ANY_COMPILE,), range(10, 20),
                           resumes=True),
}
# the same with --eval_on_stop: after the save, the evaluation in full, the task and the sample left
POINTS["interval end, during eval, --eval_on_stop"] = dataclasses.replace(
    POINTS["interval end, during eval"], flags=(*POINTS["interval end, during eval"].flags, "--eval_on_stop"),
    after_save=(r"step +10 \| loss", r"sample @ 10:"))
POINTS["during task scoring, --eval_on_stop"] = dataclasses.replace(
    POINTS["during task scoring"], flags=(*POINTS["during task scoring"].flags, "--eval_on_stop"),
    after_save=(r"task @ 10: kjv_next", r"sample @ 10:"))
INTERVAL_WORK = (r"\nstep +\d+ \|", r"task @", r"sample @")    # the lines of an interval's evaluation, tasks, sample


def start_logged(cpu_env, out, log, *flags):
    """main.py in the background, stdout, stderr and XLA's compile log in one file."""
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, *MESH1, "--output_dir", str(out), "--name",
           "run", "--training_steps", "100000", *flags]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=cpu_env | {"JAX_LOG_COMPILES": "1"}, stdout=f,
                                stderr=subprocess.STDOUT)


def wait_until(proc, log, condition, what):
    deadline = time.monotonic() + CEILING_S
    while not condition():
        assert proc.poll() is None, f"exit {proc.returncode} before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in {CEILING_S} s"
        time.sleep(0.02)


def stop_when(proc, out, log, reached, what, under_way=None):
    """SIGTERM once reached(out, log text); (the log from the signal on, seconds from the signal to the
    checkpoint line, seconds from the signal to the line `under_way` or 0 when none came after it). The process
    must then exit 0."""
    wait_until(proc, log, lambda: reached(out, log.read_text()), what)
    signalled = len(log.read_text())          # characters: a sample's text may hold multi-byte ones
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    ended = {}                      # when the work under way at the signal ended: its line's first sight

    def written():
        after = log.read_text()[signalled:]
        if under_way and "s" not in ended and re.search(under_way, after):
            ended["s"] = time.monotonic() - t0
        return WRITTEN.search(after)
    wait_until(proc, log, written, "checkpoint line")
    seconds = time.monotonic() - t0
    assert proc.wait(timeout=CEILING_S) == 0, log.read_text()[-3000:]
    return log.read_text()[signalled:], seconds, ended.get("s", 0.0)


def step_time_s(out):
    """One step of this run, from its own records: the median time between two steps' records."""
    return float(np.median(np.diff([r["time"] for r in records(out) if "loss" in r])))


def task_records(out, step):
    return sorted(r["task"] for r in records(out) if r.get("step") == step and "task" in r)


@pytest.mark.parametrize("name", POINTS)
def test_a_stop_saves_within_seconds_wherever_it_lands_and_the_same_command_resumes(cpu_env, tmp_path, name):
    """SIGTERM at the point: the checkpoint line within 5 s plus a step of what was under way, nothing of the
    interval's other work before it (nor after it, but with --eval_on_stop what was left, once), one stop record,
    no compile after the first step's dispatch; where the point `resumes`, the same command resumes from that
    checkpoint and scores the tasks the stop left."""
    point = POINTS[name]
    if "--eval_tasks" in point.flags:
        pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -r requirements-eval.txt")
    log = tmp_path / "log"
    proc = start_logged(cpu_env, tmp_path, log, *point.flags)
    after, seconds, under_way_s = stop_when(proc, tmp_path, log, point.when, name, point.under_way)
    written = WRITTEN.search(after)
    saved, before_save, after_save = int(written[1]), after[:written.start()], after[written.end():]
    bound = STOP_S + step_time_s(tmp_path)
    print(f"{name}: checkpoint line {seconds:.2f} s after the SIGTERM, {under_way_s:.2f} s of them finishing the "
          f"work under way (bound {bound:.2f} s after it)")
    assert seconds - under_way_s <= bound, (seconds, under_way_s, bound, after[-3000:])
    kept = checkpoints(tmp_path)
    assert saved in point.saved and saved == max(kept) and (saved < 10 or 10 in kept), (saved, kept)
    for pattern in point.forbidden:
        assert not re.search(pattern, before_save), (pattern, before_save[-3000:])
    stops = [r for r in records(tmp_path) if r.get("event") == "stop"]
    assert [(r["step"], r["cause"]) for r in stops] == [(saved, "SIGTERM")]
    text = log.read_text()                  # the intervals' evaluations, tasks and samples ran compiled programs
    assert not re.search(ANY_COMPILE, text[text.index("jaxformer started"):]), text[-3000:]
    if point.eval_on_stop:                  # what the interval left, after the save, each once
        assert all(re.search(line, after_save) for line in point.after_save), after_save[-3000:]
        assert [r["step"] for r in records(tmp_path) if "val_loss" in r].count(saved) == 1
        assert task_records(tmp_path, saved) == (sorted(TASK_NAMES) if "--eval_tasks" in point.flags else [])
        return
    assert not any(re.search(line, after_save) for line in INTERVAL_WORK), after_save[-3000:]
    if not point.resumes:
        return
    resumed = run(cpu_env, tmp_path, *MESH1, *point.flags, steps=saved + 1)
    assert f"resumed from {tmp_path}/run/checkpoints/{saved}: step {saved}," in resumed.stdout
    if "--eval_tasks" in point.flags:       # what the stop left unscored at step 10, scored by the resume
        assert task_records(tmp_path, saved) == sorted(TASK_NAMES), records(tmp_path)


def test_scores_cut_short_by_a_kill_are_scored_on_resume_and_a_stop_there_is_honoured(cpu_env, tmp_path):
    """SIGKILL once step 10's checkpoint is written and its first task scored; the resume scores the other two
    before its first step, SIGTERM as it begins: the task under way finishes, the stop writes nothing new and
    says which checkpoint to resume from; the next resume scores the last one. Each task's record of step 10
    is there once."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -r requirements-eval.txt")
    flags = ("--checkpoint_steps", "1", *TASKS)
    log = tmp_path / "killed"
    proc = start_logged(cpu_env, tmp_path, log, *flags)
    wait_until(proc, log, lambda: 10 in checkpoints(tmp_path) and task_records(tmp_path, 10), "step 10's first task")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=CEILING_S) == -signal.SIGKILL
    scored = task_records(tmp_path, 10)
    lost = [name for name in TASK_NAMES if name not in scored]
    assert len(lost) >= 2, scored             # a task takes seconds: the kill came before the second's record
    rescoring = (f"the checkpoint of step 10 has no score of --eval_tasks {','.join(lost)} (its scoring was cut "
                 f"short): scoring them now")
    log = tmp_path / "rescoring"
    proc = start_logged(cpu_env, tmp_path, log, *flags)
    after, seconds, under_way_s = stop_when(proc, tmp_path, log, lambda out, text: rescoring in text, "the rescoring",
                                            f"task @ 10: {lost[0]}")
    print(f"a stop while the resume scores: checkpoint line {seconds:.2f} s after the SIGTERM, {under_way_s:.2f} s "
          f"of them finishing the task under way")
    assert seconds - under_way_s <= STOP_S + step_time_s(tmp_path), (seconds, under_way_s)
    assert WRITTEN.search(after)[1] == "10" and checkpoints(tmp_path) == [10], checkpoints(tmp_path)
    assert f"task @ 10: {lost[-1]}" not in after and "jaxformer started" not in after, after[-3000:]
    # --training_steps 10: step 10 ends this start, which scores the task left (score_lost_tasks, as a resume that
    # trains on does before its first step) and trains nothing: a step 11 would score every task again, unchecked
    resumed = run(cpu_env, tmp_path, *MESH1, *flags, steps=10)
    assert "scoring them now" in resumed.stdout and f"task @ 10: {lost[-1]}" in resumed.stdout
    assert task_records(tmp_path, 10) == sorted(TASK_NAMES), records(tmp_path)


def test_a_finished_run_whose_last_scores_a_kill_cut_short_scores_them_when_started_again(cpu_env, tmp_path):
    """SIGKILL while the last step's tasks are scored (its checkpoint written): the same command scores the tasks
    left, then says the run has nothing to do; each task's record of that step is there once."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -r requirements-eval.txt")
    flags = ("--checkpoint_steps", "5", *TASKS, "--training_steps", "10")
    log = tmp_path / "killed"
    proc = start_logged(cpu_env, tmp_path, log, *flags)
    wait_until(proc, log, lambda: 10 in checkpoints(tmp_path) and task_records(tmp_path, 10), "step 10's first task")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=CEILING_S) == -signal.SIGKILL
    lost = [name for name in TASK_NAMES if name not in task_records(tmp_path, 10)]
    assert lost, "the kill came after every task's record: nothing to rescore"
    again = run(cpu_env, tmp_path, *MESH1, *flags, steps=10)
    assert (f"the checkpoint of step 10 has no score of --eval_tasks {','.join(lost)} (its scoring was cut short): "
            f"scoring them now") in again.stdout, again.stdout[-3000:]
    assert "ends this run (--training_steps 10" in again.stdout and "jaxformer started" not in again.stdout
    assert task_records(tmp_path, 10) == sorted(TASK_NAMES), records(tmp_path)
    assert run(cpu_env, tmp_path, *MESH1, *flags, steps=10).stdout.count("scoring them now") == 0
