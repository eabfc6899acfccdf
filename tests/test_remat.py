"""What the layers' remat keeps for the backward and what it replays, read off the traced gradient (no GPU
needed): a fused kernel's outputs and the routed experts' outputs are kept, so the backward runs neither
the kernel's forward nor the experts' down-projection again; and the matmuls' choice of operands for
XLA:CPU (`products.fp32_product`) hands the backward no copies of the weights.
"""
import jax
import jax.numpy as jnp

from engine import attention_kernels
import engine
import model
import pipeline
import sharding
from model_util import CFG, KEY, abstract_params, batch, equations as eqns, with_model


@jax.custom_vjp
def _kernel(q, k):
    """A stand-in for cuDNN's attention: a custom VJP whose backward needs its output and a statistic."""
    return jnp.tanh(q * k)


def _kernel_fwd(q, k):
    out = jnp.tanh(q * k)
    return out, (q, k, out, jnp.sum(out, axis=-1))


def _kernel_bwd(residuals, g):
    q, k, out, total = residuals
    d = g * (1 - out * out) + 0 * total[..., None]
    return d * k, d * q


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def test_a_kept_kernels_forward_runs_once_under_the_remat():
    """Under the layers' remat (--remat full and dots alike) keep_kernel_outputs gives the kernel's own
    gradient and the backward does not run the kernel's forward again (one tanh in the whole gradient,
    the forward's); the kernel alone is run twice, once more in the replay."""
    x, w = jnp.linspace(-1, 1, 24).reshape(4, 6), jnp.linspace(0.5, 1.5, 24).reshape(4, 6)

    def layer(kernel):
        return lambda x, w: jnp.sum(jnp.sin(kernel(x * w, x + w)) ** 2)

    for policy in engine.REMAT_POLICIES.values():
        def grad(kernel):
            return jax.grad(jax.checkpoint(layer(kernel), policy=policy), argnums=(0, 1))
        kept = lambda q, k: attention_kernels.keep_kernel_outputs(_kernel, q, k)
        tanhs = lambda kernel: sum(e.primitive.name == "tanh" for e in eqns(jax.make_jaxpr(grad(kernel))(x, w).jaxpr))
        assert (tanhs(kept), tanhs(_kernel)) == (1, 2)
        for a, b in zip(grad(kept)(x, w), grad(_kernel)(x, w)):
            assert jnp.array_equal(a, b)


def _grad_jaxpr(cfg, mesh):
    grad = jax.grad(lambda p, x, y: pipeline.loss_and_metrics(p, x, y, KEY, cfg, mesh, 1)[0])
    return jax.make_jaxpr(grad)(abstract_params(cfg, mesh), *batch()).jaxpr


def test_the_experts_outputs_are_kept_not_replayed(monkeypatch):
    """Under --remat full the experts' down-projection ([B, E, C, F] x [E, F, D]) runs once, in the
    forward: its outputs are kept (EXPERT_OUTPUTS) for the gates' gradient. Without the name in the
    policy the replay runs it a second time."""
    mesh = sharding.make_mesh((1, 1, 1))
    cfg = with_model(CFG, remat="full")
    B, E, F, D = 16, CFG.n_experts, CFG.ffn_dim, CFG.model_dimension

    def down_projections():
        """The products of the weights [E, F, D] with hidden units [B, E, C, F] (einsum orders them as
        it likes: the hidden's last dim and the weights' are F)."""
        def down(e):
            shapes = [v.aval.shape for v in e.invars]
            return (E, F, D) in shapes and any(len(s) == 4 and s[:2] == (B, E) and s[-1] == F for s in shapes)
        return sum(e.primitive.name == "dot_general" and down(e) for e in eqns(_grad_jaxpr(cfg, mesh)))
    kept = down_projections()
    names = tuple(n for n in engine._ALWAYS_KEPT if n != model.EXPERT_OUTPUTS)
    monkeypatch.setitem(engine.REMAT_POLICIES, "full", jax.checkpoint_policies.save_only_these_names(*names))
    assert (kept, down_projections()) == (1, 2)


def test_the_products_platform_choice_hands_the_backward_no_copies():
    """bf16 under --remat full: nothing the forward scans stack for the backward comes out of a
    conditional. `products.fp32_product`'s choice of operands (lax.platform_dependent) traces as one;
    outside a checkpoint of its own, JAX split it and handed the replay both branches' copies of every
    weight (the CPU's widened one and the accelerator's bf16 one), which the layer scans stacked."""
    mesh = sharding.make_mesh((1, 1, 1))
    cfg = with_model(CFG, model_dtype="bfloat16", remat="full")
    from_conds = []
    for e in eqns(_grad_jaxpr(cfg, mesh)):
        if e.primitive.name == "scan" and not e.params["reverse"]:
            body = e.params["jaxpr"].jaxpr
            producer = {id(v): q.primitive.name for q in body.eqns for v in q.outvars}
            from_conds += [str(v.aval) for v in body.outvars[e.params["num_carry"]:] if producer.get(id(v)) == "cond"]
    assert not from_conds
