"""Engine: causal attention on a TPU as one Pallas kernel a (sequence, head), forward and backward, for
MLA's narrow heads (q.k 64 or 192 wide, v 64), where XLA writes every T x T block of scores to HBM and
jax's splash and flash kernels were slower than that (docs/performance-log.md#2026-12-06-tpu-levers).

One grid step holds a whole sequence of one head in VMEM (q, k, v, and in the backward dq's fp32 sums:
about 2 MB at T 1024, 9 MB at T 4096) and walks its causal blocks, block x block at a time, with the
loops unrolled at trace time: the blocks above the diagonal are never visited and only the diagonal's
are masked. The forward is flash attention's online softmax (the scores never leave VMEM) and keeps the
rows' log-sum-exp; the backward recomputes each block's probabilities from it (FlashAttention-2's).
Numerics as model.masked_attention's: scores and softmax in fp32, the products' operands in the input
dtype (bf16 on the chip), fp32 sums; the block order changes the rounding, not the math.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_SIZES = (512, 256, 128)        # a block is the largest of these that divides T
MAX_T = 4096                          # above this a sequence's dq sums and operands crowd VMEM: XLA's path
VMEM_LIMIT_BYTES = 64 * 2**20


def takes(T):
    """Whether the kernel runs a causal attention of T queries (else the caller keeps XLA's path)."""
    return T <= MAX_T and T % BLOCK_SIZES[-1] == 0


def attention(q_BThQ, k_BShQ, v_BShJ, block=None, interpret=False):
    """softmax(q.k / sqrt(Q)) v, causal (S = T), returned in q's dtype; block: the square block's side
    (default: the largest of BLOCK_SIZES dividing T)."""
    T = q_BThQ.shape[1]
    block = block or next(b for b in BLOCK_SIZES if T % b == 0)
    return _attention(q_BThQ, k_BShQ, v_BShJ, block, interpret)


def _heads_first(x_BThX):
    return jnp.swapaxes(x_BThX, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q_BThQ, k_BShQ, v_BShJ, block, interpret):
    return _forward(q_BThQ, k_BShQ, v_BShJ, block, interpret)[0]


def _forward(q_BThQ, k_BShQ, v_BShJ, block, interpret):
    """(out_BThJ, (the residuals: q, k, v and out as they are given and returned, so that a remat keeping the
    output keeps one copy of it, and lse_Bh1T))."""
    q, k, v = (_heads_first(x) for x in (q_BThQ, k_BShQ, v_BShJ))
    B, h, T, Q = q.shape
    J = v.shape[-1]
    out_BhTJ, lse_Bh1T = pl.pallas_call(
        functools.partial(_forward_kernel, block=block, scale=1 / math.sqrt(Q)),
        grid=(B, h),
        in_specs=[_sequence_spec(T, Q), _sequence_spec(T, Q), _sequence_spec(T, J)],
        out_specs=[_sequence_spec(T, J), _sequence_spec(1, T)],
        out_shape=[_like(q, (B, h, T, J)), _like(q, (B, h, 1, T), jnp.float32)],
        compiler_params=_COMPILER_PARAMS, cost_estimate=_cost(B, h, T, Q, J, block, q.dtype, backward=False),
        interpret=interpret, name="mla_causal_attention")(q, k, v)
    out_BThJ = _heads_first(out_BhTJ)
    return out_BThJ, (q_BThQ, k_BShQ, v_BShJ, out_BThJ, lse_Bh1T)


def _backward(block, interpret, residuals, dout_BThJ):
    q_BThQ, k_BShQ, v_BShJ, out_BThJ, lse_Bh1T = residuals
    q, k, v, out, dout = (_heads_first(x) for x in (q_BThQ, k_BShQ, v_BShJ, out_BThJ, dout_BThJ))
    B, h, T, Q = q.shape
    J = v.shape[-1]
    dq_BhQT, dk, dv = pl.pallas_call(
        functools.partial(_backward_kernel, block=block, scale=1 / math.sqrt(Q)),
        grid=(B, h),
        in_specs=[_sequence_spec(T, Q), _sequence_spec(T, Q), _sequence_spec(T, J), _sequence_spec(T, J),
                  _sequence_spec(T, J), _sequence_spec(1, T)],
        out_specs=[_sequence_spec(Q, T), _sequence_spec(T, Q), _sequence_spec(T, J)],
        out_shape=[_like(q, (B, h, Q, T)), _like(k, k.shape), _like(v, v.shape)],
        scratch_shapes=[pltpu.VMEM((Q, T), jnp.float32)],
        compiler_params=_COMPILER_PARAMS, cost_estimate=_cost(B, h, T, Q, J, block, q.dtype, backward=True),
        interpret=interpret, name="mla_causal_attention_backward")(q, k, v, out, dout, lse_Bh1T)
    return jnp.transpose(dq_BhQT, (0, 3, 1, 2)), _heads_first(dk), _heads_first(dv)


_attention.defvjp(_forward, _backward)
_COMPILER_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                        vmem_limit_bytes=VMEM_LIMIT_BYTES)


def _like(x, shape, dtype=None):
    """An output of `shape` varying over the manual mesh axes as x does (inside a shard_map)."""
    return jax.ShapeDtypeStruct(shape, dtype or x.dtype, manual_axis_type=jax.typeof(x).manual_axis_type)


def _sequence_spec(rows, columns):
    """One (sequence, head)'s [rows, columns] of a [B, h, rows, columns] array."""
    return pl.BlockSpec((pl.squeezed, pl.squeezed, rows, columns), lambda b, h: (b, h, 0, 0))


def _cost(B, h, T, Q, J, block, dtype, backward):
    """The kernel's FLOPs (its products over the blocks it visits: on and below the diagonal) and bytes, for
    XLA's scheduler and hlo.matmul_flops."""
    n = T // block
    products = 2 * B * h * n * (n + 1) // 2 * block * block * (Q + J) * (5 if backward else 2) // 2
    operands = B * h * T * (2 * Q + J) * jnp.dtype(dtype).itemsize
    return pl.CostEstimate(flops=products, transcendentals=B * h * n * (n + 1) // 2 * block * block,
                           bytes_accessed=int(operands * (2 if backward else 1.5)))


def _as_row(column):
    """A [n, 1] column as a [1, n] row (a transpose of its lane-wide broadcast: a layout Mosaic tiles)."""
    return jnp.transpose(jnp.broadcast_to(column, (column.shape[0], 128)))[:1]


def _causal(scores, queries_on_columns):
    """A diagonal block's scores with those of keys after their query at -inf."""
    row, column = (lax.broadcasted_iota(jnp.int32, scores.shape, d) for d in (0, 1))
    return jnp.where(row <= column if queries_on_columns else column <= row, scores, -jnp.inf)


def _forward_kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, *, block, scale):
    nt = (((1,), (1,)), ((), ()))                          # a @ b.T
    for i in range(q_ref.shape[0] // block):
        rows = slice(i * block, (i + 1) * block)
        q = q_ref[rows, :]
        m = l = acc = None
        for j in range(i + 1):                        # key block 0 first: every row has a finite score
            keys = slice(j * block, (j + 1) * block)
            s = lax.dot_general(q, k_ref[keys, :], nt, preferred_element_type=jnp.float32) * scale
            s = _causal(s, queries_on_columns=False) if i == j else s
            m_new = jnp.max(s, axis=1, keepdims=True) if m is None else jnp.maximum(
                m, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            pv = jnp.dot(p.astype(v_ref.dtype), v_ref[keys, :], preferred_element_type=jnp.float32)
            if m is None:
                l, acc = jnp.sum(p, axis=1, keepdims=True), pv
            else:
                rescale = jnp.exp(m - m_new)
                l, acc = rescale * l + jnp.sum(p, axis=1, keepdims=True), rescale * acc + pv
            m = m_new
        out_ref[rows, :] = (acc / l).astype(out_ref.dtype)
        lse_ref[:, rows] = _as_row(m + jnp.log(l))


def _backward_kernel(q_ref, k_ref, v_ref, out_ref, dout_ref, lse_ref, dqT_ref, dk_ref, dv_ref, dqT_sum, *,
                     block, scale):
    """Keys on the rows, queries on the columns (sT = k q.T), so that every product but kT's is one the MXU
    takes as it is; dq comes out transposed, [Q, T], its sums over the key blocks in dqT_sum."""
    n = q_ref.shape[0] // block
    nt = (((1,), (1,)), ((), ()))                          # a @ b.T
    dtype = q_ref.dtype
    dqT_sum[...] = jnp.zeros_like(dqT_sum)
    # softmax's backward: ds = p (dp - delta), delta a query's sum of dout . out, as a row like lse
    deltas = [_as_row(jnp.sum(dout_ref[i * block:(i + 1) * block, :].astype(jnp.float32) *
                              out_ref[i * block:(i + 1) * block, :].astype(jnp.float32), axis=1, keepdims=True))
              for i in range(n)]
    for j in range(n):                                # a key block's dk, dv from the query blocks that see it
        keys = slice(j * block, (j + 1) * block)
        k, v = k_ref[keys, :], v_ref[keys, :]
        kT = jnp.transpose(k)
        dk = dv = None
        for i in range(j, n):
            queries = slice(i * block, (i + 1) * block)
            q, dout = q_ref[queries, :], dout_ref[queries, :]
            sT = lax.dot_general(k, q, nt, preferred_element_type=jnp.float32) * scale
            sT = _causal(sT, queries_on_columns=True) if i == j else sT
            pT = jnp.exp(sT - lse_ref[:, queries])
            dpT = lax.dot_general(v, dout, nt, preferred_element_type=jnp.float32)
            dsT = (pT * (dpT - deltas[i]) * scale).astype(dtype)
            dv_i = jnp.dot(pT.astype(dtype), dout, preferred_element_type=jnp.float32)
            dk_i = jnp.dot(dsT, q, preferred_element_type=jnp.float32)
            dv, dk = (dv_i, dk_i) if dv is None else (dv + dv_i, dk + dk_i)
            dqT_sum[:, queries] += jnp.dot(kT, dsT, preferred_element_type=jnp.float32)
        dk_ref[keys, :] = dk.astype(dk_ref.dtype)
        dv_ref[keys, :] = dv.astype(dv_ref.dtype)
    dqT_ref[...] = dqT_sum[...].astype(dqT_ref.dtype)
