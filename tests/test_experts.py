"""The routed experts' grouped matmuls (engine/expert_kernels.py): dropless (--capacity_factor 0) the ragged experts give
the capacity buffers' loss, metrics and every gradient in fp32, on one device and on a (2,2,2) mesh; and on a
GPU the engine multiplies them with tokamax's grouped-matmul kernel, whose FLOPs the H200 estimate counts.

On a CPU the grouped products are lax.ragged_dot, the kernel's reference: the GPU's program is compiled here
without a GPU (XLA:GPU from requirements-gpu-aot.txt, in its own virtualenv: $JAXFORMER_GPU_PYTHON, default
.venv-gpu/bin/python), in a subprocess.
"""
import json
import functools
import os
import subprocess

import jax
import numpy as np
import pytest

import sharding
from ceiling import CEILING_S
from model_util import CFG, ROUTER_BIAS, batch, rel_err, sharded_value_and_grad, with_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_PYTHON = os.environ.get("JAXFORMER_GPU_PYTHON", os.path.join(ROOT, ".venv-gpu", "bin", "python"))
DROPLESS = with_model(CFG, capacity_factor=0.0)


def run(cfg, shape, n_micro):
    """(loss, metrics, gradients in the model's order) of cfg's model on a mesh of `shape`."""
    params = sharding.init_params(cfg, jax.random.key(0))
    mesh = sharding.make_mesh(shape)
    placed = jax.device_put(params, sharding.param_shardings(params, mesh, cfg.expert_parallel))
    (loss, metrics), grads = sharded_value_and_grad(cfg, mesh, n_micro, ROUTER_BIAS)(placed, *batch())
    return loss, metrics, sharding.model_order(grads)


@pytest.mark.parametrize("shape,n_micro", [((1, 1, 1), 2), ((2, 2, 2), 2)])
def test_the_ragged_experts_equal_the_buffers_dropless_in_fp32(shape, n_micro):
    buffers_loss, buffers_metrics, buffers_grads = run(DROPLESS, shape, n_micro)
    loss, metrics, grads = run(with_model(DROPLESS, moe_impl="ragged"), shape, n_micro)
    assert not np.any(metrics["drop_rate"]) and not np.any(buffers_metrics["drop_rate"])     # dropless: every layer
    assert rel_err(loss, buffers_loss) < 1e-5
    for name in ("ce", "balance"):
        assert rel_err(metrics[name], buffers_metrics[name]) < 1e-5, name
    np.testing.assert_array_equal(metrics["tokens_per_expert"], buffers_metrics["tokens_per_expert"])
    for (path, g_buffers), g in zip(jax.tree_util.tree_leaves_with_path(buffers_grads), jax.tree.leaves(grads)):
        assert rel_err(g, g_buffers) < 1e-5, jax.tree_util.keystr(path)


# The routed experts of the fast engine for a GPU (Fast("gpu"), as a mesh of H200s makes it) and for a CPU,
# differentiated in the expert weights and the tokens inside shard_map with check_vma on a (2, 1, 2) mesh of
# H200s, compiled by XLA:GPU: the kernels of its HLO and what the census counts of them, as JSON.
COMPILE_THE_EXPERTS = """
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import engine, hardware, hlo, sharding, utils
from planning import measure
from collectives import Axes
measure.compile_only_cuda()
B, T, D, F, E, k = 4, 64, 64, 128, 8, 2
mesh = sharding.make_mesh((2, 1, 2), measure.target_devices(hardware.GpuTarget("h200", 4)))
cfg = utils.override(utils.Config(), moe_impl="ragged").model

def loss(w, x_BTD, experts_BTk, slot_BTk, platform):
    def local(w, x_BTD, experts_BTk, slot_BTk):
        axes = Axes("dp", "pp", "tp", engine=engine.Fast(platform))
        y_BTkD = axes.engine.routed_experts(w, x_BTD, experts_BTk, slot_BTk, T, cfg, axes)
        return jax.lax.psum(jnp.sum(y_BTkD.astype(jnp.float32) ** 2), ("dp", "tp"))
    weights = {"expert_up": PartitionSpec(None, None, "tp"), "expert_down": PartitionSpec(None, "tp", None)}
    over_dp = PartitionSpec("dp")
    return jax.shard_map(local, mesh=mesh, in_specs=(weights, over_dp, over_dp, over_dp), out_specs=PartitionSpec(),
                         check_vma=True)(w, x_BTD, experts_BTk, slot_BTk)

w = {"expert_up": jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16),
     "expert_down": jax.ShapeDtypeStruct((E, F, D), jnp.bfloat16)}
tokens = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype,
                                                             sharding=NamedSharding(mesh, PartitionSpec("dp")))
args = (w, tokens(B, T, D, dtype=jnp.float32), tokens(B, T, k), tokens(B, T, k))
for platform in ("gpu", "cpu"):
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=4)
    text = grad.trace(*args, platform).lower(lowering_platforms=("cuda",)).compile().as_text()
    census = hlo.kernel_census(text, 779e12, 4.8e12)
    print(json.dumps({"platform": platform, "kinds": census["kinds"], "uncounted": census["uncounted"]}))
"""


@pytest.mark.skipif(not os.path.exists(GPU_PYTHON), reason="a virtualenv from requirements-gpu-aot.txt")
def test_on_a_gpu_the_grouped_matmuls_are_tokamaxs_kernel_and_the_census_counts_them():
    """For a GPU the engine's ragged experts run tokamax's Triton kernel for the forward and both directions
    of its VJP (2 products in the forward, 4 in the backward, each 2 N D f FLOPs for the N = B T k routed
    rows of a dp shard and the f = F/tp hidden units of a tp rank) and XLA's dense expansion of
    lax.ragged_dot nowhere; the census counts exactly those FLOPs, as grouped GEMMs. For a CPU the same
    seam keeps lax.ragged_dot."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    p = subprocess.run([GPU_PYTHON, "-c", COMPILE_THE_EXPERTS], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=CEILING_S)
    assert p.returncode == 0, p.stderr[-3000:]
    gpu, cpu = (json.loads(line) for line in p.stdout.splitlines() if line.startswith("{"))
    grouped = gpu["kinds"]["custom-call:grouped-gemm"]
    N, D, f = 2 * 64 * 2, 64, 128 // 2
    assert grouped["count"] == 6 and grouped["flops"] == 6 * 2 * N * D * f
    assert not gpu["uncounted"] and "fusion:matmul" not in gpu["kinds"]
    assert "fusion:matmul" in cpu["kinds"] and "custom-call:grouped-gemm" not in cpu["kinds"]
    # The kernel's outputs vary over the mesh axes its operands vary over, so the gradient's reductions are
    # lax.ragged_dot's: the same all-reduces.
    assert gpu["kinds"]["collective:all-reduce"] == cpu["kinds"]["collective:all-reduce"]


@pytest.mark.parametrize("tiling", [(128, 128, 128), (256, 128, 256)])
def test_megablox_grouped_matmuls_equal_laxs_in_fp32(tiling):
    """expert_kernels.megablox_grouped (jax's Pallas TPU gmm and tgmm, in interpret mode here), the grouped
    matmuls a lever times on a TPU, as `_grouped` runs them: its three products equal lax.ragged_dot_general's in
    fp32, with an empty group and rows past the groups (dropped choices: 0 in lax's)."""
    from jax import lax
    from engine import expert_kernels as ek
    keys = jax.random.split(jax.random.key(0), 3)
    N, D, F = 512, 256, 384
    group_sizes = jax.numpy.array([200, 0, 160, 100], jax.numpy.int32)         # 460 of 512 rows in a group
    x, g = jax.random.normal(keys[0], (N, D)), jax.random.normal(keys[1], (N, F))
    w = jax.random.normal(keys[2], (4, D, F))
    for a, b, dims in ((x, w, ek.ROWS), (g, w, ek.ROWS_T), (x, g, ek.PER_GROUP)):
        expected = lax.ragged_dot_general(a, b, group_sizes, dims, precision=lax.Precision.HIGHEST)
        with jax.set_mesh(sharding.make_mesh((1, 1, 1))):          # as inside the model's shard_map
            kernel = functools.partial(ek.megablox_grouped, tiling=tiling, interpret=True)
            got = ek._grouped(a, b, group_sizes, dims, kernel)
        assert got.shape == expected.shape and rel_err(got, expected) < 1e-5, dims
