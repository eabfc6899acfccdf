"""Engine: the attention seam's fast implementation (engine.Fast.attention). The core's attention is
`model.masked_attention`, softmax(q.k / sqrt(Q)) v under a mask, which is what --engine reference runs.

Fast: on a GPU in bf16 with a head width cuDNN takes, cuDNN's fused kernel (`cudnn_attention`); on a TPU
in bf16, a causal one as long as the chip's VMEM holds (tpu_attention.longest_T), our Pallas kernel
(`tpu_attention`); elsewhere masked_attention itself, a causal one a chunk of queries at a time so that the
blocks above the diagonal are never computed.
"""
import math
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import hardware
from collectives import vary_like
from engine import products, tpu_attention
from model import decoupled_rope_qk, masked_attention
from multihost import log

CUDNN_MAX_HEAD_DIM = 256
# A causal attention without cuDNN runs in up to 8 chunks of >= 128 queries: smaller chunks save few FLOPs
# and each is more to compile (docs/performance-log.md#2026-12-01-h200-estimate-issue-27).
CAUSAL_QUERY_CHUNKS, CAUSAL_MIN_CHUNK = 8, 128
KERNEL_OUTPUTS = "kernel_outputs"     # the name the remat policies keep a fused kernel's outputs by


def attention(q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype, platform, device_kind="",
              query_chunks=CAUSAL_QUERY_CHUNKS):
    """softmax(q.k / sqrt(Q)) v with an fp32 softmax, returned in dtype, q and k joined with decoupled RoPE's
    parts (rotary: model.decoupled_rope_qk's); causal (mask_TS None: query t sees keys <= t) or under mask_TS.
    device_kind: the chip's (its VMEM bounds the TPU kernel's sequences); query_chunks: xla_attention's, where no
    kernel runs."""
    _, T, h, K = q_BThK.shape
    R = 0 if rotary is None else rotary[0].shape[-1]
    if (platform == "tpu" and dtype == jnp.bfloat16 and mask_TS is None
            and tpu_attention.takes(T, h, K, v_BShJ.shape[-1], R, hardware.vmem_bytes(device_kind))):
        return tpu_kernel_attention(q_BThK, k_BShK, v_BShJ, rotary, dtype)
    q_BThQ, k_BShQ = decoupled_rope_qk(q_BThK, k_BShK, rotary, dtype)
    Q = q_BThQ.shape[-1]
    if platform == "gpu" and dtype == jnp.bfloat16 and Q <= CUDNN_MAX_HEAD_DIM and Q % 8 == 0:
        return cudnn_attention(*(a.astype(dtype) for a in (q_BThQ, k_BShQ, v_BShJ)), mask_TS)
    return xla_attention(q_BThQ, k_BShQ, v_BShJ, mask_TS, dtype, query_chunks)


def tpu_kernel_attention(q_BThK, k_BShK, v_BShJ, rotary, dtype, **kernel):
    """tpu_attention's kernel, which reads decoupled RoPE's parts as they are (nothing joined or repeated);
    kernel: its block, rows, interpret and lanes (the tests'). Its outputs are not kept (unlike cuDNN's): the layer
    scans' stacking of them cost more than the kernel's forward run again, and a pipeline would keep them for
    every micro-batch (performance-log.md)."""
    q_rope_BThR, k_rope_BSR = (None, None) if rotary is None else (rotary[0].astype(dtype), rotary[1])
    if rotary is not None:        # varying over tp as the heads do: its cotangent's psum over tp in fp32
        k_rope_BSR, = vary_like((k_rope_BSR,), (k_BShK,))
    return tpu_attention.attention(q_BThK.astype(dtype), k_BShK.astype(dtype), v_BShJ.astype(dtype),
                                   q_rope_BThR, k_rope_BSR, **kernel)


def xla_attention(q_BThQ, k_BShQ, v_BShJ, mask_TS, dtype, query_chunks=CAUSAL_QUERY_CHUNKS):
    """masked_attention as XLA compiles it; a causal one in up to query_chunks chunks of queries."""
    if mask_TS is not None:
        return masked_attention(q_BThQ, k_BShQ, v_BShJ, mask_TS, dtype, products.mm)
    T = q_BThQ.shape[1]
    n = min(query_chunks, T // CAUSAL_MIN_CHUNK)
    if n < 1 or T % n:
        n = 1
    # Query chunk i sees only the keys before its end: (n + 1) / 2n of the T x T products. The chunks'
    # slices of k and v add their gradients in another order: fp32 losses unchanged.
    c = T // n
    return jnp.concatenate([
        masked_attention(q_BThQ[:, i * c:(i + 1) * c], k_BShQ[:, :(i + 1) * c], v_BShJ[:, :(i + 1) * c],
                         jnp.arange((i + 1) * c)[None, :] <= jnp.arange(i * c, (i + 1) * c)[:, None], dtype,
                         products.mm)
        for i in range(n)], axis=1)


def cudnn_attention(q_BThQ, k_BShQ, v_BShJ, mask_TS):
    """cuDNN's fused attention of bf16 q, k, v, its output and softmax statistics kept for the backward
    (`keep_kernel_outputs`). MLA's v is narrower than q and k (J < Q = K + R): where cuDNN takes that
    (`cudnn_takes_narrow_v`) v goes in as it is, through jax's private entry (the public
    jax.nn.dot_product_attention needs one width); else it is zero-padded to Q and the padding sliced off."""
    Q, J = q_BThQ.shape[-1], v_BShJ.shape[-1]
    kernel = partial(_cudnn_narrow_v if J < Q and cudnn_takes_narrow_v(Q, J) else _cudnn_padded_v, mask_TS=mask_TS)
    if mask_TS is not None:                 # cached decode: nothing to differentiate
        return kernel(q_BThQ, k_BShQ, v_BShJ)
    return keep_kernel_outputs(kernel, q_BThQ, k_BShQ, v_BShJ)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def keep_kernel_outputs(kernel, *operands):
    """kernel(*operands), with what its backward needs besides its operands (a fused attention's output
    and softmax statistics) named KERNEL_OUTPUTS, so that every fast remat policy keeps it: the backward
    then runs the kernel's own backward without running its forward again."""
    return kernel(*operands)


def _keep_kernel_outputs_fwd(kernel, *operands):
    out, backward = jax.vjp(kernel, *operands)
    named_out = checkpoint_name(out, KERNEL_OUTPUTS)

    def kept(residual):
        """The operands are left to the remat to recompute, as every layer input is; the rest is kept."""
        if residual is out:
            return named_out
        return residual if any(residual is o for o in operands) else checkpoint_name(residual, KERNEL_OUTPUTS)
    return named_out, jax.tree.map(kept, backward)


def _keep_kernel_outputs_bwd(kernel, backward, g):
    return backward(g)


keep_kernel_outputs.defvjp(_keep_kernel_outputs_fwd, _keep_kernel_outputs_bwd)


def _cudnn_padded_v(q_BThQ, k_BShQ, v_BShJ, mask_TS):
    Q, J = q_BThQ.shape[-1], v_BShJ.shape[-1]
    v_BShQ = jnp.pad(v_BShJ, ((0, 0), (0, 0), (0, 0), (0, Q - J))) if J < Q else v_BShJ
    out_BThQ = jax.nn.dot_product_attention(q_BThQ, k_BShQ, v_BShQ, is_causal=mask_TS is None,
                                            mask=None if mask_TS is None else mask_TS[None, None],
                                            implementation="cudnn")
    return out_BThQ[..., :J] if J < Q else out_BThQ


def _cudnn_narrow_v(q_BThQ, k_BShQ, v_BShJ, mask_TS):
    from jax._src.cudnn import fused_attention_stablehlo as fused      # private: another jax may lack it
    return fused.dot_product_attention(
        q_BThQ, k_BShQ, v_BShJ, mask=None if mask_TS is None else mask_TS[None, None],
        scale=1 / math.sqrt(q_BThQ.shape[-1]),
        mask_type=fused.MaskType.CAUSAL if mask_TS is None else fused.MaskType.NO_MASK)


@cache
def cudnn_takes_narrow_v(Q, J):
    """Whether cuDNN runs attention with v of width J < Q as it is. jax lets it through from cuDNN 9.10 on
    a Hopper or newer, but only cuDNN on the GPU accepts or refuses the kernel for these widths: with a GPU
    in this process, a small attention by the narrow kernel is run once and compared with the padded one
    (`narrow_v_matches_padded`). Compiling for a GPU that is not here (`--compile_for h200`) nothing can
    run: jax's own checks decide."""
    if jax.default_backend() != "gpu":
        return True
    try:
        with jax.ensure_compile_time_eval():        # concrete arrays, even while a step is being traced
            narrow = narrow_v_matches_padded(Q, J, _cudnn_narrow_v, _cudnn_padded_v)
    except Exception:        # noqa: BLE001 - whatever refuses it (cuDNN, XLA, a jax without the entry): pad
        narrow = False
    log(f"attention: cuDNN's fused kernel, v {J} wide " + ("as it is" if narrow else f"zero-padded to q's {Q} "
        "(the narrow kernel was refused or disagreed: attention.cudnn_takes_narrow_v)"))
    return narrow


def narrow_v_matches_padded(Q, J, narrow, padded, T=256, H=2):
    """Whether attention `narrow`(q, k, v, mask_TS) equals `padded`'s, causal and under a mask, on random
    bf16 q, k [1, T, H, Q] and v [1, T, H, J]: the outputs and the gradients of a random projection of
    them, each to within 2% of its largest value (bf16 rounding, blocked differently)."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(key, (1, T, H, Q), jnp.bfloat16) for key in keys[:2])
    v, w = (jax.random.normal(key, (1, T, H, J), jnp.bfloat16) for key in keys[2:])
    window_TS = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]) < T // 4

    def run(attention, mask_TS):
        out, vjp = jax.vjp(lambda *qkv: attention(*qkv, mask_TS), q, k, v)
        return [np.asarray(a, np.float32) for a in (out, *vjp(w))]

    return all(np.max(np.abs(a - b)) <= 0.02 * np.max(np.abs(b)) for mask_TS in (None, window_TS)
               for a, b in zip(run(narrow, mask_TS), run(padded, mask_TS)))
