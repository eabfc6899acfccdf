"""The `--compile_for` report: compile main.py's training and eval steps (and the task-scoring step when
--eval_tasks names any) for a TPU slice, or for H200s, on this machine, and print what each plans.

`python main.py --preset moe1B --compile_for v4-64` needs no TPU: libtpu's ahead-of-time compiler
(`pip install -r requirements-tpu.txt`) compiles for a TPU topology on a CPU (as MaxText's
train_compile does), so a config's per-chip memory plan, FLOPs and compile time are known before a
pod is rented, with the bytes each chip moves in collectives per step (`collective_bytes`, counted
from the compiled HLO). The mesh comes from `ParallelDims.build_mesh` over the topology's devices, the same function
and device order a real run on that slice uses (planning/measure.py); the steps are `trainer.build_trainer`'s,
the ones main.py runs. Nothing is trained and nothing is written.

`--compile_for h200` (h200-N: N on one host) does the same with XLA:GPU (jax-cuda12-plugin,
requirements-gpu-aot.txt) given XLA's H200 description, and estimates the step time from the
compiled kernels (planning/step_time.py, calibrated on measured H200 steps:
docs/performance-log.md#2026-12-03-h200-estimate-band).

Exit status: 0 the steps fit in the chip's HBM, 1 they do not (one line says by how much),
2 the request is unusable (unknown target, invalid config, the compiler missing). main.py imports this
module only for --compile_for (tests/test_layout.py).
"""
import importlib
import importlib.util
import sys
import threading
import time

import jax

import hardware
import hlo
import sharding
import utils
from planning import fit, measure, step_time, tradeoffs
from trainer import abstract_step_args, build_trainer

PIP_COMMAND = "pip install -r requirements-tpu.txt"
PIP_COMMAND_GPU = "python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -r requirements-gpu-aot.txt"
GiB = 2**30
HFU_ASSUMED = 0.4                   # a good MoE run's share of the peak, for the second TPU step-time estimate
# What a TPU host sends across slices (DCN) a second, for the DCN time of --compile_for NxSLICE: an assumed
# 100 Gb/s NIC a host; the time scales inversely with a host's real rate.
DCN_BYTES_PER_S_PER_HOST = 12.5e9


def compile_for(cfg, argv=()):
    """`python main.py ... --compile_for TARGET`: the report, and its exit status. argv: the command line, for the
    command a fitting setting prints (`plan_a_fit`)."""
    target = hardware.compile_target(cfg.run.compile_for)
    if target is None:
        return _usage(f"--compile_for {cfg.run.compile_for!r} is not a target this knows. TPU slices: "
                      + ", ".join(t.name for t in hardware.tpu_slices()) + " (NxSLICE: N of one over DCN, e.g. "
                      "2xv4-32); GPUs: "
                      + ", ".join(g.name for g in hardware.gpu_targets()))
    gpu = isinstance(target, hardware.GpuTarget)
    compiler, install = ("jax_plugins.xla_cuda12", PIP_COMMAND_GPU) if gpu else ("libtpu", PIP_COMMAND)
    if importlib.util.find_spec(compiler.split(".")[0]) is None or importlib.util.find_spec(compiler) is None:
        return _usage(f"--compile_for {target.name} needs {'XLA:GPU (jax-cuda12-plugin)' if gpu else 'libtpu'}'s "
                      f"ahead-of-time compiler, which is not installed; run: {install}")
    if target.slices > 1 and cfg.run.n_slices == 1:      # NxSLICE: the run spans N slices (--n_slices N)
        cfg = utils.override(cfg, n_slices=target.slices)
    if target.slices == 1 and cfg.run.n_slices > 1:      # (several slices: utils.check_slices below)
        slices = (f"; {cfg.run.n_slices} slices over DCN are --compile_for {cfg.run.n_slices}x{target.name}"
                  if isinstance(target, hardware.TpuSlice) else "")
        return _usage(f"--n_slices ({cfg.run.n_slices}) must be 1: --compile_for {target.name} is one slice{slices}")
    try:
        utils.check_slices(utils.validate(cfg, target.chips), target.hosts, target.slices)
    except utils.ConfigError as e:
        return _usage(f"{e}\n(compiling for {target.name}: {target.chips} chips on {target.hosts} host(s))")
    if gpu:
        measure.compile_only_cuda()
    else:
        measure.compile_only_libtpu(target)
    cfg, _ = fit.settle_auto_remat(cfg, measure.target_mesh(cfg, target), lambda line: print(line, flush=True),
                                   target.hbm_bytes / GiB)            # as a run on the target settles it
    return rehearse(cfg, target, argv)


def _usage(message):
    print(message, file=sys.stderr)
    return 2


def rehearse(cfg, target, argv=(), plan_on_failure=True):
    """Compile cfg's steps for the target, printing the Report of each; the exit status. A train step that does
    not fit goes on to `plan_a_fit` (plan_on_failure), any other step that does not fit is exit 1."""
    mesh = measure.target_mesh(cfg, target)
    trainer = build_trainer(cfg, mesh)
    report = Report(cfg, target, mesh)
    report.header()
    train_args, eval_args = abstract_step_args(cfg, trainer)
    params = {k: trainer.abstract_state[k] for k in ("params", "router_bias")}
    steps = (("train step", trainer.step, train_args, trainer.abstract_state),
             ("eval step", trainer.eval_step, eval_args, params))
    if cfg.run.eval_tasks:                  # the rows of --eval_tasks: tokens, targets and the continuation mask
        # every position through the output layer (window T): the most a batch of task rows can cost
        steps += (("score step", trainer.score_step, (*eval_args, eval_args[-1], cfg.model.T), params),)
    for name, jitted, args, state in steps:
        compiled, needed, wall_s, cpu_s = _compile(jitted, args, f"the {name} for {target.name}")
        if compiled is not None:
            needed = report.step(name, compiled, wall_s, cpu_s, state)
        if needed > target.hbm_bytes / GiB:
            print(f"does not fit: {name} needs {needed:.2f} GiB per chip, {target.name}'s chips have "
                  f"{target.hbm_bytes / GiB:.2f} GiB usable ({needed - target.hbm_bytes / GiB:.2f} GiB short); "
                  f"see docs/launch.md 'Before you rent a pod'")
            return plan_a_fit(cfg, target, argv) if name == "train step" and plan_on_failure else 1
    print(f"fits on {target.name}: {report.summary()}")
    return 0


def plan_a_fit(cfg, target, argv):
    """After the train step does not fit: the settings that trade compute for memory, each compiled
    (planning/tradeoffs.py); the cheapest that fits printed with its command, and with --fit rehearsed (its exit
    status). Exit 1 when none fits or without --fit."""
    usable = target.hbm_bytes / GiB
    print("compiling the train step with each setting that trades compute for memory (planning/tradeoffs.py; each "
          "about as long as the compile above):", flush=True)
    plan = lambda c: measure.train_plan(c, measure.target_mesh(c, target))
    chosen, _ = tradeoffs.cheapest_fit(cfg, target.chips, usable, plan, say=lambda line: print(line, flush=True))
    if chosen is None:
        print(f"none of them fits {target.name}: a larger pp or tp, a smaller model or a bigger slice "
              f"(docs/launch.md#when-a-plan-does-not-fit)")
        return 1
    print(f"fits with {tradeoffs.flags(chosen.changes)}: {chosen.gib:.2f} of {usable:.2f} GiB a chip, "
          f"FLOPs {chosen.flops_ratio:.2f}x the model's (the fewest of the settings that fit):")
    print(f"  {tradeoffs.command(argv, chosen.changes)}")
    if not cfg.run.fit:
        print("(--fit rehearses with it here, and a run with --fit trains with it)")
        return 1
    print(f"--fit: rehearsing with {tradeoffs.flags(chosen.changes)}")
    return rehearse(chosen.cfg, target, argv, plan_on_failure=False)


TICK_S = 30                         # while a compile runs, a line this often says it still does


def _compile(jitted, args, what):
    """`compiled_or_shortfall`'s (compiled executable, None) or (None, GiB needed), with the wall and CPU seconds
    to lower and compile, saying so first and every TICK_S seconds while it runs (a large model compiles for minutes with nothing else to show). The
    CPU time is what the compile costs on an otherwise idle machine (the compiler runs mostly on one
    thread); the wall time also counts waiting for cores that other processes hold."""
    print(f"compiling {what} (the guide's moe1B: about a minute on a quiet 2-core CPU, several under load; "
          f"a small model: seconds)", flush=True)
    wall, cpu, done = time.perf_counter(), time.process_time(), threading.Event()

    def tick():
        while not done.wait(TICK_S):
            print(f"  ... still compiling {what}: {time.perf_counter() - wall:.0f} s", flush=True)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        compiled, needed = measure.compiled_or_shortfall(jitted, args)
    finally:
        done.set()
        ticker.join()
    return compiled, needed, time.perf_counter() - wall, time.process_time() - cpu


def _gib(n):
    return f"{n / GiB:6.2f} GiB"


class Report:
    """The printed report: the target and mesh, then each compiled step."""

    def __init__(self, cfg, target, mesh):
        self.cfg, self.target, self.mesh = cfg, target, mesh
        self.planned, self.estimate = {}, None      # GiB per chip of each step; the train step's time, in words
        self.gpu = isinstance(target, hardware.GpuTarget)
        self.peak = hardware.peak_flops(mesh.devices.flat[0].device_kind)
        self.tokens = utils.sequences_per_step(cfg) * cfg.model.T
        self.model_flops = measure.model_flops(cfg, target.chips)

    def header(self):
        target, mesh = self.target, self.mesh
        dims = self.cfg.run.dims
        kind = mesh.devices.flat[0].device_kind
        if self.gpu:
            print(f"target: {target.name} = {target.chips} {kind} GPU(s) on one host (XLA:GPU with XLA's H200 "
                  f"description; no GPU here); memory {target.hbm_bytes / GiB:.2f} GiB per GPU")
            print(f"mesh: {dims.words}")
            return
        crossing = sharding.axes_across_hosts(mesh)
        n = target.slices
        slices = f"{n} slices of " if n > 1 else ""
        print(f"slice: {target.name} = {slices}{target.chips // n} {kind} chips ({target.topology_name}) on {target.hosts} "
              f"host(s) of {target.chips_per_host} chips; usable HBM {target.hbm_bytes / GiB:.2f} GiB per chip")
        print(f"mesh: {dims.words}; crossing hosts: {', '.join(crossing) or 'none (one host)'}")
        for i, plane in enumerate(mesh.devices.reshape(dims.shape)[:min(dims.dp, 4)]):
            hosts = sorted({d.process_index for d in plane.flat})
            coords = " ".join("(" + ",".join(map(str, d.coords)) + ")" for d in plane.flat)
            print(f"  dp {i}: host(s) {','.join(map(str, hosts))}, chips {coords}")
        if dims.dp > 4:
            print(f"  ... {dims.dp - 4} more dp rows")

    def step(self, name, compiled, seconds, cpu_seconds, abstract_state):
        """Print the step's plan; return the GiB it needs per chip."""
        mem, hlo_text = compiled.memory_analysis(), compiled.as_text()   # the text of a big step is megabytes
        state_bytes = sum(measure.shard_bytes(a) for a in jax.tree.leaves(abstract_state))
        inputs = mem.argument_size_in_bytes - state_bytes
        total = measure.planned_gib(mem, self.mesh.devices.flat[0].platform) * GiB
        not_aliased = mem.output_size_in_bytes - mem.alias_size_in_bytes
        temporaries = total - mem.generated_code_size_in_bytes - mem.argument_size_in_bytes - not_aliased
        print(f"{name}: compiled in {seconds:.1f} s ({cpu_seconds:.1f} s of CPU)")
        print(f"  {'memory per GPU' if self.gpu else 'HBM per chip'}: state {_gib(state_bytes)} | batch {_gib(inputs)} | temporaries "
              f"{_gib(temporaries)} | outputs not aliased {_gib(not_aliased)}"
              f" | code {_gib(mem.generated_code_size_in_bytes)} | total {_gib(total)} of "
              f"{self.target.hbm_bytes / GiB:.2f} GiB ({100 * total / self.target.hbm_bytes:.0f}%)")
        print("  largest buffers: " + "; ".join(f"{what} {_gib(size).strip()}"
                                                for what, size in hlo.largest_buffers(hlo_text, 4)))
        if not self.gpu or self.target.chips > 1:
            self._collectives(hlo_text)
        if name == "train step":
            if self.gpu:
                self._gpu_step_time(hlo_text)
            else:
                flops = self._flops(hlo.matmul_flops(hlo_text))
                for hfu in (1.0, HFU_ASSUMED):
                    self._speed(f"at HFU {100 * hfu:.0f}%", flops / (hfu * self.peak), flops)
                self.estimate = f"{flops / (HFU_ASSUMED * self.peak) * 1e3:.1f} ms at {100 * HFU_ASSUMED:.0f}% of the peak"
        elif name == "score step":
            self._score_time(hlo.matmul_flops(hlo_text)["total"])
        self.planned[name] = total / GiB
        return total / GiB

    def summary(self):
        """The verdict's line in words: the step that plans the most memory and the training step's time."""
        name, gib = max(self.planned.items(), key=lambda kv: kv[1])
        usable = self.target.hbm_bytes / GiB
        return (f"the {name} plans {gib:.2f} of {usable:.2f} GiB {'a GPU' if self.gpu else 'a chip'} "
                f"({100 * gib / usable:.0f}%), the most of the {len(self.planned)} steps"
                + (f"; a training step estimated at {self.estimate}" if self.estimate else ""))

    def _score_time(self, flops):
        """What scoring --eval_tasks costs: a step's FLOPs per chip and time at HFU_ASSUMED, per row."""
        rows, seconds = self.cfg.run.val_batch_size, flops / (HFU_ASSUMED * self.peak)
        print(f"  FLOPs per chip per step (compiled HLO): {flops:.3e}; at HFU {100 * HFU_ASSUMED:.0f}%: "
              f"{seconds * 1e3:.4g} ms a step of {rows} task rows (--val_batch_size), {seconds / rows * 1e3:.4g} ms "
              f"a row of --T {self.cfg.model.T} tokens")

    def _collectives(self, hlo_text):
        counted = hlo.collective_bytes(hlo_text)
        within = " within a slice (ICI)" if self.target.slices > 1 else ""
        print(f"  collectives per chip per step{within} (compiled HLO, loops x trip counts; bytes: each op's full-size "
              "buffer on the chip, sent: a ring's share of it, docs/performance-log.md#2026-11-30-collective-bytes-issue-18):")
        for kind, c in counted.items():
            print(f"    {kind:<19} {c['count']:>7,} ops {_gib(c['bytes'])} {_gib(c['link_bytes'])} sent")
        print(f"    {'total':<19} {sum(c['count'] for c in counted.values()):>7,} ops "
              f"{_gib(sum(c['bytes'] for c in counted.values()))} "
              f"{_gib(sum(c['link_bytes'] for c in counted.values()))} sent")
        if self.target.slices > 1:
            self._dcn(hlo.dcn_bytes(hlo_text))

    def _dcn(self, counted):
        """What crosses slices (megascale's transfers over DCN): per chip, and the time at a host's rate."""
        n, per_host = self.target.slices, self.target.chips_per_host
        share = lambda kind: 2 * (n - 1) / n if kind == "ALL_REDUCE" else (n - 1) / n     # a ring over n slices
        sent = sum(c["bytes"] * share(kind) for kind, c in counted.items())
        print("  across slices per chip per step (DCN: megascale's transfers in the compiled HLO, TPU tile padding "
              "included):")
        for kind, c in counted.items():
            print(f"    {kind.lower().replace('_', '-'):<19} {c['count']:>7,} ops {_gib(c['bytes'])} "
                  f"{_gib(c['bytes'] * share(kind))} sent")
        print(f"    at {DCN_BYTES_PER_S_PER_HOST * 8 / 1e9:.0f} Gb/s a host ({per_host} chips' {_gib(sent * per_host).strip()}"
              f"): {sent * per_host / DCN_BYTES_PER_S_PER_HOST * 1e3:.0f} ms a step, unless it overlaps the backward")

    def _flops(self, counted, census=None):
        """Print the compiled FLOPs per chip against the model's; return them. On a GPU they are the kernel
        census's: the dots', cuBLAS calls' and cuDNN attention's, whose FLOPs no dot shows."""
        flops = census["flops"] if census else counted["total"]
        kinds = census["kinds"] if census else {}
        attention = {k.removeprefix("custom-call:__cudnn$"): v["flops"] for k, v in kinds.items() if k.startswith("custom-call:__cudnn")}
        cublas = sum(v["flops"] for k, v in kinds.items() if k.startswith("custom-call:__cublas"))
        print(f"  FLOPs per chip per step (compiled HLO, loops x trip counts): {flops:.3e} (output layer "
              f"{counted['output_layer']:.2e}, blocks {counted['blocks'] + counted['unattributed']:.2e}"
              + (f", cuBLAS calls {cublas:.2e}" if cublas else "")
              + "".join(f", cuDNN {k} {f:.2e}" for k, f in sorted(attention.items())) + "); "
              f"model FLOPs {self.model_flops:.3e} ({100 * self.model_flops / flops:.0f}% of the compiled work)")
        by_dtype = census["by_dtype"] if census else counted["by_dtype"]
        print("  matmul FLOPs by operand dtype: " + ", ".join(
            f"{kind} {100 * f / flops:.2f}% ({f:.2e})" for kind, f in sorted(by_dtype.items(), key=lambda kv: -kv[1])))
        return flops

    def _speed(self, label, seconds, flops, band=None):
        """One step-time line with tokens/s, MFU (model FLOPs) and HFU (compiled FLOPs) of the datasheet's bf16
        peak, as MaxText, Megatron and NeMo report them; on a GPU also of the GEMM rate measured on an H200.
        band: (low, high) seconds, printed beside the step and as MFU and HFU ranges."""
        ratio = lambda f, peak: f"{100 * f / (seconds * peak):.1f}%" + (
            f" ({100 * f / (band[1] * peak):.1f}-{100 * f / (band[0] * peak):.1f}%)" if band else "")
        measured = (f"; of the measured {step_time.GPU_GEMM_FLOPS / 1e12:.0f} TFLOP/s GEMM rate: MFU "
                    f"{ratio(self.model_flops, step_time.GPU_GEMM_FLOPS)}, HFU {ratio(flops, step_time.GPU_GEMM_FLOPS)}" if self.gpu else "")
        print(f"  {label}: step {seconds * 1e3:.1f} ms" + (f" (band {band[0] * 1e3:.1f}-{band[1] * 1e3:.1f} ms)" if band else "")
              + f", {self.tokens / seconds:,.0f} tokens/s ({self.tokens:,} tokens a step), MFU "
              f"{ratio(self.model_flops, self.peak)}, HFU {ratio(flops, self.peak)} of the {self.peak / 1e12:.0f} TFLOP/s "
              f"datasheet bf16 peak{measured}")

    def _gpu_step_time(self, hlo_text):
        census = hlo.kernel_census(hlo_text, step_time.GPU_GEMM_FLOPS, self.target.hbm_bandwidth)
        flops = self._flops(hlo.matmul_flops(hlo_text), census)
        print(f"  kernels per step {census['kernels']:,}; HBM traffic {census['bytes'] / GiB:,.1f} GiB "
              f"(operands + results of each kernel); by kernel kind:")
        for kind, k in sorted(census["kinds"].items(), key=lambda kv: -kv[1]["bytes"])[:12]:
            print(f"    {kind:<40} {k['count']:>8,.0f} kernels {k['bytes'] / GiB:9.1f} GiB "
                  f"{100 * k['bytes'] / census['bytes']:5.1f}%" + (f" {k['flops']:.2e} FLOPs" if k["flops"] else ""))
        if census["uncounted"]:
            print("  FLOPs not known (bytes only): " + ", ".join(f"{n:,} {k}" for k, n in census["uncounted"].items()))
        seconds = step_time.class_seconds(census)
        print(f"  roofline sum over kernels of max(FLOPs / {step_time.GPU_GEMM_FLOPS / 1e12:.0f} TFLOP/s (fp32 operands: half), bytes / "
              f"{self.target.hbm_bandwidth / 1e12:.1f} TB/s) = {census['roofline_s'] * 1e3:.1f} ms: GEMMs "
              f"{seconds['gemm'] * 1e3:.1f} ms, cuDNN attention {seconds['attention'] * 1e3:.1f} ms, memory-bound "
              f"{seconds['memory'] * 1e3:.1f} ms" + (" (collectives counted as memory-bound: not calibrated)"
                                                    if self.target.chips > 1 else ""))
        try:
            calibration = step_time.load_calibration()
        except (OSError, ValueError) as e:
            print(f"  no step-time estimate: the calibration {step_time.H200_CALIBRATION} is unreadable ({e})")
            return
        point, low, high, used, band = step_time.estimate(seconds, census["kernels"], calibration["runs"])
        overhead = (f"{used['per_kernel'] * 1e6:.2g} µs per kernel" if "per_kernel" in used else
                    f"{used['per_step'] * 1e3:.3g} ms per step")
        print(f"  calibration ({used['form']}): GEMMs x {used['factors']['gemm']:.3g}, attention x "
              f"{used['factors']['attention']:.3g}, memory-bound x {used['factors']['memory']:.3g}, {overhead}; the band: "
              f"{len(band)} fits of {len({c['form'] for c in band})} forms, each timed step held out in turn "
              f"(docs/performance-log.md#2026-12-03-h200-estimate-band)")
        print(f"  calibrated on: {step_time.calibrated_on(calibration)}")
        self._speed("estimated on an H200", point, flops, band=(low, high))
        self.estimate = f"{point * 1e3:.1f} ms (band {low * 1e3:.1f}-{high * 1e3:.1f} ms)"

