"""The TPU's attention kernel (engine/tpu_attention.py) computes model.masked_attention's causal attention:
in fp32, run here by Pallas' interpret mode, its output and the gradients of q, k and v equal the one
masked softmax's at MLA's head widths (q.k wider than v) and several blocks a sequence; inside a shard_map
over heads; and in the whole model, behind the attention seam, on a mesh with pp and tp, where it gives the XLA path's loss and every gradient. Compiled for a TPU by libtpu here, its
products count in the program's matmul FLOPs. On the chip: tests/test_tpu.py."""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import engine
import hardware
import hlo
import model
import pipeline
import sharding
from jax.experimental.pallas import tpu as pltpu

from engine import attention_kernels, products, tpu_attention
from model_util import CFG, KEY, batch, rel_err, sharded_value_and_grad, with_model


def causal_reference(q_BThQ, k_BShQ, v_BShJ):
    T = q_BThQ.shape[1]
    return model.masked_attention(q_BThQ, k_BShQ, v_BShJ, jnp.tril(jnp.ones((T, T), bool)), q_BThQ.dtype, products.mm)


def operands(B, T, h, Q, J, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k = (jax.random.normal(key, (B, T, h, Q), jnp.float32) for key in keys[:2])
    v, w = (jax.random.normal(key, (B, T, h, J), jnp.float32) for key in keys[2:])
    return q, k, v, w


def value_and_grads(attention, q, k, v, w):
    """The output and the gradients of q, k, v of sum(attention(q, k, v) * w)."""
    out, vjp = jax.vjp(attention, q, k, v)
    return (out, *vjp(w))


@pytest.mark.parametrize("T,block,Q,J", [(256, 128, 48, 16), (384, 128, 24, 8), (64, 16, 12, 4)])
def test_the_kernel_equals_one_masked_softmax_in_fp32(T, block, Q, J):
    """Blocks of 2, 3 and 4 a sequence (the diagonal's masked, the ones above it skipped)."""
    q, k, v, w = operands(2, T, 3, Q, J)
    with jax.default_matmul_precision("highest"):
        kernel = functools.partial(tpu_attention.attention, block=block, interpret=pltpu.InterpretParams())
        # jitted: run op by op, the reference's gradient compiled each of its operations apart
        got, want = (jax.jit(functools.partial(value_and_grads, f))(q, k, v, w) for f in (kernel, causal_reference))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(a, b) < 1e-5, name


def test_the_kernel_runs_inside_a_shard_map_over_heads_and_sequences():
    """Each device its sequences' heads (dp x tp 2 x 4 of the 8 devices), the outputs varying as q does."""
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    spec = PartitionSpec("dp", None, "tp", None)
    q, k, v, w = operands(4, 128, 8, 24, 8, seed=1)
    kernel = jax.shard_map(functools.partial(tpu_attention.attention, block=64, interpret=pltpu.InterpretParams()), mesh=mesh,
                           in_specs=(spec,) * 3, out_specs=spec)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, w)]
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda *a: value_and_grads(kernel, *a))(*placed)
        want = jax.jit(functools.partial(value_and_grads, causal_reference))(q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(a, b) < 1e-5, name


@dataclasses.dataclass(frozen=True)
class InterpretedKernel(engine.Fast):
    """The fast engine with the TPU kernel at its attention seam as a TPU's runs it (bf16 there), in fp32 here."""

    def attention(self, q_BThQ, k_BShQ, v_BShJ, mask_TS, dtype):
        if mask_TS is not None:
            return super().attention(q_BThQ, k_BShQ, v_BShJ, mask_TS, dtype)
        return tpu_attention.attention(q_BThQ, k_BShQ, v_BShJ, block=8, interpret=pltpu.InterpretParams())


def test_the_model_with_the_kernel_gives_the_xla_paths_loss_and_gradients(monkeypatch):
    """CFG's first 2 blocks (T 16: two kernel blocks of 8) on mesh 1 x 2 x 4 (pp 2, tp 4: 2 of the 8 heads a
    device), against the fast engine's one-device run. (Not under a remat: the interpreter's callbacks are
    effects, which jax.checkpoint refuses; tests/test_tpu.py runs the chip's under --remat full.) A batch of 4
    sequences, 2 a micro-batch: the interpreter's run grows with the kernel's grid (sequences x heads), 16
    sequences took a minute of its run."""
    monkeypatch.setitem(engine.ENGINES, "interpreted_kernel", InterpretedKernel)
    small = with_model(CFG, blocks=2)
    params, (x, y) = sharding.init_params(small, KEY), batch(n=4)
    (want_loss, _), want_grads = jax.jit(jax.value_and_grad(
        lambda p: pipeline.one_device_loss(p, x, y, KEY, small), has_aux=True))(params)
    cfg = with_model(small, engine="interpreted_kernel")
    mesh = sharding.make_mesh((1, 2, 4))
    placed = jax.device_put(params, sharding.param_shardings(params, mesh, cfg.expert_parallel))
    (loss, _), grads = sharded_value_and_grad(cfg, mesh, 2)(placed, x, y)
    assert rel_err(loss, want_loss) < 1e-5
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                                 jax.tree.leaves(sharding.model_order(grads))):
        assert rel_err(got, want) < 1e-5, jax.tree_util.keystr(path)


def test_the_fast_engine_runs_the_kernel_only_on_a_tpu_in_bf16():
    """The attention seam's choice, read from the traced program: a TPU's bf16 causal attention is the
    kernel (a pallas_call), its fp32 one and every other platform's are not; the CPU's program is
    unchanged (tests/test_golden_program.py)."""
    q, k, v, _ = operands(1, 256, 2, 24, 8)

    def traced(platform, dtype):
        f = lambda q, k, v: attention_kernels.attention(q, k, v, None, dtype, platform)
        return str(jax.make_jaxpr(f)(*(x.astype(dtype) for x in (q, k, v))))
    assert "pallas_call" in traced("tpu", jnp.bfloat16)
    for platform, dtype in (("tpu", jnp.float32), ("cpu", jnp.bfloat16), (None, jnp.bfloat16)):
        assert "pallas_call" not in traced(platform, dtype), (platform, dtype)
    assert tpu_attention.takes(1024) and not tpu_attention.takes(tpu_attention.MAX_T * 2)
    assert not tpu_attention.takes(100)             # no block divides it: XLA's path


@pytest.mark.parametrize("policy", sorted(engine.REMAT_POLICIES))
def test_the_layers_remat_runs_the_kernels_forward_again(policy):
    """No remat policy keeps the kernel's outputs (the layer scans' stacking of them cost more than its forward
    run again): the gradient of a rematted layer holds three kernels, the forward, its replay and the backward."""
    q, k, v, w = (x.astype(jnp.bfloat16) for x in operands(1, 256, 2, 24, 8))
    layer = lambda q, k, v: jnp.sum(engine.Fast("tpu").attention(q, k, v, None, jnp.bfloat16) * w)
    grad = jax.grad(jax.checkpoint(layer, policy=engine.REMAT_POLICIES[policy]), argnums=(0, 1, 2))
    assert str(jax.make_jaxpr(grad)(q, k, v)).count("pallas_call[") == 3


def test_the_kernels_products_count_in_a_tpu_programs_matmul_flops():
    """Compiled for a v5e here (libtpu's compiler), the kernel's products are counted (hlo.matmul_flops reads the
    FLOPs it declares: its block pairs on and below the diagonal), the forward's and the backward's apart."""
    pytest.importorskip("libtpu", reason="pip install -r requirements-tpu.txt")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")     # other test processes may hold libtpu
    from planning import measure
    device = measure.topology_devices(hardware.tpu_slice("v5e-1"))[0]
    B, T, h, Q, J, block = 1, 256, 2, 192, 64, 128
    q = jax.ShapeDtypeStruct((B, T, h, Q), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    v = jax.ShapeDtypeStruct((B, T, h, J), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    loss = lambda q, k, v: jnp.sum(tpu_attention.attention(q, k, v, block).astype(jnp.float32))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, v).lower(lowering_platforms=("tpu",)).compile()
    flops = hlo.matmul_flops(compiled.as_text())
    forward = 2 * B * h * 3 * block * block * (Q + J)           # T / block = 2: three block pairs
    assert (flops["forward"], flops["backward"], flops["total"]) == (forward, 2.5 * forward, 3.5 * forward), flops
