"""The mesh axes a layer runs under (`Axes`) and the collectives the core writes out with them. Outside
shard_map (the one-device model) every axis is None and every collective here is the identity."""
import dataclasses
import math
from typing import Protocol

import jax
from jax import lax


def data_axes(n_slices):
    """The mesh axes a batch's rows are split over, for a mesh of n_slices slices (inside shard_map:
    lax.axis_size("slice")): each (slice, dp) pair is one data-parallel replica. Across slices (over DCN)
    only the data is split: every slice holds the whole model, FSDP-sharded over its dp. On one slice dp
    alone, so that nothing varies over the slice axis and no gradient is summed over it."""
    return ("slice", "dp") if n_slices > 1 else ("dp",)


class Engine(Protocol):
    """What the core calls at its seams (engine/, whose engine.Reference is where go-to-definition lands and says
    what each does): the engine imports this module, so the core names the seams here."""
    def mm(self, spec, a, b, dtype, out_dtype=...): ...
    def attention(self, q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype): ...
    def routed_experts(self, w, x_BTD, experts_BTk, slot_BTk, C, cfg, axes): ...
    def cross_entropy_sum(self, table_vD, h_BTD, targets_BT, cfg, axes): ...
    def token_scores(self, table_vD, h_BTD, targets_BT, cfg, axes): ...
    def keep(self, x, name): ...
    def layer_loop(self, cfg, train): ...
    def gathered(self, param, axes, dtype): ...
    def gather_stage(self, layers, part, names, cfg, axes, lead=0): ...
    def read_weights(self, stack, cfg): ...
    def optimizer_kernel(self): ...


@dataclasses.dataclass(frozen=True)
class Axes:
    """Mesh axis names the layer code runs under; all None on one device. expert_parallel: the routed
    experts are split over dp (sharding.axis_rules) and tokens are sent to them. engine: what the core
    calls at its seams (engine/), chosen by --engine for the mesh's platform: a Reference (the guide's plain
    math, where go-to-definition lands) or its subclass Fast."""
    dp: str | None = None
    pp: str | None = None
    tp: str | None = None
    expert_parallel: bool = False
    engine: Engine | None = None


def psum(x, axis):
    return x if axis is None else lax.psum(x, axis)


def axis_index(axis):
    return 0 if axis is None else lax.axis_index(axis)


def over_gloo():
    """Whether collectives run through gloo: CPU devices of a multi-process jax.distributed job."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def psum_scatter(x, axis, dim):
    """x summed over mesh axis `axis`, each rank keeping its 1/n of dim `dim` (lax.psum_scatter, tiled).
    Over gloo a psum then this rank's slice, twice the bytes: the pinned jaxlib's gloo reduce-scatter sends
    from a buffer it then overwrites, so when the ranks arrive apart rank 0 silently gets wrong values at
    the end of a large slice (jax-ml/jax#40830; docs/performance-log.md#2026-12-05-gloo-drift)."""
    if not over_gloo():
        return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    n = x.shape[dim] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(lax.psum(x, axis), lax.axis_index(axis) * n, n, axis=dim)


def axis_names(axes):
    """A PartitionSpec entry or a collective's axes (None, a mesh axis's name or a tuple of names) as a tuple."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def tp_sum(x, tp, dtype):
    """x (a branch's partial output, or an activation's partial gradient) summed over the mesh axes `tp`
    (a name, a tuple of names or None), the all-reduce carried in the matmul dtype as Megatron does: half
    the bytes, and the tp all-reduces are most of a TPU step's collective bytes. SPEC allows it where the
    mesh's error stays within bf16's own (`bench.py --grad_error`); parameter gradients are never summed
    so. With nothing to sum over (tp None or of size 1) nothing is rounded: one device stays exact."""
    axes = axis_names(tp)
    if not axes:
        return x
    if math.prod(lax.axis_size(a) for a in axes) == 1:
        return lax.psum(x, axes)               # no data moves: only check_vma's type changes
    return lax.psum(x.astype(dtype), axes).astype(x.dtype)


def varying_axes(x):
    """The mesh axes x varies over (check_vma's type)."""
    return jax.typeof(x).manual_axis_type.varying


def vary_like(arrays, others):
    """`arrays` cast to vary over every mesh axis any of `others` varies over (inside shard_map; a no-op
    outside it)."""
    axes = frozenset().union(*map(varying_axes, others))

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x
    return tuple(map(cast, arrays))


def extra_axes(x, like):
    """The mesh axes x varies over and `like` does not."""
    return tuple(sorted(varying_axes(x) - varying_axes(like)))


def sum_like(x, like):
    """x summed over the mesh axes it varies over and `like` does not: the transpose of the implicit pcast
    that made `like` varying in the forward (a weight split over tp times activations replicated over tp:
    the activations' gradient is the psum over tp), as JAX's own transpose does."""
    extra = extra_axes(x, like)
    return lax.psum(x, extra) if extra else x
