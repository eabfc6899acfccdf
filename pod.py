"""Pod rehearsal: compile main.py's training and eval steps for a TPU slice on this machine.

`python main.py --preset moe1B --compile_for v4-64` needs no TPU: libtpu's ahead-of-time compiler
(`pip install -r requirements-tpu.txt`) compiles for a TPU topology on a CPU (as MaxText's
train_compile does), so a config's per-chip memory plan, FLOPs and compile time are known before a
pod is rented, with the bytes each chip moves in collectives per step (`collective_bytes`, counted
from the compiled HLO). The mesh comes from `sharding.make_mesh` over the topology's devices, the same function
and device order a real run on that slice uses; the steps are `trainer.build_trainer`'s, the ones
main.py runs. Nothing is trained and nothing is written.

Exit status: 0 the steps fit in the chip's HBM, 1 they do not (one line says by how much),
2 the request is unusable (unknown slice, invalid config, libtpu missing).
"""
import importlib
import math
import os
import re
import sys
import time

import jax
from jax.experimental import topologies

import hlo
import model
import sharding
import utils
from trainer import abstract_step_args, build_trainer

PIP_COMMAND = "pip install -r requirements-tpu.txt"
GiB = 2**30
MFU_ASSUMED = 0.4                   # a good MoE run's MFU, for the second step-time estimate


def main(cfg):
    tpu = utils.tpu_slice(cfg.run.compile_for)
    if tpu is None:
        return _usage(f"--compile_for {cfg.run.compile_for!r} is not a TPU slice this knows. Known slices: "
                      + ", ".join(t.name for t in utils.tpu_slices()))
    if not _has_libtpu():
        return _usage(f"--compile_for needs libtpu's ahead-of-time compiler, which is not installed; run: "
                      f"{PIP_COMMAND}")
    try:
        utils.validate(cfg, tpu.chips)
    except utils.ConfigError as e:
        return _usage(f"{e}\n(compiling for {tpu.name}: {tpu.chips} chips on {tpu.hosts} host(s))")
    _compile_only_libtpu(tpu)
    return rehearse(cfg, tpu)


def _has_libtpu():
    try:
        return importlib.import_module("libtpu") is not None
    except ImportError:
        return False


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


def topology_devices(tpu):
    """The slice's devices as libtpu describes them: ids, host (process_index), chip coords."""
    return topologies.get_topology_desc(
        platform="tpu", topology_name=tpu.topology_name, chip_config_name=tpu.chip_config,
        chips_per_host_bounds=tpu.host_grid, num_slices=1, wrap=(False,) * 3).devices


def rehearse(cfg, tpu):
    mesh = sharding.make_mesh(cfg.run.n_device_axis, topology_devices(tpu))
    trainer = build_trainer(cfg, mesh)
    report = Report(cfg, tpu, mesh)
    report.header()
    train_args, eval_args = abstract_step_args(cfg, trainer)
    steps = (("train step", trainer.step, train_args, trainer.abstract_state),
             ("eval step", trainer.eval_step, eval_args,
              {k: trainer.abstract_state[k] for k in ("params", "router_bias")}))
    for name, jitted, args, state in steps:
        try:
            needed = report.step(name, *_compile(jitted, args), state)
        except Exception as e:               # noqa: BLE001 - libtpu reports some plans that do not fit so
            needed = _hbm_shortfall(str(e))
            if needed is None:
                raise
        if needed > tpu.hbm_bytes / GiB:
            print(f"does not fit: {name} needs {needed:.2f} GiB per chip, {tpu.name}'s chips have "
                  f"{tpu.hbm_bytes / GiB:.2f} GiB usable ({needed - tpu.hbm_bytes / GiB:.2f} GiB short); "
                  f"see docs/launch.md 'Before you rent a pod'")
            return 1
    print(f"fits on {tpu.name}")
    return 0


def _compile(jitted, args):
    """(compiled executable, wall seconds, CPU seconds) to lower and compile. The CPU time is what the
    compile costs on an otherwise idle machine (the compiler runs mostly on one thread); the wall
    time also counts waiting for cores that other processes hold."""
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = jitted.lower(*args).compile()
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
    """The printed report: the slice and mesh, then each compiled step."""

    def __init__(self, cfg, tpu, mesh):
        self.cfg, self.tpu, self.mesh = cfg, tpu, mesh

    def header(self):
        tpu, mesh = self.tpu, self.mesh
        dp, pp, tp = self.cfg.run.n_device_axis
        kind = mesh.devices.flat[0].device_kind
        crossing = sharding.axes_across_hosts(mesh)
        print(f"slice: {tpu.name} = {tpu.chips} {kind} chips ({tpu.topology_name}) on {tpu.hosts} host(s) of "
              f"{math.prod(tpu.host_grid)} chips; usable HBM {tpu.hbm_bytes / GiB:.2f} GiB per chip")
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
        print(f"  HBM per chip: state {_gib(state_bytes)} | batch {_gib(inputs)} | temporaries "
              f"{_gib(mem.temp_size_in_bytes)} | outputs not aliased {_gib(mem.output_size_in_bytes - mem.alias_size_in_bytes)}"
              f" | code {_gib(mem.generated_code_size_in_bytes)} | total {_gib(total)} of "
              f"{self.tpu.hbm_bytes / GiB:.2f} GiB ({100 * total / self.tpu.hbm_bytes:.0f}%)")
        print("  largest buffers: " + "; ".join(f"{what} {_gib(size).strip()}"
                                                for what, size in hlo.largest_buffers(hlo_text, 4)))
        self._collectives(hlo_text)
        if name == "train step":
            self._flops(hlo_text)
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
        cfg, tpu = self.cfg, self.tpu
        counted = hlo.matmul_flops(hlo_text)
        peak = utils.peak_flops(self.mesh.devices.flat[0].device_kind)
        tokens = utils.sequences_per_step(cfg) * cfg.model.T
        useful = model.flops_per_token(cfg.model) * tokens / tpu.chips
        flops = counted["total"]
        print(f"  FLOPs per chip per step (compiled HLO, loops x trip counts): {flops:.3e} (output layer "
              f"{counted['output_layer']:.2e}, blocks {counted['blocks'] + counted['unattributed']:.2e}); "
              f"model FLOPs {useful:.3e} ({100 * useful / flops:.0f}% of the compiled work)")
        print("  matmul FLOPs by operand dtype: " + ", ".join(
            f"{kind} {100 * f / flops:.2f}% ({f:.2e})" for kind, f in sorted(counted["by_dtype"].items(),
                                                                           key=lambda kv: -kv[1])))
        for util in (1.0, MFU_ASSUMED):
            seconds = flops / (util * peak)
            print(f"  at {100 * util:.0f}% of the {peak / 1e12:.0f} TFLOP/s bf16 peak: step {seconds * 1e3:.3g} ms, "
                  f"{tokens / seconds:,.0f} tokens/s ({tokens:,} tokens a step)")


def _shard_bytes(abstract):
    """Bytes one device holds of a sharded ShapeDtypeStruct."""
    shape = abstract.sharding.shard_shape(abstract.shape)
    return math.prod(shape) * abstract.dtype.itemsize
