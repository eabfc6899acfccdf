"""The work of tests/test_tpu.py's checks, each in a process of its own (one process at a time holds a TPU chip;
the test process stays on the CPU). Every result is one JSON line on stdout.

    python tests/chip_checks.py CHECK [CHECK ...]

A CHECK is `fp32` (the tiny preset's first three steps in fp32: loss, grad norm), `attention` (the TPU attention
kernel's and XLA's bf16 attention against fp32, at the one-chip preset's shapes), `grouped` (the grouped
matmuls of --moe_impl ragged, lax's and megablox's, against fp32 products), `optimizer` (the one-pass update
against optax's chain) or a memory case (MODEL's flags +
CASE's: the compiler's verdict and plan, measure.planned_gib, and what the device held after three steps: its buffers,
bytes_in_use, and the program's reserved temporaries, bytes_reserved). One process runs them all: each start and
shutdown of a TPU runtime costs tens of seconds.
"""
import functools
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import engine  # noqa: E402
import model  # noqa: E402
import sharding  # noqa: E402
import utils  # noqa: E402
from bench import build_step  # noqa: E402
from engine import attention_kernels, expert_kernels, tpu_attention  # noqa: E402
from planning import measure  # noqa: E402
from scripts import levers  # noqa: E402

GiB = 2**30
# the moe1B preset's layers at 4 blocks of 6 on one chip: a model at the edge of a 16 GiB chip
MODEL = ("--model_dimension 768 --n_head 12 --blocks 4 --layers_per_block 6 --T 1024 --latent_dim 128 --q_latent_dim 128 "
         "--dhR 128 --n_experts 16 --n_shared 2 --capacity_factor 1.5 --val_batch_size 8 --n_device_axis 1 1 1").split()
# MODEL at the edge of a v5e chip's 15.75 GiB, as one chip met it on 2026-12-06 (jax 0.10.2, libtpu 0.0.42.1;
# docs/performance-log.md#2026-12-06-tpu-memory-plans): the GiB it held running each that fits (its buffers and
# the program's reserved temporaries, after three steps), and the GiB its compiler said each it refused needs
V5E_HELD = {"--train_batch_size 16 --micro_batch_size 1 --remat full": 11.64,
            "--train_batch_size 8 --micro_batch_size 1 --remat dots": 13.95,
            "--train_batch_size 8 --micro_batch_size 1 --remat dots --moe_impl ragged --capacity_factor 0": 13.62,
            "--train_batch_size 24 --micro_batch_size 1 --remat full": 12.83}
# (--remat none at 8 sequences left this list when a TPU's layers came to be traced apart: it fits now;
# docs/performance-log.md#2026-12-07-tpu-layers-apart)
V5E_REFUSED = {"--train_batch_size 8 --micro_batch_size 2 --remat dots": 16.51,
               "--train_batch_size 12 --micro_batch_size 1 --remat dots": 16.40}
PLAN_TOLERANCE = 0.15       # a plan that fits is within this share of what the chip holds


def memory(case):
    cfg = utils.config_from_args(MODEL + case.split())
    step, fresh_state, make_batch, abstract_args = build_step(cfg, sharding.run_mesh(cfg.run))
    compiled, needed = measure.compiled_or_shortfall(step, abstract_args())
    if compiled is None:
        return {"case": case, "refused": True, "needed_gib": needed}
    planned = measure.planned_gib(compiled.memory_analysis(), jax.devices()[0].platform)
    state, data = fresh_state(0), make_batch(1)
    for _ in range(3):
        state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    stats = jax.devices()[0].memory_stats()
    held = stats["bytes_in_use"] + stats.get("bytes_reserved", 0)
    del state, data, metrics, compiled
    gc.collect()                # the program's reservation goes with it, before the next case compiles
    return {"case": case, "refused": False, "planned_gib": planned, "held_gib": held / GiB,
            "usable_gib": stats["bytes_limit"] / GiB}


def fp32():
    cfg = utils.config_from_args(["--preset", "tiny", "--model_dtype", "float32", "--n_device_axis", "1", "1", "1"])
    step, fresh_state, make_batch, _ = build_step(cfg, sharding.run_mesh(cfg.run))
    state, steps = fresh_state(0), []
    for i in range(3):
        state, metrics = step(state, make_batch(100 + i))
        steps.append([float(metrics["loss"]), float(metrics["grad_norm"])])
    return {"platform": jax.default_backend(), "steps": steps}


def optimizer():
    """The largest difference (its share of the leaf's largest value) of each state leaf after the tiny preset's first
    step in fp32, the update by engine/tpu_update.py's kernel (the fast engine's on a TPU) against optax's chain."""
    engine.ENGINES["chain"] = levers.OptimizerInXla
    cfg = utils.config_from_args(["--preset", "tiny", "--model_dtype", "float32", "--n_device_axis", "1", "1", "1"])
    states = []
    for name in ("fast", "chain"):
        step, fresh_state, make_batch, _ = build_step(utils.override(cfg, engine=name), sharding.run_mesh(cfg.run))
        states.append(jax.device_get(step(fresh_state(0), make_batch(100))[0]))
    return {"check": "optimizer", "platform": jax.default_backend(),
            "shares": {jax.tree_util.keystr(path): _share(a, b) for (path, a), b in
                       zip(jax.tree_util.tree_leaves_with_path(states[0]), jax.tree.leaves(states[1]))}}


def _share(a, b):
    """The largest difference of a and b, as a share of b's largest value; their NaNs (the spike window's unseen
    norms) where each other's or the share is inf; integers: 1.0 if any differs."""
    if a.dtype.kind != "f":
        return float((a != b).any())
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return float("inf")
    seen = ~np.isnan(b)
    return float(np.abs(a - b)[seen].max(initial=0.0) / max(np.abs(b)[seen].max(initial=0.0), 1e-30))


def attention():
    """The largest error against fp32 (its share of the fp32 value's largest) of the output and the gradients of
    q, k, v (and RoPE's q and key) of sum(attention * w), for the kernel (engine/tpu_attention.py: the parts as
    they are) and XLA's path (q and k joined), both in bf16, at the one-chip preset's sequences (8 of 1,024), 12
    heads and MLA's widths (content 64 and RoPE 128, or none; v 64)."""
    def run(attention, dtype, w, *operands):
        out, vjp = jax.vjp(lambda *args: attention(*args).astype(jnp.float32), *(x.astype(dtype) for x in operands))
        return [out, *(g.astype(jnp.float32) for g in vjp(w))]

    def xla(dtype):
        return lambda q, k, v, *rotary: attention_kernels.xla_attention(
            *model.decoupled_rope_qk(q, k, rotary or None, dtype), v, None, dtype)
    errors = {}
    for K, R, J in ((64, 128, 64), (64, 0, 64)):
        keys = jax.random.split(jax.random.key(0), 6)
        q, k = (jax.random.normal(key, (8, 1024, 12, K), jnp.float32) for key in keys[:2])
        v, w = (jax.random.normal(key, (8, 1024, 12, J), jnp.float32) for key in keys[2:4])
        rotary = (jax.random.normal(keys[4], (8, 1024, 12, R)), jax.random.normal(keys[5], (8, 1024, R))) if R else ()
        # the operands are arguments: closed over, they are constants the compiler folds for minutes
        with jax.default_matmul_precision("highest"):
            fp32 = jax.jit(functools.partial(run, xla(jnp.float32), jnp.float32))(w, q, k, v, *rotary)
        for name, attention in (("kernel", tpu_attention.attention), ("xla", xla(jnp.bfloat16))):
            got = jax.jit(functools.partial(run, attention, jnp.bfloat16))(w, q, k, v, *rotary)
            errors[f"{name} {K + R}/{J}"] = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                                             for a, b in zip(got, fp32)]
    return {"check": "attention", "platform": jax.default_backend(), "errors": errors}


def grouped():
    """The largest error (its share of the largest value) of each of --moe_impl ragged's grouped products
    (expert_kernels' ROWS, ROWS_T, PER_GROUP) of bf16 operands, by lax.ragged_dot_general and by megablox,
    against one fp32 product per group: 1,024 rows in 8 groups, one empty, and 128 rows past the groups
    (the dropped choices, whose outputs must be 0)."""
    N, D, F = 1024, 768, 512
    sizes_E = jnp.array([200, 0, 130, 90, 256, 50, 100, 70], jnp.int32)
    group_NE = jax.nn.one_hot(jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(N), side="right"), len(sizes_E))
    keys = jax.random.split(jax.random.key(0), 4)
    x_ND, g_NF = (jax.random.normal(key, shape).astype(jnp.bfloat16) for key, shape in zip(keys, [(N, D), (N, F)]))
    w_EDF = jax.random.normal(keys[2], (len(sizes_E), D, F)).astype(jnp.bfloat16)
    cases = {"rows": (x_ND, w_EDF, expert_kernels.ROWS, "nd,edf,ne->nf"),
             "rows_t": (g_NF, w_EDF, expert_kernels.ROWS_T, "nf,edf,ne->nd"),
             "per_group": (x_ND, g_NF, expert_kernels.PER_GROUP, "nd,nf,ne->edf")}
    errors = {}
    with jax.set_mesh(jax.sharding.Mesh(jax.devices()[:1], ("one",))):         # the kernels' shard_map needs one
        for name, (a, b, dims, spec) in cases.items():
            want = jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), group_NE, precision="highest")
            for kernel_name, kernel in (("lax", None), ("megablox", expert_kernels.megablox_grouped)):
                got = jax.jit(functools.partial(expert_kernels._grouped, dims=dims, kernel=kernel))(a, b, sizes_E)
                errors[f"{kernel_name} {name}"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    return {"check": "grouped", "platform": jax.default_backend(), "errors": errors}


CHECKS = {"fp32": fp32, "attention": attention, "grouped": grouped, "optimizer": optimizer}

if __name__ == "__main__":
    jnp.zeros(()).block_until_ready()        # the device is opened before anything is timed or measured
    for check in sys.argv[1:]:
        print(json.dumps(CHECKS[check]() if check in CHECKS else memory(check)), flush=True)
