"""Engine: an element-by-element update of same-shaped arrays on a TPU as one Pallas kernel, its outputs written
over its first inputs (the optimizer's: params and Adam's moments from them and the gradient, optimizer.py).

XLA split AdamW's update of a leaf into two or three passes over HBM (one writing the params and the first moment,
one the second moment, which the first computed again, and a copy of the second moment where the two read it
across its update in place): 40 bytes an element where one pass moves 26
(docs/performance-log.md#2026-12-07-tpu-adamw-one-pass). Here each grid step loads a block of every array,
computes the update in VMEM and writes the outputs where their inputs were (aliased). Its inputs may come from
other operations that XLA fuses into the kernel's reads (allow_input_fusion): the gradient of a stack of layers
traced apart is the concatenation of each layer's, in bf16, and is read as such, never written whole in fp32.
"""
import functools
import math

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# The most elements a block of each array holds: 0.5 MiB in fp32, so that the double-buffered blocks of an update's
# seven arrays (four read, three written) stay within the 16 MiB of VMEM a kernel may use by default (a v4's all).
BLOCK_ELEMENTS = 2**17
SUBLANES = 16                 # rows of a block, unless it holds the whole: a multiple of bf16's packed tile
LANES = 128                   # VMEM holds a row in whole tiles of 128 lanes, however few it has


def update_in_place(fn, scalars_S, arrays, n_out, interpret=False):
    """fn(scalars_S, *blocks) -> n_out blocks, applied to the same-shaped `arrays` a block at a time, its outputs
    written over arrays[:n_out] (in place when those are donated). scalars_S: the fp32 scalars fn reads (in SMEM).
    An array's last two dimensions are a block's rows and lanes (a vector's: one row); the others, the grid's."""
    shape = arrays[0].shape
    arrays = [a.reshape(1, -1) if a.ndim == 1 else a for a in arrays]
    lead, (rows, lanes) = arrays[0].shape[:-2], arrays[0].shape[-2:]
    block_lanes = lanes if lanes * SUBLANES <= BLOCK_ELEMENTS else BLOCK_ELEMENTS // SUBLANES    # a multiple of 128
    held = -(-block_lanes // LANES) * LANES           # a block row's elements in VMEM
    block_rows = rows if rows * held <= BLOCK_ELEMENTS else BLOCK_ELEMENTS // held // SUBLANES * SUBLANES
    spec = pl.BlockSpec((pl.squeezed,) * len(lead) + (block_rows, block_lanes), lambda *ix: ix)
    outs = pl.pallas_call(
        functools.partial(_kernel, fn, n_out),
        grid=(*lead, pl.cdiv(rows, block_rows), pl.cdiv(lanes, block_lanes)),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [spec] * len(arrays),
        out_specs=[spec] * n_out,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype, manual_axis_type=jax.typeof(a).manual_axis_type)
                   for a in arrays[:n_out]],
        input_output_aliases={1 + i: i for i in range(n_out)},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * (len(lead) + 2),
                                             allow_input_fusion=[False] + [True] * len(arrays)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=_bytes(arrays) + _bytes(arrays[:n_out])),
        interpret=interpret, name="update_in_place")(scalars_S, *arrays)
    return tuple(out.reshape(shape) for out in outs)


def _bytes(arrays):
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)


def _kernel(fn, n_out, scalars_ref, *refs):
    inputs, outputs = refs[:-n_out], refs[-n_out:]
    for ref, block in zip(outputs, fn(scalars_ref, *(ref[...] for ref in inputs))):
        ref[...] = block
