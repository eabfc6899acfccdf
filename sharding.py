"""The sharded model: logical axes -> mesh axes, the params (drawn, laid out, counted), and the mesh.

- One table, `AXIS_RULES` (led by `EXPERT_PARALLEL_RULE` under --expert_parallel), maps a parameter's
  logical axes ("vocab", "embed", "heads", ...) to mesh axes: the PartitionSpecs (`param_specs`) and the
  dim FSDP gathers along (`dp_dim`) come from it, and nothing else names a mesh axis for a parameter.
- The params are a plain nested dict of arrays (what crosses jit, shard_map, optax and orbax), keyed by
  the modules' attribute names, each drawn by the initializer its module declared (`init_params`);
  `build` merges them back into the modules (inside shard_map, from the local shards).
- `Layout`: how the params store the stacked blocks for the pipeline, [blocks, ...] or [P, G, ...].
- The mesh itself is ParallelDims.build_mesh's (parallel_dims.py); `make_mesh` and `run_mesh` call it for a shape or a
  run's config.
"""
import dataclasses
import math
from functools import cache, partial

import jax
import numpy as np
from flax import nnx
from flax.linen import logical_to_mesh_axes
from jax.sharding import NamedSharding

from model import DENSE_LAYERS, LAYERS, PROLOGUE, Transformer
from parallel_dims import ParallelDims

# The one sharding table: logical axis -> mesh axis, in order of precedence. A mesh axis shards at most one
# dim of a parameter (flax's logical_to_mesh_axes), so dp splits D in w_dq [D, Lq] and the latent in w_uq
# [Lq, H K]. "dp" = FSDP shard, all-gathered for the step (engine/fsdp.py); "tp" = Megatron split; "pp" = pipeline
# stage. Logical axes not listed are replicated: "dense_layers" (a block's stacked dense layers), "norm",
# "rope", "score" (the router's column per expert), "shared" (the shared experts' index) and, unless expert
# parallelism is on, "expert" (the routed experts' index).
AXIS_RULES = (
    ("layers", "pp"),        # the stacked blocks: stage s holds blocks [s n, (s+1) n), n = blocks/pp
    ("vocab", "tp"),         # rows of the tied table
    ("heads", "tp"),         # the H K (and H R) columns of the attention projections
    ("mlp", "tp"),           # FFN hidden units, in the dense FFN and inside every expert
    ("embed", "dp"),         # the model width D
    ("q_latent", "dp"),      # the latent widths, in the matrices without D
    ("kv_latent", "dp"),
)
# With --expert_parallel the table starts with this rule: the routed experts' index goes to dp, so each dp
# shard holds E/dp whole experts, which stay there (FSDP gathers no "expert" dim); their "embed" dim then
# finds dp taken and is not split, their "mlp" dim is still split over tp.
EXPERT_PARALLEL_RULE = ("expert", "dp")
# The circular pipeline's leading axis of every stacked block leaf, [P, G, ...] (`Layout`); not in
# AXIS_RULES, so replicated: stage s holds [:, s G:(s+1) G].
REPEATS = "repeats"


def axis_rules(expert_parallel=False):
    """The sharding table: AXIS_RULES, led by EXPERT_PARALLEL_RULE when expert parallelism is on."""
    return ((EXPERT_PARALLEL_RULE,) if expert_parallel else ()) + AXIS_RULES


def mesh_spec(logical_axes, expert_parallel=False):
    """The PartitionSpec of a parameter with these logical axes."""
    return logical_to_mesh_axes(logical_axes, axis_rules(expert_parallel))


def dp_dim(logical_axes, expert_parallel):
    """The dim of a parameter with these logical axes that FSDP gathers over dp, or None: not split over
    dp, or its experts split over dp (expert parallelism), which stay where they are."""
    spec = mesh_spec(logical_axes, expert_parallel)
    if "dp" not in spec or logical_axes[spec.index("dp")] == "expert":
        return None
    return spec.index("dp")


# ----------------------------------------------------------------------------------------------
# The params: the modules' Param attributes by name, except that the tied table sits at the top as
# params["embed"] (not params["embed"]["table"]), as in every checkpoint.


def _params_path(path):
    return ("embed",) if path == ("embed", "table") else path


def _flat_variables(module, kind):
    """[(path in the params, Variable)] of the `kind` Variables of module, in the params' order."""
    return sorted((_params_path(path), v) for path, v in nnx.to_flat_state(nnx.state(module, kind)))


def _nested(flat):
    """The nested dict holding each (path, value) of flat."""
    tree = {}
    for path, value in flat:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def has_router_bias(params):
    return "router_bias" in params["blocks"]["moe"]["moe"]


@cache
def _graphdef(cfg, router_bias):
    """The Transformer's structure for cfg, without its values."""
    return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), router_bias)))


def build(params, cfg):
    """The Transformer holding params (global arrays, or inside shard_map this device's shards)."""
    return nnx.merge(_graphdef(cfg, has_router_bias(params)), params | {"embed": {"table": params["embed"]}})


@cache
def _params_of(cfg):
    """[(path in the params, abstract Param)] of the Transformer for cfg (nnx builds a module tree in about
    half a second, and init, shapes and counts each want one)."""
    return _flat_variables(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)


def init_params(cfg, key):
    """fp32 parameters with global shapes in model order, each drawn by its initializer (stacked ones whole)
    with its own key split from `key` in the params' order: the values depend only on (cfg, key), not on
    any mesh or layout."""
    params = _params_of(cfg)
    keys = jax.random.split(key, len(params))
    return _nested([(path, v.initializer(k, v.shape)) for (path, v), k in zip(params, keys)])


def param_shapes(cfg):
    """Global shape of every parameter, as a nested dict mirroring the params."""
    return jax.tree.map(lambda p: p.shape, jax.eval_shape(partial(init_params, cfg), jax.random.key(0)))


class _SizeOne:
    """A stand-in config whose every size is 1 and every option on, so that the modules hold every parameter
    there can be (a dense layer beside the MoE one, gates, latent norms, the untied table, ...): the logical
    axes of a parameter depend on where it sits in the modules, not on any size."""
    EVERY_PARAMETER = {"layers_per_block": 2, "ffn": "gated_silu", "tied_embeddings": False}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return self.EVERY_PARAMETER.get(name, 1)


@cache
def logical_axes(router_bias):
    """{path in the params: that parameter's logical axes}, read from the modules' Variables."""
    module = nnx.eval_shape(lambda: Transformer(_SizeOne(), nnx.Rngs(0), router_bias))
    return {path: variable.out_sharding for path, variable in _flat_variables(module, nnx.Variable)}


@cache
def _axes_by_leaf_name():
    """{leaf name: its logical axes less the stacking ones}: a name is one kind of parameter wherever it sits
    (every "scale" is ("norm",)), so masks apply to any dict of such leaves."""
    return {path[-1]: tuple(a for a in axes if a not in (LAYERS, DENSE_LAYERS, PROLOGUE))
            for path, axes in logical_axes(True).items()}


def is_matrix(name):
    """Whether leaf `name` is a weight matrix: two or more logical axes besides the stacking ones."""
    return len(_axes_by_leaf_name()[name]) >= 2


def decay_mask(params):
    """True for the leaves AdamW decays: the matrices, not norm scales and shifts."""
    return jax.tree_util.tree_map_with_path(lambda path, _: is_matrix(path[-1].key), params)


def table_mask(params):
    """True for the tied embedding / output table, the one leaf with its own Adam epsilon (optimizer.py)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _axes_by_leaf_name()[path[-1].key] == ("vocab", "embed"),
                                            params)


def param_specs(params, expert_parallel=False):
    """PartitionSpec of every parameter: its logical axes through the table (`axis_rules`), stacked block
    leaves as their `Layout` stores them. The global arrays are the same with or without expert parallelism:
    a checkpoint restores either way."""
    axes, layout = logical_axes(has_router_bias(params)), Layout.of(params)

    def spec(path, p):
        path = tuple(k.key for k in path)
        return mesh_spec(layout.axes(path, axes[path]), expert_parallel)
    return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(params, mesh, expert_parallel=False):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, expert_parallel))


def count_params(cfg):
    """total: every real parameter (padding rows excluded); active: those one token uses, without the
    embedding and an untied output table (the guide's convention); embedding: the token table."""
    shapes = param_shapes(cfg)
    size = lambda tree: sum(math.prod(s) for s in jax.tree.leaves(tree, is_leaf=lambda s: isinstance(s, tuple)))
    embedding = cfg.vocab_size * cfg.model_dimension
    body = sum(size(shapes[part]) for part in ("prologue", "blocks", "final_norm") if part in shapes)
    experts = shapes["blocks"]["moe"]["moe"]
    routed = size({k: experts[k] for k in ("expert_gate", "expert_up", "expert_down") if k in experts})
    active = body - routed + routed * cfg.k // cfg.n_experts
    unembed = 0 if cfg.tied_embeddings else embedding
    return {"total": body + embedding + unembed, "active": active, "embedding": embedding}


# flops_per_token in words, for the run's MFU line (main.py); tests/test_model.py evaluates the words against
# the code, so neither drifts from the other.
FLOPS_PER_TOKEN = ("6 x (active_params + V x D) + 3 x T x n_head x ((qk_head_dim + v_head_dim) x n_layers + dhR x "
                   "rope_layers)")


def flops_per_token(cfg):
    """Training FLOPs per token (FLOPS_PER_TOKEN): 6 x (active params + the output projection V x D), plus
    causal attention 3 x T x H x (K + J) per layer and 3 x T x H x R per RoPE layer (QK^T over K + R
    channels and AV over J, the value width; forward 2 FLOPs a multiply-add, backward twice the forward,
    half the positions masked). Bubbles and remat excluded."""
    matmul = 6 * (count_params(cfg)["active"] + cfg.vocab_size * cfg.model_dimension)
    n_rope = cfg.n_layers - (0 if cfg.rope_all_layers else cfg.blocks)       # the guide's MoE layers have none
    attn = 3 * cfg.T * cfg.n_head * ((cfg.head_dim + cfg.value_dim) * cfg.n_layers + cfg.dhR * n_rope)
    return float(matmul + attn)


def with_router_bias(params, router_bias):
    """params with DeepSeek-V3's aux-loss-free routing bias (router_bias [blocks, E], in model order) beside
    each MoE layer's router, where MoE reads it, laid out like the routers. It is routing state, not a
    parameter: the driver keeps it out of the optimizer and differentiates the params alone."""
    moe_layers = params["blocks"]["moe"]
    router_bias = Layout.of(params).store_leaf(router_bias)
    moe_layers = moe_layers | {"moe": moe_layers["moe"] | {"router_bias": router_bias}}
    return params | {"blocks": params["blocks"] | {"moe": moe_layers}}


# ----------------------------------------------------------------------------------------------
# The pipeline's layout of the stacked blocks


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the params store the stacked blocks: [blocks, ...] in model order (repeats 1: GPipe), or for the
    circular pipeline (repeats P > 1) [P, G, ...], G = blocks/P, a pure reshape: block (r, j) is block
    r G + j. With the second axis split over pp, stage s holds j in [s G/pp, (s+1) G/pp) of every r: the P
    non-adjacent groups r pp + s of G/pp consecutive blocks. A checkpoint restores in either layout."""
    repeats: int = 1

    @property
    def stacked_dims(self):
        return 1 if self.repeats == 1 else 2

    @staticmethod
    def of(params):
        """The layout params are in, read off the router's rank ([blocks, D, E] or [P, G, D, E])."""
        router = params["blocks"]["moe"]["moe"]["router"]
        return Layout(1 if len(router.shape) == 3 else router.shape[0])

    def axes(self, path, names):
        """The logical axes of the leaf at `path` stored in this layout."""
        return (REPEATS, *names) if path[0] == "blocks" and self.repeats > 1 else names

    def stored_shape(self, shape):
        """The shape a stacked leaf of shape [blocks, ...] in model order is stored in."""
        return tuple(shape) if self.repeats == 1 else (self.repeats, shape[0] // self.repeats, *shape[1:])

    def store_leaf(self, a):
        """A stacked leaf [blocks, ...] in model order, as this layout stores it."""
        return a if self.repeats == 1 else a.reshape(self.stored_shape(a.shape))

    def store(self, params):
        """params (in any layout) in this one."""
        params = model_order(params)
        return params | {"blocks": jax.tree.map(self.store_leaf, params["blocks"])}


def model_order(params):
    """params with every stacked block leaf as [blocks, ...], in model order."""
    if Layout.of(params).repeats == 1:
        return params
    return params | {"blocks": jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), params["blocks"])}


def init_stored_params(cfg, key):
    """init_params in the layout the sharded path stores (cfg.pipeline_repeats): the same numbers in any."""
    return Layout(cfg.pipeline_repeats).store(init_params(cfg, key))


def init_sharded_params(cfg, key, mesh):
    """init_stored_params computed directly into the mesh layout (no host ever holds the full model)."""
    abstract = jax.eval_shape(partial(init_stored_params, cfg), key)
    return jax.jit(partial(init_stored_params, cfg),
                   out_shardings=param_shardings(abstract, mesh, cfg.expert_parallel))(key)


# ----------------------------------------------------------------------------------------------
# The mesh


def make_mesh(shape, devices=None, n_slices=1):
    """ParallelDims.build_mesh for shape = (dp, pp, tp): the mesh of --n_device_axis `shape` over n_slices slices."""
    return ParallelDims(*shape, n_slices=n_slices).build_mesh(devices)


def run_mesh(rc, devices=None):
    """The mesh a run's config (cfg.run) asks for: its dims (--n_device_axis over --n_slices slices)."""
    return rc.dims.build_mesh(devices)


def axes_across_hosts(mesh):
    """Mesh axis names along which neighbouring devices belong to different processes (hosts)."""
    hosts = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return [name for i, name in enumerate(mesh.axis_names) if np.any(np.diff(hosts, axis=i) != 0)]
