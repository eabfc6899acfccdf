"""The guide's model as flax.nnx modules, in the guide's order: RMSNorm, Embedding, RoPE, MLA, FeedForward,
the MoE layer (router, capacity, balance loss, the aux-loss-free bias), Layer, Block, Transformer. Plain
math, every collective written out. Each __call__ takes the mesh axes it runs under (`collectives.Axes`,
all None on one device) and calls the engine (axes.engine, engine.py) at its seams: the product `mm`,
`attention`, the routed experts, `keep` (a value named for the remat) and the weights' read dtypes. Every
weight is an nnx.Param with logical axes ("vocab", "embed", ...) that sharding.py maps to the mesh.

Shape suffixes (legend: docs/model.md): B sequences, T query positions, S key positions, D model width, H
heads, K content and R rotary width per head, Q = K + R, L latent width, F FFN hidden units, V vocabulary
rows, E routed experts, k experts per token, C slots per expert per sequence. Lowercase: this shard's part
(h = H/tp, f = F/tp, v = V/tp, e = E/dp).
"""
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from collectives import axis_index, psum, tp_sum, vary_like
from stacking import call_module, scan_stacked, stacked, variable

NORM_EPS = 1e-6
LAYERS, DENSE_LAYERS = "layers", "dense_layers"     # the logical names of the two stacking axes
# The values the modules name for the remat policies (engine.py): a branch's all-reduced output, the
# routed experts' outputs, a dense FFN's up-projection.
BRANCH_SUM, EXPERT_OUTPUTS, FFN_HIDDEN = "branch_sum", "expert_outputs", "ffn_hidden"


class RouterBias(nnx.Variable):
    """DeepSeek-V3's aux-loss-free routing bias [E]: routing state beside a router, set by the driver
    (`sharding.with_router_bias`), never trained."""


_normal, _ones, _zeros = jax.nn.initializers.normal, jax.nn.initializers.ones, jax.nn.initializers.zeros


def _output_std(cfg):
    """Output projections of each residual branch start smaller, so that the residual stream's variance
    does not grow with depth (GPT-2's scheme)."""
    return 0.02 / math.sqrt(2 * cfg.n_layers)


# ----------------------------------------------------------------------------------------------
# The modules. The residual stream is fp32; products run in cfg.model_dtype.


class RMSNorm(nnx.Module):
    def __init__(self, D, rngs):
        self.scale = variable(rngs, _ones, (D,), "norm")
        self.shift = variable(rngs, _zeros, (D,), "norm")

    def __call__(self, x):
        """Statistics, scale and shift in fp32."""
        x = x.astype(jnp.float32)
        return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * self.scale[...] + self.shift[...]


def vocab_start(axes, v):
    """Vocab-parallel: tp rank r holds the table's rows of vocabulary ids [r v, (r+1) v)."""
    return axis_index(axes.tp) * v


class Embedding(nnx.Module):
    """The token table [V, D], tied with the output projection: vocab-parallel (each tp rank holds v = V/tp
    rows), split over D for FSDP and gathered once for the lookup and the output layer (`gathered`)."""

    def __init__(self, cfg, rngs):
        # Guide: nn.Embed's default, std 1/sqrt(D). At 0.02 a row the data rarely moves enters the first
        # RMSNorm at RMS 0.02, which scales its gradient by 50 (a spike's cause: docs/training.md).
        normal = _normal(cfg.model_dimension ** -0.5)

        def init(key, shape):
            # Guide: the vocabulary is padded (cfg.padded_vocab) so that a checkpoint restores on any tp.
            # The padding rows are never looked up and their logits are masked: they stay 0.
            real_V1 = (jnp.arange(shape[0]) < cfg.vocab_size)[:, None]
            return jnp.where(real_V1, normal(key, shape), 0.0)
        self.table = variable(rngs, init, (cfg.padded_vocab, cfg.model_dimension), "vocab", "embed")
        self.cfg = cfg

    def gathered(self, axes):
        """The table as the lookup and the output layer read it: [v, D/dp] -> [v, D] (engine.gathered)."""
        return axes.engine.gathered(self.table, axes, jnp.dtype(self.cfg.model_dtype))

    def __call__(self, ids_BT, axes, table_vD):
        """Vocab-parallel lookup: each tp rank holds rows [start, start + v) and contributes zeros for ids
        outside them; the psum over tp assembles the embedding."""
        # Guide: the table is split over tp by vocabulary rows (Megatron's vocab-parallel embedding).
        v = table_vD.shape[0]
        local_BT = ids_BT - vocab_start(axes, v)
        inside_BT = (local_BT >= 0) & (local_BT < v)
        x_BTD = jnp.where(inside_BT[..., None], table_vD[jnp.clip(local_BT, 0, v - 1)], 0.0)
        return psum(x_BTD, axes.tp)


def output_logits(h_BTD, table_vD, cfg, axes):
    """The tied output layer: fp32 logits of this tp rank's vocab rows, padding rows masked to -inf (the
    training loss never forms them whole: loss.py)."""
    v = table_vD.shape[0]
    logits_BTv = axes.engine.mm("btd,vd->btv", h_BTD, table_vD, cfg.model_dtype)
    vocab_ids_v = vocab_start(axes, v) + jnp.arange(v)
    return jnp.where(vocab_ids_v < cfg.vocab_size, logits_BTv, -jnp.inf)


def rope(x, positions, base):
    """Rotate channel pairs (i, i + R/2) of x[..., T, (heads,) R] by position x frequency. Queries and keys
    call this with the same R, hence the same frequency table."""
    # Guide: one frequency table over R for queries and keys (the guide's query uses dhR x heads channels).
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freq                       # [T, R/2]
    if x.ndim == 4:                                                             # [B, T, h, R]
        angle = angle[:, None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def masked_attention(q_BThQ, k_BShQ, v_BShK, mask_TS, dtype, mm):
    """softmax(q.k / sqrt(Q)) v, query t seeing the keys s where mask_TS[t, s]; the softmax in fp32."""
    scores_BhTS = mm("bthq,bshq->bhts", q_BThQ, k_BShQ, dtype) / math.sqrt(q_BThQ.shape[-1])
    probs_BhTS = jax.nn.softmax(jnp.where(mask_TS, scores_BhTS, -jnp.inf), axis=-1)
    return mm("bhts,bshk->bthk", probs_BhTS, v_BShK, dtype, dtype)


def branch_sum(x_BTD, axes, dtype):
    """A residual branch's output: the sum over tp of each rank's partial sum (Megatron's one all-reduce
    per branch), in the matmul dtype (`collectives.tp_sum`), named so that the remat keeps it rather than
    all-reduce again in the backward (there is an all-reduce only with more than one tp rank)."""
    # Guide: Megatron tensor parallelism, one psum over tp per branch (the guide: all_to_all + psum_scatter).
    out_BTD = tp_sum(x_BTD, axes.tp, dtype)
    return out_BTD if axes.tp is None or lax.axis_size(axes.tp) == 1 else axes.engine.keep(out_BTD, BRANCH_SUM)


class MLA(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2), with decoupled RoPE in the dense layers (use_rope) and
    none (NoPE) in the MoE layers. Under tp each rank holds h = H/tp heads."""

    def __init__(self, cfg, rngs, use_rope):
        D, Lq, Lkv = cfg.model_dimension, cfg.q_latent_dim, cfg.latent_dim
        HK, HR = cfg.n_head * cfg.head_dim, cfg.n_head * cfg.dhR
        self.w_dq = variable(rngs, _normal(0.02), (D, Lq), "embed", "q_latent")     # down to the query latent
        self.w_dkv = variable(rngs, _normal(0.02), (D, Lkv), "embed", "kv_latent")  # down to the KV latent (the cache)
        self.w_uq = variable(rngs, _normal(0.02), (Lq, HK), "q_latent", "heads")
        self.w_uk = variable(rngs, _normal(0.02), (Lkv, HK), "kv_latent", "heads")
        self.w_uv = variable(rngs, _normal(0.02), (Lkv, HK), "kv_latent", "heads")
        self.w_o = variable(rngs, _normal(_output_std(cfg)), (HK, D), "heads", "embed")
        if use_rope:
            self.w_qr = variable(rngs, _normal(0.02), (Lq, HR), "q_latent", "heads")  # per-head rotary query
            self.w_kr = variable(rngs, _normal(0.02), (D, cfg.dhR), "embed", "rope")  # one rotary key for all heads
        self.use_rope = use_rope
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, cache=None):
        """Keys and values are up-projected from the KV latent c_kv; with a cache, c_kv and the rotated
        shared key are written at `positions_T` and attention runs over every cached position. Returns
        the output and the updated cache (None without one)."""
        cfg, dtype, mm = self.cfg, jnp.dtype(self.cfg.model_dtype), axes.engine.mm
        K, R = cfg.head_dim, cfg.dhR
        B, T, _ = x_BTD.shape
        # The three projections of x (w_dq, w_dkv, w_kr: three parameters, as in the guide) as one product:
        # x is read once and its gradient comes out of one GEMM. The latents and the shared rotary key come
        # out in the matmul dtype, which their up-projections and the rotation read them in anyway.
        down = (self.w_dq, self.w_dkv) + ((self.w_kr,) if self.use_rope else ())
        c_BTL = mm("btd,dl->btl", x_BTD, jnp.concatenate([w[...] for w in down], axis=1), dtype, dtype)
        c_q_BTL, c_kv_BTL, k_rope_BTR = jnp.split(c_BTL, [cfg.q_latent_dim, cfg.q_latent_dim + cfg.latent_dim], -1)
        q_BThK = mm("btl,lf->btf", c_q_BTL, self.w_uq[...], dtype, dtype).reshape(B, T, -1, K)
        new_cache = {"c_kv": c_kv_BTL}
        if self.use_rope:
            # Rotated in fp32 from the product in the matmul dtype, as Megatron rotates its q.
            q_rope_BThR = rope(mm("btl,lf->btf", c_q_BTL, self.w_qr[...], dtype, dtype).reshape(B, T, -1, R),
                               positions_T, cfg.rope_base)
            new_cache["k_rope"] = rope(k_rope_BTR, positions_T, cfg.rope_base)
        if cache is None:
            kv, key_positions_S = new_cache, positions_T
        else:
            kv = {name: lax.dynamic_update_slice_in_dim(cache[name], new_cache[name].astype(cache[name].dtype),
                                                        positions_T[0], axis=1) for name in cache}
            new_cache, key_positions_S = kv, jnp.arange(kv["c_kv"].shape[1])
        h = q_BThK.shape[2]
        k_BShK = mm("bsl,lf->bsf", kv["c_kv"], self.w_uk[...], dtype, dtype).reshape(B, -1, h, K)
        v_BShK = mm("bsl,lf->bsf", kv["c_kv"], self.w_uv[...], dtype, dtype).reshape(B, -1, h, K)
        if self.use_rope:
            # Decoupled RoPE: the rotary parts appended to the content parts, so that one dot product gives
            # q_C.k_C + q_R.k_R, the shared rotary key repeated for every head. Rounded after the broadcast
            # and the cast to varying over tp (which concatenate would insert), so that the cotangent's psum
            # over tp and sum over heads stay fp32.
            k_rope_BShR, = vary_like((jnp.broadcast_to(kv["k_rope"][:, :, None, :], (*k_BShK.shape[:3], R)),), (k_BShK,))
            k_rope_BShR = k_rope_BShR.astype(dtype)
            q_BThK = jnp.concatenate([q_BThK, q_rope_BThR.astype(dtype)], axis=-1)          # [B, T, h, Q]
            k_BShK = jnp.concatenate([k_BShK, k_rope_BShR], axis=-1)
        mask_TS = None if cache is None else key_positions_S[None, :] <= positions_T[:, None]
        out_BThK = axes.engine.attention(q_BThK, k_BShK, v_BShK, mask_TS, dtype)
        # Each tp rank holds h heads: its W_o rows give a partial sum of the output.
        out_BTD = mm("btf,fd->btd", out_BThK.reshape(B, T, -1), self.w_o[...], dtype, dtype)
        return branch_sum(out_BTD, axes, dtype), (new_cache if cache is not None else None)


def ffn(x, w_up, w_down, up_spec, mm, keep=None):
    """The feed-forward of the dense layers and of every expert, up-projection, GELU, down-projection: a
    partial sum over this tp rank's f hidden units, in the matmul dtype. GELU computes in fp32 and is
    rounded back, which the down-projection reads anyway: the widest activation in half the bytes.
    up_spec: the up-projection's einsum (the down-projection's swaps d and f); keep: tags it for the remat."""
    dtype = w_up.dtype
    hidden = mm(up_spec, x, w_up, dtype, dtype)
    hidden = hidden if keep is None else keep(hidden)
    hidden = jax.nn.gelu(hidden.astype(jnp.float32)).astype(dtype)
    return mm(up_spec.translate(str.maketrans("df", "fd")), hidden, w_down, dtype, dtype)


class FeedForward(nnx.Module):
    """The dense FFN, d -> 4d -> d with GELU; under tp each rank holds f = F/tp hidden units."""

    def __init__(self, cfg, rngs):
        D, F = cfg.model_dimension, cfg.ffn_dim
        self.w_up = variable(rngs, _normal(0.02), (D, F), "embed", "mlp")
        self.w_down = variable(rngs, _normal(_output_std(cfg)), (F, D), "mlp", "embed")
        self.cfg = cfg

    def __call__(self, x_BTD, axes):
        keep_hidden = partial(axes.engine.keep, name=FFN_HIDDEN)
        out_BTD = ffn(x_BTD, self.w_up[...], self.w_down[...], "btd,df->btf", axes.engine.mm, keep_hidden)
        return branch_sum(out_BTD, axes, jnp.dtype(self.cfg.model_dtype))          # one psum, as in MLA


def expert_capacity(cfg):
    """Slots per expert per sequence: ceil(capacity_factor k T / E), counting all k choices, with T the
    padded length (cfg.T) whatever the length of one call (1 in cached decode); capacity_factor 0 means
    dropless (an expert can receive each token at most once: T slots)."""
    # Guide: capacity counts all k choices, per sequence (the guide's is B T factor / E over the batch).
    if cfg.capacity_factor == 0:
        return cfg.T
    return min(cfg.T, math.ceil(cfg.capacity_factor * cfg.k * cfg.T / cfg.n_experts))


def route(router_DE, x_BTD, cfg, bias_E=None):
    """Sigmoid top-k routing of each sequence (the routing group, so drops do not depend on the mesh). With
    DeepSeek-V3's aux-loss-free bias_E the k experts are chosen on score + bias; the gates and the balance
    loss's P_i still come from the scores alone.

    Returns expert ids and gates [B, T, k], each choice's place in its expert's queue of this call (tokens
    in order, a token's k choices in rank order), the routed choices per expert and the sequence-wise
    balance loss terms."""
    E, k = cfg.n_experts, cfg.k
    # In fp32 at full precision (on a TPU the default is one bf16 pass): top-k flips on rounded scores.
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), router_DE.astype(jnp.float32),
                            precision=lax.Precision.HIGHEST)
    scores_BTE = jax.nn.sigmoid(logits_BTE)
    _, experts_BTk = lax.top_k(scores_BTE if bias_E is None else scores_BTE + bias_E, k)
    top_scores_BTk = jnp.take_along_axis(scores_BTE, experts_BTk, axis=-1)
    gates_BTk = top_scores_BTk / jnp.sum(top_scores_BTk, axis=-1, keepdims=True)
    B, T, _ = x_BTD.shape
    chosen_BNE = jax.nn.one_hot(experts_BTk, E, dtype=jnp.int32).reshape(B, T * k, E)   # N = T k choices
    slot_BTk = jnp.sum((jnp.cumsum(chosen_BNE, axis=1) - 1) * chosen_BNE, axis=-1).reshape(B, T, k)
    tokens_per_expert_BE = jnp.sum(chosen_BNE, axis=1)
    # Guide: DeepSeek-V3's sequence-wise balance loss in every MoE layer, summed over the layers:
    # f_i = E/(kT) tokens routed to i, P_i = mean_t s_i / sum_j s_j.
    f_BE = E / (k * T) * tokens_per_expert_BE
    p_BE = jnp.mean(scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True), axis=1)
    balance_B = jnp.sum(f_BE * p_BE, axis=-1)
    return experts_BTk, gates_BTk, slot_BTk, tokens_per_expert_BE, balance_B


def update_router_bias(router_bias, tokens_per_expert, rate):
    """DeepSeek-V3's aux-loss-free balancing, after an optimizer step: each expert's bias [blocks, E] moves
    by rate x sign(mean load of its layer's experts - its load), loads being the routed choices of the
    step's whole global batch. The sign comes from integers, so it is exact and the same on every mesh, and
    from no product that can overflow (E c_i does, in int32, at E = 256 and 9M choices for one expert):
    with sum_j c_j = q E + r (0 <= r < E), mean - c_i has the sign of q - c_i, or of r when q = c_i."""
    E = tokens_per_expert.shape[-1]
    q, r = jnp.divmod(jnp.sum(tokens_per_expert, axis=-1, keepdims=True), E)
    below_mean = jnp.where(q == tokens_per_expert, jnp.sign(r), jnp.sign(q - tokens_per_expert))
    return router_bias + rate * below_mean.astype(router_bias.dtype)


class MoE(nnx.Module):
    """Routed experts plus shared experts, added. Under tp every rank routes the same tokens and holds
    f = F/tp hidden units of every expert, so one psum completes routed and shared outputs together.
    router_bias: this layer has DeepSeek-V3's aux-loss-free bias (a RouterBias, not a Param)."""

    def __init__(self, cfg, rngs, router_bias=False):
        D, F, E, n_shared = cfg.model_dimension, cfg.ffn_dim, cfg.n_experts, cfg.n_shared
        # Guide: the router is a matrix without a bias term.
        self.router = variable(rngs, _normal(0.02), (D, E), "embed", "score")
        self.expert_up = variable(rngs, _normal(0.02), (E, D, F), "expert", "embed", "mlp")
        self.expert_down = variable(rngs, _normal(_output_std(cfg)), (E, F, D), "expert", "mlp", "embed")
        # --n_shared 0: no shared experts, and no empty arrays to checkpoint
        shared = lambda init, shape, *axes: variable(rngs, init, shape, "shared", *axes) if n_shared else None
        self.shared_up = shared(_normal(0.02), (n_shared, D, F), "embed", "mlp")
        self.shared_down = shared(_normal(_output_std(cfg)), (n_shared, F, D), "mlp", "embed")
        self.router_bias = variable(rngs, _zeros, (E,), "score", kind=RouterBias) if router_bias else None
        self.cfg = cfg

    def __call__(self, x_BTD, axes, fill_BE=None):
        """fill_BE: tokens each sequence queued per expert in earlier calls (cached decode); they come first
        in the queue, so a token is kept or dropped as in one call over the whole sequence. Returns the
        output, the stats and the fill counts after this call."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.model_dtype)
        bias_E = None if self.router_bias is None else self.router_bias[...]
        experts_BTk, gates_BTk, slot_BTk, tokens_per_expert_BE, balance_B = route(self.router[...], x_BTD, cfg, bias_E)
        B, T, _ = x_BTD.shape
        C = expert_capacity(cfg)
        fill_BE = jnp.zeros_like(tokens_per_expert_BE) if fill_BE is None else fill_BE
        kept_BTk = fill_BE[jnp.arange(B)[:, None, None], experts_BTk] + slot_BTk < C
        # A kept choice's place in this call's queue is below C and below T: buffers of min(C, T) slots hold
        # every kept one, so a one-token decode step computes one slot per expert, not C.
        n_slots = min(C, T)
        w = {name: getattr(self, name)[...] for name in ("expert_up", "expert_down")}
        y_BTkD = axes.engine.routed_experts(w, x_BTD, experts_BTk, jnp.where(kept_BTk, slot_BTk, n_slots), n_slots,
                                            cfg, axes)
        # Kept by the remat: the gates' gradient needs them, and replaying them runs the experts again.
        y_BTkD = axes.engine.keep(y_BTkD, EXPERT_OUTPUTS)
        out_BTD = jnp.einsum("btkd,btk->btd", jnp.where(kept_BTk[..., None], y_BTkD, 0.0).astype(jnp.float32),
                             gates_BTk)
        if self.shared_up is not None:
            # Guide: the shared experts' output is added (the guide's MoE returns the routed part alone).
            # The shared experts as one FFN of n_shared F hidden units (the same sum, in one pair of GEMMs).
            n_shared, D, f = self.shared_up[...].shape
            shared_up_Df = jnp.moveaxis(self.shared_up[...], 0, 1).reshape(D, n_shared * f)
            out_BTD = out_BTD + ffn(x_BTD, shared_up_Df, self.shared_down[...].reshape(n_shared * f, D), "btd,df->btf",
                                    axes.engine.mm)
        out_BTD = branch_sum(out_BTD, axes, dtype)                                   # one psum, as in MLA
        stats = {"balance": jnp.sum(balance_B), "tokens_per_expert": jnp.sum(tokens_per_expert_BE, axis=0),
                 "dropped": jnp.sum(~kept_BTk).astype(jnp.float32)}
        return out_BTD, stats, fill_BE + tokens_per_expert_BE


def dropout(x_BTD, rate, key, seq_ids_B):
    """Inverted dropout whose mask depends only on (key, global sequence id), so any mesh (and any
    micro-batching) draws the same mask for the same sequence."""
    def one(x_TD, seq):
        keep = jax.random.bernoulli(jax.random.fold_in(key, seq), 1.0 - rate, x_TD.shape)
        # A product, not where(keep, x, 0): the scan over layers hoisted where's zeros out as a full [B, T, D]
        # array that every layer then read. Same values.
        return x_TD / (1.0 - rate) * keep
    return jax.vmap(one)(x_BTD, seq_ids_B)


class Layer(nnx.Module):
    """One pre-norm residual layer: MLA, then a FeedForward (dense layers, with RoPE) or a MoE (the block's
    last layer, NoPE)."""

    def __init__(self, cfg, rngs, use_moe, router_bias=False):
        self.attn_norm = RMSNorm(cfg.model_dimension, rngs)
        self.attn = MLA(cfg, rngs, use_rope=not use_moe)
        self.ffn_norm = RMSNorm(cfg.model_dimension, rngs)
        self.ffn = None if use_moe else FeedForward(cfg, rngs)
        self.moe = MoE(cfg, rngs, router_bias) if use_moe else None
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, ctx, cache=None):
        """Returns (x, MoE stats (None in a dense layer), new cache). cache (generate.init_caches): {"attn":
        the latent KV cache, "expert_fill": MoE layers' fill counts}."""
        cfg = self.cfg
        attn_cache, fill_BE = (None, None) if cache is None else (cache["attn"], cache.get("expert_fill"))

        def residual(x_BTD, branch_BTD, i):
            # The branch comes in the matmul dtype, as Megatron's; the residual stream stays fp32.
            branch_BTD = branch_BTD.astype(x_BTD.dtype)
            if ctx["train"] and cfg.dropout_rate:
                branch_BTD = dropout(branch_BTD, cfg.dropout_rate, jax.random.fold_in(ctx["key"], i), ctx["seq_ids"])
            return x_BTD + branch_BTD

        attn_BTD, attn_cache = self.attn(self.attn_norm(x_BTD), positions_T, axes, attn_cache)
        x_BTD = residual(x_BTD, attn_BTD, 0)
        h_BTD = self.ffn_norm(x_BTD)
        new_cache = {"attn": attn_cache}
        if self.moe is not None:
            ffn_BTD, stats, new_cache["expert_fill"] = self.moe(h_BTD, axes, fill_BE)
        else:
            ffn_BTD, stats = self.ffn(h_BTD, axes), None
        return residual(x_BTD, ffn_BTD, 1), stats, None if cache is None else new_cache


class Block(nnx.Module):
    """layers_per_block layers: the dense RoPE layers (stacked, scanned), then one MoE NoPE layer."""

    def __init__(self, cfg, rngs, router_bias=False):
        dense_layer = lambda rngs: Layer(cfg, rngs, use_moe=False)
        # --layers_per_block 1: every layer MoE, and no empty stack of dense ones to checkpoint
        n_dense = cfg.layers_per_block - 1
        self.dense = stacked(dense_layer, n_dense, DENSE_LAYERS, rngs) if n_dense else None
        self.moe = Layer(cfg, rngs, use_moe=True, router_bias=router_bias)
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, ctx, cache=None):
        """Returns x, this block's MoE stats and its updated cache (None without one). ctx["layer_keys"]: each
        layer's dropout key, in layer order (`Transformer.run_blocks`)."""
        def dense(layer, x_BTD, inputs):
            key, cache_l = inputs
            x_BTD, _, cache_l = layer(x_BTD, positions_T, axes, ctx | {"key": key}, cache_l)
            return x_BTD, cache_l

        n_dense, keys = self.cfg.layers_per_block - 1, ctx["layer_keys"]
        moe = lambda layer, x_BTD, cache_l: layer(x_BTD, positions_T, axes, ctx | {"key": keys[n_dense]}, cache_l)
        # Each layer is rematerialised on its own (not the block as one, which would replay the whole inner
        # scan); the engine says what each keeps and whether the dense layers' scan is unrolled.
        policy, unroll = axes.engine.layer_remat(self.cfg)
        new_cache = {}
        if self.dense is not None:
            x_BTD, new_cache["dense"] = scan_stacked(self.dense, DENSE_LAYERS, dense, x_BTD,
                                                     (keys[:n_dense], None if cache is None else cache["dense"]),
                                                     policy, unroll=unroll)
        x_BTD, stats, new_cache["moe"] = call_module(self.moe, moe, x_BTD, None if cache is None else cache["moe"],
                                                     policy)
        return x_BTD, stats, None if cache is None else new_cache


def _fold_in_each(key, n, first=0):
    """[fold_in(key, first), ..., fold_in(key, first + n - 1)]: one key per layer or block, drawn at once."""
    return jax.vmap(partial(jax.random.fold_in, key))(first + jnp.arange(n))


class Transformer(nnx.Module):
    """Embedding -> blocks (stacked on the "layers" axis, which pp splits) -> final RMSNorm; the output
    layer is the embedding table again (`output_logits`, loss.py)."""

    def __init__(self, cfg, rngs, router_bias=False):
        self.embed = Embedding(cfg, rngs)
        self.blocks = stacked(lambda rngs: Block(cfg, rngs, router_bias), cfg.blocks, LAYERS, rngs)
        self.final_norm = RMSNorm(cfg.model_dimension, rngs)
        self.cfg = cfg

    def run_blocks(self, x_BTD, positions_T, axes, ctx, first_block=0, caches=None):
        """The blocks this device holds, in a scan (compile time independent of depth), their weights read
        in the dtypes the layers compute in (engine.read_weights). Returns x, per-block MoE stats (stacked
        over blocks) and the updated caches (None without a cache)."""
        def block(block, x_BTD, inputs):
            keys_L, cache = inputs
            x_BTD, stats, cache = block(x_BTD, positions_T, axes, ctx | {"layer_keys": keys_L}, cache)
            return x_BTD, (stats, cache)

        n_blocks = jax.tree.leaves(nnx.state(self.blocks))[0].shape[0]
        # Layer i of block j drops out with fold_in(fold_in(key, j), i), j in model order: drawn here for every
        # layer, outside the scan and the layers' remat.
        keys = jax.vmap(partial(_fold_in_each, n=self.cfg.layers_per_block))(
            _fold_in_each(ctx["key"], n_blocks, first_block))
        x_BTD, (stats, caches) = scan_stacked(axes.engine.read_weights(self.blocks, self.cfg), LAYERS, block, x_BTD,
                                              (keys, caches))
        return x_BTD, stats, caches

    def __call__(self, ids_BT, axes, positions_T=None, caches=None, ctx=None):
        """On one device (axes with no mesh axis): final hidden states [B, T, D] (after the last norm), MoE
        stats and caches."""
        positions_T = jnp.arange(ids_BT.shape[1]) if positions_T is None else positions_T
        ctx = ctx or {"train": False, "key": jax.random.key(0), "seq_ids": jnp.arange(ids_BT.shape[0])}
        x_BTD = self.embed(ids_BT, axes, self.embed.gathered(axes))
        x_BTD, stats, caches = self.run_blocks(x_BTD, positions_T, axes, ctx, caches=caches)
        return self.final_norm(x_BTD), stats, caches
