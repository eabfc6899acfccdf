"""The loss: the tied output layer's cross-entropy with the vocabulary split over tp, and the loss and
metrics summed over the global batch (`summarise`).

The guide's cross-entropy, from this tp rank's logits [B, T, v] (`plain_cross_entropy_sum`, and per token
`plain_token_scores` for scoring tasks): what --engine reference runs at the engine's cross-entropy seam;
the fast engine's equal one never holds more than a chunk's logits (engine/chunked_loss.py). Megatron's
parallel softmax: each tp rank reduces its v vocabulary rows to the max logit, the sum of exponentials and
the target's logit (which one rank holds), and the ranks combine those.
"""

import jax.numpy as jnp
from jax import lax

from collectives import psum
from model import output_logits, vocab_start


def real_rows(start, v, vocab_size):
    """How many of this tp rank's v rows (ids [start, start + v)) are real, not vocabulary padding."""
    return jnp.clip(vocab_size - start, 0, v)


def plain_cross_entropy_sum(table_vD, h_BTD, targets_BT, cfg, axes):
    """Summed cross-entropy from the output layer's logits (`plain_token_scores`)."""
    return jnp.sum(plain_token_scores(table_vD, h_BTD, targets_BT, cfg, axes)[0])


def plain_token_scores(table_vD, h_BTD, targets_BT, cfg, axes):
    """Each token's cross-entropy [B, T] from the output layer's logits (`model.output_logits`, fp32, padding
    rows at -inf): log-sum-exp over the vocabulary, combined over the tp ranks, minus the target's logit; and
    whether the target is the greedy choice [B, T] (its logit the largest)."""
    logits_BTv = output_logits(h_BTD, table_vD, cfg, axes)
    v = table_vD.shape[0]
    local_BT = targets_BT - vocab_start(axes, v)
    max_BT = lax.stop_gradient(jnp.max(logits_BTv, axis=-1))       # a shift that cancels: no gradient
    max_BT = max_BT if axes.tp is None else lax.pmax(max_BT, axes.tp)
    sum_exp_BT = psum(jnp.sum(jnp.exp(logits_BTv - max_BT[..., None]), axis=-1), axes.tp)
    held_BT = (local_BT >= 0) & (local_BT < v)
    target_BT = jnp.take_along_axis(logits_BTv, jnp.clip(local_BT, 0, v - 1)[..., None], axis=-1)[..., 0]
    target_BT = psum(jnp.where(held_BT, target_BT, 0.0), axes.tp)     # the one rank's logit + zeros: exact
    return max_BT + jnp.log(sum_exp_BT) - target_BT, target_BT >= max_BT


def summarise(ce_sum, stats, n_tokens, n_sequences, cfg):
    """Loss and metrics from sums over the global batch: mean CE plus, as DeepSeek-V3 and Megatron, alpha x
    the balance loss of every MoE layer (averaged over sequences), summed over the layers. Per MoE layer
    (one per block): that balance term [blocks], the routed choices each expert received before capacity
    drops [blocks, E] (integers, so exact on every mesh) and the fraction of the k x tokens choices
    dropped [blocks]."""
    ce = ce_sum / n_tokens
    balance = cfg.alpha * stats["balance"] / n_sequences
    metrics = {"ce": ce, "balance": balance, "tokens_per_expert": stats["tokens_per_expert"],
               "drop_rate": stats["dropped"] / (n_tokens * cfg.k)}
    return ce + jnp.sum(balance), metrics
