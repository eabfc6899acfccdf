"""The loss-spike watch, host-side bookkeeping for main.py's loop: per step the loss jump over the median
of the previous LOSS_WINDOW losses, per log interval the largest jump and grad-norm ratio (the ratio comes
from optimizer.skip_spikes' window), and a warning line naming the step when either crosses its threshold.
Why the tiny preset no longer spikes, and --skip_spikes: docs/training.md, "Loss spikes"."""
from collections import deque

import numpy as np

LOSS_WINDOW = 10            # a loss is compared with the median of this many previous losses
LOSS_JUMP_WARN = 0.5        # nats above that median: a spike
RATIO_WARN = 5.0            # grad norm over its running median: a spike (or --skip_spikes when set)


class SpikeWatch:
    """The loop's view of spikes: `step(record)` per fetched step (adds 'loss_jump' and returns a
    warning line or None), `interval()` the largest jump and grad-norm ratio since the last call."""

    def __init__(self, ratio_warn=RATIO_WARN):
        self.ratio_warn = ratio_warn
        self.losses = deque(maxlen=LOSS_WINDOW)
        self.max_jump = self.max_ratio = None

    def step(self, rec):
        jump = rec["loss"] - float(np.median(self.losses)) if len(self.losses) == LOSS_WINDOW else None
        self.losses.append(rec["loss"])
        rec["loss_jump"] = jump
        ratio = rec.get("grad_norm_ratio")
        self.max_jump = _max(self.max_jump, jump)
        self.max_ratio = _max(self.max_ratio, ratio)
        big_jump = jump is not None and jump > LOSS_JUMP_WARN
        big_ratio = ratio is not None and ratio > self.ratio_warn
        if not (big_jump or big_ratio):
            return None
        median = f"{rec['loss'] - jump:.3f}" if jump is not None else "n/a"
        return (f"WARNING: spike at step {rec['step']}: loss {rec['loss']:.3f} (median of the previous "
                f"{LOSS_WINDOW}: {median}), grad norm {rec['grad_norm']:.2f} = "
                f"{ratio if ratio is not None else float('nan'):.1f}x its running median"
                + (" (update skipped)" if rec.get("update_skipped") else ""))

    def interval(self):
        out = {"max_loss_jump": self.max_jump, "max_grad_norm_ratio": self.max_ratio}
        self.max_jump = self.max_ratio = None
        return out


def _max(a, b):
    if b is None or not np.isfinite(b):
        return a
    return b if a is None else max(a, b)
