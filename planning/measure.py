"""Compile a config and measure it, in small named steps (as MaxText's train_compile.py): the devices of a
target that is not here (`target_devices`: a TPU slice's topology from libtpu, or H200s from XLA's target
description, hardware.py's catalogue naming them) and the run's mesh over them (`target_mesh`), with the
compiler loaded alone (`compile_only_libtpu`, `compile_only_cuda`: no device runtime starts); the compile,
or the compiler's refusal of a step too large for the device as the GiB it needs (`compiled_or_shortfall`);
and what the compiled step plans (`planned_gib`), against the model's FLOPs (`model_flops`). `train_plan`
is the three for a train step. The run's fit check (planning/fit.py) and the `--compile_for` report
(planning/report.py) both measure with it; it prints nothing."""
import math
import os
import re
from typing import NamedTuple

import jax
from jax.experimental import topologies

import hardware
import hlo
import sharding
import utils
from trainer import Trainer, abstract_step_args, build_trainer

GiB = 2**30
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


# ---- the target's devices and mesh, the compiler loaded alone

def compile_only_libtpu(tpu):
    """jax on the CPU backend with libtpu loaded only as a compiler: no TPU runtime starts, several
    processes may load libtpu at once, and libtpu is told what it would otherwise look up on a TPU VM
    (it prints warnings without them; nothing here queries a server)."""
    jax.config.update("jax_platforms", "cpu")     # jax is imported already: $JAX_PLATFORMS would come too late
    for name, value in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                        ("TPU_ACCELERATOR_TYPE", tpu.slice_name), ("TPU_WORKER_HOSTNAMES", "localhost")):
        os.environ.setdefault(name, value)


def compile_only_cuda():
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
    if isinstance(target, hardware.GpuTarget):
        return topologies.get_topology_desc(platform="cuda", topology=f"1x1x{target.chips}",
                                            target_config=H200_DESCRIPTION).devices
    return topology_devices(target)


def topology_devices(tpu):
    """The slice's devices as libtpu describes them: ids, host (process_index), chip coords."""
    return topologies.get_topology_desc(
        platform="tpu", topology_name=tpu.topology_name, chip_config_name=tpu.chip_config,
        chips_per_host_bounds=tpu.host_grid, num_slices=tpu.slices, wrap=(False,) * 3).devices


def target_mesh(cfg, target):
    """The mesh a run of cfg makes on the target's devices (sharding.run_mesh: a real run's device order)."""
    return sharding.run_mesh(cfg.run, target_devices(target))


# ---- the compile, and what it plans

def compiled_or_shortfall(jitted, args, compiler_options=None):
    """(jitted compiled for args, None), or (None, GiB it needs) where the compiler refuses it as too large for the
    device (libtpu does, saying how large). compiler_options: XLA's, for this compile alone."""
    try:
        return jitted.lower(*args).compile(compiler_options), None
    except Exception as e:               # noqa: BLE001 - libtpu refuses some plans that do not fit so
        needed = hbm_shortfall(str(e))
        if needed is None:
            raise
        return None, needed


def hbm_shortfall(message):
    """GiB needed per chip from libtpu's out-of-HBM error, or None for any other error."""
    m = re.search(r"\(([\d.]+)([GMK])\) exceeds available HBM", message)
    if not m or "RESOURCE_EXHAUSTED" not in message:
        return None
    return float(m.group(1)) * {"G": 1.0, "M": 2.0**-10, "K": 2.0**-20}[m.group(2)]


class StepPlan(NamedTuple):
    """cfg's train step compiled for a mesh: GiB per device (where the compiler refused it, the GiB it needs),
    compiled FLOPs over the model's and collective GiB per device (None where refused), and cfg's Trainer with
    that compiled step (None where refused; a run on this mesh trains with it, compiling nothing again)."""
    gib: float
    flops_ratio: float | None
    collective_gib: float | None
    trainer: Trainer | None


def train_plan(cfg, mesh):
    """cfg's train step compiled for mesh: its StepPlan."""
    trainer = build_trainer(cfg, mesh)
    train_args, _ = abstract_step_args(cfg, trainer)
    compiled, needed = compiled_or_shortfall(trainer.step, train_args)
    if compiled is None:
        return StepPlan(needed, None, None, None)
    text = compiled.as_text()
    return StepPlan(planned_gib(compiled.memory_analysis(), mesh.devices.flat[0].platform),
                    hlo.matmul_flops(text)["total"] / model_flops(cfg, mesh.size),
                    sum(c["bytes"] for c in hlo.collective_bytes(text).values()) / GiB,
                    trainer._replace(step=compiled))


def planned_gib(mem, platform):
    """GiB per device a compiled step needs, from its memory analysis; platform: its devices' ("tpu", "gpu", "cpu").
    On a TPU: the peak of XLA's heap simulation (arguments, outputs and temporaries as they are live together,
    the donated state once) plus the code, which is what the chip holds running the step: its buffers
    (bytes_in_use) and the program's reserved block of temporaries (bytes_reserved), within 1.5%, a little
    under it (the block holds the peak and its gaps). XLA:TPU's temp_size_in_bytes is more than that block: the
    sum of arguments, outputs and temp_size overstated the chip's need by 16-23%
    (docs/performance-log.md#2026-12-06-tpu-memory-plans). Elsewhere that sum (XLA:CPU's peak can be less
    than the arguments it holds)."""
    if platform == "tpu":
        return (mem.peak_memory_in_bytes + mem.generated_code_size_in_bytes) / GiB
    return (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes) / GiB


def model_flops(cfg, chips):
    """The model's FLOPs per chip for a training step (sharding.flops_per_token over its tokens)."""
    return sharding.flops_per_token(cfg.model) * utils.sequences_per_step(cfg) * cfg.model.T / chips


def shard_bytes(abstract):
    """Bytes one device holds of a sharded ShapeDtypeStruct."""
    shape = abstract.sharding.shard_shape(abstract.shape)
    return math.prod(shape) * abstract.dtype.itemsize
