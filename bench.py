"""Training-step benchmark: `python bench.py [--preset P] [guide flags...] [--steps N] [--warmup W]`.

Builds the config exactly as main.py does (preset, then every guide flag on top), validates it,
compiles the training step main.py runs (value_and_grad of pipeline.loss_and_metrics, global-norm
clipping, AdamW with weight decay on matrices only, params and optimizer state sharded over the mesh
and donated), feeds it random tokens, runs W warm-up steps and N timed steps, and prints ONE JSON
line (the fields are described in docs/performance.md). In the same run it times a large matmul (bf16
8192^3 on an accelerator, fp32 1024^3 on a CPU) so MFU is reported against the spec-sheet peak and
against what this device actually sustains: MFU of the datasheet's bf16 peak ("mfu"), as MaxText, Megatron and
NeMo report it, and of the measured rate beside it. `--dump_hlo PATH` writes the compiled step's optimized HLO
(on a GPU: the kernels autotuning chose), which scripts/refit_estimate.py costs kernel by kernel.

`--pipeline_flops` counts instead of timing: it compiles the step for the given mesh (pp = P,
M micro-batches) and for the same config with pp = 1, 2, 4, ... below P (same dp and tp, same
global batch and M; a pp the config does not allow is skipped) and prints the per-device FLOPs of
each, their ratio to pp = 1, and the pipeline's expectation (P M + pp - 1) / (P M pp) (P =
--pipeline_repeats; 1: GPipe), as a table on stderr and in the JSON line ("by_pp"). XLA:CPU's cost analysis does not count through loops (a `while`
body, i.e. every lax.scan, is costed once), so the FLOPs are also counted here from the optimized
HLO with every loop body multiplied by its trip count (`hlo_flops`); that count is the one compared.

`--profile DIR` traces --steps more steps after the timed ones (jax.profiler, into DIR; open it in XProf
or TensorBoard) and prints the device's op time per step (each op's own: a TPU loop's body ops are taken off
the loop, so the ops sum to the step's busy time), by seam (the named scope each kernel's ops carry: the
engine's seams, engine.SEAM_SCOPES, and the optimizer's update) and by name, largest first (GPU kernels and
copies, TPU XLA ops; on a CPU, which has no device plane, the host's thunks), also in the JSON line ("profile");
every op's time per step, by the HLO instruction it ran for, goes to DIR/kernels.json.

`--grad_error` measures instead: the largest per-leaf relative error of one batch's gradient in the
matmul dtype, on the given mesh and on one device with the same M micro-batches, against the fp32
single-device reference; it prints both and, in bf16, exits 1 when the mesh is worse than one
device (x1.1). In fp32 both are summation-order noise (~1e-6) and their ratio means nothing. The
batch's token ids are Zipf-distributed as in text (`--tokens uniform`: uniform); beside the errors,
that of the fp32 gradient rounded once to the matmul dtype (the floor), and each error on the tied
table alone (its gradient sums over every occurrence of a token), and one device's error with the other
engine (--engine reference's plain math, or the fast one's kernels): in bf16 the fast engine's is to be
no larger than the reference's, leaf by leaf in the median ("engine_leaf_ratio").

Examples:
  python bench.py --preset tiny --n_device_axis 2 2 2 --cpu_devices 8 --train_batch_size 8 --steps 5
  python bench.py --preset moe1B --n_device_axis 1 1 1 --train_batch_size 8 --micro_batch_size 1
  python bench.py --preset moe1B-v5e-1 --profile /tmp/trace
  python bench.py --preset tiny --n_device_axis 1 2 1 --micro_batch_size 4 --cpu_devices 8 --pipeline_flops
  python bench.py --preset tiny --blocks 4 --n_device_axis 1 4 1 --micro_batch_size 4 --cpu_devices 8 --pipeline_flops
  python bench.py --preset tiny --blocks 8 --vocab_size 1000 --n_device_axis 1 4 1 --micro_batch_size 4 \
      --pipeline_repeats 2 --cpu_devices 8 --pipeline_flops
  python bench.py --preset tiny --n_device_axis 8 1 1 --train_batch_size 2 --cpu_devices 8 --grad_error
"""
import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import hardware
import hlo
import multihost
import pipeline
import sharding
import utils
from engine import matmul_precision
from planning import fit, measure
from trainer import abstract_step_args, build_trainer


def parse_args(argv=None):
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--steps", type=int, default=10, help="timed training steps")
    own.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    own.add_argument("--pipeline_flops", action="store_true",
                     help="count per-device FLOPs of the step with this pp and with pp=1, 2, 4, ... below it "
                          "instead of timing")
    own.add_argument("--grad_error", action="store_true",
                     help="compare the gradient on this mesh and on one device with the fp32 reference instead of timing")
    own.add_argument("--tokens", choices=("zipf", "uniform"), default="zipf",
                     help="--grad_error's batch: Zipf-distributed ids, as text's (default), or uniform ones")
    own.add_argument("--matmul_size", type=int, default=0,
                     help="side of the square matmul timed for the measured peak (0: 8192 bf16 on an "
                          "accelerator, 1024 fp32 on CPU)")
    own.add_argument("--profile", metavar="DIR", default="",
                     help="after the timed steps, trace --steps more with jax.profiler into DIR and print the "
                          "device's op times per step, largest first (GPU kernels and copies, TPU XLA ops)")
    own.add_argument("--dump_hlo", metavar="PATH", default="",
                     help="write the compiled training step's optimized HLO text to PATH")
    own.add_argument("--preset", choices=sorted(utils.PRESETS), default="tiny")
    own.add_argument("-h", "--help", action="store_true")
    args, rest = own.parse_known_args(argv)
    if args.help:
        own.print_help()
        print("\nEvery training flag of main.py is accepted too:\n")
        utils.build_parser().print_help()
        sys.exit(0)
    if args.steps < 1 or args.warmup < 0:
        own.error("--steps must be >= 1 and --warmup >= 0")
    cfg = utils.config_from_args(["--preset", args.preset] + rest)
    return args, cfg


# ----------------------------------------------------------------------------------------------
# The training step (the same computation as main.py's train_step)


def build_step(cfg, mesh):
    """main.py's jitted training step (trainer.build_trainer) with a fresh state, random batches and
    abstract arguments for compiling without data. Returns (step, make_state, make_batch, abstract_args)."""
    trainer = build_trainer(cfg, mesh)
    data_shard = trainer.data_sharding
    micro_steps, rows, T = cfg.optim.grad_step, utils.global_batch(cfg), cfg.model.T

    def make_batch(seed):
        tokens = jax.random.randint(jax.random.key(seed), (micro_steps, rows, T + 1), 0, cfg.model.vocab_size,
                                    jnp.int32)
        return tuple(tuple(jax.device_put(tokens[i, :, part], data_shard) for i in range(micro_steps))
                     for part in (slice(None, -1), slice(1, None)))

    return trainer.step, trainer.fresh_state, make_batch, lambda: abstract_step_args(cfg, trainer)[0]


# ----------------------------------------------------------------------------------------------
# FLOP counting


def xla_flops(compiled):
    """'flops' of XLA's cost analysis of a compiled executable (a dict, or a list of one dict per
    program in older jax), or None. Per device: the module is the SPMD-partitioned one."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def count_step_flops(cfg):
    """Per-device FLOPs of the compiled step for cfg: XLA's cost analysis and the loop-aware count."""
    mesh = sharding.run_mesh(cfg.run)
    step, _, _, abstract_args = build_step(cfg, mesh)
    compiled = step.lower(*abstract_args()).compile()
    return {"xla_cost_analysis": xla_flops(compiled), **hlo.matmul_flops(compiled.as_text())}


def expected_pipeline_ratio(M, pp, P=1):
    """Per-device block work at pp stages over the pp = 1 figure: each device runs P M + pp - 1
    ticks of blocks/(P pp) blocks instead of P M ticks of blocks/P, i.e. (P M + pp - 1) / (P M pp)."""
    return (P * M + pp - 1) / (P * M * pp)


def pipeline_flops(cfg):
    """Per-device FLOPs of the step on (dp, pp, tp) and on (dp, 1, tp), same global batch and M,
    and in "by_pp" the same for every pp of 1, 2, 4, ... up to the mesh's (those the config allows).

    GPipe: each stage runs M + pp - 1 ticks of blocks/pp blocks on one micro-batch, so the blocks' work
    per device is (M + pp - 1) / (M pp) of the pp = 1 step; a circular pipeline of P repeats,
    (P M + pp - 1) / (P M pp). The output layer (tied embedding, large vocab) runs after the
    pipeline, split over the stages (1/pp each), so the total ratio sits below the pipeline figure
    by how much of the step the output layer is; "ratio_by_part" shows both."""
    dims = cfg.run.dims
    pp, M, P = dims.pp, cfg.run.micro_batch_size, cfg.model.pipeline_repeats
    stages = sorted({1, pp} | {2 ** i for i in range(1, pp.bit_length()) if 2 ** i < pp})
    counts = {}
    for stage_count in stages:
        variant = utils.override(cfg, n_device_axis=dims.replace(pp=stage_count).shape)
        try:
            utils.validate(variant, jax.device_count())
        except utils.ConfigError:
            if stage_count in (1, pp):
                raise
            continue                  # an intermediate pp the config does not allow (blocks, M)
        counts[stage_count] = count_step_flops(variant)
    with_pp, without = counts[pp], counts[1]
    ratio = lambda a, b, key: (a[key] / b[key]) if a.get(key) and b.get(key) else None
    expected = expected_pipeline_ratio(M, pp, P)
    parts = ("total", "blocks", "output_layer", "unattributed", "forward", "backward", "remat")
    by_pp = [{"pp": n, "per_device_flops": c["total"], "blocks": c["blocks"] + c["unattributed"],
              "output_layer": c["output_layer"], "ratio": ratio(c, without, "total"),
              "blocks_ratio": (c["blocks"] + c["unattributed"]) / (without["blocks"] + without["unattributed"])
              if without["blocks"] + without["unattributed"] else None,
              "expected_ratio": expected_pipeline_ratio(M, n, P),
              "expected_flops": expected_pipeline_ratio(M, n, P) * without["total"]}
             for n, c in sorted(counts.items())]
    return {
        "mode": "pipeline_flops", "mesh": list(dims.shape), "flat_mesh": list(dims.replace(pp=1).shape), "micro_batches": M,
        "pipeline_repeats": P,
        "global_batch": utils.global_batch(cfg), "T": cfg.model.T, "remat": cfg.model.remat,
        "per_device_flops_pp": with_pp["total"], "per_device_flops_pp1": without["total"],
        "ratio": ratio(with_pp, without, "total"), "gpipe_expected_ratio": expected_pipeline_ratio(M, pp),
        "expected_ratio": expected,
        "ratio_over_expected": ratio(with_pp, without, "total") / expected if ratio(with_pp, without, "total") else None,
        "ratio_by_part": {k: ratio(with_pp, without, k) for k in parts[1:]},
        "breakdown_pp": {k: with_pp.get(k, 0.0) for k in parts}, "breakdown_pp1": {k: without.get(k, 0.0) for k in parts},
        "by_pp": by_pp,
        "xla_cost_analysis_flops_pp": with_pp["xla_cost_analysis"],
        "xla_cost_analysis_flops_pp1": without["xla_cost_analysis"],
        "xla_cost_analysis_ratio": ratio(with_pp, without, "xla_cost_analysis"),
        "note": "per_device_flops_*: matmul FLOPs of the optimized per-device HLO, loop bodies x trip count; "
                "xla_cost_analysis_*: XLA's own figure, which counts each loop body once; "
                "expected_ratio: (P M + pp - 1) / (P M pp) with P = pipeline_repeats (1: GPipe)",
    }


def print_pipeline_table(result, out):
    """The by_pp rows as a table (to stderr: stdout stays one JSON line)."""
    M, P = result["micro_batches"], result["pipeline_repeats"]
    print(f"per-device matmul FLOPs of one train step, M = {M}, P = {P} (expected: (P M + pp - 1)/(P M pp) "
          f"x the pp = 1 total)", file=out)
    print(f"{'pp':>3} {'total':>11} {'blocks':>11} {'output':>11} {'ratio':>7} {'blocks':>7} {'expected':>9} "
          f"{'expected FLOPs':>14} {'total/exp':>9}", file=out)
    for row in result["by_pp"]:
        print(f"{row['pp']:>3} {row['per_device_flops']:>11.4e} {row['blocks']:>11.4e} {row['output_layer']:>11.4e} "
              f"{row['ratio']:>7.3f} {row['blocks_ratio'] or 0:>7.3f} {row['expected_ratio']:>9.3f} "
              f"{row['expected_flops']:>14.4e} {row['ratio'] / row['expected_ratio']:>9.3f}", file=out)


# ----------------------------------------------------------------------------------------------
# Gradient precision

# bf16 rounding noise moves with the batch shapes XLA blocks the matmuls by, which differ between
# the mesh and one device: per leaf the two errors differ by up to ~30%, their maxima by a few
# percent (docs/performance-log.md#2026-11-30-gradient-error-fsdp).
GRAD_ERROR_SLACK = 1.1


TABLE_LEAF = "['embed']"
ZIPF_EXPONENT = 1.2     # text's token frequencies fall about as rank^-1.2 (a few ids take most positions)


def zipf_tokens(seed, shape, vocab_size, exponent=ZIPF_EXPONENT):
    """Token ids with Zipf-distributed frequencies (rank r drawn with probability proportional to
    r^-exponent), ranks given to ids in a fixed random order: as in real text, a few ids fill a large
    share of the positions (here the commonest about a fifth) and most of the vocabulary never appears.
    Uniform ids would hide what sums over a token's occurrences do (the tied table's gradient)."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, vocab_size + 1, dtype=np.float64) ** -exponent
    return jnp.asarray(rng.permutation(vocab_size)[rng.choice(vocab_size, size=shape, p=p / p.sum())], jnp.int32)


def grad_error(cfg, tokens="zipf"):
    """Largest per-leaf relative gradient error, max|g - g_ref| / max|g_ref|, on cfg's mesh and on one
    device (same M micro-batches) in cfg's matmul dtype against the fp32 single-device reference, on one
    batch of `tokens` ("zipf": `zipf_tokens`, or "uniform"); beside them the same error of the fp32
    gradient rounded once to the matmul dtype, the least a gradient held in it can have."""
    m, M = cfg.model, cfg.run.micro_batch_size
    params = sharding.init_params(m, jax.random.key(cfg.run.seed))
    key = jax.random.key(cfg.run.seed + 1)
    shape = (utils.global_batch(cfg), m.T + 1)
    batch = (zipf_tokens(cfg.run.seed + 1, shape, m.vocab_size) if tokens == "zipf" else
             jax.random.randint(key, shape, 0, m.vocab_size))
    x, y = batch[:, :-1], batch[:, 1:]
    fp32 = utils.override(cfg, model_dtype="float32").model
    with matmul_precision(fp32.model_dtype):     # traced at full precision, as a run in fp32 is (a TPU's default is not)
        reference = jax.device_get(jax.jit(jax.grad(
            lambda p: pipeline.one_device_loss(p, x, y, key, fp32)[0]))(params))
    ref_leaves = jax.tree_util.tree_leaves_with_path(reference)

    def errors(grads):
        """{leaf: its relative error}, and the worst leaf."""
        by_leaf = {jax.tree_util.keystr(path): float(np.max(np.abs(np.asarray(g, np.float32) - r)) / np.max(np.abs(r)))
                   for (path, r), g in zip(ref_leaves, jax.tree.leaves(grads))}
        return by_leaf, max(by_leaf, key=by_leaf.get)

    def on_mesh(shape, mc=m):
        mesh = sharding.make_mesh(shape)
        grad = jax.jit(jax.grad(lambda p: pipeline.loss_and_metrics(p, x, y, key, mc, mesh, M)[0]))
        with matmul_precision(mc.model_dtype):
            return errors(grad(jax.device_put(params, sharding.param_shardings(params, mesh, mc.expert_parallel))))

    other_engine = dataclasses.replace(m, engine="reference" if m.engine == "fast" else "fast")
    runs = {"mesh": on_mesh(cfg.run.dims.shape), "one_device": on_mesh((1, 1, 1)),
            f"{other_engine.engine}_engine": on_mesh((1, 1, 1), other_engine),
            "rounding": errors(jax.tree.map(lambda r: r.astype(m.model_dtype), reference))}
    worst = {name: by_leaf[leaf] for name, (by_leaf, leaf) in runs.items()}
    # leaf by leaf, the mesh's error over one device's: where a mesh's own rounding would show
    leaf_ratios = {leaf: runs["mesh"][0][leaf] / e for leaf, e in runs["one_device"][0].items()}
    worst_ratio_leaf = max(leaf_ratios, key=leaf_ratios.get)
    # leaf by leaf, this engine's error over the other's, both on one device
    engine_ratios = [e / runs[f"{other_engine.engine}_engine"][0][leaf] for leaf, e in runs["one_device"][0].items()]
    return {"mode": "grad_error", "tokens": tokens, "mesh": list(cfg.run.dims.shape), "micro_batches": M,
            "global_batch": len(x), "model_dtype": m.model_dtype, "engine": m.engine,
            **{f"{name}_error": worst[name] for name in runs}, **{f"{name}_worst_leaf": runs[name][1] for name in runs},
            "ratio": worst["mesh"] / worst["one_device"], "bound": GRAD_ERROR_SLACK,
            "leaf_ratio": {"median": float(np.median(list(leaf_ratios.values()))), "max": leaf_ratios[worst_ratio_leaf],
                           "max_leaf": worst_ratio_leaf},
            "engine_leaf_ratio": {"median": float(np.median(engine_ratios)), "max": float(np.max(engine_ratios))},
            # The tied table's gradient sums over every occurrence of a token: where a bf16 sum would show.
            "table_error": {name: by_leaf[TABLE_LEAF] for name, (by_leaf, _) in runs.items()}}


# ----------------------------------------------------------------------------------------------
# Timing


def matmul_peak(device, size):
    """Sustained FLOP/s of one square matmul on `device` (bf16 on accelerators, fp32 on CPU)."""
    cpu = device.platform == "cpu"
    n = size or (1024 if cpu else 8192)
    dtype = jnp.float32 if cpu else jnp.bfloat16
    a = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), dtype), device)
    b = jax.device_put(jax.random.normal(jax.random.key(2), (n, n), dtype), device)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    reps = 3 if cpu else 20
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(a, b)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t) / reps)
    return 2.0 * n ** 3 / best, f"{n}x{n}x{n} {jnp.dtype(dtype).name}"


def peak_memory(devices):
    """The most memory a device holds running the step. Where the runtime reserves a program's temporaries apart
    from its buffers (a TPU's bytes_reserved), what each device holds after the timed steps: its buffers (the
    state, the batch) and the step's reservation (peak_bytes_in_use leaves that out, and it peaks while the state
    is initialised). Elsewhere the buffers' peak."""
    held = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:           # not implemented on some backends
            stats = None
        if stats and "bytes_reserved" in stats:
            held.append(int(stats["bytes_in_use"]) + int(stats["bytes_reserved"]))
        elif stats and "peak_bytes_in_use" in stats:
            held.append(int(stats["peak_bytes_in_use"]))
    return max(held) if held else None


def compiled_memory(compiled, platform):
    """Bytes per device the compiled step plans (measure.planned_gib: the plan --compile_for and --fit read)."""
    try:
        return int(measure.planned_gib(compiled.memory_analysis(), platform) * measure.GiB)
    except Exception:
        return None


def run_benchmark(args, cfg, argv):
    n_mesh = cfg.run.dims.n_devices
    mesh = sharding.run_mesh(cfg.run)
    device_kind = jax.devices()[0].device_kind
    say = lambda line: print(line, file=sys.stderr, flush=True)     # stdout: the JSON line alone
    t = time.perf_counter()
    cfg, plan = fit.settle_auto_remat(cfg, mesh, say)                # main.py's choice, with the step it compiled
    step, make_state, make_batch, abstract_args = build_step(cfg, mesh)
    compiled = plan.trainer.step if plan else fit.compile_step(step, abstract_args(), cfg, mesh, argv, say,
                                                                "python bench.py")
    compile_s = time.perf_counter() - t
    if args.dump_hlo:
        with open(args.dump_hlo, "w") as f:
            f.write(compiled.as_text())

    batch = make_batch(cfg.run.seed + 1)
    try:
        state, stats, times = time_steps(compiled, make_state(cfg.run.seed), batch, args)
    except jax.errors.JaxRuntimeError as e:
        raise fit.runtime_out_of_memory(e, "the benchmark's steps ran") or e from None
    held = peak_memory(mesh.devices.flat)       # before anything else runs (the matmul below reserves its own)

    profile = profile_steps(compiled, state, batch, args.steps, args.profile) if args.profile else None

    tokens_per_step = utils.sequences_per_step(cfg) * cfg.model.T
    median = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    tok_s = tokens_per_step / median
    fpt = sharding.flops_per_token(cfg.model)
    spec_peak = hardware.peak_flops(device_kind)
    measured_peak, matmul_shape = matmul_peak(jax.devices()[0], args.matmul_size)
    counts = sharding.count_params(cfg.model)
    return {
        "preset": args.preset, "mesh": list(cfg.run.dims.shape), "devices": n_mesh, "device_kind": device_kind,
        "backend": jax.default_backend(), "jax_version": jax.__version__,
        "model_dtype": cfg.model.model_dtype, "remat": cfg.model.remat,
        "global_batch": utils.global_batch(cfg), "T": cfg.model.T,
        "micro_batches": cfg.run.micro_batch_size, "grad_step": cfg.optim.grad_step,
        "tokens_per_step": tokens_per_step, "steps": args.steps, "warmup": args.warmup,
        "tokens_per_s": tok_s, "step_time_median_s": median,
        "step_time_spread": {"min": min(times), "max": max(times), "p25": q[0], "p75": q[2]},
        "compile_s": compile_s, "flops_per_token": fpt,
        "mfu": hardware.mfu(tok_s, fpt, n_mesh, spec_peak), "spec_peak_flops": spec_peak,
        "mfu_vs_measured_peak": hardware.mfu(tok_s, fpt, n_mesh, measured_peak),
        "matmul_peak_flops": measured_peak, "matmul_shape": matmul_shape,
        "peak_memory_bytes": held,
        "compiled_memory_bytes": compiled_memory(compiled, jax.devices()[0].platform),
        "hlo_matmul_flops_per_device_step": (hlo.matmul_flops(compiled.as_text()) or {}).get("total"),
        "params_total": counts["total"], "params_active": counts["active"],
        "final_loss": float(stats["loss"]),
        **({"profile": profile} if profile else {}),
    }


def time_steps(compiled, state, batch, args):
    """(state, the last step's stats, the seconds of each of --steps steps) after --warmup untimed ones."""
    stats = None
    for _ in range(args.warmup):
        state, stats = compiled(state, batch)
    jax.block_until_ready((state, stats) if args.warmup else state)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, stats = compiled(state, batch)
        jax.block_until_ready((state, stats))
        times.append(time.perf_counter() - t)
    return state, stats, times


def profile_steps(compiled, state, batch, steps, trace_dir):
    """`steps` more training steps under jax.profiler.trace(trace_dir), kept apart from the timed ones
    (tracing slows the host side). Returns the trace's path, its largest device ops' times per step, the
    step's time by seam (`by_seam`) and the path of trace_dir/kernels.json, which holds every op's
    (`kernel_times`)."""
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            state, stats = compiled(state, batch)
        jax.block_until_ready((state, stats))
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    kernels = kernel_times(path, steps)
    with open(os.path.join(trace_dir, "kernels.json"), "w") as f:
        json.dump({"steps": steps, "kernels": kernels}, f)
    all_ms = sum(k["ms_per_step"] for k in kernels) or 1.0
    return {"trace": path, "steps": steps, "kernels": os.path.join(trace_dir, "kernels.json"), "ops_ms": all_ms,
            "by_seam": by_seam(kernels, hlo.op_names(compiled.as_text())),
            "top_ops": [[k["name"], k["ms_per_step"], k["ms_per_step"] / all_ms] for k in kernels[:30]]}


def kernel_times(xplane_path, steps):
    """[{"name", "hlo_op", "launches", "ms_per_step"}, ...], largest first: the trace's device ops summed by
    the HLO instruction they ran for (their hlo_op, which XLA's kernels and copies carry; else their
    name), over the device planes: a TPU plane's "XLA Ops" line, or where a plane has none (GPU) all its
    lines, one per stream. A CPU trace has no device plane; there the host's thunks, which carry their
    hlo_op too, stand in. An op's time is its own: where ops nest on a line (a TPU's while loop holds its
    body's ops, a CPU's loop thunk its body's thunks) the ops inside are taken off the op around them, so
    a loop counts only the time between its body's ops and the ops sum to the time the line was busy."""
    totals, launches, names = collections.Counter(), collections.Counter(), {}
    data = jax.profiler.ProfileData.from_file(xplane_path)
    device = [plane for plane in data.planes if plane.name.startswith("/device:")]
    lines = [line for plane in device for line in ([line for line in plane.lines if line.name == "XLA Ops"] or plane.lines)]
    for line in lines or [line for plane in data.planes for line in plane.lines]:
        ops = [(event, dict(event.stats).get("hlo_op") or _instruction(event.name)) for event in line.events]
        ops = [(event, hlo_op) for event, hlo_op in ops if lines or event.name == hlo_op]
        for (event, hlo_op), own_ns in zip(ops, _own_times([(e.start_ns, e.duration_ns) for e, _ in ops])):
            key = hlo_op or event.name
            totals[key] += own_ns
            launches[key] += 1
            names.setdefault(key, (event.name, hlo_op))
    return [{"name": names[key][0], "hlo_op": names[key][1], "launches": launches[key] / steps,
             "ms_per_step": ns / 1e6 / steps} for key, ns in totals.most_common()]


def _instruction(event_name):
    """The instruction an event ran for where its name is the instruction's HLO text (a TPU's XLA ops:
    "%fusion.12 = bf16[...] fusion(...)"); else None."""
    m = re.match(r"%([\w.\-]+) = ", event_name)
    return m.group(1) if m else None


def _own_times(spans):
    """Each (start, duration) span's time less that of the spans directly inside it."""
    own = [duration for _, duration in spans]
    open_spans = []                                  # indices of the spans around the current one, innermost last
    for i in sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1])):
        start, duration = spans[i]
        while open_spans and sum(spans[open_spans[-1]]) <= start:
            open_spans.pop()
        if open_spans:
            own[open_spans[-1]] -= duration
        open_spans.append(i)
    return own


# bench.py --profile's groups, in the order a kernel is given to the first whose named scope it carries: the
# engine's seams (engine.SEAM_SCOPES) and the optimizer's update (trainer.train_step); "other" for the rest.
SEAM_GROUPS = ("attention", "experts", "cross_entropy", "optimizer", "products")


def by_seam(kernels, names):
    """{group: ms per step} of kernel_times' rows, by the named scopes in their instructions' op_names (`names`,
    hlo.op_names: the instruction's own, a fusion's its root's, first): SEAM_GROUPS' first that its own carries,
    else the first that any fused op's carries, else "other". The own name first: a fused op may carry a place
    not its kernel's (a jitted helper's lowering keeps the path of the place it was first traced, the optimizer's
    nanmedian in the products' gradient fusions: 18.6 ms of a v5e's products went to the optimizer)."""
    groups = dict.fromkeys(SEAM_GROUPS + ("other",), 0.0)

    def group(op_names):
        scopes = {part for name in op_names for part in _scope_path(name)}
        return next((g for g in SEAM_GROUPS if g in scopes), None)
    for k in kernels:
        op_names = names.get(k["hlo_op"], [])
        groups[group(op_names[:1]) or group(op_names) or "other"] += k["ms_per_step"]
    return groups


def _scope_path(op_name):
    """An op_name's scopes, "jit(step)/jvp()/attention/dot_general" -> ["jit", "step", "jvp", "attention", ...],
    up to where its first one comes again: a jitted helper's lowering, reused from where it was first traced,
    brings that place's path after its own (the dropout's under "optimizer", where nanmedian's was first)."""
    top = op_name.split("/", 1)[0]
    own = op_name.split("/" + top + "/", 1)[0]
    return [part for part in re.split(r"[/()]", own) if part]


def print_op_times(profile, step_s, out):
    step_ms = 1e3 * step_s
    print(f"device op time per step over {profile['steps']} traced steps ({profile['trace']}; every op's in "
          f"{profile['kernels']}): {profile['ops_ms']:.1f} ms, {100 * profile['ops_ms'] / step_ms:.0f}% of the "
          f"timed step's {step_ms:.1f} ms", file=out)
    print("  by seam: " + ", ".join(f"{g} {ms:.1f} ms ({100 * ms / profile['ops_ms']:.0f}%)"
                                    for g, ms in profile["by_seam"].items()), file=out)
    for name, ms, share in profile["top_ops"]:
        print(f"  {ms:9.3f} ms  {100 * share:5.1f}%  {name[:120]}", file=out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args, cfg = parse_args(argv)
    multihost.set_up_devices(cfg)
    utils.validate(cfg, jax.device_count())
    if args.grad_error:
        result = {"preset": args.preset, **grad_error(cfg, args.tokens)}
    elif args.pipeline_flops:
        result = {"preset": args.preset, **pipeline_flops(cfg)}
    else:
        try:
            result = run_benchmark(args, cfg, argv)
        except fit.OutOfMemory as e:
            sys.exit(f"error: {e}")
    if args.pipeline_flops:
        print_pipeline_table(result, sys.stderr)
    if "profile" in result:
        print_op_times(result["profile"], result["step_time_median_s"], sys.stderr)
    print(json.dumps(result), flush=True)
    if args.grad_error and cfg.model.model_dtype != "float32" and result["ratio"] > GRAD_ERROR_SLACK:
        sys.exit(f"the gradient on {tuple(result['mesh'])} is {result['ratio']:.2f}x one device's error "
                 f"(bound {GRAD_ERROR_SLACK})")
    return result


if __name__ == "__main__":
    main()
