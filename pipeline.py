"""The loss on the mesh: the pipeline schedule over pp inside one `jax.shard_map` over ("dp", "pp",
"tp"), the vocab-parallel chunked cross-entropy of the tied output layer, and the single-device
reference they are checked against; and the layout the pipeline stores the params in.
"""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import model
from sharding import Axes, axis_index, dot32, dp_dim, gather_over_dp, psum, sharded_axes, vary_like


# ----------------------------------------------------------------------------------------------
# The layout: stacked blocks as [blocks, ...] (GPipe) or [R, blocks/R, ...] (circular)


def model_order(params):
    """params with every stacked block leaf as [blocks, ...], in model order (undoes `pipeline_layout`;
    leaves already so are returned as they are)."""
    axes = model.logical_axes(True)

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
    return pipeline_layout(model.init_params(cfg, key), cfg.pipeline_repeats)


def init_sharded_params(cfg, key, mesh):
    """init_pipeline_params computed directly into the mesh layout (no host ever holds the full model)."""
    abstract = jax.eval_shape(partial(init_pipeline_params, cfg), key)
    return jax.jit(partial(init_pipeline_params, cfg), out_shardings=model.param_shardings(abstract, mesh, cfg.expert_parallel))(key)


def cross_entropy_sum(table_VD, h_BTD, targets_BT, cfg, axes):
    """Summed cross-entropy with the vocab split over tp (Megatron's parallel softmax), a chunk of
    whole sequences at a time. Per chunk each rank reduces its vocab rows to three numbers per token
    (the max logit, the sum of exponentials, the target's logit); the ranks then combine maxima,
    rescaled sums and the target logit, which exactly one rank holds. No fp32 logits outlive one
    chunk: memory is O(chunk x V/tp) whatever the batch.

    Differentiated, each chunk's gradients are computed with its loss (`_ce_fwd`), from the logits
    already there, so the backward pass recomputes nothing. table_VD is fp32 (`Embedding.gathered`),
    rounded to the matmul dtype once; its gradient is summed over the chunks in fp32."""
    # Guide: vocab-parallel cross-entropy over the tp-split table; no [B, T, V] logits are formed.
    V = table_VD.shape[0]
    vocab_start = axis_index(axes.tp) * V
    n_real = jnp.clip(cfg.vocab_size - vocab_start, 0, V)          # rows past the real vocab are padding
    local_targets_BT = targets_BT - vocab_start
    # A custom_vjp must hand back cotangents typed like its inputs, and the table's gradient varies
    # over every axis the tokens do (and the tokens' over tp). Casting both to the union first
    # makes JAX put the reductions in the cast's transpose: psum over dp/pp for the table (on top of
    # FSDP's reduce-scatter), over tp for the hidden states, both in fp32.
    table_VD, h_BTD = vary_like((table_VD, h_BTD), (table_VD, h_BTD, local_targets_BT, n_real))
    B, T, D = h_BTD.shape
    n = B // _sequences_per_chunk(B, T, GPU_CHUNK_TOKENS if axes.platform == "gpu" else CPU_CHUNK_TOKENS)
    with jax.named_scope("output_layer"):
        return _chunked_ce(jnp.dtype(cfg.model_dtype), axes, table_VD, h_BTD.reshape(n, -1, D),
                           local_targets_BT.reshape(n, -1), n_real)


# The fewest tokens a cross-entropy chunk holds. Below ~128 XLA:CPU's vocab-sized matmuls lose efficiency,
# above it memory grows for no speed. A GPU runs 15 kernels a chunk whatever its size: 8,192 tokens
# launch an eighth of 1,024's (one H200, moe1B: 4 chunks of 8 sequences, 420 kernels fewer, the same Σ
# and memory plan). A TPU keeps the CPU's: its plan is set by HBM (docs/performance.md).
CPU_CHUNK_TOKENS, GPU_CHUNK_TOKENS = 128, 8192


def _sequences_per_chunk(B, T, min_tokens):
    """Whole sequences per cross-entropy chunk: the fewest (dividing B) that make min_tokens."""
    return next(g for g in range(1, B + 1) if B % g == 0 and (g * T >= min_tokens or g == B))


def _exp_logits_VT(table_VD, h_TD, n_real):
    """exp(logits - max) [V, T] from operands in the matmul dtype, 0 on padding rows, and this rank's
    max. Vocab-major: XLA:CPU runs the gradient's products with it up to 2x faster than with
    token-major [T, V] (docs/performance.md)."""
    logits_VT = dot32("vd,td->vt", table_VD, h_TD)
    real_V1 = (jnp.arange(table_VD.shape[0]) < n_real)[:, None]
    max_T = jnp.max(jnp.where(real_V1, logits_VT, -jnp.inf), axis=0)
    return jnp.where(real_V1, jnp.exp(logits_VT - max_T), 0.0), max_T


def _target_rows(table_VD, local_targets_T, n_real):
    """Whether this rank holds each token's target, and the target's row of the table (or row 0/V-1)."""
    return _held(local_targets_T, n_real), table_VD[_clipped(local_targets_T, table_VD)]


def _held(local_targets, n_real):
    """Whether this rank's vocab rows hold each target."""
    return (local_targets >= 0) & (local_targets < n_real)


def _clipped(local_targets, table_VD):
    return jnp.clip(local_targets, 0, table_VD.shape[0] - 1)


def _chunk_ce(axes, table_r, h_r, local_targets_T, n_real):
    """One chunk's summed cross-entropy from operands in the matmul dtype, and what its gradient needs:
    exp(logit - local max) [V, T], d loss / d sum_exp per token (the combination's, over tp) and the
    target rows."""
    exp_VT, local_max_T = _exp_logits_VT(table_r, h_r, n_real)
    max_T = local_max_T if axes.tp is None else lax.pmax(local_max_T, axes.tp)
    rescale_T = jnp.exp(local_max_T - max_T)
    sum_exp_T = psum(jnp.sum(exp_VT, axis=0) * rescale_T, axes.tp)
    inside_T, rows_TD = _target_rows(table_r, local_targets_T, n_real)
    target_T = psum(jnp.where(inside_T, dot32("td,td->t", rows_TD, h_r), 0.0), axes.tp)
    ce = jnp.sum(max_T + jnp.log(sum_exp_T) - target_T)
    return ce, (exp_VT, 1 / sum_exp_T * rescale_T, inside_T, rows_TD)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_ce(dtype, axes, table_VD, h_NTD, local_targets_NT, n_real):
    """The summed cross-entropy of N chunks of tokens (`_chunk_ce` each, in a scan)."""
    table_r = table_VD.astype(dtype)
    _, ces = lax.scan(lambda _, c: (None, _chunk_ce(axes, table_r, c[0].astype(dtype), c[1], n_real)[0]), None,
                      (h_NTD, local_targets_NT))
    return jnp.sum(ces)


def _ce_fwd(dtype, axes, table_VD, h_NTD, local_targets_NT, n_real):
    """The loss and, with it, its gradients for a cotangent of 1 (the backward scales them): per chunk
    d logit[v, t] = exp(logit[v, t] - m[t]) c[t] - [v is t's target], c = d loss / d sum_exp, with c
    applied on the [T, D] side of both products and the target's term added in fp32, so the
    exponentials are the only [V, T] array. The table's gradient is summed over the chunks in an fp32
    carry; the target terms then go into it in one scatter-add of every token's hidden state (one
    pass over the [V, D] table, not one per chunk)."""
    table_r = table_VD.astype(dtype)

    def one(d_table_VD, chunk):
        h_TD, y_T = chunk
        h_r = h_TD.astype(dtype)
        ce, (exp_VT, c_T, inside_T, rows_TD) = _chunk_ce(axes, table_r, h_r, y_T, n_real)
        exp_VT, minus_T = exp_VT.astype(dtype), jnp.where(inside_T, -1.0, 0.0)
        d_h_TD = c_T[:, None] * dot32("vd,vt->td", table_r, exp_VT) + minus_T[:, None] * rows_TD.astype(jnp.float32)
        d_chunk_VD = dot32("vt,td->vd", exp_VT, (h_TD * c_T[:, None]).astype(dtype))
        return d_table_VD + d_chunk_VD, (ce, d_h_TD.astype(h_TD.dtype))

    zeros_VD, = vary_like((jnp.zeros(table_VD.shape, jnp.float32),), (table_VD,))
    d_table_VD, (ces, d_h_NTD) = lax.scan(one, zeros_VD, (h_NTD, local_targets_NT))
    targets_N, h_ND = local_targets_NT.reshape(-1), h_NTD.reshape(-1, h_NTD.shape[-1]).astype(dtype)
    d_table_VD = d_table_VD.at[_clipped(targets_N, table_VD)].add(
        jnp.where(_held(targets_N, n_real)[:, None], -h_ND.astype(jnp.float32), 0.0))
    return jnp.sum(ces), (d_table_VD.astype(table_VD.dtype), d_h_NTD)


def _ce_bwd(dtype, axes, residuals, g):
    """The gradients for cotangent g, each in its input's dtype (the residuals are)."""
    d_table_VD, d_h_NTD = residuals
    return (g * d_table_VD).astype(d_table_VD.dtype), (g * d_h_NTD).astype(d_h_NTD.dtype), None, None


_chunked_ce.defvjp(_ce_fwd, _ce_bwd)


def summarise(ce_sum, stats, n_tokens, n_sequences, cfg):
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


def reference_loss_and_metrics(params, x_BT, y_BT, key, cfg, train=True):
    ctx = {"train": train, "key": key, "seq_ids": jnp.arange(x_BT.shape[0])}
    transformer = model.build(model_order(params), cfg)
    h_BTD, stats, _ = transformer(x_BT, ctx=ctx)
    ce_sum = cross_entropy_sum(transformer.embed.gathered(Axes()), h_BTD, y_BT, cfg, Axes())
    return summarise(ce_sum, stats, x_BT.size, x_BT.shape[0], cfg)


# ----------------------------------------------------------------------------------------------
# The sharded path: one shard_map over ("dp", "pp", "tp") with a GPipe schedule over pp, or with
# cfg.pipeline_repeats = R > 1 a circular one (MaxText's num_pipeline_repeats).


def _pipeline_loss(params, x_BT, y_BT, key, cfg, n_micro, train, platform):
    """On one device with its shards: x_BT is this dp replica's [b, T] tokens (the same on its pp and tp
    ranks); params["blocks"] this stage's R groups of L blocks (R = cfg.pipeline_repeats, L = B/(pp R),
    `pipeline_layout`), group r being blocks [(r pp + s) L, (r pp + s + 1) L) of stage s; GPipe is R = 1.
    The R M items are the M micro-batches in each repeat (item i = r M + m). At tick t stage s works on
    item t - s with its blocks of repeat r and passes the result to stage s + 1; the last stage files
    repeat R - 1's outputs and sends the others back to stage 0, which keeps them until their next
    turn, M - pp ticks later (hence M >= pp). R M + pp - 1 ticks: the bubble is (pp - 1)/(R M + pp - 1)."""
    axes = sharded_axes(cfg, platform)
    R = cfg.pipeline_repeats
    n_stages, stage = lax.axis_size("pp"), lax.axis_index("pp")
    # Normalised on entry: the stage's blocks as [R, L, ...] whatever R (GPipe stores them as [L, ...]).
    blocks_RL = params["blocks"] if R > 1 else jax.tree.map(lambda a: a[None], params["blocks"])
    # The embedding and the output layer's modules (with any one repeat's blocks, unused).
    transformer = model.build(params | {"blocks": jax.tree.map(lambda a: a[0], blocks_RL)}, cfg)
    # Guide: each layer all-gathers its weights when called, every tick; here once a step, for all ticks.
    blocks_RL = _gathered_over_dp(blocks_RL, params, cfg, axes)
    blocks_of = lambda r: jax.tree.map(lambda a: a[r], blocks_RL)
    block_axes = dataclasses.replace(axes, dp_gathered=True)
    b, T = x_BT.shape
    M, mb = n_micro, b // n_micro
    n_items, blocks_per_stage = R * M, jax.tree.leaves(blocks_RL)[0].shape[1]
    positions_T = jnp.arange(T)
    table_VD = transformer.embed.gathered(axes)                                    # [V/tp, D/dp] -> [V/tp, D]
    x_MbT, y_MbT = x_BT.reshape(M, mb, T), y_BT.reshape(M, mb, T)
    emb_MbTD = transformer.embed(x_MbT, axes, table_VD)                             # [M, mb, T, D]
    seq_base = lax.axis_index("dp") * b
    # Stage s -> s + 1, and with R > 1 the last stage back to stage 0 for the next repeat.
    ring = [(s, (s + 1) % n_stages) for s in range(n_stages if R > 1 else n_stages - 1)]

    # Guide: one block group per device per tick (the guide vmaps over every layer a device holds, each tick).
    def tick(carry, t):
        """Every stage works on one item: stage s on item t - s (a bubble when outside [0, R M):
        computed on stale data and masked out of every sum)."""
        received_bTD, waiting_MbTD, outputs_MbTD, stats_sum = carry
        i = t - stage
        valid = (i >= 0) & (i < n_items)
        i_clipped = jnp.clip(i, 0, n_items - 1)
        r, m = (0, i_clipped) if R == 1 else (i_clipped // M, i_clipped % M)
        # Stage 0's inputs wait in a buffer of M micro-batches, the embeddings at first: it files what the
        # last stage sent last tick (its item t - pp) when that has a repeat to go (none when R = 1),
        # then reads micro-batch m (filed >= 0 ticks ago).
        back = t - n_stages
        slot = jnp.clip(back, 0, n_items - 1) % M
        file_it = (stage == 0) & (back >= 0) & (back < n_items - M)
        waiting_MbTD = waiting_MbTD.at[slot].set(jnp.where(file_it, received_bTD, waiting_MbTD[slot]))
        x_bTD = jnp.where(stage == 0, waiting_MbTD[m], received_bTD)
        ctx = {"train": train, "key": key, "seq_ids": seq_base + m * mb + jnp.arange(mb)}
        y_bTD, stats, _ = model.build(params | {"blocks": blocks_of(r)}, cfg).run_blocks(
            x_bTD, positions_T, block_axes, ctx, first_block=(r * n_stages + stage) * blocks_per_stage)
        stats_sum = jax.tree.map(lambda acc, s: acc.at[r].add(jnp.where(valid, s, 0)), stats_sum, stats)
        # The last stage files the last repeat's outputs; other stages keep their buffer at zero.
        keep = (stage == n_stages - 1) & valid & (r == R - 1)
        outputs_MbTD = outputs_MbTD.at[m].set(jnp.where(keep, y_bTD, outputs_MbTD[m]))
        return (lax.ppermute(y_bTD, "pp", ring), waiting_MbTD, outputs_MbTD, stats_sum), None

    init = _initial_carry(emb_MbTD, R, blocks_per_stage, cfg.n_experts)
    (_, _, outputs_MbTD, stats), _ = lax.scan(tick, init, jnp.arange(n_items + n_stages - 1))
    ce_sum = _output_layer_ce(transformer, table_VD, outputs_MbTD, y_MbT, cfg, axes)
    n_dp = lax.axis_size("dp")
    return summarise(ce_sum, _stats_in_model_order(stats), x_BT.size * n_dp, b * n_dp, cfg)


def _gathered_over_dp(blocks_RL, params, cfg, axes):
    """The stage's blocks all-gathered over dp once for the step, [R, L, .., D/dp, ..] -> [R, L, .., D, ..]
    (FSDP's gather hoisted out of the ticks: inside them every tick and the remat's replay gathered
    again; moe1B on v4-64: all-gathers 2.81 -> 0.61 GiB, reduce-scatters 4.32 -> 0.97 GiB a step, for
    3.8 GiB more HBM). In the weights' dtype and held in fp32, as the tied table is
    (`Embedding.gathered`): their gradient is summed over the ticks in fp32 and reduce-scattered once.
    Nothing to gather with one dp shard."""
    names = model.logical_axes(model.has_router_bias(params))

    def gather(path, a):
        path = ("blocks", *(k.key for k in path))
        dim = dp_dim(names[path], cfg.expert_parallel)
        if dim is None or lax.axis_size(axes.dp) == 1:
            return a
        return gather_over_dp(a, model.weight_dtype(path[-1], cfg), axes.dp, dim + 1).astype(jnp.float32)
    return jax.tree_util.tree_map_with_path(gather, blocks_RL)


def _initial_carry(emb_MbTD, R, L, E):
    """The schedule's carry before tick 0: what stage s received (nothing yet), stage 0's buffer (the
    embeddings), the last stage's outputs and the per-block MoE stats [R, L] (zeros). They differ per
    dp replica and per stage: declared varying over both for check_vma."""
    zeros = lambda *shape, dtype=jnp.float32: lax.pcast(jnp.zeros(shape, dtype), ("dp", "pp"), to="varying")
    stats = {"balance": zeros(R, L), "dropped": zeros(R, L), "tokens_per_expert": zeros(R, L, E, dtype=jnp.int32)}
    received_bTD = zeros(*emb_MbTD.shape[1:])
    return received_bTD, vary_like((emb_MbTD,), (received_bTD,))[0], zeros(*emb_MbTD.shape), stats


def _stats_in_model_order(stats):
    """Per-block stats [R, L] per stage, gathered over pp to [R, B/R] (GPipe: stage s has blocks
    [s B/pp, (s+1) B/pp)), flattened to model order [B], summed over dp."""
    return {name: lax.psum(lax.all_gather(s, "pp", axis=1, tiled=True, to="invarying"), "dp").reshape(-1, *s.shape[2:])
            for name, s in stats.items()}


def _output_layer_ce(transformer, table_VD, outputs_MbTD, y_MbT, cfg, axes):
    """The summed cross-entropy of the pipeline's outputs, which only the last stage holds: a
    reduce-scatter over pp hands each stage M/pp of them, so the (large-vocab) output layer's work is
    split over the stages, [M, mb, T, D] -> [M/pp, mb, T, D]; summed over dp and pp."""
    M, T, n_stages = y_MbT.shape[0], y_MbT.shape[-1], lax.axis_size("pp")
    mine_MbTD = lax.psum_scatter(outputs_MbTD, "pp", scatter_dimension=0, tiled=True)
    targets_MbT = lax.dynamic_slice_in_dim(y_MbT, lax.axis_index("pp") * (M // n_stages), M // n_stages)
    h_MbTD = transformer.final_norm(mine_MbTD)
    return lax.psum(cross_entropy_sum(table_VD, h_MbTD.reshape(-1, T, h_MbTD.shape[-1]), targets_MbT.reshape(-1, T),
                                      cfg, axes), ("dp", "pp"))


def loss_and_metrics(params, x_BT, y_BT, key, cfg, mesh, n_micro, train=True):
    """Loss (cross-entropy + balance) and metrics of a global batch on `mesh`; differentiable in params.
    params in either layout (`pipeline_layout`; the one cfg.pipeline_repeats asks for costs no reshard)."""
    params = pipeline_layout(params, cfg.pipeline_repeats)
    x_BT, y_BT = (lax.with_sharding_constraint(a, NamedSharding(mesh, P("dp"))) for a in (x_BT, y_BT))
    metric_specs = {"ce": P(), "balance": P(), "tokens_per_expert": P(), "drop_rate": P()}
    platform = mesh.devices.flat[0].platform          # for the mesh's devices, whatever this process runs on
    loss = partial(_pipeline_loss, cfg=cfg, n_micro=n_micro, train=train, platform=platform)
    sharded = jax.shard_map(loss, mesh=mesh, in_specs=(model.param_specs(params, cfg.expert_parallel), P("dp"), P("dp"), P()),
                            out_specs=(P(), metric_specs), check_vma=True)
    return sharded(params, x_BT, y_BT, key)
