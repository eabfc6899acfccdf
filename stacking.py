"""nnx plumbing for model.py: weights declared with their logical axes (`variable`), layers stacked on a
leading axis (`stacked`) and run one at a time under lax.scan (`scan_stacked`), each optionally
rematerialised (`remat_call` for a single one)."""
from functools import partial

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


def scan_stacked(stack, axis, body, carry, xs, policy=None, unroll=1):
    """lax.scan of body(layer, carry, x) over the layers of `stack` (made by `stacked`) and xs: each step
    rebuilds one layer with nnx.merge from its slice of the stacked state. policy: rematerialise each step
    (jax.checkpoint); unroll: lax.scan's."""
    graphdef, state = nnx.split(stack)

    def step(carry, inputs):
        layer_state, x = inputs
        layer = nnx.merge(graphdef, nnx.spmd.remove_axis(layer_state, 0, {nnx.PARTITION_NAME: axis}))
        return body(layer, carry, x)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy)
    return lax.scan(step, carry, (state, xs), unroll=unroll)


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
