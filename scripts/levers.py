"""The fast engine's levers, each measured alone against the fast engine in the same process (on a quiet chip the
ratios of one run are what to trust): `python scripts/levers.py [--preset moe1B-v5e-1] [--levers A,B,...]
[--steps 8] [--warmup 2] [main.py flags ...]`.

A lever is one choice changed: a setting (flags on top of the run's), an option of XLA's compiler for the step
(COMPILER_OPTIONS: a TPU's; a CPU refuses them), one seam of engine.Fast done another
way (a subclass of it, registered in engine.ENGINES under the lever's name for this process), or a function of
the core swapped while the lever's step is built (a context). Each is compiled and timed as bench.py times a
step (bench.build_step, bench.time_steps), one JSON line as it is done, then a table: step time, its ratio to
the baseline's (above 1: faster), MFU of the datasheet peak and the compiler's plan. A lever the compiler
refuses (out of memory) says so and the others go on. A lever changes the program, not the math (but
no_dropout, which prices dropout's random bits, and the dropout levers, which draw other bits); one kept moves
into the engine for its platform, proven equal to --engine reference (tests/test_engine.py).

    python scripts/levers.py --levers unrolled_layers,ce_chunks_of_4096_tokens,attention_in_2_chunks   # one TPU v5e
    python scripts/levers.py --preset tiny --n_device_axis 1 1 1 --levers unrolled_layers --steps 2   # on a CPU
"""
import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import bench  # noqa: E402
import engine  # noqa: E402
import hardware  # noqa: E402
import model  # noqa: E402
import multihost  # noqa: E402
import sharding  # noqa: E402
import utils  # noqa: E402
from engine import attention_kernels, chunked_loss, expert_kernels, products, tpu_attention  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend.random import threefry_2x32  # noqa: E402
from planning.measure import compiled_or_shortfall, planned_gib  # noqa: E402


@dataclasses.dataclass(frozen=True)
class UnrolledLayers(engine.Fast):
    """Each block's dense layers unrolled (a GPU's choice) rather than a loop that stacks their saved products."""

    def layer_loop(self, cfg, train):
        return super().layer_loop(cfg, train)._replace(unroll=True)


def cross_entropy_chunks_of(tokens):
    @dataclasses.dataclass(frozen=True)
    class CrossEntropyChunks(engine.Fast):
        def _chunk_tokens(self):
            return tokens
    CrossEntropyChunks.__doc__ = (f"The output layer over chunks of at least {tokens} tokens (the engine's on a "
                                  f"TPU: {engine.CPU_CHUNK_TOKENS}): fewer passes over the table's gradient")
    return CrossEntropyChunks


def attention_in(chunks):
    @dataclasses.dataclass(frozen=True)
    class AttentionInChunks(engine.Fast):
        def attention(self, q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype):
            q_BThQ, k_BShQ = model.decoupled_rope_qk(q_BThK, k_BShK, rotary, dtype)
            return attention_kernels.xla_attention(q_BThQ, k_BShQ, v_BShJ, mask_TS, dtype, chunks)
    AttentionInChunks.__doc__ = (f"XLA's causal attention in up to {chunks} query chunks (the engine's where no "
                                 f"kernel runs: {attention_kernels.CAUSAL_QUERY_CHUNKS})")
    return AttentionInChunks


def attention_kernel(block=None, keep_outputs=False, narrow_block=None, rows=None):
    @dataclasses.dataclass(frozen=True)
    class AttentionKernel(engine.Fast):
        def attention(self, q_BThK, k_BShK, v_BShJ, rotary, mask_TS, dtype):
            narrow = narrow_block if rotary is None else None          # the NoPE layers
            kernel = lambda q, k, v, *rotary: attention_kernels.tpu_kernel_attention(
                q, k, v, rotary or None, dtype, block=narrow or block, rows=rows)
            operands = (q_BThK, k_BShK, v_BShJ, *(rotary or ()))
            return attention_kernels.keep_kernel_outputs(kernel, *operands) if keep_outputs else kernel(*operands)
    AttentionKernel.__doc__ = (f"The TPU attention kernel in blocks of {block or 'the engine'}'s side (the engine's: the "
                               f"largest of {tpu_attention.BLOCK_SIZES} dividing T)" +
                               (f", {rows} rows a piece (the diagonal's squares {rows} wide; the engine's: half a "
                                f"block from blocks of {tpu_attention.HALVED_BLOCK})" if rows else "") +
                               (", its outputs kept by every remat policy" if keep_outputs else "") +
                               (f", blocks of {narrow_block} for q.k 64 (the NoPE layers)" if narrow_block else ""))
    return AttentionKernel


def experts_megablox(tiling):
    @dataclasses.dataclass(frozen=True)
    class MegabloxExperts(engine.Fast):
        def routed_experts(self, w, x_BTD, experts_BTk, slot_BTk, C, cfg, axes):
            kernel = functools.partial(expert_kernels.megablox_grouped, tiling=tiling)
            return expert_kernels.experts_ragged(w, x_BTD, experts_BTk, slot_BTk, C, kernel)
    MegabloxExperts.__doc__ = (f"--moe_impl ragged's grouped matmuls by jax's Pallas TPU kernels (megablox gmm, tgmm), "
                               f"tiles of {tiling} (rows, contraction, columns); the engine's: lax.ragged_dot")
    return MegabloxExperts


@dataclasses.dataclass(frozen=True)
class ProductsFused(engine.Fast):
    """Each product's output free to fuse into what follows it (the engine's before the barriers of engine.Fast.mm)."""

    def mm(self, spec, a, b, dtype, out_dtype=jnp.float32):
        return products.mm(spec, a, b, dtype, out_dtype)


@dataclasses.dataclass(frozen=True)
class KeepFfnHidden(engine.Fast):
    """--remat auto as on a GPU: every layer recomputed but each dense FFN's up-projection, kept (a TPU keeps
    every product without batch dimensions, and the layer loops stack them)."""

    def layer_loop(self, cfg, train):
        return super().layer_loop(cfg, train)._replace(policy=engine.Fast("gpu").layer_loop(cfg, train).policy)


@dataclasses.dataclass(frozen=True)
class LayersApart(engine.Fast):
    """The training step's blocks and their dense layers traced apart (Python loops) whatever --remat (the
    engine's with --remat none on a TPU), not scanned: what the backward reads of a layer stays its own arrays,
    where the scans stack it and the blocks' scan copies each block's stacks again."""

    def layer_loop(self, cfg, train):
        return super().layer_loop(cfg, train)._replace(apart=train)


@dataclasses.dataclass(frozen=True)
class WeightsCastOnceAStep(engine.Fast):
    """The stacked layers' weights cast to their read dtypes once a step, behind an optimization barrier, so
    that XLA cannot sink the cast into the layer loops (a slice cast a layer at a time, in the forward and
    again in the replay: 6.5 ms of the step in the 2026-12-07 profile)."""

    def read_weights(self, stack, cfg):
        graphdef, state = nnx.split(super().read_weights(stack, cfg))
        # one barrier a leaf: one over all would make every leaf vary over the union of their mesh axes
        return nnx.merge(graphdef, jax.tree.map(lax.optimization_barrier, state))


@dataclasses.dataclass(frozen=True)
class CrossEntropySumsInAPass(engine.Fast):
    """Each token's sum of exponentials over the fp32 exponentials in a pass of its own (the engine's elsewhere than
    on a TPU), rather than from the hidden states' gradient product, a column of ones beside the table."""

    def cross_entropy_sum(self, table_vD, h_BTD, targets_BT, cfg, axes):
        return chunked_loss.chunked_cross_entropy_sum(table_vD, h_BTD, targets_BT, cfg, axes, self._chunk_tokens())


@dataclasses.dataclass(frozen=True)
class OptimizerInXla(engine.Fast):
    """The optimizer's update as optax's chain writes it, fused by XLA (the engine's elsewhere than on a TPU),
    rather than tpu_update's kernel, a leaf a pass."""

    def optimizer_kernel(self):
        return None


def dropout_from_whole_threefry_words(x_BTD, rate, key, seq_ids_B):
    """model.dropout with both 32-bit halves of each threefry hash used (jax.random.bits keeps one word of a
    hash's two, bits1 ^ bits2): 4 elements' 16 bits a hash, half the hashes; other bits, the same mask's law."""
    def one(x_TD, seq):
        (T, D), cut = x_TD.shape, round(rate * 2**16)
        pair, n = jax.random.key_data(jax.random.fold_in(key, seq)), (D + 1) // 2
        words = threefry_2x32(pair, lax.iota(jnp.uint32, T * n)).reshape(T, n)
        bits_TD = jnp.concatenate([words & 0xFFFF, words >> 16], axis=-1)[:, :D]
        return x_TD / (1 - cut / 2**16) * (bits_TD >= cut)
    return jax.vmap(one)(x_BTD, seq_ids_B)


@contextlib.contextmanager
def dropout_swapped(dropout):
    """model.dropout is `dropout` while the lever's step is built."""
    plain, model.dropout = model.dropout, dropout
    try:
        yield
    finally:
        model.dropout = plain


@contextlib.contextmanager
def ce_exponentials_behind_barrier():
    """The output layer's exp(logit - max) [v, N] rounded to the matmul dtype behind an optimization barrier:
    written once, then read by the two gradient products, rather than recomputed from the fp32 logits inside
    each (the table gradient's fusion ran at 53% of peak in the 2026-12-07 profile)."""
    plain = chunked_loss._chunk_ce

    def chunk_ce(axes, table_r, h_r, local_targets_N, n_real, table_ones_vE=None):
        ce, (exp_vN, *rest) = plain(axes, table_r, h_r, local_targets_N, n_real, table_ones_vE)
        return ce, (lax.optimization_barrier(exp_vN.astype(table_r.dtype)), *rest)
    chunked_loss._chunk_ce = chunk_ce
    try:
        yield
    finally:
        chunked_loss._chunk_ce = plain


@contextlib.contextmanager
def ce_hidden_states_rounded_without_barrier():
    """The output layer's chunks of hidden states rounded to the matmul dtype in the loop with no optimization barrier
    (the engine's elsewhere than on a TPU): XLA:TPU folds the rounding into the logits' product, an fp32 x bf16 one
    (docs/performance-log.md#2026-12-07-tpu-ce-sums)."""
    plain = chunked_loss._rounded_behind_barrier
    chunked_loss._rounded_behind_barrier = lambda h_ND, dtype: h_ND.astype(dtype)
    try:
        yield
    finally:
        chunked_loss._rounded_behind_barrier = plain


@contextlib.contextmanager
def experts_combined_by_unique_gather():
    """Each routed choice's output gathered from the expert buffers with a dropped choice sent to a place of its own
    past the buffer (read as 0), as the dispatch's scatter already does, the gather promising unique indices: its
    transpose, the backward's scatter-add into the buffers, then has no duplicates to add up (the dropped choices
    read the expert's last slot, a kept one's). The same numbers (the MoE masks the dropped choices)."""
    plain = expert_kernels._choices_outputs

    def unique_gather(y_BECD, b_BTk, experts_BTk, slot_BTk, C):
        return y_BECD.at[b_BTk, experts_BTk, expert_kernels._distinct_drops(slot_BTk, C)].get(
            mode="fill", fill_value=0, unique_indices=True)
    expert_kernels._choices_outputs = unique_gather
    try:
        yield
    finally:
        expert_kernels._choices_outputs = plain


# Options of XLA's TPU compiler, each a lever for its step's compile alone: the VMEM each of XLA's fusions may use (16 MiB
# on a v5e unless set; MaxText sets 96 on a v5e or v6e for a dense model), room for larger tiles of a product.
COMPILER_OPTIONS = {f"xla_fusions_vmem_of_{mib}_mib": {"xla_tpu_scoped_vmem_limit_kib": str(mib * 1024)}
                    for mib in (32, 64, 96)}

# name: (flags on top of the run's, engine class or None[, a context the lever's step is built in])
LEVERS = {
    "unrolled_layers": ((), UnrolledLayers),
    "optimizer_in_xla": ((), OptimizerInXla),
    "ce_sums_in_a_pass": ((), CrossEntropySumsInAPass),
    "weights_cast_once_a_step": ((), WeightsCastOnceAStep),
    **{f"ce_chunks_of_{n}_tokens": ((), cross_entropy_chunks_of(n)) for n in (2048, 4096, 8192)},
    **{f"attention_in_{n}_chunks": ((), attention_in(n)) for n in (1, 2, 4, 8)},
    **{f"attention_kernel_blocks_of_{n}": ((), attention_kernel(n)) for n in (128, 256, 512)},
    "attention_kernel_blocks_of_256_for_nope": ((), attention_kernel(narrow_block=256)),
    **{f"attention_kernel_rows_of_{n}": ((), attention_kernel(rows=n)) for n in (128, 256, 512)},   # 512: square
    "attention_kernel_blocks_of_1024_rows_of_128": ((), attention_kernel(1024, rows=128)),
    "attention_kernel_outputs_kept": ((), attention_kernel(keep_outputs=True)),
    "remat_full": (("--remat", "full"), None),
    "remat_auto": (("--remat", "auto"), None),         # dots here (not settled as main.py settles it): the dots rows
    "remat_dots": (("--remat", "dots"), None),
    "remat_keep_ffn_hidden": ((), KeepFfnHidden),
    "products_fused": ((), ProductsFused),
    "moe_ragged": (("--moe_impl", "ragged"), None),
    **{f"moe_ragged_megablox_{'_'.join(map(str, tiling))}": (("--moe_impl", "ragged"), experts_megablox(tiling))
       for tiling in ((128, 128, 128), (256, 256, 256), (512, 256, 256), (512, 768, 768))},
    # twice the sequences a step (compare MFU, not step time): the optimizer's pass over the state per token halved
    "batch_16": (("--train_batch_size", "16"), None),
    "batch_16_in_2_grad_steps": (("--grad_step", "2"), None),     # 8 sequences twice, one optimizer pass
    "batch_16_ce_chunks_of_8192_tokens": (("--train_batch_size", "16"), cross_entropy_chunks_of(8192)),
    "ce_exponentials_behind_barrier": ((), None, ce_exponentials_behind_barrier),
    "ce_hidden_states_rounded_without_barrier": ((), None, ce_hidden_states_rounded_without_barrier),
    "experts_combined_by_unique_gather": ((), None, experts_combined_by_unique_gather),
    "no_dropout": (("--dropout_rate", "0"), None),          # what dropout's random bits cost (not a lever to keep)
    "dropout_whole_threefry_words": ((), None, functools.partial(dropout_swapped, dropout_from_whole_threefry_words)),
    **{f"layers_apart_remat_{remat}": (("--remat", remat), LayersApart) for remat in ("full", "dots")},
    **{name: ((), None) for name in COMPILER_OPTIONS},
}


def parse_args(argv):
    """(this script's options, the run's main.py flags)."""
    own = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    own.add_argument("--preset", default="moe1B-v5e-1")
    own.add_argument("--levers", default=",".join(LEVERS), help=f"comma-separated, of: {', '.join(LEVERS)}")
    own.add_argument("--steps", type=int, default=8)
    own.add_argument("--warmup", type=int, default=2)
    args, flags = own.parse_known_args(argv)
    unknown = [name for name in args.levers.split(",") if name not in LEVERS]
    if unknown:
        own.error(f"--levers: {', '.join(unknown)} unknown; the levers: {', '.join(LEVERS)}")
    return args, flags


def lever_config(name, args, flags):
    """The run's config with lever `name` (or none: "baseline") applied."""
    lever_flags, engine_class, *_ = LEVERS.get(name, ((), None))
    cfg = utils.config_from_args(["--preset", args.preset, *flags, *lever_flags])
    if engine_class is None:
        return cfg
    engine.ENGINES[name] = engine_class
    return utils.override(cfg, engine=name)


def measure(name, cfg, args):
    """{lever, step_ms, mfu, plan_gib, compile_s, loss} of cfg's train step (bench.py's timing), or {lever,
    error} when the compiler refuses it for want of memory."""
    mesh = sharding.run_mesh(cfg.run)
    step, make_state, make_batch, abstract_args = bench.build_step(cfg, mesh)
    t = time.perf_counter()
    compiled, needed_gib = compiled_or_shortfall(step, abstract_args(), COMPILER_OPTIONS.get(name))
    if compiled is None:
        return {"lever": name, "error": f"out of memory: needs {needed_gib:.2f} GiB a device"}
    compile_s = time.perf_counter() - t
    _, stats, times = bench.time_steps(compiled, make_state(cfg.run.seed), make_batch(cfg.run.seed + 1), args)
    median = statistics.median(times)
    tokens_per_s = utils.sequences_per_step(cfg) * cfg.model.T / median
    device = jax.devices()[0]
    return {"lever": name, "step_ms": 1e3 * median, "compile_s": compile_s, "loss": float(stats["loss"]),
            "mfu": hardware.mfu(tokens_per_s, sharding.flops_per_token(cfg.model), mesh.size,
                                hardware.peak_flops(device.device_kind)),
            "plan_gib": planned_gib(compiled.memory_analysis(), device.platform)}


def main(argv=None):
    args, flags = parse_args(sys.argv[1:] if argv is None else argv)
    configs = {name: lever_config(name, args, flags) for name in ["baseline", *args.levers.split(",")]}
    multihost.set_up_devices(configs["baseline"])
    utils.validate(configs["baseline"], jax.device_count())
    rows = []
    for name, cfg in configs.items():
        context = LEVERS[name][2] if len(LEVERS.get(name, ())) > 2 else contextlib.nullcontext
        with context():
            row = measure(name, cfg, args)
        baseline = rows[0] if rows else row
        if "step_ms" in row and "step_ms" in baseline:
            row["speedup"] = baseline["step_ms"] / row["step_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows, sys.stderr)
    return rows


def print_table(rows, out):
    w = max(24, *(len(row["lever"]) for row in rows))
    print(f"{'lever':{w}} {'step ms':>9} {'speedup':>8} {'MFU':>6} {'plan GiB':>9}", file=out)
    for row in rows:
        if "error" in row:
            print(f"{row['lever']:{w}} {row['error']}", file=out)
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        speedup = f"{row['speedup']:.3f}" if "speedup" in row else "n/a"
        print(f"{row['lever']:{w}} {row['step_ms']:9.1f} {speedup:>8} {mfu:>6} "
              f"{row['plan_gib']:9.2f}", file=out)


if __name__ == "__main__":
    main()
