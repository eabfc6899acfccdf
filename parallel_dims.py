"""The mesh's sizes in one place: `ParallelDims` (torchtitan's name), what `RunConfig.dims` hands out.

A run's mesh is `--n_device_axis DP PP TP` over `--n_slices` slices: DP data-parallel replicas counted over
every slice (DP/N in each, where FSDP shards the weights), PP pipeline stages, TP tensor shards. The rules
the sizes obey among themselves and every size the rest asks for (devices, FSDP shards per slice, the
mesh's shape: sharding.make_mesh builds it) are written here once; `utils.validate` checks them against the
model. Nothing of the project is imported: the config, the CLI and the mesh read it.
"""
import dataclasses
from dataclasses import dataclass

FLAG = "--n_device_axis"
# What a message calls each size: the flag's part that sets it
DP, PP, TP = (f"{axis} of {FLAG}" for axis in ("DP", "PP", "TP"))


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
        """The sizes of the mesh's axes ("slice", "dp", "pp", "tp") (collectives.MESH_AXES)."""
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
