"""Pod rehearsal: compile main.py's training and eval steps for a TPU slice, or for H200s, on this machine.

`python main.py --preset moe1B --compile_for v4-64` needs no TPU: libtpu's ahead-of-time compiler
(`pip install -r requirements-tpu.txt`) compiles for a TPU topology on a CPU (as MaxText's
train_compile does), so a config's per-chip memory plan, FLOPs and compile time are known before a
pod is rented, with the bytes each chip moves in collectives per step (`collective_bytes`, counted
from the compiled HLO). The mesh comes from `sharding.make_mesh` over the topology's devices, the same function
and device order a real run on that slice uses; the steps are `trainer.build_trainer`'s, the ones
main.py runs. Nothing is trained and nothing is written.

`--compile_for h200` (h200-N: N on one host) does the same with XLA:GPU (jax-cuda12-plugin,
requirements-gpu-aot.txt) given XLA's H200 description, and estimates the step time from the
compiled kernels (`hlo.kernel_census`, calibrated on measured H200 steps: docs/performance.md).

Exit status: 0 the steps fit in the chip's HBM, 1 they do not (one line says by how much),
2 the request is unusable (unknown target, invalid config, the compiler missing).
"""
import importlib
import importlib.util
import math
import os
import re
import sys
import threading
import time

import jax
from jax.experimental import topologies

import hlo
import sharding
import utils
from trainer import abstract_step_args, build_trainer

PIP_COMMAND = "pip install -r requirements-tpu.txt"
PIP_COMMAND_GPU = "python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -r requirements-gpu-aot.txt"
GiB = 2**30
HFU_ASSUMED = 0.4                   # a good MoE run's share of the peak, for the second TPU step-time estimate
# The H200 estimate: the roofline's rates and the fit of measured steps to it (docs/performance.md
# 'The H200 estimate': five measured moe1B runs, within 2.3%).
GPU_GEMM_FLOPS = 779e12             # bf16 GEMM FLOP/s measured on an H200 (8192^3; its datasheet says 989)
STEP_PER_ROOFLINE = 1.695
LAUNCH_SECONDS = 1.6e-6             # per kernel
H200_COMPUTE_CAPABILITY = (9, 0)
# XLA's H200 target description (the fields jaxlib 0.10.2 reads), so XLA:GPU compiles with no GPU present.
H200_DESCRIPTION = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H200"
"""


def main(cfg):
    target = utils.compile_target(cfg.run.compile_for)
    if target is None:
        return _usage(f"--compile_for {cfg.run.compile_for!r} is not a target this knows. TPU slices: "
                      + ", ".join(t.name for t in utils.tpu_slices()) + "; GPUs: "
                      + ", ".join(g.name for g in utils.gpu_targets()))
    gpu = isinstance(target, utils.GpuTarget)
    compiler, install = ("jax_plugins.xla_cuda12", PIP_COMMAND_GPU) if gpu else ("libtpu", PIP_COMMAND)
    if importlib.util.find_spec(compiler.split(".")[0]) is None or importlib.util.find_spec(compiler) is None:
        return _usage(f"--compile_for {target.name} needs {'XLA:GPU (jax-cuda12-plugin)' if gpu else 'libtpu'}'s "
                      f"ahead-of-time compiler, which is not installed; run: {install}")
    try:
        utils.validate(cfg, target.chips)
    except utils.ConfigError as e:
        return _usage(f"{e}\n(compiling for {target.name}: {target.chips} chips on {target.hosts} host(s))")
    if gpu:
        _compile_only_cuda()
    else:
        _compile_only_libtpu(target)
    return rehearse(cfg, target)


def _usage(message):
    print(message, file=sys.stderr)
    return 2


def _compile_only_libtpu(tpu):
    """jax on the CPU backend with libtpu loaded only as a compiler: no TPU runtime starts, several
    processes may load libtpu at once, and libtpu is told what it would otherwise look up on a TPU VM
    (it prints warnings without them; nothing here queries a server)."""
    jax.config.update("jax_platforms", "cpu")     # jax is imported already: $JAX_PLATFORMS would come too late
    for name, value in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                        ("TPU_ACCELERATOR_TYPE", tpu.name), ("TPU_WORKER_HOSTNAMES", "localhost")):
        os.environ.setdefault(name, value)


def _compile_only_cuda():
    """jax on the CPU backend with XLA:GPU as a compiler only. JAX's cuDNN attention asks the local GPU
    whether it is a Hopper before it emits the fused kernel; there is none here, so the answer comes
    from the target (compute capability 9.0)."""
    jax.config.update("jax_platforms", "cpu")
    from jax._src.cudnn import fused_attention_stablehlo
    fused_attention_stablehlo.check_compute_capability = lambda capability: (
        tuple(map(int, capability.split("."))) <= H200_COMPUTE_CAPABILITY)


def target_devices(target):
    """The target's devices: a TPU slice's as libtpu describes them (ids, host, chip coords), or N
    H200s on one host as XLA:GPU's target description gives them."""
    if isinstance(target, utils.GpuTarget):
        return topologies.get_topology_desc(platform="cuda", topology=f"1x1x{target.chips}",
                                            target_config=H200_DESCRIPTION).devices
    return topology_devices(target)


def topology_devices(tpu):
    """The slice's devices as libtpu describes them: ids, host (process_index), chip coords."""
    return topologies.get_topology_desc(
        platform="tpu", topology_name=tpu.topology_name, chip_config_name=tpu.chip_config,
        chips_per_host_bounds=tpu.host_grid, num_slices=1, wrap=(False,) * 3).devices


def rehearse(cfg, target):
    mesh = sharding.make_mesh(cfg.run.n_device_axis, target_devices(target))
    trainer = build_trainer(cfg, mesh)
    report = Report(cfg, target, mesh)
    report.header()
    train_args, eval_args = abstract_step_args(cfg, trainer)
    steps = (("train step", trainer.step, train_args, trainer.abstract_state),
             ("eval step", trainer.eval_step, eval_args,
              {k: trainer.abstract_state[k] for k in ("params", "router_bias")}))
    for name, jitted, args, state in steps:
        try:
            needed = report.step(name, *_compile(jitted, args, f"the {name} for {target.name}"), state)
        except Exception as e:               # noqa: BLE001 - libtpu reports some plans that do not fit so
            needed = _hbm_shortfall(str(e))
            if needed is None:
                raise
        if needed > target.hbm_bytes / GiB:
            print(f"does not fit: {name} needs {needed:.2f} GiB per chip, {target.name}'s chips have "
                  f"{target.hbm_bytes / GiB:.2f} GiB usable ({needed - target.hbm_bytes / GiB:.2f} GiB short); "
                  f"see docs/launch.md 'Before you rent a pod'")
            return 1
    print(f"fits on {target.name}")
    return 0


TICK_S = 30                         # while a compile runs, a line this often says it still does


def _compile(jitted, args, what):
    """(compiled executable, wall seconds, CPU seconds) to lower and compile, saying so first and every
    TICK_S seconds while it runs (a large model compiles for minutes with nothing else to show). The
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
        compiled = jitted.lower(*args).compile()
    finally:
        done.set()
        ticker.join()
    return compiled, time.perf_counter() - wall, time.process_time() - cpu


def _hbm_shortfall(message):
    """GiB needed per chip from libtpu's out-of-HBM error, or None for any other error."""
    m = re.search(r"\(([\d.]+)([GMK])\) exceeds available HBM", message)
    if not m or "RESOURCE_EXHAUSTED" not in message:
        return None
    return float(m.group(1)) * {"G": 1.0, "M": 2.0**-10, "K": 2.0**-20}[m.group(2)]


def _gib(n):
    return f"{n / GiB:6.2f} GiB"


class Report:
    """The printed report: the target and mesh, then each compiled step."""

    def __init__(self, cfg, target, mesh):
        self.cfg, self.target, self.mesh = cfg, target, mesh
        self.gpu = isinstance(target, utils.GpuTarget)
        self.peak = utils.peak_flops(mesh.devices.flat[0].device_kind)
        self.tokens = utils.sequences_per_step(cfg) * cfg.model.T
        self.model_flops = sharding.flops_per_token(cfg.model) * self.tokens / target.chips    # per chip

    def header(self):
        target, mesh = self.target, self.mesh
        dp, pp, tp = self.cfg.run.n_device_axis
        kind = mesh.devices.flat[0].device_kind
        if self.gpu:
            print(f"target: {target.name} = {target.chips} {kind} GPU(s) on one host (XLA:GPU with XLA's H200 "
                  f"description; no GPU here); memory {target.hbm_bytes / GiB:.2f} GiB per GPU")
            print(f"mesh: dp={dp} pp={pp} tp={tp}")
            return
        crossing = sharding.axes_across_hosts(mesh)
        print(f"slice: {target.name} = {target.chips} {kind} chips ({target.topology_name}) on {target.hosts} "
              f"host(s) of {math.prod(target.host_grid)} chips; usable HBM {target.hbm_bytes / GiB:.2f} GiB per chip")
        print(f"mesh: dp={dp} pp={pp} tp={tp}; crossing hosts: {', '.join(crossing) or 'none (one host)'}")
        for i, plane in enumerate(mesh.devices[:min(dp, 4)]):
            hosts = sorted({d.process_index for d in plane.flat})
            coords = " ".join("(" + ",".join(map(str, d.coords)) + ")" for d in plane.flat)
            print(f"  dp {i}: host(s) {','.join(map(str, hosts))}, chips {coords}")
        if dp > 4:
            print(f"  ... {dp - 4} more dp rows")

    def step(self, name, compiled, seconds, cpu_seconds, abstract_state):
        """Print the step's plan; return the GiB it needs per chip."""
        mem, hlo_text = compiled.memory_analysis(), compiled.as_text()   # the text of a big step is megabytes
        state_bytes = sum(_shard_bytes(a) for a in jax.tree.leaves(abstract_state))
        inputs = mem.argument_size_in_bytes - state_bytes
        total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                 + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
        print(f"{name}: compiled in {seconds:.1f} s ({cpu_seconds:.1f} s of CPU)")
        print(f"  {'memory per GPU' if self.gpu else 'HBM per chip'}: state {_gib(state_bytes)} | batch {_gib(inputs)} | temporaries "
              f"{_gib(mem.temp_size_in_bytes)} | outputs not aliased {_gib(mem.output_size_in_bytes - mem.alias_size_in_bytes)}"
              f" | code {_gib(mem.generated_code_size_in_bytes)} | total {_gib(total)} of "
              f"{self.target.hbm_bytes / GiB:.2f} GiB ({100 * total / self.target.hbm_bytes:.0f}%)")
        print("  largest buffers: " + "; ".join(f"{what} {_gib(size).strip()}"
                                                for what, size in hlo.largest_buffers(hlo_text, 4)))
        if not self.gpu or self.target.chips > 1:
            self._collectives(hlo_text)
        if name == "train step":
            flops = self._flops(hlo_text)
            if self.gpu:
                self._gpu_step_time(hlo_text, flops)
            else:
                for hfu in (1.0, HFU_ASSUMED):
                    self._speed(f"at HFU {100 * hfu:.0f}%",
                                flops / (hfu * self.peak), flops)
        return total / GiB

    def _collectives(self, hlo_text):
        counted = hlo.collective_bytes(hlo_text)
        print("  collectives per chip per step (compiled HLO, loops x trip counts; bytes: each op's full-size "
              "buffer on the chip, sent: a ring's share of it, docs/performance.md 'Collective bytes'):")
        for kind, c in counted.items():
            print(f"    {kind:<19} {c['count']:>7,} ops {_gib(c['bytes'])} {_gib(c['link_bytes'])} sent")
        print(f"    {'total':<19} {sum(c['count'] for c in counted.values()):>7,} ops "
              f"{_gib(sum(c['bytes'] for c in counted.values()))} "
              f"{_gib(sum(c['link_bytes'] for c in counted.values()))} sent")

    def _flops(self, hlo_text):
        """Print the compiled matmul FLOPs per chip against the model's; return them."""
        counted = hlo.matmul_flops(hlo_text)
        flops = counted["total"]
        print(f"  FLOPs per chip per step (compiled HLO, loops x trip counts): {flops:.3e} (output layer "
              f"{counted['output_layer']:.2e}, blocks {counted['blocks'] + counted['unattributed']:.2e}); "
              f"model FLOPs {self.model_flops:.3e} ({100 * self.model_flops / flops:.0f}% of the compiled work)"
              + ("; FLOPs inside cuDNN attention are not counted" if self.gpu else ""))
        print("  matmul FLOPs by operand dtype: " + ", ".join(
            f"{kind} {100 * f / flops:.2f}% ({f:.2e})" for kind, f in sorted(counted["by_dtype"].items(),
                                                                           key=lambda kv: -kv[1])))
        return flops

    def _speed(self, label, seconds, flops):
        """One step-time line with tokens/s, MFU (model FLOPs) and HFU (compiled FLOPs) over the bf16 peak;
        on a GPU over the GEMM rate measured on an H200 too, as docs/performance.md's H200 MFU is."""
        ratio = lambda f, peak: f"{100 * f / (seconds * peak):.1f}%"
        measured = (f" (of the measured {GPU_GEMM_FLOPS / 1e12:.0f} TFLOP/s GEMM rate: MFU "
                    f"{ratio(self.model_flops, GPU_GEMM_FLOPS)}, HFU {ratio(flops, GPU_GEMM_FLOPS)})" if self.gpu else "")
        print(f"  {label}: step {seconds * 1e3:.4g} ms, {self.tokens / seconds:,.0f} tokens/s "
              f"({self.tokens:,} tokens a step), MFU {ratio(self.model_flops, self.peak)}, HFU {ratio(flops, self.peak)} "
              f"of the {self.peak / 1e12:.0f} TFLOP/s bf16 peak" + measured)

    def _gpu_step_time(self, hlo_text, flops):
        census = hlo.kernel_census(hlo_text, GPU_GEMM_FLOPS, self.target.hbm_bandwidth)
        print(f"  kernels per step {census['kernels']:,}; HBM traffic {census['bytes'] / GiB:,.1f} GiB "
              f"(operands + results of each kernel); by kernel kind:")
        for kind, k in sorted(census["kinds"].items(), key=lambda kv: -kv[1]["bytes"])[:12]:
            print(f"    {kind:<34} {k['count']:>8,.0f} kernels {k['bytes'] / GiB:9.1f} GiB "
                  f"{100 * k['bytes'] / census['bytes']:5.1f}%" + (f" {k['flops']:.2e} FLOPs" if k["flops"] else ""))
        sigma = census["roofline_s"]
        seconds = STEP_PER_ROOFLINE * sigma + LAUNCH_SECONDS * census["kernels"]
        print(f"  roofline sum over kernels of max(FLOPs / {GPU_GEMM_FLOPS / 1e12:.0f} TFLOP/s, bytes / "
              f"{self.target.hbm_bandwidth / 1e12:.1f} TB/s) = {sigma * 1e3:.4g} ms (matmuls at that rate alone: "
              f"{census['flops'] / GPU_GEMM_FLOPS * 1e3:.4g} ms)")
        self._speed(f"estimated on an H200 ({STEP_PER_ROOFLINE} x the roofline sum + {LAUNCH_SECONDS * 1e6:.1f} ms per 1,000 kernels, "
                    "docs/performance.md 'The H200 estimate')", seconds, flops)


def _shard_bytes(abstract):
    """Bytes one device holds of a sharded ShapeDtypeStruct."""
    shape = abstract.sharding.shard_shape(abstract.shape)
    return math.prod(shape) * abstract.dtype.itemsize
