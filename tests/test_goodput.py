"""The run's goodput across sessions (metrics.earlier_sessions, Goodput.records) from hand-made metrics.jsonl
records with known times: three sessions, the second killed before its first checkpoint (no goodput
record), the third resumed; the phases, the work lost and the time down add up to the run's wall time."""
import pytest

import metrics

PHASES = metrics.Goodput.PHASES


def goodput_record(step, time, wall, **phases):
    return {"step": step, "time": time, "wall_s": wall, **{f"{p}_s": phases.get(p, 0.0) for p in PHASES},
            "redone_steps": 0, "redone_s": 0.0, "down_s": None, "goodput": 0.0}


RECORDS = [
    {"step": 3, "time": 90.0, "loss": 7.0},                      # from before sessions were recorded
    {"step": 0, "time": 105.0, "event": "start", "process_start": 100.0},
    {"step": 10, "time": 150.0, "loss": 6.0},
    goodput_record(10, 160.0, 60.0, startup=5.0, compile=15.0, train=30.0, eval=10.0),
    {"step": 14, "time": 180.0, "loss": 5.9},                    # then killed: 20 s of work lost
    {"step": 10, "time": 210.0, "event": "resume", "process_start": 200.0},
    {"step": 12, "time": 230.0, "loss": 5.8},                    # killed again before a checkpoint
    {"step": 10, "time": 300.0, "event": "resume", "process_start": 290.0},
]


def test_earlier_sessions_split_the_time_before_this_one():
    e = metrics.earlier_sessions(RECORDS, start_step=10)
    assert e.sessions == 3 and e.first_start == 100.0 and e.last_time == 300.0 and e.redone_steps == 4
    assert e.seconds == dict(startup=5.0, compile=15.0, train=30.0, eval=10.0, checkpoint=0.0, tasks=0.0, sample=0.0)
    # after the first session's goodput record (at 160): 20 s to its last record; the second had no
    # record: all of its 30 s; the third (still this process's own records) its 10 s before the event
    assert e.lost_s == pytest.approx(20.0 + 30.0 + 10.0)
    assert e.down_s == pytest.approx((200.0 - 180.0) + (290.0 - 230.0))


def test_the_runs_phases_lost_and_down_time_add_up_to_its_wall_time(monkeypatch):
    # this session: started at 400, after the three above (down from their last record at 300)
    earlier = metrics.earlier_sessions(RECORDS[:-1], start_step=10)
    goodput = metrics.Goodput(400.0, 10, earlier)
    clock = iter([420.0, 450.0, 500.0])
    monkeypatch.setattr(metrics.time, "time", lambda: next(clock, 500.0))   # records are stamped at 500
    for phase in ("startup", "compile", "train"):
        goodput.mark(phase)
    record, run, line, run_line = goodput.records(step=20)
    assert record["down_s"] == 400.0 - 230.0 and record["wall_s"] == 100.0 and record["train_s"] == 50.0
    parts = sum(run[f"run_{p}_s"] for p in PHASES) + run["run_lost_s"] + run["run_down_s"]
    assert run["run_wall_s"] == 500.0 - 100.0 == pytest.approx(parts), run
    assert run["run_sessions"] == 3 and run["run_train_s"] == 30.0 + 50.0
    assert run["run_goodput"] == pytest.approx(80.0 / 400.0)
    assert "down before this session: 3 min" in line and run_line.startswith("run goodput over 3 sessions 20% of")
