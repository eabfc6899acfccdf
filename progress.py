"""The training loop's bookkeeping, advanced by the loop's events: the progress bar, the per-step metrics
(metrics.Meter), the stop signals and their agreement across hosts, and where the time goes
(metrics.Goodput) with the hang watchdog's heartbeat (multihost.Watchdog). Goodput's phases and the
watchdog's progress are the same events: `done` marks both."""
import sys

import jax
from tqdm import tqdm

import metrics_schema
from checkpoints import wait_for_save
from metrics import Goodput, Meter, earlier_sessions, process_start, say
from multihost import StopAgreement, StopSignals, Watchdog, log, started_line
from rundir import metrics_records, run_dir_of


class Progress:
    def __init__(self, run):
        self.run, rc = run, run.cfg.run
        self.goodput = Goodput(process_start(), run.start_step, _earlier_sessions(run))
        self.goodput.mark("startup")
        run.logger.metrics(metrics_schema.metrics_record("event", run.start_step, event="start" if run.meta is None else "resume",
                                                process_start=self.goodput.started))
        self.signals = StopSignals()         # first: it guards sys.stdout, which the progress bar writes to
        # A progress bar on a terminal; a log file (launcher.sh's) gets the interval lines alone, not redraws.
        self.bar = tqdm(total=run.cfg.optim.training_steps, initial=run.start_step, dynamic_ncols=True, desc="train",
                        disable=jax.process_index() != 0 or not sys.stdout.isatty(), unit="step", file=sys.stdout,
                        mininterval=0.5)
        if not self.bar.disable:
            sys.stdout, sys.stderr = _AboveTheBar(sys.stdout, self.bar), _AboveTheBar(sys.stderr, self.bar)
        self.meter = Meter(run, self.bar)
        # every process stops at the same step; agreed every few seconds, not every step (multihost.py)
        self.agreement = StopAgreement(lambda: self.signals.requested)
        self.watchdog = Watchdog(rc.hang_timeout, rc.heartbeat_file)
        self.stopping = False
        self.signals.compiling = "the training step"
        say(self.bar, "compiling the training step (the first step waits for it)")

    def done(self, phase, next_doing=None):
        """The loop finished `phase` (Goodput's) and goes on to `next_doing`, what a hang would be stuck in."""
        self.goodput.mark(phase)
        if next_doing is not None:
            self.watchdog.progress(next_doing, self.meter.recorded)

    def stepped(self, step, metrics):
        """Step `step` was dispatched (the ones before it are fetched and recorded). Returns whether its
        interval's evaluation, checkpoint and sample are due: the interval ends, or every process agreed to
        stop (self.stopping)."""
        first = step == self.run.start_step + 1
        self.meter.dispatched(step, metrics)
        if first:                            # every process; launcher.sh waits for this line
            self.signals.compiling = None
            print(started_line(jax.process_index(), jax.process_count()), flush=True)
        self.meter.fetch(everything=False)
        self.done("compile" if first else "train", f"training step {step} (dispatched; the steps before it done)")
        interval_ends = step % self.run.cfg.run.checkpoint_steps == 0 or step == self.run.cfg.optim.training_steps
        self.stopping = self.agreement(step, synced=interval_ends)
        return interval_ends or self.stopping

    def stop_agreed(self, step):
        """Whether every process agreed to stop, asked between the pieces of work after step `step` (the
        evaluation's batches, the checkpoint, each task, the sample). Every process asks at the same points and
        all get the same answer, so on several hosts each ask is one collective that all of them make."""
        self.stopping = self.stopping or self.agreement(step, synced=True)
        return self.stopping

    def fetch_all(self, next_doing):
        """Every dispatched step's results, recorded: the steps so far are done."""
        self.meter.fetch()
        self.done("train", next_doing)

    def interval_done(self, step, saved, last):
        """After an interval's evaluation, checkpoint and sample: where the time went so far (written with a
        checkpoint, so an interrupted session's time is known to its last one; not with the `last` step's, whose
        records the end's report writes once the save is done), the next steps timed anew."""
        self.report(step, write=saved and not last)
        self.watchdog.progress(f"the interval after step {step}")
        self.meter.restart_timer()

    def report(self, step, write=True, final=False):
        """Where this process's and the run's time went: the heartbeat file, metrics.jsonl (`write`) and, at
        the end of the process (once its last checkpoint is written), the log."""
        if final:
            wait_for_save(self.run.mngr)
            self.goodput.mark("checkpoint")
        record, run_record, line, run_line = self.goodput.records(step)
        for rec in (record, run_record):
            if rec is not None and write:
                self.run.logger.metrics(rec)
        self.watchdog.note(goodput=line, run_goodput=run_line or "")
        if final:
            log(line + (f"\n{run_line}" if run_line else ""))

    def close(self):
        self.bar.close()
        for name in ("stdout", "stderr"):
            if isinstance(getattr(sys, name), _AboveTheBar):
                setattr(sys, name, getattr(sys, name).unwrapped())


class _AboveTheBar:
    """sys.stdout or sys.stderr while the progress bar is drawn on a terminal. The bar's line ends in no newline
    (each redraw goes back to its start with a carriage return), so a line printed as it is (log(), print, a
    warning) would be glued to the bar's end. What is written here waits for the end of its line (print writes
    the newline apart); then the bar is cleared (it is on stdout, so a line on stderr waits for that too), the
    lines are written, and the bar is drawn again below them."""

    def __init__(self, stream, bar):
        self._stream, self._bar, self._waiting = stream, bar, ""

    def write(self, text):
        with self._bar.get_lock():          # the bar's own: its redraws wait, and so does another thread's line
            self._waiting += text
            if self._waiting.endswith("\n"):
                self._bar.clear(nolock=True)
                self._bar.fp.flush()
                self._stream.write(self._waiting)
                self._stream.flush()
                self._bar.refresh(nolock=True)
                self._waiting = ""
        return len(text)

    def flush(self):
        self._stream.flush()

    def unwrapped(self):
        """The stream, with what still waits for its line's end written to it (the bar is closed)."""
        self._stream.write(self._waiting)
        return self._stream

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _earlier_sessions(run):
    """The run's earlier sessions, from metrics.jsonl (process 0; the others write no metrics: None)."""
    if jax.process_index() != 0:
        return None
    return earlier_sessions(metrics_records(run_dir_of(run.cfg.run)), run.start_step)
