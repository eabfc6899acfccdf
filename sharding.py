"""The sharding rules, the mesh, the collectives and the matmul numerics: everything the modules need
to run on one device or inside one `jax.shard_map` over ("dp", "pp", "tp").

- One table, `AXIS_RULES` (led by `EXPERT_PARALLEL_RULE` under --expert_parallel), maps a parameter's
  logical axes ("vocab", "embed", "heads", ...) to mesh axes: the PartitionSpecs (model.param_specs)
  and the dim each FSDP gather runs along (`fetch`) come from it, and nothing else names a mesh axis
  for a parameter.
- `Axes`: the mesh axis names the layer code runs under (none on the single-device reference, where
  every collective here is a no-op) and the platform the program is for.
- The collectives the modules write out: `psum`, `fetch` / `gather_over_dp` (the FSDP all-gather in
  the matmul dtype, its gradient reduce-scattered in fp32), `vary_like` (check_vma's types).
- The matmuls: `matmul` / `einsum_fp32` multiply operands rounded to the matmul dtype and accumulate in
  fp32, in the backward too (custom VJPs, `sum_like` for the reductions JAX's own transpose would add);
  `fp32_product` widens bf16 operands for XLA:CPU when the step is lowered for a CPU.
- `make_mesh`: the mesh over real devices or an ahead-of-time TPU topology, host by host.
"""
import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import logical_to_mesh_axes
from jax import lax
from jax.ad_checkpoint import checkpoint_name

MESH_AXES = ("dp", "pp", "tp")

# The one sharding table: logical axis -> mesh axis, in order of precedence. A mesh axis shards at
# most one dim of a parameter (flax's logical_to_mesh_axes), so dp splits D in w_dq [D, Lq] and the
# latent in w_uq [Lq, H*K]. "dp" = FSDP shard, all-gathered just in time; "tp" = Megatron split;
# "pp" = pipeline stage. Logical axes not listed are replicated: "dense_layers" (a block's stacked
# dense layers), "norm", "rope", "score" (the router's column per expert), "shared" (the shared
# experts' index) and, unless expert parallelism is on, "expert" (the routed experts' index).
AXIS_RULES = (
    ("layers", "pp"),        # the stacked blocks: stage s holds blocks [s B/pp, (s+1) B/pp)
    ("vocab", "tp"),         # rows of the tied table
    ("heads", "tp"),         # the H*K (and H*R) columns of the attention projections
    ("mlp", "tp"),           # FFN hidden units, in the dense FFN and inside every expert
    ("embed", "dp"),         # the model width D
    ("q_latent", "dp"),      # the latent widths, in the matrices without D
    ("kv_latent", "dp"),
)
# With --expert_parallel the table starts with this rule: the routed experts' index goes to dp, so
# each dp shard holds E/dp whole experts, which stay there (`fetch` gathers no "expert" dim); their
# "embed" dim then finds dp taken and is not split, their "mlp" dim is still split over tp.
EXPERT_PARALLEL_RULE = ("expert", "dp")


def axis_rules(expert_parallel=False):
    """The sharding table: AXIS_RULES, led by EXPERT_PARALLEL_RULE when expert parallelism is on."""
    return ((EXPERT_PARALLEL_RULE,) if expert_parallel else ()) + AXIS_RULES


LAYERS, DENSE_LAYERS = "layers", "dense_layers"     # the logical names of the two stacking axes
# The circular pipeline's leading axis of every stacked block leaf, [R, blocks/R, ...] (`pipeline_layout`);
# not in AXIS_RULES, so replicated: stage s holds [:, s L:(s+1) L], L = blocks/(pp R).
REPEATS = "repeats"

@dataclasses.dataclass(frozen=True)
class Axes:
    """Mesh axis names the layer code runs under; all None on the single-device reference path.
    expert_parallel: the routed experts are split over dp (`axis_rules`), tokens sent to them."""
    dp: str | None = None
    pp: str | None = None
    tp: str | None = None
    expert_parallel: bool = False
    # The platform of the devices the program is for ("cpu", "gpu", "tpu"; the mesh's, which may be an
    # ahead-of-time topology's): it picks fused kernels (`attend`). None: the portable code.
    platform: str | None = None
    # True inside the pipeline's ticks: the stage's blocks were all-gathered over dp once for the step
    # (`pipeline._gathered_over_dp`), so `fetch` only casts them.
    dp_gathered: bool = False


def sharded_axes(cfg, platform):
    """The axes of the sharded path under cfg, for devices of `platform`."""
    return Axes(*MESH_AXES, expert_parallel=cfg.expert_parallel, platform=platform)


def psum(x, axis):
    return x if axis is None else lax.psum(x, axis)


BRANCH_SUM = "branch_sum"            # the checkpoint name of a branch's output summed over tp (`branch_sum`)


def branch_sum(x, tp, dtype):
    """A residual branch's output: the psum over tp of this rank's partial sum (Megatron's one
    all-reduce per branch), carried in the matmul dtype (`tp_sum`). Under tp it is named so that the
    remat policies keep it for the backward rather than replay the all-reduce there (moe1B on v4-64:
    all-reduce bytes 15.90 -> 13.09 GiB per chip for 4.3 GiB of HBM); with no tp to sum over,
    recomputing it is cheaper than keeping it (one H200: Σ 359 vs 366 ms, 23.5 vs 30.0 GiB)."""
    out = tp_sum(x, (tp,) if tp else (), dtype)
    return out if tp is None or lax.axis_size(tp) == 1 else checkpoint_name(out, BRANCH_SUM)


def tp_sum(x, axes, dtype):
    """The fp32 activation x (a branch's partial output, or an activation's partial gradient) summed
    over the mesh `axes` (tp), the all-reduce carried in the matmul dtype as Megatron does: half the
    bytes, and the tp all-reduces are most of a TPU step's collective bytes (moe1B on v4-64: 11.82 of
    13.61 GiB per chip). The measured reason to round, which issue 24's rule asks for: `bench.py
    --grad_error` on tp = 2 (docs/performance.md): the mesh's gradient error stays within the bar
    bf16 sets on one device. Parameter gradients are never summed this way (`sum_like`). With nothing
    to sum over (one device, tp = 1) nothing is rounded: the numbers of one device stay exact."""
    if not axes:
        return x
    if math.prod(lax.axis_size(a) for a in axes) == 1:
        return lax.psum(x, axes)               # no data moves: only check_vma's type changes
    return lax.psum(x.astype(dtype), axes).astype(x.dtype)


def axis_index(axis):
    return 0 if axis is None else lax.axis_index(axis)


def vary_like(arrays, others):
    """`arrays` cast to vary over every mesh axis any of `others` varies over (inside shard_map;
    a no-op outside it)."""
    axes = frozenset().union(*map(varying_axes, others))

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x
    return tuple(map(cast, arrays))


def varying_axes(x):
    """The mesh axes x varies over (check_vma's type)."""
    return jax.typeof(x).manual_axis_type.varying


def mesh_spec(logical_axes, expert_parallel=False):
    """The PartitionSpec of a parameter with these logical axes."""
    return logical_to_mesh_axes(logical_axes, axis_rules(expert_parallel))


def fetch(param, axes, dtype):
    """A parameter's value in dtype and, under FSDP, all-gathered over dp just in time along the dim
    that its logical axes map to dp (`gather_over_dp`). A dim of experts split over dp (expert
    parallelism) is not gathered: the shard keeps its own experts, and tokens come to them."""
    dim = None if axes.dp is None or axes.dp_gathered else dp_dim(param.out_sharding, axes.expert_parallel)
    if dim is None:
        return param[...].astype(dtype)
    return gather_over_dp(param[...], dtype, axes.dp, dim)


def dp_dim(logical_axes, expert_parallel):
    """The dim of a parameter with these logical axes that FSDP gathers over dp, or None: not split
    over dp, or its experts split over dp (expert parallelism), which stay where they are."""
    spec = mesh_spec(logical_axes, expert_parallel)
    if "dp" not in spec or logical_axes[spec.index("dp")] == "expert":
        return None
    return spec.index("dp")


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_over_dp(w, dtype, dp, axis):
    """A weight shard cast to dtype, then all-gathered: [.., D/dp, ..] fp32 -> [.., D, ..] dtype
    (casting first halves the bytes a bf16 gather moves). Its gradient is reduce-scattered back in
    fp32, as Megatron does: the plain transpose would sum the dp bf16 cotangents in bf16."""
    return lax.all_gather(w.astype(dtype), dp, axis=axis, tiled=True)


def _gather_over_dp_fwd(w, dtype, dp, axis):
    return gather_over_dp(w, dtype, dp, axis), None


def _gather_over_dp_bwd(dtype, dp, axis, _, g):
    # [.., D, ..] dtype -> fp32 -> summed over dp, each rank keeping its own slice: [.., D/dp, ..] fp32
    return (lax.psum_scatter(g.astype(jnp.float32), dp, scatter_dimension=axis, tiled=True),)


gather_over_dp.defvjp(_gather_over_dp_fwd, _gather_over_dp_bwd)


def fp32_product(product, *operands):
    """product(*operands), a matmul of operands in the matmul dtype that accumulates and returns fp32.
    XLA:CPU cannot run every bf16 x bf16 -> fp32 dot ("Unsupported element type for DotThunk"), so on
    CPU alone the lowering widens bf16 operands first: the products are exact in fp32, the numbers the
    same. The choice is made when the program is lowered for its devices (lax.platform_dependent), not
    when it is traced: every platform traces this one program, `--compile_for` a TPU's included.

    The choice sits in a checkpoint of its own that keeps nothing: differentiated under the layers'
    remat, JAX split the conditional into a forward and a replay part and handed the replay both
    branches' operands (the CPU's widened copies and the accelerator's bf16 ones) as residuals, which
    the layer scans then stacked: a copy of every weight, a step (one H200, moe1B: Σ -1.0 ms, 104
    kernels fewer). The product's backward is its caller's custom VJP: nothing is recomputed."""
    if not any(o.dtype == jnp.bfloat16 for o in operands):
        return product(*operands)
    widen = lambda *ops: product(*(o.astype(jnp.float32) if o.dtype == jnp.bfloat16 else o for o in ops))
    choose = lambda *ops: lax.platform_dependent(*ops, cpu=widen, default=product)
    return jax.checkpoint(choose, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)(*operands)


def dot32(spec, a, b):
    """einsum(spec, a, b) of operands already in the matmul dtype, accumulated and returned in fp32."""
    return fp32_product(partial(jnp.einsum, spec, preferred_element_type=jnp.float32), a, b)


UNBATCHED_DOT = "unbatched_dot"     # the checkpoint name of einsum_fp32's products without batch dims


def matmul(x, w, spec, out_dtype=jnp.float32):
    """einsum of operands rounded to the weights' dtype, accumulated in fp32 and returned in out_dtype:
    the weights' dtype for a product whose one use rounds it to that dtype anyway (attention's q, k, v,
    the latents): the same numbers in half the bytes, and no separate cast kernel on a GPU; and for a
    residual branch, whose tp all-reduce carries that dtype (`tp_sum`) before the fp32 residual stream
    adds it. fp32, the default, where the caller needs the product unrounded."""
    return einsum_fp32(spec, w.dtype, x, w, out_dtype)


def gelu(h):
    """GELU, computed in fp32, of an up-projection that `matmul` returned in the matmul dtype (as
    Megatron keeps it), and returned in that dtype: the widest activation, [B, T, 4D], is written and
    read in half the bytes. Its one use, the down-projection, rounds it so anyway (the same forward
    numbers); its cotangent then comes back in that dtype too, rounded once more before the GELU's
    derivative (one H200, moe1B: Σ 303.1 -> 299.8 ms; docs/performance.md)."""
    return jax.nn.gelu(h.astype(jnp.float32)).astype(h.dtype)


def einsum_fp32(spec, dtype, a, b, out_dtype=jnp.float32):
    """einsum(spec, a, b) of the operands rounded to `dtype`, accumulated in fp32 and returned in
    out_dtype; in the backward the cotangent is rounded to `dtype` too (`_einsum_rounded`)."""
    out = _einsum_rounded(spec, jnp.dtype(dtype), (a.dtype, b.dtype), jnp.dtype(out_dtype), a, b)
    a_spec, b_spec, out_spec = _einsum_specs(spec)
    # jax.checkpoint's policies do not see the dot inside a custom_vjp: the name lets --remat dots
    # keep saving the products without batch dims (`REMAT_POLICIES`).
    return out if set(a_spec) & set(b_spec) & set(out_spec) else checkpoint_name(out, UNBATCHED_DOT)


def _einsum_specs(spec):
    """"btd,df->btf" -> ("btd", "df", "btf")."""
    inputs, out_spec = spec.split("->")
    return (*inputs.split(","), out_spec)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _einsum_rounded(spec, dtype, operand_dtypes, out_dtype, a, b):
    """The operands are rounded to `dtype` here, inside: each cotangent then comes back in its operand's
    own dtype (operand_dtypes), so an fp32 activation's gradient is psummed over tp and added up in
    fp32. JAX's own transpose would multiply the fp32 cotangent by the rounded operand in fp32: on GPU
    the backward's GEMMs, two thirds of the step's, ran on fp32 operands as TF32 (H200 profile,
    docs/performance.md). Rounding the cotangent first keeps them bf16 x bf16 -> fp32 like the forward."""
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
    # a is the activation (`matmul(x, w)`), b the weight: only the activation's sum is rounded (`tp_sum`)
    return (tp_sum(d_a, extra_axes(d_a, a), dtype).astype(operand_dtypes[0]),
            sum_like(d_b, b).astype(operand_dtypes[1]))


def extra_axes(x, like):
    """The mesh axes x varies over and `like` does not."""
    return tuple(sorted(varying_axes(x) - varying_axes(like)))


def sum_like(x, like):
    """x summed over the mesh axes it varies over and `like` does not: the transpose of the implicit
    pcast that made `like` varying in the forward (a weight split over tp times activations
    replicated over tp: the activations' gradient is the psum over tp), as JAX's own transpose does.
    x is the fp32 product: the sum runs in fp32 whatever dtype the cotangent is then returned in."""
    extra = extra_axes(x, like)
    return lax.psum(x, extra) if extra else x


_einsum_rounded.defvjp(_einsum_rounded_fwd, _einsum_rounded_bwd)



# ----------------------------------------------------------------------------------------------
# The mesh


def physical_order(device):
    """Sort key: host first, then the chip's position (z, y, x) and core on a TPU; id elsewhere."""
    coords = getattr(device, "coords", None)
    place = (*reversed(coords), getattr(device, "core_on_chip", 0)) if coords is not None else (device.id,)
    return (device.process_index, *place)


def make_mesh(shape, devices=None):
    """The ("dp", "pp", "tp") mesh over dp*pp*tp devices, real or an ahead-of-time TPU topology's.

    Devices are taken host by host, each host's in physical order, and laid out with tp fastest:
    so a pp x tp plane whose size divides a host's device count sits on one host (on a v4 host's
    2 x 2 chips, tp pairs along x and pp pairs along y are direct neighbours) and only dp crosses
    hosts, as in the guide's figure. jax.make_mesh instead insists on not splitting physical axes,
    which (8, 2, 2) on v4-64's 2 x 4 x 4 chips cannot satisfy. Auto axes: outside shard_map XLA
    propagates shardings (optimizer, generation); inside it every collective is written out."""
    ordered = sorted(jax.devices() if devices is None else devices, key=physical_order)[:math.prod(shape)]
    if len(ordered) < math.prod(shape):
        raise ValueError(f"mesh {tuple(shape)} needs {math.prod(shape)} devices, {len(ordered)} available")
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    return jax.sharding.Mesh(grid.reshape(tuple(shape)), MESH_AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)


def axes_across_hosts(mesh):
    """Mesh axis names along which neighbouring devices belong to different processes (hosts)."""
    hosts = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return [name for i, name in enumerate(mesh.axis_names) if np.any(np.diff(hosts, axis=i) != 0)]
