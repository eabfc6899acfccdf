"""plot.py turns a run's metrics.jsonl (with a resume and a line cut short by a kill) into the PNGs, next to
the run unless told where; also a run on an object store, whose metrics.jsonl is a set of part objects."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import plot  # noqa: E402


def test_plot_writes_the_four_figures(tmp_path):
    run = tmp_path / "tiny"
    run.mkdir()
    lines = []
    for step in list(range(1, 7)) + [5, 6, 7, 8]:          # killed after 6, resumed from 4
        lines.append({"step": step, "loss": 10.0 / step, "ce": 10.0 / step, "balance": 1e-4, "grad_norm": 1.0,
                      "lr": 1e-3, "drop_rate": 0.0})
        if step % 2 == 0:
            lines.append({"step": step, "val_loss": 11.0 / step, "val_bpb": 4.0 / step, "val_balance": 1e-4,
                          "expert_load": [[0.1, 0.2, 0.3, 0.4], [0.25] * 4, [0.4, 0.3, 0.2, 0.1]]})
        if step % 4 == 0:
            lines.append({"step": step, "task": "kjv_endings", "acc": 0.3, "acc_norm": 0.32, "bpb": 3.0, "chance": 0.25})
            # a loglikelihood task (evals/harness.py): no acc_norm, no chance
            lines.append({"step": step, "task": "kjv_next", "acc": 0.1, "acc_norm": None, "bpb": 2.0, "chance": None})
    lines.append({"step": 8, "final_val_loss": 1.4, "final_val_bpb": 0.5, "unigram_entropy": 6.5})
    text = "\n".join(json.dumps(l) for l in lines) + '\n{"step": 9, "lo'
    (run / "metrics.jsonl").write_text(text)
    train, evals, tasks, final = plot.read_metrics(run)
    assert final["unigram_entropy"] == 6.5
    assert [r["step"] for r in train] == list(range(1, 9)) and [r["step"] for r in evals] == [2, 4, 6, 8]
    assert [r["step"] for r in tasks["kjv_endings"]] == [4, 8] == [r["step"] for r in tasks["kjv_next"]]
    # By default next to the run (never over the README's figures in public/); elsewhere with --out.
    plot.main([str(run)])
    written = plot.plot(str(run), str(tmp_path / "public"))
    assert sorted(os.path.basename(p) for p in written) == ["balance.png", "expert_load.png", "loss.png", "tasks.png"]
    for p in written + [str(run / os.path.basename(p)) for p in written]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_reads_a_run_on_an_object_store(tmp_path, monkeypatch):
    """memory:// stands for gs:// here (the same fsspec code path; tests/test_gcs.py runs main.py on gs://)."""
    import fsspec
    fs = fsspec.filesystem("memory")
    parts = [[{"step": 1, "loss": 3.0, "ce": 3.0, "balance": 0.0}], [{"step": 2, "loss": 2.0, "ce": 2.0, "balance": 0.0},
                                                                      {"step": 2, "val_loss": 2.5, "val_balance": 0.0}]]
    for i, records in enumerate(parts, 1):
        fs.pipe_file(f"/plotted/run/metrics.jsonl.parts/{i:06d}", "".join(json.dumps(r) + "\n" for r in records).encode())
    train, evals, _, _ = plot.read_metrics("memory://plotted/run")
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [2]
    monkeypatch.chdir(tmp_path)
    written = plot.plot("memory://plotted/run")
    assert sorted(written) == [os.path.join("run", n) for n in ("balance.png", "loss.png")]


def test_plot_draws_records_of_every_shape_the_schema_accepts(tmp_path):
    """Fields missing (written before they existed), numbers null (not finite), acc_norm null in one record of a
    task only, expert loads of another shape in one record (a hand-edited file): drawn, never a traceback."""
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": None, "balance": 1e-4},
               {"step": 1, "val_loss": 3.1, "expert_load": [[0.5, 0.5]]},
               {"step": 2, "val_loss": None, "val_balance": 1e-4, "expert_load": [[0.2, 0.3, 0.5], [0.4, 0.3, 0.3]]},
               {"step": 1, "task": "kjv_endings", "acc": 0.3, "bpb": None, "acc_norm": 0.2},
               {"step": 2, "task": "kjv_endings", "acc": 0.4, "bpb": 2.0, "acc_norm": None, "chance": 0.25},
               {"step": 2, "final_val_loss": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot.plot(str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == ["balance.png", "expert_load.png", "loss.png", "tasks.png"]
