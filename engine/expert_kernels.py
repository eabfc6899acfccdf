"""Engine: the routed-experts seam (engine.Reference/Fast.routed_experts). model.MoE routes, decides what
is kept and gates; here each kept choice gets its expert's output [B, T, k, D] in the matmul dtype, four
ways: per-expert capacity buffers [B, E, C, D] (`experts_in_buffers`, what --engine reference runs) or
a sorted grouped matmul (`experts_ragged`: lax.ragged_dot, or on a GPU in bf16 tokamax's Triton kernel,
`triton_grouped`), each also with the experts split over dp and the tokens sent to them by all-to-all
(`experts_over_dp`, `experts_over_dp_ragged`: --expert_parallel).
Every way computes `model.ffn`. N = B T k routed choices, U slots per expert on a dp shard, W rows a
shard receives, Z dp shards (expert parallelism's senders and receivers); e = E/dp experts on a dp shard.
"""
import importlib
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from collectives import sum_like, vary_like
from model import ffn
from engine.products import fp32_product


def _distinct_drops(index_BTk, end):
    """index_BTk with each dropped choice (index >= end) sent to a place of its own past the end, where the
    scatter drops it. The kept choices' places are distinct already, so the scatter may promise unique
    indices; without that promise JAX differentiates a scatter-set by scattering the update ids too, to
    find which duplicate won (three u32 [B, E, C, D] passes a MoE layer)."""
    B, T, k = index_BTk.shape
    return jnp.where(index_BTk < end, index_BTk, end + jnp.arange(B * T * k).reshape(B, T, k))


def experts_in_buffers(w, x_BTD, experts_BTk, slot_BTk, C, mm):
    """Each expert's output for each choice, computed on per-expert buffers of C slots per sequence: kept
    choices are scattered into their slot, dropped ones (slot C) fall off (mode="drop"). The buffers hold
    the matmul dtype both ways, as experts_over_dp's trips do: the way in is what the up-projection reads
    anyway; the way back rounds the expert outputs."""
    B, T, k = experts_BTk.shape
    dtype = w["expert_up"].dtype
    b_BTk = jnp.broadcast_to(jnp.arange(B)[:, None, None], experts_BTk.shape)
    x_BTkD = jnp.broadcast_to(x_BTD[:, :, None, :], (B, T, k, x_BTD.shape[-1])).astype(dtype)
    buffer_BECD = jnp.zeros((B, w["expert_up"].shape[0], C, x_BTD.shape[-1]), dtype)
    buffer_BECD = buffer_BECD.at[b_BTk, experts_BTk, _distinct_drops(slot_BTk, C)].set(
        x_BTkD, mode="drop", unique_indices=True)
    y_BECD = ffn(buffer_BECD, w["expert_up"], w["expert_down"], "becd,edf->becf", mm, w_gate=w.get("expert_gate"))
    return _choices_outputs(y_BECD, b_BTk, experts_BTk, slot_BTk, C)


def _choices_outputs(y_BECD, b_BTk, experts_BTk, slot_BTk, C):
    """Each choice's row of the buffers' outputs, [B, T, k, D]; a dropped one's (slot C) the expert's last (the MoE
    masks it, so the cotangent its gradient adds there is 0)."""
    return y_BECD[b_BTk, experts_BTk, jnp.minimum(slot_BTk, C - 1)]


def experts_over_dp(w, x_BTD, experts_BTk, slot_BTk, C, mm, dp):
    """Expert parallelism: the outputs of experts_in_buffers, with the experts split over dp. This shard
    holds experts [j e, (j+1) e) whole (w's expert_up is [e, D, f]). Its B sequences fill buffers of B C
    slots per expert (sequence b's slots are [b C, (b+1) C): the keep/drop decisions are the per-sequence
    ones made before, so drops do not depend on the mesh); an all-to-all over dp hands each shard its
    experts' slots from every shard, the experts run, and a second all-to-all returns the outputs. Both
    trips carry the matmul dtype; the way back rounds the outputs (a partial sum over tp), which fp32 leaves
    exact."""
    B, T, k = experts_BTk.shape
    D, dtype = x_BTD.shape[-1], w["expert_up"].dtype
    E = w["expert_up"].shape[0] * lax.axis_size(dp)
    # Kept choice (b, t, i) in slot s goes to row b C + s of its expert's buffer; a dropped one (slot C) past
    # the end, to a row of its own (`_distinct_drops`), where the scatter drops it.
    row_BTk = jnp.where(slot_BTk < C, jnp.arange(B)[:, None, None] * C + slot_BTk, B * C)
    x_BTkD = jnp.broadcast_to(x_BTD[:, :, None, :], (B, T, k, D)).astype(dtype)
    send_EUD = jnp.zeros((E, B * C, D), dtype).at[experts_BTk, _distinct_drops(row_BTk, B * C)].set(
        x_BTkD, mode="drop", unique_indices=True)
    # all-to-all over dp: block j of the experts goes to shard j, which stacks what it receives by source
    # shard: [E, B C, D] -> [e, dp B C, D] (U = dp B C slots per expert)
    recv_eUD = lax.all_to_all(send_EUD, dp, split_axis=0, concat_axis=1, tiled=True)
    y_eUD = ffn(recv_eUD, w["expert_up"], w["expert_down"], "eud,edf->euf", mm, w_gate=w.get("expert_gate"))
    # all-to-all back over dp: slot block i returns to shard i, stacked by expert block: [e, dp B C, D] -> [E, B C, D]
    y_EUD = lax.all_to_all(y_eUD, dp, split_axis=1, concat_axis=0, tiled=True)
    return y_EUD[experts_BTk, jnp.minimum(row_BTk, B * C - 1)]


def _grouped_ffn(w, x_ND, group_sizes_E, kernel):
    """model.ffn over rows sorted by expert (group_sizes_E rows each, in expert order; rows past their sum
    in no group), each product a grouped matmul with the product's contract: in bf16 by `kernel` (a grouped
    matmul as `triton_grouped` or `megablox_grouped`, None: lax.ragged_dot, which is also the kernels' reference)."""
    def grouped(spec, x, w_EDF, dtype, out_dtype):
        return _ragged_rounded(dtype, (x.dtype, w_EDF.dtype), out_dtype, kernel if dtype == jnp.bfloat16 else None,
                               x, w_EDF, group_sizes_E)
    return ffn(x_ND, w["expert_up"], w["expert_down"], "nd,edf->nf", grouped, w_gate=w.get("expert_gate"))


# A grouped matmul's three products, as lax.ragged_dot_general's dimension numbers: rows grouped by expert
# times their group's matrix [G, K, M] (the forward), times its transpose (d_x), and the rows' outer
# products summed per group (d_w: the rows are the ragged contraction).
_dims = lambda contract, group: lax.RaggedDotDimensionNumbers((contract, ((), ())), (0,), group)
ROWS, ROWS_T, PER_GROUP = _dims(((1,), (1,)), (0,)), _dims(((1,), (2,)), (0,)), _dims(((0,), (0,)), ())


def _grouped(a, b, group_sizes, dims, kernel, out_dtype=jnp.float32):
    """The grouped product `dims` of operands in the matmul dtype, accumulated in fp32 and returned in
    out_dtype: by `kernel` or, where it is None, lax.ragged_dot_general; 0 where no group has a row."""
    if kernel is None:
        product = partial(lax.ragged_dot_general, ragged_dot_dimension_numbers=dims, preferred_element_type=jnp.float32)
        out = fp32_product(product, a, b, group_sizes)
    else:
        out = kernel(a, b, group_sizes, dims, out_dtype)
    return _only_grouped_rows(out, dims, group_sizes).astype(out_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ragged_rounded(dtype, operand_dtypes, out_dtype, kernel, x_ND, w_EDF, group_sizes_E):
    """The grouped matmul of the operands rounded to `dtype`, accumulated in fp32 and returned in out_dtype,
    whose backward rounds the cotangent to `dtype` and returns each operand's cotangent in its own dtype
    (as products.mm); kernel (or lax's) does all three products."""
    return _grouped(x_ND.astype(dtype), w_EDF.astype(dtype), group_sizes_E, ROWS, kernel, out_dtype)


def _ragged_rounded_fwd(dtype, operand_dtypes, out_dtype, kernel, x_ND, w_EDF, group_sizes_E):
    x_ND, w_EDF = x_ND.astype(dtype), w_EDF.astype(dtype)
    return _grouped(x_ND, w_EDF, group_sizes_E, ROWS, kernel, out_dtype), (x_ND, w_EDF, group_sizes_E)


def _ragged_rounded_bwd(dtype, operand_dtypes, out_dtype, kernel, residuals, g_Nf):
    x_ND, w_EDF, group_sizes_E = residuals
    g_Nf = g_Nf.astype(dtype)
    # d_x = g w_e^T row by row; d_w_e = x_e^T g_e over group e's rows
    d_x_ND = _grouped(g_Nf, w_EDF, group_sizes_E, ROWS_T, kernel)
    d_w_EDF = _grouped(x_ND, g_Nf, group_sizes_E, PER_GROUP, kernel)
    return (sum_like(d_x_ND, x_ND).astype(operand_dtypes[0]), sum_like(d_w_EDF, w_EDF).astype(operand_dtypes[1]),
            None)


_ragged_rounded.defvjp(_ragged_rounded_fwd, _ragged_rounded_bwd)


def _only_grouped_rows(out, dims, group_sizes):
    """A grouped product's output with 0 where it may write nothing: in the rows past the groups' (dropped
    choices, whose d_x would otherwise flow back into their tokens) and, for the per-group products, in an
    empty group's matrix. lax.ragged_dot promises these zeros but on a TPU leaves the rows past the groups
    unwritten (jax 0.10.2; tests/test_tpu.py), and the Pallas kernels leave both unwritten."""
    if dims == PER_GROUP:
        return jnp.where(group_sizes[:, None, None] > 0, out, 0)
    return jnp.where(jnp.arange(out.shape[0])[:, None] < jnp.sum(group_sizes), out, 0)


def _outside_vma_check(kernel, a, b, group_sizes):
    """kernel(a, b, group_sizes), a Pallas call that does not give its outputs' varying axes, which a call
    inside shard_map needs: traced with check_vma off (a shard_map over no axis), its result varying as its
    operands do."""
    out = jax.shard_map(kernel, in_specs=PartitionSpec(), out_specs=PartitionSpec(), axis_names=frozenset(),
                        check_vma=False)(a, b, group_sizes)
    return vary_like((out,), (a, b, group_sizes))[0]


def triton_grouped(a, b, group_sizes, dims, out_dtype):
    """lax.ragged_dot_general(a, b, group_sizes, dims) where a group has rows (`_grouped` zeroes the rest), for
    dims ROWS, ROWS_T or PER_GROUP, by tokamax's Pallas-Triton grouped matmuls (requirements-gpu-aot.txt),
    accumulated in fp32 and returned in out_dtype.
    XLA:GPU expands lax.ragged_dot into a dense product with every group's matrix; jax's own Mosaic GPU
    kernels read the local GPU's SM count while tracing, which a deviceless `--compile_for h200` has not.
    Tokamax's private entries: its public one reads absl flags from sys.argv and asks the local device."""
    try:
        from tokamax._src.ops.ragged_dot import pallas_triton
    except ImportError as e:
        raise ImportError("--moe_impl ragged on a GPU multiplies with tokamax's grouped matmul: pip install "
                          "tokamax==0.0.12 (requirements-gpu-aot.txt)") from e
    # tokamax's heuristic tiles for these shapes: with no GPU here there is nothing to autotune on
    config = pallas_triton.Config(block_m=min(128, pl.next_power_of_2(a.shape[0])), block_n=128, block_k=32,
                                  num_warps=4, num_stages=4)
    common = dict(precision=(lax.Precision.DEFAULT,) * 2, out_dtype=jnp.dtype(out_dtype), config=config)

    def kernel(a, b, group_sizes):
        if dims == PER_GROUP:
            # an empty group's one (masked) step adds up the block_k rows before it (`_only_grouped_rows`)
            return pallas_triton._ragged_contracting_dim_dot(
                a, b, group_sizes=group_sizes,
                ragged_dot_dimension_numbers=pallas_triton.base.RAGGED_CONTRACTING_DOT_DIM_NUMS, **common)
        return pallas_triton._ragged_dot(
            a, jnp.swapaxes(b, 1, 2) if dims == ROWS_T else b, group_sizes=group_sizes,
            ragged_dot_dimension_numbers=pallas_triton.base.DEFAULT_RAGGED_DOT_DIM_NUMS,
            split_k_intermediate_dtype=None, **common)
    return _outside_vma_check(kernel, a, b, group_sizes)


def megablox_grouped(a, b, group_sizes, dims, out_dtype, tiling=(128, 128, 128), interpret=False):
    """lax.ragged_dot_general(a, b, group_sizes, dims) where a group has rows (`_grouped` zeroes the rest), for
    dims ROWS, ROWS_T or PER_GROUP, by jax's Pallas TPU grouped matmuls (megablox's gmm and, for the per-group products, tgmm), accumulated in fp32 and returned
    in out_dtype; tiling: their (rows, contraction, columns) tiles. Not the engine's: on one v5e the preset's
    step was slower with it at every tiling timed than with lax's (scripts/levers.py `moe_ragged_megablox_*`,
    docs/performance-log.md#2026-12-07-tpu-megablox)."""
    # the module: the package's `gmm` is its differentiable wrapper, whose backward ours replaces (_ragged_rounded)
    megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

    def kernel(a, b, group_sizes):
        if dims == PER_GROUP:
            out = megablox.tgmm(a.T, b, group_sizes, jnp.float32, tiling, interpret=interpret)
        else:
            out = megablox.gmm(a, b, group_sizes, jnp.float32, tiling, transpose_rhs=dims == ROWS_T,
                               interpret=interpret)
        return out.astype(out_dtype)
    return _outside_vma_check(kernel, a, b, group_sizes)


def _sorted_by_expert(experts_BTk, slot_BTk, C, E):
    """(the order sorting the N = B T k choices by expert, dropped ones (slot C) last as expert E, and the
    kept choices per expert [E])."""
    expert_N = jnp.where(slot_BTk < C, experts_BTk, E).reshape(-1)
    return jnp.argsort(expert_N, stable=True), jnp.sum(jax.nn.one_hot(expert_N, E, dtype=jnp.int32), axis=0)


def experts_ragged(w, x_BTD, experts_BTk, slot_BTk, C, kernel=None):
    """The same outputs from a grouped matmul: choices sorted by expert (dropped ones last, in no group) and
    multiplied by their expert's weights; no capacity padding. kernel: the grouped matmul (`_grouped_ffn`)."""
    B, T, k = experts_BTk.shape
    order_N, group_sizes_E = _sorted_by_expert(experts_BTk, slot_BTk, C, w["expert_up"].shape[0])
    y_ND = _grouped_ffn(w, x_BTD.reshape(B * T, -1)[order_N // k], group_sizes_E, kernel)
    # order_N is a permutation: promising unique indices keeps the scatter's gradient a gather
    return jnp.zeros_like(y_ND).at[order_N].set(y_ND, unique_indices=True).reshape(B, T, k, -1)


def experts_over_dp_ragged(w, x_BTD, experts_BTk, slot_BTk, C, dp, kernel=None):
    """Expert parallelism without capacity padding: the kept choices, sorted by expert, travel to their
    experts' shard with lax.ragged_all_to_all (only the rows there are), run through a grouped matmul and
    come back the same way. XLA:CPU does not implement ragged_all_to_all: on a CPU this path is checked by
    compiling it for a TPU slice."""
    B, T, k = experts_BTk.shape
    D, dtype = x_BTD.shape[-1], w["expert_up"].dtype
    Z, e = lax.axis_size(dp), w["expert_up"].shape[0]
    E, N, me = Z * e, B * T * k, lax.axis_index(dp)
    order_N, counts_E = _sorted_by_expert(experts_BTk, slot_BTk, C, E)
    send_ND = x_BTD.reshape(B * T, D)[order_N // k].astype(dtype)       # by expert: shard 0's block first
    # Every shard's counts, a few integers: [E] -> [dp, E] -> [sender, receiver, local expert]
    counts_ZZe = lax.all_gather(counts_E, dp).reshape(Z, Z, e)
    rows_ZZ = jnp.sum(counts_ZZe, axis=-1)                                # rows sender -> receiver
    start_send_ZZ = jnp.cumsum(rows_ZZ, axis=1) - rows_ZZ                 # in the sender's buffer
    start_recv_ZZ = jnp.cumsum(rows_ZZ, axis=0) - rows_ZZ                 # in the receiver's buffer
    # A receiver gets at most C slots per sequence per expert from each sender: B C E rows in all.
    W = min(B * C * E, Z * N)
    recv_WD = vary_like((jnp.zeros((W, D), dtype),), (send_ND,))[0]
    # ragged all-to-all over dp: my rows for shard j ([start_send[me, j], + rows[me, j])) land in shard j's
    # buffer at start_recv[me, j]: [N, D] -> [W, D], ordered (sender, local expert)
    recv_WD = lax.ragged_all_to_all(send_ND, recv_WD, start_send_ZZ[me], rows_ZZ[me], start_recv_ZZ[me],
                                    rows_ZZ[:, me], axis_name=dp)
    # Regroup by local expert for the grouped matmul (rows past the received ones: group e, none).
    sizes_Ze = counts_ZZe[:, me, :].reshape(-1)                           # flat: (sender, local expert)
    group_W = jnp.searchsorted(jnp.cumsum(sizes_Ze), jnp.arange(W), side="right")
    local_W = jnp.where(group_W < Z * e, group_W % e, e)
    by_expert_W = jnp.argsort(local_W, stable=True)
    y_sorted_WD = _grouped_ffn(w, recv_WD[by_expert_W], jnp.sum(counts_ZZe[:, me, :], axis=0), kernel)
    y_WD = jnp.zeros_like(y_sorted_WD).at[by_expert_W].set(y_sorted_WD, unique_indices=True)
    # And back over dp, the inverse exchange: [W, D] -> [N, D] in this shard's sorted order
    back_ND = vary_like((jnp.zeros((N, D), dtype),), (y_WD,))[0]
    back_ND = lax.ragged_all_to_all(y_WD, back_ND, start_recv_ZZ[:, me], rows_ZZ[:, me], start_send_ZZ[:, me],
                                    rows_ZZ[me], axis_name=dp)
    return jnp.zeros((N, D), dtype).at[order_N].set(back_ND, unique_indices=True).reshape(B, T, k, D)


def buffers(w, x_BTD, experts_BTk, slot_BTk, C, mm, dp=None, platform=None):
    """--moe_impl buffers, over dp when dp names the axis the experts are split over (--expert_parallel);
    mm, the engine's product, runs on every platform."""
    if dp is None:
        return experts_in_buffers(w, x_BTD, experts_BTk, slot_BTk, C, mm)
    return experts_over_dp(w, x_BTD, experts_BTk, slot_BTk, C, mm, dp)


# The grouped matmul --moe_impl ragged runs in bf16, by the mesh's platform (lax.ragged_dot elsewhere)
GROUPED_KERNELS = {"gpu": triton_grouped}


def ragged(w, x_BTD, experts_BTk, slot_BTk, C, mm, dp=None, platform=None):
    """--moe_impl ragged (grouped matmuls with the product's contract of their own, GROUPED_KERNELS' for the
    mesh's platform: mm is not used)."""
    kernel = GROUPED_KERNELS.get(platform)
    if dp is None:
        return experts_ragged(w, x_BTD, experts_BTk, slot_BTk, C, kernel)
    return experts_over_dp_ragged(w, x_BTD, experts_BTk, slot_BTk, C, dp, kernel)


MOE_IMPLS = {"buffers": buffers, "ragged": ragged}
