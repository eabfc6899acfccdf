"""The MoE + MLA transformer, its sharding over the ("dp", "pp", "tp") mesh, the pipeline, generation.

Why plain JAX functions over a parameter pytree rather than flax modules: every weight here is
all-gathered by hand (FSDP), split by hand (tensor parallel) and scanned over a stacked block axis
that is itself sharded (pipeline). Linen checks each parameter against the shape its module declares
and NNX keeps mutable module graphs; both would put a layer of framework between the reader and the
collectives this file exists to show. So parameters are a nested dict of arrays, one table
(`LEAF_SPECS`) maps each kind to mesh axes, and the layer functions below are shared by the
single-device reference path (`Axes()` = no mesh, every collective a no-op) and the sharded path
inside one `jax.shard_map` with `check_vma=True`, which makes JAX derive the gradient reductions.

Shape suffixes: B batch (sequences), T query positions, S key positions, D model width, H heads
(local to the tp shard inside shard_map), K content head width, R rotary width, L latent width,
E experts, C expert capacity, F FFN width (local to the tp shard), V vocab (local to the tp shard).
"""
import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("dp", "pp", "tp")

# The one sharding table: parameter kind -> mesh axis of each dim ("dp" = FSDP shard, all-gathered
# just in time; "tp" = Megatron split: heads, FFN hidden units, vocab rows). Stacking prefixes are
# added by `param_specs`: ("pp",) for the block axis, then None for the dense-layer axis in a block.
LEAF_SPECS = {
    "embed": ("tp", "dp"),                 # [V, D] vocab-parallel, tied with the output projection
    "scale": (None,), "shift": (None,),    # RMSNorm, replicated
    "w_dq": ("dp", None),                  # [D, Lq]   down to the query latent
    "w_dkv": ("dp", None),                 # [D, Lkv]  down to the KV latent (the cache)
    "w_kr": ("dp", None),                  # [D, R]    the rotary key shared by all heads
    "w_uq": ("dp", "tp"),                  # [Lq, H*K]
    "w_qr": ("dp", "tp"),                  # [Lq, H*R] per-head rotary query
    "w_uk": ("dp", "tp"),                  # [Lkv, H*K]
    "w_uv": ("dp", "tp"),                  # [Lkv, H*K]
    "w_o": ("tp", "dp"),                   # [H*K, D]
    "w_up": ("dp", "tp"), "w_down": ("tp", "dp"),                      # dense FFN [D, F], [F, D]
    "router": ("dp", None),                                            # [D, E]
    "router_bias": (None,),                # [E] routing state, not trained: see with_router_bias
    "expert_up": (None, "dp", "tp"), "expert_down": (None, "tp", "dp"),  # [E, D, F], [E, F, D]
    "shared_up": (None, "dp", "tp"), "shared_down": (None, "tp", "dp"),  # [n_shared, D, F], ...
}
STACK_PREFIX = {"blocks": ("pp",), "dense": (None,)}
MATRICES = {name for name, spec in LEAF_SPECS.items() if len(spec) >= 2}
# Kept in fp32 inside the layer too: norms (cheap) and the router (top-k decisions are brittle).
KEEP_FP32 = {"scale", "shift", "router", "router_bias"}
NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Axes:
    """Mesh axis names the layer code runs under; all None on the single-device reference path."""
    dp: str | None = None
    pp: str | None = None
    tp: str | None = None


SHARDED = Axes(*MESH_AXES)


def _psum(x, axis):
    return x if axis is None else lax.psum(x, axis)


def _index(axis):
    return 0 if axis is None else lax.axis_index(axis)


def _vary_like(arrays, others):
    """`arrays` cast to vary over every mesh axis any of `others` varies over (inside shard_map;
    a no-op outside it)."""
    axes = frozenset().union(*map(_varying_axes, others))

    def cast(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x
    return tuple(map(cast, arrays))


def _varying_axes(x):
    """The mesh axes x varies over (check_vma's type). JAX 0.10 keeps them in the aval's
    manual_axis_type; earlier releases called the same set `vma`."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else aval.vma


# ----------------------------------------------------------------------------------------------
# Parameters: shapes, init, specs, counts


def param_shapes(cfg):
    """Global shape of every parameter, as a nested dict mirroring the params."""
    D, H, K, R, F = cfg.model_dimension, cfg.n_head, cfg.head_dim, cfg.dhR, cfg.ffn_dim
    Lq, Lkv, E, Bk, n_dense = cfg.q_latent_dim, cfg.latent_dim, cfg.n_experts, cfg.blocks, cfg.layers_per_block - 1
    norm = {"scale": (D,), "shift": (D,)}

    def attention(rope):
        shapes = {"w_dq": (D, Lq), "w_dkv": (D, Lkv), "w_uq": (Lq, H * K), "w_uk": (Lkv, H * K),
                  "w_uv": (Lkv, H * K), "w_o": (H * K, D)}
        return shapes | ({"w_qr": (Lq, H * R), "w_kr": (D, R)} if rope else {})

    dense = {"attn_norm": norm, "attn": attention(True), "ffn_norm": norm, "ffn": {"w_up": (D, F), "w_down": (F, D)}}
    moe = {"attn_norm": norm, "attn": attention(False), "ffn_norm": norm,
           "moe": {"router": (D, E), "expert_up": (E, D, F), "expert_down": (E, F, D),
                   "shared_up": (cfg.n_shared, D, F), "shared_down": (cfg.n_shared, F, D)}}
    stack = lambda tree, *lead: jax.tree.map(lambda s: (*lead, *s), tree, is_leaf=lambda s: isinstance(s, tuple))
    return {"embed": (cfg.padded_vocab, D), "final_norm": norm,
            "blocks": {"dense": stack(dense, Bk, n_dense), "moe": stack(moe, Bk)}}


def _leaf_name(path):
    return path[-1].key


def init_params(cfg, key):
    """fp32 parameters with global shapes. The values depend only on (cfg, key), not on any mesh."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    # Output projections of each residual branch start smaller so the residual stream's variance
    # does not grow with depth (GPT-2's scheme).
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)

    def init(path, shape, k):
        name = _leaf_name(path)
        if name == "scale":
            return jnp.ones(shape, jnp.float32)
        if name == "shift":
            return jnp.zeros(shape, jnp.float32)
        std = out_std if name in ("w_o", "w_down", "expert_down", "shared_down") else 0.02
        if name == "embed":
            # Guide: nn.Embed's default, std 1/sqrt(D). At 0.02 a row the data rarely moves enters the
            # first RMSNorm at RMS 0.02, which scales its gradient by 1/RMS = 50: one sequence opening
            # with such tokens gave 20-30x the median grad norm (spikes.py).
            std = cfg.model_dimension ** -0.5
        w = std * jax.random.normal(k, shape, jnp.float32)
        if name == "embed":  # padding rows are never looked up and their logits are masked: keep them 0
            w = jnp.where(jnp.arange(shape[0])[:, None] < cfg.vocab_size, w, 0.0)
        return w

    return jax.tree_util.tree_unflatten(treedef, [init(p, s, k) for (p, s), k in zip(leaves, keys)])


def param_specs(params):
    """PartitionSpec of every parameter: the stacking prefix of its position plus LEAF_SPECS."""
    def spec(path, _):
        prefix = tuple(a for entry in path for a in STACK_PREFIX.get(getattr(entry, "key", None), ()))
        return P(*prefix, *LEAF_SPECS[_leaf_name(path)])
    return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(params, mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params))


def init_sharded_params(cfg, key, mesh):
    """init_params computed directly into the mesh layout (no host ever holds the full model)."""
    abstract = jax.eval_shape(partial(init_params, cfg), key)
    return jax.jit(partial(init_params, cfg), out_shardings=param_shardings(abstract, mesh))(key)


def decay_mask(params):
    """True for the leaves AdamW decays: matrices, not norm scales and shifts."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_name(path) in MATRICES, params)


def table_mask(params):
    """True for the tied embedding / output table, the one leaf with its own Adam epsilon (spikes.py)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_name(path) == "embed", params)


def count_params(cfg):
    """total: every real parameter (padding rows excluded); active: those one token uses, without the
    embedding (the guide's convention); embedding: the tied table."""
    shapes = param_shapes(cfg)
    size = lambda tree: sum(math.prod(s) for s in jax.tree.leaves(tree, is_leaf=lambda s: isinstance(s, tuple)))
    embedding = cfg.vocab_size * cfg.model_dimension
    body = size(shapes["blocks"]) + size(shapes["final_norm"])
    routed = size({k: shapes["blocks"]["moe"]["moe"][k] for k in ("expert_up", "expert_down")})
    active = body - routed + routed * cfg.k // cfg.n_experts
    return {"total": body + embedding, "active": active, "embedding": embedding}


def flops_per_token(cfg):
    """Training FLOPs per token: 6 x (active params + the output projection V x D), plus causal
    attention 3 x T x H x (2K + R) per layer (QK^T over K+R channels and AV over K, forward 2 FLOPs a
    multiply-add, backward twice the forward, half the positions masked). Bubbles and remat excluded."""
    matmul = 6 * (count_params(cfg)["active"] + cfg.vocab_size * cfg.model_dimension)
    n_rope = cfg.blocks * (cfg.layers_per_block - 1)
    attn = 3 * cfg.T * cfg.n_head * (2 * cfg.head_dim * cfg.n_layers + cfg.dhR * n_rope)
    return float(matmul + attn)


# ----------------------------------------------------------------------------------------------
# Layers. Activations are fp32 in the residual stream; matmuls run in cfg.model_dtype.


def fetch(weights, axes, dtype):
    """This layer's weights in the matmul dtype (KEEP_FP32 leaves in fp32) and, under FSDP,
    all-gathered over dp just in time (`gather_over_dp`)."""
    def one(path, w):
        spec = LEAF_SPECS[_leaf_name(path)]
        w_dtype = w.dtype if _leaf_name(path) in KEEP_FP32 else dtype
        if axes.dp is None or "dp" not in spec:
            return w.astype(w_dtype)
        return gather_over_dp(w, w_dtype, axes.dp, spec.index("dp"))
    return jax.tree_util.tree_map_with_path(one, weights)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_over_dp(w, dtype, dp, axis):
    """A weight shard cast to dtype, then all-gathered: [.., D/dp, ..] fp32 -> [.., D, ..] dtype
    (casting first halves the bytes a bf16 gather moves). Its gradient is reduce-scattered back in
    fp32, as Megatron does: the plain transpose would sum the dp bf16 cotangents in bf16."""
    return lax.all_gather(w.astype(dtype), dp, axis=axis, tiled=True)


def _gather_over_dp_fwd(w, dtype, dp, axis):
    return gather_over_dp(w, dtype, dp, axis), None


def _gather_over_dp_bwd(dtype, dp, axis, _, g):
    # [.., D, ..] dtype -> fp32 -> summed over dp, each rank keeping its own slice: [.., D/dp, ..] fp32
    return (lax.psum_scatter(g.astype(jnp.float32), dp, scatter_dimension=axis, tiled=True),)


gather_over_dp.defvjp(_gather_over_dp_fwd, _gather_over_dp_bwd)


def _operands(dtype, *arrays):
    """Operands rounded to the matmul dtype. XLA:CPU has no bf16 x bf16 -> fp32 dot, so there the
    rounded values are widened back to fp32: the same numbers, accumulated in fp32 as on GPU/TPU."""
    rounded = [a.astype(dtype) for a in arrays]
    return [a.astype(jnp.float32) for a in rounded] if jax.default_backend() == "cpu" else rounded


def matmul(x, w, spec):
    """einsum of operands rounded to the weights' dtype, accumulated and returned in fp32."""
    return jnp.einsum(spec, *_operands(w.dtype, x, w), preferred_element_type=jnp.float32)


def rms_norm(p, x):
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * p["scale"] + p["shift"]


def rope(x, positions, base):
    """Rotate channel pairs (i, i + R/2) of x[..., T, (heads,) R] by position x frequency. Queries and
    keys call this with the same R, hence the same frequency table."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freq                       # [T, R/2]
    if x.ndim == 4:                                                             # [B, T, H, R]
        angle = angle[:, None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attention(w, x_BTD, positions_T, cfg, axes, cache=None):
    """Multi-head latent attention (DeepSeek-V2) with decoupled RoPE when w has w_qr/w_kr.

    Keys and values are up-projected from the KV latent c_kv; with a cache, c_kv and the rotated
    shared key are written at `positions_T` and attention runs over every cached position."""
    K, R = cfg.head_dim, cfg.dhR
    use_rope = "w_qr" in w
    B, T, _ = x_BTD.shape
    c_q_BTL = matmul(x_BTD, w["w_dq"], "btd,dl->btl")
    c_kv_BTL = matmul(x_BTD, w["w_dkv"], "btd,dl->btl")
    q_BTHK = matmul(c_q_BTL, w["w_uq"], "btl,lf->btf").reshape(B, T, -1, K)
    new_cache = {"c_kv": c_kv_BTL}
    if use_rope:
        q_rope_BTHR = rope(matmul(c_q_BTL, w["w_qr"], "btl,lf->btf").reshape(B, T, -1, R), positions_T, cfg.rope_base)
        new_cache["k_rope"] = rope(matmul(x_BTD, w["w_kr"], "btd,dr->btr"), positions_T, cfg.rope_base)
    if cache is None:
        kv, key_positions_S = new_cache, positions_T
    else:
        kv = {name: lax.dynamic_update_slice_in_dim(cache[name], new_cache[name].astype(cache[name].dtype),
                                                    positions_T[0], axis=1) for name in cache}
        new_cache, key_positions_S = kv, jnp.arange(kv["c_kv"].shape[1])
    H = q_BTHK.shape[2]
    k_BSHK = matmul(kv["c_kv"], w["w_uk"], "bsl,lf->bsf").reshape(B, -1, H, K)
    v_BSHK = matmul(kv["c_kv"], w["w_uv"], "bsl,lf->bsf").reshape(B, -1, H, K)
    if use_rope:
        # Decoupled RoPE: append the rotary parts to the content parts so that one dot product
        # gives q_C.k_C + q_R.k_R, the shared rotary key repeated for every head.
        k_rope_BSHR = jnp.broadcast_to(kv["k_rope"][:, :, None, :], (*k_BSHK.shape[:3], R))
        q_BTHK = jnp.concatenate([q_BTHK, q_rope_BTHR], axis=-1)
        k_BSHK = jnp.concatenate([k_BSHK, k_rope_BSHR], axis=-1)
    mask_TS = None if cache is None else key_positions_S[None, :] <= positions_T[:, None]
    out_BTHK = attend(q_BTHK, k_BSHK, v_BSHK, mask_TS, w["w_uk"].dtype)
    # Each tp rank holds H/tp heads: its W_o rows give a partial sum of the output.
    out_BTD = matmul(out_BTHK.reshape(B, T, -1), w["w_o"], "btf,fd->btd")
    return _psum(out_BTD, axes.tp), (new_cache if cache is not None else None)


CUDNN_MAX_HEAD_DIM = 256


def attend(q_BTHQ, k_BSHQ, v_BSHK, mask_TS, dtype):
    """softmax(q.k / sqrt(Q)) v with an fp32 softmax; causal (mask_TS=None: query t sees keys <= t) or
    under mask_TS. On GPU in bf16 with a head width cuDNN accepts, its fused kernel through
    jax.nn.dot_product_attention; it needs one width for q, k and v, so v is zero-padded from K to
    Q = K + R and the padding sliced off. Elsewhere the plain einsums, which XLA fuses well enough."""
    Q, K = q_BTHQ.shape[-1], v_BSHK.shape[-1]
    if jax.default_backend() == "gpu" and dtype == jnp.bfloat16 and Q <= CUDNN_MAX_HEAD_DIM and Q % 8 == 0:
        v_BSHQ = jnp.pad(v_BSHK, ((0, 0), (0, 0), (0, 0), (0, Q - K)))
        out_BTHQ = jax.nn.dot_product_attention(
            *(a.astype(dtype) for a in (q_BTHQ, k_BSHQ, v_BSHQ)), is_causal=mask_TS is None,
            mask=None if mask_TS is None else mask_TS[None, None], implementation="cudnn")
        return out_BTHQ[..., :K].astype(jnp.float32)
    scores_BHTS = jnp.einsum("bthq,bshq->bhts", *_operands(dtype, q_BTHQ, k_BSHQ),
                             preferred_element_type=jnp.float32) / math.sqrt(Q)
    if mask_TS is None:
        mask_TS = jnp.tril(jnp.ones((q_BTHQ.shape[1], k_BSHQ.shape[1]), bool))
    probs_BHTS = jax.nn.softmax(jnp.where(mask_TS, scores_BHTS, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshk->bthk", *_operands(dtype, probs_BHTS, v_BSHK), preferred_element_type=jnp.float32)


def ffn(w_up, w_down, x_BTD):
    """d -> 4d -> d with GELU; under tp each rank holds F/tp hidden units and returns a partial sum."""
    return matmul(jax.nn.gelu(matmul(x_BTD, w_up, "btd,df->btf")), w_down, "btf,fd->btd")


def expert_capacity(cfg):
    """Slots per expert per sequence: ceil(capacity_factor * k * T / E), counting all k choices, with
    T the padded length (cfg.T) whatever the length of one call (1 in cached decode); capacity_factor
    0 means dropless (an expert can receive each token at most once: T slots)."""
    if cfg.capacity_factor == 0:
        return cfg.T
    return min(cfg.T, math.ceil(cfg.capacity_factor * cfg.k * cfg.T / cfg.n_experts))


def route(router_DE, x_BTD, cfg, bias_E=None):
    """Sigmoid top-k routing of each sequence (the routing group, so drops do not depend on the mesh).
    With DeepSeek-V3's aux-loss-free bias_E, the k experts are chosen on score + bias; the gates and
    the balance loss's P_i still come from the scores alone.

    Returns expert ids and gates [B, T, k], each choice's place in its expert's queue of this call
    (tokens in order, a token's k choices in rank order), and the sequence-wise balance loss terms."""
    E, k = cfg.n_experts, cfg.k
    # fp32 operands at full precision: on TPU the default precision would be one bf16 pass.
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), router_DE.astype(jnp.float32),
                            precision=lax.Precision.HIGHEST)
    scores_BTE = jax.nn.sigmoid(logits_BTE)
    _, experts_BTk = lax.top_k(scores_BTE if bias_E is None else scores_BTE + bias_E, k)
    top_scores_BTk = jnp.take_along_axis(scores_BTE, experts_BTk, axis=-1)
    gates_BTk = top_scores_BTk / jnp.sum(top_scores_BTk, axis=-1, keepdims=True)
    B, T, _ = x_BTD.shape
    chosen_BNE = jax.nn.one_hot(experts_BTk, E, dtype=jnp.int32).reshape(B, T * k, E)
    slot_BTk = jnp.sum((jnp.cumsum(chosen_BNE, axis=1) - 1) * chosen_BNE, axis=-1).reshape(B, T, k)
    tokens_per_expert_BE = jnp.sum(chosen_BNE, axis=1)
    # DeepSeek-V3 sequence-wise balance: f_i = E/(kT) * tokens routed to i, P_i = mean_t s_i / sum_j s_j.
    f_BE = E / (k * T) * tokens_per_expert_BE
    p_BE = jnp.mean(scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True), axis=1)
    balance_B = jnp.sum(f_BE * p_BE, axis=-1)
    return experts_BTk, gates_BTk, slot_BTk, tokens_per_expert_BE, balance_B


def experts_in_buffers(w, x_BTD, experts_BTk, slot_BTk, C):
    """Each expert's output for each choice [B, T, k, D], computed on per-expert buffers of C slots
    per sequence: kept choices are scattered into their slot, dropped ones (slot C) fall off
    (mode="drop")."""
    B, T, k = experts_BTk.shape
    b_BTk = jnp.broadcast_to(jnp.arange(B)[:, None, None], experts_BTk.shape)
    x_BTkD = jnp.broadcast_to(x_BTD[:, :, None, :], (B, T, k, x_BTD.shape[-1]))
    buffer_BECD = jnp.zeros((B, w["expert_up"].shape[0], C, x_BTD.shape[-1]), x_BTD.dtype)
    buffer_BECD = buffer_BECD.at[b_BTk, experts_BTk, slot_BTk].set(x_BTkD, mode="drop")
    h_BECF = jax.nn.gelu(matmul(buffer_BECD, w["expert_up"], "becd,edf->becf"))
    y_BECD = matmul(h_BECF, w["expert_down"], "becf,efd->becd")
    return y_BECD[b_BTk, experts_BTk, jnp.minimum(slot_BTk, C - 1)]


def experts_ragged(w, x_BTD, experts_BTk, slot_BTk, C):
    """The same outputs from a grouped matmul: choices sorted by expert (dropped ones, slot C, last,
    in no group) and multiplied by their expert's weights with lax.ragged_dot; no capacity padding."""
    B, T, k = experts_BTk.shape
    E = w["expert_up"].shape[0]
    expert_N = jnp.where(slot_BTk < C, experts_BTk, E).reshape(-1)                  # N = B T k choices
    order_N = jnp.argsort(expert_N, stable=True)
    group_sizes_E = jnp.sum(jax.nn.one_hot(expert_N, E, dtype=jnp.int32), axis=0)
    x_ND = x_BTD.reshape(B * T, -1)[order_N // k]

    def grouped(lhs, rhs):
        lhs, rhs = _operands(w["expert_up"].dtype, lhs, rhs)
        return lax.ragged_dot(lhs, rhs, group_sizes_E, preferred_element_type=jnp.float32)
    y_ND = grouped(jax.nn.gelu(grouped(x_ND, w["expert_up"])), w["expert_down"])
    return jnp.zeros_like(y_ND).at[order_N].set(y_ND).reshape(B, T, k, -1)


MOE_IMPLS = {"buffers": experts_in_buffers, "ragged": experts_ragged}


def moe(w, x_BTD, cfg, axes, fill_BE=None):
    """Routed experts plus shared experts, added. Under tp every rank routes the same tokens and holds
    F/tp hidden units of every expert, so one psum completes routed and shared outputs together.

    fill_BE: tokens each sequence queued per expert in earlier calls (cached decode); they come
    first in the queue, so a token is kept or dropped as in one call over the whole sequence.
    Returns the output, the stats and the fill counts after this call."""
    experts_BTk, gates_BTk, place_BTk, tokens_per_expert_BE, balance_B = route(w["router"], x_BTD, cfg,
                                                                              w.get("router_bias"))
    B, T, _ = x_BTD.shape
    C = expert_capacity(cfg)
    fill_BE = jnp.zeros_like(tokens_per_expert_BE) if fill_BE is None else fill_BE
    kept_BTk = fill_BE[jnp.arange(B)[:, None, None], experts_BTk] + place_BTk < C
    # A kept choice's place in this call's queue is below C and below T: buffers of min(C, T) slots
    # hold every kept one, so a one-token decode step computes one slot per expert, not C.
    n_slots = min(C, T)
    y_BTkD = MOE_IMPLS[cfg.moe_impl](w, x_BTD, experts_BTk, jnp.where(kept_BTk, place_BTk, n_slots), n_slots)
    routed_BTD = jnp.einsum("btkd,btk->btd", jnp.where(kept_BTk[..., None], y_BTkD, 0.0), gates_BTk)
    shared_BTD = sum(ffn(w["shared_up"][i], w["shared_down"][i], x_BTD) for i in range(cfg.n_shared))
    out_BTD = _psum(routed_BTD + shared_BTD, axes.tp)
    stats = {"balance": jnp.sum(balance_B), "tokens_per_expert": jnp.sum(tokens_per_expert_BE, axis=0),
             "dropped": jnp.sum(~kept_BTk).astype(jnp.float32)}
    return out_BTD, stats, fill_BE + tokens_per_expert_BE


def with_router_bias(params, router_bias):
    """params with DeepSeek-V3's aux-loss-free routing bias (router_bias [blocks, E]) beside each MoE
    layer's router, where `moe` reads it. It is routing state, not a parameter: the driver keeps it
    out of the optimizer and differentiates the params alone."""
    moe_layers = params["blocks"]["moe"]
    moe_layers = moe_layers | {"moe": moe_layers["moe"] | {"router_bias": router_bias}}
    return params | {"blocks": params["blocks"] | {"moe": moe_layers}}


def update_router_bias(router_bias, tokens_per_expert, rate):
    """DeepSeek-V3's aux-loss-free balancing, after an optimizer step: each expert's bias [blocks, E]
    moves by rate x sign(mean load of its layer's experts - its load), loads being the routed choices
    of the step's whole global batch [blocks, E]. sign(mean - c_i) = sign(sum_j c_j - E c_i), kept in
    integers: exact, hence the same on every mesh."""
    E = tokens_per_expert.shape[-1]
    below_mean = jnp.sum(tokens_per_expert, axis=-1, keepdims=True) - E * tokens_per_expert
    return router_bias + rate * jnp.sign(below_mean).astype(router_bias.dtype)


def dropout(x_BTD, rate, key, seq_ids_B):
    """Inverted dropout whose mask depends only on (key, global sequence id), so any mesh (and any
    micro-batching) draws the same mask for the same sequence."""
    def one(x_TD, seq):
        keep = jax.random.bernoulli(jax.random.fold_in(key, seq), 1.0 - rate, x_TD.shape)
        return jnp.where(keep, x_TD / (1.0 - rate), 0.0)
    return jax.vmap(one)(x_BTD, seq_ids_B)


def layer(w, x_BTD, positions_T, cfg, axes, ctx, cache=None):
    """One pre-norm residual layer: attention, then FFN or MoE. Returns (x, MoE stats, new cache).
    cache (`init_caches`): {"attn": the latent KV cache, "expert_fill": MoE layers' fill counts}."""
    w = fetch(w, axes, jnp.dtype(cfg.model_dtype))
    residual = lambda x, branch, i: x + (dropout(branch, cfg.dropout_rate, jax.random.fold_in(ctx["key"], i),
                                                 ctx["seq_ids"]) if ctx["train"] and cfg.dropout_rate else branch)
    attn_BTD, attn_cache = attention(w["attn"], rms_norm(w["attn_norm"], x_BTD), positions_T, cfg, axes,
                                     None if cache is None else cache["attn"])
    x_BTD = residual(x_BTD, attn_BTD, 0)
    h_BTD = rms_norm(w["ffn_norm"], x_BTD)
    new_cache = {"attn": attn_cache}
    if "moe" in w:
        ffn_BTD, stats, new_cache["expert_fill"] = moe(w["moe"], h_BTD, cfg, axes,
                                                       None if cache is None else cache["expert_fill"])
    else:
        ffn_BTD, stats = _psum(ffn(w["ffn"]["w_up"], w["ffn"]["w_down"], h_BTD), axes.tp), None
    return residual(x_BTD, ffn_BTD, 1), stats, None if cache is None else new_cache


REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def run_blocks(blocks, x_BTD, positions_T, cfg, axes, ctx, first_block=0, caches=None):
    """Scan over stacked blocks (compile time independent of depth), each rematerialised; inside a
    block, scan over its dense RoPE layers, then its MoE NoPE layer. Returns x, per-block MoE stats
    (stacked over blocks) and the updated caches (None without a cache)."""
    def block(x_BTD, inputs):
        w, index, cache = inputs
        ctx_b = ctx | {"key": jax.random.fold_in(ctx["key"], index)}

        def dense(x_BTD, layer_inputs):
            w_l, i, cache_l = layer_inputs
            ctx_l = ctx_b | {"key": jax.random.fold_in(ctx_b["key"], i)}
            x_BTD, _, cache_l = layer(w_l, x_BTD, positions_T, cfg, axes, ctx_l, cache_l)
            return x_BTD, cache_l

        n_dense = cfg.layers_per_block - 1
        x_BTD, dense_cache = lax.scan(dense, x_BTD, (w["dense"], jnp.arange(n_dense),
                                                     None if cache is None else cache["dense"]))
        ctx_m = ctx_b | {"key": jax.random.fold_in(ctx_b["key"], n_dense)}
        x_BTD, stats, moe_cache = layer(w["moe"], x_BTD, positions_T, cfg, axes, ctx_m,
                                        None if cache is None else cache["moe"])
        return x_BTD, (stats, None if cache is None else {"dense": dense_cache, "moe": moe_cache})

    if cfg.remat != "none":
        block = jax.checkpoint(block, policy=REMAT_POLICIES[cfg.remat])
    n_blocks = jax.tree.leaves(blocks)[0].shape[0]
    x_BTD, (stats, caches) = lax.scan(block, x_BTD, (blocks, first_block + jnp.arange(n_blocks), caches))
    return x_BTD, stats, caches


def _table(params, cfg, axes):
    """The tied embedding / output table in the matmul dtype, gathered over dp: [V/tp, D]."""
    return fetch({"embed": params["embed"]}, axes, jnp.dtype(cfg.model_dtype))["embed"]


def embed(table_VD, ids_BT, axes):
    """Vocab-parallel lookup: each tp rank holds rows [start, start + V) and contributes zeros for
    ids outside them; the psum over tp assembles the embedding."""
    V = table_VD.shape[0]
    local_BT = ids_BT - _index(axes.tp) * V
    inside_BT = (local_BT >= 0) & (local_BT < V)
    x_BTD = jnp.where(inside_BT[..., None], table_VD[jnp.clip(local_BT, 0, V - 1)].astype(jnp.float32), 0.0)
    return _psum(x_BTD, axes.tp)


def logits_local(table_VD, h_BTD, cfg, axes):
    """fp32 logits of this tp rank's vocab rows, padding rows masked to -inf."""
    V = table_VD.shape[0]
    logits_BTV = matmul(h_BTD, table_VD, "btd,vd->btv")
    vocab_ids_V = _index(axes.tp) * V + jnp.arange(V)
    return jnp.where(vocab_ids_V < cfg.vocab_size, logits_BTV, -jnp.inf)


def cross_entropy_sum(table_VD, h_BTD, targets_BT, cfg, axes):
    """Summed cross-entropy with the vocab split over tp (Megatron's parallel softmax), a chunk of
    whole sequences at a time. Per chunk each rank reduces its vocab rows to three numbers per token
    (`_vocab_softmax_stats`); the ranks then combine maxima, rescaled sums of exponentials and the
    target logit, which exactly one rank holds. No fp32 logits outlive one chunk, in the forward or
    the backward pass (which recomputes them): memory is O(chunk x V/tp) whatever the batch."""
    V, dtype = table_VD.shape[0], table_VD.dtype
    vocab_start = _index(axes.tp) * V
    n_real = jnp.clip(cfg.vocab_size - vocab_start, 0, V)          # rows past the real vocab are padding
    table_VD = _operands(dtype, table_VD)[0]                         # rounded (on CPU widened) once, not per chunk
    local_targets_BT = targets_BT - vocab_start
    # A custom_vjp must hand back cotangents typed like its inputs, and the table's gradient varies
    # over every axis the tokens do (and the tokens' over tp). Casting both to the union first
    # makes JAX put the reductions in the cast's transpose: psum over dp/pp for the table (on top of
    # FSDP's reduce-scatter), over tp for the hidden states.
    table_VD, h_BTD = _vary_like((table_VD, h_BTD), (table_VD, h_BTD, local_targets_BT, n_real))

    def one(h_TD, y_T):                                             # T: the chunk's tokens
        local_max_T, sum_exp_T, target_T = _vocab_softmax_stats(dtype, table_VD, h_TD, y_T, n_real)
        local_max_T = lax.stop_gradient(local_max_T)
        max_T = local_max_T if axes.tp is None else lax.pmax(local_max_T, axes.tp)
        sum_exp_T = _psum(sum_exp_T * jnp.exp(local_max_T - max_T), axes.tp)
        return jnp.sum(max_T + jnp.log(sum_exp_T) - _psum(target_T, axes.tp))

    B, T, D = h_BTD.shape
    n = B // _sequences_per_chunk(B, T)
    with jax.named_scope("output_layer"):
        _, sums = lax.scan(lambda _, inputs: (None, one(*inputs)), None,
                           (h_BTD.reshape(n, -1, D), local_targets_BT.reshape(n, -1)))
    return jnp.sum(sums)


def _sequences_per_chunk(B, T, min_tokens=128):
    """Whole sequences per cross-entropy chunk: the fewest (dividing B) that make min_tokens. Below
    ~128 tokens XLA:CPU's vocab-sized matmuls lose efficiency; above it memory grows for no speed."""
    return next(g for g in range(1, B + 1) if B % g == 0 and (g * T >= min_tokens or g == B))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _vocab_softmax_stats(dtype, table_VD, h_TD, local_targets_T, n_real):
    """Over this rank's vocab rows [0, n_real) of a table already rounded for the matmul dtype
    (`_operands`): per token the max logit m, sum_v exp(logit_v - m), and the target's logit (0 when
    another rank holds the target). m gets no gradient: the loss does not depend on it. The
    backward pass recomputes the logits rather than keeping [V, T] floats per chunk."""
    return _softmax_stats_fwd(dtype, table_VD, h_TD, local_targets_T, n_real)[0]


_dot32 = partial(jnp.einsum, preferred_element_type=jnp.float32)


def _exp_logits_VT(dtype, table_VD, h_TD, n_real, max_T=None):
    """exp(logits - max) [V, T], 0 on padding rows, and the max. Vocab-major: XLA:CPU runs the
    backward's products with it up to 2x faster than with token-major [T, V] (BENCHMARKS.md)."""
    logits_VT = _dot32("vd,td->vt", table_VD, _operands(dtype, h_TD)[0])
    real_V1 = (jnp.arange(table_VD.shape[0]) < n_real)[:, None]
    if max_T is None:
        max_T = jnp.max(jnp.where(real_V1, logits_VT, -jnp.inf), axis=0)
    return jnp.where(real_V1, jnp.exp(logits_VT - max_T), 0.0), max_T


def _target_rows(table_VD, local_targets_T, n_real):
    """Each token's target row of the table, and whether this rank holds it."""
    inside_T = (local_targets_T >= 0) & (local_targets_T < n_real)
    return inside_T, table_VD[jnp.clip(local_targets_T, 0, table_VD.shape[0] - 1)]


def _softmax_stats_fwd(dtype, table_VD, h_TD, local_targets_T, n_real):
    exp_VT, max_T = _exp_logits_VT(dtype, table_VD, h_TD, n_real)
    inside_T, rows_TD = _target_rows(table_VD, local_targets_T, n_real)
    target_T = jnp.where(inside_T, _dot32("td,td->t", rows_TD, _operands(dtype, h_TD)[0]), 0.0)
    return (max_T, jnp.sum(exp_VT, axis=0), target_T), (table_VD, h_TD, local_targets_T, n_real, max_T)


def _softmax_stats_bwd(dtype, residuals, cotangents):
    """d logit[v, t] = g_sum[t] exp(logit[v, t] - m[t]) + g_target[t] [v is t's target]. The g_sum
    scaling is applied on the [T, D] side of both products, so the recomputed exponentials are the
    only [V, T] array."""
    table_VD, h_TD, local_targets_T, n_real, max_T = residuals
    _, g_sum_T, g_target_T = cotangents
    exp_VT = _operands(dtype, _exp_logits_VT(dtype, table_VD, h_TD, n_real, max_T)[0])[0]
    inside_T, rows_TD = _target_rows(table_VD, local_targets_T, n_real)
    g_target_T = jnp.where(inside_T, g_target_T, 0.0)
    d_h_TD = (g_sum_T[:, None] * _dot32("vd,vt->td", table_VD, exp_VT)
              + g_target_T[:, None] * rows_TD.astype(jnp.float32))
    d_table_VD = _dot32("vt,td->vd", exp_VT, _operands(dtype, h_TD * g_sum_T[:, None])[0])
    d_table_VD = d_table_VD.at[jnp.clip(local_targets_T, 0, table_VD.shape[0] - 1)].add(
        g_target_T[:, None] * _operands(dtype, h_TD)[0].astype(jnp.float32))
    return d_table_VD.astype(table_VD.dtype), d_h_TD.astype(h_TD.dtype), None, None


_vocab_softmax_stats.defvjp(_softmax_stats_fwd, _softmax_stats_bwd)


def _summarise(ce_sum, stats, n_tokens, n_sequences, cfg):
    """Loss and metrics from sums over the global batch: mean CE plus, as DeepSeek-V3 and Megatron,
    alpha x the balance loss of every MoE layer (averaged over sequences), summed over the layers.
    Per MoE layer (one per block): that balance term [blocks], the routed choices each expert
    received before capacity drops [blocks, E] (integers, so exact on every mesh) and the fraction of
    the k x tokens choices dropped [blocks]."""
    ce = ce_sum / n_tokens
    balance = cfg.alpha * stats["balance"] / n_sequences
    metrics = {"ce": ce, "balance": balance, "tokens_per_expert": stats["tokens_per_expert"],
               "drop_rate": stats["dropped"] / (n_tokens * cfg.k)}
    return ce + jnp.sum(balance), metrics


# ----------------------------------------------------------------------------------------------
# The single-device reference: the ground truth for every mesh, and the path generation uses.


def forward(params, ids_BT, cfg, positions_T=None, caches=None, ctx=None):
    """Final hidden states [B, T, D] (after the last norm), MoE stats and caches; no mesh."""
    axes = Axes()
    positions_T = jnp.arange(ids_BT.shape[1]) if positions_T is None else positions_T
    ctx = ctx or {"train": False, "key": jax.random.key(0), "seq_ids": jnp.arange(ids_BT.shape[0])}
    x_BTD = embed(_table(params, cfg, axes), ids_BT, axes)
    x_BTD, stats, caches = run_blocks(params["blocks"], x_BTD, positions_T, cfg, axes, ctx, caches=caches)
    return rms_norm(params["final_norm"], x_BTD), stats, caches


def reference_loss_and_metrics(params, x_BT, y_BT, key, cfg, train=True):
    ctx = {"train": train, "key": key, "seq_ids": jnp.arange(x_BT.shape[0])}
    h_BTD, stats, _ = forward(params, x_BT, cfg, ctx=ctx)
    ce_sum = cross_entropy_sum(_table(params, cfg, Axes()), h_BTD, y_BT, cfg, Axes())
    return _summarise(ce_sum, stats, x_BT.size, x_BT.shape[0], cfg)


# ----------------------------------------------------------------------------------------------
# The sharded path: one shard_map over ("dp", "pp", "tp") with a GPipe schedule over pp.


def _pipeline_loss(params, x_BT, y_BT, key, cfg, n_micro, train):
    """Runs on one device with its shards: x_BT is this dp replica's [b, T] tokens (all pp/tp ranks of
    the replica hold the same rows); params["blocks"] holds this stage's B/pp blocks."""
    axes = SHARDED
    n_stages, stage = lax.axis_size("pp"), lax.axis_index("pp")
    b, T = x_BT.shape
    M, mb = n_micro, b // n_micro
    positions_T = jnp.arange(T)
    table_VD = _table(params, cfg, axes)                                      # [V/tp, D/dp] -> [V/tp, D]
    x_MbT, y_MbT = x_BT.reshape(M, mb, T), y_BT.reshape(M, mb, T)
    emb_MbTD = embed(table_VD, x_MbT, axes)                                   # [M, mb, T, D]
    blocks_per_stage = jax.tree.leaves(params["blocks"])[0].shape[0]
    seq_base = lax.axis_index("dp") * b

    def tick(carry, t):
        """Every stage works on one micro-batch: stage s on micro-batch t - s (a bubble when outside
        [0, M): computed on stale data and masked out of every sum)."""
        received_bTD, outputs_MbTD, stats_sum = carry
        m = t - stage
        valid = (m >= 0) & (m < M)
        m_clipped = jnp.clip(m, 0, M - 1)
        x_bTD = jnp.where(stage == 0, emb_MbTD[jnp.minimum(t, M - 1)], received_bTD)
        ctx = {"train": train, "key": key, "seq_ids": seq_base + m_clipped * mb + jnp.arange(mb)}
        y_bTD, stats, _ = run_blocks(params["blocks"], x_bTD, positions_T, cfg, axes, ctx,
                                     first_block=stage * blocks_per_stage)
        stats_sum = jax.tree.map(lambda acc, s: acc + jnp.where(valid, s, 0), stats_sum, stats)
        # The last stage files finished micro-batches; other stages keep their buffer at zero.
        keep = (stage == n_stages - 1) & valid
        outputs_MbTD = outputs_MbTD.at[m_clipped].set(jnp.where(keep, y_bTD, outputs_MbTD[m_clipped]))
        # Stage s -> s + 1. Non-cyclic: stage 0 receives zeros (it reads the embeddings instead).
        received_bTD = lax.ppermute(y_bTD, "pp", [(s, s + 1) for s in range(n_stages - 1)])
        return (received_bTD, outputs_MbTD, stats_sum), None

    # Carries differ per dp replica and per stage: declare them varying over both for check_vma.
    zeros = lambda shape, dtype=jnp.float32: lax.pcast(jnp.zeros(shape, dtype), ("dp", "pp"), to="varying")
    stats_sum = {"balance": zeros((blocks_per_stage,)), "dropped": zeros((blocks_per_stage,)),
                 "tokens_per_expert": zeros((blocks_per_stage, cfg.n_experts), jnp.int32)}
    init = (zeros(emb_MbTD.shape[1:]), zeros(emb_MbTD.shape), stats_sum)
    (_, outputs_MbTD, stats), _ = lax.scan(tick, init, jnp.arange(M + n_stages - 1))
    # Only the last stage holds real outputs; a reduce-scatter over pp hands each stage M/pp of them,
    # so the (large-vocab) output layer's work is split over the stages: [M, mb, T, D] -> [M/pp, ...].
    mine_MbTD = lax.psum_scatter(outputs_MbTD, "pp", scatter_dimension=0, tiled=True)
    targets_MbT = lax.dynamic_slice_in_dim(y_MbT, stage * (M // n_stages), M // n_stages)
    h_MbTD = rms_norm(params["final_norm"], mine_MbTD)
    ce_sum = lax.psum(cross_entropy_sum(table_VD, h_MbTD.reshape(-1, T, h_MbTD.shape[-1]), targets_MbT.reshape(-1, T),
                                        cfg, axes), ("dp", "pp"))
    # Per-block stats: stage s has blocks [s B/pp, (s+1) B/pp); gather them in order, sum over dp.
    stats = {name: lax.psum(lax.all_gather(s, "pp", axis=0, tiled=True, to="invarying"), "dp")
             for name, s in stats.items()}
    n_dp = lax.axis_size("dp")
    return _summarise(ce_sum, stats, x_BT.size * n_dp, b * n_dp, cfg)


def physical_order(device):
    """Sort key: host first, then the chip's position (z, y, x) and core on a TPU; id elsewhere."""
    coords = getattr(device, "coords", None)
    place = (*reversed(coords), getattr(device, "core_on_chip", 0)) if coords is not None else (device.id,)
    return (device.process_index, *place)


def make_mesh(shape, devices=None):
    """The ("dp", "pp", "tp") mesh over dp*pp*tp devices, real or an ahead-of-time TPU topology's.

    Devices are taken host by host, each host's in physical order, and laid out with tp fastest:
    so a pp x tp plane whose size divides a host's device count sits on one host (on a v4 host's
    2 x 2 chips, tp pairs along x and pp pairs along y are direct neighbours) and only dp crosses
    hosts, as in the guide's figure. jax.make_mesh instead insists on not splitting physical axes,
    which (8, 2, 2) on v4-64's 2 x 4 x 4 chips cannot satisfy. Auto axes: outside shard_map XLA
    propagates shardings (optimizer, generation); inside it every collective is written out."""
    ordered = sorted(jax.devices() if devices is None else devices, key=physical_order)[:math.prod(shape)]
    if len(ordered) < math.prod(shape):
        raise ValueError(f"mesh {tuple(shape)} needs {math.prod(shape)} devices, {len(ordered)} available")
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    return jax.sharding.Mesh(grid.reshape(tuple(shape)), MESH_AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)


def axes_across_hosts(mesh):
    """Mesh axis names along which neighbouring devices belong to different processes (hosts)."""
    hosts = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return [name for i, name in enumerate(mesh.axis_names) if np.any(np.diff(hosts, axis=i) != 0)]


def loss_and_metrics(params, x_BT, y_BT, key, cfg, mesh, n_micro, train=True):
    """Loss (cross-entropy + balance) and metrics of a global batch on `mesh`; differentiable in params."""
    x_BT, y_BT = (lax.with_sharding_constraint(a, NamedSharding(mesh, P("dp"))) for a in (x_BT, y_BT))
    metric_specs = {"ce": P(), "balance": P(), "tokens_per_expert": P(), "drop_rate": P()}
    sharded = jax.shard_map(partial(_pipeline_loss, cfg=cfg, n_micro=n_micro, train=train), mesh=mesh,
                            in_specs=(param_specs(params), P("dp"), P("dp"), P()),
                            out_specs=(P(), metric_specs), check_vma=True)
    return sharded(params, x_BT, y_BT, key)


# ----------------------------------------------------------------------------------------------
# Generation with the latent KV cache (only c_kv and the rotated shared key are stored).


def init_caches(cfg, batch, length, dtype=jnp.float32):
    """Per layer, stacked like the params: the attention cache (the KV latent, plus the rotated
    shared key in RoPE layers) and in MoE layers each sequence's tokens queued per expert so far."""
    n_dense = cfg.layers_per_block - 1
    latent = lambda *lead: jnp.zeros((*lead, batch, length, cfg.latent_dim), dtype)
    return {"dense": {"attn": {"c_kv": latent(cfg.blocks, n_dense),
                               "k_rope": jnp.zeros((cfg.blocks, n_dense, batch, length, cfg.dhR), dtype)}},
            "moe": {"attn": {"c_kv": latent(cfg.blocks)},
                    "expert_fill": jnp.zeros((cfg.blocks, batch, cfg.n_experts), jnp.int32)}}


def _sample(logits_V, key, top_k, temperature):
    values, ids = lax.top_k(logits_V / temperature, top_k)
    return ids[jax.random.categorical(key, values)]


@partial(jax.jit, static_argnames=("cfg", "n_total", "top_k", "use_cache"))
def _decode(params, cfg, tokens_T, n_prompt, key, n_total, top_k, temperature, use_cache):
    """Fill tokens_T[n_prompt:n_total] one position at a time. Returns tokens and the fp32 logits
    (real vocab) that chose each position. The cached path feeds one token per step; the uncached
    path recomputes the whole prefix each step. Both draw position p with fold_in(key, p)."""
    table = _table(params, cfg, Axes())
    T = tokens_T.shape[0]

    def logits_at(h_D):
        return logits_local(table, h_D[None, None], cfg, Axes())[0, 0, :cfg.vocab_size]

    def step(carry, p):
        tokens_T, caches = carry
        if use_cache:
            h_1TD, _, caches = forward(params, tokens_T[p][None, None], cfg, positions_T=p[None], caches=caches)
            logits_V = logits_at(h_1TD[0, 0])
        else:
            h_1TD, _, _ = forward(params, tokens_T[None], cfg)
            logits_V = logits_at(h_1TD[0, p])
        chosen = _sample(logits_V, jax.random.fold_in(key, p + 1), top_k, temperature)
        write = p + 1 >= n_prompt
        tokens_T = tokens_T.at[p + 1].set(jnp.where(write, chosen, tokens_T[p + 1]))
        return (tokens_T, caches), logits_V

    caches = init_caches(cfg, 1, T) if use_cache else None
    (tokens_T, _), logits_PV = lax.scan(step, (tokens_T, caches), jnp.arange(n_total - 1))
    return tokens_T, logits_PV


def generate(params, cfg, prompt_ids, key, max_tokens, top_k, temperature, use_cache=True, return_logits=False):
    """Sample max_tokens new ids after prompt_ids (top-k, temperature); the prompt plus the new tokens
    must fit in the context T. Returns the new ids (and the logits that chose them)."""
    n_prompt = len(prompt_ids)
    if n_prompt < 1 or n_prompt + max_tokens > cfg.T:
        raise ValueError(f"prompt ({n_prompt} tokens) + --max_tokens ({max_tokens}) must be between 1 and --T "
                         f"({cfg.T}); shorten --prompt or lower --max_tokens")
    tokens_T = jnp.zeros((cfg.T,), jnp.int32).at[:n_prompt].set(jnp.asarray(prompt_ids, jnp.int32))
    tokens_T, logits_PV = _decode(params, cfg, tokens_T, n_prompt, key, n_prompt + max_tokens, min(top_k, cfg.vocab_size),
                                  temperature, use_cache)
    new = [int(t) for t in tokens_T[n_prompt:n_prompt + max_tokens]]
    return (new, logits_PV[n_prompt - 1:]) if return_logits else new
