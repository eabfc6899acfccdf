"""The loss on the mesh: one `jax.shard_map` over ("slice", "dp", "pp", "tp") running the pipeline schedule over pp
(GPipe, or with --pipeline_repeats P > 1 a circular one, MaxText's num_pipeline_repeats), then the output
layer's cross-entropy (loss.py), or each row's for scoring tasks (`continuation_scores`); and the one-device
versions every mesh is checked against.
"""
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import sharding
from collectives import Axes, data_axes, psum_scatter, vary_like
from engine import engine_for
from loss import summarise
from sharding import Layout, build, model_order

WHOLE = PartitionSpec()          # a replicated value's spec (P in this file is the pipeline repeats)


def by_replica(mesh):
    """The spec of rows split over the data-parallel replicas, slice x dp (`data_axes`)."""
    return PartitionSpec(data_axes(mesh.shape["slice"]))


def replica_axes():
    """Inside shard_map: the axes the rows are split over."""
    return data_axes(lax.axis_size("slice"))


def one_device_loss(params, x_BT, y_BT, key, cfg, train=True):
    """Loss and metrics of a batch on one device, no mesh (params in any layout): the ground truth for
    every mesh."""
    axes = Axes(engine=engine_for(cfg))
    ctx = {"train": train, "key": key, "seq_ids": jnp.arange(x_BT.shape[0])}
    transformer = build(model_order(params), cfg)
    h_BTD, stats, _ = transformer(x_BT, axes, ctx=ctx)
    table_vD = transformer.output_table(axes, transformer.embed.gathered(axes))
    ce_sum = axes.engine.cross_entropy_sum(table_vD, h_BTD, y_BT, cfg, axes)
    return summarise(ce_sum, stats, x_BT.size, x_BT.shape[0], cfg)


def loss_and_metrics(params, x_BT, y_BT, key, cfg, mesh, n_micro, train=True):
    """Loss (cross-entropy + balance) and metrics of a global batch on `mesh`; differentiable in params.
    params in any layout (the one cfg.pipeline_repeats asks for costs no reshard)."""
    params = Layout(cfg.pipeline_repeats).store(params)
    rows = by_replica(mesh)
    x_BT, y_BT = (lax.with_sharding_constraint(a, NamedSharding(mesh, rows)) for a in (x_BT, y_BT))
    metric_specs = {"ce": WHOLE, "balance": WHOLE, "tokens_per_expert": WHOLE, "drop_rate": WHOLE}
    device = mesh.devices.flat[0]          # the engine is the mesh's devices', whatever this process runs on
    loss = partial(_pipeline_loss, cfg=cfg, n_micro=n_micro, train=train, device=device)
    sharded = jax.shard_map(loss, mesh=mesh, in_specs=(sharding.param_specs(params, cfg.expert_parallel), rows,
                                                       rows, WHOLE),
                            out_specs=(WHOLE, metric_specs), check_vma=True)
    return sharded(params, x_BT, y_BT, key)


def _pipeline_loss(params, x_bT, y_bT, key, cfg, n_micro, train, device):
    """On one device with its shards (`_pipeline_outputs`): the loss and metrics of the global batch."""
    if lax.axis_size("slice") > 1:
        # Every slice holds the same params: cast once, here, to vary over "slice", so that the gradient's one
        # all-reduce over DCN is this cast's transpose, on the fp32 shards [.., D/dp, ..], once a micro-step
        # (JAX would otherwise sum over slices at each use of a weight, every tick).
        params = jax.tree.map(lambda a: lax.pcast(a, "slice", to="varying"), params)
    out = _pipeline_outputs(params, x_bT, y_bT, key, cfg, n_micro, train, device)
    h_NTD, targets_NT = _last_stage_share(out)
    ce_sum = lax.psum(out.axes.engine.cross_entropy_sum(out.table_vD, h_NTD, targets_NT, cfg, out.axes),
                      (*replica_axes(), "pp"))
    b, n_dp = x_bT.shape[0], lax.axis_size(replica_axes())
    return summarise(ce_sum, _stats_in_model_order(out.stats), x_bT.size * n_dp, b * n_dp, cfg)


def continuation_scores(params, x_BT, y_BT, mask_BT, cfg, mesh, n_micro, window):
    """Each row's cross-entropy summed over its targets where mask is 1 and whether they are all the greedy
    choice [B] (fp32, rows over dp) of a global batch on `mesh`, the model in eval mode: what scoring a task's
    continuations needs (evals/scoring.py). Only each row's last `window` positions up to its continuation's end
    reach the output layer (a continuation is at most that long), not all T: its vocabulary-wide work is the
    largest part of a small model's forward."""
    params = Layout(cfg.pipeline_repeats).store(params)
    rows = by_replica(mesh)
    x_BT, y_BT, mask_BT = (lax.with_sharding_constraint(a, NamedSharding(mesh, rows)) for a in (x_BT, y_BT, mask_BT))
    scores = partial(_pipeline_continuation_scores, cfg=cfg, n_micro=n_micro, device=mesh.devices.flat[0],
                     window=window)
    sharded = jax.shard_map(scores, mesh=mesh, in_specs=(sharding.param_specs(params, cfg.expert_parallel), rows,
                                                         rows, rows),
                            out_specs=(rows, rows), check_vma=True)
    return sharded(params, x_BT, y_BT, mask_BT)


def one_device_token_scores(params, x_BT, y_BT, cfg):
    """Each token's cross-entropy and greedy flag [B, T] on one device, no mesh: the ground truth every mesh's
    continuation_scores is held to."""
    axes = Axes(engine=engine_for(cfg))
    transformer = build(model_order(params), cfg)
    h_BTD, _, _ = transformer(x_BT, axes, ctx={"train": False, "key": jax.random.key(0),
                                               "seq_ids": jnp.arange(x_BT.shape[0])})
    table_vD = transformer.output_table(axes, transformer.embed.gathered(axes))
    return axes.engine.token_scores(table_vD, h_BTD, y_BT, cfg, axes)


def _pipeline_continuation_scores(params, x_bT, y_bT, mask_bT, cfg, n_micro, device, window):
    """On one device: this dp replica's per-row summed cross-entropy and greedy flags [b]. Each stage scores
    its share of the outputs (`_last_stage_share`), M/pp micro-batches in order, at t = window of the T positions
    a row, [N, T, D] -> [N, t, D]; an all-gather over pp puts the rows together: [M/pp b/M] -> [b]."""
    out = _pipeline_outputs(params, x_bT, y_bT, jax.random.key(0), cfg, n_micro, False, device)
    h_NTD, targets_NT = _last_stage_share(out)
    M, T, n_stages = out.y_MbT.shape[0], out.y_MbT.shape[-1], lax.axis_size("pp")
    mask_NT = lax.dynamic_slice_in_dim(mask_bT.reshape(M, -1, T), lax.axis_index("pp") * (M // n_stages),
                                       M // n_stages).reshape(-1, T)
    end_N = T - jnp.argmax(mask_NT[:, ::-1] > 0, axis=1)               # one past the continuation's last target
    at_Nt = end_N[:, None] - window + jnp.arange(window)               # < 0: before the row starts, scores nothing
    index_Nt = jnp.clip(at_Nt, 0, T - 1)
    h_NtD = jnp.take_along_axis(h_NTD, index_Nt[..., None], axis=1)
    targets_Nt = jnp.take_along_axis(targets_NT, index_Nt, axis=1)
    scored_Nt = (jnp.take_along_axis(mask_NT, index_Nt, axis=1) > 0) & (at_Nt >= 0)
    nats_Nt, greedy_Nt = out.axes.engine.token_scores(out.table_vD, h_NtD, targets_Nt, cfg, out.axes)
    nats_N = jnp.sum(jnp.where(scored_Nt, nats_Nt, 0.0), axis=1)
    greedy_N = jnp.all(greedy_Nt | ~scored_Nt, axis=1)
    return tuple(lax.all_gather(a_N, "pp", axis=0, tiled=True, to="invarying") for a_N in (nats_N, greedy_N))


class _Outputs(NamedTuple):
    """What the schedule leaves on one device for the output layer (`_pipeline_outputs`)."""
    transformer: object
    table_vD: jax.Array          # the output table
    outputs_MbTD: jax.Array      # the last stage's outputs of the last repeat (zeros on the other stages)
    y_MbT: jax.Array             # their targets
    stats: dict                  # the per-block MoE stats [P, G] of this stage
    axes: Axes


def _pipeline_outputs(params, x_bT, y_bT, key, cfg, n_micro, train, device):
    """On one device with its shards: x_bT is this dp replica's b = B/dp sequences (the same on its pp and tp
    ranks); params["blocks"] this stage's P groups of G blocks (P = cfg.pipeline_repeats, G = blocks/(pp P),
    `sharding.Layout`), group r being blocks [(r pp + s) G, (r pp + s + 1) G) of stage s; GPipe is P = 1.
    The schedule (`schedule`) runs P M + pp - 1 ticks, each stage one item a tick: the bubble is
    (pp - 1)/(P M + pp - 1)."""
    axes = Axes("dp", "pp", "tp", expert_parallel=cfg.expert_parallel, engine=engine_for(cfg, device))
    P = cfg.pipeline_repeats
    n_stages, stage = lax.axis_size("pp"), lax.axis_index("pp")
    # Normalised on entry: the stage's blocks as [P, G, ...] whatever P (GPipe stores them as [G, ...]).
    blocks_PG = params["blocks"] if P > 1 else jax.tree.map(lambda a: a[None], params["blocks"])
    names = sharding.logical_axes(sharding.has_router_bias(params))
    prologue = ({"prologue": axes.engine.gather_stage(params["prologue"], "prologue", names, cfg, axes)}
                if cfg.first_k_dense else {})
    # The embedding, the first dense layers and the output layer (with any one repeat's blocks, unused).
    transformer = build(params | prologue | {"blocks": jax.tree.map(lambda a: a[0], blocks_PG)}, cfg)
    # FSDP, [P, G, .., D/dp, ..] -> [P, G, .., D, ..] (engine/fsdp.py). Guide: each layer all-gathers its weights
    # when called, every tick; here a stage's once a step (--fsdp_gather step) or a tick's blocks at each tick.
    if cfg.fsdp_gather == "step":
        blocks_PG = axes.engine.gather_stage(blocks_PG, "blocks", names, cfg, axes, lead=1)
        blocks_of = lambda r: jax.tree.map(lambda a: a[r], blocks_PG)
    else:
        blocks_of = lambda r: axes.engine.gather_stage(jax.tree.map(lambda a: a[r], blocks_PG), "blocks", names, cfg,
                                                       axes)
    b, T = x_bT.shape
    M, mb = n_micro, b // n_micro
    n_items, G = P * M, jax.tree.leaves(blocks_PG)[0].shape[1]
    positions_T = jnp.arange(T)
    table_vD = transformer.embed.gathered(axes)                                    # [v, D/dp] -> [v, D]
    x_MbT, y_MbT = x_bT.reshape(M, mb, T), y_bT.reshape(M, mb, T)
    emb_MbTD = transformer.embed(x_MbT, axes, table_vD)                            # [M, b/M, T, D]
    seq_base = lax.axis_index(replica_axes()) * b                                     # this replica's first row
    if cfg.first_k_dense:
        # DeepSeek-V3's first dense layers, before the pipeline: every stage runs them and stage 0's output is
        # used (a few layers of many; a stage of their own would idle the others as long).
        ctx = {"train": train, "key": key, "seq_ids": seq_base + jnp.arange(b)}
        emb_bTD, _ = transformer.run_prologue(emb_MbTD.reshape(b, T, -1), positions_T, axes, ctx)
        emb_MbTD = emb_bTD.reshape(emb_MbTD.shape)
    # Stage s -> s + 1, and with P > 1 the last stage back to stage 0 for the next repeat.
    ring = [(s, (s + 1) % n_stages) for s in range(n_stages if P > 1 else n_stages - 1)]

    # Guide: one block group per device per tick (the guide vmaps over every layer a device holds, each tick).
    def tick(carry, t):
        """Every stage works on its item of the schedule (`schedule`): a bubble is computed on stale data and
        masked out of every sum."""
        received_bTD, waiting_MbTD, outputs_MbTD, stats_sum = carry
        plan = schedule(t, stage, n_stages, M, P)
        # Stage 0's inputs wait in a buffer of M micro-batches, the embeddings at first: it files what the last
        # stage sent last tick, then reads its micro-batch (filed >= 0 ticks ago).
        waiting_MbTD = waiting_MbTD.at[plan.slot].set(
            jnp.where(plan.file, received_bTD, waiting_MbTD[plan.slot]))
        x_bTD = jnp.where(stage == 0, waiting_MbTD[plan.micro], received_bTD)
        ctx = {"train": train, "key": key, "seq_ids": seq_base + plan.micro * mb + jnp.arange(mb)}
        y_bTD, stats, _ = build(params | {"blocks": blocks_of(plan.repeat)}, cfg).run_blocks(
            x_bTD, positions_T, axes, ctx, first_block=(plan.repeat * n_stages + stage) * G)
        stats_sum = jax.tree.map(lambda acc, s: acc.at[plan.repeat].add(jnp.where(plan.valid, s, 0)), stats_sum, stats)
        outputs_MbTD = outputs_MbTD.at[plan.micro].set(jnp.where(plan.output, y_bTD, outputs_MbTD[plan.micro]))
        return (lax.ppermute(y_bTD, "pp", ring), waiting_MbTD, outputs_MbTD, stats_sum), None

    init = _initial_carry(emb_MbTD, P, G, cfg.n_experts)
    (_, _, outputs_MbTD, stats), _ = lax.scan(tick, init, jnp.arange(n_items + n_stages - 1))
    return _Outputs(transformer, transformer.output_table(axes, table_vD), outputs_MbTD, y_MbT, stats, axes)


class Tick(NamedTuple):
    """What one stage does at one tick: its item is micro-batch `micro` of repeat `repeat` (a bubble when
    not `valid`); stage 0 first files what the last stage sent it into buffer slot `slot` when `file`; the
    last stage files the item's output when `output` (the last repeat's)."""
    valid: jax.Array
    repeat: jax.Array
    micro: jax.Array
    slot: jax.Array
    file: jax.Array
    output: jax.Array


def schedule(t, stage, n_stages, M, P):
    """The pipeline schedule, a pure function of the tick t and the stage (traced or concrete). The P M items
    are the M micro-batches of each repeat, item i = r M + m; at tick t stage s works on item t - s with its
    blocks of repeat r, so items flow down the stages one tick apart. With P > 1 the last stage sends repeat
    r < P - 1's outputs back to stage 0, which receives item t - pp at tick t and files it until its next turn,
    M - pp ticks later (hence M >= pp). P M + pp - 1 ticks."""
    n_items = P * M
    i = t - stage
    valid = (i >= 0) & (i < n_items)
    i_clipped = jnp.clip(i, 0, n_items - 1)
    r, m = (0, i_clipped) if P == 1 else (i_clipped // M, i_clipped % M)
    back = t - n_stages
    slot = jnp.clip(back, 0, n_items - 1) % M
    file = (stage == 0) & (back >= 0) & (back < n_items - M)
    output = (stage == n_stages - 1) & valid & (r == P - 1)
    return Tick(valid, r, m, slot, file, output)


def _initial_carry(emb_MbTD, P, G, E):
    """The schedule's carry before tick 0: what stage s received (nothing yet), stage 0's buffer (the
    embeddings), the last stage's outputs and the per-block MoE stats [P, G] (zeros). They differ per dp
    replica and per stage: declared varying over both for check_vma."""
    zeros = lambda *shape, dtype=jnp.float32: lax.pcast(jnp.zeros(shape, dtype), (*replica_axes(), "pp"), to="varying")
    stats = {"balance": zeros(P, G), "dropped": zeros(P, G), "tokens_per_expert": zeros(P, G, E, dtype=jnp.int32)}
    received_bTD = zeros(*emb_MbTD.shape[1:])
    return received_bTD, vary_like((emb_MbTD,), (received_bTD,))[0], zeros(*emb_MbTD.shape), stats


def _stats_in_model_order(stats):
    """Per-block stats [P, G] per stage, gathered over pp to [P, blocks/P] (GPipe: stage s has blocks
    [s blocks/pp, (s+1) blocks/pp)), flattened to model order [blocks], summed over the replicas."""
    return {name: lax.psum(lax.all_gather(s, "pp", axis=1, tiled=True, to="invarying"), replica_axes()).reshape(-1, *s.shape[2:])
            for name, s in stats.items()}


def _last_stage_share(out):
    """This stage's share of the output layer's work: the pipeline's outputs, which only the last stage holds,
    reduce-scattered over pp, [M, b/M, T, D] -> [M/pp, b/M, T, D] (so the large-vocab output layer's work is
    split over the stages), final-normed, with their targets: ([M/pp b/M, T, D], [M/pp b/M, T])."""
    M, T, n_stages = out.y_MbT.shape[0], out.y_MbT.shape[-1], lax.axis_size("pp")
    mine_MbTD = psum_scatter(out.outputs_MbTD, "pp", 0)
    targets_MbT = lax.dynamic_slice_in_dim(out.y_MbT, lax.axis_index("pp") * (M // n_stages), M // n_stages)
    h_MbTD = out.transformer.final_norm(mine_MbTD)
    return h_MbTD.reshape(-1, T, h_MbTD.shape[-1]), targets_MbT.reshape(-1, T)
