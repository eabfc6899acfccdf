"""The optimizer: global-norm clipping, AdamW with the tied table's own epsilon, the learning-rate
schedule, and `skip_spikes`, which can turn a step with a spiking gradient norm into a no-op. The update
runs outside shard_map on the sharded state (trainer.py): the clipping norm is over all shards. Where the
engine has a kernel for it (a TPU's), `in_one_pass` computes the params and moments again, a leaf a pass."""
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import sharding
from collectives import axis_names

ADAM_EPS = 1e-8            # Adam's epsilon for every leaf but the embedding table (optax's default)
WINDOW = 20                 # grad norms the running median is taken over
MIN_HISTORY = 10            # no ratio (and no skip) before this many steps


def make_optimizer(oc, abstract_params):
    """Global-norm clipping, then AdamW, inside skip_spikes: it keeps the running grad-norm median in the
    optimizer state (checkpointed with it) and, with --skip_spikes F > 0, leaves params and moments
    untouched on a step whose norm is > F x it."""
    # Guide: optax.adamw; here the tied embedding table has its own Adam epsilon (`adamw`).
    decay, table = sharding.decay_mask(abstract_params), sharding.table_mask(abstract_params)
    inner = optax.chain(optax.clip_by_global_norm(oc.grad_clip_norm), adamw(lr_schedule(oc), oc, decay, table))
    return skip_spikes(inner, oc.skip_spikes)


def lr_schedule(o):
    """Linear warmup min_lr -> max_lr, cosine max_lr -> end_lr at end_steps, then end_lr."""

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = o.min_lr + (o.max_lr - o.min_lr) * step / max(o.warmup_steps, 1)
        progress = jnp.clip((step - o.warmup_steps) / max(o.end_steps - o.warmup_steps, 1), 0.0, 1.0)
        cosine = o.end_lr + 0.5 * (o.max_lr - o.end_lr) * (1 + jnp.cos(math.pi * progress))
        return jnp.where(step < o.warmup_steps, warm, cosine)
    return schedule


def adamw(schedule, oc, decay_mask, table_mask):
    """optax.adamw (the same chain: Adam, decoupled weight decay on `decay_mask`, learning rate), except that
    the leaves in `table_mask` divide by sqrt(v) + oc.embed_eps, the rest by sqrt(v) + 1e-8. The rows of
    the tied table whose tokens the data rarely shows only get the softmax's tiny, one-signed push-down
    gradient, which Adam's 1e-8 turns into a full lr step each step: the table's epsilon (--embed_eps, a
    probability: tokens rarer than it move in proportion to their gradient) keeps them apart
    (docs/training.md, "Loss spikes")."""
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
    """`inner` (an optax.GradientTransformation) whose update becomes a no-op (zero updates, its state as it
    was) on a step whose global grad norm is above factor x the median of the last WINDOW steps' (factor 0:
    never; the ratio is still tracked, for spikes.SpikeWatch). Every step's norm enters the window, skipped
    or not, so a lasting rise is accepted after WINDOW / 2 steps. The window is optimizer state, so a
    resume continues it; the decision is on replicated scalars, the same on every mesh."""
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


def in_one_pass(kept, old_state, grads, grad_norm, finite, oc, kernel, mesh, specs):
    """kept (trainer.train_step's new state, guarded) with its params and Adam's moments computed again by `kernel`
    (the engine's optimizer_kernel), each leaf in one pass on each device's shard: `adamw_elements`, the chain's
    arithmetic and the guard's, element by element, from the same scalars. What the chain computed of them is then
    unread, and XLA drops it. A leaf whose last dimension is split over devices keeps the chain's: for the kernel's
    row-major operands XLA all-reduced two such leaves' gradients on a v4-64 where it had reduce-scattered them
    (docs/performance-log.md#2026-12-07-tpu-adamw-one-pass)."""
    # make_optimizer's state: SpikeState(inner=(clipping's, (Adam's, weight decay's, the schedule's)))
    adam, lr_count = old_state["opt_state"].inner[1][0], old_state["opt_state"].inner[1][2].count
    count, spike = optax.safe_increment(adam.count), kept["opt_state"]
    skip = spike.skipped > old_state["opt_state"].skipped
    scalars_S = jnp.stack([-1 * lr_schedule(oc)(lr_count), 1 - oc.b1 ** count, 1 - oc.b2 ** count, grad_norm,
                           grad_norm < oc.grad_clip_norm, skip, finite]).astype(jnp.float32)
    decay, table, chain = sharding.decay_mask(grads), sharding.table_mask(grads), spike.inner[1][0]

    def leaf(p, m, v, g, spec, decays, is_table, *chains):
        if len(spec) == p.ndim and math.prod(mesh.shape[axis] for axis in axis_names(spec[-1])) > 1:
            return chains
        elements = functools.partial(adamw_elements, oc, oc.embed_eps if is_table else ADAM_EPS, decays)
        # each device's shards alone, no collective: unchecked, as Pallas' interpreter (the CPU tests') indexes the
        # scalars by a grid index that varies over no mesh axis
        return jax.shard_map(lambda s, *arrays: kernel(elements, s, arrays, 3), mesh=mesh, check_vma=False,
                             in_specs=(P(), *[spec] * 4), out_specs=(spec,) * 3)(scalars_S, p, m, v, g)

    params = old_state["params"]
    updated = jax.tree.map(leaf, params, adam.mu, adam.nu, grads, specs, decay, table,
                           kept["params"], chain.mu, chain.nu)
    tree = jax.tree.structure(params)
    params, mu, nu = (jax.tree.unflatten(tree, [outs[i] for outs in tree.flatten_up_to(updated)]) for i in range(3))
    inner = (spike.inner[0], (chain._replace(mu=mu, nu=nu), *spike.inner[1][1:]))
    return kept | {"params": params, "opt_state": spike._replace(inner=inner)}


def adamw_elements(oc, eps, decays, scalars_S, p, m, v, g):
    """One element's update of a leaf (p, its moments m and v, its gradient g) as the optimizer's chain and the
    training step's guard compute it, operation for operation: clipped, Adam's moments and bias corrections, eps,
    decoupled weight decay (`decays`: the leaf is in the decay mask), the learning rate, a skipped spike, a
    non-finite step. scalars_S: in_one_pass's [step size (-lr), 1 - b1^t, 1 - b2^t, grad norm, norm < clip,
    skip, finite]. -> (p, m, v)."""
    step_size, bias1, bias2, norm, unclipped, skip, finite = (scalars_S[i] for i in range(7))
    g = jnp.where(unclipped > 0, g, (g / norm) * oc.grad_clip_norm)
    m_new = (1 - oc.b1) * g + oc.b1 * m
    v_new = (1 - oc.b2) * (g ** 2) + oc.b2 * v
    u = (m_new / bias1) / (jnp.sqrt(v_new / bias2) + eps)
    if decays and oc.weight_decay != 0.0:             # optax.add_decayed_weights skips a zero
        u = u + oc.weight_decay * p
    u = jnp.where(skip > 0, jnp.zeros_like(u), step_size * u)
    keep = finite > 0
    return (jnp.where(keep, p + u, p), jnp.where(keep, jnp.where(skip > 0, m, m_new), m),
            jnp.where(keep, jnp.where(skip > 0, v, v_new), v))
