import dataclasses

import pytest

import optimizer
import utils
from utils import ConfigError, PRESETS, config_from_args, override, validate

# Dataclass defaults, not a preset, so tuning a preset does not move these expectations.
DEFAULT_CONFIG = utils.Config()

# (overrides, substring the error must contain): each violates exactly one rule of the default config.
INVALID = [
    ({"n_head": 3}, "--model_dimension (128) must be divisible by --n_head (3)"),
    ({"n_device_axis": (1, 1, 8)}, "--n_head (4) must be divisible by TP"),
    ({"model_dimension": 132, "n_device_axis": (8, 1, 1)}, "--model_dimension (132) must be divisible by DP"),
    ({"latent_dim": 30}, None),  # valid: no FSDP split of the latent on dp 1
    ({"n_device_axis": (4, 1, 1), "latent_dim": 30}, "--latent_dim (30) must be divisible by DP"),
    ({"n_device_axis": (4, 1, 1), "q_latent_dim": 6}, "--q_latent_dim (6) must be divisible by DP"),
    ({"blocks": 3, "n_device_axis": (1, 2, 1)}, "--blocks (3) must be divisible by PP"),
    ({"pipeline_repeats": 2}, None),   # valid: 2 blocks, one group per repeat on the one stage
    ({"pipeline_repeats": 2, "n_device_axis": (1, 2, 1)},
     "--blocks (2) must be divisible by PP of --n_device_axis x --pipeline_repeats (2 x 2)"),
    ({"pipeline_repeats": 0}, "--pipeline_repeats must be >= 1"),
    ({"n_device_axis": (1, 2, 1), "micro_batch_size": 1, "train_batch_size": 4, "val_batch_size": 4},
     "--micro_batch_size (1) must be divisible by PP"),
    ({"train_batch_size": 5}, "--train_batch_size (5) must be divisible by --micro_batch_size (2)"),
    ({"val_batch_size": 3}, "--val_batch_size (3) must be divisible by DP x --micro_batch_size (1 x 2) (2)"),
    # a count in all: each of 2 replicas' 3 sequences would not split into 2 micro-batches
    ({"n_device_axis": (2, 1, 1), "val_batch_size": 6},
     "--val_batch_size (6) must be divisible by DP x --micro_batch_size (2 x 2) (4); valid values of "
     "--val_batch_size are multiples of 4"),
    ({"k": 5}, "--k (5) must be <= --n_experts (4)"),
    ({"k": 0}, "--k must be >= 1"),
    ({"n_experts": 0}, "--n_experts must be >= 1"),
    ({"n_shared": -1}, "--n_shared must be >= 0"),
    ({"capacity_factor": -0.5}, "--capacity_factor must be >= 0"),
    ({"dhR": 15}, "--dhR (15) must be even"),
    ({"dhR": 0}, "--dhR must be >= 2"),
    ({"dropout_rate": 1.0}, "--dropout_rate must be in [0, 1)"),
    ({"model_dtype": "float16"}, "--model_dtype must be bfloat16 or float32"),
    ({"remat": "some"}, "--remat must be auto, full, dots or none"),
    ({"T": 1}, "--T must be >= 2"),
    ({"max_tokens": 128}, "--max_tokens (128) must be < --T (128)"),
    ({"temperature": 0.0}, "--temperature must be > 0"),
    ({"top_k": 0}, "--top_k must be >= 1"),
    ({"max_lr": 0.0}, "--max_lr must be > 0"),
    ({"warmup_steps": 500}, "--warmup_steps (500) must be <= --end_steps (300)"),
    ({"grad_step": 0}, "--grad_step must be >= 1"),
    ({"grad_clip_norm": -1.0}, "--grad_clip_norm must be > 0"),
    ({"checkpoint_steps": 0}, "--checkpoint_steps must be >= 1"),
    ({"eval_steps": 0}, "--eval_steps must be >= 1"),
    ({"training_steps": 0}, "--training_steps must be >= 1"),
    ({"bias_update_rate": -1e-3}, "--bias_update_rate must be >= 0"),
    ({"stop_at_val_loss": -1.0}, "--stop_at_val_loss must be >= 0"),
    ({"n_device_axis": (0, 1, 1)}, "--n_device_axis needs three positive sizes"),
    ({"expert_parallel": True, "n_device_axis": (8, 1, 1)}, "--n_experts (4) must be divisible by DP of --n_device_axis"),
    ({"expert_parallel": True, "n_device_axis": (4, 1, 2)}, None),
    ({"vocab_size": 100_277, "n_device_axis": (1, 1, 8), "n_head": 8},
     None),  # padded vocab 100,352 splits over tp 8
    ({"model_dimension": 120, "n_head": 4, "n_device_axis": (1, 1, 4), "vocab_size": 100}, None),
    ({"seed": -1}, "--seed must be in [0, 2147483646], got -1"),
    ({"seed": 2**40}, "--seed must be in [0, 2147483646]"),
    ({"name": ""}, "--name must be one directory name under --output_dir"),
    ({"name": "../.."}, "--name must be one directory name"),
    ({"name": "/tmp/run"}, "--name must be one directory name"),
    ({"name": "run-2_v1.5"}, None),
    ({"max_bad_steps": 0}, "--max_bad_steps must be >= 1"),
    ({"n_slices": 0}, "--n_slices must be >= 1"),
    ({"n_slices": 2}, "--n_slices (2) must divide DP of --n_device_axis (1)"),
    ({"n_slices": 2, "n_device_axis": (4, 1, 2), "val_batch_size": 8}, None),
    # FSDP shards within a slice: dp 8 over 2 slices is 4 shards of the width, 4 experts a shard
    ({"n_slices": 2, "n_device_axis": (8, 1, 1), "model_dimension": 34, "n_head": 2, "val_batch_size": 16},
     "--model_dimension (34) must be divisible by DP/--n_slices (FSDP shards) (4)"),
    ({"n_slices": 2, "n_device_axis": (8, 1, 1), "expert_parallel": True, "val_batch_size": 16}, None),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_every_float_flag_refuses_nan_and_inf(value):
    """NaN compares false with any bound (`nan < 0` is False), so each float flag is checked for being a
    number at all, by name: --max_lr inf trained to NaN and rotated the good checkpoints away."""
    floats = [f.name for section in utils.SECTIONS.values() for f in dataclasses.fields(section)
              if isinstance(f.default, float)]
    assert {"max_lr", "min_lr", "capacity_factor", "alpha", "grad_clip_norm", "temperature"} <= set(floats)
    for name in floats:
        with pytest.raises(ConfigError) as err:
            validate(override(DEFAULT_CONFIG, **{name: value}))
        assert f"--{name} must be a finite number, got {value}" in str(err.value)


@pytest.mark.parametrize("values,message", INVALID)
def test_each_rule_has_its_own_error(values, message):
    cfg = override(DEFAULT_CONFIG, **values)
    if message is None:
        assert validate(cfg, n_devices=8) is cfg
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg, n_devices=8)
    assert message in str(err.value)
    assert str(err.value).count("\n  - ") == 1, f"expected exactly one violated rule: {err.value}"


def test_all_violations_reported_together():
    cfg = override(DEFAULT_CONFIG, n_head=3, k=9, dhR=7)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).count("\n  - ") == 3


def test_moe1B_on_8_2_2_needs_32_devices():
    cfg = config_from_args(["--preset", "moe1B", "--n_device_axis", "8", "2", "2"])
    assert cfg.run.n_device_axis == (8, 2, 2) and cfg.model.n_layers == 48
    assert validate(cfg, n_devices=32) is cfg
    with pytest.raises(ConfigError, match=r"--n_device_axis 8 2 2 needs 32 devices.*8 available"):
        validate(cfg, n_devices=8)


def test_mesh_must_divide_device_count():
    cfg = override(DEFAULT_CONFIG, n_device_axis=(1, 3, 1), blocks=3, micro_batch_size=3, train_batch_size=3,
                   val_batch_size=3)
    with pytest.raises(ConfigError, match="needs 3 devices, which must divide the 8 available"):
        validate(cfg, n_devices=8)
    assert validate(cfg, n_devices=6) is cfg


def test_slices_are_whole_processes_and_as_many_as_the_tpus_say():
    cfg = override(DEFAULT_CONFIG, n_device_axis=(4, 1, 1), n_slices=2)
    from utils import check_slices
    assert check_slices(cfg, 2, 1) is cfg and check_slices(cfg, 4, 2) is cfg and check_slices(cfg, 1, 1) is cfg
    with pytest.raises(ConfigError, match=r"--n_slices \(2\) must divide the 3 processes \(a slice is whole hosts\)"):
        check_slices(cfg, 3, 1)
    with pytest.raises(ConfigError, match=r"--n_slices \(1\) must be 2: these devices are 2 TPU slices"):
        check_slices(override(cfg, n_slices=1), 2, 2)


def test_the_mesh_sizes_are_one_type_handed_out_by_the_run_config():
    """cfg.run.dims: --n_device_axis DP PP TP over --n_slices as a ParallelDims, what the rest asks of the mesh
    written once; the config itself (and so its JSON) keeps the guide's positional field."""
    from parallel_dims import ParallelDims
    cfg = config_from_args(["--n_device_axis", "8", "2", "2", "--n_slices", "2"])
    dims = cfg.run.dims
    assert dims == ParallelDims(8, 2, 2, 2) and dims.shape == cfg.run.n_device_axis == (8, 2, 2)
    assert (dims.n_devices, dims.stage_plane, dims.fsdp_per_slice, dims.devices_per_slice) == (32, 4, 4, 16)
    assert dims.mesh_shape == (2, 4, 2, 2) and dims.flags == "--n_device_axis 8 2 2"
    assert dims.words == "dp=8 pp=2 tp=2 (2 slices of dp=4, joined over DCN)" and dims.rule_errors() == []
    assert ParallelDims(4, 1, 2).words == "dp=4 pp=1 tp=2" and ParallelDims(4).fsdp_name == "DP of --n_device_axis"
    assert "dims" not in dataclasses.asdict(cfg.run) and dataclasses.asdict(cfg.run)["n_device_axis"] == (8, 2, 2)
    assert override(cfg, n_device_axis=[2, 1, 1]).run.dims == ParallelDims(2, 1, 1, 2)      # a JSON list reads back
    assert ParallelDims(3, n_slices=2).rule_errors() and ParallelDims(3, n_slices=0).rule_errors()
    assert ParallelDims.of((2, 0, 1)) == ParallelDims.of((2, 2)) == ParallelDims()         # shape_errors says why
    assert ParallelDims.shape_errors((2, 2)) and not ParallelDims.shape_errors((1, 1, 1))


def test_cli_keeps_guide_flag_names_and_overrides_preset():
    cfg = config_from_args(["--model_dimension", "256", "--n_device_axis", "2", "2", "2", "--T", "64",
                            "--micro_batch_size", "4", "--grad_step", "2", "--use_cache", "false", "--wandb"])
    assert (cfg.model.model_dimension, cfg.model.T, cfg.run.n_device_axis) == (256, 64, (2, 2, 2))
    assert (cfg.run.micro_batch_size, cfg.optim.grad_step, cfg.inference.use_cache, cfg.run.wandb) == (4, 2, False, True)
    assert cfg.model.n_head == PRESETS["tiny"].model.n_head


def test_cli_rejects_bad_values(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--n_device_axis", "2", "2"])
    with pytest.raises(SystemExit):
        config_from_args(["--preset", "huge"])
    assert "invalid choice" in capsys.readouterr().err


def test_help_states_flag_meanings(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "NUMBER of pipeline micro-batches" in out and "checkpoint is saved every 10 intervals" in out
    # each flag shows what the presets set it to (argparse's own default would say None)
    assert "d_model (tiny: 64, moe1B: 768, moe1B-v4-32: 768, dsv3-tiny: 64, moe10B: 2048, moe1B-v5e-1: 768)" in out and "mesh sizes DP PP TP (tiny: 1 1 1," in out
    assert "None" not in out


def test_lr_schedule_shape():
    o = override(DEFAULT_CONFIG, min_lr=0.0, max_lr=1.0, end_lr=0.1, warmup_steps=10, end_steps=110).optim
    lr = optimizer.lr_schedule(o)
    assert float(lr(0)) == 0.0 and abs(float(lr(5)) - 0.5) < 1e-6 and abs(float(lr(10)) - 1.0) < 1e-6
    assert abs(float(lr(60)) - 0.55) < 1e-6 and abs(float(lr(110)) - 0.1) < 1e-6 and abs(float(lr(500)) - 0.1) < 1e-6


def test_implementation_choices_are_the_tables_keys():
    """utils names --remat's, --moe_impl's and --engine's values without importing the model; they must be
    what the engine implements."""
    import engine
    from engine import expert_kernels
    assert set(utils.CHOICES["remat"]) == {*engine.REMAT_POLICIES, "none", "auto"}
    assert set(utils.CHOICES["moe_impl"]) == set(expert_kernels.MOE_IMPLS)
    assert set(utils.CHOICES["engine"]) == set(engine.ENGINES)


def test_help_prints_before_jax_loads_with_a_short_usage_and_commands_that_parse():
    """`python main.py --help`: argparse's help without importing jax (seconds on a loaded machine), a one-line
    usage, and at the end the commands a newcomer needs, each of main.py's parsing as a config."""
    import os
    import shlex
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from ceiling import CEILING_S
    proc = subprocess.run([sys.executable, "-X", "importtime", "main.py", "--help"], cwd=root, capture_output=True,
                          text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "utils" in imported and not {m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "numpy")}
    assert proc.stdout.splitlines()[0] == "usage: python main.py [--preset NAME] [--FLAG VALUE ...]"
    assert proc.stdout.rstrip().endswith("\n".join(f"  {c}\n      {w}" for c, w in utils.EXAMPLES))
    for command, _ in utils.EXAMPLES:
        words = shlex.split(command)
        if words[1] == "main.py":
            config_from_args(words[2:])


def test_a_slice_count_that_does_not_divide_dp_exits_2_before_any_compile(cpu_env, tmp_path):
    import os
    import subprocess
    import sys
    from ceiling import CEILING_S
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "main.py", "--n_device_axis", "4", "1", "1", "--n_slices", "3",
                           "--cpu_devices", "4", "--output_dir", str(tmp_path)], cwd=root, env=cpu_env,
                          capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--n_slices (3) must divide DP of --n_device_axis (4)" in proc.stderr and "compil" not in proc.stdout
    assert not os.listdir(tmp_path)
