"""Issue 35's newcomer path, the cases no other test reproduces from outside the process: the README's
pod recipe tokenizes what the guide's run reads (the command main.py prints when --data_dir is missing,
and README's step 1, the same flags), the README's Python version and virtualenv line work as written,
`--sample` prints the sample without absl's warnings (case 10), docs/training.md's 3-D mesh command is a run
of its own with the one-device run's global batch (case 15), and (opt-in, ~5 min) `python main.py` ends
inside the spread docs/training.md states (case 11)."""
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import utils
from run_util import MESH1, assert_final_line_compares_with_the_unigram_entropy, run
from ceiling import CEILING_S

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _page(*path):
    with open(os.path.join(REPO, *path)) as f:
        return f.read()


def _flags(command):
    words = shlex.split(command)
    return {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--") and i + 1 < len(words)}


def test_the_pod_recipe_tokenizes_what_the_guides_run_reads(cpu_env, tmp_path):
    """`python main.py --preset moe1B` without --data_dir exits 2 naming the tokenizer command; that command
    and README's step 1 ask for the same shards, with a --max_tokens budget that covers the run's 100,000
    steps past the val shard, and not much more (sample-350BT's ~350B tokens take days to tokenize)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "main.py"), "--preset", "moe1B", "--output_dir",
                           str(tmp_path)], cwd=REPO, env=cpu_env, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 2, proc.stderr[-3000:]
    printed = re.search(r"\((python -m data\.tokenize_local [^)]*)\)", proc.stderr)
    assert printed, proc.stderr
    recipe = re.search(r"^python -m data\.tokenize_local (?:.*\\\n)*.*$", _page("README.md"), re.M)
    assert recipe, "README's pod recipe has no tokenizer command"
    flags, readme = _flags(printed[1]), _flags(recipe[0].replace("\\\n", " "))
    assert readme == flags, (readme, flags)
    assert "--max_tokens" in flags, f"the recipe tokenizes the whole source: {printed[1]}"

    cfg = utils.PRESETS["moe1B"]
    train_tokens = cfg.optim.training_steps * utils.sequences_per_step(cfg) * cfg.model.T + 1   # windows of T+1
    budget = int(flags["--max_tokens"]) - int(flags["--val_shards"]) * int(flags["--shard_size"])
    assert train_tokens <= budget <= 1.05 * train_tokens, (train_tokens, budget)
    assert not os.listdir(tmp_path), "a refused run leaves nothing behind"


def test_the_readmes_python_version_and_virtualenv_line_work_as_written(tmp_path):
    """README names the Python for which requirements.txt's pins are resolved and a virtualenv line; run as
    written (in an empty directory), the line gives an interpreter of that version."""
    readme = _page("README.md")
    version = re.search(r"\bPython (3\.\d+)\b", readme)
    assert version, "README names no Python version"
    with open(os.path.join(REPO, "requirements.txt")) as f:
        assert f"resolved together on Python {version[1]}" in f.read(), "README's Python is not the pins'"
    line = re.search(r"`(python(3\.\d+) -m venv (\S+) && \. \3/bin/activate)`", readme)
    assert line and line[2] == version[1], "README gives no virtualenv line for its Python version"
    if shutil.which(f"python{version[1]}") is None:
        pytest.skip(f"python{version[1]} is not installed here")
    proc = subprocess.run(["bash", "-c", f"{line[1]} && python -c 'import sys; print(sys.prefix, *sys.version_info[:2])'"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefix, major, minor = proc.stdout.split()
    assert (f"{major}.{minor}", os.path.realpath(prefix)) == (version[1], os.path.realpath(tmp_path / line[3]))


def test_sample_prints_no_absl_warning(cpu_env, tmp_path):
    """`python main.py --sample` after a run: the sample on stdout, and no absl or glog line on stderr (Orbax
    printed `WARNING:absl:CheckpointManagerOptions.read_only=True, setting save_interval_steps=0.` from the
    options' constructor, built before checkpoints.checkpoint_manager lowered absl's level; test_run_safety's
    `"read only" not in stderr` does not match that line)."""
    run(cpu_env, tmp_path, *MESH1, steps=1)
    proc = run(cpu_env, tmp_path, *MESH1, "--sample", "--max_tokens", "4", steps=1)
    assert f"sample @ 1 of {tmp_path}/run/checkpoints:" in proc.stdout
    noise = [line for line in proc.stderr.splitlines() if "absl" in line or re.match(r"[WEF]\d{4} ", line)]
    assert noise == [], proc.stderr[-3000:]


def test_training_mds_3d_mesh_command_is_a_run_of_its_own_with_the_same_global_batch():
    """Case 15: run after `python main.py`, the page's 3-D mesh command must not find the finished run ("nothing
    to do": another --name), and must train what the one-device run trains on the same sequences per step (its
    curve is laid beside that run's), every model and optimizer setting the default's."""
    command = re.search(r"python main\.py ([^`\n]*--n_device_axis 2 2 2[^`\n]*)", _page("docs", "training.md"))
    assert command, "docs/training.md shows no 3-D mesh command"
    default, mesh = utils.config_from_args([]), utils.config_from_args(shlex.split(command[1]))
    assert mesh.run.name != default.run.name, command[0]
    assert utils.sequences_per_step(mesh) == utils.sequences_per_step(default), command[0]
    assert (mesh.model, mesh.optim) == (default.model, default.optim), command[0]


@pytest.mark.slow("~5 min")
def test_python_main_prints_what_training_md_says(cpu_env, tmp_path):
    """README's first command, run as a newcomer runs it: the parameter count docs/training.md shows, and a
    final val cross-entropy inside the spread the page states (case 11: the page once gave one machine's
    digits, 4.9794, and a newcomer's first run ended at 4.9974)."""
    page = _page("docs", "training.md")
    low, high = map(float, re.search(r"final val cross-entropy between ([\d.]+) and ([\d.]+)", page).groups())
    params = re.search(r"^params: .*$", page, re.M)[0]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "main.py"), "--output_dir", str(tmp_path)], cwd=REPO,
                          env=cpu_env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert params in proc.stdout.splitlines(), proc.stdout[:3000]
    final = float(re.search(r"^final: val cross-entropy ([\d.]+) nats", proc.stdout, re.M)[1])
    assert low <= final <= high, (final, low, high)
    assert_final_line_compares_with_the_unigram_entropy(proc.stdout)          # below it
