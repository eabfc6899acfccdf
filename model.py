"""The MoE + MLA transformer as flax.nnx modules, its sharding over the ("dp", "pp", "tp") mesh, the
pipeline, generation.

Why nnx: the modules carry the guide's names (Embedding, MLA, FeedForward, MoE, Block, Transformer),
and every parameter is an `nnx.Param` that carries its logical axes ("vocab", "embed", "heads", ...).
One table, `AXIS_RULES` (led by `EXPERT_PARALLEL_RULE` under --expert_parallel), maps logical axes
to mesh axes; the PartitionSpecs (`param_specs`) and the dim each FSDP gather runs along (`fetch`)
are derived from it, and nothing else names a mesh axis for a parameter. The math and every
collective stay written out, in the modules' `__call__` and the pipeline (all-gather over dp, psum
over tp, ppermute over pp, all-to-all over dp under expert parallelism, ...), with shapes in the
names. The same modules serve the single-device reference (`Axes()` = no mesh, every collective a
no-op) and the sharded path inside one `jax.shard_map` with `check_vma=True`, which makes JAX derive
the gradient reductions.

What crosses jit, shard_map, optax and orbax is a plain nested dict of arrays (`init_params`, each
drawn by the initializer its module declared), keyed by the modules' attribute names. `nnx.merge`
rebuilds the modules from it (inside shard_map, from the local shards), and the stacked blocks run
under a visible `lax.scan` that merges one block per step. nnx.vmap builds the stacked layers (and
prepends the stacking axis to their logical axes); no nnx transform runs in the forward pass.

Shape suffixes: B batch (sequences), T query positions, S key positions, D model width, H heads
(local to the tp shard inside shard_map), K content head width, R rotary width, L latent width,
E experts (e = E/dp of them on a dp shard under expert parallelism), C expert capacity, U slots
per expert on a dp shard (expert parallelism), F FFN width (local to the tp shard), V vocab (local
to the tp shard).
"""
import math
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from experts import EXPERT_PARALLEL_IMPLS, MOE_IMPLS
from multihost import log
from sharding import (BRANCH_SUM, DENSE_LAYERS, LAYERS, REPEATS, UNBATCHED_DOT, Axes, axis_index, branch_sum,
                      einsum_fp32, fetch, gelu, matmul, mesh_spec, psum, vary_like)

NORM_EPS = 1e-6



# ----------------------------------------------------------------------------------------------
# Parameters: logical axes, stacking, the FSDP gather


class RouterBias(nnx.Variable):
    """DeepSeek-V3's aux-loss-free routing bias [E]: routing state beside a router, set by the driver
    (`with_router_bias`), never trained."""


def _variable(rngs, initializer, shape, *axes, kind=nnx.Param):
    """An nnx Variable (a Param unless told) holding initializer(key, shape), carrying its logical
    axes and its initializer (`init_params` draws the params with it). Not sharded when created
    (eager_sharding=False): the layout comes from `param_specs`, applied by jit's out_shardings and
    shard_map's in_specs."""
    return kind(initializer(rngs.params(), shape), out_sharding=axes, initializer=initializer, eager_sharding=False)


_normal, _ones, _zeros = jax.nn.initializers.normal, jax.nn.initializers.ones, jax.nn.initializers.zeros


def _output_std(cfg):
    """Output projections of each residual branch start smaller, so that the residual stream's
    variance does not grow with depth (GPT-2's scheme)."""
    return 0.02 / math.sqrt(2 * cfg.n_layers)


def _stacked(make, n, axis, rngs):
    """n independently initialised make(rngs), their parameters stacked on a new leading dim whose
    logical axis `axis` nnx.vmap prepends to each parameter's axes."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make_stacked(rngs):
        return make(rngs)
    return make_stacked(rngs)


def scan_stacked(stack, axis, body, carry, xs, policy=None, unroll=1):
    """lax.scan of body(layer, carry, x) over the layers of `stack` (a module made by `_stacked`) and
    xs: each step rebuilds one layer with nnx.merge from its slice of the stacked state, the stacking
    axis dropped from its parameters' logical axes. policy: rematerialise each step (jax.checkpoint);
    unroll: lax.scan's (True: straight-line code, no loop)."""
    graphdef, state = nnx.split(stack)

    def step(carry, inputs):
        layer_state, x = inputs
        layer = nnx.merge(graphdef, nnx.spmd.remove_axis(layer_state, 0, {nnx.PARTITION_NAME: axis}))
        return body(layer, carry, x)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy)
    return lax.scan(step, carry, (state, xs), unroll=unroll)


def call_module(module, body, x, extra, policy=None):
    """body(module, x, extra), rematerialised under policy as one scan_stacked step is."""
    if policy is None:
        return body(module, x, extra)
    graphdef, state = nnx.split(module)
    run = lambda state, x, extra: body(nnx.merge(graphdef, state), x, extra)
    return jax.checkpoint(run, policy=policy)(state, x, extra)


def rope(x, positions, base):
    """Rotate channel pairs (i, i + R/2) of x[..., T, (heads,) R] by position x frequency. Queries and
    keys call this with the same R, hence the same frequency table."""
    # Guide: one frequency table over R for queries and keys (the guide's query uses dhR x heads channels).
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freq                       # [T, R/2]
    if x.ndim == 4:                                                             # [B, T, H, R]
        angle = angle[:, None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


# The weights the layers read in fp32 whatever --model_dtype: the router, whose top-k flips on
# rounded scores. Every other weight is read in the matmul dtype.
FP32_WEIGHTS = frozenset({"router"})


def weight_dtype(name, cfg):
    """The dtype the layers read weight leaf `name` in (FSDP gathers it in that dtype)."""
    return jnp.dtype(jnp.float32 if name in FP32_WEIGHTS else cfg.model_dtype)


CUDNN_MAX_HEAD_DIM = 256
# A causal attention without cuDNN runs in up to 8 chunks of >= 128 queries (see attend): smaller
# chunks save few FLOPs and each is more to compile (tiny, T = 128, in 8: compile 12 -> 21 s on CPU).
CAUSAL_QUERY_CHUNKS, CAUSAL_MIN_CHUNK = 8, 128


def attend(q_BTHQ, k_BSHQ, v_BSHK, mask_TS, dtype, platform):
    """softmax(q.k / sqrt(Q)) v with an fp32 softmax, returned in dtype (the output projection's
    operand dtype); causal (mask_TS=None: query t sees keys <= t) or under mask_TS. For a GPU in bf16
    with a head width cuDNN accepts, its fused kernel (`cudnn_attention`); elsewhere einsums
    (`masked_attention`), causal ones a chunk of queries at a time."""
    Q = q_BTHQ.shape[-1]
    if platform == "gpu" and dtype == jnp.bfloat16 and Q <= CUDNN_MAX_HEAD_DIM and Q % 8 == 0:
        return cudnn_attention(*(a.astype(dtype) for a in (q_BTHQ, k_BSHQ, v_BSHK)), mask_TS)
    if mask_TS is not None:
        return masked_attention(q_BTHQ, k_BSHQ, v_BSHK, mask_TS, dtype)
    T = q_BTHQ.shape[1]
    n = min(CAUSAL_QUERY_CHUNKS, T // CAUSAL_MIN_CHUNK)
    if n < 1 or T % n:
        n = 1
    # Causal: query chunk i sees only the keys before its end, so the blocks above the diagonal are
    # never computed: (n + 1) / 2n of the T x T products (moe1B on v4-64: 4.91e13 -> 4.41e13 FLOPs a
    # chip). The chunks' slices of k and v add their gradients in another order: fp32 losses unchanged.
    c = T // n
    return jnp.concatenate([
        masked_attention(q_BTHQ[:, i * c:(i + 1) * c], k_BSHQ[:, :(i + 1) * c], v_BSHK[:, :(i + 1) * c],
                         jnp.arange((i + 1) * c)[None, :] <= jnp.arange(i * c, (i + 1) * c)[:, None], dtype)
        for i in range(n)], axis=1)


def cudnn_attention(q_BTHQ, k_BSHQ, v_BSHK, mask_TS):
    """cuDNN's fused attention of bf16 q, k, v, its output and softmax statistics kept for the backward
    (`keep_kernel_outputs`). MLA's v is narrower than q and k (K = Q - R): where cuDNN takes that
    (`cudnn_takes_narrow_v`) v goes in as it is, through jax's private entry (the public
    jax.nn.dot_product_attention needs one width); else it is zero-padded to Q and the padding sliced
    off (moe1B on one H200, estimated: Σ 328 -> 312 ms without the padding)."""
    Q, K = q_BTHQ.shape[-1], v_BSHK.shape[-1]
    kernel = partial(_cudnn_narrow_v if K < Q and cudnn_takes_narrow_v(Q, K) else _cudnn_padded_v, mask_TS=mask_TS)
    if mask_TS is not None:                 # cached decode: nothing to differentiate
        return kernel(q_BTHQ, k_BSHQ, v_BSHK)
    return keep_kernel_outputs(kernel, q_BTHQ, k_BSHQ, v_BSHK)


KERNEL_OUTPUTS = "kernel_outputs"     # the checkpoint name of what `keep_kernel_outputs` keeps
EXPERT_OUTPUTS = "expert_outputs"     # the checkpoint name of each kept choice's expert output (`MoE`)
FFN_HIDDEN = "ffn_hidden"             # the checkpoint name of an FFN's up-projection (`ffn`)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def keep_kernel_outputs(kernel, *operands):
    """kernel(*operands), with what its backward needs besides its operands (a fused attention's output
    and softmax statistics) named KERNEL_OUTPUTS, so that the remat policies keep it: the backward then
    runs the kernel's own backward without running its forward again (under remat the operands are
    recomputed, as every layer input is; one H200, moe1B: the replay's 48 cuDNN forwards go)."""
    return kernel(*operands)


def _keep_kernel_outputs_fwd(kernel, *operands):
    out, backward = jax.vjp(kernel, *operands)
    named_out = checkpoint_name(out, KERNEL_OUTPUTS)

    def kept(residual):
        """The operands are left to the remat to recompute, as every layer input is; the rest is kept."""
        if residual is out:
            return named_out
        return residual if any(residual is o for o in operands) else checkpoint_name(residual, KERNEL_OUTPUTS)
    return named_out, jax.tree.map(kept, backward)


def _keep_kernel_outputs_bwd(kernel, backward, g):
    return backward(g)


keep_kernel_outputs.defvjp(_keep_kernel_outputs_fwd, _keep_kernel_outputs_bwd)


def _cudnn_padded_v(q_BTHQ, k_BSHQ, v_BSHK, mask_TS):
    Q, K = q_BTHQ.shape[-1], v_BSHK.shape[-1]
    v_BSHQ = jnp.pad(v_BSHK, ((0, 0), (0, 0), (0, 0), (0, Q - K))) if K < Q else v_BSHK
    out_BTHQ = jax.nn.dot_product_attention(q_BTHQ, k_BSHQ, v_BSHQ, is_causal=mask_TS is None,
                                            mask=None if mask_TS is None else mask_TS[None, None],
                                            implementation="cudnn")
    return out_BTHQ[..., :K] if K < Q else out_BTHQ


def _cudnn_narrow_v(q_BTHQ, k_BSHQ, v_BSHK, mask_TS):
    from jax._src.cudnn import fused_attention_stablehlo as fused      # private: another jax may lack it
    return fused.dot_product_attention(
        q_BTHQ, k_BSHQ, v_BSHK, mask=None if mask_TS is None else mask_TS[None, None],
        scale=1 / math.sqrt(q_BTHQ.shape[-1]),
        mask_type=fused.MaskType.CAUSAL if mask_TS is None else fused.MaskType.NO_MASK)


@cache
def cudnn_takes_narrow_v(Q, K):
    """Whether cuDNN runs attention with v of width K < Q as it is. jax lets it through from cuDNN 9.10
    on a Hopper or newer, but only cuDNN on the GPU accepts or refuses the kernel for these widths: on
    a GPU, once per process, a small attention by the narrow kernel is run and compared with the
    padded one (`narrow_v_matches_padded`). Compiling for a GPU that is not here (`--compile_for h200`:
    cuDNN 9.28 on sm_90 from requirements-gpu-aot.txt) nothing can run: jax's own checks decide."""
    if jax.default_backend() != "gpu":
        return True
    try:
        with jax.ensure_compile_time_eval():        # concrete arrays, even while a step is being traced
            narrow = narrow_v_matches_padded(Q, K, _cudnn_narrow_v, _cudnn_padded_v)
    except Exception:        # noqa: BLE001 - whatever refuses it (cuDNN, XLA, a jax without the entry): pad
        narrow = False
    log(f"attention: cuDNN's fused kernel, v {K} wide " + ("as it is" if narrow else f"zero-padded to q's {Q} "
        "(the narrow kernel was refused or disagreed: model.cudnn_takes_narrow_v)"))
    return narrow


def narrow_v_matches_padded(Q, K, narrow, padded, T=256, H=2):
    """Whether attention `narrow`(q, k, v, mask_TS) equals `padded`'s, causal and under a mask, on
    random bf16 q, k [1, T, H, Q] and v [1, T, H, K]: the outputs and the gradients of a random
    projection of them, each to within 2% of its largest value (bf16 rounding, blocked differently)."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(key, (1, T, H, Q), jnp.bfloat16) for key in keys[:2])
    v, w = (jax.random.normal(key, (1, T, H, K), jnp.bfloat16) for key in keys[2:])
    window_TS = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]) < T // 4

    def run(attention, mask_TS):
        out, vjp = jax.vjp(lambda *qkv: attention(*qkv, mask_TS), q, k, v)
        return [np.asarray(a, np.float32) for a in (out, *vjp(w))]

    return all(np.max(np.abs(a - b)) <= 0.02 * np.max(np.abs(b)) for mask_TS in (None, window_TS)
               for a, b in zip(run(narrow, mask_TS), run(padded, mask_TS)))


def masked_attention(q_BTHQ, k_BSHQ, v_BSHK, mask_TS, dtype):
    """softmax(q.k / sqrt(Q)) v, query t seeing the keys s where mask_TS[t, s]."""
    scores_BHTS = einsum_fp32("bthq,bshq->bhts", dtype, q_BTHQ, k_BSHQ) / math.sqrt(q_BTHQ.shape[-1])
    probs_BHTS = jax.nn.softmax(jnp.where(mask_TS, scores_BHTS, -jnp.inf), axis=-1)
    return einsum_fp32("bhts,bshk->bthk", dtype, probs_BHTS, v_BSHK, dtype)


def ffn(w_up, w_down, x_BTD, name=None):
    """d -> 4d -> d with GELU; under tp each rank holds F/tp hidden units and returns a partial sum, in
    the matmul dtype as every residual branch (`Layer`)."""
    hidden_BTF = matmul(x_BTD, w_up, "btd,df->btf", w_up.dtype)
    hidden_BTF = hidden_BTF if name is None else checkpoint_name(hidden_BTF, name)
    return matmul(gelu(hidden_BTF), w_down, "btf,fd->btd", w_down.dtype)


def expert_capacity(cfg):
    """Slots per expert per sequence: ceil(capacity_factor * k * T / E), counting all k choices, with
    T the padded length (cfg.T) whatever the length of one call (1 in cached decode); capacity_factor
    0 means dropless (an expert can receive each token at most once: T slots)."""
    # Guide: capacity counts all k choices, per sequence (the guide's is B T factor / E over the batch).
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
    # Guide: DeepSeek-V3's sequence-wise balance loss in every MoE layer, summed over the layers.
    # DeepSeek-V3 sequence-wise balance: f_i = E/(kT) * tokens routed to i, P_i = mean_t s_i / sum_j s_j.
    f_BE = E / (k * T) * tokens_per_expert_BE
    p_BE = jnp.mean(scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True), axis=1)
    balance_B = jnp.sum(f_BE * p_BE, axis=-1)
    return experts_BTk, gates_BTk, slot_BTk, tokens_per_expert_BE, balance_B


def dropout(x_BTD, rate, key, seq_ids_B):
    """Inverted dropout whose mask depends only on (key, global sequence id), so any mesh (and any
    micro-batching) draws the same mask for the same sequence."""
    def one(x_TD, seq):
        keep = jax.random.bernoulli(jax.random.fold_in(key, seq), 1.0 - rate, x_TD.shape)
        # A product, not where(keep, x, 0): the scan over layers hoisted where's zeros out as a full
        # [B, T, D] array that every layer then read (moe1B on one H200: 8.7 GiB a step). Same values.
        return x_TD / (1.0 - rate) * keep
    return jax.vmap(one)(x_BTD, seq_ids_B)


# ----------------------------------------------------------------------------------------------
# Modules. Activations are fp32 in the residual stream; matmuls run in cfg.model_dtype. Each
# module's __call__ takes the mesh axes it runs under (`Axes`): none on the reference path.


class RMSNorm(nnx.Module):
    def __init__(self, D, rngs):
        self.scale = _variable(rngs, _ones, (D,), "norm")
        self.shift = _variable(rngs, _zeros, (D,), "norm")

    def __call__(self, x):
        """Statistics, scale and shift in fp32."""
        x = x.astype(jnp.float32)
        return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * self.scale[...] + self.shift[...]


class Embedding(nnx.Module):
    """The token table [V, D] tied with the output projection: vocab-parallel (each tp rank holds V/tp
    rows) and split over D for FSDP. One gathered table (`gathered`) serves the lookup and the output
    layer (`logits`, `cross_entropy_sum`), in fp32, so their gradients add up in fp32."""

    def __init__(self, cfg, rngs):
        # Guide: nn.Embed's default, std 1/sqrt(D). At 0.02 a row the data rarely moves enters the
        # first RMSNorm at RMS 0.02, which scales its gradient by 1/RMS = 50: one sequence opening
        # with such tokens gave 20-30x the median grad norm (spikes.py).
        normal = _normal(cfg.model_dimension ** -0.5)

        def init(key, shape):
            # Guide: the vocabulary is padded (cfg.padded_vocab) so that a checkpoint restores on any tp.
            # The padding rows are never looked up and their logits are masked: they stay 0.
            real_V1 = (jnp.arange(shape[0]) < cfg.vocab_size)[:, None]
            return jnp.where(real_V1, normal(key, shape), 0.0)
        self.table = _variable(rngs, init, (cfg.padded_vocab, cfg.model_dimension), "vocab", "embed")
        self.cfg = cfg

    def gathered(self, axes):
        """The table gathered over dp in the matmul dtype, [V/tp, D/dp] -> [V/tp, D], held in fp32 (the
        same values): the lookup's scatter-add, the cross-entropy's chunks and the psum over pp then sum
        its gradient in fp32, which is rounded once, where the gather's transpose takes it."""
        return fetch(self.table, axes, jnp.dtype(self.cfg.model_dtype)).astype(jnp.float32)

    def __call__(self, ids_BT, axes, table_VD=None):
        """Vocab-parallel lookup: each tp rank holds rows [start, start + V) and contributes zeros for
        ids outside them; the psum over tp assembles the embedding."""
        # Guide: the table is split over tp by vocabulary rows (Megatron's vocab-parallel embedding).
        table_VD = self.gathered(axes) if table_VD is None else table_VD
        V = table_VD.shape[0]
        local_BT = ids_BT - axis_index(axes.tp) * V
        inside_BT = (local_BT >= 0) & (local_BT < V)
        x_BTD = jnp.where(inside_BT[..., None], table_VD[jnp.clip(local_BT, 0, V - 1)], 0.0)
        return psum(x_BTD, axes.tp)

    def logits(self, h_BTD, axes, table_VD=None):
        """fp32 logits of this tp rank's vocab rows, padding rows masked to -inf."""
        table_VD = self.gathered(axes) if table_VD is None else table_VD
        V = table_VD.shape[0]
        logits_BTV = einsum_fp32("btd,vd->btv", self.cfg.model_dtype, h_BTD, table_VD)
        vocab_ids_V = axis_index(axes.tp) * V + jnp.arange(V)
        return jnp.where(vocab_ids_V < self.cfg.vocab_size, logits_BTV, -jnp.inf)


class MLA(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2), with decoupled RoPE in the dense layers (use_rope)
    and none (NoPE) in the MoE layers. Under tp each rank holds H/tp heads."""

    def __init__(self, cfg, rngs, use_rope):
        D, Lq, Lkv = cfg.model_dimension, cfg.q_latent_dim, cfg.latent_dim
        HK, HR = cfg.n_head * cfg.head_dim, cfg.n_head * cfg.dhR
        self.w_dq = _variable(rngs, _normal(0.02), (D, Lq), "embed", "q_latent")     # down to the query latent
        self.w_dkv = _variable(rngs, _normal(0.02), (D, Lkv), "embed", "kv_latent")  # down to the KV latent (the cache)
        self.w_uq = _variable(rngs, _normal(0.02), (Lq, HK), "q_latent", "heads")
        self.w_uk = _variable(rngs, _normal(0.02), (Lkv, HK), "kv_latent", "heads")
        self.w_uv = _variable(rngs, _normal(0.02), (Lkv, HK), "kv_latent", "heads")
        self.w_o = _variable(rngs, _normal(_output_std(cfg)), (HK, D), "heads", "embed")
        if use_rope:
            self.w_qr = _variable(rngs, _normal(0.02), (Lq, HR), "q_latent", "heads")  # per-head rotary query
            self.w_kr = _variable(rngs, _normal(0.02), (D, cfg.dhR), "embed", "rope")  # one rotary key for all heads
        self.use_rope = use_rope
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, cache=None):
        """Keys and values are up-projected from the KV latent c_kv; with a cache, c_kv and the rotated
        shared key are written at `positions_T` and attention runs over every cached position.
        Returns the output and the updated cache (None without one)."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.model_dtype)
        K, R = cfg.head_dim, cfg.dhR
        B, T, _ = x_BTD.shape
        w_uk, w_uv = fetch(self.w_uk, axes, dtype), fetch(self.w_uv, axes, dtype)      # [Lkv, H*K] each
        # The projections of x (w_dq, w_dkv and w_kr: three parameters, as in the guide) as one
        # product: x is read once and its gradient comes out of one GEMM rather than three added up
        # (one H200, moe1B: docs/performance.md). Its outputs, the latents and the shared rotary key, come
        # out in the matmul dtype (Σ -2.3 ms): the up-projections round the latents so anyway, and the key
        # is rotated in fp32 from its product, as q is; each latent's cotangents from its two up-
        # projections then add up in that dtype too.
        down = (self.w_dq, self.w_dkv) + ((self.w_kr,) if self.use_rope else ())
        c_BTL = matmul(x_BTD, jnp.concatenate([fetch(w, axes, dtype) for w in down], axis=1), "btd,dl->btl", dtype)
        c_q_BTL, c_kv_BTL, k_rope_BTR = jnp.split(c_BTL, [cfg.q_latent_dim, cfg.q_latent_dim + cfg.latent_dim], -1)
        q_BTHK = matmul(c_q_BTL, fetch(self.w_uq, axes, dtype), "btl,lf->btf", dtype).reshape(B, T, -1, K)
        new_cache = {"c_kv": c_kv_BTL}
        if self.use_rope:
            # Rotated in fp32 from the product in the matmul dtype, as Megatron rotates its q (half the
            # bytes of the widest attention product; one H200, moe1B: docs/performance.md).
            q_rope_BTHR = rope(matmul(c_q_BTL, fetch(self.w_qr, axes, dtype), "btl,lf->btf", dtype).reshape(B, T, -1, R),
                               positions_T, cfg.rope_base)
            new_cache["k_rope"] = rope(k_rope_BTR, positions_T, cfg.rope_base)
        if cache is None:
            kv, key_positions_S = new_cache, positions_T
        else:
            kv = {name: lax.dynamic_update_slice_in_dim(cache[name], new_cache[name].astype(cache[name].dtype),
                                                        positions_T[0], axis=1) for name in cache}
            new_cache, key_positions_S = kv, jnp.arange(kv["c_kv"].shape[1])
        H = q_BTHK.shape[2]
        # q, k and v come out of their matmuls in the matmul dtype, which attention rounds them to.
        k_BSHK = matmul(kv["c_kv"], w_uk, "bsl,lf->bsf", dtype).reshape(B, -1, H, K)
        v_BSHK = matmul(kv["c_kv"], w_uv, "bsl,lf->bsf", dtype).reshape(B, -1, H, K)
        if self.use_rope:
            # Decoupled RoPE: append the rotary parts to the content parts so that one dot product
            # gives q_C.k_C + q_R.k_R, the shared rotary key repeated for every head.
            # Rounded after the broadcast and the cast to varying over tp (which concatenate would
            # insert), so that the cotangent's psum over tp and sum over heads stay fp32.
            k_rope_BSHR, = vary_like((jnp.broadcast_to(kv["k_rope"][:, :, None, :], (*k_BSHK.shape[:3], R)),), (k_BSHK,))
            k_rope_BSHR = k_rope_BSHR.astype(dtype)
            q_BTHK = jnp.concatenate([q_BTHK, q_rope_BTHR.astype(dtype)], axis=-1)
            k_BSHK = jnp.concatenate([k_BSHK, k_rope_BSHR], axis=-1)
        mask_TS = None if cache is None else key_positions_S[None, :] <= positions_T[:, None]
        out_BTHK = attend(q_BTHK, k_BSHK, v_BSHK, mask_TS, dtype, axes.platform)
        # Each tp rank holds H/tp heads: its W_o rows give a partial sum of the output.
        out_BTD = matmul(out_BTHK.reshape(B, T, -1), fetch(self.w_o, axes, dtype), "btf,fd->btd", dtype)
        # Guide: Megatron tensor parallelism, one psum over tp per branch (the guide: all_to_all + psum_scatter).
        return branch_sum(out_BTD, axes.tp, dtype), (new_cache if cache is not None else None)


class FeedForward(nnx.Module):
    """The dense FFN, d -> 4d -> d with GELU; under tp each rank holds F/tp hidden units."""

    def __init__(self, cfg, rngs):
        D, F = cfg.model_dimension, cfg.ffn_dim
        self.w_up = _variable(rngs, _normal(0.02), (D, F), "embed", "mlp")
        self.w_down = _variable(rngs, _normal(_output_std(cfg)), (F, D), "mlp", "embed")
        self.cfg = cfg

    def __call__(self, x_BTD, axes):
        dtype = jnp.dtype(self.cfg.model_dtype)
        # One psum over tp, as in MLA (Megatron).
        return branch_sum(ffn(fetch(self.w_up, axes, dtype), fetch(self.w_down, axes, dtype), x_BTD, FFN_HIDDEN), axes.tp, dtype)


class MoE(nnx.Module):
    """Routed experts plus shared experts, added. Under tp every rank routes the same tokens and holds
    F/tp hidden units of every expert, so one psum completes routed and shared outputs together.
    router_bias: this layer has DeepSeek-V3's aux-loss-free bias (a RouterBias, not a Param)."""

    def __init__(self, cfg, rngs, router_bias=False):
        D, F, E, n_shared = cfg.model_dimension, cfg.ffn_dim, cfg.n_experts, cfg.n_shared
        # Guide: the router is a matrix without a bias term.
        self.router = _variable(rngs, _normal(0.02), (D, E), "embed", "score")
        self.expert_up = _variable(rngs, _normal(0.02), (E, D, F), "expert", "embed", "mlp")
        self.expert_down = _variable(rngs, _normal(_output_std(cfg)), (E, F, D), "expert", "mlp", "embed")
        # --n_shared 0: no shared experts, and no empty arrays to checkpoint
        shared = lambda init, shape, *axes: _variable(rngs, init, shape, "shared", *axes) if n_shared else None
        self.shared_up = shared(_normal(0.02), (n_shared, D, F), "embed", "mlp")
        self.shared_down = shared(_normal(_output_std(cfg)), (n_shared, F, D), "mlp", "embed")
        self.router_bias = _variable(rngs, _zeros, (E,), "score", kind=RouterBias) if router_bias else None
        self.cfg = cfg

    def __call__(self, x_BTD, axes, fill_BE=None):
        """fill_BE: tokens each sequence queued per expert in earlier calls (cached decode); they come
        first in the queue, so a token is kept or dropped as in one call over the whole sequence.
        Returns the output, the stats and the fill counts after this call."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.model_dtype)
        # The router stays in fp32: top-k decisions are brittle.
        bias_E = None if self.router_bias is None else self.router_bias[...]
        experts_BTk, gates_BTk, place_BTk, tokens_per_expert_BE, balance_B = route(
            fetch(self.router, axes, weight_dtype("router", cfg)), x_BTD, cfg, bias_E)
        w = {name: fetch(getattr(self, name), axes, dtype)
             for name in ("expert_up", "expert_down", "shared_up", "shared_down") if getattr(self, name) is not None}
        B, T, _ = x_BTD.shape
        C = expert_capacity(cfg)
        fill_BE = jnp.zeros_like(tokens_per_expert_BE) if fill_BE is None else fill_BE
        kept_BTk = fill_BE[jnp.arange(B)[:, None, None], experts_BTk] + place_BTk < C
        # A kept choice's place in this call's queue is below C and below T: buffers of min(C, T) slots
        # hold every kept one, so a one-token decode step computes one slot per expert, not C.
        n_slots = min(C, T)
        if axes.expert_parallel and axes.dp is not None:
            impl = partial(EXPERT_PARALLEL_IMPLS[cfg.moe_impl], dp=axes.dp)
        else:
            impl = MOE_IMPLS[cfg.moe_impl]
        # Kept by the remat (EXPERT_OUTPUTS, [B, T, k, D] in the matmul dtype): the gates' gradient needs
        # them, and replaying them runs the experts' down-projection again (one H200, moe1B: Σ -4 ms).
        y_BTkD = checkpoint_name(impl(w, x_BTD, experts_BTk, jnp.where(kept_BTk, place_BTk, n_slots), n_slots),
                                 EXPERT_OUTPUTS)
        routed_BTD = jnp.einsum("btkd,btk->btd", jnp.where(kept_BTk[..., None], y_BTkD, 0.0).astype(jnp.float32),
                                gates_BTk)
        if "shared_up" in w:
            # Guide: the shared experts' output is added (the guide's MoE returns the routed part alone).
            # The shared experts as one FFN of n_shared * F hidden units (the same sum, in one pair of
            # GEMMs): [n_shared, D, F] -> [D, n_shared * F] and [n_shared, F, D] -> [n_shared * F, D].
            n_shared, D, F = w["shared_up"].shape
            routed_BTD = routed_BTD + ffn(jnp.moveaxis(w["shared_up"], 0, 1).reshape(D, n_shared * F),
                                          w["shared_down"].reshape(n_shared * F, D), x_BTD)
        # One psum over tp, as in MLA (Megatron).
        out_BTD = branch_sum(routed_BTD, axes.tp, dtype)
        stats = {"balance": jnp.sum(balance_B), "tokens_per_expert": jnp.sum(tokens_per_expert_BE, axis=0),
                 "dropped": jnp.sum(~kept_BTk).astype(jnp.float32)}
        return out_BTD, stats, fill_BE + tokens_per_expert_BE


# Kept by every policy besides the policy's own: each branch's tp all-reduce (`sharding.branch_sum`), a
# fused kernel's outputs (`keep_kernel_outputs`) and the routed experts' outputs (`MoE`).
_ALWAYS_KEPT = (BRANCH_SUM, KERNEL_OUTPUTS, EXPERT_OUTPUTS)
REMAT_POLICIES = {"full": jax.checkpoint_policies.save_only_these_names(*_ALWAYS_KEPT),
                  "dots": jax.checkpoint_policies.save_from_both_policies(
                      jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                      jax.checkpoint_policies.save_only_these_names(UNBATCHED_DOT, *_ALWAYS_KEPT))}


def remat_policy(cfg, platform):
    """What each layer's forward keeps for the backward under --remat (None: everything, no remat).
    auto: dots on a TPU, whose step is bound by matmul FLOPs (moe1B on v4-64: 1.48x -> 1.36x the
    model's FLOPs, HBM 11.9 -> 21.9 of 30.75 GiB); on a GPU, whose step is bound by memory traffic,
    full (one H200, moe1B: Σ 336 vs 405 ms with dots) and each dense FFN's up-projection, whose replay
    costs more than keeping it (Σ -1.2 ms for 7.5 GiB); full on a CPU."""
    if cfg.remat == "auto" and platform == "gpu":
        return jax.checkpoint_policies.save_only_these_names(*_ALWAYS_KEPT, FFN_HIDDEN)
    remat = ("dots" if platform == "tpu" else "full") if cfg.remat == "auto" else cfg.remat
    return None if remat == "none" else REMAT_POLICIES[remat]


class Layer(nnx.Module):
    """One pre-norm residual layer: MLA, then a FeedForward (dense layers, with RoPE) or a MoE (the
    block's last layer, NoPE)."""

    def __init__(self, cfg, rngs, use_moe, router_bias=False):
        self.attn_norm = RMSNorm(cfg.model_dimension, rngs)
        self.attn = MLA(cfg, rngs, use_rope=not use_moe)
        self.ffn_norm = RMSNorm(cfg.model_dimension, rngs)
        self.ffn = None if use_moe else FeedForward(cfg, rngs)
        self.moe = MoE(cfg, rngs, router_bias) if use_moe else None
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, ctx, cache=None):
        """Returns (x, MoE stats (None in a dense layer), new cache). cache (`init_caches`): {"attn":
        the latent KV cache, "expert_fill": MoE layers' fill counts}."""
        cfg = self.cfg
        attn_cache, fill_BE = (None, None) if cache is None else (cache["attn"], cache.get("expert_fill"))

        def residual(x_BTD, branch_BTD, i):
            # The branch comes in the matmul dtype, as Megatron's: the residual stream stays fp32, and
            # the tp all-reduce carried that dtype already (`sharding.tp_sum`; one H200, moe1B: Σ -2.3 ms).
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
        self.dense = _stacked(dense_layer, n_dense, DENSE_LAYERS, rngs) if n_dense else None
        self.moe = Layer(cfg, rngs, use_moe=True, router_bias=router_bias)
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, ctx, cache=None):
        """Returns x, this block's MoE stats and its updated cache (None without one). ctx["layer_keys"]:
        each layer's dropout key, in layer order (`Transformer.run_blocks`)."""
        def dense(layer, x_BTD, inputs):
            key, cache_l = inputs
            x_BTD, _, cache_l = layer(x_BTD, positions_T, axes, ctx | {"key": key}, cache_l)
            return x_BTD, cache_l

        n_dense, keys = self.cfg.layers_per_block - 1, ctx["layer_keys"]
        moe = lambda layer, x_BTD, cache_l: layer(x_BTD, positions_T, axes, ctx | {"key": keys[n_dense]}, cache_l)

        # Each layer is rematerialised on its own (not the block as one): a block-level checkpoint keeps
        # only the block's input but replays the whole inner scan, which stacks every layer's residuals
        # again and copies them (on an H200, moe1B: Σ 518 -> 360 ms, memory plan 37.1 -> 24 GiB).
        # On a GPU the dense layers' scan is unrolled (the same numbers): as a loop inside the blocks'
        # scan it stacked each layer's residuals into [n_dense, ...] buffers that the outer scan copied
        # into its own [blocks, n_dense, ...] ones, and its per-step slicing launched ~2,900 kernels a
        # step (one H200, moe1B: Σ 289.4 -> 283.1 ms, 9,487 -> 6,611 kernels). A TPU keeps the loop,
        # which compiles faster (--compile_for v4-64: docs/performance.md).
        policy = remat_policy(self.cfg, axes.platform)
        new_cache = {}
        if self.dense is not None:
            x_BTD, new_cache["dense"] = scan_stacked(self.dense, DENSE_LAYERS, dense, x_BTD,
                                                     (keys[:n_dense], None if cache is None else cache["dense"]),
                                                     policy, unroll=axes.platform == "gpu")
        x_BTD, stats, new_cache["moe"] = call_module(self.moe, moe, x_BTD, None if cache is None else cache["moe"],
                                                     policy)
        return x_BTD, stats, None if cache is None else new_cache


def _fold_in_each(key, n, first=0):
    """[fold_in(key, first), ..., fold_in(key, first + n - 1)]: one key per layer or block, drawn at once."""
    return jax.vmap(partial(jax.random.fold_in, key))(first + jnp.arange(n))


def _in_read_dtypes(stack, cfg):
    """stack (stacked blocks) with each weight matrix in the dtype the layers read it in (`weight_dtype`),
    cast here, outside every layer's remat: `fetch` then has nothing to cast, and the backward's replay
    reads the cast weights rather than casting them again (one H200, moe1B: Σ -2.9 ms, 461 kernels
    fewer). The same values, and the same gradients: each weight's is rounded to that dtype by its
    product (`sharding.einsum_fp32`) either way. Norm scales and shifts stay fp32."""
    graphdef, state = nnx.split(stack)
    cast = lambda path, a: a.astype(weight_dtype(path[-2].key, cfg)) if _is_matrix(path[-2].key) else a
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(cast, state))


class Transformer(nnx.Module):
    """Embedding -> blocks (stacked on the "layers" axis, which pp splits) -> final RMSNorm; the
    output layer is the embedding table again (`Embedding.logits`, `cross_entropy_sum`)."""

    def __init__(self, cfg, rngs, router_bias=False):
        self.embed = Embedding(cfg, rngs)
        self.blocks = _stacked(lambda rngs: Block(cfg, rngs, router_bias), cfg.blocks, LAYERS, rngs)
        self.final_norm = RMSNorm(cfg.model_dimension, rngs)
        self.cfg = cfg

    def run_blocks(self, x_BTD, positions_T, axes, ctx, first_block=0, caches=None):
        """The blocks this device holds, in a scan (compile time independent of depth), each layer
        rematerialised per cfg.remat (`Block`). Returns x, per-block MoE stats (stacked over blocks) and the
        updated caches (None without a cache)."""
        def block(block, x_BTD, inputs):
            keys_L, cache = inputs
            x_BTD, stats, cache = block(x_BTD, positions_T, axes, ctx | {"layer_keys": keys_L}, cache)
            return x_BTD, (stats, cache)

        n_blocks = jax.tree.leaves(nnx.state(self.blocks))[0].shape[0]
        # Layer i of block b drops out with fold_in(fold_in(key, b), i), b in model order: drawn here for
        # every layer, outside the scan and the layers' remat (on a GPU each fold_in in there was a dozen
        # tiny kernels, in the forward and again in the backward).
        keys_BL = jax.vmap(partial(_fold_in_each, n=self.cfg.layers_per_block))(
            _fold_in_each(ctx["key"], n_blocks, first_block))
        x_BTD, (stats, caches) = scan_stacked(_in_read_dtypes(self.blocks, self.cfg), LAYERS, block, x_BTD,
                                              (keys_BL, caches))
        return x_BTD, stats, caches

    def __call__(self, ids_BT, positions_T=None, caches=None, ctx=None):
        """The single-device reference: final hidden states [B, T, D] (after the last norm), MoE stats
        and caches."""
        axes = Axes()
        positions_T = jnp.arange(ids_BT.shape[1]) if positions_T is None else positions_T
        ctx = ctx or {"train": False, "key": jax.random.key(0), "seq_ids": jnp.arange(ids_BT.shape[0])}
        x_BTD, stats, caches = self.run_blocks(self.embed(ids_BT, axes), positions_T, axes, ctx, caches=caches)
        return self.final_norm(x_BTD), stats, caches


# ----------------------------------------------------------------------------------------------
# The params: a plain nested dict of arrays, the modules' Param attributes by name, except that the
# tied table sits at the top as params["embed"] (not params["embed"]["table"]), as in every checkpoint.


def _params_path(path):
    return ("embed",) if path == ("embed", "table") else path


def _as_state(params):
    """params in the Transformer's layout (the inverse of `_params_path`)."""
    return params | {"embed": {"table": params["embed"]}}


def _flat_variables(model, kind):
    """[(path in the params, Variable)] of the `kind` Variables of model, in the params' order."""
    return sorted((_params_path(path), v) for path, v in nnx.to_flat_state(nnx.state(model, kind)))


def _nested(flat):
    """The nested dict holding each (path, value) of flat."""
    tree = {}
    for path, value in flat:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def has_router_bias(params):
    return "router_bias" in params["blocks"]["moe"]["moe"]


@cache
def _graphdef(module_type, cfg, router_bias):
    """The structure of module_type(cfg, router_bias=...) (Transformer or MoE), without its values."""
    return nnx.graphdef(nnx.eval_shape(lambda: module_type(cfg, nnx.Rngs(0), router_bias)))


def build(params, cfg):
    """The Transformer holding params (global arrays, or inside shard_map this device's shards)."""
    return nnx.merge(_graphdef(Transformer, cfg, has_router_bias(params)), _as_state(params))


def init_params(cfg, key):
    """fp32 parameters with global shapes, each drawn by its initializer (stacked ones whole) with its
    own key split from `key` in the params' order. The values depend only on (cfg, key), not on any
    mesh, and are those this file drew before its modules were nnx modules."""
    params = _params_of(cfg)
    keys = jax.random.split(key, len(params))
    return _nested([(path, v.initializer(k, v.shape)) for (path, v), k in zip(params, keys)])


@cache
def _params_of(cfg):
    """[(path in the params, abstract Param)] of the Transformer for cfg, built once per config (nnx builds
    a module tree in about half a second, and init, shapes and counts each want one)."""
    return _flat_variables(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)


def param_shapes(cfg):
    """Global shape of every parameter, as a nested dict mirroring the params."""
    return jax.tree.map(lambda p: p.shape, jax.eval_shape(partial(init_params, cfg), jax.random.key(0)))


class _SizeOne:
    """A stand-in config whose every size is 1 but layers_per_block (2: a dense layer beside the MoE
    one): the logical axes of a parameter depend on where it sits in the modules, not on any size."""
    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return 2 if name == "layers_per_block" else 1


@cache
def logical_axes(router_bias):
    """{path in the params: that parameter's logical axes}, read from the modules' Variables."""
    model = nnx.eval_shape(lambda: Transformer(_SizeOne(), nnx.Rngs(0), router_bias))
    return {path: variable.out_sharding for path, variable in _flat_variables(model, nnx.Variable)}


@cache
def _axes_by_leaf_name():
    """{leaf name: its logical axes less the stacking ones}: a name is one kind of parameter wherever
    it sits (every "scale" is ("norm",)), so masks apply to any dict of such leaves."""
    return {path[-1]: tuple(a for a in axes if a not in (LAYERS, DENSE_LAYERS))
            for path, axes in logical_axes(True).items()}


def param_specs(params, expert_parallel=False):
    """PartitionSpec of every parameter: its logical axes through the table (`axis_rules`), with REPEATS
    (replicated) in front of a stacked block leaf stored as [R, blocks/R, ...] (`pipeline_layout`). The
    global arrays are the same either way: a checkpoint restores with or without expert parallelism."""
    axes = logical_axes(has_router_bias(params))

    def spec(path, p):
        names = axes[tuple(k.key for k in path)]
        return mesh_spec((REPEATS, *names) if len(p.shape) > len(names) else names, expert_parallel)
    return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(params, mesh, expert_parallel=False):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, expert_parallel))


def decay_mask(params):
    """True for the leaves AdamW decays: matrices (two or more logical axes besides the stacking
    ones), not norm scales and shifts."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _is_matrix(path[-1].key), params)


def _is_matrix(name):
    """Whether leaf `name` is a matrix: two or more logical axes besides the stacking ones."""
    return len(_axes_by_leaf_name()[name]) >= 2


def table_mask(params):
    """True for the tied embedding / output table, the one leaf with its own Adam epsilon (spikes.py)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _axes_by_leaf_name()[path[-1].key] == ("vocab", "embed"),
                                            params)


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


def with_router_bias(params, router_bias):
    """params with DeepSeek-V3's aux-loss-free routing bias (router_bias [blocks, E], in model order)
    beside each MoE layer's router, where `moe` reads it, laid out like the routers (`pipeline_layout`).
    It is routing state, not a parameter: the driver keeps it out of the optimizer and differentiates
    the params alone."""
    moe_layers = params["blocks"]["moe"]
    router = moe_layers["moe"]["router"]                          # [blocks, D, E] or [R, blocks/R, D, E]
    if len(router.shape) > len(router_bias.shape) + 1:             # pipeline_layout: the bias likewise
        router_bias = router_bias.reshape(*router.shape[:-2], router_bias.shape[-1])
    moe_layers = moe_layers | {"moe": moe_layers["moe"] | {"router_bias": router_bias}}
    return params | {"blocks": params["blocks"] | {"moe": moe_layers}}


def update_router_bias(router_bias, tokens_per_expert, rate):
    """DeepSeek-V3's aux-loss-free balancing, after an optimizer step: each expert's bias [blocks, E]
    moves by rate x sign(mean load of its layer's experts - its load), loads being the routed choices
    of the step's whole global batch [blocks, E]. The sign comes from integers, so it is exact and the
    same on every mesh, and from no product that can overflow (E c_i does, in int32, at E = 256 and 9M
    choices for one expert): with sum_j c_j = q E + r (0 <= r < E), mean - c_i has the sign of q - c_i,
    or of r when q = c_i."""
    E = tokens_per_expert.shape[-1]
    q, r = jnp.divmod(jnp.sum(tokens_per_expert, axis=-1, keepdims=True), E)
    below_mean = jnp.where(q == tokens_per_expert, jnp.sign(r), jnp.sign(q - tokens_per_expert))
    return router_bias + rate * below_mean.astype(router_bias.dtype)
