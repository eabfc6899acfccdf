"""The hardware the project knows: TPU slices and H200 targets for --compile_for (chips, hosts, HBM, the
topology libtpu's compiler takes), each device kind's datasheet bf16 peak, and MFU of it, and a TPU core's VMEM.
"""
import math
import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TpuSlice:
    """A TPU slice, or N of one type joined over the data-centre network (DCN): `NxSLICE`, e.g. 2xv4-32."""
    name: str                 # as Google names it: v4-64 (v4 and v5p count TensorCores, 2 a chip), v6e-16 (chips)
    generation: str           # libtpu's topology prefix: v4, v5p, v5e, v6e
    chip_grid: tuple          # one slice's chips along x, y(, z)
    host_grid: tuple          # one host's chips along x, y, z
    hbm_bytes: float          # usable HBM per chip, as libtpu's compiler reports it when a program exceeds it
    slices: int = 1

    @property
    def chips(self):
        """Of every slice."""
        return math.prod(self.chip_grid) * self.slices

    @property
    def hosts(self):
        return self.chips // math.prod(self.host_grid)

    @property
    def chips_per_host(self):
        return math.prod(self.host_grid)

    @property
    def slice_name(self):
        """One slice's name: v4-32 of 2xv4-32."""
        return self.name.split("x", 1)[1] if self.slices > 1 else self.name

    @property
    def topology_name(self):
        return f"{self.generation}:" + "x".join(map(str, self.chip_grid))

    @property
    def chip_config(self):
        return "megacore" if self.generation in ("v4", "v5p") else "default"   # one JAX device per chip


_CUBE_GRIDS = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
               256: (4, 8, 8)}                                      # v4 and v5p: chips -> 3-D torus shape
_PLANE_GRIDS = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
                256: (16, 16)}                                      # v5e and v6e: chips -> 2-D shape
_HBM_GIB = {"v4": 30.75, "v5p": 95.74, "v5e": 15.75, "v6e": 31.25}   # measured from libtpu 0.0.42.1's errors


def tpu_slices():
    """Every slice --compile_for knows, smallest first within each generation."""
    out = []
    for gen, prefix in (("v4", "v4"), ("v5p", "v5p")):
        out += [TpuSlice(f"{prefix}-{2 * chips}", gen, grid, (2, 2, 1), _HBM_GIB[gen] * 2**30)
                for chips, grid in _CUBE_GRIDS.items()]
    for gen, prefix in (("v5e", "v5litepod"), ("v6e", "v6e")):
        out += [TpuSlice(f"{prefix}-{chips}", gen, grid, (*grid, 1) if chips <= 8 else (2, 2, 1),
                         _HBM_GIB[gen] * 2**30) for chips, grid in _PLANE_GRIDS.items()]
    return out


def tpu_slice(name):
    """The TpuSlice called `name` (v5e-N is accepted for v5litepod-N; NxSLICE is N of SLICE), or None."""
    name = name.strip().lower().replace("v5e-", "v5litepod-")
    several = re.fullmatch(r"([1-9]\d*)x(.+)", name)
    if several:
        one = tpu_slice(several.group(2))
        return None if one is None else replace(one, name=f"{several.group(1)}x{one.name}", slices=int(several.group(1)))
    return next((t for t in tpu_slices() if t.name == name), None)


@dataclass(frozen=True)
class GpuTarget:
    """N H200s on one host, for `--compile_for h200` / `h200-N`: compiled by XLA:GPU on this machine."""
    name: str
    chips: int                               # GPUs
    hbm_bytes: float = 151397597184          # device_memory_size in XLA's H200 description (141 GiB)
    hbm_bandwidth: float = 4.8e12            # B/s
    hosts: int = 1
    slices: int = 1


def gpu_targets():
    return [GpuTarget("h200" if n == 1 else f"h200-{n}", n) for n in (1, 2, 4, 8)]


def compile_target(name):
    """The TpuSlice or GpuTarget `--compile_for NAME` compiles for, or None."""
    return tpu_slice(name) or next((g for g in gpu_targets() if g.name == name.strip().lower()), None)


# Dense bf16 peaks per chip from the vendors' datasheets: what MFU is of, as MaxText, Megatron and NeMo report
# it (bench.py and --compile_for h200 give MFU of a measured GEMM rate beside it).
PEAK_BF16_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5": 459e12, "TPU v6 lite": 918e12,
                   "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12}


# Each TensorCore's VMEM (jax's pallas tpu_info): what a Pallas kernel's blocks must fit in.
VMEM_BYTES = {"TPU v4": 16 * 2**20, "TPU v5 lite": 128 * 2**20, "TPU v5": 64 * 2**20, "TPU v6 lite": 128 * 2**20}


def _of_kind(table, device_kind):
    """table's value for the longest prefix of device_kind it holds, or None (a CPU, an unknown chip)."""
    return next((value for prefix, value in sorted(table.items(), key=lambda kv: -len(kv[0]))
                 if device_kind.startswith(prefix)), None)


def peak_flops(device_kind):
    """The bf16 dense peak of a device kind, or None when unknown (a CPU)."""
    return _of_kind(PEAK_BF16_FLOPS, device_kind)


def vmem_bytes(device_kind):
    """A TPU core's VMEM, or None when unknown."""
    return _of_kind(VMEM_BYTES, device_kind)


MFU_FORMULA = ("MFU = tokens/s x model FLOPs per token / (devices x the datasheet's dense bf16 FLOP/s: "
               + ", ".join(f"{kind} {peak / 1e12:g}e12" for kind, peak in PEAK_BF16_FLOPS.items()) + ")")


def mfu(tokens_per_second, flops_per_token, n_devices, peak):
    return None if not peak else tokens_per_second * flops_per_token / (n_devices * peak)
