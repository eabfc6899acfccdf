"""The small model the model and engine tests share: CFG (MoE + RoPE + NoPE layers, 8 blocks and 8 experts,
fp32) and its DeepSeek-V3-shaped variant DSV3, the config changes EP and CIRCULAR, a batch, the routing
bias ROUTER_BIAS, the one-device reference run and the sharded loss's value_and_grad, the abstract params
to lower without computing, and a walk over a traced program's equations (sub-jaxprs included)."""
import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

import pipeline
import sharding
import utils
from small_configs import small_model

# MoE + RoPE + NoPE layers, 8 blocks so that pp can be 8 and 8 experts so that expert parallelism
# (E/dp whole experts per dp shard) can run on dp 8; fp32 so the comparison is tight.
CFG = small_model(n_head=8, blocks=8, n_experts=8, capacity_factor=1.0, model_dtype="float32", remat="none")
BATCH = 16
EP = {"expert_parallel": True}     # each dp shard holds E/dp whole experts; tokens reach them by all-to-all
CIRCULAR = {"pipeline_repeats": 2}     # the circular pipeline, params stored as [R, blocks/R, ...]
KEY = jax.random.key(0)
# The sharded runs route with a nonzero aux-loss-free bias [blocks, E] (test_model checks the update it gets).
ROUTER_BIAS = 0.05 * jax.random.normal(jax.random.key(5), (CFG.blocks, CFG.n_experts))


def batch(seed=1, n=BATCH, cfg=CFG):
    tokens = jax.random.randint(jax.random.key(seed), (n, cfg.T + 1), 0, cfg.vocab_size)
    return tokens[:, :-1], tokens[:, 1:]


def rel_err(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def one_device_run(cfg):
    """(params, loss, metrics, gradients) of cfg's model on one device, routed with ROUTER_BIAS."""
    params = sharding.init_params(cfg, KEY)
    x, y = batch()
    (loss, metrics), grads = jax.jit(jax.value_and_grad(lambda p: pipeline.one_device_loss(
        sharding.with_router_bias(p, ROUTER_BIAS), x, y, KEY, cfg), has_aux=True))(params)
    return params, loss, metrics, grads


def sharded_value_and_grad(cfg, mesh, n_micro, router_bias=None):
    """value_and_grad of the sharded loss in the params (routed with router_bias when given)."""
    def loss(p, x, y):
        p = p if router_bias is None else sharding.with_router_bias(p, router_bias)
        return pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, n_micro)
    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def with_model(cfg, **changes):
    return utils.override(utils.Config(model=cfg), **changes).model


# DeepSeek-V3's architecture (utils.ModelConfig's options; --preset dsv3-tiny): a dense layer before the
# blocks, every block one MoE layer with RoPE, gated SiLU FFNs of their own widths, RMSNorms without shift and
# on both latents, an untied output table, heads narrower than D/H, values narrower still, routed scaling.
DSV3 = with_model(CFG, ffn="gated_silu", ffn_hidden_dim=64, moe_hidden_dim=32, norm_shift=False, latent_norm=True,
                  rope_all_layers=True, first_k_dense=1, tied_embeddings=False, layers_per_block=1, qk_head_dim=8,
                  v_head_dim=6, routed_scaling=2.5)


def abstract_params(cfg, mesh):
    """Shapes, dtypes and shardings of cfg's parameters on mesh, for lowering without computing."""
    params = jax.eval_shape(lambda: sharding.init_params(cfg, KEY))
    return jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params,
                        sharding.param_shardings(params, mesh, cfg.expert_parallel))


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax_core.Jaxpr):
                yield item


def equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from equations(sub)

