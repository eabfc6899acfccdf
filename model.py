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
import dataclasses
import math
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import logical_to_mesh_axes
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("dp", "pp", "tp")

# The one sharding table: logical axis -> mesh axis, in order of precedence. A mesh axis shards at
# most one dim of a parameter (flax's logical_to_mesh_axes), so dp splits D in w_dq [D, Lq] and the
# latent in w_uq [Lq, H*K]. "dp" = FSDP shard, all-gathered just in time; "tp" = Megatron split;
# "pp" = pipeline stage. Logical axes not listed are replicated: "dense_layers" (a block's stacked
# dense layers), "norm", "rope", "score" (the router's column per expert), "shared" (the shared
# experts' index) and, unless expert parallelism is on, "expert" (the routed experts' index).
AXIS_RULES = (
    ("layers", "pp"),        # the stacked blocks: stage s holds blocks [s B/pp, (s+1) B/pp)
    ("vocab", "tp"),         # rows of the tied table
    ("heads", "tp"),         # the H*K (and H*R) columns of the attention projections
    ("mlp", "tp"),           # FFN hidden units, in the dense FFN and inside every expert
    ("embed", "dp"),         # the model width D
    ("q_latent", "dp"),      # the latent widths, in the matrices without D
    ("kv_latent", "dp"),
)
# With --expert_parallel the table starts with this rule: the routed experts' index goes to dp, so
# each dp shard holds E/dp whole experts, which stay there (`fetch` gathers no "expert" dim); their
# "embed" dim then finds dp taken and is not split, their "mlp" dim is still split over tp.
EXPERT_PARALLEL_RULE = ("expert", "dp")


def axis_rules(expert_parallel=False):
    """The sharding table: AXIS_RULES, led by EXPERT_PARALLEL_RULE when expert parallelism is on."""
    return ((EXPERT_PARALLEL_RULE,) if expert_parallel else ()) + AXIS_RULES


LAYERS, DENSE_LAYERS = "layers", "dense_layers"     # the logical names of the two stacking axes
# The circular pipeline's leading axis of every stacked block leaf, [R, blocks/R, ...] (`pipeline_layout`);
# not in AXIS_RULES, so replicated: stage s holds [:, s L:(s+1) L], L = blocks/(pp R).
REPEATS = "repeats"
NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Axes:
    """Mesh axis names the layer code runs under; all None on the single-device reference path.
    expert_parallel: the routed experts are split over dp (`axis_rules`), tokens sent to them."""
    dp: str | None = None
    pp: str | None = None
    tp: str | None = None
    expert_parallel: bool = False
    # The platform of the devices the program is for ("cpu", "gpu", "tpu"; the mesh's, which may be an
    # ahead-of-time topology's): it picks fused kernels (`attend`). None: the portable code.
    platform: str | None = None


def sharded_axes(cfg, platform):
    """The axes of the sharded path under cfg, for devices of `platform`."""
    return Axes(*MESH_AXES, expert_parallel=cfg.expert_parallel, platform=platform)


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


def scan_stacked(stack, axis, body, carry, xs, policy=None):
    """lax.scan of body(layer, carry, x) over the layers of `stack` (a module made by `_stacked`) and
    xs: each step rebuilds one layer with nnx.merge from its slice of the stacked state, the stacking
    axis dropped from its parameters' logical axes. policy: rematerialise each step (jax.checkpoint)."""
    graphdef, state = nnx.split(stack)

    def step(carry, inputs):
        layer_state, x = inputs
        layer = nnx.merge(graphdef, nnx.spmd.remove_axis(layer_state, 0, {nnx.PARTITION_NAME: axis}))
        return body(layer, carry, x)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy)
    return lax.scan(step, carry, (state, xs))


def _mesh_spec(logical_axes, expert_parallel=False):
    """The PartitionSpec of a parameter with these logical axes."""
    return logical_to_mesh_axes(logical_axes, axis_rules(expert_parallel))


def fetch(param, axes, dtype):
    """A parameter's value in dtype and, under FSDP, all-gathered over dp just in time along the dim
    that its logical axes map to dp (`gather_over_dp`). A dim of experts split over dp (expert
    parallelism) is not gathered: the shard keeps its own experts, and tokens come to them."""
    spec = _mesh_spec(param.out_sharding, axes.expert_parallel)
    if axes.dp is None or "dp" not in spec or param.out_sharding[spec.index("dp")] == "expert":
        return param[...].astype(dtype)
    return gather_over_dp(param[...], dtype, axes.dp, spec.index("dp"))


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


def fp32_product(product, *operands):
    """product(*operands), a matmul of operands in the matmul dtype that accumulates and returns fp32.
    XLA:CPU cannot run every bf16 x bf16 -> fp32 dot ("Unsupported element type for DotThunk"), so on
    CPU alone the lowering widens bf16 operands first: the products are exact in fp32, the numbers the
    same. The choice is made when the program is lowered for its devices (lax.platform_dependent), not
    when it is traced: every platform traces this one program, `--compile_for` a TPU's included."""
    if not any(o.dtype == jnp.bfloat16 for o in operands):
        return product(*operands)
    widen = lambda *ops: product(*(o.astype(jnp.float32) if o.dtype == jnp.bfloat16 else o for o in ops))
    return lax.platform_dependent(*operands, cpu=widen, default=product)


def _dot32(spec, a, b):
    """einsum(spec, a, b) of operands already in the matmul dtype, accumulated and returned in fp32."""
    return fp32_product(partial(jnp.einsum, spec, preferred_element_type=jnp.float32), a, b)


UNBATCHED_DOT = "unbatched_dot"     # the checkpoint name of einsum_fp32's products without batch dims


def matmul(x, w, spec):
    """einsum of operands rounded to the weights' dtype, accumulated and returned in fp32."""
    return einsum_fp32(spec, w.dtype, x, w)


def einsum_fp32(spec, dtype, a, b):
    """einsum(spec, a, b) of the operands rounded to `dtype`, accumulated and returned in fp32; in
    the backward the fp32 cotangent is rounded to `dtype` too (`_einsum_rounded`)."""
    out = _einsum_rounded(spec, jnp.dtype(dtype), (a.dtype, b.dtype), a, b)
    a_spec, b_spec, out_spec = _einsum_specs(spec)
    # jax.checkpoint's policies do not see the dot inside a custom_vjp: the name lets --remat dots
    # keep saving the products without batch dims (`REMAT_POLICIES`).
    return out if set(a_spec) & set(b_spec) & set(out_spec) else checkpoint_name(out, UNBATCHED_DOT)


def _einsum_specs(spec):
    """"btd,df->btf" -> ("btd", "df", "btf")."""
    inputs, out_spec = spec.split("->")
    return (*inputs.split(","), out_spec)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum_rounded(spec, dtype, operand_dtypes, a, b):
    """The operands are rounded to `dtype` here, inside: each cotangent then comes back in its operand's
    own dtype (operand_dtypes), so an fp32 activation's gradient is psummed over tp and added up in
    fp32. JAX's own transpose would multiply the fp32 cotangent by the rounded operand in fp32: on GPU
    the backward's GEMMs, two thirds of the step's, ran on fp32 operands as TF32 (H200 profile,
    BENCHMARKS.md). Rounding the cotangent first keeps them bf16 x bf16 -> fp32 like the forward."""
    return _dot32(spec, a.astype(dtype), b.astype(dtype))


def _einsum_rounded_fwd(spec, dtype, operand_dtypes, a, b):
    a, b = a.astype(dtype), b.astype(dtype)
    return _dot32(spec, a, b), (a, b)


def _einsum_rounded_bwd(spec, dtype, operand_dtypes, residuals, g):
    a, b = residuals
    a_spec, b_spec, out_spec = _einsum_specs(spec)
    g = g.astype(dtype)
    d_a = _dot32(f"{out_spec},{b_spec}->{a_spec}", g, b)
    d_b = _dot32(f"{a_spec},{out_spec}->{b_spec}", a, g)
    return tuple(_sum_like(d, like).astype(t) for d, like, t in ((d_a, a, operand_dtypes[0]),
                                                                  (d_b, b, operand_dtypes[1])))


def _sum_like(x, like):
    """x summed over the mesh axes it varies over and `like` does not: the transpose of the implicit
    pcast that made `like` varying in the forward (a weight split over tp times activations
    replicated over tp: the activations' gradient is the psum over tp), as JAX's own transpose does.
    x is the fp32 product: the sum runs in fp32 whatever dtype the cotangent is then returned in."""
    extra = tuple(sorted(_varying_axes(x) - _varying_axes(like)))
    return lax.psum(x, extra) if extra else x


_einsum_rounded.defvjp(_einsum_rounded_fwd, _einsum_rounded_bwd)


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


CUDNN_MAX_HEAD_DIM = 256


def attend(q_BTHQ, k_BSHQ, v_BSHK, mask_TS, dtype, platform):
    """softmax(q.k / sqrt(Q)) v with an fp32 softmax; causal (mask_TS=None: query t sees keys <= t) or
    under mask_TS. For a GPU in bf16 with a head width cuDNN accepts, its fused kernel through
    jax.nn.dot_product_attention; it needs one width for q, k and v, so v is zero-padded from K to
    Q = K + R and the padding sliced off. Elsewhere the plain einsums, which XLA fuses well enough."""
    Q, K = q_BTHQ.shape[-1], v_BSHK.shape[-1]
    if platform == "gpu" and dtype == jnp.bfloat16 and Q <= CUDNN_MAX_HEAD_DIM and Q % 8 == 0:
        v_BSHQ = jnp.pad(v_BSHK, ((0, 0), (0, 0), (0, 0), (0, Q - K)))
        out_BTHQ = jax.nn.dot_product_attention(
            *(a.astype(dtype) for a in (q_BTHQ, k_BSHQ, v_BSHQ)), is_causal=mask_TS is None,
            mask=None if mask_TS is None else mask_TS[None, None], implementation="cudnn")
        return out_BTHQ[..., :K].astype(jnp.float32)
    scores_BHTS = einsum_fp32("bthq,bshq->bhts", dtype, q_BTHQ, k_BSHQ) / math.sqrt(Q)
    if mask_TS is None:
        mask_TS = jnp.tril(jnp.ones((q_BTHQ.shape[1], k_BSHQ.shape[1]), bool))
    probs_BHTS = jax.nn.softmax(jnp.where(mask_TS, scores_BHTS, -jnp.inf), axis=-1)
    return einsum_fp32("bhts,bshk->bthk", dtype, probs_BHTS, v_BSHK)


def ffn(w_up, w_down, x_BTD):
    """d -> 4d -> d with GELU; under tp each rank holds F/tp hidden units and returns a partial sum."""
    return matmul(jax.nn.gelu(matmul(x_BTD, w_up, "btd,df->btf")), w_down, "btf,fd->btd")


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


def _grouped_ffn(w, x_ND, group_sizes_E):
    """The routed experts' FFN over rows sorted by expert (group_sizes_E rows each, in expert order;
    rows past their sum in no group): gelu(x W_up) W_down per group with lax.ragged_dot."""
    dtype = jnp.dtype(w["expert_up"].dtype)
    grouped = lambda x, w_EDF: _ragged_rounded(dtype, (x.dtype, w_EDF.dtype), x, w_EDF, group_sizes_E)
    return grouped(jax.nn.gelu(grouped(x_ND, w["expert_up"])), w["expert_down"])


def _ragged32(x, w, group_sizes, dims=None):
    """lax.ragged_dot (or ragged_dot_general with `dims`) accumulated and returned in fp32."""
    product = (partial(lax.ragged_dot, preferred_element_type=jnp.float32) if dims is None else
               partial(lax.ragged_dot_general, ragged_dot_dimension_numbers=dims, preferred_element_type=jnp.float32))
    return fp32_product(product, x, w, group_sizes)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ragged_rounded(dtype, operand_dtypes, x_ND, w_EDF, group_sizes_E):
    """lax.ragged_dot of the operands rounded to `dtype`, in fp32, whose backward rounds the cotangent
    to `dtype` and returns each operand's cotangent in its own dtype (as `_einsum_rounded`)."""
    return _ragged32(x_ND.astype(dtype), w_EDF.astype(dtype), group_sizes_E)


def _ragged_rounded_fwd(dtype, operand_dtypes, x_ND, w_EDF, group_sizes_E):
    x_ND, w_EDF = x_ND.astype(dtype), w_EDF.astype(dtype)
    return _ragged32(x_ND, w_EDF, group_sizes_E), (x_ND, w_EDF, group_sizes_E)


def _ragged_rounded_bwd(dtype, operand_dtypes, residuals, g_NF):
    x_ND, w_EDF, group_sizes_E = residuals
    g_NF = g_NF.astype(dtype)
    dims = lambda contract, ragged, group: lax.RaggedDotDimensionNumbers((contract, ((), ())), ragged, group)
    # d_x = g w_e^T row by row; d_w_e = x_e^T g_e over group e's rows (the rows are the ragged contraction)
    d_x_ND = _ragged32(g_NF, w_EDF, group_sizes_E, dims(((1,), (2,)), (0,), (0,)))
    d_w_EDF = _ragged32(x_ND, g_NF, group_sizes_E, dims(((0,), (0,)), (0,), ()))
    return (_sum_like(d_x_ND, x_ND).astype(operand_dtypes[0]), _sum_like(d_w_EDF, w_EDF).astype(operand_dtypes[1]),
            None)


_ragged_rounded.defvjp(_ragged_rounded_fwd, _ragged_rounded_bwd)


def experts_ragged(w, x_BTD, experts_BTk, slot_BTk, C):
    """The same outputs from a grouped matmul: choices sorted by expert (dropped ones, slot C, last,
    in no group) and multiplied by their expert's weights with lax.ragged_dot; no capacity padding."""
    B, T, k = experts_BTk.shape
    E = w["expert_up"].shape[0]
    expert_N = jnp.where(slot_BTk < C, experts_BTk, E).reshape(-1)                  # N = B T k choices
    order_N = jnp.argsort(expert_N, stable=True)
    group_sizes_E = jnp.sum(jax.nn.one_hot(expert_N, E, dtype=jnp.int32), axis=0)
    y_ND = _grouped_ffn(w, x_BTD.reshape(B * T, -1)[order_N // k], group_sizes_E)
    return jnp.zeros_like(y_ND).at[order_N].set(y_ND).reshape(B, T, k, -1)


def experts_over_dp(w, x_BTD, experts_BTk, slot_BTk, C, dp):
    """Expert parallelism: the outputs of experts_in_buffers, with the experts split over dp. This
    shard holds experts [j e, (j+1) e) whole, e = E/dp (w's expert_up is [e, D, F], F split over tp).
    Its B sequences fill buffers of B C slots per expert (sequence b's slots are [b C, (b+1) C): the
    keep/drop decisions are the per-sequence ones made before, here, so drops do not depend on the
    mesh); an all-to-all over dp hands each shard its experts' slots from every shard, the experts
    run, and a second all-to-all returns the outputs. Both trips carry the matmul dtype: the way
    there is what the matmul reads anyway; the way back rounds the expert outputs (a partial sum
    over tp) to it, which fp32 (the tests') leaves exact."""
    B, T, k = experts_BTk.shape
    D, dtype = x_BTD.shape[-1], w["expert_up"].dtype
    E = w["expert_up"].shape[0] * lax.axis_size(dp)
    # Kept choice (b, t, i) in slot s goes to row b C + s of its expert's buffer; a dropped one (slot
    # C) to row B C, past the end, where the scatter drops it.
    row_BTk = jnp.where(slot_BTk < C, jnp.arange(B)[:, None, None] * C + slot_BTk, B * C)
    x_BTkD = jnp.broadcast_to(x_BTD[:, :, None, :], (B, T, k, D)).astype(dtype)
    send_EUD = jnp.zeros((E, B * C, D), dtype).at[experts_BTk, row_BTk].set(x_BTkD, mode="drop")
    # all-to-all over dp: block j of the experts goes to shard j, which stacks what it receives by
    # source shard: [E, B C, D] -> [E/dp, dp B C, D] (U = dp B C slots per expert)
    recv_eUD = lax.all_to_all(send_EUD, dp, split_axis=0, concat_axis=1, tiled=True)
    h_eUF = jax.nn.gelu(matmul(recv_eUD, w["expert_up"], "eud,edf->euf"))
    y_eUD = matmul(h_eUF, w["expert_down"], "euf,efd->eud").astype(dtype)
    # all-to-all back over dp: slot block i returns to shard i, stacked by expert block:
    # [E/dp, dp B C, D] -> [E, B C, D]
    y_EUD = lax.all_to_all(y_eUD, dp, split_axis=1, concat_axis=0, tiled=True)
    return y_EUD[experts_BTk, jnp.minimum(row_BTk, B * C - 1)].astype(jnp.float32)


def experts_over_dp_ragged(w, x_BTD, experts_BTk, slot_BTk, C, dp):
    """Expert parallelism without capacity padding: the kept choices, sorted by expert, travel to their
    experts' shard with lax.ragged_all_to_all (only the rows there are), run through a grouped matmul
    (lax.ragged_dot) and come back the same way. XLA:CPU does not implement ragged_all_to_all: on CPU
    this path is checked by compiling it for a TPU slice."""
    B, T, k = experts_BTk.shape
    D, dtype = x_BTD.shape[-1], w["expert_up"].dtype
    n, e = lax.axis_size(dp), w["expert_up"].shape[0]
    E, N, me = n * e, B * T * k, lax.axis_index(dp)
    expert_N = jnp.where(slot_BTk < C, experts_BTk, E).reshape(-1)                # dropped: expert E, last
    order_N = jnp.argsort(expert_N, stable=True)
    send_ND = x_BTD.reshape(B * T, D)[order_N // k].astype(dtype)       # by expert: shard 0's block first
    counts_E = jnp.sum(jax.nn.one_hot(expert_N, E, dtype=jnp.int32), axis=0)
    # Every shard's counts, a few integers: [E] -> [dp, E] -> [sender, receiver, local expert]
    counts_nne = lax.all_gather(counts_E, dp).reshape(n, n, e)
    rows_nn = jnp.sum(counts_nne, axis=-1)                                # rows sender -> receiver
    start_send_nn = jnp.cumsum(rows_nn, axis=1) - rows_nn                 # in the sender's buffer
    start_recv_nn = jnp.cumsum(rows_nn, axis=0) - rows_nn                 # in the receiver's buffer
    # A receiver gets at most C slots per sequence per expert from each sender: B C E rows in all.
    M = min(B * C * E, n * N)
    recv_MD = _vary_like((jnp.zeros((M, D), dtype),), (send_ND,))[0]
    # ragged all-to-all over dp: my rows for shard j ([start_send[me, j], + rows[me, j])) land in
    # shard j's buffer at start_recv[me, j]: [N, D] -> [M, D], ordered (sender, local expert)
    recv_MD = lax.ragged_all_to_all(send_ND, recv_MD, start_send_nn[me], rows_nn[me], start_recv_nn[me],
                                    rows_nn[:, me], axis_name=dp)
    # Regroup by local expert for the grouped matmul (rows past the received ones: group e, none).
    sizes_G = counts_nne[:, me, :].reshape(-1)                            # G = (sender, local expert)
    group_M = jnp.searchsorted(jnp.cumsum(sizes_G), jnp.arange(M), side="right")
    local_M = jnp.where(group_M < n * e, group_M % e, e)
    by_expert_M = jnp.argsort(local_M, stable=True)
    y_sorted_MD = _grouped_ffn(w, recv_MD[by_expert_M], jnp.sum(counts_nne[:, me, :], axis=0))
    y_MD = jnp.zeros_like(y_sorted_MD).at[by_expert_M].set(y_sorted_MD).astype(dtype)
    # And back over dp, the inverse exchange: [M, D] -> [N, D] in this shard's sorted order
    back_ND = _vary_like((jnp.zeros((N, D), dtype),), (y_MD,))[0]
    back_ND = lax.ragged_all_to_all(y_MD, back_ND, start_recv_nn[:, me], rows_nn[:, me], start_send_nn[:, me],
                                    rows_nn[me], axis_name=dp)
    return jnp.zeros((N, D), jnp.float32).at[order_N].set(back_ND.astype(jnp.float32)).reshape(B, T, k, D)


MOE_IMPLS = {"buffers": experts_in_buffers, "ragged": experts_ragged}
# The same interface with the experts split over dp (`Axes.expert_parallel`), taking the dp axis too.
EXPERT_PARALLEL_IMPLS = {"buffers": experts_over_dp, "ragged": experts_over_dp_ragged}


def dropout(x_BTD, rate, key, seq_ids_B):
    """Inverted dropout whose mask depends only on (key, global sequence id), so any mesh (and any
    micro-batching) draws the same mask for the same sequence."""
    def one(x_TD, seq):
        keep = jax.random.bernoulli(jax.random.fold_in(key, seq), 1.0 - rate, x_TD.shape)
        return jnp.where(keep, x_TD / (1.0 - rate), 0.0)
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
        local_BT = ids_BT - _index(axes.tp) * V
        inside_BT = (local_BT >= 0) & (local_BT < V)
        x_BTD = jnp.where(inside_BT[..., None], table_VD[jnp.clip(local_BT, 0, V - 1)], 0.0)
        return _psum(x_BTD, axes.tp)

    def logits(self, h_BTD, axes, table_VD=None):
        """fp32 logits of this tp rank's vocab rows, padding rows masked to -inf."""
        table_VD = self.gathered(axes) if table_VD is None else table_VD
        V = table_VD.shape[0]
        logits_BTV = einsum_fp32("btd,vd->btv", self.cfg.model_dtype, h_BTD, table_VD)
        vocab_ids_V = _index(axes.tp) * V + jnp.arange(V)
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
        c_q_BTL = matmul(x_BTD, fetch(self.w_dq, axes, dtype), "btd,dl->btl")
        c_kv_BTL = matmul(x_BTD, fetch(self.w_dkv, axes, dtype), "btd,dl->btl")
        q_BTHK = matmul(c_q_BTL, fetch(self.w_uq, axes, dtype), "btl,lf->btf").reshape(B, T, -1, K)
        new_cache = {"c_kv": c_kv_BTL}
        if self.use_rope:
            q_rope_BTHR = rope(matmul(c_q_BTL, fetch(self.w_qr, axes, dtype), "btl,lf->btf").reshape(B, T, -1, R),
                               positions_T, cfg.rope_base)
            new_cache["k_rope"] = rope(matmul(x_BTD, fetch(self.w_kr, axes, dtype), "btd,dr->btr"), positions_T,
                                       cfg.rope_base)
        if cache is None:
            kv, key_positions_S = new_cache, positions_T
        else:
            kv = {name: lax.dynamic_update_slice_in_dim(cache[name], new_cache[name].astype(cache[name].dtype),
                                                        positions_T[0], axis=1) for name in cache}
            new_cache, key_positions_S = kv, jnp.arange(kv["c_kv"].shape[1])
        H = q_BTHK.shape[2]
        k_BSHK = matmul(kv["c_kv"], w_uk, "bsl,lf->bsf").reshape(B, -1, H, K)
        v_BSHK = matmul(kv["c_kv"], w_uv, "bsl,lf->bsf").reshape(B, -1, H, K)
        if self.use_rope:
            # Decoupled RoPE: append the rotary parts to the content parts so that one dot product
            # gives q_C.k_C + q_R.k_R, the shared rotary key repeated for every head.
            k_rope_BSHR = jnp.broadcast_to(kv["k_rope"][:, :, None, :], (*k_BSHK.shape[:3], R))
            q_BTHK = jnp.concatenate([q_BTHK, q_rope_BTHR], axis=-1)
            k_BSHK = jnp.concatenate([k_BSHK, k_rope_BSHR], axis=-1)
        mask_TS = None if cache is None else key_positions_S[None, :] <= positions_T[:, None]
        out_BTHK = attend(q_BTHK, k_BSHK, v_BSHK, mask_TS, dtype, axes.platform)
        # Each tp rank holds H/tp heads: its W_o rows give a partial sum of the output.
        out_BTD = matmul(out_BTHK.reshape(B, T, -1), fetch(self.w_o, axes, dtype), "btf,fd->btd")
        # Guide: Megatron tensor parallelism, one psum over tp per branch (the guide: all_to_all + psum_scatter).
        return _psum(out_BTD, axes.tp), (new_cache if cache is not None else None)


class FeedForward(nnx.Module):
    """The dense FFN, d -> 4d -> d with GELU; under tp each rank holds F/tp hidden units."""

    def __init__(self, cfg, rngs):
        D, F = cfg.model_dimension, cfg.ffn_dim
        self.w_up = _variable(rngs, _normal(0.02), (D, F), "embed", "mlp")
        self.w_down = _variable(rngs, _normal(_output_std(cfg)), (F, D), "mlp", "embed")
        self.cfg = cfg

    def __call__(self, x_BTD, axes):
        dtype = jnp.dtype(self.cfg.model_dtype)
        # Guide: Megatron tensor parallelism, one psum over tp per branch (the guide: all_to_all + psum_scatter).
        return _psum(ffn(fetch(self.w_up, axes, dtype), fetch(self.w_down, axes, dtype), x_BTD), axes.tp)


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
        self.shared_up = _variable(rngs, _normal(0.02), (n_shared, D, F), "shared", "embed", "mlp")
        self.shared_down = _variable(rngs, _normal(_output_std(cfg)), (n_shared, F, D), "shared", "mlp", "embed")
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
            fetch(self.router, axes, jnp.float32), x_BTD, cfg, bias_E)
        w = {name: fetch(getattr(self, name), axes, dtype)
             for name in ("expert_up", "expert_down", "shared_up", "shared_down")}
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
        y_BTkD = impl(w, x_BTD, experts_BTk, jnp.where(kept_BTk, place_BTk, n_slots), n_slots)
        routed_BTD = jnp.einsum("btkd,btk->btd", jnp.where(kept_BTk[..., None], y_BTkD, 0.0), gates_BTk)
        # Guide: the shared experts' output is added (the guide's MoE returns the routed part alone).
        shared_BTD = sum(ffn(w["shared_up"][i], w["shared_down"][i], x_BTD) for i in range(cfg.n_shared))
        # Guide: Megatron tensor parallelism, one psum over tp per branch (the guide: all_to_all + psum_scatter).
        out_BTD = _psum(routed_BTD + shared_BTD, axes.tp)
        stats = {"balance": jnp.sum(balance_B), "tokens_per_expert": jnp.sum(tokens_per_expert_BE, axis=0),
                 "dropped": jnp.sum(~kept_BTk).astype(jnp.float32)}
        return out_BTD, stats, fill_BE + tokens_per_expert_BE


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
        self.dense = _stacked(dense_layer, cfg.layers_per_block - 1, DENSE_LAYERS, rngs)
        self.moe = Layer(cfg, rngs, use_moe=True, router_bias=router_bias)
        self.cfg = cfg

    def __call__(self, x_BTD, positions_T, axes, ctx, cache=None):
        """Returns x, this block's MoE stats and its updated cache (None without one)."""
        def dense(layer, x_BTD, inputs):
            i, cache_l = inputs
            ctx_l = ctx | {"key": jax.random.fold_in(ctx["key"], i)}
            x_BTD, _, cache_l = layer(x_BTD, positions_T, axes, ctx_l, cache_l)
            return x_BTD, cache_l

        n_dense = self.cfg.layers_per_block - 1
        x_BTD, dense_cache = scan_stacked(self.dense, DENSE_LAYERS, dense, x_BTD,
                                          (jnp.arange(n_dense), None if cache is None else cache["dense"]))
        ctx_moe = ctx | {"key": jax.random.fold_in(ctx["key"], n_dense)}
        x_BTD, stats, moe_cache = self.moe(x_BTD, positions_T, axes, ctx_moe, None if cache is None else cache["moe"])
        return x_BTD, stats, None if cache is None else {"dense": dense_cache, "moe": moe_cache}


REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.save_from_both_policies(
                      jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                      jax.checkpoint_policies.save_only_these_names(UNBATCHED_DOT))}


class Transformer(nnx.Module):
    """Embedding -> blocks (stacked on the "layers" axis, which pp splits) -> final RMSNorm; the
    output layer is the embedding table again (`Embedding.logits`, `cross_entropy_sum`)."""

    def __init__(self, cfg, rngs, router_bias=False):
        self.embed = Embedding(cfg, rngs)
        self.blocks = _stacked(lambda rngs: Block(cfg, rngs, router_bias), cfg.blocks, LAYERS, rngs)
        self.final_norm = RMSNorm(cfg.model_dimension, rngs)
        self.cfg = cfg

    def run_blocks(self, x_BTD, positions_T, axes, ctx, first_block=0, caches=None):
        """The blocks this device holds, in a scan (compile time independent of depth), each
        rematerialised per cfg.remat. Returns x, per-block MoE stats (stacked over blocks) and the
        updated caches (None without a cache)."""
        def block(block, x_BTD, inputs):
            index, cache = inputs
            ctx_b = ctx | {"key": jax.random.fold_in(ctx["key"], index)}
            x_BTD, stats, cache = block(x_BTD, positions_T, axes, ctx_b, cache)
            return x_BTD, (stats, cache)

        n_blocks = jax.tree.leaves(nnx.state(self.blocks))[0].shape[0]
        policy = None if self.cfg.remat == "none" else REMAT_POLICIES[self.cfg.remat]
        x_BTD, (stats, caches) = scan_stacked(self.blocks, LAYERS, block, x_BTD,
                                              (first_block + jnp.arange(n_blocks), caches), policy)
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


def _has_router_bias(params):
    return "router_bias" in params["blocks"]["moe"]["moe"]


@cache
def _graphdef(module_type, cfg, router_bias):
    """The structure of module_type(cfg, router_bias=...) (Transformer or MoE), without its values."""
    return nnx.graphdef(nnx.eval_shape(lambda: module_type(cfg, nnx.Rngs(0), router_bias)))


def build(params, cfg):
    """The Transformer holding params (global arrays, or inside shard_map this device's shards)."""
    return nnx.merge(_graphdef(Transformer, cfg, _has_router_bias(params)), _as_state(params))


def init_params(cfg, key):
    """fp32 parameters with global shapes, each drawn by its initializer (stacked ones whole) with its
    own key split from `key` in the params' order. The values depend only on (cfg, key), not on any
    mesh, and are those this file drew before its modules were nnx modules."""
    params = _flat_variables(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)
    keys = jax.random.split(key, len(params))
    return _nested([(path, v.initializer(k, v.shape)) for (path, v), k in zip(params, keys)])


def init_sharded_params(cfg, key, mesh):
    """init_pipeline_params computed directly into the mesh layout (no host ever holds the full model)."""
    abstract = jax.eval_shape(partial(init_pipeline_params, cfg), key)
    return jax.jit(partial(init_pipeline_params, cfg), out_shardings=param_shardings(abstract, mesh, cfg.expert_parallel))(key)


def param_shapes(cfg):
    """Global shape of every parameter, as a nested dict mirroring the params."""
    return jax.tree.map(lambda p: p.shape, jax.eval_shape(partial(init_params, cfg), jax.random.key(0)))


class _SizeOne:
    """A stand-in config whose every size is 1: the logical axes of a parameter depend on where it
    sits in the modules, not on any size."""
    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return 1


@cache
def _logical_axes(router_bias):
    """{path in the params: that parameter's logical axes}, read from the modules' Variables."""
    model = nnx.eval_shape(lambda: Transformer(_SizeOne(), nnx.Rngs(0), router_bias))
    return {path: variable.out_sharding for path, variable in _flat_variables(model, nnx.Variable)}


@cache
def _axes_by_leaf_name():
    """{leaf name: its logical axes less the stacking ones}: a name is one kind of parameter wherever
    it sits (every "scale" is ("norm",)), so masks apply to any dict of such leaves."""
    return {path[-1]: tuple(a for a in axes if a not in (LAYERS, DENSE_LAYERS))
            for path, axes in _logical_axes(True).items()}


def param_specs(params, expert_parallel=False):
    """PartitionSpec of every parameter: its logical axes through the table (`axis_rules`), with REPEATS
    (replicated) in front of a stacked block leaf stored as [R, blocks/R, ...] (`pipeline_layout`). The
    global arrays are the same either way: a checkpoint restores with or without expert parallelism."""
    axes = _logical_axes(_has_router_bias(params))

    def spec(path, p):
        names = axes[tuple(k.key for k in path)]
        return _mesh_spec((REPEATS, *names) if len(p.shape) > len(names) else names, expert_parallel)
    return jax.tree_util.tree_map_with_path(spec, params)


def model_order(params):
    """params with every stacked block leaf as [blocks, ...], in model order (undoes `pipeline_layout`;
    leaves already so are returned as they are)."""
    axes = _logical_axes(True)

    def flat(path, a):
        extra = len(a.shape) > len(axes[("blocks", *(k.key for k in path))])
        return a.reshape(-1, *a.shape[2:]) if extra else a
    return params | {"blocks": jax.tree_util.tree_map_with_path(flat, params["blocks"])}


def pipeline_layout(params, repeats):
    """The layout the circular pipeline stores params in (R = repeats > 1): every stacked block leaf
    [blocks, ...] reshaped to [R, blocks/R, ...], a pure reshape of the model order. Block (r, k) is
    block r blocks/R + k; with the second axis split over pp, stage s holds k in [s L, (s+1) L),
    L = blocks/(pp R), i.e. the R non-adjacent groups r pp + s of L consecutive blocks. R = 1: the
    model order, as GPipe stores them."""
    params = model_order(params)
    if repeats == 1:
        return params
    return params | {"blocks": jax.tree.map(lambda a: a.reshape(repeats, -1, *a.shape[1:]), params["blocks"])}


def init_pipeline_params(cfg, key):
    """init_params in the layout the sharded path stores (`pipeline_layout` with cfg.pipeline_repeats):
    the same numbers whatever R."""
    return pipeline_layout(init_params(cfg, key), cfg.pipeline_repeats)


def param_shardings(params, mesh, expert_parallel=False):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, expert_parallel))


def decay_mask(params):
    """True for the leaves AdamW decays: matrices (two or more logical axes besides the stacking
    ones), not norm scales and shifts."""
    return jax.tree_util.tree_map_with_path(lambda path, _: len(_axes_by_leaf_name()[path[-1].key]) >= 2, params)


def table_mask(params):
    """True for the tied embedding / output table, the one leaf with its own Adam epsilon (spikes.py)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _axes_by_leaf_name()[path[-1].key] == ("vocab", "embed"),
                                            params)


def moe(w, x_BTD, cfg, axes, fill_BE=None):
    """The MoE layer with weights w (a dict: router, expert_up, ..., optionally router_bias) on x_BTD."""
    return nnx.merge(_graphdef(MoE, cfg, "router_bias" in w), w)(x_BTD, axes, fill_BE)


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


def cross_entropy_sum(table_VD, h_BTD, targets_BT, cfg, axes):
    """Summed cross-entropy with the vocab split over tp (Megatron's parallel softmax), a chunk of
    whole sequences at a time. Per chunk each rank reduces its vocab rows to three numbers per token
    (`_vocab_softmax_stats`); the ranks then combine maxima, rescaled sums of exponentials and the
    target logit, which exactly one rank holds. No fp32 logits outlive one chunk, in the forward or
    the backward pass (which recomputes them): memory is O(chunk x V/tp) whatever the batch.

    table_VD is fp32 (`Embedding.gathered`) and is rounded to the matmul dtype inside each chunk: as a
    constant of the chunk scan, its gradient is then accumulated over the chunks in an fp32 carry (the
    transposed scan's), where a table rounded before the scan would carry a bf16 sum."""
    # Guide: vocab-parallel cross-entropy over the tp-split table; no [B, T, V] logits are formed.
    V, dtype = table_VD.shape[0], jnp.dtype(cfg.model_dtype)
    vocab_start = _index(axes.tp) * V
    n_real = jnp.clip(cfg.vocab_size - vocab_start, 0, V)          # rows past the real vocab are padding
    local_targets_BT = targets_BT - vocab_start
    # A custom_vjp must hand back cotangents typed like its inputs, and the table's gradient varies
    # over every axis the tokens do (and the tokens' over tp). Casting both to the union first
    # makes JAX put the reductions in the cast's transpose: psum over dp/pp for the table (on top of
    # FSDP's reduce-scatter), over tp for the hidden states, both in fp32.
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
    """Over this rank's vocab rows [0, n_real) of the fp32 table, rounded here to the matmul dtype: per
    token the max logit m, sum_v exp(logit_v - m), and the target's logit (0 when another rank holds
    the target). m gets no gradient: the loss does not depend on it. The backward pass recomputes the
    logits rather than keeping [V, T] floats per chunk, and returns the table's and the hidden states'
    gradients in fp32. The residuals are the inputs themselves (the table a constant of the chunk
    scan, not a per-chunk copy)."""
    return _softmax_stats_fwd(dtype, table_VD, h_TD, local_targets_T, n_real)[0]


def _exp_logits_VT(table_VD, h_TD, n_real, max_T=None):
    """exp(logits - max) [V, T] from operands in the matmul dtype, 0 on padding rows, and the max.
    Vocab-major: XLA:CPU runs the backward's products with it up to 2x faster than with token-major
    [T, V] (BENCHMARKS.md)."""
    logits_VT = _dot32("vd,td->vt", table_VD, h_TD)
    real_V1 = (jnp.arange(table_VD.shape[0]) < n_real)[:, None]
    if max_T is None:
        max_T = jnp.max(jnp.where(real_V1, logits_VT, -jnp.inf), axis=0)
    return jnp.where(real_V1, jnp.exp(logits_VT - max_T), 0.0), max_T


def _target_rows(table_VD, local_targets_T, n_real):
    """Each token's target row of the table, and whether this rank holds it."""
    inside_T = (local_targets_T >= 0) & (local_targets_T < n_real)
    return inside_T, table_VD[jnp.clip(local_targets_T, 0, table_VD.shape[0] - 1)]


def _softmax_stats_fwd(dtype, table_VD, h_TD, local_targets_T, n_real):
    table_r, h_r = table_VD.astype(dtype), h_TD.astype(dtype)
    exp_VT, max_T = _exp_logits_VT(table_r, h_r, n_real)
    inside_T, rows_TD = _target_rows(table_r, local_targets_T, n_real)
    target_T = jnp.where(inside_T, _dot32("td,td->t", rows_TD, h_r), 0.0)
    return (max_T, jnp.sum(exp_VT, axis=0), target_T), (table_VD, h_TD, local_targets_T, n_real, max_T)


def _softmax_stats_bwd(dtype, residuals, cotangents):
    """d logit[v, t] = g_sum[t] exp(logit[v, t] - m[t]) + g_target[t] [v is t's target]. The g_sum
    scaling is applied on the [T, D] side of both products, so the recomputed exponentials are the
    only [V, T] array."""
    table_VD, h_TD, local_targets_T, n_real, max_T = residuals
    _, g_sum_T, g_target_T = cotangents
    table_r, h_r = table_VD.astype(dtype), h_TD.astype(dtype)
    exp_VT = _exp_logits_VT(table_r, h_r, n_real, max_T)[0].astype(dtype)
    inside_T, rows_TD = _target_rows(table_r, local_targets_T, n_real)
    g_target_T = jnp.where(inside_T, g_target_T, 0.0)
    d_h_TD = (g_sum_T[:, None] * _dot32("vd,vt->td", table_r, exp_VT)
              + g_target_T[:, None] * rows_TD.astype(jnp.float32))
    d_table_VD = _dot32("vt,td->vd", exp_VT, (h_TD * g_sum_T[:, None]).astype(dtype))
    d_table_VD = d_table_VD.at[jnp.clip(local_targets_T, 0, table_VD.shape[0] - 1)].add(
        g_target_T[:, None] * h_r.astype(jnp.float32))
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
    return build(model_order(params), cfg)(ids_BT, positions_T, caches, ctx)


def reference_loss_and_metrics(params, x_BT, y_BT, key, cfg, train=True):
    ctx = {"train": train, "key": key, "seq_ids": jnp.arange(x_BT.shape[0])}
    model = build(model_order(params), cfg)
    h_BTD, stats, _ = model(x_BT, ctx=ctx)
    ce_sum = cross_entropy_sum(model.embed.gathered(Axes()), h_BTD, y_BT, cfg, Axes())
    return _summarise(ce_sum, stats, x_BT.size, x_BT.shape[0], cfg)


# ----------------------------------------------------------------------------------------------
# The sharded path: one shard_map over ("dp", "pp", "tp") with a GPipe schedule over pp, or with
# cfg.pipeline_repeats = R > 1 a circular one (MaxText's num_pipeline_repeats).


def _pipeline_loss(params, x_BT, y_BT, key, cfg, n_micro, train, platform):
    """Runs on one device with its shards: x_BT is this dp replica's [b, T] tokens (all pp/tp ranks of
    the replica hold the same rows); params["blocks"] holds this stage's blocks: B/pp of them, or with
    R = cfg.pipeline_repeats > 1 [R, L] of them (`pipeline_layout`), L = B/(pp R), repeat r being the
    group of blocks [(r pp + s) L, (r pp + s + 1) L) of stage s.

    The schedule: at tick t stage s works on item i = t - s of the R M items (micro-batch i mod M in
    its repeat i div M) with its blocks of that repeat, and passes the result to stage s + 1. The last
    stage files repeat R - 1's outputs, and (R > 1) sends the others round the ring to stage 0, which
    keeps them in a buffer of M micro-batches until their next turn, M - pp ticks later (hence M >=
    pp). R M + pp - 1 ticks of L blocks: the bubble is (pp - 1)/(R M + pp - 1)."""
    axes = sharded_axes(cfg, platform)
    R = cfg.pipeline_repeats
    n_stages, stage = lax.axis_size("pp"), lax.axis_index("pp")
    repeat_of = lambda r: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, r, keepdims=False), params["blocks"])
    # The embedding and the output layer's modules (R > 1: with any one repeat's blocks, unused).
    model = build(params if R == 1 else params | {"blocks": repeat_of(0)}, cfg)
    b, T = x_BT.shape
    M, mb = n_micro, b // n_micro
    n_items = R * M
    positions_T = jnp.arange(T)
    table_VD = model.embed.gathered(axes)                                    # [V/tp, D/dp] -> [V/tp, D]
    x_MbT, y_MbT = x_BT.reshape(M, mb, T), y_BT.reshape(M, mb, T)
    emb_MbTD = model.embed(x_MbT, axes, table_VD)                             # [M, mb, T, D]
    blocks_per_stage = jax.tree.leaves(params["blocks"])[0].shape[0 if R == 1 else 1]
    seq_base = lax.axis_index("dp") * b

    # Guide: one block group per device per tick (the guide vmaps over every layer a device holds, each tick).
    def tick(carry, t):
        """Every stage works on one item: stage s on item t - s (a bubble when outside [0, R M):
        computed on stale data and masked out of every sum)."""
        received_bTD, waiting_MbTD, outputs_MbTD, stats_sum = carry
        i = t - stage
        valid = (i >= 0) & (i < n_items)
        i_clipped = jnp.clip(i, 0, n_items - 1)
        m_clipped, r = (i_clipped, 0) if R == 1 else (i_clipped % M, i_clipped // M)
        if R == 1:
            x_bTD = jnp.where(stage == 0, emb_MbTD[jnp.minimum(t, M - 1)], received_bTD)
            stage_model, first_block = model, stage * blocks_per_stage
        else:
            # Stage 0 files what the last stage sent last tick (its item t - pp), then reads micro-batch
            # m: the embedding in repeat 0, afterwards what came back round the ring (filed >= 0 ticks ago).
            back = t - n_stages
            slot = jnp.clip(back, 0, n_items - 1) % M
            file_it = (stage == 0) & (back >= 0) & (back < n_items)
            waiting_MbTD = waiting_MbTD.at[slot].set(jnp.where(file_it, received_bTD, waiting_MbTD[slot]))
            first_input_bTD = jnp.where(r == 0, emb_MbTD[m_clipped], waiting_MbTD[m_clipped])
            x_bTD = jnp.where(stage == 0, first_input_bTD, received_bTD)
            stage_model = build(params | {"blocks": repeat_of(r)}, cfg)
            first_block = (r * n_stages + stage) * blocks_per_stage
        ctx = {"train": train, "key": key, "seq_ids": seq_base + m_clipped * mb + jnp.arange(mb)}
        y_bTD, stats, _ = stage_model.run_blocks(x_bTD, positions_T, axes, ctx, first_block=first_block)
        if R == 1:
            stats_sum = jax.tree.map(lambda acc, s: acc + jnp.where(valid, s, 0), stats_sum, stats)
        else:
            stats_sum = jax.tree.map(lambda acc, s: acc.at[r].add(jnp.where(valid, s, 0)), stats_sum, stats)
        # The last stage files finished micro-batches (the last repeat's); other stages keep their buffer at zero.
        keep = (stage == n_stages - 1) & valid
        if R > 1:
            keep = keep & (r == R - 1)
        outputs_MbTD = outputs_MbTD.at[m_clipped].set(jnp.where(keep, y_bTD, outputs_MbTD[m_clipped]))
        # Stage s -> s + 1. GPipe: non-cyclic (stage 0 receives zeros; it reads the embeddings instead).
        # Circular: the last stage's results go back to stage 0 for their next repeat.
        ring = [(s, s + 1) for s in range(n_stages - 1)] + ([(n_stages - 1, 0)] if R > 1 else [])
        received_bTD = lax.ppermute(y_bTD, "pp", ring)
        return (received_bTD, waiting_MbTD, outputs_MbTD, stats_sum), None

    # Carries differ per dp replica and per stage: declare them varying over both for check_vma.
    zeros = lambda shape, dtype=jnp.float32: lax.pcast(jnp.zeros(shape, dtype), ("dp", "pp"), to="varying")
    lead = (blocks_per_stage,) if R == 1 else (R, blocks_per_stage)
    stats_sum = {"balance": zeros(lead), "dropped": zeros(lead),
                 "tokens_per_expert": zeros((*lead, cfg.n_experts), jnp.int32)}
    waiting_MbTD = None if R == 1 else zeros(emb_MbTD.shape)
    init = (zeros(emb_MbTD.shape[1:]), waiting_MbTD, zeros(emb_MbTD.shape), stats_sum)
    (_, _, outputs_MbTD, stats), _ = lax.scan(tick, init, jnp.arange(n_items + n_stages - 1))
    # Only the last stage holds real outputs; a reduce-scatter over pp hands each stage M/pp of them,
    # so the (large-vocab) output layer's work is split over the stages: [M, mb, T, D] -> [M/pp, ...].
    mine_MbTD = lax.psum_scatter(outputs_MbTD, "pp", scatter_dimension=0, tiled=True)
    targets_MbT = lax.dynamic_slice_in_dim(y_MbT, stage * (M // n_stages), M // n_stages)
    h_MbTD = model.final_norm(mine_MbTD)
    ce_sum = lax.psum(cross_entropy_sum(table_VD, h_MbTD.reshape(-1, T, h_MbTD.shape[-1]), targets_MbT.reshape(-1, T),
                                        cfg, axes), ("dp", "pp"))
    # Per-block stats in model order, summed over dp. GPipe: stage s has blocks [s B/pp, (s+1) B/pp).
    # Circular: [R, L] per stage, gathered over pp to [R, B/R], which is model order once flattened.
    stats = {name: lax.psum(lax.all_gather(s, "pp", axis=0 if R == 1 else 1, tiled=True, to="invarying"), "dp")
             for name, s in stats.items()}
    if R > 1:
        stats = {name: s.reshape(-1, *s.shape[2:]) for name, s in stats.items()}
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
    """Loss (cross-entropy + balance) and metrics of a global batch on `mesh`; differentiable in params.
    params in either layout (`pipeline_layout`; the one cfg.pipeline_repeats asks for costs no reshard)."""
    params = pipeline_layout(params, cfg.pipeline_repeats)
    x_BT, y_BT = (lax.with_sharding_constraint(a, NamedSharding(mesh, P("dp"))) for a in (x_BT, y_BT))
    metric_specs = {"ce": P(), "balance": P(), "tokens_per_expert": P(), "drop_rate": P()}
    platform = mesh.devices.flat[0].platform          # for the mesh's devices, whatever this process runs on
    loss = partial(_pipeline_loss, cfg=cfg, n_micro=n_micro, train=train, platform=platform)
    sharded = jax.shard_map(loss, mesh=mesh, in_specs=(param_specs(params, cfg.expert_parallel), P("dp"), P("dp"), P()),
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
    model = build(params, cfg)
    T = tokens_T.shape[0]

    def logits_at(h_D):
        return model.embed.logits(h_D[None, None], Axes())[0, 0, :cfg.vocab_size]

    def step(carry, p):
        tokens_T, caches = carry
        if use_cache:
            h_1TD, _, caches = model(tokens_T[p][None, None], positions_T=p[None], caches=caches)
            logits_V = logits_at(h_1TD[0, 0])
        else:
            h_1TD, _, _ = model(tokens_T[None])
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
    tokens_T, logits_PV = _decode(model_order(params), cfg, tokens_T, n_prompt, key, n_prompt + max_tokens,
                                  min(top_k, cfg.vocab_size), temperature, use_cache)
    new = [int(t) for t in tokens_T[n_prompt:n_prompt + max_tokens]]
    return (new, logits_PV[n_prompt - 1:]) if return_logits else new
