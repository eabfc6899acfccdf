"""Engine: the cross-entropy seam's fast implementation (engine.Fast.cross_entropy_sum, .token_scores).
The core's is loss.py's, from the output layer's logits [B, T, v] (what --engine reference runs); this one
takes a chunk of whole sequences at a time, its gradient computed with its loss, and never holds more than
one chunk's logits. The same Megatron parallel softmax over the tp ranks' vocabulary rows as loss.py's.
Shape suffixes as model.py's; X chunks of N tokens.
"""
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from collectives import psum, vary_like
from engine.products import dot32
from loss import real_rows
from model import vocab_start


def chunked_cross_entropy_sum(table_vD, h_BTD, targets_BT, cfg, axes, min_chunk_tokens, sums_by_product=False):
    """The same sum a chunk of whole sequences (at least min_chunk_tokens) at a time: no fp32 logits
    outlive one chunk, memory O(chunk x v) whatever the batch. Differentiated, each chunk's gradients are
    computed with its loss (`_ce_fwd`), from the logits already there, so the backward recomputes nothing.
    table_vD is fp32 (fsdp.gathered), rounded to the matmul dtype once; its gradient is summed over the
    chunks in fp32. sums_by_product (a TPU's): differentiated, each token's sum of exponentials is the one
    the hidden states' gradient product makes as it multiplies them (`_chunk_token_nats`)."""
    # Guide: vocab-parallel cross-entropy over the tp-split table; no [B, T, V] logits are formed.
    v = table_vD.shape[0]
    start = vocab_start(axes, v)
    n_real = real_rows(start, v, cfg.vocab_size)
    local_targets_BT = targets_BT - start
    # A custom_vjp must hand back cotangents typed like its inputs, and the table's gradient varies over
    # every axis the tokens do (and the tokens' over tp). Casting both to the union first makes JAX put the
    # reductions in the cast's transpose: psum over dp/pp for the table (on top of FSDP's reduce-scatter),
    # over tp for the hidden states, both in fp32.
    table_vD, h_BTD = vary_like((table_vD, h_BTD), (table_vD, h_BTD, local_targets_BT, n_real))
    X = _n_chunks(h_BTD.shape, min_chunk_tokens)
    with jax.named_scope("output_layer"):
        return _chunked_ce(jnp.dtype(cfg.model_dtype), axes, sums_by_product, table_vD,
                           h_BTD.reshape(X, -1, h_BTD.shape[-1]), local_targets_BT.reshape(X, -1), n_real)


def chunked_token_scores(table_vD, h_BTD, targets_BT, cfg, axes, min_chunk_tokens):
    """Each token's cross-entropy [B, T] as chunked_cross_entropy_sum computes it, a chunk at a time, and
    whether its target is the greedy choice [B, T]; for scoring (no gradient)."""
    v = table_vD.shape[0]
    start = vocab_start(axes, v)
    n_real = real_rows(start, v, cfg.vocab_size)
    B, T, D = h_BTD.shape
    X, dtype = _n_chunks(h_BTD.shape, min_chunk_tokens), jnp.dtype(cfg.model_dtype)
    table_r = table_vD.astype(dtype)

    def one_chunk(chunk):
        h_ND, local_targets_N = chunk
        nats_N, (exp_vN, _, rescale_N, inside_N, *_) = _chunk_token_nats(axes, table_r, h_ND.astype(dtype),
                                                                         local_targets_N, n_real)
        # exp(target - local max) x exp(local max - max) is exactly 1 only where the target's logit is the max
        target_exp_N = exp_vN[_clipped(local_targets_N, table_r), jnp.arange(len(local_targets_N))] * rescale_N
        return nats_N, psum(jnp.where(inside_N, target_exp_N, 0.0), axes.tp) == 1.0

    nats_XN, greedy_XN = lax.map(one_chunk, (h_BTD.reshape(X, -1, D), (targets_BT - start).reshape(X, -1)))
    return nats_XN.reshape(B, T), greedy_XN.reshape(B, T)


def _n_chunks(shape_BTD, min_chunk_tokens):
    """How many chunks of whole sequences, each of at least min_chunk_tokens tokens (or all of them)."""
    B, T, _ = shape_BTD
    return B // next(g for g in range(1, B + 1) if B % g == 0 and (g * T >= min_chunk_tokens or g == B))


def _exp_logits_vN(table_vD, h_ND, n_real):
    """exp(logits - max) [v, N] from operands in the matmul dtype, 0 on padding rows, and this rank's max.
    Vocab-major: XLA:CPU runs the gradient's products with it up to 2x faster than token-major."""
    logits_vN = dot32("vd,td->vt", table_vD, h_ND)
    real_v1 = (jnp.arange(table_vD.shape[0]) < n_real)[:, None]
    max_N = jnp.max(jnp.where(real_v1, logits_vN, -jnp.inf), axis=0)
    return jnp.where(real_v1, jnp.exp(logits_vN - max_N), 0.0), max_N


def _held(local_targets, n_real):
    """Whether this rank's vocab rows hold each target."""
    return (local_targets >= 0) & (local_targets < n_real)


def _clipped(local_targets, table_vD):
    return jnp.clip(local_targets, 0, table_vD.shape[0] - 1)


def _chunk_token_nats(axes, table_r, h_r, local_targets_N, n_real, table_ones_vE=None):
    """One chunk's per-token cross-entropy [N] from operands in the matmul dtype, and the pieces its gradient
    is made of: exp(logit - local max) [v, N], the sum of exponentials and the rescale of the local max to
    the combined one (over tp), whether this rank holds each target, the target rows, and where table_ones_vE
    (the table and a column of ones, [v, D + 1]) is given, the product of the table and the exponentials
    rounded to the matmul dtype, [N, D] (the hidden states' gradient but for its factors per token). Its last
    column is then each token's sum of exponentials, added up by the MXU as it multiplies, rather than in a pass of
    its own over the fp32 exponentials: the sum of the rounded exponentials the gradient uses
    (docs/performance-log.md#2026-12-07-tpu-ce-sums)."""
    exp_vN, local_max_N = _exp_logits_vN(table_r, h_r, n_real)
    product_NE = None
    if table_ones_vE is not None:
        exp_vN = exp_vN.astype(table_r.dtype)
        product_NE = dot32("vd,vt->td", table_ones_vE, exp_vN)
    max_N = local_max_N if axes.tp is None else lax.pmax(local_max_N, axes.tp)
    rescale_N = jnp.exp(local_max_N - max_N)
    local_sum_N = jnp.sum(exp_vN, axis=0) if product_NE is None else product_NE[:, -1]
    sum_exp_N = psum(local_sum_N * rescale_N, axes.tp)
    product_ND = None if product_NE is None else product_NE[:, :-1]
    inside_N, rows_ND = _held(local_targets_N, n_real), table_r[_clipped(local_targets_N, table_r)]
    target_N = psum(jnp.where(inside_N, dot32("td,td->t", rows_ND, h_r), 0.0), axes.tp)
    return max_N + jnp.log(sum_exp_N) - target_N, (exp_vN, sum_exp_N, rescale_N, inside_N, rows_ND, product_ND)


def _chunk_ce(axes, table_r, h_r, local_targets_N, n_real, table_ones_vE=None):
    """One chunk's summed cross-entropy and what its gradient needs: exp(logit - local max) [v, N],
    d loss / d sum_exp per token (the combination's, over tp), the target rows and the table's product
    with the exponentials (or None: `_chunk_token_nats`)."""
    nats_N, (exp_vN, sum_exp_N, rescale_N, inside_N, rows_ND, product_ND) = _chunk_token_nats(
        axes, table_r, h_r, local_targets_N, n_real, table_ones_vE)
    return jnp.sum(nats_N), (exp_vN, 1 / sum_exp_N * rescale_N, inside_N, rows_ND, product_ND)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked_ce(dtype, axes, sums_by_product, table_vD, h_XND, local_targets_XN, n_real):
    """The summed cross-entropy of X chunks of tokens (`_chunk_ce` each, in a scan); not differentiated, the
    exponentials summed in fp32 whatever sums_by_product."""
    table_r = table_vD.astype(dtype)
    _, ces = lax.scan(lambda _, c: (None, _chunk_ce(axes, table_r, c[0].astype(dtype), c[1], n_real)[0]), None,
                      (h_XND, local_targets_XN))
    return jnp.sum(ces)


def _ce_fwd(dtype, axes, sums_by_product, table_vD, h_XND, local_targets_XN, n_real):
    """The loss and, with it, its gradients for a cotangent of 1 (the backward scales them): per chunk
    d logit[v, t] = exp(logit[v, t] - m[t]) c[t] - [v is t's target], c = d loss / d sum_exp, with c applied
    on the [N, D] side of both products and the target's term added in fp32, so the exponentials are the
    only [v, N] array. The table's gradient is summed over the chunks in an fp32 carry; the target terms
    then go into it in one scatter-add of every token's hidden state. sums_by_product: the sums of
    exponentials from the hidden states' product (`_chunk_token_nats`)."""
    table_r = table_vD.astype(dtype)
    table_ones_vE = (jnp.concatenate([table_r, jnp.ones((table_r.shape[0], 1), dtype)], axis=1)
                     if sums_by_product else None)

    def one(d_table_vD, chunk):
        h_ND, y_N = chunk
        h_r = _rounded_behind_barrier(h_ND, dtype) if sums_by_product else h_ND.astype(dtype)
        ce, (exp_vN, c_N, inside_N, rows_ND, product_ND) = _chunk_ce(axes, table_r, h_r, y_N, n_real, table_ones_vE)
        exp_vN, minus_N = exp_vN.astype(dtype), jnp.where(inside_N, -1.0, 0.0)
        d_h_ND = (c_N[:, None] * (dot32("vd,vt->td", table_r, exp_vN) if product_ND is None else product_ND)
                  + minus_N[:, None] * rows_ND.astype(jnp.float32))
        d_chunk_vD = dot32("vt,td->vd", exp_vN, (h_ND * c_N[:, None]).astype(dtype))
        return d_table_vD + d_chunk_vD, (ce, d_h_ND.astype(h_ND.dtype))

    zeros_vD, = vary_like((jnp.zeros(table_vD.shape, jnp.float32),), (table_vD,))
    d_table_vD, (ces, d_h_XND) = lax.scan(one, zeros_vD, (h_XND, local_targets_XN))
    targets_N, h_ND = local_targets_XN.reshape(-1), h_XND.reshape(-1, h_XND.shape[-1]).astype(dtype)
    d_table_vD = d_table_vD.at[_clipped(targets_N, table_vD)].add(
        jnp.where(_held(targets_N, n_real)[:, None], -h_ND.astype(jnp.float32), 0.0))
    return jnp.sum(ces), (d_table_vD.astype(table_vD.dtype), d_h_XND)


def _rounded_behind_barrier(h_ND, dtype):
    """A chunk's hidden states rounded to the matmul dtype behind an optimization barrier, where the sums of exponentials
    come from the MXU (a TPU's): XLA:TPU otherwise folds the rounding into the logits' product, an fp32 x bf16 one, and
    with all the chunks rounded once before the loop it staged the whole step slower
    (docs/performance-log.md#2026-12-08-tpu-rounding-in-the-loop)."""
    return lax.optimization_barrier(h_ND.astype(dtype))


def _ce_bwd(dtype, axes, sums_by_product, residuals, g):
    """The gradients for cotangent g, each in its input's dtype (the residuals are)."""
    d_table_vD, d_h_XND = residuals
    return (g * d_table_vD).astype(d_table_vD.dtype), (g * d_h_XND).astype(d_h_XND.dtype), None, None


_chunked_ce.defvjp(_ce_fwd, _ce_bwd)
