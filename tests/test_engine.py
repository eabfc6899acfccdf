"""The two engines (engine/) compute the same model: in fp32 the reference engine (the guide's plain math
at every seam) gives the fast engine's loss, metrics and every gradient on each mesh, expert parallelism and
the circular pipeline included. tests/test_model.py holds the fast engine on every mesh to its one-device
run; this holds the reference engine on the meshes to that same run, so each engine equals the other."""
import dataclasses

import jax
import numpy as np
import pytest

import engine
import pipeline
import sharding
from engine import chunked_loss
from scripts import levers
from model_util import (CFG, CIRCULAR, DSV3, EP, KEY, ROUTER_BIAS, batch, one_device_run, rel_err,
                        sharded_value_and_grad, with_model)

REFERENCE = with_model(CFG, engine="reference")
# The reference engine's code is mesh-free math; its seams meet the mesh on one device, on pp x tp 4 and on
# every axis with expert parallelism and the circular pipeline (test_model holds the fast one to all 9 meshes).
CASES = [((1, 1, 1), 2, {}), ((1, 2, 4), 4, {}), ((2, 2, 2), 4, EP | CIRCULAR)]


def run_on_mesh(cfg, mesh, n_micro, params):
    """((loss, metrics), grads) of cfg's loss on mesh in n_micro micro-batches of the test batch, from params stored
    in cfg's pipeline layout and placed by its shardings."""
    stored = sharding.Layout(cfg.pipeline_repeats).store(params)
    placed = jax.device_put(stored, sharding.param_shardings(stored, mesh, cfg.expert_parallel))
    return jax.device_get(sharded_value_and_grad(cfg, mesh, n_micro, ROUTER_BIAS)(placed, *batch()))


@pytest.mark.slow("~25 s; the reference engine's three meshes below and test_model's DeepSeek-V3 cases stay")
def test_the_reference_engine_equals_the_fast_one_in_deepseek_v3s_architecture():
    """The reference engine on (2,2,2), expert parallel, two repeats, against the fast one on one device."""
    _, fast_loss, _, fast_grads = one_device_run(DSV3)
    cfg = with_model(DSV3, engine="reference", **EP, **CIRCULAR)
    (loss, _), grads = run_on_mesh(cfg, sharding.make_mesh((2, 2, 2)), 4, sharding.init_params(DSV3, KEY))
    assert rel_err(loss, fast_loss) < 1e-5
    for (path, g_fast), g in zip(jax.tree_util.tree_leaves_with_path(fast_grads),
                                 jax.tree.leaves(sharding.model_order(grads))):
        assert rel_err(g, g_fast) < 1e-5, jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def fast_one_device():
    return one_device_run(CFG)


@pytest.mark.parametrize("shape,n_micro,changes", CASES)
def test_the_reference_engine_equals_the_fast_one_in_fp32(fast_one_device, shape, n_micro, changes):
    params, fast_loss, fast_metrics, fast_grads = fast_one_device
    cfg = with_model(REFERENCE, **changes)
    (loss, metrics), grads = run_on_mesh(cfg, sharding.make_mesh(shape), n_micro, params)
    assert rel_err(loss, fast_loss) < 1e-5
    for name in ("ce", "balance", "drop_rate"):
        assert rel_err(metrics[name], fast_metrics[name]) < 1e-5, name
    np.testing.assert_array_equal(metrics["tokens_per_expert"], fast_metrics["tokens_per_expert"])
    grads = sharding.model_order(grads)
    for (path, g_fast), g in zip(jax.tree_util.tree_leaves_with_path(fast_grads), jax.tree.leaves(grads)):
        assert rel_err(g, g_fast) < 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("shape,n_micro,changes", [((1, 1, 1), 2, {}), ((2, 2, 2), 4, EP | CIRCULAR)])
def test_layers_traced_apart_give_the_scans_loss_and_gradients(monkeypatch, shape, n_micro, changes):
    """Python loops over the blocks and their dense layers, each layer traced on its own, in place of the scans:
    in fp32 the scanned step's loss and metrics bit for bit and every gradient to rounding, on one device and
    through the circular pipeline with expert parallelism."""
    # levers.py's LayersApart: the layers traced apart on any platform, as a TPU's are with --remat none
    monkeypatch.setitem(engine.ENGINES, "apart", levers.LayersApart)
    params, mesh = sharding.init_params(CFG, KEY), sharding.make_mesh(shape)
    run = lambda engine_name: run_on_mesh(with_model(CFG, engine=engine_name, **changes), mesh, n_micro, params)
    (loss, metrics), grads = run("apart")
    (scan_loss, scan_metrics), scan_grads = run("fast")
    np.testing.assert_array_equal(loss, scan_loss)
    for name in ("ce", "balance", "drop_rate", "tokens_per_expert"):
        np.testing.assert_array_equal(metrics[name], scan_metrics[name], err_msg=name)
    for (path, g_scan), g in zip(jax.tree_util.tree_leaves_with_path(scan_grads), jax.tree.leaves(grads)):
        assert rel_err(g, g_scan) < 1e-6, jax.tree_util.keystr(path)      # 3.2e-7 at most: sums in another order


@dataclasses.dataclass(frozen=True)
class SumsByProduct(engine.Fast):
    """The fast engine with a TPU's sums of the output layer's exponentials (from the MXU's product) on any platform."""

    def cross_entropy_sum(self, table_vD, h_BTD, targets_BT, cfg, axes):
        return chunked_loss.chunked_cross_entropy_sum(table_vD, h_BTD, targets_BT, cfg, axes, self._chunk_tokens(),
                                                      sums_by_product=True)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 2, 4)])
def test_a_tpus_sums_of_exponentials_from_the_product_give_the_loss_and_gradients(monkeypatch, shape):
    """Each token's sum of exponentials from the hidden states' gradient product (a column of ones beside the table,
    a TPU's way), on one device and with the vocabulary split over tp 4: in fp32 the pass's loss and every
    gradient to rounding (the sums in another order)."""
    monkeypatch.setitem(engine.ENGINES, "sums_by_product", SumsByProduct)
    params, mesh = sharding.init_params(CFG, KEY), sharding.make_mesh(shape)
    run = lambda engine_name: run_on_mesh(with_model(CFG, engine=engine_name), mesh, 2, params)
    ((loss, metrics), grads), ((plain_loss, plain_metrics), plain_grads) = run("sums_by_product"), run("fast")
    assert rel_err(loss, plain_loss) < 1e-6 and rel_err(metrics["ce"], plain_metrics["ce"]) < 1e-6
    for (path, g_plain), g in zip(jax.tree_util.tree_leaves_with_path(plain_grads), jax.tree.leaves(grads)):
        assert rel_err(g, g_plain) < 1e-6, jax.tree_util.keystr(path)


def test_a_tpu_traces_the_layers_apart_when_its_training_step_keeps_every_activation():
    """--remat none on a TPU: the training step's layers traced apart (a scan would stack every residual); with any
    remat, out of training (nothing kept for a backward), past engine.MAX_LAYERS_APART layers (each compiles on
    its own) or on another platform or engine, scanned."""
    none = with_model(CFG, remat="none")
    assert engine.Fast("tpu").layer_loop(none, True).apart
    deep = with_model(CFG, remat="none", blocks=engine.MAX_LAYERS_APART // CFG.layers_per_block + 1)
    assert not engine.Fast("tpu").layer_loop(deep, True).apart
    assert not engine.Fast("tpu").layer_loop(none, False).apart
    assert not any(engine.Fast("tpu").layer_loop(with_model(CFG, remat=r), True).apart for r in ("full", "dots"))
    assert not any(engine.Fast(platform).layer_loop(none, True).apart for platform in ("cpu", "gpu", None))
    assert not engine.Reference("tpu").layer_loop(none, True).apart
    assert engine.Fast("tpu").layer_loop(none, True).policy is None


def test_the_reference_engine_runs_none_of_the_fast_ones_kernels():
    """What a reader steps through: the reference engine's training step has no custom VJP, no value named
    for the remat and no platform choice, where the fast engine's has each."""
    mesh = sharding.make_mesh((1, 1, 1))

    def step_jaxpr(engine):
        cfg = with_model(CFG, engine=engine, model_dtype="bfloat16", remat="full")
        grad = jax.grad(lambda p, x, y: pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, 1)[0])
        return str(jax.make_jaxpr(grad)(jax.eval_shape(lambda: sharding.init_params(cfg, KEY)), *batch()))
    fast, reference = step_jaxpr("fast"), step_jaxpr("reference")
    for kernel in ("custom_vjp_call", " name[", "platform_index"):
        assert kernel in fast and kernel not in reference, kernel
    assert "dot_general" in reference and ("checkpoint" in reference or "remat" in reference)


def test_a_tpus_products_stand_behind_barriers_and_no_other_platforms():
    """On a TPU the fast engine's product and its cotangent stand behind optimization barriers, so that XLA fuses
    nothing of what follows into the matmul; the CPU's and GPU's programs have none (tests/test_golden_program.py)."""
    a, b = np.ones((4, 8), np.float32), np.ones((8, 16), np.float32)

    def barriers(platform):
        loss = lambda a, b: engine.Fast(platform).mm("td,df->tf", a, b, "bfloat16").sum()
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(a, b)).count("optimization_barrier")
    assert (barriers("tpu"), barriers("cpu"), barriers("gpu"), barriers(None)) == (2, 0, 0, 0)
