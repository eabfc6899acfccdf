"""The mesh in one place: `ParallelDims` (torchtitan's name, what `RunConfig.dims` hands out), its sizes and the mesh.

A run's mesh is `--n_device_axis DP PP TP` over `--n_slices` slices: DP data-parallel replicas counted over
every slice (DP/N in each, where FSDP shards the weights), PP pipeline stages, TP tensor shards. The rules
the sizes obey among themselves, every size the rest asks for (devices, FSDP shards per slice, the mesh's
shape) and the mesh itself (`build_mesh`, over `MESH_AXES`) are written here once; `utils.validate` checks
them against the model. Nothing of the project is imported: the config, the CLI and the sharded model read it;
jax and numpy only by build_mesh, so that --help prints before they load (tests/test_config.py).
"""
import dataclasses
from dataclasses import dataclass

FLAG = "--n_device_axis"
# What a message calls each size: the flag's part that sets it
DP, PP, TP = (f"{axis} of {FLAG}" for axis in ("DP", "PP", "TP"))
# The mesh's axes, outermost first: TPU slices, FSDP shards within a slice, pipeline stages, tensor shards
MESH_AXES = ("slice", "dp", "pp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """dp data-parallel replicas (over every slice), pp pipeline stages and tp tensor shards, over n_slices
    TPU slices joined by data parallelism over DCN."""
    dp: int = 1
    pp: int = 1
    tp: int = 1
    n_slices: int = 1

    @classmethod
    def of(cls, shape, n_slices=1):
        """The dims of --n_device_axis `shape` (DP, PP, TP) over `n_slices`; a 1 x 1 x 1 mesh where `shape` is not
        three positive sizes (`shape_errors` says so), so that the config's other rules can still be checked."""
        return cls(n_slices=n_slices) if cls.shape_errors(shape) else cls(*shape, n_slices=n_slices)

    @staticmethod
    def shape_errors(shape):
        """The rule --n_device_axis itself obeys: three positive sizes."""
        if len(shape) != 3 or any(n < 1 for n in shape):
            return [f"{FLAG} needs three positive sizes DP PP TP, got {shape}"]
        return []

    def rule_errors(self):
        """The messages of the rules the sizes break among themselves (a slice holds whole dp replicas)."""
        if self.n_slices < 1:
            return [f"--n_slices must be >= 1, got {self.n_slices}"]
        if self.dp % self.n_slices:
            return [f"--n_slices ({self.n_slices}) must divide {DP} ({self.dp}): each slice holds DP/N of the "
                    f"data-parallel replicas; valid values of --n_slices are the divisors of {self.dp}"]
        return []

    @property
    def shape(self):
        """(dp, pp, tp): the --n_device_axis sizes."""
        return self.dp, self.pp, self.tp

    @property
    def n_devices(self):
        """Devices the mesh spans, every slice's."""
        return self.dp * self.pp * self.tp

    @property
    def stage_plane(self):
        """Devices of one dp replica: its pp x tp plane."""
        return self.pp * self.tp

    @property
    def fsdp_per_slice(self):
        """FSDP shards: the dp replicas of one slice, over which the weights are sharded (dp where n_slices is not a
        divisor of it, which rule_errors refuses)."""
        return self.dp // self.n_slices if self.n_slices >= 1 and not self.dp % self.n_slices else self.dp

    @property
    def fsdp_name(self):
        """What a message calls the FSDP shards."""
        return DP if self.n_slices == 1 else "DP/--n_slices"

    @property
    def mesh_shape(self):
        """The sizes of the mesh's axes, MESH_AXES."""
        return self.n_slices, self.fsdp_per_slice, self.pp, self.tp

    @property
    def devices_per_slice(self):
        return self.n_devices // self.n_slices

    @property
    def flags(self):
        """The flag that asks for this mesh (without --n_slices)."""
        return f"{FLAG} {self.dp} {self.pp} {self.tp}"

    @property
    def words(self):
        """The mesh for a log line: "dp=D pp=P tp=T", and over several slices how dp splits."""
        return f"dp={self.dp} pp={self.pp} tp={self.tp}" + (
            f" ({self.n_slices} slices of dp={self.fsdp_per_slice}, joined over DCN)" if self.n_slices > 1 else "")

    def replace(self, **sizes):
        return dataclasses.replace(self, **sizes)

    def build_mesh(self, devices=None):
        """The MESH_AXES mesh of n_slices x (dp/n_slices, pp, tp) of `devices` (jax.devices() by default), real or
        an ahead-of-time TPU topology's.

        Devices are taken slice by slice (a TPU slice's, or on CPUs and GPUs an equal share of the devices in
        host order), host by host, each host's in physical order, and laid out with tp fastest: so a pp x tp
        plane whose size divides a host's device count sits on one host (on a v4 host's 2 x 2 chips, tp pairs
        along x and pp pairs along y are direct neighbours), only dp crosses hosts, as in the guide's figure, and
        only the slice axis crosses slices. jax.make_mesh instead insists on not splitting physical axes, which
        (8, 2, 2) on v4-64's 2 x 4 x 4 chips cannot satisfy. Auto axes: outside shard_map XLA propagates
        shardings (optimizer, generation); inside it every collective is written out."""
        import jax
        import numpy as np
        ordered = sorted(jax.devices() if devices is None else devices, key=physical_order)
        per_slice, in_mesh = len(ordered) // self.n_slices, self.devices_per_slice
        if per_slice < in_mesh:
            raise ValueError(f"mesh {self.shape} over {self.n_slices} slice(s) needs {self.n_devices} devices, "
                             f"{len(ordered)} available")
        grid = np.empty((self.n_slices, in_mesh), dtype=object)
        for s in range(self.n_slices):
            grid[s, :] = ordered[s * per_slice:s * per_slice + in_mesh]
        return jax.sharding.Mesh(grid.reshape(self.mesh_shape), MESH_AXES,
                                 axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def physical_order(device):
    """Sort key: TPU slice, host, then the chip's position (z, y, x) and core on a TPU; id elsewhere."""
    coords = getattr(device, "coords", None)
    place = (*reversed(coords), getattr(device, "core_on_chip", 0)) if coords is not None else (device.id,)
    return (getattr(device, "slice_index", 0), device.process_index, *place)
