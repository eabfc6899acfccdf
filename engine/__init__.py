"""The engine: what the guide's math (model.py, loss.py, pipeline.py) calls at its seams, two ways. This
package is the one door: the core holds an engine (`engine_for`) and calls its methods; it imports none of
the files behind them (tests/test_layout.py).

Each seam, and what each engine runs there (--engine; the fast one is the default, the reference one is
what a reader steps through in a debugger and the oracle the tests hold the fast one to):

  seam                       reference: the guide's plain math          fast (this package's files)
  mm(spec, a, b, dtype)      jnp.einsum, operands rounded to dtype,     products.mm: a custom VJP whose backward
                             products in fp32                           products are bf16 x bf16 -> fp32 too; on
                                                                        a TPU behind optimization barriers
  attention(q, k, v,         model.masked_attention of q, k joined     attention_kernels.attention: cuDNN's
    rotary, mask)            with RoPE's parts, a causal mask           fused kernel on a GPU, tpu_attention's
                                                                        Pallas kernel (the parts apart) on a
                                                                        TPU, else causal chunks
  routed_experts(...)        expert_kernels.experts_in_buffers (over    the same, or --moe_impl ragged
                             dp with --expert_parallel)                 (grouped matmuls)
  cross_entropy_sum(...)     loss.plain_cross_entropy_sum               chunked_loss.chunked_cross_entropy_sum (on
                                                                        a TPU the sums of exponentials by the MXU)
  token_scores(...)          loss.plain_token_scores                    chunked_loss.chunked_token_scores
  keep(x, name),             nothing named; --remat's plain jax         named values kept (all-reduced branches,
  layer_loop(cfg, train)     policies, the layers scanned               kernel and expert outputs); per platform;
                                                                        with no remat on a TPU, layers traced apart
  gathered, gather_stage,    fsdp.py, the fp32 shards gathered          fsdp.py, gathered in the matmul dtype
  read_weights
  optimizer_kernel()         None: the optimizer's update as optax      on a TPU tpu_update's Pallas kernel: a
                             writes it and XLA fuses it                 leaf's update in one pass, in place
Both engines give the same numbers in fp32 (tests/test_engine.py); in bf16 the fast one is no further from
fp32 than the reference (bench.py --grad_error --engine).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import loss
from engine import attention_kernels, chunked_loss, expert_kernels, fsdp, products, tpu_update
from model import BRANCH_SUM, EXPERT_OUTPUTS, FFN_HIDDEN, decoupled_rope_qk, masked_attention
from stacking import LayerLoop

# What a fast engine's layer remat keeps besides what its policy keeps: each branch's tp all-reduce, a fused
# kernel's outputs and the routed experts' outputs.
_ALWAYS_KEPT = (BRANCH_SUM, attention_kernels.KERNEL_OUTPUTS, EXPERT_OUTPUTS)
REMAT_POLICIES = {"full": jax.checkpoint_policies.save_only_these_names(*_ALWAYS_KEPT),
                  "dots": jax.checkpoint_policies.save_from_both_policies(
                      jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                      jax.checkpoint_policies.save_only_these_names(products.UNBATCHED_DOT, *_ALWAYS_KEPT))}
# Where a step's cross-entropy chunk holds at least this many tokens: below ~128 XLA:CPU's vocab-sized
# products lose speed, above it memory grows for none; a GPU runs the same kernels a chunk whatever its
# size, so fewer, larger chunks launch fewer. A TPU keeps the CPU's: its plan is set by HBM.
CPU_CHUNK_TOKENS, GPU_CHUNK_TOKENS = 128, 8192
# The most layers a TPU's training step traces apart (Fast.layer_loop): its compile grows with each layer traced,
# where a scan's does not, so a deeper model's stay scanned (docs/performance-log.md#2026-12-07-tpu-layers-apart).
MAX_LAYERS_APART = 32
# The named scope each seam's operations run under (their op_name in the compiled program): bench.py --profile
# sums a step's kernel time by them.
SEAM_SCOPES = {"mm": "products", "attention": "attention", "routed_experts": "experts",
               "cross_entropy_sum": "cross_entropy", "token_scores": "cross_entropy"}


def _scoped_seams(cls):
    """cls with each seam it defines run under its SEAM_SCOPES name (an engine's subclasses too:
    Reference.__init_subclass__)."""
    for seam, scope in SEAM_SCOPES.items():
        if seam not in vars(cls):
            continue
        method = vars(cls)[seam]
        plain = method.__func__ if isinstance(method, staticmethod) else method

        @functools.wraps(plain)
        def scoped(*args, _plain=plain, _scope=scope, **kwargs):
            with jax.named_scope(_scope):
                return _plain(*args, **kwargs)
        setattr(cls, seam, staticmethod(scoped) if isinstance(method, staticmethod) else scoped)
    return cls


@_scoped_seams
@dataclasses.dataclass(frozen=True)
class Reference:
    """--engine reference: every seam the guide's plain math, no custom VJP (but over gloo, fsdp.plain_gather's)
    and no named remat."""
    platform: str | None = None      # the mesh's ("cpu", "gpu", "tpu"; None: portable code)
    device_kind: str = ""            # the mesh's ("TPU v5 lite", ...): what its kernels may hold in VMEM

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _scoped_seams(cls)

    def mm(self, spec, a, b, dtype, out_dtype=jnp.float32):
        """einsum of the operands rounded to dtype, multiplied and accumulated in fp32 (HIGHEST: exact
        products of the rounded operands on every backend), returned in out_dtype."""
        widened = (x.astype(dtype).astype(jnp.float32) for x in (a, b))
        return jnp.einsum(spec, *widened, precision=lax.Precision.HIGHEST).astype(out_dtype)

    def attention(self, q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype):
        """rotary: decoupled RoPE's parts (model.decoupled_rope_qk) or None; mask_TS None: causal."""
        q_BThQ, k_BShQ = decoupled_rope_qk(q_BThK, k_BShK, rotary, dtype)
        if mask_TS is None:
            mask_TS = jnp.arange(k_BShQ.shape[1])[None, :] <= jnp.arange(q_BThQ.shape[1])[:, None]
        return masked_attention(q_BThQ, k_BShQ, v_BShJ, mask_TS, dtype, self.mm)

    def routed_experts(self, w, x_BTD, experts_BTk, slot_BTk, C, cfg, axes):
        dp = axes.dp if axes.expert_parallel else None
        return expert_kernels.buffers(w, x_BTD, experts_BTk, slot_BTk, C, self.mm, dp)

    def cross_entropy_sum(self, table_vD, h_BTD, targets_BT, cfg, axes):
        return loss.plain_cross_entropy_sum(table_vD, h_BTD, targets_BT, cfg, axes)

    def token_scores(self, table_vD, h_BTD, targets_BT, cfg, axes):
        return loss.plain_token_scores(table_vD, h_BTD, targets_BT, cfg, axes)

    def keep(self, x, name):
        return x

    def layer_loop(self, cfg, train):
        """How the core runs its stacks of layers (stacking.LayerLoop): each layer's remat policy, the scans."""
        plain = {"none": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
        return LayerLoop(plain.get(cfg.remat, jax.checkpoint_policies.nothing_saveable))

    def gathered(self, param, axes, dtype):
        return fsdp.gathered(param, axes, dtype, fsdp.plain_gather)

    def gather_stage(self, layers, part, names, cfg, axes, lead=0):
        return fsdp.gather_stage(layers, part, names, cfg, axes, lead, fsdp.plain_gather)

    def read_weights(self, stack, cfg):
        return fsdp.read_dtypes(stack, cfg)

    def optimizer_kernel(self):
        """What computes the optimizer's update element by element, a leaf at a time (tpu_update.update_in_place's
        signature: optimizer.in_one_pass), or None: the update as optax's chain writes it, which XLA fuses."""
        return None


@dataclasses.dataclass(frozen=True)
class Fast(Reference):
    """--engine fast: the same seams as the kernels and numerics that make a step fast."""

    def mm(self, spec, a, b, dtype, out_dtype=jnp.float32):
        """products.mm; on a TPU its output (and in the backward its cotangent) behind an optimization barrier, so
        that XLA does not fuse the next norm's reduction, dropout's random bits or the residual into the product:
        so fused the dense FFNs' ran at 47-61% of peak; behind barriers one v5e ran the step 1.029x faster
        (docs/performance-log.md#2026-12-07-tpu-barriers-dropout)."""
        out = products.mm(spec, a, b, dtype, out_dtype)
        return lax.optimization_barrier(out) if self.platform == "tpu" else out

    def attention(self, q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype):
        return attention_kernels.attention(q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype, self.platform,
                                           self.device_kind)

    def routed_experts(self, w, x_BTD, experts_BTk, slot_BTk, C, cfg, axes):
        """--moe_impl ragged's grouped matmuls are tokamax's kernel on a GPU (expert_kernels.triton_grouped)."""
        dp = axes.dp if axes.expert_parallel else None
        return expert_kernels.MOE_IMPLS[cfg.moe_impl](w, x_BTD, experts_BTk, slot_BTk, C, self.mm, dp, self.platform)

    def cross_entropy_sum(self, table_vD, h_BTD, targets_BT, cfg, axes):
        """On a TPU each token's sum of exponentials comes out of the MXU with the gradient's product."""
        return chunked_loss.chunked_cross_entropy_sum(table_vD, h_BTD, targets_BT, cfg, axes, self._chunk_tokens(),
                                                      sums_by_product=self.platform == "tpu")

    def token_scores(self, table_vD, h_BTD, targets_BT, cfg, axes):
        return chunked_loss.chunked_token_scores(table_vD, h_BTD, targets_BT, cfg, axes, self._chunk_tokens())

    def _chunk_tokens(self):
        return GPU_CHUNK_TOKENS if self.platform == "gpu" else CPU_CHUNK_TOKENS

    def keep(self, x, name):
        return checkpoint_name(x, name)

    def layer_loop(self, cfg, train):
        """--remat auto: dots on a TPU, whose step is bound by matmul FLOPs (none where it fits and the layers trace
        apart: planning.fit.settle_auto_remat settles that before a run builds its step); on a GPU, whose step is bound
        by memory traffic, full and each dense FFN's up-projection, whose replay costs more than keeping
        it; full on a CPU. On a GPU the dense layers' scan is unrolled: as a loop inside the blocks' scan
        it stacked each layer's residuals twice and launched thousands of slicing kernels a step (a TPU
        keeps the loop, which compiles faster): docs/performance-log.md#2026-12-01-h200-estimate-issue-27.
        A TPU's training step with --remat none traces its layers apart (Python loops; up to MAX_LAYERS_APART):
        the scans would stack every residual the backward reads and copy each block's stacks again; apart, each
        stays where its layer wrote it (docs/performance-log.md#2026-12-07-tpu-layers-apart)."""
        unroll = self.platform == "gpu"
        if cfg.remat == "auto" and self.platform == "gpu":
            return LayerLoop(jax.checkpoint_policies.save_only_these_names(*_ALWAYS_KEPT, FFN_HIDDEN), unroll)
        remat = ("dots" if self.platform == "tpu" else "full") if cfg.remat == "auto" else cfg.remat
        apart = train and remat == "none" and self.platform == "tpu" and cfg.n_layers <= MAX_LAYERS_APART
        return LayerLoop(None if remat == "none" else REMAT_POLICIES[remat], unroll, apart)

    def gathered(self, param, axes, dtype):
        return fsdp.gathered(param, axes, dtype)

    def gather_stage(self, layers, part, names, cfg, axes, lead=0):
        return fsdp.gather_stage(layers, part, names, cfg, axes, lead)

    def optimizer_kernel(self):
        """On a TPU one Pallas pass a leaf, its outputs written over params and moments: XLA made two or three of
        the chain's (docs/performance-log.md#2026-12-07-tpu-adamw-one-pass)."""
        return tpu_update.update_in_place if self.platform == "tpu" else None


ENGINES = {"fast": Fast, "reference": Reference}


def matmul_precision(model_dtype):
    """The context a step's products are traced in: --model_dtype float32 asks for fp32 products, which XLA:TPU
    computes in one bf16 pass at its default precision (the tiny preset's step-1 grad norm 2.6e-5 from the
    CPU's), so HIGHEST (1.4e-7); bf16 operands are exact in one pass, and their programs stay as they were."""
    return jax.default_matmul_precision("highest" if jnp.dtype(model_dtype) == jnp.float32 else None)


def engine_for(cfg, device=None):
    """The engine --engine names, for devices like `device` (the mesh's; None: portable code)."""
    return ENGINES[cfg.engine]() if device is None else ENGINES[cfg.engine](device.platform, device.device_kind)
