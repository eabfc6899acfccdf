"""Figures from a run's metrics.jsonl (written by main.py; its fields: metrics_schema.METRICS).

    python plot.py [RUN_DIR] [--out DIR]

RUN_DIR defaults to runs/tiny (the embedded default's run) and may be any run directory main.py writes,
an object store's too (gs://bucket/runs/NAME, whose metrics.jsonl is a set of part objects). The PNGs go
next to its metrics.jsonl (for a URL: into NAME/ here) unless --out names another directory (the
README's figures: `--out public`, on purpose). Up to four PNGs:
  loss.png         training loss per step and validation cross-entropy per evaluation, and the training
                   tokens' unigram entropy (the no-context baseline) once the run has ended
  tasks.png        per --eval_tasks task, acc and acc_norm with chance; bits per byte of the gold
                   continuations and of the validation set (when the run scored tasks)
  balance.png      the sequence-wise balance loss (training, per step, and validation)
  expert_load.png  per MoE layer, the fraction of routed token-slots each expert received over steps
                   (1/E is perfect balance)
When a run was resumed, the last record of each step wins.
"""
import argparse
import os

import matplotlib

matplotlib.use("Agg")                    # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

import metrics_schema  # noqa: E402
import rundir  # noqa: E402


def read_metrics(run_dir):
    """(per-step training records, per-evaluation records, {task: its records}, the run's final record or
    None) of run_dir's metrics.jsonl, each sorted by step, the last record of a step winning. Every record is
    of a shape metrics_schema knows (rundir.metrics_records skips the others); a field added since it was
    written may be missing, and a number may be null (not finite: drawn as a gap)."""
    train, evals, tasks, final = {}, {}, {}, None
    for rec in rundir.metrics_records(str(run_dir)):
        kind = metrics_schema.kind_of(rec)
        if kind == "final":
            final = rec
        elif kind == "step":
            train[rec["step"]] = rec
        elif kind == "interval":
            evals[rec["step"]] = rec
        elif kind == "tasks":
            tasks.setdefault(rec["task"], {})[rec["step"]] = rec
    by_step = lambda records: [records[s] for s in sorted(records)]
    return by_step(train), by_step(evals), {name: by_step(records) for name, records in tasks.items()}, final


def plot(run_dir, out_dir=None):
    """The figures of run_dir's metrics.jsonl, written to out_dir (default: run_dir, or for a URL NAME/ in
    the current directory); their paths."""
    name = os.path.basename(os.path.normpath(str(run_dir).rstrip("/")))
    out_dir = out_dir or (name if rundir.is_url(run_dir) else run_dir)
    train, evals, tasks, final = read_metrics(run_dir)
    if not train:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no training records")
    os.makedirs(out_dir, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.6, label="train loss (CE + balance)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3, label="val cross-entropy")
    if final and final.get("unigram_entropy") is not None:
        ax.axhline(final["unigram_entropy"], color="k", ls="--", lw=0.8,
                   label=f"unigram entropy of the training tokens ({final['unigram_entropy']:.2f})")
    ax.set(xlabel="step", ylabel="nats", title=f"{name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir, "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r.get("balance") for r in train], lw=0.8, label="train")
    if any("val_balance" in r for r in evals):
        ax.plot([r["step"] for r in evals], [r.get("val_balance") for r in evals], "o-", ms=3, label="val")
    ax.set(xlabel="step", ylabel="sum over MoE layers of alpha x sum_i f_i P_i",
           title=f"{name}: sequence-wise balance loss")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir, "balance.png"))

    # the records of the newest one's shape (layers x experts): a run's model cannot change, a hand-edited file's can
    shape = lambda r: (len(r["expert_load"]), len(r["expert_load"][0]))
    loads = [r for r in evals if "expert_load" in r]
    loads = [r for r in loads if shape(r) == shape(loads[-1])]
    if loads:
        n_layers, n_experts = len(loads[0]["expert_load"]), len(loads[0]["expert_load"][0])
        cols = min(n_layers, 4)
        rows = -(-n_layers // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.5 * cols, 2.8 * rows), squeeze=False, sharey=True)
        steps = [r["step"] for r in loads]
        for layer in range(n_layers):
            ax = axes[layer // cols][layer % cols]
            for e in range(n_experts):
                ax.plot(steps, [r["expert_load"][layer][e] for r in loads], lw=1, label=f"expert {e}")
            ax.axhline(1 / n_experts, color="k", ls="--", lw=0.8)
            ax.set(title=f"MoE layer {layer}", xlabel="step")
            ax.grid(alpha=0.3)
        for i in range(n_layers, rows * cols):
            axes[i // cols][i % cols].axis("off")
        axes[0][0].set_ylabel("fraction of routed slots")
        if n_experts <= 16:
            axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{name}: per-expert load (dashed: 1/E)")
        written.append(_save(fig, out_dir, "expert_load.png"))
    if tasks:
        written.append(_plot_tasks(name, tasks, evals, out_dir))
    return written


def _plot_tasks(name, tasks, evals, out_dir):
    fig, (acc_ax, bpb_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (task, records) in enumerate(sorted(tasks.items())):
        steps, color = [r["step"] for r in records], f"C{i}"
        acc_ax.plot(steps, [100 * r["acc"] for r in records], "o-", ms=3, color=color, label=f"{task} acc")
        if any(r.get("acc_norm") is not None for r in records):
            acc_ax.plot(steps, [_percent(r.get("acc_norm")) for r in records], "s--", ms=3, color=color,
                        label=f"{task} acc_norm")
        if records[-1].get("chance") is not None:
            acc_ax.axhline(100 * records[-1]["chance"], color=color, ls=":", lw=0.8)
        bpb_ax.plot(steps, [r["bpb"] for r in records], "o-", ms=3, color=color, label=f"{task} (gold continuations)")
    val = [r for r in evals if r.get("val_bpb") is not None]
    if val:
        bpb_ax.plot([r["step"] for r in val], [r["val_bpb"] for r in val], "k.-", ms=3, label="validation set")
    acc_ax.set(xlabel="step", ylabel="% of examples", title=f"{name}: task accuracy (dotted: chance)")
    bpb_ax.set(xlabel="step", ylabel="bits per UTF-8 byte", title=f"{name}: bits per byte")
    for ax in (acc_ax, bpb_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out_dir, "tasks.png")


def _percent(share):
    return None if share is None else 100 * share


def _save(fig, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", default=os.path.join("runs", "tiny"),
                        help="run directory holding metrics.jsonl (OUTPUT_DIR/NAME)")
    parser.add_argument("--out", help="where to write the PNGs (default: RUN_DIR; the README's figures: public)")
    args = parser.parse_args(argv)
    for path in plot(args.run_dir, args.out):
        print(path)


if __name__ == "__main__":
    main()
