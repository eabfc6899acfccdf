"""main.py on data it cannot train on, as a user meets it: exit 2 and one `error:` line naming the flag
(or environment variable) to change and what to do, no traceback, nothing half-written; corrupt token
ids are found as they are read. Every case fails before anything is compiled (a second or two each).
The shard directory is a copy of conftest.py's `reference_run` (one val shard, the rest train)."""
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys

import numpy as np
import pytest

from run_util import REPO, TINY_FLAGS, run
from ceiling import CEILING_S

VAL = "val_000000.bin"


def error_line(proc):
    """The one line main.py printed for the error (checked: exit 2, no traceback)."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.strip().endswith(errors[0]), proc.stderr[-3000:]
    return errors[0]


@pytest.fixture
def shard_copy(reference_run, tmp_path):
    d = tmp_path / "shards"
    shutil.copytree(reference_run, d)
    return d


def _write_manifest(d, text):
    (d / "manifest.json").write_text(text)


def _truncate(d, name="train_000001.bin"):
    with open(d / name, "r+b") as f:
        f.truncate(os.path.getsize(d / name) - 4)


# (what to do to a copy of the shards, extra flags, what the error line must say; {d} is the copy)
BROKEN = [
    (lambda d: shutil.rmtree(d), [], "--data_dir {d}: {d}: no such directory; tokenize into it first"),
    (lambda d: [os.remove(p) for p in d.iterdir()], [], "--data_dir {d}: {d}/manifest.json: no manifest"),
    (_truncate, [], "--data_dir {d}: shard {d}/train_000001.bin is truncated or corrupt: 9996 bytes, the manifest "
                    "says 2500 tokens (10000 bytes); python -m data.verify {d} checks every shard; tokenize the data "
                    "again into an empty --out"),
    (lambda d: _write_manifest(d, '{"format": 1,'), [], "--data_dir {d}: {d}/manifest.json: not valid JSON"),
    (lambda d: os.remove(d / VAL), [], f"--data_dir {{d}}: shard {{d}}/{VAL} listed in the manifest is missing"),
    (lambda d: None, ["--T", "4096"], "--T 4096: split 'val' of {d}/manifest.json has 2500 tokens = 0 windows"),
    (lambda d: None, ["--vocab_size", "1000"], "tokenizer vocab 100277 exceeds --vocab_size 1000; use --vocab_size "
                                               "100277 or more"),
]


@pytest.mark.parametrize("breakage,flags,message", BROKEN,
                         ids=["no-dir", "empty-dir", "truncated-shard", "bad-manifest", "missing-shard", "T", "vocab"])
def test_data_that_does_not_fit_is_one_line_naming_the_flag(cpu_env, shard_copy, tmp_path, breakage, flags, message):
    breakage(shard_copy)
    proc = run(cpu_env, tmp_path, "--data_dir", str(shard_copy), *flags, expect=2)
    assert message.format(d=shard_copy) in error_line(proc)
    assert not os.path.exists(tmp_path / "run"), os.listdir(tmp_path)      # no empty run directory left


@pytest.mark.parametrize("bad_id", [0xFFFFFFFF, 100277], ids=["2**32-1", "vocab_size"])
def test_a_token_id_outside_the_vocabulary_is_found_as_read(cpu_env, shard_copy, tmp_path, bad_id):
    """A shard whose size and sha256 agree with the manifest but holds an id >= --vocab_size (2**32 - 1 is no
    -1): the run stops with exit 2 naming the shard and the token's offset in it."""
    tokens = np.fromfile(shard_copy / VAL, dtype="<u4")
    tokens[5] = bad_id                         # inside the first validation window, read before any step
    tokens.tofile(shard_copy / VAL)
    m = json.loads((shard_copy / "manifest.json").read_text())
    for s in m["shards"]:
        if s["file"] == VAL:
            s["sha256"] = hashlib.sha256((shard_copy / VAL).read_bytes()).hexdigest()
    _write_manifest(shard_copy, json.dumps(m))
    proc = run(cpu_env, tmp_path, "--data_dir", str(shard_copy), expect=2)
    assert (f"error: shard {shard_copy}/{VAL} holds token id {bad_id} >= --vocab_size 100277 at token 5 (byte 20)"
            in error_line(proc))


def test_a_cache_where_nothing_can_be_written(cpu_env, tmp_path):
    (tmp_path / "file").write_text("")         # a file where the cache's parent directory should be
    cache = tmp_path / "file" / "cache"
    proc = run(cpu_env, tmp_path, extra_env={"JAXFORMER_CACHE": str(cache)}, expect=2)
    assert f"error: JAXFORMER_CACHE={cache}: cannot write the bundled corpus' shards there" in error_line(proc)


def test_a_cache_that_fills_up_leaves_nothing_half_written(cpu_env, tmp_path):
    """No file may outgrow 64 KiB (as a full disk: the bundled val shard is 85 KB): one line, and no
    partial shard directory in the cache for the next run to trip over."""
    cache = tmp_path / "cache"
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, "--output_dir", str(tmp_path), "--name", "run"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(cpu_env, JAXFORMER_CACHE=str(cache)), capture_output=True,
                          text=True, timeout=CEILING_S,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16)))
    assert f"error: JAXFORMER_CACHE={cache}: cannot write the bundled corpus' shards there" in error_line(proc)
    assert os.listdir(cache) == []


def test_a_damaged_bundled_cache_is_built_again(cpu_env, bundled_shards, tmp_path):
    """The bundled corpus' cache is main.py's own: a shard of it cut short (a full disk, a copy cut short)
    is tokenized again at start, with a line saying so, rather than refused with advice to re-tokenize."""
    cache = tmp_path / "cache"
    shutil.copytree(bundled_shards, cache / os.path.basename(bundled_shards))
    _truncate(cache / os.path.basename(bundled_shards), "train_000000.bin")
    proc = run(cpu_env, tmp_path, extra_env={"JAXFORMER_CACHE": str(cache)}, steps=1)
    assert (f"tokenizing the bundled corpus (the King James Bible) into {cache / os.path.basename(bundled_shards)}, "
            f"once more: the cached shards there are incomplete or damaged") in proc.stdout
    assert "final: val cross-entropy" in proc.stdout
