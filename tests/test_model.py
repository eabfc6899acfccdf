"""The sharded model equals the single-device reference on every mesh; the parts match hand math."""
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from engine import attention_kernels
import generate
import hlo
import model
import pipeline
from engine import products
import trainer
import sharding
import utils
from collectives import Axes
from engine import engine_for
from model_util import (CFG, CIRCULAR, DSV3, EP, KEY, ROUTER_BIAS, abstract_params, batch, one_device_run,
                        rel_err, sharded_value_and_grad, with_model)

# (mesh, micro-batches per step (several wherever pp > 1), config changes of the sharded run)
# (tp = 8 alone was a case too; (1,2,4), (4,1,2) and (2,2,2) split heads, FFN and vocab over tp.)
CASES = [((1, 1, 1), 2, {}), ((8, 1, 1), 2, EP), ((1, 8, 1), 8, {}),
         ((4, 1, 2), 2, EP), ((4, 2, 1), 4, {}), ((1, 2, 4), 4, {}),
         # sorted grouped-matmul experts and full remat must give the same numbers too
         ((2, 2, 2), 2, {"moe_impl": "ragged", "remat": "full"}),
         # circular, M = pp: a micro-batch back from the last stage is used in the tick it arrives;
         # M > pp: it waits in stage 0's buffer, here with expert parallelism as well (one case for both)
         ((1, 4, 1), 4, CIRCULAR), ((2, 2, 2), 4, EP | CIRCULAR),
         # each tick gathers the weights it runs and reduce-scatters their gradient (a repeat's, when circular)
         ((2, 2, 2), 2, {"fsdp_gather": "tick"}), ((4, 2, 1), 4, CIRCULAR | {"fsdp_gather": "tick"})]
# Every case routes with the nonzero aux-loss-free bias ROUTER_BIAS [blocks, E] and checks the update it gets.
BIAS_RATE = 1e-3


def one_device(cfg):
    """The axes of the one-device model: no mesh axis, cfg's engine."""
    return Axes(engine=engine_for(cfg))


@pytest.fixture(scope="module")
def reference():
    run = one_device_run(CFG)
    assert 0 < float(jnp.mean(run[2]["drop_rate"])) < 1, "the test config should drop some tokens"
    return run


@pytest.mark.parametrize("shape,n_micro,changes", CASES)
def test_loss_and_grads_equal_reference(reference, shape, n_micro, changes):
    """Loss, metrics, every gradient and the routing-bias update; with expert parallelism too (routing
    and drops are decided before the all-to-all, so they are the reference's)."""
    assert_equals_one_device(reference, with_model(CFG, **changes), shape, n_micro)


@pytest.fixture(scope="module")
def deepseek_v3_reference():
    return one_device_run(DSV3)


@pytest.mark.parametrize("shape,n_micro,changes", [((2, 2, 2), 4, EP | CIRCULAR), ((1, 2, 4), 4, {})])
def test_a_deepseek_v3_shaped_model_equals_its_one_device_run(deepseek_v3_reference, shape, n_micro, changes):
    assert_equals_one_device(deepseek_v3_reference, with_model(DSV3, **changes), shape, n_micro)


@pytest.mark.parametrize("shape,n_micro,changes", [((4, 1, 2), 2, EP), ((4, 2, 1), 4, CIRCULAR | {"fsdp_gather": "tick"}),
                                                   ((2, 2, 2), 2, {"remat": "full"})])
def test_two_slices_equal_one_device(reference, shape, n_micro, changes):
    """DP split over 2 slices (FSDP and expert parallelism within a slice, the gradient summed across them)."""
    assert_equals_one_device(reference, with_model(CFG, **changes), shape, n_micro, n_slices=2)


def assert_equals_one_device(reference, cfg, shape, n_micro, n_slices=1):
    params, ref_loss, ref_metrics, ref_grads = reference
    mesh = sharding.make_mesh(shape, n_slices=n_slices)
    stored = sharding.Layout(cfg.pipeline_repeats).store(params)        # as the training state holds them
    sharded = jax.device_put(stored, sharding.param_shardings(stored, mesh, cfg.expert_parallel))
    (loss, metrics), grads = sharded_value_and_grad(cfg, mesh, n_micro, ROUTER_BIAS)(sharded, *batch())
    grads = sharding.model_order(grads)
    assert rel_err(loss, ref_loss) < 1e-5
    for name in ("ce", "balance", "drop_rate"):
        assert rel_err(metrics[name], ref_metrics[name]) < 1e-5, name
    np.testing.assert_array_equal(metrics["tokens_per_expert"], ref_metrics["tokens_per_expert"])
    updated, ref_updated = (trainer.update_router_bias(ROUTER_BIAS, m["tokens_per_expert"], BIAS_RATE)
                            for m in (metrics, ref_metrics))
    np.testing.assert_array_equal(updated, ref_updated)
    assert np.any(updated != ROUTER_BIAS)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, g_ref), g in zip(flat_ref, jax.tree.leaves(grads)):
        assert rel_err(g, g_ref) < 1e-5, jax.tree_util.keystr(path)


def test_circular_layout_puts_groups_r_pp_plus_s_on_stage_s():
    """pipeline_layout is a reshape of the model order ([blocks, ...] -> [R, blocks/R, ...]) that
    model_order undoes, and sharding its second axis over pp puts on stage s the R groups r pp + s of
    L = blocks/(pp R) consecutive blocks (as the schedule assumes); R = 1 is the model order itself."""
    params = jax.eval_shape(lambda: sharding.init_params(CFG, KEY))
    assert sharding.Layout(1).store(params)["blocks"] == params["blocks"]
    R, pp = 2, 2
    L = CFG.blocks // (pp * R)
    w = jnp.arange(CFG.blocks * 3.0).reshape(CFG.blocks, 3)                     # row g = block g
    tree = {"embed": jnp.zeros((1, 1)), "blocks": {"moe": {"moe": {"router": w[:, :, None]}}}}
    stored = sharding.Layout(R).store(tree)
    router = stored["blocks"]["moe"]["moe"]["router"]
    assert router.shape == (R, CFG.blocks // R, 3, 1)
    np.testing.assert_array_equal(sharding.model_order(stored)["blocks"]["moe"]["moe"]["router"], w[:, :, None])
    assert tuple(sharding.param_specs(stored)["blocks"]["moe"]["moe"]["router"]) == (None, "pp", "dp", None)
    mesh = sharding.make_mesh((1, pp, 1))
    placed = jax.device_put(stored, sharding.param_shardings(stored, mesh))["blocks"]["moe"]["moe"]["router"]
    for shard in placed.addressable_shards:
        s = mesh.devices.flatten().tolist().index(shard.device)
        blocks = np.asarray(shard.data)[:, :, 0, 0].ravel() // 3                   # the blocks this stage holds
        np.testing.assert_array_equal(blocks, [(r * pp + s) * L + j for r in range(R) for j in range(L)])
    bias = jnp.arange(CFG.blocks * 4.0).reshape(CFG.blocks, 4)
    with_bias = sharding.with_router_bias(stored, bias)["blocks"]["moe"]["moe"]["router_bias"]
    np.testing.assert_array_equal(with_bias.reshape(CFG.blocks, 4), bias)


def test_checkpoint_restores_across_pipeline_repeats(tmp_path):
    """A training state saved with --pipeline_repeats 1 restores with 2: the same numbers in model
    order (params and Adam moments), on the restoring run's layout [R, blocks/R, ...] and shardings."""
    import checkpoints
    from trainer import build_trainer
    mesh = sharding.make_mesh((1, 2, 1))
    cfgs = {R: utils.override(utils.Config(model=CFG), n_device_axis=(1, 2, 1), pipeline_repeats=R) for R in (1, 2)}
    # every leaf of the state (params, Adam moments, ...) numbered 0, 1, 2, ... in its own order
    saved = jax.tree.map(lambda t: jax.device_put(np.arange(math.prod(t.shape)).reshape(t.shape).astype(t.dtype),
                                                  t.sharding), build_trainer(cfgs[1], mesh).abstract_state)
    mngr = checkpoints.checkpoint_manager(str(tmp_path))
    checkpoints.save(mngr, 1, saved, {"step": 1, "model": dataclasses.asdict(cfgs[1].model)})
    checkpoints.wait_for_save(mngr)
    abstract = build_trainer(cfgs[2], mesh).abstract_state
    restored, _ = checkpoints.restore_latest(mngr, abstract, None, cfgs[2].model)
    mngr.close()
    for a, b, t in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), jax.tree.leaves(abstract)):
        assert b.shape == t.shape and b.sharding == t.sharding
        np.testing.assert_array_equal(np.asarray(a).ravel(), np.asarray(b).ravel())
    assert restored["params"]["blocks"]["moe"]["moe"]["router"].shape[:2] == (2, CFG.blocks // 2)


def test_fsdp_gathers_weights_in_bf16_and_reduce_scatters_gradients_in_fp32():
    """The dp all-gathers move bf16 weights (fp32 only for the router), and the gradients' reduce-
    scatters sum fp32: a bf16 sum would round at every step (`bench.py --grad_error` measures it)."""
    cfg = with_model(CFG, model_dtype="bfloat16")
    mesh = sharding.make_mesh((8, 1, 1))
    grad = jax.grad(lambda p, x, y: pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, 2)[0])
    jaxpr = str(jax.make_jaxpr(grad)(abstract_params(cfg, mesh), *batch()))
    # A collective prints as `name:dtype[shape]{V:axes} = primitive[params] operand`.
    collectives = re.findall(r"(\w+)\[[\d,]*\](?:\{[^}]*\})? = (all_gather|reduce_scatter)\[([^\]]*)\]", jaxpr)
    over_dp = {(primitive, dtype) for dtype, primitive, params in collectives if "axis_name=('dp',)" in params}
    assert over_dp == {("all_gather", "bf16"), ("all_gather", "f32"), ("reduce_scatter", "f32")}


def test_remat_dots_saves_the_matmul_products_full_recomputes():
    """--remat dots recomputes well under half of what --remat full adds to no remat: it keeps the
    products without batch dims, which products.mm names for the policy (a checkpoint policy does not
    see the dot inside its custom_vjp; without the name, dots recomputed ~all that full does)."""
    mesh = sharding.make_mesh((1, 1, 1))

    def step_flops(remat):
        cfg = with_model(CFG, remat=remat)
        grad = jax.jit(jax.grad(lambda p, x, y: pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, 1)[0]))
        return hlo.matmul_flops(grad.lower(abstract_params(cfg, mesh), *batch()).compile().as_text())["total"]
    none, dots, full = map(step_flops, ("none", "dots", "full"))
    assert none < dots and dots - none < 0.6 * (full - none), (none, dots, full)


def test_expert_parallel_sends_tokens_instead_of_gathering_expert_weights():
    """With --expert_parallel no routed expert's weights [E, D, F/tp] are all-gathered over dp (each
    shard keeps its E/dp experts whole) and tokens cross dp by all-to-all, in bf16 both ways and in
    the backward; without it, no all-to-all."""
    mesh = sharding.make_mesh((4, 1, 2))
    E, D, F = CFG.n_experts, CFG.model_dimension, CFG.ffn_dim // 2

    def collectives_over_dp(cfg):
        grad = jax.grad(lambda p, x, y: pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, 2)[0])
        jaxpr = str(jax.make_jaxpr(grad)(abstract_params(cfg, mesh), *batch()))
        found = re.findall(r"(\w+)\[([\d,]*)\](?:\{[^}]*\})? = (all_gather|all_to_all)\[([^\]]*)\]", jaxpr)
        return [(primitive, dtype, shape) for dtype, shape, primitive, params in found
                if re.search(r"axis_name=(dp\b|\('dp',\))", params)]

    expert_shapes = {f"{E},{D},{F}", f"{E},{F},{D}"}
    for ep in (False, True):
        found = collectives_over_dp(with_model(CFG, model_dtype="bfloat16", expert_parallel=ep))
        # the pipeline gathers a stage's stacked blocks at once: [.., L, E, D, F]
        expert_gathers = [c for c in found if c[0] == "all_gather" and ",".join(c[2].split(",")[-3:]) in expert_shapes]
        all_to_alls = {dtype for primitive, dtype, _ in found if primitive == "all_to_all"}
        assert (bool(expert_gathers), all_to_alls) == ((False, {"bf16"}) if ep else (True, set())), ep


def test_bfloat16_matmuls_track_the_fp32_reference(reference):
    params, ref_loss, _, _ = reference
    mesh = sharding.make_mesh((2, 2, 2))
    cfg = with_model(CFG, model_dtype="bfloat16")
    sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
    loss, _ = jax.jit(lambda p, x, y: pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, 4))(sharded, *batch())
    bf16_ref, _ = jax.jit(lambda p: pipeline.one_device_loss(p, *batch(), KEY, cfg))(params)
    assert rel_err(loss, ref_loss) < 1e-2 and rel_err(loss, bf16_ref) < 1e-3


# 1024 (8 chunks) is opt-in: 256 (2 chunks) takes the same path
@pytest.mark.parametrize("T", [256, pytest.param(1024, marks=pytest.mark.slow("~20 s"))])
def test_causal_attention_in_query_chunks_equals_one_masked_softmax(T):
    """attend runs a causal attention in chunks of queries (T = 256: 2, T = 1024: 8), each against the
    keys up to its end; in fp32 its values and gradients equal one masked softmax over all T x T."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, T, 3, 24 if i < 2 else 16)) for i in range(3))
    chunked = lambda q, k, v: attention_kernels.attention(q, k, v, None, None, jnp.float32, None)
    whole = lambda q, k, v: model.masked_attention(q, k, v, jnp.tril(jnp.ones((T, T), bool)), jnp.float32, products.mm)
    assert attention_kernels.CAUSAL_MIN_CHUNK * 2 <= T          # more than one chunk
    # jitted: run op by op, the gradients compiled each of their dozens of operations apart (17 s of the test)
    np.testing.assert_allclose(jax.jit(chunked)(q, k, v), jax.jit(whole)(q, k, v), rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    grads = [jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v) for f in (chunked, whole)]
    for g, g_ref in zip(*grads):
        np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)


def test_the_narrow_v_check_compares_with_the_padded_kernel_while_a_step_is_traced():
    """cudnn_takes_narrow_v's check on a GPU, with einsum attention in place of cuDNN's (there is no
    GPU here): a narrow-v kernel that computes the padded one's attention passes, run on concrete
    arrays from inside a jit trace as the check runs; one that ignores the mask, or loses a column
    of v, fails it."""
    Q, K, T = 192, 64, 256
    causal = jnp.tril(jnp.ones((T, T), bool))
    narrow = lambda q, k, v, mask: model.masked_attention(q, k, v, causal if mask is None else mask, jnp.bfloat16,
                                                          products.mm)
    padded = lambda q, k, v, mask: narrow(q, k, jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, Q - K))), mask)[..., :K]
    always_causal = lambda q, k, v, mask: narrow(q, k, v, None)
    lossy = lambda q, k, v, mask: narrow(q, k, v.at[..., -1].set(0), mask)

    verdicts = []

    def body(x):                                 # where attend runs: inside shard_map, under jit
        with jax.ensure_compile_time_eval():
            verdicts.extend(attention_kernels.narrow_v_matches_padded(Q, K, kernel, padded, T=T)
                            for kernel in (narrow, always_causal, lossy))
        return x + 1
    mesh = sharding.make_mesh((2, 2, 2))
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("dp"), out_specs=PartitionSpec("dp")))(jnp.zeros(8))
    assert verdicts == [True, False, False]


@pytest.mark.parametrize("n_seq,T", [(3, 8), (16, 16), (5, 40), (2, 130)])
def test_cross_entropy_equals_log_softmax(n_seq, T):
    """The chunked cross-entropy and its hand-written backward (logits recomputed, never stored)
    against log_softmax over the full logits: value and both gradients. The padding rows past the
    real vocab hold nonzero values here and must still be ignored. The shapes give one chunk, two
    chunks of several sequences, and chunks of one long sequence."""
    cfg = utils.ModelConfig(vocab_size=1000, model_dimension=16, model_dtype="float32")
    table_VD = jax.random.normal(jax.random.key(1), (1024, 16))
    h_BTD = jax.random.normal(jax.random.key(2), (n_seq, T, 16))        # logits spread ~4: max-shift matters
    y_BT = jax.random.randint(jax.random.key(3), (n_seq, T), 0, cfg.vocab_size)

    def naive(table_VD, h_BTD):
        log_p = jax.nn.log_softmax(h_BTD @ table_VD[:cfg.vocab_size].T, axis=-1)
        return -jnp.sum(jnp.take_along_axis(log_p, y_BT[..., None], axis=-1))

    fused = lambda table_VD, h_BTD: one_device(cfg).engine.cross_entropy_sum(table_VD, h_BTD, y_BT, cfg, one_device(cfg))
    value, grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(table_VD, h_BTD)
    ref_value, ref_grads = jax.value_and_grad(naive, argnums=(0, 1))(table_VD, h_BTD)
    assert rel_err(value, ref_value) < 1e-6
    assert rel_err(grads[0], ref_grads[0]) < 1e-5 and rel_err(grads[1], ref_grads[1]) < 1e-5
    assert not jnp.any(grads[0][cfg.vocab_size:])


def test_the_cross_entropy_gradient_recomputes_no_logits():
    """Its gradient products run with the loss (loss._chunked_ce), from the logits already there:
    the compiled gradient's matmul FLOPs are the forward's three vocab-sized products per chunk (the
    logits, d h and d table; 4 chunks of 128 tokens here) and nothing in the backward pass, where the
    logits used to be recomputed (2 of the 4 products there)."""
    cfg = utils.ModelConfig(vocab_size=1000, model_dimension=16, model_dtype="float32")
    V, D, N = 1024, 16, 4 * 128
    table_VD = jax.random.normal(jax.random.key(1), (V, D))
    h_BTD = jax.random.normal(jax.random.key(2), (4, 128, D))
    y_BT = jax.random.randint(jax.random.key(3), (4, 128), 0, cfg.vocab_size)
    ce = lambda t, h: one_device(cfg).engine.cross_entropy_sum(t, h, y_BT, cfg, one_device(cfg))
    grad = jax.jit(jax.grad(ce, argnums=(0, 1)))
    flops = hlo.matmul_flops(grad.lower(table_VD, h_BTD).compile().as_text())
    vocab_products = 3 * 2 * V * D * N
    assert flops["backward"] == 0 and flops["remat"] == 0, flops
    assert vocab_products <= flops["forward"] == flops["output_layer"] <= vocab_products + 2 * N * D, flops


def test_dropout_masks_do_not_depend_on_the_mesh():
    cfg = with_model(CFG, dropout_rate=0.2)
    params = sharding.init_params(cfg, KEY)
    x, y = batch()
    train, evaluation = (jax.jit(lambda p: pipeline.one_device_loss(p, x, y, KEY, cfg, train=t)[0])(params)
                         for t in (True, False))
    mesh = sharding.make_mesh((2, 2, 2))
    sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
    loss, _ = jax.jit(lambda p: pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, 4, train=True))(sharded)
    assert rel_err(loss, train) < 1e-6 and rel_err(train, evaluation) > 1e-5   # dropout is active


@pytest.mark.parametrize("D", [256, 7])
def test_dropout_drops_its_rate_and_keeps_the_mean(D):
    """Each element's 16 random bits are half a word, the low halves the first half of D (an odd width's last
    word half used): the share dropped is the rate within 5 standard deviations, both halves of the words alike,
    every sequence its own mask, the mean kept."""
    rate, x_BTD, n = 0.2, jnp.ones((2, 512, D)), D // 2
    out = model.dropout(x_BTD, rate, KEY, jnp.arange(2))
    dropped = np.asarray(out == 0)
    sigma = math.sqrt(rate * (1 - rate) / dropped[..., n:].size)
    for half in (dropped[..., :n], dropped[..., n:]):
        assert abs(half.mean() - rate) < 5 * sigma
    assert (dropped[0] != dropped[1]).any()
    assert abs(float(out.mean()) - 1) < 5 * sigma / (1 - rate) and set(np.unique(out).round(4)) == {0, 1.25}


def test_init_is_mesh_independent():
    """The same global arrays on every mesh, with expert parallelism too (only the layout differs, so
    a checkpoint restores across both; main.py and test_main's (2,2,2) runs init without it)."""
    inits = [sharding.init_sharded_params(with_model(CFG, expert_parallel=ep), KEY, sharding.make_mesh(shape))
             for shape, ep in [((1, 1, 1), False), ((2, 2, 2), True)]]
    for leaves in zip(*map(jax.tree.leaves, inits)):
        for other in leaves[1:]:
            np.testing.assert_array_equal(np.asarray(other), np.asarray(leaves[0]))


def _optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1,
                                                                   mask=sharding.decay_mask))


def _train(params, loss_fn, steps=3):
    opt = _optimizer()

    @jax.jit
    def step(params, state, i):
        x, y = batch(seed=10 + i)
        grads = jax.grad(lambda p: loss_fn(p, x, y)[0])(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = opt.init(params)
    for i in range(steps):
        params, state = step(params, state, i)
    return params


@pytest.mark.slow("~30 s; test_main's (2,2,2) curve holds a mesh to one device over 20 steps in default CI")
def test_three_steps_keep_replicas_identical_and_match_reference():
    params = sharding.init_params(CFG, KEY)
    mesh = sharding.make_mesh((2, 2, 2))
    sharded = _train(jax.device_put(params, sharding.param_shardings(params, mesh)),
                     lambda p, x, y: pipeline.loss_and_metrics(p, x, y, KEY, CFG, mesh, 4))
    reference = _train(params, lambda p, x, y: pipeline.one_device_loss(p, x, y, KEY, CFG))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sharded), jax.tree.leaves(reference)):
        copies = {}
        for shard in a.addressable_shards:   # every device holding the same slice holds the same bits
            copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        for same_slice in copies.values():
            for other in same_slice[1:]:
                assert other.tobytes() == same_slice[0].tobytes(), jax.tree_util.keystr(path)
        # The exact comparison is the gradient test above. After steps, Adam's division by sqrt(v)
        # and the discrete top-k routing turn float-level differences (summation order) into larger
        # parameter differences; observed up to 4e-3 of the leaf's scale on expert weights.
        assert rel_err(a, b) < 1e-2, jax.tree_util.keystr(path)
    # Checkpointless reshard: the trained (2,2,2) params on other meshes, and with expert parallelism,
    # give the same loss.
    x, y = batch(seed=99)
    meshes = [(mesh, 4, CFG), (sharding.make_mesh((1, 8, 1)), 8, CFG),
              (sharding.make_mesh((4, 1, 2)), 2, with_model(CFG, expert_parallel=True))]
    losses = [float(jax.jit(lambda p: pipeline.loss_and_metrics(p, x, y, KEY, c, m, n)[0])(
        jax.device_put(sharded, sharding.param_shardings(sharded, m, c.expert_parallel)))) for m, n, c in meshes]
    np.testing.assert_allclose(losses, losses[0], rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# MoE by hand: 6 tokens, 3 experts, top-2, router = identity so the logits are the inputs.

LOGITS = np.array([[2, 1, 0], [2, 0, 1], [0, 2, 1], [1, 2, 0], [2, 1, 0], [0, 1, 2]], np.float32)
# Queue order is token-major, a token's choices in rank order:
# e0 <- t0 t1 t3 t4, e1 <- t0 t2 t3 t4 t5, e2 <- t1 t2 t5.
EXPERTS = [[0, 1], [0, 2], [1, 2], [1, 0], [0, 1], [2, 1]]
SLOTS = [[0, 0], [1, 0], [1, 1], [2, 2], [3, 3], [2, 4]]
MOE_CFG = utils.ModelConfig(model_dimension=3, n_experts=3, k=2, n_shared=1, capacity_factor=0.5, T=6,
                            model_dtype="float32")


def _moe_weights(seed=0):
    rng = np.random.default_rng(seed)
    F = MOE_CFG.ffn_dim
    return {"router": jnp.eye(3), "expert_up": jnp.asarray(rng.normal(size=(3, 3, F)), jnp.float32),
            "expert_down": jnp.asarray(rng.normal(size=(3, F, 3)), jnp.float32),
            "shared_up": jnp.asarray(rng.normal(size=(1, 3, F)), jnp.float32),
            "shared_down": jnp.asarray(rng.normal(size=(1, F, 3)), jnp.float32)}


def moe(w, x_BTD, cfg, axes, fill_BE=None):
    """The MoE layer holding weights w (router, expert_up, ..., optionally router_bias) on x_BTD."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model.MoE(cfg, nnx.Rngs(0), "router_bias" in w)))
    return nnx.merge(graphdef, w)(x_BTD, axes, fill_BE)


def test_routing_by_hand():
    x = jnp.asarray(LOGITS)[None]
    routing, balance = model.route(jnp.eye(3), x, MOE_CFG)
    np.testing.assert_array_equal(routing.experts_BTk[0], EXPERTS)
    np.testing.assert_array_equal(routing.slot_BTk[0], SLOTS)
    np.testing.assert_array_equal(routing.tokens_per_expert_BE[0], [4, 5, 3])
    gates = routing.gates_BTk
    s = 1 / (1 + np.exp(-LOGITS))
    chosen = np.take_along_axis(s, np.array(EXPERTS), axis=1)
    np.testing.assert_allclose(gates[0], chosen / chosen.sum(1, keepdims=True), rtol=1e-6)
    f = 3 / (2 * 6) * np.array([4, 5, 3])                  # E/(kT) x tokens routed to i
    p = (s / s.sum(1, keepdims=True)).mean(0)
    np.testing.assert_allclose(balance[0], (f * p).sum(), rtol=1e-6)
    assert model.expert_capacity(MOE_CFG) == 2              # ceil(0.5 * 2 * 6 / 3)


def test_biased_routing_by_hand():
    """Aux-loss-free bias: the top-k is taken on score + bias, the gates and P_i on the score alone."""
    bias = np.array([0.0, -0.3, 0.4], np.float32)
    x = jnp.asarray(LOGITS)[None]
    (experts, gates, _, tokens_per_expert), balance = model.route(jnp.eye(3), x, MOE_CFG, jnp.asarray(bias))
    s = 1 / (1 + np.exp(-LOGITS))
    chosen_experts = np.argsort(-(s + bias), axis=1, kind="stable")[:, :2]
    assert not np.array_equal(chosen_experts, EXPERTS), "the bias should change some choices"
    np.testing.assert_array_equal(experts[0], chosen_experts)
    chosen = np.take_along_axis(s, chosen_experts, axis=1)
    np.testing.assert_allclose(gates[0], chosen / chosen.sum(1, keepdims=True), rtol=1e-6)
    counts = np.bincount(chosen_experts.ravel(), minlength=3)
    np.testing.assert_array_equal(tokens_per_expert[0], counts)
    p = (s / s.sum(1, keepdims=True)).mean(0)
    np.testing.assert_allclose(balance[0], (3 / (2 * 6) * counts * p).sum(), rtol=1e-6)


def test_deepseek_v3_gates_by_hand():
    """--renormalize_gates false: the chosen scores themselves are the gates; --routed_scaling multiplies
    them either way."""
    x = jnp.asarray(LOGITS)[None]
    s = 1 / (1 + np.exp(-LOGITS))
    chosen = np.take_along_axis(s, np.array(EXPERTS), axis=1)
    for renormalize, want in ((False, chosen), (True, chosen / chosen.sum(1, keepdims=True))):
        cfg = with_model(MOE_CFG, renormalize_gates=renormalize, routed_scaling=2.5)
        gates = model.route(jnp.eye(3), x, cfg)[0].gates_BTk
        np.testing.assert_allclose(gates[0], 2.5 * want, rtol=1e-6)


def test_router_bias_update_by_hand():
    tokens = jnp.array([[5, 3, 4], [4, 4, 4], [2, 1, 1]])     # mean 4; balanced; mean 4/3, just above 1
    updated = trainer.update_router_bias(jnp.zeros((3, 3)), tokens, 1e-3)
    np.testing.assert_array_equal(updated, np.float32([[-1e-3, 1e-3, 0], [0, 0, 0], [-1e-3, 1e-3, 1e-3]]))


def test_router_bias_update_does_not_overflow():
    """256 experts and 80M routed choices in a step, 9M of them to expert 0: E x 9M is past 2^31, where an
    int32 product wrapped round and moved that expert's bias up instead of down."""
    E, total, busiest = 256, 80_000_000, 9_000_000
    counts = np.full(E, (total - busiest) // (E - 1), np.int64)
    counts[0] = busiest
    counts[1] += total - counts.sum()
    updated = trainer.update_router_bias(jnp.zeros((1, E)), jnp.asarray(counts[None], jnp.int32), 1e-3)
    np.testing.assert_array_equal(np.sign(updated[0]), np.sign(total - E * counts))      # int64: exact
    assert updated[0, 0] < 0


def test_balance_loss_is_applied_in_every_moe_layer_and_summed():
    """Two MoE-only layers whose attention and experts output 0, so both route the embeddings
    themselves (rows of +-1: RMSNorm leaves them as they are) through their own router. Each layer's
    term is alpha x the mean over sequences of sum_i f_i P_i, written out below; the loss adds them."""
    cfg = utils.ModelConfig(vocab_size=8, model_dimension=4, n_head=1, blocks=2, layers_per_block=1, T=6,
                            latent_dim=4, q_latent_dim=4, dhR=2, n_experts=3, k=2, n_shared=1, capacity_factor=0.0,
                            model_dtype="float32", alpha=0.5, remat="none")
    rng = np.random.default_rng(0)
    embed = rng.choice([-1.0, 1.0], size=(cfg.padded_vocab, 4)).astype(np.float32)
    routers = rng.normal(size=(2, 4, 3)).astype(np.float32)                     # [blocks, D, E]
    params = sharding.init_params(cfg, KEY)
    layers = params["blocks"]["moe"]
    params = params | {"embed": jnp.asarray(embed), "blocks": params["blocks"] | {"moe": layers | {
        "attn": layers["attn"] | {"w_o": jnp.zeros_like(layers["attn"]["w_o"])},
        "moe": layers["moe"] | {"router": jnp.asarray(routers),
                                "expert_down": jnp.zeros_like(layers["moe"]["expert_down"]),
                                "shared_down": jnp.zeros_like(layers["moe"]["shared_down"])}}}}
    ids = np.array([[1, 2, 3, 4, 5, 6], [7, 7, 0, 1, 1, 2]])
    loss, metrics = jax.jit(lambda p: pipeline.one_device_loss(p, jnp.asarray(ids), jnp.asarray(ids), KEY,
                                                                          cfg))(params)

    x = embed[ids]                                                              # [B, T, D]
    for layer, router in enumerate(routers):
        s = 1 / (1 + np.exp(-(x @ router)))                                     # [B, T, E]
        top2 = np.argsort(-s, axis=-1)[..., :2]
        f = 3 / (2 * 6) * np.stack([np.bincount(seq.ravel(), minlength=3) for seq in top2])   # [B, E]
        p = (s / s.sum(-1, keepdims=True)).mean(1)                              # [B, E]
        np.testing.assert_allclose(metrics["balance"][layer], 0.5 * np.mean(np.sum(f * p, -1)), rtol=1e-5)
    assert metrics["balance"][0] != metrics["balance"][1]
    np.testing.assert_allclose(loss, metrics["ce"] + metrics["balance"].sum(), rtol=1e-6)


def _moe_by_hand(w, capacity):
    """The MoE's output [T, D] on LOGITS, token by token: the kept choices' gated experts plus the
    shared expert (jnp, so that it can be differentiated too)."""
    s = 1 / (1 + np.exp(-LOGITS))
    out = []
    for t in range(6):
        chosen = [s[t, e] for e in EXPERTS[t]]
        out_D = jax.nn.gelu(LOGITS[t] @ w["shared_up"][0]) @ w["shared_down"][0]
        for j, e in enumerate(EXPERTS[t]):
            if SLOTS[t][j] < capacity:
                out_D += chosen[j] / sum(chosen) * (jax.nn.gelu(LOGITS[t] @ w["expert_up"][e]) @ w["expert_down"][e])
        out.append(out_D)
    return jnp.stack(out)


def test_router_logits_are_fp32_at_full_precision():
    """On TPU an fp32 dot at default precision is one bf16 pass: the router's must ask for HIGHEST."""
    cfg = with_model(CFG, model_dtype="bfloat16", n_experts=4)        # E != dhR: w_kr is [D, dhR]
    params = jax.eval_shape(lambda: sharding.init_params(cfg, KEY))
    forward = lambda p, x: sharding.build(sharding.model_order(p), cfg)(x, one_device(cfg))[0]
    hlo = jax.jit(forward).lower(params, batch()[0]).as_text()
    router_type = f"tensor<{cfg.model_dimension}x{cfg.n_experts}xf32>"   # [D, E], no other weight has it
    router_dots = [line for line in hlo.splitlines() if "dot_general" in line and f"{router_type}) ->" in line]
    assert router_dots and all("precision = [HIGHEST, HIGHEST]" in line for line in router_dots), router_dots


@pytest.mark.parametrize("impl", utils.CHOICES["moe_impl"])
def test_moe_output_drops_and_shared_expert_by_hand(impl):
    w = _moe_weights()
    cfg = with_model(MOE_CFG, moe_impl=impl)
    out, stats, _ = moe(w, jnp.asarray(LOGITS)[None], cfg, one_device(cfg))
    np.testing.assert_allclose(out[0], _moe_by_hand(w, capacity=2), rtol=1e-5, atol=1e-5)
    assert float(stats["dropped"]) == 6                      # e0: t3 t4, e1: t3 t4 t5, e2: t5
    no_shared = {name: value for name, value in w.items() if not name.startswith("shared")}
    out_routed, _, _ = moe(no_shared, jnp.asarray(LOGITS)[None], with_model(cfg, n_shared=0), one_device(cfg))
    assert not np.allclose(out, out_routed), "the shared expert's output must be added"


@pytest.mark.parametrize("impl", ["buffers", "ragged"])
def test_moe_weight_gradients_with_drops_by_hand(impl):
    """The weights' gradients through the capacity buffers' scatter (its indices promised unique,
    dropped choices sent past the end: expert_kernels._distinct_drops) and the gathers back equal autodiff
    of the by-hand sum over kept choices, for a random cotangent."""
    w, cfg = _moe_weights(2), with_model(MOE_CFG, moe_impl=impl)
    g_TD = jax.random.normal(jax.random.key(5), LOGITS.shape)
    by_hand = lambda w: jnp.sum(_moe_by_hand(w, capacity=2) * g_TD)        # capacity 2: 6 of the 12 choices drop

    through_moe = lambda w: jnp.sum(moe(w, jnp.asarray(LOGITS)[None], cfg, one_device(cfg))[0][0] * g_TD)
    got, want = jax.jit(jax.grad(through_moe))(w), jax.jit(jax.grad(by_hand))(w)      # jitted: op by op compiled each
    for name in ("expert_up", "expert_down", "shared_up", "shared_down"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_dropless_equals_capacity_mode_when_nothing_is_dropped():
    w = _moe_weights(1)
    x = jnp.asarray(LOGITS)[None]
    roomy = with_model(MOE_CFG, capacity_factor=1.25)   # C = 5 >= the busiest expert's 5 tokens
    dropless = with_model(MOE_CFG, capacity_factor=0.0)  # C = T = 6
    assert (model.expert_capacity(roomy), model.expert_capacity(dropless)) == (5, 6)
    out_roomy, stats_roomy, _ = moe(w, x, roomy, one_device(roomy))
    out_dropless, stats_dropless, _ = moe(w, x, dropless, one_device(dropless))
    assert float(stats_roomy["dropped"]) == float(stats_dropless["dropped"]) == 0
    np.testing.assert_allclose(out_roomy, out_dropless, rtol=1e-6)
    np.testing.assert_allclose(out_dropless[0], _moe_by_hand(w, capacity=6), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------


def test_rope_scores_depend_only_on_relative_position():
    q = jax.random.normal(jax.random.key(1), (1, 5, 3, 8))  # [B, T, H, R]
    k = jax.random.normal(jax.random.key(2), (1, 5, 8))     # [B, T, R], shared by the heads
    pos = jnp.arange(5)

    def scores(shift):
        return jnp.einsum("bthr,bsr->bhts", model.rope(q, pos + shift, 10_000.0), model.rope(k, pos + shift, 10_000.0))
    np.testing.assert_allclose(scores(0), scores(37), rtol=1e-4, atol=1e-4)
    assert not np.allclose(scores(0), jnp.einsum("bthr,bsr->bhts", q, k), atol=1e-3)


@pytest.mark.parametrize("base,capacity_factor", [(CFG, 1.0), (CFG, 0.25), (DSV3, 0.0)])   # 0.25: most drop
def test_cached_and_uncached_generation_agree(base, capacity_factor):
    """Cached decode (one token per call) keeps and drops exactly what the full forward over the
    padded sequence does, so the logits agree to float noise and the samples are identical; in
    DeepSeek-V3's architecture too (its first dense layers, RoPE and latent norms in every layer)."""
    cfg = with_model(base, blocks=2, T=24, remat="full", capacity_factor=capacity_factor)
    params = sharding.init_params(cfg, jax.random.key(3))
    args = (params, cfg, [5, 17, 42, 7], jax.random.key(4), 12, 20, 0.9)
    cached, cached_logits = generate.generate(*args, use_cache=True, return_logits=True)
    plain, plain_logits = generate.generate(*args, use_cache=False, return_logits=True)
    assert cached == plain and len(cached) == 12
    np.testing.assert_allclose(cached_logits, plain_logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="--max_tokens"):
        generate.generate(params, cfg, [1] * 20, jax.random.key(0), 10, 5, 1.0)


def test_cache_holds_only_latent_rotary_key_and_expert_fill():
    caches = generate.init_caches(CFG, batch=1, length=CFG.T)
    shapes = {jax.tree_util.keystr(path): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(caches)}
    assert shapes == {"['blocks']['dense']['attn']['c_kv']": (CFG.blocks, 1, 1, CFG.T, CFG.latent_dim),
                      "['blocks']['dense']['attn']['k_rope']": (CFG.blocks, 1, 1, CFG.T, CFG.dhR),
                      "['blocks']['moe']['attn']['c_kv']": (CFG.blocks, 1, CFG.T, CFG.latent_dim),
                      "['blocks']['moe']['expert_fill']": (CFG.blocks, 1, CFG.n_experts)}


def test_shape_errors_come_from_validation():
    cfg = utils.override(utils.Config(model=CFG), n_head=6, model_dimension=36, n_device_axis=(1, 1, 4))
    with pytest.raises(utils.ConfigError, match=r"--n_head \(6\) must be divisible by TP"):
        utils.validate(cfg, n_devices=8)


def test_param_counts_and_flops():
    counts = sharding.count_params(CFG)
    sizes = {jax.tree_util.keystr(p): math.prod(s) for p, s in jax.tree_util.tree_leaves_with_path(
        sharding.param_shapes(CFG), is_leaf=lambda s: isinstance(s, tuple))}
    routed = sum(v for k, v in sizes.items() if "expert_" in k and "shared" not in k)
    body = sum(sizes.values()) - sizes["['embed']"]
    assert counts["embedding"] == CFG.vocab_size * CFG.model_dimension
    assert counts["total"] == body + counts["embedding"]
    assert counts["active"] == body - routed + routed * CFG.k // CFG.n_experts
    moe1B = sharding.count_params(utils.PRESETS["moe1B"].model)
    assert 0.9e9 < moe1B["total"] < 1.1e9 and 0.3e9 < moe1B["active"] < 0.45e9
    assert sharding.flops_per_token(CFG) > 6 * counts["active"]


@pytest.mark.parametrize("preset", ["tiny", "dsv3-tiny", "moe1B"])
def test_the_flops_formula_the_run_prints_is_the_one_mfu_counts(preset):
    """sharding.FLOPS_PER_TOKEN, the words main.py prints, evaluated: flops_per_token's number (the guide's
    RoPE-free MoE layers and DeepSeek-V3's RoPE everywhere, different value widths)."""
    m = utils.PRESETS[preset].model
    names = dict(active_params=sharding.count_params(m)["active"], V=m.vocab_size, D=m.model_dimension, T=m.T,
                 n_head=m.n_head, qk_head_dim=m.head_dim, v_head_dim=m.value_dim, n_layers=m.n_layers, dhR=m.dhR,
                 rope_layers=m.n_layers if m.rope_all_layers else m.n_layers - m.blocks)
    assert eval(sharding.FLOPS_PER_TOKEN.replace(" x ", " * "), names) == sharding.flops_per_token(m)


def test_the_compiled_program_does_not_grow_with_depth():
    # Layers are scanned, not unrolled: the optimized program for 16 blocks has the instructions of the
    # one for 4 (compile time follows; a timed test was flaky on two busy cores). 2 blocks on 2 stages
    # is smaller: XLA drops a loop of one trip.
    mesh = sharding.make_mesh((1, 2, 1))
    instructions = {}
    for blocks in (4, 16):
        cfg = with_model(CFG, blocks=blocks, remat="full")
        x, y = batch(cfg=cfg)
        text = sharded_value_and_grad(cfg, mesh, 2).lower(abstract_params(cfg, mesh), x, y).compile().as_text()
        instructions[blocks] = sum(len(body) for body in hlo.parse(text)[0].values())
    print(f"\noptimized instructions of the training step on (1,2,1): {instructions}")
    assert instructions[16] <= 1.02 * instructions[4]
