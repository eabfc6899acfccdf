"""engine/tpu_update.py, the TPU's one-pass optimizer update (optimizer.in_one_pass), proven on the CPU through
Pallas' interpret mode: training steps with it give the state optax's chain gives from the same gradients (a
random one a step: two programs' backward passes can differ by an ulp, which Adam's ratio magnifies), bit for bit
in fp32 on one device, clipped or not, and a skipped spike or a non-finite step leaves the state as it was in
both. Only a TPU's fast engine runs it. On the chip: tests/test_tpu.py."""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine
import hardware
import sharding
import trainer as trainer_module
import utils
from engine import tpu_update
from planning import measure
from small_configs import small_model
from trainer import build_trainer


@dataclasses.dataclass(frozen=True)
class OnePassInterpreted(engine.Fast):
    """The fast engine with the TPU's one-pass update, run by Pallas' interpreter (on a CPU)."""

    def optimizer_kernel(self):
        return functools.partial(tpu_update.update_in_place, interpret=True)


MODEL = small_model(n_head=4, model_dtype="float32", remat="none")


def random_grads(grads, key):
    """A gradient of grads' shapes, normal times 1e-2, its entries' scales spread over 1e-3..1e3 (key: the step's)."""
    keys = jax.random.split(key, 2 * len(jax.tree.leaves(grads)))
    return jax.tree.unflatten(jax.tree.structure(grads), [
        1e-2 * jax.random.normal(a, g.shape) * 10.0 ** jax.random.uniform(b, g.shape, minval=-3, maxval=3)
        for g, a, b in zip(jax.tree.leaves(grads), keys[::2], keys[1::2])])


def _steps(monkeypatch, shape, steps=2, grads_of=random_grads, opt_state_of=None, **optim):
    """The training state after `steps` steps of MODEL on `shape`, by the fast engine (the chain) and by it with the
    one-pass update; grads_of(gradient, the step's key): the gradient each step takes instead of its own;
    opt_state_of: the optimizer state the steps start from."""
    monkeypatch.setitem(engine.ENGINES, "one_pass", OnePassInterpreted)
    plain = trainer_module.accumulate_gradients
    monkeypatch.setattr(trainer_module, "accumulate_gradients",
                        lambda params, bias, batch, key, *rest: (lambda g, m: (grads_of(g, key), m))(
                            *plain(params, bias, batch, key, *rest)))
    cfg = utils.Config(model=MODEL, run=utils.RunConfig(train_batch_size=8, micro_batch_size=2, n_device_axis=shape),
                       optim=dataclasses.replace(utils.OptimConfig(), **optim))
    mesh = sharding.make_mesh(shape)
    tokens = jax.random.randint(jax.random.key(7), (8, MODEL.T + 1), 0, MODEL.vocab_size)
    states = []
    for name in ("fast", "one_pass"):
        trainer = build_trainer(utils.override(cfg, engine=name), mesh)
        x, y = (jax.device_put(tokens[:, part], trainer.data_sharding) for part in (slice(None, -1), slice(1, None)))
        state = trainer.fresh_state(0)
        if opt_state_of is not None:
            state["opt_state"] = opt_state_of(state["opt_state"])
        for _ in range(steps):
            state, _ = trainer.step(state, ((x,), (y,)))
        states.append(jax.device_get(state))
    return states


def _assert_equal(chain, one_pass, share=0.0):
    """Every leaf equal, or within `share` of its largest finite value (NaN: the spike window's unseen norms)."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(chain), jax.tree.leaves(one_pass)):
        largest = np.max(np.abs(a), initial=0, where=np.isfinite(a))
        np.testing.assert_allclose(b, a, rtol=0, atol=share * largest, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("grad_clip_norm", [1e-3, 1e3], ids=["clipped", "unclipped"])
def test_the_one_pass_update_is_the_chains_in_fp32(monkeypatch, grad_clip_norm):
    _assert_equal(*_steps(monkeypatch, (1, 1, 1), steps=3, grad_clip_norm=grad_clip_norm))


def test_the_one_pass_update_skips_a_spike_and_a_non_finite_step_as_the_chain_does(monkeypatch):
    """A history of tiny grad norms makes the step a spike (--skip_spikes 2); a NaN in the gradient, a non-finite
    step: each leaves params and moments as they were, in both."""
    history = lambda opt_state: opt_state._replace(norms=jnp.full_like(opt_state.norms, 1e-6))
    chain, one_pass = _steps(monkeypatch, (1, 1, 1), steps=1, opt_state_of=history, skip_spikes=2.0)
    _assert_equal(chain, one_pass)
    assert int(one_pass["opt_state"].skipped) == 1
    poisoned = lambda grads, _: jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
    _assert_equal(*_steps(monkeypatch, (1, 1, 1), steps=1, grads_of=poisoned))


def test_the_one_pass_update_runs_on_each_devices_shards(monkeypatch):
    """On (2, 2, 2): FSDP's shards and the pipeline's stages, each device updating its own, to 1e-6 of each leaf's
    largest value (XLA:CPU partitions the chain's moments into fusions that round 1 element in 10 apart)."""
    _assert_equal(*_steps(monkeypatch, (2, 2, 2), steps=2), share=1e-6)


def test_only_a_tpus_fast_engine_updates_in_one_pass():
    assert engine.Fast("tpu").optimizer_kernel() is tpu_update.update_in_place
    assert engine.Fast("cpu").optimizer_kernel() is None and engine.Fast("gpu").optimizer_kernel() is None
    assert engine.Reference("tpu").optimizer_kernel() is None


SHAPES = [(300000,), (5, 7), (4, 768, 16), (2, 3, 1000, 96), (70, 200000)]     # vector, tiny, narrow, stacked, wide


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_the_kernels_blocks_cover_any_leaf(shape):
    """Every element updated once, whatever the leaf's rank and width: a block holds a whole small leaf, else rows
    (and, past 8192 lanes, lanes) a grid step; the edges' blocks run past the leaf."""
    fn = lambda s, p, g: (p * s[0] + g * s[1],)
    p, g = (jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(0)))
    scalars_S = jnp.array([0.5, 2.0], jnp.float32)
    got = jax.jit(lambda s, p, g: tpu_update.update_in_place(fn, s, (p, g.astype(jnp.bfloat16)), 1,
                                                              interpret=True))(scalars_S, p, g)
    np.testing.assert_array_equal(got[0], fn(scalars_S, p, g.astype(jnp.bfloat16).astype(jnp.float32))[0])


def test_the_kernel_compiles_for_a_v5e_at_any_leafs_shape():
    """libtpu's compiler (here on the CPU) takes each of SHAPES within a core's default 16 MiB of VMEM."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")          # other test processes may hold libtpu
    device = measure.topology_devices(hardware.tpu_slice("v5e-1"))[0]
    on_chip = jax.sharding.SingleDeviceSharding(device)
    fn = lambda s, p, g: (p * s[0] + g * s[1],)
    for shape in SHAPES:
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip) for dtype in (jnp.float32, jnp.bfloat16)]
        step = jax.jit(lambda s, p, g: tpu_update.update_in_place(fn, s, (p, g), 1), donate_argnums=1)
        step.lower(jax.ShapeDtypeStruct((2,), jnp.float32, sharding=on_chip), *args).compile()
