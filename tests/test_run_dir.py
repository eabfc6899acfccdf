"""The run directory's files in this process: metrics.jsonl stays strict JSON (a non-finite number is null,
and plot.py draws it as a gap), and the lock holds on any fsspec store (memory:// here; gs:// against the
emulator in test_gcs.py)."""
import json
import os

import pytest

import rundir
import plot
import utils


def _strict(line):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_non_finite_metrics_are_null_and_plot_draws_them(tmp_path):
    logger = rundir.Logger(utils.Config(), str(tmp_path), "id", True)
    nan, inf = float("nan"), float("inf")
    for step in (1, 2):
        logger.metrics({"step": step, "loss": nan if step == 1 else 2.0, "balance": 1e-4, "grad_norm": inf})
    logger.metrics({"step": 2, "val_loss": -inf, "val_balance": 1e-4, "expert_load": [[nan, 0.5], [0.5, 0.5]]})
    logger.close()
    records = [_strict(line) for line in open(tmp_path / "metrics.jsonl")]
    assert records[0]["loss"] is None and records[0]["grad_norm"] is None and records[1]["loss"] == 2.0
    assert records[2]["val_loss"] is None and records[2]["expert_load"] == [[None, 0.5], [0.5, 0.5]]
    assert sorted(os.path.basename(p) for p in plot.plot(str(tmp_path))) == ["balance.png", "expert_load.png",
                                                                             "loss.png"]


def test_lock_on_an_object_store_refuses_a_live_holder_and_takes_over_a_dead_one(capsys):
    import fsspec
    run_dir = "memory://jaxformer-lock-test/run"
    assert rundir.lock_run_dir(run_dir) == f"{run_dir}/lock"
    mine = json.loads(fsspec.filesystem("memory").cat_file("/jaxformer-lock-test/run/lock"))
    with pytest.raises(rundir.RunRefused, match=f"in use by another run: pid {os.getpid()} on {rundir._hostname()}"):
        rundir.lock_run_dir(run_dir)
    # a process of this host that is gone (no process has that identity)
    fsspec.filesystem("memory").pipe_file("/jaxformer-lock-test/run/lock", json.dumps(
        dict(mine, proc_start="1", pid=os.getpid())).encode())
    assert rundir.lock_run_dir(run_dir) == f"{run_dir}/lock"
    assert f"taking over {run_dir}/lock: pid {os.getpid()}" in capsys.readouterr().out
    assert json.loads(fsspec.filesystem("memory").cat_file("/jaxformer-lock-test/run/lock"))["pid"] == os.getpid()


GOOD = [{"step": 0, "time": 1.0, "event": "start", "process_start": 0.5},
        {"step": 1, "time": 2.0, "loss": None, "balance": 1e-4, "update_skipped": False},    # null: not finite
        {"step": 1, "time": 3.0, "val_loss": 2.0, "expert_load": [[0.5, 0.5], [1.0, None]], "partial": True},
        {"step": 1, "task": "kjv_endings", "acc": 0.5, "bpb": None, "acc_norm": None, "future_field": "kept"}]
BAD = {b"\xff\xfe": "not UTF-8 (byte 0xff at column 1)",
       b"5": "5 is not a record (a JSON object)",
       b'{"step": 1, "loss": 2.0, "ce": ': "not JSON (a record cut short by a kill, or damaged)",
       b"[" * 100_000: "not JSON (a record cut short by a kill, or damaged)",
       b'{"step": "1", "loss": 2.0}': "a record without a whole-number step",
       b'{"step": 1, "note": 2}': "a record of no kind (none of loss, val_loss, final_val_loss, task, wall_s, "
                                  "run_wall_s, event)",
       b'{"step": 1, "loss": 2.0, "val_loss": 2.0}': "a record of step and interval at once",
       b'{"step": 8, "task": "kjv_endings", "bpb": 1.0}': "a tasks record without acc",
       b'{"step": 8, "task": "kjv_endings", "acc": null, "bpb": 1.0}': "a tasks record whose acc is null, not a number",
       b'{"step": 2, "loss": "low"}': 'a step record whose loss is "low", not a number or null',
       b'{"step": 2, "val_loss": 1.0, "expert_load": [[0.5], [0.2, 0.8]]}':
           "an interval record whose expert_load is [[0.5], [0.2, 0.8]], not a list per MoE layer of as many numbers "
           "each",
       b'{"step": 2, "time": 1.0, "event": "start", "process_start": "now"}':
           'an event record whose process_start is "now", not a number'}


def test_metrics_lines_that_are_not_records_are_skipped_each_named_once(tmp_path, capsys):
    """Between good records, every kind of bad line; the last line cut short (being written) goes unsaid."""
    lines = [json.dumps(r).encode() for r in GOOD[:2]] + list(BAD) + [json.dumps(r).encode() for r in GOOD[2:]]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n\n" + b'{"step": 3, "lo')
    assert rundir.metrics_records(str(tmp_path)) == GOOD
    warned = capsys.readouterr().err.splitlines()
    named = rundir.SKIPPED_NAMED
    assert warned == [f"WARNING: {tmp_path}/metrics.jsonl line {3 + i}: {why}; skipped"
                      for i, why in enumerate(list(BAD.values())[:named])] + [
        f"WARNING: {tmp_path}/metrics.jsonl: {len(BAD) - named} more lines that are not records skipped too (the "
        f"first line {3 + named}, the last line {2 + len(BAD)})"]
    assert rundir.metrics_records(str(tmp_path)) == GOOD and capsys.readouterr().err == ""     # once per process


def test_a_damaged_part_of_a_metrics_file_on_an_object_store_costs_its_line_alone(capsys):
    import fsspec
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/damaged-parts/run/metrics.jsonl.parts/000001", b'{"step": 1, "loss": 3.0}\n\xff\n')
    fs.pipe_file("/damaged-parts/run/metrics.jsonl.parts/000002", b'{"step": 2, "loss": 2.0}\n')
    assert [r["step"] for r in rundir.metrics_records("memory://damaged-parts/run")] == [1, 2]
    assert "metrics.jsonl line 2: not UTF-8" in capsys.readouterr().err
