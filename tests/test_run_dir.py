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
