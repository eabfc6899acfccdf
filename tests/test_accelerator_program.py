"""The program we check is the program that runs.

Every platform traces the same training step: whether bf16 operands are widened for XLA:CPU is decided
when the step is lowered for its devices (`products.fp32_product`), so these CPU tests trace the step a
TPU VM or a GPU traces, and `--compile_for` compiles it. Lowered for an accelerator here, its matmuls
take bf16 operands, and no gradient is summed in bf16 on the way (the scatter-adds and scan carries
of parameter-shaped cotangents, and every psum but the activations' over tp, are fp32).
"""
import collections
import re

import jax
import jax.numpy as jnp
import pytest

from trainer import build_trainer
import pipeline
import sharding
import utils
from model_util import CFG, KEY, abstract_params, batch, equations, with_model

BF16 = with_model(CFG, model_dtype="bfloat16")
# (mesh, config changes): FSDP, tp and pp together, with the ragged experts; expert parallelism (4
# blocks, so that no stacked weight has the shape of its token buffers [E = 8, slots, D])
CASES = [((2, 2, 2), {"moe_impl": "ragged"}), ((4, 1, 2), {"expert_parallel": True, "blocks": 4})]


def train_step_jaxpr(cfg, mesh):
    """The jaxpr of main.py's jitted training step (a fresh trainer, so nothing is served from a trace
    cache) on abstract arguments."""
    config = utils.override(utils.Config(model=cfg), n_device_axis=mesh.devices.shape[1:], train_batch_size=8,
                            micro_batch_size=2)
    trainer = build_trainer(config, mesh)
    x = jax.ShapeDtypeStruct((mesh.shape["dp"] * 8, cfg.T), jnp.int32, sharding=trainer.data_sharding)
    return jax.make_jaxpr(trainer.step)(trainer.abstract_state, ((x,), (x,)))


@pytest.mark.parametrize("shape,changes", CASES)
def test_the_train_step_traces_alike_whatever_backend_traces_it(monkeypatch, shape, changes):
    """What jax.default_backend() says (the CPU here, the TPU on a TPU VM) changes nothing in the traced
    step: planning/report.py's trace for a slice is the slice's own."""
    cfg, mesh = with_model(BF16, **changes), sharding.make_mesh(shape)
    here = str(train_step_jaxpr(cfg, mesh))
    for backend in ("tpu", "gpu"):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        assert str(train_step_jaxpr(cfg, mesh)) == here, backend


def dot_operand_dtypes(fn, cfg, mesh, platform):
    """Counter of (op, lhs dtype, rhs dtype) over the matmuls of fn lowered for `platform`."""
    text = jax.jit(fn).trace(abstract_params(cfg, mesh), *batch()).lower(lowering_platforms=(platform,)).as_text()
    return collections.Counter(re.findall(
        r"(stablehlo\.dot_general|chlo\.ragged_dot)[^\n]*?: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>", text))


@pytest.mark.parametrize("moe_impl", ["buffers", "ragged"])
def test_matmuls_lowered_for_an_accelerator_take_bf16_operands(moe_impl):
    """Lowered for a TPU or a GPU, every matmul of the loss and of its gradient is bf16 x bf16 -> fp32
    but the router's logits (fp32 at HIGHEST, on purpose) and the gate-weighted sum of the k expert
    outputs: one each per MoE layer in the forward, plus two transposes each in the gradient. The
    backward's matmuls round the fp32 cotangent first (JAX's own transpose would multiply it in fp32:
    TF32 GEMMs on GPU). The same trace lowered for the CPU widens every operand to fp32."""
    cfg, mesh = with_model(BF16, moe_impl=moe_impl), sharding.make_mesh((2, 1, 2))
    loss = lambda p, x, y: pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, 2)[0]
    for platform in ("tpu", "cuda"):
        forward, gradient = (dot_operand_dtypes(fn, cfg, mesh, platform) for fn in (loss, jax.grad(loss)))
        assert {(a, b) for _, a, b in forward + gradient} == {("bf16", "bf16"), ("f32", "f32")}, platform
        f32 = lambda counted: sum(n for (_, a, _), n in counted.items() if a == "f32")
        assert f32(forward) == 2 and f32(gradient) == 3 * f32(forward), (platform, forward, gradient)
        assert sum(gradient.values()) - f32(gradient) > 2 * (sum(forward.values()) - f32(forward))
    on_cpu = dot_operand_dtypes(jax.grad(loss), cfg, mesh, "cpu")
    assert set(on_cpu) == {("stablehlo.dot_general", "f32", "f32")}


def parameter_shapes(cfg, mesh):
    """Every shape a parameter's value or gradient has on a device: its shard, all-gathered over dp or
    not, with or without the leading stacking dims (the scans slice those off)."""
    shapes = set()
    for abstract, spec in zip(jax.tree.leaves(abstract_params(cfg, mesh)),
                              jax.tree.leaves(sharding.param_specs(jax.eval_shape(lambda: sharding.init_params(cfg, KEY)),
                                                                cfg.expert_parallel))):
        local = abstract.sharding.shard_shape(abstract.shape)
        gathered = tuple(n * mesh.shape["dp"] if axis == "dp" else n
                         for n, axis in zip(local, (*spec, *(None,) * len(local))))
        shapes |= {s[i:] for s in (local, gathered) for i in range(len(s) - 1)}
    return shapes


SUMS = {"psum", "psum_invariant", "psum_scatter", "reduce_scatter", "all_reduce"}


def sum_axes(eqn):
    """The mesh axes a cross-device sum runs over."""
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return set(axes) if isinstance(axes, (tuple, list)) else {axes}


def bf16_sums(jaxpr, parameter_shapes):
    """(primitive, shape) of every cross-device sum of a bf16 value in the jaxpr shaped like a
    parameter, or of any shape over an axis but tp (activations and their gradients are summed over tp
    in bf16 by design, `collectives.tp_sum`), and of every scatter-add or scan carry that is bf16 and
    shaped like a parameter."""
    found = []
    for eqn in equations(jaxpr):
        name, shapes = eqn.primitive.name, parameter_shapes
        if name in ("scatter-add", "scatter_add"):
            values = eqn.invars[:1]
        elif name == "scan":
            start = eqn.params["num_consts"]
            values = eqn.invars[start:start + eqn.params["num_carry"]]
        elif name in SUMS:
            values, shapes = eqn.invars, (parameter_shapes if sum_axes(eqn) <= {"tp"} else None)
        else:
            continue
        found += [(name, tuple(v.aval.shape)) for v in values if getattr(v.aval, "dtype", None) == jnp.bfloat16
                  and (shapes is None or tuple(v.aval.shape) in shapes)]
    return found


@pytest.mark.parametrize("shape,changes", CASES)
def test_no_gradient_is_summed_in_bf16(shape, changes):
    """The tied table is looked up from its fp32 copy (so repeated tokens' rows add up in fp32), the
    chunked cross-entropy carries the table's gradient across chunks in fp32, and every psum of a
    parameter's cotangent (over tp, over dp and pp for the table) is fp32; only activations and
    their cotangents are summed over tp in bf16. The gradient's own scatter-adds, scans and sums all
    appear in this jaxpr, which every platform traces alike."""
    # T = 24: no activation [mb, T, D] has the shape of a parameter (the test tells them apart by shape)
    cfg, mesh = with_model(BF16, T=24, **changes), sharding.make_mesh(shape)
    jaxpr = train_step_jaxpr(cfg, mesh).jaxpr
    names = {eqn.primitive.name for eqn in equations(jaxpr)}
    assert {"scatter-add", "scan"} <= names and names & SUMS, "the walk must see the step's sums"
    assert bf16_sums(jaxpr, parameter_shapes(cfg, mesh)) == []
    # the tp all-reduces of activations and their gradients do move bf16 (half the bytes)
    assert any(eqn.primitive.name in SUMS and sum_axes(eqn) == {"tp"} and eqn.invars[0].aval.dtype == jnp.bfloat16
               for eqn in equations(jaxpr))


@pytest.fixture(scope="module")
def bf16_grad_error():
    """bench.grad_error of BF16 (vocab 1000, T 32) on tp = 2 against the fp32 reference, on one Zipf batch of 16
    sequences: the mesh's errors beside one device's, the reference engine's (one device) and those of the fp32
    gradient rounded once. The two tests below read it (one device's run is the same whatever the mesh)."""
    import bench
    cfg = utils.override(utils.Config(model=with_model(BF16, vocab_size=1000, T=32)), n_device_axis=(1, 1, 2),
                         train_batch_size=16, micro_batch_size=1)
    return bench.grad_error(cfg)


def test_the_tied_tables_bf16_gradient_is_as_close_as_rounding_allows(bf16_grad_error):
    """One device, bf16, a Zipf batch (the commonest token fills about a fifth of the positions): the
    table's gradient against the fp32 reference's. A bf16 sum over a token's occurrences (the lookup's
    scatter-add, the chunks of the cross-entropy) put it at about 10x the error of rounding the fp32
    gradient once; summed in fp32 it stays within the bf16 forward's own noise (about 2x)."""
    table = bf16_grad_error["table_error"]
    assert table["one_device"] < 3 * table["rounding"], table


def test_a_tp_mesh_and_the_fast_engine_in_bf16_cost_no_more_than_bf16_itself(bf16_grad_error):
    """SPEC rule 1 in bf16: on tp = 2, whose all-reduces of activations and of their gradients move bf16
    (`collectives.tp_sum`), every leaf's gradient error against the fp32 reference is at most twice one
    device's (the mesh adds at most what bf16 costs there), and the worst leaf's within bench's bound.
    The fast engine's kernels and numerics are no further from fp32 than the reference engine's plain math:
    leaf by leaf no further in the median, and its worst leaf within the mesh's bound of the reference's (the
    worst leaves are the experts', whose error is which choices flip, a few either way)."""
    result = bf16_grad_error
    assert result["leaf_ratio"]["max"] <= 2 and result["ratio"] <= result["bound"], result
    assert result["engine"] == "fast" and result["engine_leaf_ratio"]["median"] <= 1, result
    assert result["one_device_error"] <= result["bound"] * result["reference_engine_error"], result
