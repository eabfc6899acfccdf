"""gs:// end to end against a real GCS server: the pinned gcp-storage-emulator, started here on
127.0.0.1 (data/emulator.py says how gcsfs and tensorstore are pointed at it). Tokenize to gs:// with
kill -9 and --resume (byte-identical to a clean local run), train from gs:// shards with the run
directory on gs:// (checkpoints through Orbax/tensorstore, metrics as part objects), kill -9 and resume
exactly, and two processes sharing one gs:// run directory."""
import json
import os
import subprocess
import sys

import fsspec
import numpy as np
import pytest

from data import emulator, shards
from data import tokenizer as tok
import dataset
import main as jmain
from test_data_pipeline import REPO, SHARD, _files, _kill_chain, reference_run, src  # noqa: F401 (fixtures)
from test_main import MESH1, TINY, env  # noqa: F401 (fixture)

BUCKET = "jaxformer"


@pytest.fixture(scope="module")
def gcs():
    """The emulator, and this process pointed at it (gcsfs' plain GCSFileSystem, anonymous; tensorstore)."""
    proc, url = emulator.start(bucket=BUCKET)
    restore = emulator.point_this_process_at(url)
    yield emulator.emulator_env(url)
    proc.terminate()
    proc.wait(timeout=30)
    restore()


def test_tokenize_to_gcs_kill_9_resume_is_byte_identical(gcs, src, reference_run):
    """Killed mid-shard, halfway through uploading a shard (a torn upload never becomes an object),
    right after a manifest update mid-document, after a shard upload before the manifest lists it:
    resumed, the bucket holds exactly the clean local run's bytes."""
    url = f"gs://{BUCKET}/tok"
    carries = _kill_chain(src, url, ["doc:7", "tmp:2", "manifest:2", "shard:1"], gcs, workers=1)
    assert carries[2] > 0
    assert _files(url) == _files(reference_run)
    # the loader reads it by range, and it is what the local loader reads
    ds, ref = dataset.TokenDataset(url, "train", tok.VOCAB_SIZE), dataset.TokenDataset(reference_run, "train",
                                                                                         tok.VOCAB_SIZE)
    starts = [0, SHARD - 3, ds.n_tokens - 70]
    assert np.array_equal(ds.read_many(starts, 70), ref.read_many(starts, 70))
    assert ds.bytes_read == 3 * 70 * 4 and ds.unigram_entropy() == ref.unigram_entropy()
    from data import verify
    assert verify.verify(url, out=lambda *_: None) == []


@pytest.fixture(scope="module")
def gs_shards(gcs, reference_run):
    url = f"gs://{BUCKET}/shards"
    fs, path = fsspec.core.url_to_fs(url)
    fs.put(reference_run.rstrip("/") + "/", path, recursive=True)
    return url


def _main(env, out, data_dir, steps, hook=None, extra_env=None, args=()):
    e = dict(env, **(extra_env or {}))
    if hook:
        e["JAXFORMER_TEST_SIGNAL"] = hook
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY, *MESH1, "--output_dir", out, "--name", "run",
           "--training_steps", str(steps), "--data_dir", data_dir, *args]
    return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=900)


def _losses(text):
    return {r["step"]: r["loss"] for r in map(json.loads, text.splitlines()) if "loss" in r}


def test_train_from_gcs_with_run_dir_on_gcs_kill_9_resumes_exactly(gcs, env, gs_shards, reference_run,
                                                                     tmp_path):
    """Same shards, local vs gs://: the same losses; on gs:// a kill -9 after step 12 (last checkpoint
    10) and a restart continue bit-for-bit. Nothing is written to a local 'gs:' directory."""
    env = dict(env, **gcs)
    local = _main(env, str(tmp_path / "runs"), reference_run, 14)
    assert local.returncode == 0, local.stderr[-4000:]
    want = _losses((tmp_path / "runs" / "run" / "metrics.jsonl").read_text())
    out = f"gs://{BUCKET}/runs"
    killed = _main(env, out, gs_shards, 14, hook="12:KILL")
    assert killed.returncode == -9, killed.stderr[-4000:]
    fs = fsspec.filesystem("gs")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/runs/run/checkpoints", detail=False)) == ["10"]
    resumed = _main(env, out, gs_shards, 14)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
    fs.invalidate_cache()
    got = _losses(jmain.read_run_file(f"{out}/run", "metrics.jsonl"))
    assert sorted(got) == list(range(1, 15)) and got == want
    parts = fs.ls(f"{BUCKET}/runs/run/metrics.jsonl.parts", detail=False)
    assert len(parts) >= 2 and not fs.exists(f"{BUCKET}/runs/run/metrics.jsonl")   # whole objects, no appends
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/runs/run/checkpoints", detail=False)) == ["10", "14"]
    assert not os.path.exists(os.path.join(REPO, "gs:")) and not os.path.exists(os.path.join(REPO, "gs"))
