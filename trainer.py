"""The training step as main.py runs it, bench.py times it and planning/ compiles it: the optimizer
(global-norm clipping, AdamW, the spike watch), gradient accumulation over --grad_step micro-steps,
the guard that keeps a non-finite step out of the state, the eval and scoring steps, and the training state's
layout on the mesh. The state is one pytree: {"params", "opt_state", "key", "router_bias"}.
"""
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import pipeline
import sharding
import utils
from collectives import data_axes
from engine import engine_for, matmul_precision
from optimizer import in_one_pass, lr_schedule, make_optimizer


class Trainer(NamedTuple):
    step: Callable              # step(state, (xs, ys)) -> (state, metrics), jitted, donates the state
    eval_step: Callable         # eval_step(params, router_bias, x, y) -> (val CE, balance term), jitted
    score_step: Callable        # score_step(params, router_bias, x, y, mask, window) -> each row's (nats, greedy) [B],
                                # jitted (the two compiled by compile_interval_steps; this one then a ScoreSteps)
    fresh_state: Callable       # fresh_state(seed) -> a new training state on the mesh
    abstract_state: dict        # the state's shapes, dtypes and shardings (restore targets, compiling)
    schedule: Callable          # the learning rate of an update, by step index (jitted: one program, not one per op)
    data_sharding: NamedSharding  # a global batch [sequences, T]: sequences over the replicas (slice x dp), whole rows


def build_trainer(cfg, mesh):
    """The jitted training and eval steps for cfg on mesh, and the training state's layout."""
    abstract_params = jax.eval_shape(partial(sharding.init_stored_params, cfg.model), jax.random.key(0))
    optimizer = make_optimizer(cfg.optim, abstract_params)
    shardings, abstract_state = state_layout(cfg, optimizer, abstract_params, mesh)
    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P(data_axes(mesh.shape["slice"]), None))
    micro_steps = (data,) * cfg.optim.grad_step
    step = jax.jit(partial(train_step, cfg=cfg, mesh=mesh, optimizer=optimizer),
                   in_shardings=(shardings, (micro_steps, micro_steps)), out_shardings=(shardings, replicated),
                   donate_argnums=(0,))
    evaluate = jax.jit(partial(eval_step, cfg=cfg, mesh=mesh),
                       in_shardings=(shardings["params"], replicated, data, data))
    score = jax.jit(partial(score_step, cfg=cfg, mesh=mesh), static_argnums=5,
                    in_shardings=(shardings["params"], replicated, data, data, data), out_shardings=replicated)
    return Trainer(step, evaluate, score, partial(init_state, cfg, optimizer, shardings, mesh), abstract_state,
                   jax.jit(lr_schedule(cfg.optim)), data)


def abstract_step_args(cfg, trainer):
    """The arguments of the train and eval steps as shapes, dtypes and shardings, for compiling without
    data: ((state, (xs, ys)), (params, router_bias, x, y)). A global batch of token ids [sequences, T]
    laid out over dp: utils.global_batch per micro-step, --val_batch_size to evaluate."""
    batch = lambda rows: jax.ShapeDtypeStruct((rows, cfg.model.T), jnp.int32, sharding=trainer.data_sharding)
    state, micro_steps, val = trainer.abstract_state, (batch(utils.global_batch(cfg)),) * cfg.optim.grad_step, \
        batch(cfg.run.val_batch_size)
    return (state, (micro_steps, micro_steps)), (state["params"], state["router_bias"], val, val)


class ScoreSteps(NamedTuple):
    """The score step compiled for the shapes a run's tasks take, called as the jitted one is."""
    programs: dict              # (rows, width, window) -> the score step compiled for [rows, width] ids and window

    def __call__(self, params, router_bias, x, y, mask, window):
        return self.programs[(*x.shape, window)](params, router_bias, x, y, mask)


def compile_interval_steps(cfg, trainer, score_shapes):
    """trainer with what an interval's end runs compiled now, before the first step: the eval step, the learning
    rate's schedule (each step's record reads it) and the score step for each (rows, width, window) of
    score_shapes (scoring.TaskScorer.shapes). The loop then compiles nothing (main.compile_programs)."""
    _, eval_args = abstract_step_args(cfg, trainer)
    params, router_bias = eval_args[:2]
    ids = lambda rows, width: jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=trainer.data_sharding)
    scores = {(rows, width, window): trainer.score_step.lower(params, router_bias, *[ids(rows, width)] * 3,
                                                              window).compile()
              for rows, width, window in score_shapes}
    # the step records call the schedule with a Python int (a weak int32): compiled here, jit's cache serves them
    trainer.schedule.lower(jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)).compile()
    return trainer._replace(eval_step=trainer.eval_step.lower(*eval_args).compile(), score_step=ScoreSteps(scores))


def state_layout(cfg, optimizer, abstract_params, mesh):
    """(shardings, abstract state) of the training state: params and their optimizer moments sharded
    as sharding.param_shardings says, everything else replicated. The aux-loss-free routing bias [blocks,
    E] (update_router_bias) is tiny, and equal on every device because every device computes its
    update from the same global counts."""
    replicated = NamedSharding(mesh, P())
    param_shardings = sharding.param_shardings(abstract_params, mesh, cfg.model.expert_parallel)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    shardings = {"params": param_shardings, "key": replicated, "router_bias": replicated,
                 "opt_state": optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_shardings,
                                                    transform_non_params=lambda _: replicated)}
    shapes = {"params": abstract_params, "opt_state": abstract_opt,
              "key": jax.ShapeDtypeStruct(jax.random.key_data(jax.random.key(0)).shape, jnp.uint32),
              "router_bias": jax.ShapeDtypeStruct((cfg.model.blocks, cfg.model.n_experts), jnp.float32)}
    return shardings, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                                   shardings)


def init_state(cfg, optimizer, shardings, mesh, seed):
    """A fresh training state, computed straight into its shardings (no host holds the whole model)."""
    init_key, train_key = jax.random.split(jax.random.key(seed))
    params = sharding.init_sharded_params(cfg.model, init_key, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    # The key committed to the mesh like the train step's output, so step 2 reuses step 1's executable.
    return {"params": params, "opt_state": opt_state,
            "key": jax.device_put(jax.random.key_data(train_key), shardings["key"]),
            "router_bias": jax.device_put(jnp.zeros((cfg.model.blocks, cfg.model.n_experts), jnp.float32),
                                          shardings["router_bias"])}


def train_step(state, batch, *, cfg, mesh, optimizer):
    """One optimizer update from --grad_step micro-steps: (state, (xs, ys)) -> (state, metrics)."""
    key, step_key = jax.random.split(jax.random.wrap_key_data(state["key"]))
    with matmul_precision(cfg.model.model_dtype):
        grads, metrics = accumulate_gradients(state["params"], state["router_bias"], batch, step_key, cfg, mesh)
    with jax.named_scope("optimizer"):           # the update's kernels, for bench.py --profile
        metrics["grad_norm"] = optax.tree.norm(grads)
        # Guide: the update runs inside shard_map; here outside it, on global arrays that jit partitions.
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        metrics["grad_norm_ratio"], metrics["skipped"] = opt_state.ratio, opt_state.skipped
        # A step skipped as a spike leaves the routing bias as it was, like the parameters.
        router_bias = jnp.where(opt_state.skipped > state["opt_state"].skipped, state["router_bias"],
                                update_router_bias(state["router_bias"], metrics["tokens_per_expert"],
                                                   cfg.optim.bias_update_rate))
        updated = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                   "router_bias": router_bias}
        # A non-finite loss or gradient leaves params, moments and routing bias as they were, so no
        # checkpoint ever holds a NaN. That suffices: a finite global norm means every g^2 is finite, so
        # Adam's moments stay finite and its update divides by at least eps (--b2 < 1). Parameters that an
        # absurd finite --max_lr overflows make the next loss non-finite, and save_checkpoint refuses such
        # a state. (Testing the updated state itself would be a pass over all of it.) The test reads
        # replicated scalars: every device takes the same decision.
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        metrics["nonfinite"] = ~finite
        kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated,
                            {name: state[name] for name in updated})
        kernel = engine_for(cfg.model, mesh.devices.flat[0]).optimizer_kernel()
        if kernel is not None:
            kept = in_one_pass(kept, state, grads, metrics["grad_norm"], finite, cfg.optim, kernel, mesh,
                               sharding.param_specs(state["params"], cfg.model.expert_parallel))
    return kept | {"key": jax.random.key_data(key)}, metrics


def accumulate_gradients(params, router_bias, batch, key, cfg, mesh):
    """(gradient, metrics) averaged over the micro-steps of batch = (xs, ys), except the routed-choice
    counts, which stay sums: the bias update and the log interval's loads count the whole global batch.
    Gradients of the params only: the routing bias is state the loss reads, not a parameter."""
    xs, ys = batch
    micro_steps = len(xs)
    grad_fn = jax.value_and_grad(lambda p, x, y, k: pipeline.loss_and_metrics(
        sharding.with_router_bias(p, router_bias), x, y, k, cfg.model, mesh, cfg.run.micro_batch_size, True),
        has_aux=True)

    def micro(sums, inputs):
        x, y, i = inputs
        (loss, metrics), g = grad_fn(params, x, y, jax.random.fold_in(key, i))
        return jax.tree.map(jnp.add, sums, (g, {"loss": loss, **metrics})), None

    if micro_steps == 1:       # nothing to sum: no zeros to start from, whose shapes cost a trace of the loss
        (loss, metrics), grads = grad_fn(params, xs[0], ys[0], jax.random.fold_in(key, 0))
        return grads, {"loss": loss, **metrics}
    loss, metrics = jax.eval_shape(grad_fn, params, xs[0], ys[0], key)[0]
    zeros = (jax.tree.map(jnp.zeros_like, params),
             jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), {"loss": loss, **metrics}))
    (grads, sums), _ = jax.lax.scan(micro, zeros, (jnp.stack(xs), jnp.stack(ys), jnp.arange(micro_steps)))
    grads = jax.tree.map(lambda g: g / micro_steps, grads)
    return grads, {name: s if name == "tokens_per_expert" else s / micro_steps for name, s in sums.items()}


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


def eval_step(params, router_bias, x, y, *, cfg, mesh):
    with matmul_precision(cfg.model.model_dtype):
        _, metrics = pipeline.loss_and_metrics(sharding.with_router_bias(params, router_bias), x, y,
                                               jax.random.key(0), cfg.model, mesh, cfg.run.micro_batch_size, False)
    return metrics["ce"], jnp.sum(metrics["balance"])


def score_step(params, router_bias, x, y, mask, window, *, cfg, mesh):
    """Each row's cross-entropy summed over its targets where mask is 1 [B] (fp32), in eval mode: minus the
    log-likelihood of a task's continuation (evals/scoring.py); and whether each of those targets is the greedy
    choice [B] (lm-evaluation-harness's is_greedy). window (static): the longest continuation's tokens, at
    most T (pipeline.continuation_scores)."""
    with matmul_precision(cfg.model.model_dtype):
        return pipeline.continuation_scores(sharding.with_router_bias(params, router_bias), x, y, mask, cfg.model,
                                            mesh, cfg.run.micro_batch_size, window)
