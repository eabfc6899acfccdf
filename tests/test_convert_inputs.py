"""convert.py from-hf on hostile or broken Hugging Face directories: weight files named outside the
directory, links out of it, FIFOs and devices (refused before they are opened), config.json sizes past
what the model or this machine's memory can take (refused before anything is allocated), a full disk.
Each is one `error:` line and exit 2, with nothing written."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import convert
import hf_files
from convert_util import HF, ROOT, random_tensors
from run_util import mount

TAIL = "HF_DIR's files must be regular files inside it, named relative to it"


def hf_dir(path, hf=HF):
    """A small valid deepseek_v3 directory at path: config.json and sharded safetensors with an index."""
    os.makedirs(path)
    (path / "config.json").write_text(json.dumps(hf))
    files = hf_files.write_safetensors(str(path), random_tensors(HF), 40_000)
    return files[:-1]


def rename_in_index(directory, file, name):
    """The index's entries for `file` pointed at `name` instead."""
    index = json.loads((directory / hf_files.INDEX).read_text())
    index["weight_map"] = {k: name if v == file else v for k, v in index["weight_map"].items()}
    (directory / hf_files.INDEX).write_text(json.dumps(index))


def from_hf(cpu_env, hf, run, timeout=120):
    """python convert.py from-hf HF RUN, its memory held to 4 GiB (a runaway allocation fails, not the machine)."""
    return subprocess.run(["sh", "-c", 'ulimit -d 4194304 && exec "$@"', "sh", sys.executable,
                           os.path.join(ROOT, "convert.py"), "from-hf", str(hf), str(run)], cwd=ROOT, env=cpu_env,
                          capture_output=True, text=True, timeout=timeout)


def one_error(proc):
    """The one `error:` line of a refused command (exit 2, no traceback)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path, cpu_env):
    """The index names ../outside/x.safetensors, a valid file of the right tensors: refused by name (from-hf
    used to read it and write a run, exit 0)."""
    files = hf_dir(tmp_path / "hf")
    os.makedirs(tmp_path / "outside")
    os.rename(tmp_path / "hf" / files[0], tmp_path / "outside" / "x.safetensors")
    rename_in_index(tmp_path / "hf", files[0], "../outside/x.safetensors")
    error = one_error(from_hf(cpu_env, tmp_path / "hf", tmp_path / "run"))
    assert error == (f"error: {tmp_path}/hf/{hf_files.INDEX} names '../outside/x.safetensors', outside {tmp_path}/hf: "
                     f"{TAIL}"), error
    assert sorted(os.listdir(tmp_path)) == ["hf", "outside"]


def test_a_fifo_for_a_weight_file_is_refused_unopened(tmp_path, cpu_env):
    """A FIFO in a weight file's place: refused without opening it (from-hf used to block forever)."""
    files = hf_dir(tmp_path / "hf")
    os.remove(tmp_path / "hf" / files[1])
    os.mkfifo(tmp_path / "hf" / files[1])
    error = one_error(from_hf(cpu_env, tmp_path / "hf", tmp_path / "run", timeout=60))
    assert error == f"error: {tmp_path}/hf/{files[1]} is a FIFO, not a regular file: {TAIL}", error


@pytest.mark.parametrize("case", ["absolute", "device", "dotdot", "link out", "config.json a FIFO"])
def test_weight_files_outside_or_not_regular_are_refused(tmp_path, capsys, case):
    files = hf_dir(tmp_path / "hf")
    os.makedirs(tmp_path / "outside")
    os.rename(tmp_path / "hf" / files[2], tmp_path / "outside" / "x.safetensors")
    where = f"{tmp_path}/hf/{hf_files.INDEX} names"
    if case == "absolute":
        rename_in_index(tmp_path / "hf", files[2], "/etc/passwd")
        want = f"{where} '/etc/passwd', an absolute path: {TAIL}"
    elif case == "device":
        rename_in_index(tmp_path / "hf", files[2], "/dev/zero")
        want = f"{where} '/dev/zero', an absolute path: {TAIL}"
    elif case == "dotdot":
        rename_in_index(tmp_path / "hf", files[2], "sub/../../outside/x.safetensors")
        want = f"{where} 'sub/../../outside/x.safetensors', outside {tmp_path}/hf: {TAIL}"
    elif case == "link out":
        os.symlink("../outside/x.safetensors", tmp_path / "hf" / files[2])
        want = (f"{tmp_path}/hf/{files[2]} is a link to {tmp_path}/outside/x.safetensors, outside {tmp_path}/hf: "
                f"{TAIL}")
    else:
        os.rename(tmp_path / "hf" / "config.json", tmp_path / "outside" / "config.json")
        os.mkfifo(tmp_path / "hf" / "config.json")
        want = f"{tmp_path}/hf/config.json is a FIFO, not a regular file: {TAIL}"
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {want}\n"
    assert not os.path.exists(tmp_path / "run")


def test_the_hugging_face_cache_links_into_its_blobs(tmp_path):
    """huggingface_hub's cache holds snapshots/REV/NAME as links to ../../blobs/HASH: a snapshot reads."""
    tensors = random_tensors(HF)
    repo = tmp_path / "models--org--name"
    hf_dir(repo / "made")
    os.makedirs(repo / "blobs")
    os.makedirs(repo / "snapshots" / "abc123")
    for i, name in enumerate(sorted(os.listdir(repo / "made"))):
        os.rename(repo / "made" / name, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", repo / "snapshots" / "abc123" / name)
    back = hf_files.read_safetensors(str(repo / "snapshots" / "abc123"))
    assert sorted(back) == sorted(tensors) and all(np.array_equal(back[n], tensors[n]) for n in tensors)
    assert convert.read_hf_config(str(repo / "snapshots" / "abc123"))["hidden_size"] == 24


@pytest.mark.parametrize("field", ["num_hidden_layers", "n_routed_experts"])
def test_a_config_json_past_this_machines_memory_is_refused_at_once(tmp_path, cpu_env, field):
    """config.json with 10^9 layers or experts: one line with the memory the import would need (it used to
    grow past 8 GiB with no output until killed)."""
    hf_dir(tmp_path / "hf", HF | {field: 10**9})
    error = one_error(from_hf(cpu_env, tmp_path / "hf", tmp_path / "run", timeout=60))
    assert error.startswith(f"error: {tmp_path}/hf/config.json describes a model of "), error
    assert "of memory to import; this machine has" in error and error.endswith(" available"), error
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_config_json_sizes_are_checked(tmp_path, capsys):
    """Sizes that are not positive integers are refused by name; DeepSeek-V3's own config.json (671B
    parameters) by the memory it needs, before any file is opened."""
    hf_dir(tmp_path / "hf")
    cases = [({"hidden_size": "24"}, "hidden_size '24' is not a size (needs an integer from 1 to 2147483647)"),
             ({"num_hidden_layers": 0}, "num_hidden_layers 0 is not a size (needs an integer from 1 to 2147483647)"),
             ({"n_routed_experts": 2.5}, "n_routed_experts 2.5 is not a size (needs an integer from 1 to 2147483647)"),
             ({"vocab_size": True}, "vocab_size True is not a size (needs an integer from 1 to 2147483647)"),
             ({"first_k_dense_replace": -1},
              "first_k_dense_replace -1 is not a size (needs an integer from 0 to 2147483647)"),
             ({"kv_lora_rank": 2**31}, "kv_lora_rank 2147483648 is not a size (needs an integer from 1 to 2147483647)")]
    for change, message in cases:
        (tmp_path / "hf" / "config.json").write_text(json.dumps(HF | change))
        assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
        assert capsys.readouterr().err == f"error: {tmp_path}/hf/config.json: {message}\n"
    dsv3 = {k: v for k, v in HF.items() if k not in convert.HF_DEFAULTS} | {"n_group": 1, "topk_group": 1}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dsv3))
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}/hf/config.json describes a model of 671,026,419,200 parameters, which "
                          f"needs about "), err
    assert not os.path.exists(tmp_path / "run")


def test_from_hf_onto_a_full_disk_is_one_line(tmp_path, cpu_env):
    """RUN_DIR on a 64 KB disk: one line naming RUN_DIR and the space the checkpoint needs, nothing left (a
    traceback and exit 1 before)."""
    hf_dir(tmp_path / "hf")
    disk = tmp_path / "disk"
    os.makedirs(disk)
    mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk))
    try:
        error = one_error(from_hf(cpu_env, tmp_path / "hf", disk / "run", timeout=300))
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert error == (f"error: RUN_DIR {disk}/run needs about 0.6 MB; its disk has 0.1 MB free. Free some space or "
                     f"give another RUN_DIR"), error
