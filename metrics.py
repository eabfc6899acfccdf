"""The training loop's metrics: each step's record (written to metrics.jsonl, watched for spikes and
non-finite values), each interval's record and log line (validation, tokens/s, MFU, the experts'
loads and drops). Every field and its meaning: metrics_schema.METRICS.
"""
import dataclasses
import os
import time

import jax
import numpy as np
import psutil

import hardware
import metrics_schema
import sharding
import spikes


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
        self.recorded = run.start_step                   # the newest step whose results were fetched

    def dispatched(self, step, metrics):
        self.pending.append((step, metrics))

    def fetch(self, everything=True):
        """Fetch and record the pending steps' metrics: all of them, or all but the newest (never before
        the first step is timed, so the timer starts after compilation)."""
        while self.pending and (everything or self.t is None or len(self.pending) > 1):
            step, metrics = self.pending.pop(0)
            self.record(step, jax.device_get(metrics))

    def record(self, step, m):
        rec = metrics_schema.metrics_record(
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
        self.recorded = step
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

    def take_interval(self, until):
        """(step records, their device metrics, seconds per step or None) of the interval, its steps timed up to
        `until` (a perf_counter time), which starts over; the step time is the first step's (compilation
        included) when no other step was timed."""
        elapsed = until - self.t if self.t is not None else 0.0
        recs, device = [r for r, _ in self.interval], [m for _, m in self.interval]
        step_time = elapsed / self.steps if self.steps and elapsed > 0 else None
        self.interval, self.steps = [], 0
        return recs, device, step_time

    def restart_timer(self):
        """After the interval's evaluation, save and sample: the next steps are timed from here."""
        self.t, self.steps = time.perf_counter(), 0


def duration(seconds):
    """A span of time for a log line: 42 s, 12 min, 3.4 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


@dataclasses.dataclass
class Earlier:
    """The run's earlier sessions (process runs), read from its metrics.jsonl by process 0: each starts at
    its "event" record and its time is known up to its last "goodput" record (written at every
    checkpoint); after that, up to its last record of any kind, it did work the next session redoes
    (lost_s); from there to the next session's start the run was down (down_s)."""
    sessions: int = 0
    first_start: float = None
    seconds: dict = dataclasses.field(default_factory=dict)    # phase -> seconds, summed over the sessions
    lost_s: float = 0.0
    down_s: float = 0.0                                        # between the earlier sessions
    last_time: float = None                                    # the newest record's
    redone_steps: int = 0                                      # logged past the step this session starts from


def earlier_sessions(records, start_step):
    """Earlier from metrics.jsonl's records, each of a shape metrics_schema.problem accepts (records written
    before sessions were recorded count only for redone_steps and last_time; a phase added since a goodput
    record was written counts 0 s in it)."""
    sessions = []                               # [start, last goodput record, last record's time]
    for r in records:
        kind = metrics_schema.kind_of(r)
        if kind == "event" and r["event"] in ("start", "resume") and "process_start" in r and "time" in r:
            sessions.append([r["process_start"], None, r["time"]])
        elif sessions and kind == "goodput":
            sessions[-1][1] = r
        if sessions and "time" in r:
            sessions[-1][2] = max(sessions[-1][2], r["time"])
    earlier = Earlier(sessions=len(sessions), first_start=sessions[0][0] if sessions else None,
                      seconds=dict.fromkeys(Goodput.PHASES, 0.0),
                      last_time=max((r["time"] for r in records if "time" in r), default=None),
                      redone_steps=max(0, max((r["step"] for r in records if metrics_schema.kind_of(r) == "step"),
                                              default=0) - start_step))
    for i, (start, goodput, last) in enumerate(sessions):
        known = start + goodput["wall_s"] if goodput else start
        for p in Goodput.PHASES:
            earlier.seconds[p] += goodput.get(f"{p}_s", 0.0) if goodput else 0.0
        earlier.lost_s += max(0.0, last - known)
        if i + 1 < len(sessions):
            earlier.down_s += max(0.0, sessions[i + 1][0] - last)
    return earlier


def process_start():
    """Unix seconds when this process started, to the clock tick: from /proc (psutil's create_time is up
    to a second early on Linux: it adds the boot time, which /proc/stat rounds to a second)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])           # field 22, starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, ValueError):                           # not Linux
        return psutil.Process().create_time()


class Goodput:
    """Where this process's wall time went, from its start: each `mark(phase)` books the time since the
    previous mark to that phase, so the phases add up to the wall time. "train" is the steps after the
    first (whose dispatch compiles: "compile"), "startup" the imports, devices, data and restore; the
    steps of a previous session past the checkpoint this one resumed from are done again, and are
    counted as lost ("redone"). With the earlier sessions (process 0), the same for the whole run."""

    PHASES = ("startup", "compile", "train", "eval", "checkpoint", "tasks", "sample")

    def __init__(self, started, start_step, earlier=None):
        self.started, self.last = started, started
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.start_step, self.earlier = start_step, earlier
        self.redone_steps = earlier.redone_steps if earlier else 0
        # < 0: this session started before the previous one's last record, i.e. both ran at once (its lock
        # was deleted by hand): no time down
        self.overlap_s = max(0.0, earlier.last_time - started) if earlier and earlier.last_time is not None else 0.0
        self.down_s = max(0.0, started - earlier.last_time) if earlier and earlier.last_time is not None else None

    def mark(self, phase):
        now = time.time()
        self.seconds[phase] += now - self.last
        self.last = now

    def records(self, step):
        """The metrics.jsonl records (metrics_schema.METRICS["goodput"], and ["run_goodput"] with the earlier
        sessions known, else None) and their log lines (the run's None for a first session)."""
        wall = self.last - self.started
        per_step = self.seconds["train"] / max(step - self.start_step - 1, 1)      # the first one compiled
        redone = min(self.redone_steps * per_step, self.seconds["train"])
        rec = metrics_schema.metrics_record("goodput", step, wall_s=wall, **{f"{p}_s": v for p, v in self.seconds.items()},
                                   redone_steps=self.redone_steps, redone_s=redone, down_s=self.down_s,
                                   goodput=(self.seconds["train"] - redone) / wall if wall > 0 else None)
        line = f"goodput {_shares(rec['goodput'], wall, self.seconds)}"
        if self.redone_steps:
            line += f" | redone after the restart: {self.redone_steps} steps, {duration(redone)}"
        if self.overlap_s:
            line += (f" | started {duration(self.overlap_s)} before the previous session's last record (two "
                     f"sessions at once: was the run's lock deleted?)")
        elif self.down_s is not None:
            line += f" | down before this session: {duration(self.down_s)}"
        if self.earlier is None:
            return rec, None, line, None
        e = self.earlier
        seconds = {p: e.seconds[p] + self.seconds[p] for p in self.PHASES}
        run_wall = self.last - (e.first_start if e.first_start is not None else self.started)
        down = e.down_s + (self.down_s or 0.0)
        # stamped with rec's time: the two describe one moment, and a reader pairs them by it (two clock
        # reads could straddle a millisecond)
        run = metrics_schema.metrics_record(
            "run_goodput", step, run_sessions=e.sessions + 1, run_wall_s=run_wall, run_lost_s=e.lost_s,
            run_down_s=down, **{f"run_{p}_s": v for p, v in seconds.items()},
            run_goodput=seconds["train"] / run_wall if run_wall > 0 else None) | {"time": rec["time"]}
        run_line = (f"run goodput over {e.sessions + 1} sessions {_shares(run['run_goodput'], run_wall, seconds)} | "
                    f"lost after an interrupted session's last checkpoint {duration(e.lost_s)} | down between "
                    f"sessions {duration(down)}") if e.sessions else None
        return rec, run, line, run_line


def _shares(goodput, wall, seconds):
    """'71% of 3.2 h: startup 12 s (0%) | compile ...'"""
    if wall <= 0:
        return "n/a"
    return f"{100 * goodput:.0f}% of {duration(wall)}: " + " | ".join(
        f"{p} {duration(v)} ({100 * v / wall:.0f}%)" for p, v in seconds.items())


def say(bar, text):
    """A line above the progress bar, on process 0."""
    if jax.process_index() == 0:
        bar.write(text)


def evaluate(trainer, state, val_batches, stop=lambda: False):
    """(val cross-entropy, val balance term), means over the fixed validation batches; None when stop() says so
    before a batch. The host waits for each batch while the next one runs, so a stop waits for the two in flight
    at most (all dispatched at once, it would wait for the whole evaluation)."""
    results = []
    for x, y in val_batches:
        if len(results) > 1:
            jax.block_until_ready(results[-2])
        if stop():
            return None
        results.append(trainer.eval_step(state["params"], state["router_bias"], x, y))
    return float(np.mean([float(r[0]) for r in results])), float(np.mean([float(r[1]) for r in results]))


def log_interval(run, meter, state, step, stop=lambda: False):
    """Evaluate and write the interval's record (metrics_schema.METRICS["interval"]) and line; returns val CE, or
    None when stop() ended the evaluation (`evaluate`), the interval's steps then kept for a later call."""
    cfg = run.cfg
    meter.fetch()
    steps_end = time.perf_counter()          # the steps are timed up to here, not through the evaluation
    evaluated = evaluate(run.trainer, state, run.val_batches, stop)
    if evaluated is None:
        return None
    val_ce, val_bal = evaluated
    recs, device, step_time = meter.take_interval(steps_end)
    tok_s = run.sequences_per_step * cfg.model.T / step_time if step_time else None
    step_time = step_time or meter.first_step_s
    val_bpb = metrics_schema.bits_per_byte(val_ce, run.val_bytes_per_token)
    experts = expert_stats(device)
    spread, idle = load_spread(np.asarray(experts["expert_load"]))
    first = interval_start(step, cfg.run.checkpoint_steps)
    partial = recs[0]["step"] > first
    peak = hardware.peak_flops(jax.devices()[0].device_kind)
    util = hardware.mfu(tok_s, sharding.flops_per_token(cfg.model), cfg.run.dims.n_devices, peak) if tok_s else None
    rec = metrics_schema.metrics_record(
        "interval", step, val_loss=val_ce, val_bpb=val_bpb, val_balance=val_bal,
        train_loss=float(np.mean([r["loss"] for r in recs])),
        lr=recs[-1]["lr"], grad_norm=recs[-1]["grad_norm"], tokens_per_s=tok_s, step_time_s=step_time, mfu=util,
        **experts, expert_load_spread=spread if idle is None else None,
        drop_rate=float(np.mean([r["drop_rate"] for r in recs])), balance=float(np.mean([r["balance"] for r in recs])),
        skipped_steps=recs[-1]["skipped_steps"], steps=len(recs), partial=partial, **meter.watch.interval())
    run.logger.metrics(rec)
    say(meter.bar, f"step {step:>6} | loss {recs[-1]['loss']:.4f} | val {val_ce:.4f} ({val_bpb:.3f} bpb) | "
                   f"lr {rec['lr']:.2e} | grad {rec['grad_norm']:.3f} | "
                   f"{(f'{tok_s:,.0f}' if tok_s else 'n/a'):>8} tok/s | step {step_time * 1e3:.0f} ms | MFU {(f'{100 * util:.1f}%' if util is not None else 'n/a')} | "
                   f"{load_words(spread, idle, partial)} | drop {100 * rec['drop_rate']:.2f}%"
                   + (f" | partial interval: steps {recs[0]['step']}-{step} of {first}-{step}, the others trained "
                      f"before the resume" if partial else ""))
    return val_ce


def interval_start(step, checkpoint_steps):
    """The first step of the interval that ends at `step` (the last one's may be cut short by --training_steps)."""
    return (step - 1) // checkpoint_steps * checkpoint_steps + 1


def load_words(spread, idle, partial):
    """The line's expert loads. An expert idle over a partial interval's few steps (the first interval after
    a resume) is no sign of collapse, as its whole interval would likely have routed it some: n/a, not flagged."""
    if idle is not None and partial:
        return "load max/min n/a"
    return f"load max/min {spread:.2f}{idle or ''}"


def load_spread(load):
    """(max/min tokens per expert over the worst MoE layer, a note naming idle experts or None); inf when
    an expert got no tokens: the router sent it none of the interval's tokens (early in a run, or an
    expert collapsing; the balance loss and --bias_update_rate pull it back)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = float(np.max(load.max(-1) / load.min(-1)))
    idle = [f"layer {layer} expert {e}" for layer, e in zip(*np.nonzero(load == 0))]
    if not idle:
        return spread, None
    more = f" and {len(idle) - 4} more" if len(idle) > 4 else ""
    return spread, f" (routed no token this interval: MoE {', '.join(idle[:4])}{more})"


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
