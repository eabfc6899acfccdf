"""The guide's model as flax.nnx modules, in its order: RMSNorm, Embedding, RoPE, MLA, FeedForward, the MoE
layer (router, capacity, balance loss, aux-loss-free bias), Layer, Block, Transformer. Plain math, every
collective written out; each __call__ takes the mesh axes it runs under (`collectives.Axes`, all None on one
device) and calls the engine (axes.engine: engine/) at its seams. Every weight is an nnx.Param with logical axes
that sharding.py maps to the mesh. Shape suffixes: docs/model.md's legend (B sequences, T and S query and key
positions, D width, H heads, K, J and R content, value and rotary width per head, Q = K + R, L latent, F FFN,
V vocabulary, E experts, k per token, C slots; lowercase: this shard's part).
"""
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from collectives import axis_index, psum, tp_sum, vary_like
from stacking import LayerLoop, keys_of, remat_call, scan_stacked, stacked, variable

NORM_EPS = 1e-6
# the logical names of the stacking axes: the blocks, a block's dense layers, the dense layers before the blocks
LAYERS, DENSE_LAYERS, PROLOGUE = "layers", "dense_layers", "prologue_layers"
# What the modules name for the remat policies: a branch's all-reduce, the experts' outputs, an FFN's up-projection.
BRANCH_SUM, EXPERT_OUTPUTS, FFN_HIDDEN = "branch_sum", "expert_outputs", "ffn_hidden"


class RouterBias(nnx.Variable):
    """DeepSeek-V3's aux-loss-free routing bias [E]: routing state set by the driver, never trained."""


_normal, _ones, _zeros = jax.nn.initializers.normal, jax.nn.initializers.ones, jax.nn.initializers.zeros


def _output_std(cfg):
    """Each residual branch's output projection starts smaller: the stream's variance does not grow with depth."""
    return 0.02 / math.sqrt(2 * cfg.n_layers)


class RMSNorm(nnx.Module):
    def __init__(self, D, rngs, shift=True):
        self.scale = variable(rngs, _ones, (D,), "norm")
        # Guide: a learned shift besides the scale; DeepSeek-V3's has none (--norm_shift false).
        self.shift = variable(rngs, _zeros, (D,), "norm") if shift else None

    def __call__(self, x):
        """Statistics, scale and shift in fp32."""
        x = x.astype(jnp.float32)
        x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * self.scale[...]
        return x if self.shift is None else x + self.shift[...]


def vocab_start(axes, v):
    """Vocab-parallel: tp rank r holds the table's rows of vocabulary ids [r v, (r+1) v)."""
    return axis_index(axes.tp) * v


def vocab_table(rngs, cfg, std):
    """A [V, D] table drawn with std. Guide: V padded (cfg.padded_vocab) so that a checkpoint restores on any
    tp; the padding rows are never looked up and their logits are masked: they stay 0."""
    def init(key, shape):
        real_V1 = (jnp.arange(shape[0]) < cfg.vocab_size)[:, None]
        return jnp.where(real_V1, _normal(std)(key, shape), 0.0)
    return variable(rngs, init, (cfg.padded_vocab, cfg.model_dimension), "vocab", "embed")


class Embedding(nnx.Module):
    """The token table [V, D], tied with the output projection: vocab-parallel (each tp rank holds v = V/tp
    rows), split over D for FSDP and gathered once for the lookup and the output layer (`gathered`)."""

    def __init__(self, cfg, rngs):
        # Guide: nn.Embed's default, std 1/sqrt(D); at 0.02 a rarely seen row spiked (docs/training.md).
        self.table = vocab_table(rngs, cfg, cfg.model_dimension ** -0.5)
        self.cfg = cfg

    def gathered(self, axes):                                        # [v, D/dp] -> [v, D] (engine/fsdp.py)
        return axes.engine.gathered(self.table, axes, jnp.dtype(self.cfg.model_dtype))

    def __call__(self, ids_BT, axes, table_vD):
        # Guide: all_to_all; Megatron's vocab-parallel lookup here: each tp rank's own rows (others 0), one psum.
        v = table_vD.shape[0]
        local_BT = ids_BT - vocab_start(axes, v)
        inside_BT = (local_BT >= 0) & (local_BT < v)
        x_BTD = jnp.where(inside_BT[..., None], table_vD[jnp.clip(local_BT, 0, v - 1)], 0.0)
        return psum(x_BTD, axes.tp)


def output_logits(h_BTD, table_vD, cfg, axes):
    """The output layer's fp32 logits of this tp rank's vocab rows, padding rows at -inf (loss.py)."""
    v = table_vD.shape[0]
    logits_BTv = axes.engine.mm("btd,vd->btv", h_BTD, table_vD, cfg.model_dtype)
    vocab_ids_v = vocab_start(axes, v) + jnp.arange(v)
    return jnp.where(vocab_ids_v < cfg.vocab_size, logits_BTv, -jnp.inf)


def rope(x, positions, base):
    """Rotate channel pairs (i, i + R/2) of x[..., T, (heads,) R] by position x frequency."""
    # Guide: one frequency table over R for queries and keys (the guide's query uses dhR x heads channels).
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freq                       # [T, R/2]
    angle = angle[:, None, :] if x.ndim == 4 else angle                         # x [B, T, h, R]: every head's
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def decoupled_rope_qk(q_BThK, k_BShK, rotary, dtype):
    """q = [q_C; q_R], k = [k_C; k_R] from rotary = (q_R, the one rotary key k_R [B, S, R]), or None (NoPE: Q = K):
    one dot product gives q_C.k_C + q_R.k_R. k_R is repeated for every head and rounded after the cast to varying
    over tp (which concatenate would insert): its cotangent's psum over tp and sum over heads stay fp32."""
    if rotary is None:
        return q_BThK, k_BShK
    (q_rope_BThR, k_rope_BSR), R = rotary, rotary[1].shape[-1]
    k_rope_BShR, = vary_like((jnp.broadcast_to(k_rope_BSR[:, :, None, :], (*k_BShK.shape[:3], R)),), (k_BShK,))
    k_rope_BShR = k_rope_BShR.astype(dtype)
    return (jnp.concatenate([q_BThK, q_rope_BThR.astype(dtype)], axis=-1),
            jnp.concatenate([k_BShK, k_rope_BShR], axis=-1))


def masked_attention(q_BThQ, k_BShQ, v_BShJ, mask_TS, dtype, mm):
    """softmax(q.k / sqrt(Q)) v, query t seeing the keys s where mask_TS[t, s]; the softmax in fp32."""
    scores_BhTS = mm("bthq,bshq->bhts", q_BThQ, k_BShQ, dtype) / math.sqrt(q_BThQ.shape[-1])
    probs_BhTS = jax.nn.softmax(jnp.where(mask_TS, scores_BhTS, -jnp.inf), axis=-1)
    return mm("bhts,bshj->bthj", probs_BhTS, v_BShJ, dtype, dtype)


def branch_sum(x_BTD, axes, dtype):
    """A branch's tp partial sums added in the matmul dtype (`tp_sum`), named for the remat to keep, not recompute."""
    # Guide: Megatron tensor parallelism, one psum over tp per branch (the guide: all_to_all + psum_scatter).
    out_BTD = tp_sum(x_BTD, axes.tp, dtype)
    return out_BTD if axes.tp is None or lax.axis_size(axes.tp) == 1 else axes.engine.keep(out_BTD, BRANCH_SUM)


class MLA(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2), with decoupled RoPE where use_rope (the guide: in the dense
    layers, none (NoPE) in the MoE layers). Under tp each rank holds h = H/tp heads."""

    def __init__(self, cfg, rngs, use_rope):
        D, Lq, Lkv = cfg.model_dimension, cfg.q_latent_dim, cfg.latent_dim
        HK, HJ, HR = cfg.n_head * cfg.head_dim, cfg.n_head * cfg.value_dim, cfg.n_head * cfg.dhR
        self.w_dq = variable(rngs, _normal(0.02), (D, Lq), "embed", "q_latent")     # down to the query latent
        self.w_dkv = variable(rngs, _normal(0.02), (D, Lkv), "embed", "kv_latent")  # down to the KV latent (the cache)
        # DeepSeek-V3 normalises both latents (--latent_norm); the guide does not.
        self.q_norm, self.kv_norm = ((RMSNorm(Lq, rngs, cfg.norm_shift), RMSNorm(Lkv, rngs, cfg.norm_shift))
                                     if cfg.latent_norm else (None, None))
        self.w_uq = variable(rngs, _normal(0.02), (Lq, HK), "q_latent", "heads")
        self.w_uk = variable(rngs, _normal(0.02), (Lkv, HK), "kv_latent", "heads")
        self.w_uv = variable(rngs, _normal(0.02), (Lkv, HJ), "kv_latent", "heads")
        self.w_o = variable(rngs, _normal(_output_std(cfg)), (HJ, D), "heads", "embed")
        if use_rope:
            self.w_qr = variable(rngs, _normal(0.02), (Lq, HR), "q_latent", "heads")  # per-head rotary query
            self.w_kr = variable(rngs, _normal(0.02), (D, cfg.dhR), "embed", "rope")  # one rotary key for all heads
        self.use_rope = use_rope
        self.cfg = cfg

    def down_projections(self, x_BTD, mm, dtype):
        """x's query latent c_q, KV latent c_kv and shared rotary key (unrotated; [B, T, 0] in a NoPE layer): the
        guide's three parameters in one product in the matmul dtype, x read once, its gradient out of one GEMM."""
        down = (self.w_dq, self.w_dkv) + ((self.w_kr,) if self.use_rope else ())
        fused = mm("btd,dl->btl", x_BTD, jnp.concatenate([w[...] for w in down], axis=1), dtype, dtype)
        Lq, L = self.cfg.q_latent_dim, self.cfg.latent_dim
        return jnp.split(fused, [Lq, Lq + L], -1)                            # [B, T, Lq + L (+ R)] -> three

    def __call__(self, x_BTD, positions_T, axes, cache=None):
        """Keys and values up-projected from the KV latent c_kv; with a cache, c_kv and the rotated shared key
        are written at `positions_T`, attention runs over every cached position. Returns (out, new cache)."""
        cfg, dtype, mm = self.cfg, jnp.dtype(self.cfg.model_dtype), axes.engine.mm
        (K, J, R), (B, T, _) = (cfg.head_dim, cfg.value_dim, cfg.dhR), x_BTD.shape
        c_q_BTL, c_kv_BTL, k_rope_BTR = self.down_projections(x_BTD, mm, dtype)
        c_q_BTL = c_q_BTL if self.q_norm is None else self.q_norm(c_q_BTL)
        q_BThK = mm("btl,lf->btf", c_q_BTL, self.w_uq[...], dtype, dtype).reshape(B, T, -1, K)
        kv = {"c_kv": c_kv_BTL}                  # what attention reads: this call's, or the cache updated with it
        if self.use_rope:
            # Rotated in fp32 from the product in the matmul dtype, as Megatron rotates its q.
            q_rope_BThR = rope(mm("btl,lf->btf", c_q_BTL, self.w_qr[...], dtype, dtype).reshape(B, T, -1, R),
                               positions_T, cfg.rope_base)
            kv["k_rope"] = rope(k_rope_BTR, positions_T, cfg.rope_base)
        if cache is not None:
            kv = {name: lax.dynamic_update_slice_in_dim(cache[name], kv[name].astype(cache[name].dtype),
                                                        positions_T[0], axis=1) for name in cache}
            key_positions_S = jnp.arange(kv["c_kv"].shape[1])
        c_kv_BSL = kv["c_kv"] if self.kv_norm is None else self.kv_norm(kv["c_kv"])     # the cache holds it unnormed
        k_BShK = mm("bsl,lf->bsf", c_kv_BSL, self.w_uk[...], dtype, dtype).reshape(*c_kv_BSL.shape[:2], -1, K)
        v_BShJ = mm("bsl,lf->bsf", c_kv_BSL, self.w_uv[...], dtype, dtype).reshape(*c_kv_BSL.shape[:2], -1, J)
        rotary = (q_rope_BThR, kv["k_rope"]) if self.use_rope else None                  # NoPE: Q = K
        mask_TS = None if cache is None else key_positions_S[None, :] <= positions_T[:, None]
        out_BThJ = axes.engine.attention(q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype)
        # Each tp rank holds h heads: its W_o rows give a partial sum of the output.
        out_BTD = mm("btf,fd->btd", out_BThJ.reshape(B, T, -1), self.w_o[...], dtype, dtype)
        return branch_sum(out_BTD, axes, dtype), None if cache is None else kv


def ffn(x, w_up, w_down, up_spec, mm, keep=None, w_gate=None):
    """The feed-forward of the dense layers and every expert: up-projection, GELU (with w_gate DeepSeek-V3's
    SiLU(x w_gate) x (x w_up)) in fp32 rounded back, down-projection: this tp rank's f hidden units' partial sum
    in the matmul dtype. up_spec: the up-projection's einsum; keep: tags its output for the remat."""
    dtype = w_up.dtype
    hidden = (keep or (lambda hidden: hidden))(mm(up_spec, x, w_up, dtype, dtype))
    if w_gate is None:
        hidden = jax.nn.gelu(hidden.astype(jnp.float32)).astype(dtype)
    else:
        gate = jax.nn.silu(mm(up_spec, x, w_gate, dtype, jnp.float32))
        hidden = (gate * hidden.astype(jnp.float32)).astype(dtype)
    return mm(up_spec.translate(str.maketrans("df", "fd")), hidden, w_down, dtype, dtype)


class FeedForward(nnx.Module):
    """The dense FFN, d -> 4d -> d with GELU (or gated, --ffn gated_silu); under tp each rank holds f = F/tp
    hidden units."""

    def __init__(self, cfg, rngs):
        D, F = cfg.model_dimension, cfg.ffn_dim
        self.w_gate = variable(rngs, _normal(0.02), (D, F), "embed", "mlp") if cfg.ffn == "gated_silu" else None
        self.w_up = variable(rngs, _normal(0.02), (D, F), "embed", "mlp")
        self.w_down = variable(rngs, _normal(_output_std(cfg)), (F, D), "mlp", "embed")
        self.cfg = cfg

    def __call__(self, x_BTD, axes):
        keep_hidden = partial(axes.engine.keep, name=FFN_HIDDEN)
        w_gate = None if self.w_gate is None else self.w_gate[...]
        out_BTD = ffn(x_BTD, self.w_up[...], self.w_down[...], "btd,df->btf", axes.engine.mm, keep_hidden, w_gate)
        return branch_sum(out_BTD, axes, jnp.dtype(self.cfg.model_dtype))          # one psum, as in MLA


def expert_capacity(cfg):
    """Slots per expert per sequence, T the padded length whatever one call's (cached decode's 1)."""
    # Guide: capacity counts all k choices, per sequence (the guide's is B T factor / E over the batch).
    if cfg.capacity_factor == 0:                                    # dropless
        return cfg.T
    return min(cfg.T, math.ceil(cfg.capacity_factor * cfg.k * cfg.T / cfg.n_experts))


class Routing(NamedTuple):
    """Where each token's k choices go (`route`)."""
    experts_BTk: jax.Array             # expert ids
    gates_BTk: jax.Array               # each choice's weight in the token's output
    slot_BTk: jax.Array                # its place in its expert's queue (tokens in order, a token's choices by rank)
    tokens_per_expert_BE: jax.Array    # the choices each expert received, before capacity drops


def route(router_DE, x_BTD, cfg, bias_E=None):
    """Sigmoid top-k routing of each sequence (the routing group: drops do not depend on the mesh), with
    DeepSeek-V3's aux-loss-free bias_E added to choose (the gates and P_i use the scores alone). Returns the
    Routing and, apart, the sequence-wise balance loss terms [B]."""
    E, k = cfg.n_experts, cfg.k
    # In fp32 at full precision (on a TPU the default is one bf16 pass): top-k flips on rounded scores.
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), router_DE.astype(jnp.float32),
                            precision=lax.Precision.HIGHEST)
    scores_BTE = jax.nn.sigmoid(logits_BTE)
    _, experts_BTk = lax.top_k(scores_BTE if bias_E is None else scores_BTE + bias_E, k)
    top_scores_BTk = jnp.take_along_axis(scores_BTE, experts_BTk, axis=-1)
    gates_BTk = (top_scores_BTk / jnp.sum(top_scores_BTk, axis=-1, keepdims=True) if cfg.renormalize_gates
                 else top_scores_BTk)
    if cfg.routed_scaling != 1:                                     # DeepSeek-V3's routed_scaling_factor
        gates_BTk = gates_BTk * cfg.routed_scaling
    B, T, _ = x_BTD.shape
    chosen_BNE = jax.nn.one_hot(experts_BTk, E, dtype=jnp.int32).reshape(B, T * k, E)   # N = T k choices
    slot_BTk = jnp.sum((jnp.cumsum(chosen_BNE, axis=1) - 1) * chosen_BNE, axis=-1).reshape(B, T, k)
    tokens_per_expert_BE = jnp.sum(chosen_BNE, axis=1)
    # Guide: DeepSeek-V3's sequence-wise balance loss, sum_i f_i P_i, in every MoE layer, summed over the layers.
    f_BE = E / (k * T) * tokens_per_expert_BE
    p_BE = jnp.mean(scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True), axis=1)
    balance_B = jnp.sum(f_BE * p_BE, axis=-1)
    return Routing(experts_BTk, gates_BTk, slot_BTk, tokens_per_expert_BE), balance_B


class MoE(nnx.Module):
    """Routed plus shared experts, added. Under tp every rank routes the same tokens and holds f hidden units
    of every expert: one psum completes both. router_bias: DeepSeek-V3's aux-loss-free bias (not a Param)."""

    def __init__(self, cfg, rngs, router_bias=False):
        D, F, E, n_shared = cfg.model_dimension, cfg.expert_dim, cfg.n_experts, cfg.n_shared
        gated = cfg.ffn == "gated_silu"
        # Guide: the router is a matrix without a bias term.
        self.router = variable(rngs, _normal(0.02), (D, E), "embed", "score")
        self.expert_gate = variable(rngs, _normal(0.02), (E, D, F), "expert", "embed", "mlp") if gated else None
        self.expert_up = variable(rngs, _normal(0.02), (E, D, F), "expert", "embed", "mlp")
        self.expert_down = variable(rngs, _normal(_output_std(cfg)), (E, F, D), "expert", "mlp", "embed")
        # --n_shared 0: no shared experts, and no empty arrays to checkpoint
        shared = lambda init, shape, *axes: variable(rngs, init, shape, "shared", *axes) if n_shared else None
        self.shared_gate = shared(_normal(0.02), (n_shared, D, F), "embed", "mlp") if gated else None
        self.shared_up = shared(_normal(0.02), (n_shared, D, F), "embed", "mlp")
        self.shared_down = shared(_normal(_output_std(cfg)), (n_shared, F, D), "mlp", "embed")
        self.router_bias = variable(rngs, _zeros, (E,), "score", kind=RouterBias) if router_bias else None
        self.cfg = cfg

    def __call__(self, x_BTD, axes, fill_BE=None):
        """fill_BE: tokens each sequence queued per expert in earlier calls (cached decode); they come first
        in the queue, so a token is kept or dropped as in one call over the whole sequence. Returns the
        output, the stats and the fill counts after this call."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.model_dtype)
        (experts_BTk, gates_BTk, slot_BTk, tokens_per_expert_BE), balance_B = route(
            self.router[...], x_BTD, cfg, None if self.router_bias is None else self.router_bias[...])
        (B, T, _), C = x_BTD.shape, expert_capacity(cfg)
        fill_BE = jnp.zeros_like(tokens_per_expert_BE) if fill_BE is None else fill_BE
        kept_BTk = fill_BE[jnp.arange(B)[:, None, None], experts_BTk] + slot_BTk < C
        # A kept choice's place is below C and below T: min(C, T) slots (a decode step computes one, not C).
        n_slots = min(C, T)
        w = {name: getattr(self, name)[...] for name in ("expert_gate", "expert_up", "expert_down")
             if getattr(self, name) is not None}
        y_BTkD = axes.engine.routed_experts(w, x_BTD, experts_BTk, jnp.where(kept_BTk, slot_BTk, n_slots), n_slots,
                                            cfg, axes)
        # Kept by the remat: the gates' gradient needs them, and replaying them runs the experts again.
        y_BTkD = axes.engine.keep(y_BTkD, EXPERT_OUTPUTS)
        out_BTD = jnp.einsum("btkd,btk->btd", jnp.where(kept_BTk[..., None], y_BTkD, 0.0).astype(jnp.float32),
                             gates_BTk)
        if self.shared_up is not None:
            # Guide: the shared experts' output is added (the guide returns the routed part alone); as one FFN
            # of n_shared F hidden units, the same sum in one pair of GEMMs.
            n_shared, D, f = self.shared_up[...].shape
            as_one = lambda w: None if w is None else jnp.moveaxis(w[...], 0, 1).reshape(D, n_shared * f)
            up_Df, down_fD = as_one(self.shared_up), self.shared_down[...].reshape(n_shared * f, D)
            out_BTD += ffn(x_BTD, up_Df, down_fD, "btd,df->btf", axes.engine.mm, w_gate=as_one(self.shared_gate))
        out_BTD = branch_sum(out_BTD, axes, dtype)                                   # one psum, as in MLA
        stats = {"balance": jnp.sum(balance_B), "tokens_per_expert": jnp.sum(tokens_per_expert_BE, axis=0),
                 "dropped": jnp.sum(~kept_BTk).astype(jnp.float32)}
        return out_BTD, stats, fill_BE + tokens_per_expert_BE


def dropout(x_BTD, rate, key, seq_ids_B):
    """Inverted dropout, its mask a function of (key, global sequence id) alone (any mesh or micro-batching); 16 bits
    an element, words' low halves for D's first half, high for the rest (on a TPU 1.017x faster than interleaved)."""
    def one(x_TD, seq):
        (T, D), cut = x_TD.shape, round(rate * 2**16)
        words = jax.random.bits(jax.random.fold_in(key, seq), (T, (D + 1) // 2), jnp.uint32)
        bits_TD = jnp.concatenate([words & 0xFFFF, words >> 16], axis=-1)[:, :D]
        # A product, not where(keep, x, 0): the layers' scan hoisted where's zeros as a [B, T, D] array
        return x_TD / (1 - cut / 2**16) * (bits_TD >= cut)
    return jax.vmap(one)(x_BTD, seq_ids_B)


class Layer(nnx.Module):
    """One pre-norm residual layer: MLA, then a FeedForward (dense layers, with RoPE) or a MoE (the block's
    last layer, NoPE unless --rope_all_layers)."""

    def __init__(self, cfg, rngs, use_moe, router_bias=False):
        self.attn_norm = RMSNorm(cfg.model_dimension, rngs, cfg.norm_shift)
        self.attn = MLA(cfg, rngs, use_rope=not use_moe or cfg.rope_all_layers)
        self.ffn_norm = RMSNorm(cfg.model_dimension, rngs, cfg.norm_shift)
        self.ffn = None if use_moe else FeedForward(cfg, rngs)
        self.moe = MoE(cfg, rngs, router_bias) if use_moe else None
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, ctx, cache=None):
        """Returns (x, MoE stats (None in a dense layer), new cache); cache: generate.init_caches'."""
        attn_cache, fill_BE = (None, None) if cache is None else (cache["attn"], cache.get("expert_fill"))

        def residual(x_BTD, branch_BTD, i):
            # The branch comes in the matmul dtype, as Megatron's; the residual stream stays fp32.
            branch_BTD = branch_BTD.astype(x_BTD.dtype)
            rate = self.cfg.dropout_rate
            if ctx["train"] and rate:
                branch_BTD = dropout(branch_BTD, rate, jax.random.fold_in(ctx["key"], i), ctx["seq_ids"])
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
        # --layers_per_block 1: every layer MoE, and no empty stack of dense ones to checkpoint
        n_dense = cfg.layers_per_block - 1
        self.dense = stacked(partial(Layer, cfg, use_moe=False), n_dense, DENSE_LAYERS, rngs) if n_dense else None
        self.moe = Layer(cfg, rngs, use_moe=True, router_bias=router_bias)
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, ctx, cache=None):
        """Returns x, the block's MoE stats and new cache; ctx["layer_keys"]: each layer's dropout key, in order."""
        n_dense, keys = self.cfg.layers_per_block - 1, ctx["layer_keys"]
        moe = lambda layer, x_BTD, cache_l: layer(x_BTD, positions_T, axes, ctx | {"key": keys[n_dense]}, cache_l)
        # Each layer rematerialised on its own (the block as one would replay its whole inner scan): what each keeps
        loop = axes.engine.layer_loop(self.cfg, ctx["train"])     # and how the dense layers are run
        cache, new_cache = cache or {}, {}
        if self.dense is not None:
            x_BTD, new_cache["dense"] = run_dense(self.dense, DENSE_LAYERS, x_BTD, positions_T, axes, ctx, keys[:n_dense],
                                                  cache.get("dense"), loop)
        x_BTD, stats, new_cache["moe"] = remat_call(self.moe, moe, x_BTD, cache.get("moe"), loop.policy)
        return x_BTD, stats, new_cache if cache else None


def run_dense(stack, axis, x_BTD, positions_T, axes, ctx, keys, cache, loop):
    """The dense layers of `stack` (stacked on `axis`) in turn, as `loop` says, layer i dropping out with keys[i]."""
    def dense(layer, x_BTD, inputs):
        key, cache_l = inputs
        x_BTD, _, cache_l = layer(x_BTD, positions_T, axes, ctx | {"key": key}, cache_l)
        return x_BTD, cache_l
    return scan_stacked(stack, axis, dense, x_BTD, (keys, cache), loop)


class Transformer(nnx.Module):
    """Embedding -> (DeepSeek-V3's first dense layers) -> blocks (stacked on the "layers" axis, which pp
    splits) -> final RMSNorm -> the output layer, the token table again or (untied) one of its own."""

    def __init__(self, cfg, rngs, router_bias=False):
        self.embed = Embedding(cfg, rngs)
        self.prologue = (stacked(partial(Layer, cfg, use_moe=False), cfg.first_k_dense, PROLOGUE, rngs)
                         if cfg.first_k_dense else None)
        self.blocks = stacked(lambda rngs: Block(cfg, rngs, router_bias), cfg.blocks, LAYERS, rngs)
        self.final_norm = RMSNorm(cfg.model_dimension, rngs, cfg.norm_shift)
        self.unembed = None if cfg.tied_embeddings else vocab_table(rngs, cfg, 0.02)
        self.cfg = cfg

    def output_table(self, axes, table_vD):
        """The output layer's table: the lookup's gathered copy (tied: their gradients add up) or its own."""
        dtype = jnp.dtype(self.cfg.model_dtype)
        return table_vD if self.unembed is None else axes.engine.gathered(self.unembed, axes, dtype)

    def run_prologue(self, x_BTD, positions_T, axes, ctx, cache=None):
        """The dense layers before the blocks; layer i drops out with fold_in(fold_in(key, blocks), i), no block's."""
        keys = keys_of(jax.random.fold_in(ctx["key"], self.cfg.blocks), self.cfg.first_k_dense)
        return run_dense(axes.engine.read_weights(self.prologue, self.cfg), PROLOGUE, x_BTD, positions_T, axes, ctx,
                         keys, cache, axes.engine.layer_loop(self.cfg, ctx["train"]))

    def run_blocks(self, x_BTD, positions_T, axes, ctx, first_block=0, caches=None):
        """The blocks this device holds, scanned (compile time independent of depth) or apart as the layers are, in
        their weights' read dtypes. Returns x, the MoE stats stacked over blocks and the new caches (None: no cache)."""
        def block(block, x_BTD, inputs):
            layer_keys, cache = inputs
            x_BTD, stats, cache = block(x_BTD, positions_T, axes, ctx | {"layer_keys": layer_keys}, cache)
            return x_BTD, (stats, cache)

        n_blocks = jax.tree.leaves(nnx.state(self.blocks))[0].shape[0]
        # Layer i of block j drops out with fold_in(fold_in(key, j), i), drawn outside the scan and the remat.
        keys = jax.vmap(partial(keys_of, n=self.cfg.layers_per_block))(keys_of(ctx["key"], n_blocks, first_block))
        apart = axes.engine.layer_loop(self.cfg, ctx["train"]).apart
        x_BTD, (stats, caches) = scan_stacked(axes.engine.read_weights(self.blocks, self.cfg), LAYERS, block, x_BTD,
                                              (keys, caches), LayerLoop(apart=apart))
        return x_BTD, stats, caches

    def __call__(self, ids_BT, axes, positions_T=None, caches=None, ctx=None):
        """On one device: final hidden states [B, T, D] (normed), MoE stats and caches (generate.init_caches')."""
        positions_T = jnp.arange(ids_BT.shape[1]) if positions_T is None else positions_T
        ctx = ctx or {"train": False, "key": jax.random.key(0), "seq_ids": jnp.arange(ids_BT.shape[0])}
        x_BTD = self.embed(ids_BT, axes, self.embed.gathered(axes))
        caches, new_caches = caches or {}, {}
        if self.prologue is not None:
            x_BTD, new_caches["prologue"] = self.run_prologue(x_BTD, positions_T, axes, ctx, caches.get("prologue"))
        x_BTD, stats, new_caches["blocks"] = self.run_blocks(x_BTD, positions_T, axes, ctx, caches=caches.get("blocks"))
        return self.final_norm(x_BTD), stats, new_caches if caches else None
