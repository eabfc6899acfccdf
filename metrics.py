"""The training loop's metrics: each step's record (written to metrics.jsonl, watched for spikes and
non-finite values), each interval's record and log line (validation, tokens/s, MFU, the experts'
loads and drops). Every field and its meaning: utils.METRICS.
"""
import time

import jax
import numpy as np

import model
import spikes
import utils


class Diverged(Exception):
    """--max_bad_steps steps in a row were not finite (their updates skipped): main() exits 1."""


class Meter:
    """Per-step metrics and timing. The loop dispatches a step before the previous one's metrics are
    fetched (the host stays one step ahead of the device); each fetched step is written to
    metrics.jsonl, watched for spikes and kept for its interval's record. The first step, which
    compiles, is timed apart."""

    def __init__(self, run, bar):
        self.logger, self.schedule, self.bar = run.logger, run.trainer.schedule, bar
        self.watch = spikes.SpikeWatch(run.cfg.optim.skip_spikes or spikes.RATIO_WARN)
        self.skipped = int(jax.device_get(run.state["opt_state"].skipped))  # before the next fetched step
        self.max_bad, self.bad_steps = run.cfg.run.max_bad_steps, []          # non-finite steps in a row
        self.mngr = run.mngr
        self.pending, self.interval = [], []
        self.t0 = time.perf_counter()
        self.t, self.steps, self.first_step_s = None, 0, None

    def dispatched(self, step, metrics):
        self.pending.append((step, metrics))

    def fetch(self, everything=True):
        """Fetch and record the pending steps' metrics: all of them, or all but the newest (never before
        the first step is timed, so the timer starts after compilation)."""
        while self.pending and (everything or self.t is None or len(self.pending) > 1):
            step, metrics = self.pending.pop(0)
            self.record(step, jax.device_get(metrics))

    def record(self, step, m):
        rec = utils.metrics_record(
            "step", step, loss=float(m["loss"]), ce=float(m["ce"]), balance=float(np.sum(m["balance"])),
            grad_norm=float(m["grad_norm"]), lr=float(self.schedule(step - 1)),
            drop_rate=float(np.mean(m["drop_rate"])), skipped_steps=int(m["skipped"]),
            grad_norm_ratio=float(m["grad_norm_ratio"]) if np.isfinite(m["grad_norm_ratio"]) else None,
            update_skipped=int(m["skipped"]) > self.skipped, loss_jump=None, nonfinite=bool(m["nonfinite"]))
        self.skipped = rec["skipped_steps"]
        if rec["nonfinite"]:
            self.not_finite(rec)
        else:
            self.bad_steps = []
            warning = self.watch.step(rec)                   # sets rec["loss_jump"]
            if warning:
                say(self.bar, warning)
        self.logger.metrics(rec)
        if len(self.bad_steps) >= self.max_bad:
            newest = self.mngr.latest_step()
            raise Diverged(f"steps {self.bad_steps[0]}-{self.bad_steps[-1]} in a row had a non-finite loss, gradient "
                           f"or updated state (--max_bad_steps {self.max_bad}); their updates were skipped and the "
                           f"run stops. " + (f"The newest checkpoint, {self.mngr.directory}/{newest}, is from before "
                                             f"them: resume from it with a lower --max_lr or other changes"
                                             if newest is not None else "No checkpoint was written yet"))
        self.interval.append((rec, m))
        now = time.perf_counter()
        if self.t is None:
            self.first_step_s, self.t, self.steps = now - self.t0, now, 0
        else:
            self.steps += 1
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)

    def not_finite(self, rec):
        """A step whose update train_step skipped: say so, count it in the run of such steps."""
        self.bad_steps.append(rec["step"])
        say(self.bar, f"WARNING: step {rec['step']}: loss {rec['loss']}, grad norm {rec['grad_norm']}: not finite; "
                      f"its update was skipped (parameters, Adam moments and routing bias unchanged), "
                      f"{len(self.bad_steps)} in a row of --max_bad_steps {self.max_bad}")

    def take_interval(self):
        """(step records, their device metrics, seconds per step or None) of the interval, which starts
        over; the step time is the first step's (compilation included) when no other step was timed."""
        elapsed = time.perf_counter() - self.t if self.t is not None else 0.0
        recs, device = [r for r, _ in self.interval], [m for _, m in self.interval]
        step_time = elapsed / self.steps if self.steps and elapsed > 0 else None
        self.interval, self.steps = [], 0
        return recs, device, step_time

    def restart_timer(self):
        """After the interval's evaluation, save and sample: the next steps are timed from here."""
        self.t, self.steps = time.perf_counter(), 0


class Goodput:
    """Where this process's wall time went, from its start: each `mark(phase)` books the time since the
    previous mark to that phase, so the phases add up to the wall time. "train" is the steps after the
    first (whose dispatch compiles: "compile"), "startup" the imports, devices, data and restore; the
    steps of a previous session past the checkpoint this one resumed from are done again, and are
    counted as lost ("redone")."""

    PHASES = ("startup", "compile", "train", "eval", "checkpoint", "sample")

    def __init__(self, started, start_step, redone_steps):
        self.started, self.last = started, started
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.start_step, self.redone_steps = start_step, redone_steps

    def mark(self, phase):
        now = time.time()
        self.seconds[phase] += now - self.last
        self.last = now

    def record(self, step):
        """The metrics.jsonl record (utils.METRICS["goodput"]) and its one log line."""
        wall = self.last - self.started
        per_step = self.seconds["train"] / max(step - self.start_step - 1, 1)      # the first one compiled
        redone = min(self.redone_steps * per_step, self.seconds["train"])
        useful = self.seconds["train"] - redone
        rec = utils.metrics_record("goodput", step, wall_s=wall, **{f"{p}_s": v for p, v in self.seconds.items()},
                                   redone_steps=self.redone_steps, redone_s=redone,
                                   goodput=useful / wall if wall > 0 else None)
        shares = " | ".join(f"{p} {v:.0f} s ({100 * v / wall:.0f}%)" for p, v in self.seconds.items() if wall > 0)
        line = (f"goodput {100 * rec['goodput']:.0f}% of {wall:.0f} s: {shares}" if wall > 0 else "goodput n/a")
        if self.redone_steps:
            line += f" | redone after the restart: {self.redone_steps} steps, {redone:.0f} s"
        return rec, line


def say(bar, text):
    """A line above the progress bar, on process 0."""
    if jax.process_index() == 0:
        bar.write(text)


def evaluate(trainer, state, val_batches):
    """(val cross-entropy, val balance term), means over the fixed validation batches."""
    results = [trainer.eval_step(state["params"], state["router_bias"], x, y) for x, y in val_batches]
    return float(np.mean([float(r[0]) for r in results])), float(np.mean([float(r[1]) for r in results]))


def log_interval(run, meter, state, step):
    """Evaluate and write the interval's record (utils.METRICS["interval"]) and line; returns val CE."""
    cfg, (dp, pp, tp) = run.cfg, run.cfg.run.n_device_axis
    meter.fetch()
    recs, device, step_time = meter.take_interval()
    tok_s = run.sequences_per_step * cfg.model.T / step_time if step_time else None
    step_time = step_time or meter.first_step_s
    val_ce, val_bal = evaluate(run.trainer, state, run.val_batches)
    experts = expert_stats(device)
    spread, idle = load_spread(np.asarray(experts["expert_load"]))
    peak = utils.peak_flops(jax.devices()[0].device_kind)
    util = utils.mfu(tok_s, model.flops_per_token(cfg.model), dp * pp * tp, peak) if tok_s else None
    rec = utils.metrics_record(
        "interval", step, val_loss=val_ce, val_balance=val_bal, train_loss=float(np.mean([r["loss"] for r in recs])),
        lr=recs[-1]["lr"], grad_norm=recs[-1]["grad_norm"], tokens_per_s=tok_s, step_time_s=step_time, mfu=util,
        **experts, expert_load_spread=spread if idle is None else None,
        drop_rate=float(np.mean([r["drop_rate"] for r in recs])), balance=float(np.mean([r["balance"] for r in recs])),
        skipped_steps=recs[-1]["skipped_steps"], **meter.watch.interval())
    run.logger.metrics(rec)
    say(meter.bar, f"step {step:>6} | loss {recs[-1]['loss']:.4f} | val {val_ce:.4f} | lr {rec['lr']:.2e} | "
                   f"grad {rec['grad_norm']:.3f} | {(f'{tok_s:,.0f}' if tok_s else 'n/a'):>8} tok/s | "
                   f"step {step_time * 1e3:.0f} ms | MFU {(f'{100 * util:.1f}%' if util is not None else 'n/a')} | "
                   f"load max/min {spread:.2f}{idle or ''} | drop {100 * rec['drop_rate']:.2f}%")
    return val_ce


def load_spread(load):
    """(max/min tokens per expert over the worst MoE layer, a note naming idle experts or None); inf when
    an expert got no tokens."""
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = float(np.max(load.max(-1) / load.min(-1)))
    idle = [f"{layer}.{e}" for layer, e in zip(*np.nonzero(load == 0))]
    if not idle:
        return spread, None
    more = f" and {len(idle) - 8} more" if len(idle) > 8 else ""
    return spread, f" (no tokens: expert {', '.join(idle[:8])}{more}, as layer.expert)"


def expert_stats(steps):
    """Per MoE layer, lists indexed by layer, over a log interval from its steps' device metrics: each
    expert's share of the routed choices (before capacity drops), the fraction of experts that got
    none, the busiest expert's load over the mean, the fraction of choices dropped, and the balance
    term (alpha applied; the loss adds the layers')."""
    tokens = np.sum([m["tokens_per_expert"] for m in steps], axis=0)          # [layers, experts]
    return {"expert_load": (tokens / tokens.sum(-1, keepdims=True)).tolist(),
            "idle_expert_fraction": np.mean(tokens == 0, axis=-1).tolist(),
            "load_max_over_mean": (tokens.max(-1) / tokens.mean(-1)).tolist(),
            "layer_drop_rate": np.mean([m["drop_rate"] for m in steps], axis=0).tolist(),
            "layer_balance": np.mean([m["balance"] for m in steps], axis=0).tolist()}
