"""Engine: the product seam's fast implementation (engine.Fast.mm).

The contract every engine keeps (engine.Reference.mm is the plain einsum): operands rounded to the matmul
dtype, products accumulated in fp32, the result returned in the caller's dtype; each operand's cotangent
comes back in that operand's own dtype, a weight's summed over the mesh in fp32.

What the fast one adds: the backward rounds the cotangent to the matmul dtype before its two products, so
they run bf16 x bf16 -> fp32 like the forward (JAX's own transpose multiplies the fp32 cotangent by the
rounded operand in fp32, which a GPU runs as TF32: two thirds of the step's GEMMs), and the activation's
gradient is summed over tp in the matmul dtype (`collectives.tp_sum`), as the forward's branch all-reduce.
On a CPU the bf16 operands are widened for XLA:CPU (`fp32_product`).
"""
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from collectives import extra_axes, sum_like, tp_sum

UNBATCHED_DOT = "unbatched_dot"     # the name --remat dots keeps products without batch dims by


def mm(spec, a, b, dtype, out_dtype=jnp.float32):
    """einsum(spec, a, b) of the operands rounded to `dtype`, accumulated in fp32, returned in out_dtype."""
    out = _einsum_rounded(spec, jnp.dtype(dtype), (a.dtype, b.dtype), jnp.dtype(out_dtype), a, b)
    a_spec, b_spec, out_spec = _einsum_specs(spec)
    # jax.checkpoint's policies do not see the dot inside a custom_vjp: the name lets --remat dots keep
    # the products without batch dims
    return out if set(a_spec) & set(b_spec) & set(out_spec) else checkpoint_name(out, UNBATCHED_DOT)


def fp32_product(product, *operands):
    """product(*operands), a matmul of operands in the matmul dtype that accumulates and returns fp32.
    XLA:CPU cannot run every bf16 x bf16 -> fp32 dot ("Unsupported element type for DotThunk"), so on CPU
    alone the lowering widens bf16 operands first: the products are exact in fp32, the numbers the same.
    The choice is made when the program is lowered for its devices (lax.platform_dependent), not when it
    is traced: every platform traces this one program, `--compile_for` a TPU's included.

    The choice sits in a checkpoint of its own that keeps nothing: differentiated under the layers' remat,
    JAX split the conditional into a forward and a replay part and handed the replay both branches'
    operands (the CPU's widened copies and the accelerator's bf16 ones) as residuals, which the layer
    scans then stacked: a copy of every weight, a step. The product's backward is its caller's custom
    VJP: nothing is recomputed."""
    if not any(o.dtype == jnp.bfloat16 for o in operands):
        return product(*operands)
    widen = lambda *ops: product(*(o.astype(jnp.float32) if o.dtype == jnp.bfloat16 else o for o in ops))
    choose = lambda *ops: lax.platform_dependent(*ops, cpu=widen, default=product)
    return jax.checkpoint(choose, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)(*operands)


def dot32(spec, a, b):
    """einsum(spec, a, b) of operands already in the matmul dtype, accumulated and returned in fp32."""
    return fp32_product(partial(jnp.einsum, spec, preferred_element_type=jnp.float32), a, b)


def _einsum_specs(spec):
    """"btd,df->btf" -> ("btd", "df", "btf")."""
    inputs, out_spec = spec.split("->")
    return (*inputs.split(","), out_spec)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _einsum_rounded(spec, dtype, operand_dtypes, out_dtype, a, b):
    """The operands are rounded to `dtype` in here, so that each cotangent comes back in its operand's own
    dtype: an fp32 activation's gradient is summed over tp and added up in fp32."""
    return dot32(spec, a.astype(dtype), b.astype(dtype)).astype(out_dtype)


def _einsum_rounded_fwd(spec, dtype, operand_dtypes, out_dtype, a, b):
    a, b = a.astype(dtype), b.astype(dtype)
    return dot32(spec, a, b).astype(out_dtype), (a, b)


def _einsum_rounded_bwd(spec, dtype, operand_dtypes, out_dtype, residuals, g):
    a, b = residuals
    a_spec, b_spec, out_spec = _einsum_specs(spec)
    g = g.astype(dtype)
    d_a = dot32(f"{out_spec},{b_spec}->{a_spec}", g, b)
    d_b = dot32(f"{a_spec},{out_spec}->{b_spec}", a, g)
    # a is the activation, b the weight: only the activation's sum is rounded (`tp_sum`)
    return (tp_sum(d_a, extra_axes(d_a, a), dtype).astype(operand_dtypes[0]),
            sum_like(d_b, b).astype(operand_dtypes[1]))


_einsum_rounded.defvjp(_einsum_rounded_fwd, _einsum_rounded_bwd)
