"""The TPU's attention kernel (engine/tpu_attention.py) computes model.masked_attention's causal attention of
q and k joined with decoupled RoPE's parts: in fp32, run here by Pallas' interpret mode, its output and the
gradients of q, k, v and both rotary parts equal the one masked softmax's at MLA's layouts (heads sharing a
tile of lanes or not, with RoPE or without) and several blocks a sequence; inside a shard_map over heads; and
in the whole model, behind the attention seam, on a mesh with pp and tp, where it gives the XLA path's loss
and every gradient. Compiled for a TPU by libtpu here, it fits each chip's VMEM at the longest sequence it
takes there and its products count in the program's matmul FLOPs. On the chip: tests/test_tpu.py."""
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


def causal_reference(q_BThK, k_BShK, v_BShJ, q_rope_BThR=None, k_rope_BSR=None):
    """model.masked_attention, causal, of q and k joined with RoPE's parts as the reference engine joins them."""
    T = q_BThK.shape[1]
    rotary = None if q_rope_BThR is None else (q_rope_BThR, k_rope_BSR)
    q_BThQ, k_BShQ = model.decoupled_rope_qk(q_BThK, k_BShK, rotary, q_BThK.dtype)
    return model.masked_attention(q_BThQ, k_BShQ, v_BShJ, jnp.tril(jnp.ones((T, T), bool)), q_BThK.dtype, products.mm)


def operands(B, T, h, K, J, R, seed=0):
    """q, k, v, the rotary q and the one rotary key (() without RoPE), and the output's cotangent w."""
    keys = jax.random.split(jax.random.key(seed), 6)
    q, k = (jax.random.normal(key, (B, T, h, K), jnp.float32) for key in keys[:2])
    v, w = (jax.random.normal(key, (B, T, h, J), jnp.float32) for key in keys[2:4])
    rotary = () if R == 0 else (jax.random.normal(keys[4], (B, T, h, R)), jax.random.normal(keys[5], (B, T, R)))
    return (q, k, v, *rotary), w


def value_and_grads(attention, args, w):
    """The output and the gradients of each argument of sum(attention(*args) * w)."""
    out, vjp = jax.vjp(attention, *args)
    return (out, *vjp(w))


NAMES = ("out", "dq", "dk", "dv", "dq_rope", "dk_rope")


# MLA's widths, scaled to tiles of 8 lanes (the chip's 128): K, J, R of 4, 4, 8 are 64, 64, 128 (the one-chip
# preset's: 2 heads a step, content and values a head's half of a tile, the rotary query a tile of its own);
# R 4 is 64 (the rotary key repeated to meet the 2 heads' lanes); R 0 NoPE; 8s a head a step, no lanes shared.
@pytest.mark.parametrize("T,block,rows,K,J,R", [(256, 128, None, 4, 4, 8), (384, 128, None, 8, 8, 4),
                                                (64, 16, None, 4, 4, 0), (64, 16, None, 8, 8, 8),
                                                (256, 128, 64, 4, 4, 8), (192, 128, 64, 8, 8, 0)])
def test_the_kernel_equals_one_masked_softmax_in_fp32(T, block, rows, K, J, R):
    """Blocks of 2, 3 and 4 a sequence (the diagonal's masked, the ones above it skipped), 4 heads; rows of half a
    block: the pieces crossing the diagonal cut there, masked on their last rows x rows (forward) or first
    (backward), one of T 192 shorter than a block."""
    args, w = operands(2, T, 4, K, J, R)
    with jax.default_matmul_precision("highest"):
        kernel = functools.partial(tpu_attention.attention, block=block, rows=rows, interpret=pltpu.InterpretParams(),
                                   lanes=8)
        # jitted: run op by op, the reference's gradient compiled each of its operations apart
        got, want = (jax.jit(functools.partial(value_and_grads, f))(args, w) for f in (kernel, causal_reference))
    assert len(got) == len(want) == (6 if R else 4)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-5, name


def test_the_kernel_runs_inside_a_shard_map_over_heads_and_sequences():
    """Each device its sequences' heads (dp x tp 2 x 4 of the 8 devices, 2 heads each), the outputs varying as q
    does; the one rotary key, whole on every tp rank, gets its gradient summed over them (`tpu_kernel_attention`)."""
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    heads, key = PartitionSpec("dp", None, "tp", None), PartitionSpec("dp", None, None)
    (q, k, v, q_rope, k_rope), w = operands(4, 128, 8, 4, 4, 8, seed=1)
    kernel = functools.partial(attention_kernels.tpu_kernel_attention, dtype=jnp.float32, block=64,
                               interpret=pltpu.InterpretParams(), lanes=8)
    sharded = jax.shard_map(lambda q, k, v, qr, kr: kernel(q, k, v, (qr, kr)), mesh=mesh,
                            in_specs=(heads,) * 4 + (key,), out_specs=heads)
    args = (q, k, v, q_rope, k_rope)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(args, (heads,) * 4 + (key,))]
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda args, w: value_and_grads(sharded, args, w))(placed, w)
        want = jax.jit(functools.partial(value_and_grads, causal_reference))(args, w)
    for name, a, b in zip(NAMES, got, want):
        assert rel_err(a, b) < 1e-5, name


@dataclasses.dataclass(frozen=True)
class InterpretedKernel(engine.Fast):
    """The fast engine with the TPU kernel at its attention seam as a TPU's runs it (bf16 there), in fp32 here."""

    def attention(self, q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype):
        if mask_TS is not None:
            return super().attention(q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype)
        return attention_kernels.tpu_kernel_attention(q_BThK, k_BShK, v_BShJ, rotary, dtype, block=8,
                                                      interpret=pltpu.InterpretParams(), lanes=8)


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
    unchanged (tests/test_golden_program.py). It takes heads whose parts fill whole tiles of lanes, alone or
    in groups that divide the heads (the one-chip preset's 12 of 64, 64 and 128 in pairs; moe10B's 128, 128
    and 64 in pairs), and sequences of whole blocks as long as the chip's VMEM holds (a chip not known: a v4's)."""
    (q, k, v, q_rope, k_rope), _ = operands(1, 256, 2, 64, 64, 128)

    def traced(platform, dtype):
        f = lambda q, k, v, qr, kr: attention_kernels.attention(q, k, v, (qr, kr), None, dtype, platform)
        return str(jax.make_jaxpr(f)(*(x.astype(dtype) for x in (q, k, v, q_rope, k_rope))))
    assert "pallas_call" in traced("tpu", jnp.bfloat16)
    long = [x.astype(jnp.bfloat16) for x in operands(1, 2048, 2, 64, 64, 128)[0]]
    by_chip = lambda kind: str(jax.make_jaxpr(lambda *a: engine.Fast("tpu", kind).attention(*a[:3], a[3:], None,
                                                                                             jnp.bfloat16))(*long))
    assert "pallas_call" in by_chip("TPU v5 lite") and "pallas_call" not in by_chip("TPU v4")
    for platform, dtype in (("tpu", jnp.float32), ("cpu", jnp.bfloat16), (None, jnp.bfloat16)):
        assert "pallas_call" not in traced(platform, dtype), (platform, dtype)
    assert tpu_attention.heads_per_step(12, 64, 64, 128) == 2 and tpu_attention.heads_per_step(8, 128, 128, 64) == 2
    assert tpu_attention.heads_per_step(4, 128, 128, 0) == 1
    v4, v5e = (hardware.vmem_bytes(kind) for kind in ("TPU v4", "TPU v5 lite"))
    assert tpu_attention.takes(1024, 12, 64, 64, 0, v4) and not tpu_attention.takes(1152, 12, 64, 64, 0, v4)
    assert tpu_attention.takes(3072, 12, 64, 64, 0, v5e) and not tpu_attention.takes(3200, 12, 64, 64, 0, v5e)
    assert tpu_attention.takes(1024, 12, 64, 64, 0) and not tpu_attention.takes(2048, 12, 64, 64, 0)   # not known
    assert not tpu_attention.takes(100, 12, 64, 64, 0)         # no block divides it: XLA's path
    assert not tpu_attention.takes(1024, 3, 64, 64, 128)       # 3 heads of 64 fill no whole tiles
    assert not tpu_attention.takes(1024, 4, 48, 64, 0)         # 48 lanes: neither whole tiles nor a share of one


@pytest.mark.parametrize("policy", sorted(engine.REMAT_POLICIES))
def test_the_layers_remat_runs_the_kernels_forward_again(policy):
    """No remat policy keeps the kernel's outputs (the layer scans' stacking of them cost more than its forward
    run again): the gradient of a rematted layer holds three kernels, the forward, its replay and the backward."""
    args, w = operands(1, 256, 2, 64, 64, 128)
    args, w = [x.astype(jnp.bfloat16) for x in args], w.astype(jnp.bfloat16)
    layer = lambda q, k, v, qr, kr: jnp.sum(engine.Fast("tpu").attention(q, k, v, (qr, kr), None, jnp.bfloat16) * w)
    grad = jax.grad(jax.checkpoint(layer, policy=engine.REMAT_POLICIES[policy]), argnums=(0, 1, 2, 3, 4))
    assert str(jax.make_jaxpr(grad)(*args)).count("pallas_call[") == 3


@pytest.mark.parametrize("slice_name,kind", [("v4-8", "TPU v4"),
                                             pytest.param("v5e-1", "TPU v5 lite", marks=pytest.mark.slow("~50 s"))])
def test_the_kernel_compiles_for_the_longest_sequence_a_chip_takes(slice_name, kind):
    """libtpu's compiler (Mosaic's lowering, VMEM's plan) builds the kernel's forward and backward for a chip at the
    longest T it takes there, RoPE's parts and without; one block longer and the kernel leaves it to XLA."""
    pytest.importorskip("libtpu", reason="pip install -r requirements-tpu.txt")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")     # other test processes may hold libtpu
    from planning import measure
    device = measure.topology_devices(hardware.tpu_slice(slice_name))[0]
    assert device.device_kind == kind
    T = tpu_attention.longest_T(hardware.vmem_bytes(kind))
    assert not tpu_attention.takes(T + tpu_attention.BLOCK_SIZES[-1], 12, 64, 64, 128, hardware.vmem_bytes(kind))
    on_chip = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))
    for R in (128, 0):
        args = [on_chip(1, T, 12, 64)] * 3 + ([on_chip(1, T, 12, R), on_chip(1, T, R)] if R else [])
        loss = lambda *args: jnp.sum(tpu_attention.attention(*args).astype(jnp.float32))
        grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
        grad.trace(*args).lower(lowering_platforms=("tpu",)).compile()


@pytest.mark.parametrize("R,block", [(128, 128), (0, 128), (128, 256)])
def test_the_kernels_products_count_in_a_tpu_programs_matmul_flops(R, block):
    """Compiled for a v5e here (libtpu's compiler, Mosaic's lowering of the kernel included), the kernel's products
    are counted (hlo.matmul_flops reads the FLOPs it declares: its squares of rows x rows on and below the diagonal,
    each head as if alone, q and k joined), the forward's and the backward's apart; with RoPE and without; in rows
    of half a block (of 256 here) too."""
    pytest.importorskip("libtpu", reason="pip install -r requirements-tpu.txt")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")     # other test processes may hold libtpu
    from planning import measure
    device = measure.topology_devices(hardware.tpu_slice("v5e-1"))[0]
    B, T, h, K, J, rows = 1, 256, 2, 64, 64, 128
    on_chip = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))
    args = [on_chip(B, T, h, K), on_chip(B, T, h, K), on_chip(B, T, h, J)] + ([on_chip(B, T, h, R), on_chip(B, T, R)]
                                                                              if R else [])
    loss = lambda *args: jnp.sum(tpu_attention.attention(*args, block=block, rows=rows).astype(jnp.float32))
    compiled = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).lower(
        lowering_platforms=("tpu",)).compile()
    flops = hlo.matmul_flops(compiled.as_text())
    forward = 2 * B * h * 3 * rows * rows * (K + R + J)            # T / rows = 2: three squares
    assert (flops["forward"], flops["backward"], flops["total"]) == (forward, 2.5 * forward, 3.5 * forward), flops


def test_a_kernels_declared_flops_are_read_whatever_the_order_of_its_cost_estimates_keys():
    """libtpu's ahead-of-time compile writes a Pallas kernel's cost estimate with its FLOPs first and its operands by
    name, the chip's own compile the estimate's keys sorted (bytes_accessed first) and the operands typed inline:
    hlo.matmul_flops reads both (on the chip it had counted no attention FLOPs)."""
    defined = {"q": "bf16[8,1024,768]{2,1,0} parameter(0)", "k": "bf16[8,1024,768]{2,1,0} parameter(1)"}
    for cost in ('{"flops":"96","bytes_accessed":"8","transcendentals":"4"}',
                 '{"bytes_accessed":"8","flops":"96","remote_bytes_transferred":"0","transcendentals":"4"}'):
        for operands in ("%q, %k", "bf16[8,1024,768]{2,1,0:T(8,128)(2,1)} %q, bf16[8,1024,768]{2,1,0:T(8,128)(2,1)} %k"):
            rhs = (f'bf16[8,1024,768]{{2,1,0}} custom-call({operands}), custom_call_target="tpu_custom_call", '
                   f'backend_config={{"custom_call_config":{{"body":"TUzv","cost_estimate":{cost}}}}}')
            assert hlo._pallas_kernel(rhs, defined) == (96.0, "bf16 x bf16"), (cost, operands)
