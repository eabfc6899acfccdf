"""nnx plumbing for model.py: weights declared with their logical axes (`variable`), layers stacked on a
leading axis (`stacked`) and run one at a time under lax.scan or a Python loop (`scan_stacked`, as a LayerLoop
says), each optionally rematerialised (`remat_call` for a single one)."""
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


def variable(rngs, initializer, shape, *axes, kind=nnx.Param):
    """An nnx Variable (a Param unless told) holding initializer(key, shape), carrying its logical axes
    and its initializer (sharding.init_params draws the params with it). Not sharded when created: the
    layout comes from sharding.param_specs, applied by jit's out_shardings and shard_map's in_specs."""
    return kind(initializer(rngs.params(), shape), out_sharding=axes, initializer=initializer, eager_sharding=False)


def stacked(make, n, axis, rngs):
    """n independently initialised make(rngs), their parameters stacked on a new leading dim whose logical
    axis `axis` nnx.vmap prepends to each parameter's axes."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make_stacked(rngs):
        return make(rngs)
    return make_stacked(rngs)


class LayerLoop(NamedTuple):
    """How scan_stacked runs a stack: each step's remat policy (jax.checkpoint's; None: none), lax.scan's unroll,
    and apart: a Python loop instead of the scan, each step traced on its own, so that what the backward reads
    of a step stays that step's arrays (a scan stacks them, and a scan around it stacks the stacks again)."""
    policy: Any = None
    unroll: int | bool = 1
    apart: bool = False


def scan_stacked(stack, axis, body, carry, xs, loop=LayerLoop()):
    """body(layer, carry, x) over the layers of `stack` (made by `stacked`) and xs in turn, as lax.scan returns
    (carry, the ys stacked): each step rebuilds one layer with nnx.merge from its slice of the stacked state."""
    graphdef, state = nnx.split(stack)

    def step(carry, inputs):
        layer_state, x = inputs
        layer = nnx.merge(graphdef, nnx.spmd.remove_axis(layer_state, 0, {nnx.PARTITION_NAME: axis}))
        return body(layer, carry, x)
    if loop.policy is not None:
        step = jax.checkpoint(step, policy=loop.policy)
    if not loop.apart:
        return lax.scan(step, carry, (state, xs), unroll=loop.unroll)
    ys = []
    for i in range(jax.tree.leaves(state)[0].shape[0]):
        carry, y = step(carry, jax.tree.map(lambda a: a[i], (state, xs)))
        ys.append(y)
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def remat_call(module, body, x, extra, policy=None):
    """body(module, x, extra), rematerialised under policy as one scan_stacked step is."""
    if policy is None:
        return body(module, x, extra)
    graphdef, state = nnx.split(module)
    run = lambda state, x, extra: body(nnx.merge(graphdef, state), x, extra)
    return jax.checkpoint(run, policy=policy)(state, x, extra)


def keys_of(key, n, first=0):
    """[fold_in(key, first), ..., fold_in(key, first + n - 1)]: one key per layer or block, drawn at once."""
    return jax.vmap(partial(jax.random.fold_in, key))(first + jnp.arange(n))
