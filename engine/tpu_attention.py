"""Engine: causal attention on a TPU as one Pallas kernel a (sequence, group of heads), forward and backward, for
MLA's narrow heads (content q.k 64 wide, a rotary part of 128, v 64), where XLA writes every T x T block of
scores to HBM and jax's splash and flash kernels were slower than that (docs/performance-log.md#2026-12-06-tpu-levers).

It reads q, k and v as the layer's products leave them, [B, T, h x width], and MLA's parts apart: the content
q and k, the per-head rotary q and the one rotary key all heads share. So nothing is joined, repeated or
turned heads-first around it: a grid step takes g heads, the fewest whose parts fill whole tiles of 128
lanes (2 at widths of 64). Inside, a head's part of a tile is its lanes: sliced where a head fills whole
tiles, else the other heads' lanes zeroed in one operand, which the MXU's 128-deep products cost the same.

One grid step holds whole sequences of its heads in VMEM (LONGEST_T says how long, by the core's VMEM) and walks
their causal pieces, with the loops unrolled at trace time: `rows` queries (the forward's) or keys (the
backward's) at a time against the other side's up to the diagonal, in pieces of `block`, the last one cut at the
diagonal. So nothing above the diagonal's squares of rows x rows is visited and only the pieces crossing it are
masked. The forward is flash attention's online softmax (the scores never leave VMEM) and keeps each row's
log-sum-exp; the backward recomputes each piece's probabilities from it (FlashAttention-2's). Numerics as
model.masked_attention's on the joined q and k: scores and softmax in fp32, the products' operands in the input
dtype (bf16 on the chip), fp32 sums; the block order changes the rounding, not the math.
"""
import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_SIZES = (512, 256, 128)        # a block is the largest of these that divides T
# From blocks this long, rows of half a block: the diagonal's squares half as wide, fewer masked scores computed, for
# products still long enough to keep the MXU busy (docs/performance-log.md#2026-12-07-tpu-attention-rows); shorter
# blocks keep square ones, not measured.
HALVED_BLOCK = 512
VMEM_LIMIT_BYTES = 64 * 2**20
# The longest sequence whose blocks (a grid step holds its heads' whole sequences) a core's VMEM holds, as
# libtpu's compiler found at the edges (tests/test_tpu_attention.py): a v4's 16 MiB T 1024, 64 MiB (a v5p's; a
# v5e's and v6e's 128 under VMEM_LIMIT_BYTES) T 3072. Longer: XLA's path. A chip not known: the smallest.
LONGEST_T = ((64 * 2**20, 3072), (0, 1024))
LANES = 128                           # a vector register's lanes: a block's last dim is a multiple of them
NT = (((1,), (1,)), ((), ()))         # dot_general's a @ b.T


def heads_per_step(h, K, J, R, lanes=LANES):
    """The fewest heads g (dividing h) whose content (K), value (J) and rotary (R, 0 without RoPE) widths each
    fill whole tiles of `lanes`, a head's part being whole tiles or a fraction of one; None if none does."""
    fits = lambda w: w == 0 or w % lanes == 0 or lanes % w == 0
    if not all(map(fits, (K, J, R))):
        return None
    return next((g for g in range(1, h + 1) if h % g == 0 and all(g * w % lanes == 0 for w in (K, J, R))), None)


def longest_T(vmem_bytes):
    """The longest sequence the kernel takes on a core of vmem_bytes of VMEM (None: not known)."""
    return next(T for size, T in LONGEST_T if (vmem_bytes or 0) >= size)


def takes(T, h, K, J, R, vmem_bytes=None):
    """Whether the kernel runs a causal attention of T queries and h heads of these widths on a core of
    vmem_bytes of VMEM (else the caller keeps XLA's path)."""
    return T <= longest_T(vmem_bytes) and T % BLOCK_SIZES[-1] == 0 and heads_per_step(h, K, J, R) is not None


def attention(q_BThK, k_BShK, v_BShJ, q_rope_BThR=None, k_rope_BSR=None, block=None, rows=None, interpret=False,
              lanes=LANES):
    """softmax(q.k / sqrt(K + R)) v, causal (S = T), with q = [q_content; q_rope] and k = [k_content; k_rope]
    (the one rotary key repeated for every head; both rotary parts None without RoPE), returned in q's dtype.
    k_rope_BSR is rounded to q's dtype in here, so that its gradient, the heads' sum, is added up in fp32.
    block: the longest piece of keys (forward) or queries (backward) a product takes (default: the largest of
    BLOCK_SIZES dividing T); rows: the queries (forward) or keys (backward) a piece holds (default: half a block
    from HALVED_BLOCK, else the block), a divisor of T; lanes: the tile width the heads are grouped for (smaller in tests, where the interpreter runs
    the kernel)."""
    T = q_BThK.shape[1]
    block = block or next(b for b in BLOCK_SIZES if T % b == 0)
    tiling = (block, rows or (block // 2 if block >= HALVED_BLOCK else block))
    k_rope_BSR = None if k_rope_BSR is None else k_rope_BSR.astype(jnp.float32)
    return _attention(q_BThK, k_BShK, v_BShJ, q_rope_BThR, k_rope_BSR, tiling, interpret, lanes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q_BThK, k_BShK, v_BShJ, q_rope_BThR, k_rope_BSR, tiling, interpret, lanes):
    return _forward(q_BThK, k_BShK, v_BShJ, q_rope_BThR, k_rope_BSR, tiling, interpret, lanes)[0]


class _Shape:
    """One call's sizes: h heads of K, J and R wide parts (R 0 without RoPE) in groups of g, a grid step a
    (sequence, group); the rotary key as the kernel reads it, Rk lanes: itself where R fills whole tiles, else
    repeated g times to meet the group's lanes."""

    def __init__(self, q_BThK, v_BShJ, q_rope_BThR, lanes):
        self.B, self.T, self.h, self.K = q_BThK.shape
        self.J, self.R = v_BShJ.shape[-1], 0 if q_rope_BThR is None else q_rope_BThR.shape[-1]
        self.g, self.lanes = heads_per_step(self.h, self.K, self.J, self.R, lanes), lanes
        self.Rk = self.R if self.R % lanes == 0 else self.g * self.R
        self.groups = self.h // self.g

    def kernel_args(self, tiling):
        return dict(tiling=tiling, scale=1 / math.sqrt(self.K + self.R), g=self.g, widths=(self.K, self.J, self.R),
                    lanes=self.lanes)

    def rope_specs(self):
        """The group's rotary queries and the sequence's one rotary key (every group reads it whole)."""
        if self.R == 0:
            return []
        whole_key = pl.BlockSpec((pl.squeezed, self.T, self.Rk), lambda b, group: (b, 0, 0))
        return [_group_spec(self.T, self.g * self.R), whole_key]


def _flat(x_BThX):
    """[B, T, h, X] -> [B, T, h X]: a group's heads side by side in its lanes."""
    return x_BThX.reshape(*x_BThX.shape[:2], -1)


def _forward(q_BThK, k_BShK, v_BShJ, q_rope_BThR, k_rope_BSR, tiling, interpret, lanes):
    """(out_BThJ, the residuals: q, k, v, out as given and returned, the rotary parts as the kernel reads them
    (or None), each row's log-sum-exp)."""
    s = _Shape(q_BThK, v_BShJ, q_rope_BThR, lanes)
    rope = None
    if s.R:
        k_rope_BSRk = k_rope_BSR.astype(q_BThK.dtype)
        rope = (q_rope_BThR, k_rope_BSRk if s.Rk == s.R else jnp.tile(k_rope_BSRk, (1, 1, s.g)))
    out, lse_Bh1T = pl.pallas_call(
        functools.partial(_forward_kernel, **s.kernel_args(tiling)),
        grid=(s.B, s.groups),
        in_specs=[_group_spec(s.T, s.g * w) for w in (s.K, s.K, s.J)] + s.rope_specs(),
        out_specs=[_group_spec(s.T, s.g * s.J), _lse_spec(s)],
        out_shape=[_like(q_BThK, (s.B, s.T, s.h * s.J)), _like(q_BThK, (s.B, s.h, 1, s.T), jnp.float32)],
        compiler_params=_COMPILER_PARAMS, cost_estimate=_cost(s, tiling, q_BThK.dtype, backward=False),
        interpret=interpret, name="mla_causal_attention")(
            _flat(q_BThK), _flat(k_BShK), _flat(v_BShJ), *(() if rope is None else (_flat(rope[0]), rope[1])))
    out_BThJ = out.reshape(s.B, s.T, s.h, s.J)
    return out_BThJ, (q_BThK, k_BShK, v_BShJ, out_BThJ, rope, lse_Bh1T)


def _backward(tiling, interpret, lanes, residuals, dout_BThJ):
    q_BThK, k_BShK, v_BShJ, out_BThJ, rope, lse_Bh1T = residuals
    s = _Shape(q_BThK, v_BShJ, None if rope is None else rope[0], lanes)
    # dq's parts come out transposed, [B, h / g, g x width, T]; the rotary key's per group, in fp32
    transposed = lambda w: (_per_group_spec(s.g * w, s.T), _like(q_BThK, (s.B, s.groups, s.g * w, s.T)))
    outs = [transposed(s.K), (_group_spec(s.T, s.g * s.K), _like(k_BShK, (s.B, s.T, s.h * s.K))),
            (_group_spec(s.T, s.g * s.J), _like(v_BShJ, (s.B, s.T, s.h * s.J)))]
    if rope is not None:
        outs += [transposed(s.R), (_per_group_spec(s.T, s.Rk), _like(q_BThK, (s.B, s.groups, s.T, s.Rk), jnp.float32))]
    grads = pl.pallas_call(
        functools.partial(_backward_kernel, **s.kernel_args(tiling)),
        grid=(s.B, s.groups),
        in_specs=[_group_spec(s.T, s.g * w) for w in (s.K, s.K, s.J, s.J, s.J)] + [_lse_spec(s)] + s.rope_specs(),
        out_specs=[spec for spec, _ in outs], out_shape=[shape for _, shape in outs],
        scratch_shapes=[pltpu.VMEM((s.g, 1, s.T), jnp.float32)] + [pltpu.VMEM((s.g * w, s.T), jnp.float32)
                                                                  for w in (s.K, s.R) if w],
        compiler_params=_COMPILER_PARAMS, cost_estimate=_cost(s, tiling, q_BThK.dtype, backward=True),
        interpret=interpret, name="mla_causal_attention_backward")(
            *map(_flat, (q_BThK, k_BShK, v_BShJ, out_BThJ, dout_BThJ)), lse_Bh1T,
            *(() if rope is None else (_flat(rope[0]), rope[1])))
    heads_last = lambda xT, w: jnp.transpose(xT, (0, 3, 1, 2)).reshape(s.B, s.T, s.h, w)
    dq, dk, dv = heads_last(grads[0], s.K), grads[1].reshape(k_BShK.shape), grads[2].reshape(v_BShJ.shape)
    if rope is None:
        return dq, dk, dv, None, None
    # the rotary key's gradient: every head's, summed in each group (and over its copies) and then here
    d_k_rope = jnp.sum(grads[4].reshape(s.B, s.groups, s.T, s.Rk // s.R, s.R), axis=(1, 3))
    return dq, dk, dv, heads_last(grads[3], s.R), d_k_rope


_attention.defvjp(_forward, _backward)
_COMPILER_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                        vmem_limit_bytes=VMEM_LIMIT_BYTES)


def _like(x, shape, dtype=None):
    """An output of `shape` varying over the manual mesh axes as x does (inside a shard_map)."""
    return jax.ShapeDtypeStruct(shape, dtype or x.dtype, manual_axis_type=jax.typeof(x).manual_axis_type)


def _group_spec(rows, lanes):
    """A group of heads' [rows, lanes] of a [B, rows, h x width] array."""
    return pl.BlockSpec((pl.squeezed, rows, lanes), lambda b, group: (b, 0, group))


def _per_group_spec(rows, columns):
    """A (sequence, group)'s [rows, columns] of a [B, h / g, rows, columns] array."""
    return pl.BlockSpec((pl.squeezed, pl.squeezed, rows, columns), lambda b, group: (b, group, 0, 0))


def _lse_spec(s):
    """A group's heads' [g, 1, T] of the log-sum-exps [B, h, 1, T]."""
    return pl.BlockSpec((pl.squeezed, s.g, 1, s.T), lambda b, group: (b, group, 0, 0))


def _cost(s, tiling, dtype, backward):
    """The kernel's FLOPs (its products over the pieces it visits: the rows x rows squares on and below the
    diagonal, whatever the block) and bytes, for XLA's scheduler and hlo.matmul_flops: the model's, as if each
    head were alone and q, k joined."""
    n, rows, Q = s.T // tiling[1], tiling[1], s.K + s.R
    scores = s.B * s.h * n * (n + 1) // 2 * rows * rows
    operands = s.B * s.h * s.T * (2 * Q + s.J) * jnp.dtype(dtype).itemsize
    return pl.CostEstimate(flops=2 * scores * (Q + s.J) * (5 if backward else 2) // 2, transcendentals=scores,
                           bytes_accessed=int(operands * (2 if backward else 1.5)))


def _pieces(T, tiling, keys_on_rows):
    """The (rows, columns) slices a kernel visits, a row slice at a time: the forward's queries [r0, r1) against
    keys [0, r1) in pieces of block; the backward's keys [r0, r1) against queries [r0, T)."""
    block, rows = tiling
    for r0 in range(0, T, rows):
        start, stop = (r0, T) if keys_on_rows else (0, r0 + rows)
        yield slice(r0, r0 + rows), [slice(c, min(c + block, stop)) for c in range(start, stop, block)]


def _as_row(column):
    """A [n, 1] column as a [1, n] row (a transpose of its lane-wide broadcast: a layout Mosaic tiles)."""
    return jnp.transpose(jnp.broadcast_to(column, (column.shape[0], 128)))[:1]


def _causal(scores, rows, columns, queries_on_columns):
    """A piece's scores (its rows' and columns' slices of the sequence) with those of keys after their query at
    -inf, where any is."""
    if (columns.stop - 1 <= rows.start) if not queries_on_columns else (rows.stop - 1 <= columns.start):
        return scores
    row, column = (lax.broadcasted_iota(jnp.int32, scores.shape, d) for d in (0, 1))
    row, column = row + rows.start, column + columns.start
    return jnp.where(row <= column if queries_on_columns else column <= row, scores, -jnp.inf)


def _own(x, a, width, lanes):
    """Head a's part of a group's x [n, g x width]: its lanes where it fills whole tiles, else x with every other
    head's lanes zeroed (a product with it then sees head a alone)."""
    if width % lanes == 0:
        return x[:, a * width:(a + 1) * width]
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.where((lane >= a * width) & (lane < (a + 1) * width), x, jnp.zeros_like(x))


def _beside(x, a, width, lanes):
    """The other operand of a product with _own(., a, ...): head a's lanes where it fills whole tiles, else all."""
    return x[:, a * width:(a + 1) * width] if width % lanes == 0 else x


def _store(ref, rows, per_head, width, lanes):
    """Each head's [n, width] (or, below a tile, its [n, g x width] zero but in its own lanes) into ref's rows."""
    if width % lanes == 0:
        for a, x in enumerate(per_head):
            ref[rows, a * width:(a + 1) * width] = x.astype(ref.dtype)
    else:
        ref[rows, :] = functools.reduce(operator.add, per_head).astype(ref.dtype)


def _add(total, x):
    return x if total is None else total + x


def _scores(q, qr, k, kr, a, K, R, lanes, keys_on_rows=False):
    """Head a's q.k [queries, keys] in fp32, the content part's product plus the rotary part's (keys_on_rows:
    k.q [keys, queries], the backward's)."""
    parts = [(_own(q, a, K, lanes), _beside(k, a, K, lanes))] + ([(_own(qr, a, R, lanes), kr)] if R else [])
    return functools.reduce(operator.add, (lax.dot_general(*(part[::-1] if keys_on_rows else part), NT,
                                                           preferred_element_type=jnp.float32) for part in parts))


def _forward_kernel(q_ref, k_ref, v_ref, *refs, tiling, scale, g, widths, lanes):
    K, J, R = widths
    qr_ref, kr_ref, out_ref, lse_ref = refs if R else (None, None, *refs)
    for rows, pieces in _pieces(q_ref.shape[0], tiling, keys_on_rows=False):
        q, qr = q_ref[rows, :], None if R == 0 else qr_ref[rows, :]
        outs = []
        for a in range(g):
            m = l = acc = None
            for keys in pieces:                           # keys from the first: every row has a finite score
                s = _scores(q, qr, k_ref[keys, :], None if R == 0 else kr_ref[keys, :], a, K, R, lanes) * scale
                s = _causal(s, rows, keys, queries_on_columns=False)
                m_new = jnp.max(s, axis=1, keepdims=True) if m is None else jnp.maximum(
                    m, jnp.max(s, axis=1, keepdims=True))
                p = jnp.exp(s - m_new)
                pv = jnp.dot(p.astype(v_ref.dtype), _beside(v_ref[keys, :], a, J, lanes),
                             preferred_element_type=jnp.float32)
                if m is None:
                    l, acc = jnp.sum(p, axis=1, keepdims=True), pv
                else:
                    rescale = jnp.exp(m - m_new)
                    l, acc = rescale * l + jnp.sum(p, axis=1, keepdims=True), rescale * acc + pv
                m = m_new
            # below a tile, acc's other lanes hold the other heads' values weighted by this head's softmax
            outs.append(acc / l if J % lanes == 0 else _own(acc / l, a, J, lanes))
            lse_ref[a, :, rows] = _as_row(m + jnp.log(l))
        _store(out_ref, rows, outs, J, lanes)


def _backward_kernel(q_ref, k_ref, v_ref, out_ref, dout_ref, lse_ref, *refs, tiling, scale, g, widths, lanes):
    """Keys on the rows, queries on the columns (sT = k q.T), so that every product but kT's is one the MXU
    takes as it is; dq comes out transposed, [g K, T], its sums over the key pieces in VMEM scratch."""
    K, J, R = widths
    if R:
        qr_ref, kr_ref, dqT_ref, dk_ref, dv_ref, dqrT_ref, dkr_ref, delta_ref, dqT_sum, dqrT_sum = refs
    else:
        dqT_ref, dk_ref, dv_ref, delta_ref, dqT_sum = refs
    dtype = q_ref.dtype
    dqT_sum[...] = jnp.zeros_like(dqT_sum)
    if R:
        dqrT_sum[...] = jnp.zeros_like(dqrT_sum)
    # softmax's backward: ds = p (dp - delta), delta a query's sum of dout . out over its head, [g, 1, T] as lse
    for queries, _ in _pieces(q_ref.shape[0], tiling, keys_on_rows=True):
        product = dout_ref[queries, :].astype(jnp.float32) * out_ref[queries, :].astype(jnp.float32)
        for a in range(g):
            delta_ref[a, :, queries] = _as_row(jnp.sum(_own(product, a, J, lanes), axis=1, keepdims=True))
    for keys, pieces in _pieces(q_ref.shape[0], tiling, keys_on_rows=True):   # a key slice's dk, dv
        k, v = k_ref[keys, :], v_ref[keys, :]
        kr = None if R == 0 else kr_ref[keys, :]
        kT = jnp.transpose(k)
        krT = None if R == 0 else jnp.transpose(kr)[:R]         # a repeated key's first copy
        dk, dv, dkr = [None] * g, [None] * g, None
        for queries in pieces:
            q, dout = q_ref[queries, :], dout_ref[queries, :]
            qr = None if R == 0 else qr_ref[queries, :]
            for a in range(g):
                sT = _scores(q, qr, k, kr, a, K, R, lanes, keys_on_rows=True)
                sT = _causal(sT * scale, keys, queries, queries_on_columns=True)
                pT = jnp.exp(sT - lse_ref[a, :, queries])
                dpT = lax.dot_general(_beside(v, a, J, lanes), _own(dout, a, J, lanes), NT,
                                      preferred_element_type=jnp.float32)
                dsT = (pT * (dpT - delta_ref[a, :, queries]) * scale).astype(dtype)
                dv[a] = _add(dv[a], jnp.dot(pT.astype(dtype), _own(dout, a, J, lanes),
                                            preferred_element_type=jnp.float32))
                dk[a] = _add(dk[a], jnp.dot(dsT, _own(q, a, K, lanes), preferred_element_type=jnp.float32))
                dqT_sum[a * K:(a + 1) * K, queries] += jnp.dot(kT[a * K:(a + 1) * K], dsT,
                                                               preferred_element_type=jnp.float32)
                if R:
                    dkr = _add(dkr, jnp.dot(dsT, _own(qr, a, R, lanes), preferred_element_type=jnp.float32))
                    dqrT_sum[a * R:(a + 1) * R, queries] += jnp.dot(krT, dsT, preferred_element_type=jnp.float32)
        _store(dk_ref, keys, dk, K, lanes)
        _store(dv_ref, keys, dv, J, lanes)
        if R:
            dkr_ref[keys, :] = dkr
    dqT_ref[...] = dqT_sum[...].astype(dqT_ref.dtype)
    if R:
        dqrT_ref[...] = dqrT_sum[...].astype(dqrT_ref.dtype)
