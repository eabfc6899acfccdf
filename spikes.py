"""Loss spikes: the fix at their cause, a watch in every run, and skipping as large runs do.

The cause (issue 12). Adam moves every coordinate by about lr per step whatever the gradient's size,
as long as its sign holds. The rows of the tied embedding table whose tokens the data never shows
(90,330 of cl100k's 100,277 on the bundled corpus) only ever get the softmax's push-down gradient
p_v x h, tiny and always pointing the same way, so with Adam's usual epsilon (1e-8) they all took
the same full-size step every step: by step 49 of the tiny preset they were one vector (their mean
0.94 long, each row 0.15 from it), low only for hidden states on the side the early, unigram-like
model put them. A token whose hidden state lands on the other side (routed to a rarely trained
expert, say) scores all 90,000 of them above its target: cross-entropy 15-23 nats on those tokens
and grad norms 100-1000x the median, on ordinary text. `adamw` gives the table its own epsilon,
`embed_eps` (1e-4): a row whose gradient is below it moves in proportion to the gradient, as with
SGD. Since a row's gradient is (its frequency in the batch - its predicted probability) x h with h
of unit RMS, this reads as a probability: tokens rarer than ~1e-4 in the data and in the model's
predictions are updated in proportion to their evidence instead of at Adam's full speed. The
threshold is a probability, so it does not depend on batch, model size or mesh. The second,
smaller cause (rare rows entering the first RMSNorm at their 0.02 init) is fixed where the table
is initialised (`model.init_params`).

The rest:
- `skip_spikes(inner, factor)`: an optax transformation around the whole optimizer that keeps the
  grad norms of the last WINDOW steps in the optimizer state (so it is checkpointed and a resume is
  exact) and, when factor > 0, turns a step whose grad norm exceeds factor x their median into a
  no-op: zero updates and the inner state (Adam moments, step count) left as it was. Every step's
  norm enters the window, skipped or not, so a lasting rise in the grad norm is accepted after
  WINDOW / 2 steps instead of stalling training for good. The decision is made on replicated
  scalars after the global norm, so it does not depend on the mesh.
- `SpikeWatch`: host-side bookkeeping for main.py's loop: per step the loss jump over the median
  of the previous LOSS_WINDOW losses, per log interval the largest jump and grad-norm ratio, and a
  warning line naming the step when either crosses its threshold.
"""
from collections import deque
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

ADAM_EPS = 1e-8            # Adam's epsilon for every leaf but the embedding table (optax's default)
WINDOW = 20                 # grad norms the running median is taken over
MIN_HISTORY = 10            # no ratio (and no skip) before this many steps
LOSS_WINDOW = 10            # a loss is compared with the median of this many previous losses
LOSS_JUMP_WARN = 0.5        # nats above that median: a spike
RATIO_WARN = 5.0            # grad norm over its running median: a spike (or --skip_spikes when set)


def adamw(schedule, oc, decay_mask, table_mask):
    """optax.adamw (the same chain: Adam, decoupled weight decay on `decay_mask`, learning rate), except
    that the leaves in `table_mask` divide by sqrt(v) + oc.embed_eps, the rest by sqrt(v) + 1e-8."""
    adam = optax.scale_by_adam(b1=oc.b1, b2=oc.b2)          # its init: the moments and step count

    def update(grads, state, params=None):
        mu = optax.tree.update_moment(grads, state.mu, oc.b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, state.nu, oc.b2, 2)
        count = optax.safe_increment(state.count)
        mu_hat, nu_hat = optax.tree.bias_correction(mu, oc.b1, count), optax.tree.bias_correction(nu, oc.b2, count)
        eps = jax.tree.map(lambda table: oc.embed_eps if table else ADAM_EPS, table_mask)
        updates = jax.tree.map(lambda m, v, e: m / (jnp.sqrt(v) + e), mu_hat, nu_hat, eps)
        return updates, optax.ScaleByAdamState(count, mu, nu)

    return optax.chain(optax.GradientTransformation(adam.init, update),
                       optax.add_decayed_weights(oc.weight_decay, decay_mask),
                       optax.scale_by_learning_rate(schedule))


class SpikeState(NamedTuple):
    norms: jax.Array      # [WINDOW] grad norms of the latest steps, newest first; NaN = not yet seen
    ratio: jax.Array      # this step's grad norm / median of the previous ones (NaN: too little history)
    skipped: jax.Array    # updates skipped so far (int32)
    inner: tuple            # the wrapped optimizer's state


def skip_spikes(inner, factor):
    """`inner` (an optax.GradientTransformation) whose update becomes a no-op on a step whose global
    grad norm is above factor x the running median (factor 0: never; the ratio is still tracked)."""
    def init(params):
        return SpikeState(jnp.full((WINDOW,), jnp.nan, jnp.float32), jnp.full((), jnp.nan, jnp.float32),
                          jnp.zeros((), jnp.int32), inner.init(params))

    def update(grads, state, params=None):
        norm = optax.tree.norm(grads).astype(jnp.float32)
        enough = jnp.sum(~jnp.isnan(state.norms)) >= MIN_HISTORY
        ratio = jnp.where(enough, norm / jnp.nanmedian(state.norms), jnp.nan)
        skip = (ratio > factor) if factor > 0 else jnp.zeros((), bool)   # NaN > x is False
        updates, new_inner = inner.update(grads, state.inner, params)
        updates = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), updates)
        new_inner = jax.tree.map(lambda new, old: jnp.where(skip, old, new), new_inner, state.inner)
        norms = jnp.concatenate([norm[None], state.norms[:-1]])
        return updates, SpikeState(norms, ratio, state.skipped + skip.astype(jnp.int32), new_inner)

    return optax.GradientTransformation(init, update)


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
