"""Engine: FSDP staging, the weights a step computes with, from the fp32 master shards each device holds
(engine.Reference/Fast.gathered, .gather_stage, .read_weights).

The dtype path of a weight, said once:
  fp32 master shard [.., D/dp, ..]  --rounded to the matmul dtype, all-gathered over dp-->  [.., D, ..]
  --held in fp32 for the step (the same values)-->  rounded to the dtype its layer reads it in, at each use.
Gathering in the matmul dtype moves half the bytes of fp32 (`gather_over_dp`, whose transpose reduce-
scatters the gradient in fp32); holding the gathered copy in fp32 makes the cotangents of every use (the
pipeline's ticks, the embedding and the output layer) add up in fp32 before that one reduce-scatter; the
read dtype (`read_dtypes`) is applied outside each layer's remat, so the backward's replay reads the
rounded copy rather than rounding again. The router is read in fp32 (its top-k flips on rounded scores),
norm scales and shifts too. A stage's blocks are gathered once a step for all its ticks (`gather_stage`);
the guide gathers per layer, every tick.
"""
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

import sharding
from collectives import over_gloo, psum_scatter

FP32_WEIGHTS = frozenset({"router"})


def weight_dtype(name, cfg):
    """The dtype the layers read weight leaf `name` in."""
    return jnp.dtype(jnp.float32 if name in FP32_WEIGHTS else cfg.model_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_over_dp(w, dtype, dp, axis):
    """A weight shard cast to dtype, then all-gathered: [.., D/dp, ..] fp32 -> [.., D, ..] dtype. Its
    gradient is reduce-scattered back in fp32, as Megatron does: the plain transpose would sum the dp bf16
    cotangents in bf16."""
    return lax.all_gather(w.astype(dtype), dp, axis=axis, tiled=True)


def _gather_over_dp_fwd(w, dtype, dp, axis):
    return gather_over_dp(w, dtype, dp, axis), None


def _gather_over_dp_bwd(dtype, dp, axis, _, g):
    # [.., D, ..] dtype -> fp32 -> summed over dp, each rank keeping its own slice: [.., D/dp, ..] fp32
    return (psum_scatter(g.astype(jnp.float32), dp, axis),)


gather_over_dp.defvjp(_gather_over_dp_fwd, _gather_over_dp_bwd)


def gathered(param, axes, dtype, gather=gather_over_dp):
    """One parameter (an nnx.Param: the tied table) rounded to dtype and all-gathered over dp along the dim
    its logical axes put on dp, held in fp32."""
    dim = None if axes.dp is None else sharding.dp_dim(param.out_sharding, axes.expert_parallel)
    w = param[...].astype(dtype) if dim is None else gather(param[...], dtype, axes.dp, dim)
    return w.astype(jnp.float32)


def gather_stage(layers, part, names, cfg, axes, lead=0, gather=gather_over_dp):
    """Stacked layers, params[part] ([.., D/dp, ..], `lead` dims more than their logical axes say: a stage's
    blocks as [P, G, ..]), all-gathered over dp once for the step, [.., D, ..], in the weights' read dtypes
    and held in fp32. names: {path: logical axes} (sharding.logical_axes); nothing to gather with one dp
    shard."""
    def one(path, a):
        path = (part, *(k.key for k in path))
        dim = sharding.dp_dim(names[path], cfg.expert_parallel)
        if dim is None or lax.axis_size(axes.dp) == 1:
            return a
        return gather(a, weight_dtype(path[-1], cfg), axes.dp, dim + lead).astype(jnp.float32)
    return jax.tree_util.tree_map_with_path(one, layers)


def plain_gather(w, dtype, dp, axis):
    """The reference engine's gather: the fp32 shard gathered as it is, rounded after (JAX's own
    transpose then reduce-scatters in fp32); the same values as gather_over_dp's. Over gloo it is
    gather_over_dp in fp32, whose transpose is the same sum without gloo's reduce-scatter (psum_scatter)."""
    if over_gloo():
        return gather_over_dp(w, jnp.float32, dp, axis).astype(dtype)
    return lax.all_gather(w, dp, axis=axis, tiled=True).astype(dtype)


def read_dtypes(stack, cfg):
    """stack (stacked blocks) with each weight matrix in the dtype the layers read it in (`weight_dtype`);
    norm scales and shifts stay fp32. The same values and gradients as rounding at each product."""
    graphdef, state = nnx.split(stack)
    cast = lambda path, a: a.astype(weight_dtype(path[-2].key, cfg)) if sharding.is_matrix(path[-2].key) else a
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(cast, state))
