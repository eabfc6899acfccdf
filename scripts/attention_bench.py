"""Attention alone on one accelerator: XLA's causal chunks against our TPU kernel (engine/tpu_attention.py) and
jax's Pallas kernels at MLA's head widths, forward and backward, each timed in the same process (ratios to
the first variant's: above 1 is faster).
`python scripts/attention_bench.py [--batch 8] [--heads 12] [--T 1024] [--reps 10]`; one JSON line a variant.
On a CPU the kernels run in Pallas' interpret mode (slow; for checking that the variants run, not timing).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask  # noqa: E402

import model  # noqa: E402
from engine import attention_kernels, tpu_attention  # noqa: E402


def joined(attention):
    """attention(q, k, v) of q and k joined with decoupled RoPE's parts, as the engine joins them for every path
    but the MLA kernel, which reads the parts as they are."""
    return lambda q, k, v, *rotary: attention(*model.decoupled_rope_qk(q, k, rotary or None, q.dtype), v)


def xla_chunks(n):
    return joined(lambda q, k, v: attention_kernels.xla_attention(q, k, v, None, jnp.bfloat16, n))


def mla_kernel(block, interpret, rows=None):
    return lambda q, k, v, *rotary: tpu_attention.attention(q, k, v, *rotary, block=block, rows=rows,
                                                            interpret=interpret)


def splash_variant(block, compute, fused, interpret):
    """Splash attention of [B, T, h, Q] operands: q scaled, heads first, a kernel per sequence (vmapped)."""
    def run(q, k, v):
        B, T, h, Q = q.shape
        sizes = dict(block_q=block, block_kv=block, block_kv_compute=compute, block_q_dkv=block, block_kv_dkv=block,
                     block_kv_dkv_compute=compute, use_fused_bwd_kernel=fused)
        if not fused:
            sizes.update(block_q_dq=block, block_kv_dq=block)
        mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((T, T))] * h)
        kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=splash.BlockSizes(**sizes),
                                        interpret=interpret)
        heads_first = lambda x: jnp.swapaxes(x, 1, 2)
        q = (q.astype(jnp.float32) / math.sqrt(Q)).astype(q.dtype)
        return heads_first(jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v)))
    return run


def pallas_flash_variant(block_q, block_k, interpret):
    """jax's older Pallas flash attention, v zero-padded to q's width where narrower (it takes one width)."""
    def run(q, k, v):
        Q, J = q.shape[-1], v.shape[-1]
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, Q - J)))
        sizes = pallas_flash.BlockSizes(block_q=block_q, block_k_major=block_k, block_k=block_k, block_b=1,
                                        block_q_major_dkv=block_q, block_k_major_dkv=block_k, block_k_dkv=block_k,
                                        block_q_dkv=block_q, block_k_major_dq=block_k, block_k_dq=block_k,
                                        block_q_dq=block_q)
        heads_first = lambda x: jnp.swapaxes(x, 1, 2)
        out = pallas_flash.flash_attention(heads_first(q), heads_first(k), heads_first(v), causal=True,
                                           sm_scale=1 / math.sqrt(Q), block_sizes=sizes, debug=False)
        return heads_first(out)[..., :J]
    return run


def variants(interpret):
    out = {f"xla_{n}_chunks": xla_chunks(n) for n in (8, 4)}
    out |= {f"mla_kernel_{block}": mla_kernel(block, interpret) for block in (512, 256, 128)}
    out |= {f"mla_kernel_{block}_rows_{rows}": mla_kernel(block, interpret, rows)
            for block, rows in [(512, 256), (512, 128), (1024, 512), (1024, 256), (1024, 128), (256, 128)]}
    for block, compute, fused in [(512, 512, True), (512, 256, True), (1024, 512, True), (512, 512, False),
                                  (256, 256, True), (1024, 1024, True)]:
        out[f"splash_{block}_{compute}{'_fused' if fused else ''}"] = joined(splash_variant(block, compute, fused,
                                                                                         interpret))
    for block_q, block_k in [(512, 512), (1024, 512), (256, 256)]:
        out[f"pallas_flash_{block_q}_{block_k}"] = joined(pallas_flash_variant(block_q, block_k, interpret))
    return out


def time_variant(attention, operands, w, reps):
    """Median seconds of forward + backward (the gradients of sum(out * w)) and the outputs, compiled once."""
    step = jax.jit(jax.value_and_grad(lambda *operands: jnp.sum(attention(*operands).astype(jnp.float32) * w),
                                      argnums=tuple(range(len(operands)))))
    out = jax.block_until_ready(step(*operands))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(step(*operands))
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = parser.parse_args()
    interpret = jax.default_backend() != "tpu"
    chosen = variants(interpret)
    if args.only:
        chosen = {name: chosen[name] for name in args.only.split(",")}
    for K, R, J in [(64, 128, 64), (64, 0, 64)]:             # MLA's RoPE layers (q.k 192), its NoPE ones
        keys = jax.random.split(jax.random.key(0), 6)
        B, T, h, Q = args.batch, args.T, args.heads, K + R
        q, k = (jax.random.normal(key, (B, T, h, K), jnp.bfloat16) for key in keys[:2])
        v, w = (jax.random.normal(key, (B, T, h, J), jnp.bfloat16) for key in keys[2:4])
        rotary = (jax.random.normal(keys[4], (B, T, h, R), jnp.bfloat16),
                  jax.random.normal(keys[5], (B, T, R), jnp.bfloat16)) if R else ()
        flops = 3 * 2 * B * h * T * T * (Q + J) / 2     # causal half of the forward's two products, backward twice that
        baseline, reference = None, None
        for name, attention in chosen.items():
            try:
                seconds, out = time_variant(attention, (q, k, v, *rotary), w, args.reps)
            except Exception as error:  # noqa: BLE001 - a kernel that refuses these shapes is a result
                print(json.dumps({"widths": f"{Q}/{J}", "variant": name, "error": str(error).splitlines()[0][:300]}),
                      flush=True)
                continue
            baseline, reference = baseline or seconds, reference or out
            error = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                              (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-30))
                        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference)))
            print(json.dumps({"widths": f"{Q}/{J}", "variant": name, "ms": round(1e3 * seconds, 3),
                              "speedup": round(baseline / seconds, 3), "tflops": round(flops / seconds / 1e12, 1),
                              "max_rel_error": float(f"{error:.2e}")}), flush=True)


if __name__ == "__main__":
    main()
