"""gs:// end to end against a real GCS server: the pinned gcp-storage-emulator, started here on
127.0.0.1 (data/emulator.py says how gcsfs and tensorstore are pointed at it). Tokenize to gs:// with
kill -9 and --resume (byte-identical to a clean local run), train from gs:// shards with the run
directory on gs:// (checkpoints through Orbax/tensorstore, metrics as part objects), kill -9 and resume
exactly (the killed run's lock taken over), two processes of one run sharing one gs:// run directory, a second
run refused there, and the store going down mid-run (one line, the unwritten metrics spilled locally)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import fsspec
import numpy as np
import pytest

from data import emulator
from data import tokenizer as tok
import dataset
import checkpoints
import rundir
from data_util import REPO, SHARD, kill_chain, output_files
from test_main import MESH1, TINY
from opt_in import slow

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
    carries = kill_chain(src, url, ["doc:7", "tmp:2", "manifest:2", "shard:1"], gcs, workers=1)
    assert carries[2] > 0
    assert output_files(url) == output_files(reference_run)
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


def _cmd(out, data_dir, steps, args=()):
    return [sys.executable, os.path.join(REPO, "main.py"), *TINY, *MESH1, "--output_dir", out, "--name", "run",
            "--training_steps", str(steps), "--data_dir", data_dir, *args]


def _main(cpu_env, out, data_dir, steps, extra_env=None, args=()):
    return subprocess.run(_cmd(out, data_dir, steps, args), cwd=REPO, env=dict(cpu_env, **(extra_env or {})),
                          capture_output=True, text=True, timeout=900)


def _kill_after_checkpoint(cpu_env, out, data_dir, step, log):
    """main.py on out, SIGKILLed (from outside) once Orbax lists its checkpoint of `step` as complete; the
    run is given 100 x more steps, so it cannot end first. Returns the newest complete checkpoint's step."""
    with open(log, "w") as f:
        proc = subprocess.Popen(_cmd(out, data_dir, 100 * step), cwd=REPO, env=cpu_env, stdout=f, stderr=f)
    deadline = time.time() + 900
    while (newest := _newest_checkpoint(out)) is None or newest < step:
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    return _newest_checkpoint(out)


def _newest_checkpoint(out):
    fsspec.filesystem("gs").invalidate_cache()
    with checkpoints.checkpoint_manager(f"{out}/run", read_only=True) as mngr:
        return mngr.latest_step()


def _losses(text):
    return {r["step"]: r["loss"] for r in map(json.loads, text.splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def local_losses(cpu_env, reference_run, tmp_path_factory):
    """The reference: the same shards from a local directory, run dir local, one process."""
    out = tmp_path_factory.mktemp("local")
    p = _main(cpu_env, str(out), reference_run, 14)
    assert p.returncode == 0, p.stderr[-4000:]
    return _losses((out / "run" / "metrics.jsonl").read_text())


def test_train_from_gcs_with_run_dir_on_gcs_kill_9_resumes_exactly(gcs, cpu_env, gs_shards, local_losses, tmp_path):
    """Same shards, local vs gs://: the same losses; on gs:// a kill -9 once the checkpoint of step 10 is
    complete and a restart continue bit-for-bit. Nothing is written to a local 'gs:' directory."""
    cpu_env, want = dict(cpu_env, **gcs), local_losses
    out = f"gs://{BUCKET}/runs"
    assert _kill_after_checkpoint(cpu_env, out, gs_shards, 10, tmp_path / "killed.log") == 10
    fs = fsspec.filesystem("gs")
    resumed = _main(cpu_env, out, gs_shards, 14)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    # the killed run's lock is left; its process is gone from this host: taken over, released at the end
    assert f"WARNING: taking over {out}/run/lock: pid " in resumed.stdout
    assert f"resumed from {out}/run/checkpoints/10: step 10," in resumed.stdout
    assert not fs.exists(f"{BUCKET}/runs/run/lock")
    fs.invalidate_cache()
    got = _losses(rundir.read_run_file(f"{out}/run", "metrics.jsonl"))
    assert sorted(got) == list(range(1, 15)) and got == want
    parts = fs.ls(f"{BUCKET}/runs/run/metrics.jsonl.parts", detail=False)
    assert len(parts) >= 2 and not fs.exists(f"{BUCKET}/runs/run/metrics.jsonl")   # whole objects, no appends
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/runs/run/checkpoints", detail=False)) == ["10", "14"]
    assert not os.path.exists(os.path.join(REPO, "gs:")) and not os.path.exists(os.path.join(REPO, "gs"))


@slow
def test_two_processes_share_one_gcs_run_dir(gcs, cpu_env, gs_shards, local_losses, tmp_path):
    """Two jax processes (one CPU device each, gloo) on one dp=2 mesh, reading gs:// shards and
    writing one gs:// run directory: each writes its own part of every checkpoint (Orbax, through
    tensorstore), process 0 the metrics; the losses are the one-process run's."""
    from launch_util import free_port
    out, steps = f"gs://{BUCKET}/two", 6
    e = dict(cpu_env, **gcs, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2",
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY, "--n_device_axis", "2", "1", "1",
           "--train_batch_size", "4", "--val_batch_size", "4", "--output_dir", out, "--name", "run",
           "--training_steps", str(steps), "--data_dir", gs_shards]
    logs = [tmp_path / f"process{i}.log" for i in (0, 1)]      # files, not pipes: neither can block on output
    procs = [subprocess.Popen(cmd, cwd=REPO, env=dict(e, JAX_PROCESS_ID=str(i)), stdout=open(logs[i], "w"),
                              stderr=subprocess.STDOUT) for i in (0, 1)]
    for p, log in zip(procs, logs):
        assert p.wait(timeout=900) == 0, log.read_text()[-4000:]
    fs = fsspec.filesystem("gs")
    fs.invalidate_cache()
    got = _losses(rundir.read_run_file(f"{out}/run", "metrics.jsonl"))
    assert sorted(got) == list(range(1, steps + 1))
    np.testing.assert_allclose([got[k] for k in got], [local_losses[k] for k in got], rtol=1e-5, atol=1e-6)
    written = fs.find(f"{BUCKET}/two/run/checkpoints/{steps}")
    assert any("ocdbt.process_0" in w for w in written) and any("ocdbt.process_1" in w for w in written)


@slow
def test_second_run_is_refused_then_a_store_outage_is_one_line_and_loses_no_record(cpu_env, reference_run, tmp_path):
    """A run on gs:// holds its directory: a second one (even with --restart) exits 2 naming the holder and
    touches nothing. Then the store goes down (the emulator killed from outside): the first exits 1 with one
    error line naming the URL, no traceback, and the metrics it could not write spilled to a local file that
    one line names; uploaded as that line says once the store is back, the run's metrics miss no step."""
    import gcsfs.core
    store = tmp_path / "store"
    store.mkdir()
    proc, url = emulator.start(bucket=BUCKET, data_dir=str(store))      # objects survive a restart on its port
    restore = emulator.point_this_process_at(url)
    e = dict(cpu_env, **emulator.emulator_env(url))
    out, log = f"gs://{BUCKET}/outage", tmp_path / "first.log"
    fs = gcsfs.core.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)
    with open(log, "w") as f:          # saves every 50 steps: the store goes down long before the first
        first = subprocess.Popen(_cmd(out, reference_run, 100_000, ["--checkpoint_steps", "5"]), cwd=REPO, env=e,
                                 stdout=f, stderr=f)
    try:
        deadline = time.time() + 600
        # the lock is taken before the compile that precedes the first step's line
        while not fs.exists(f"{BUCKET}/outage/run/lock") and "jaxformer started" not in log.read_text():
            assert first.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        lock = fs.info(f"{BUCKET}/outage/run/lock")
        second = subprocess.run(_cmd(out, reference_run, 3, ["--restart"]), cwd=REPO, env=e, capture_output=True,
                                text=True, timeout=600)
        assert second.returncode == 2, second.stderr[-4000:]
        assert f"{out}/run is in use by another run: pid {first.pid} on {socket.gethostname()}" in second.stderr
        fs.invalidate_cache()
        assert fs.info(f"{BUCKET}/outage/run/lock")["generation"] == lock["generation"]
        assert not fs.exists(f"{BUCKET}/outage/run/replaced")

        while "step     10 |" not in log.read_text():
            assert first.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        proc.kill()
        proc.wait()
        assert first.wait(timeout=600) == 1, log.read_text()[-4000:]
        text = log.read_text()
        assert "Traceback" not in text and "ERROR:" not in text, text[-4000:]
        errors = re.findall(r"error: .*", text)          # after the progress bar's last refresh, on its line
        assert len(errors) == 1 and f"in {out}/run/checkpoints: Cannot connect to host" in errors[0], text[-4000:]
        spill = re.search(r"WARNING: (\d+) record\(s\) could not be written to (\S+) \(.*\); they are in (\S+): "
                          r"upload it as (\S+) when the store is back", text)
        assert spill and spill[2] == spill[4] and spill[2].startswith(f"{out}/run/metrics.jsonl.parts/"), text[-4000:]
    finally:
        proc.kill()
        proc.wait()
        first.kill()
        first.wait()
    proc, url = emulator.start(port=int(url.rsplit(":", 1)[1]), bucket=BUCKET, data_dir=str(store))
    try:
        fs = gcsfs.core.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)
        fs.put_file(spill[3], spill[4])
        got = [json.loads(line) for line in fs.cat_file(f"{BUCKET}/outage/run/metrics.jsonl.parts/{spill[4][-6:]}")
               .decode().splitlines()]
        assert len(got) == int(spill[1])
        parts = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/outage/run/metrics.jsonl.parts", detail=False))
        text = "".join(fs.cat_file(f"{BUCKET}/outage/run/metrics.jsonl.parts/{p}").decode() for p in parts)
        steps = [r["step"] for r in map(json.loads, text.splitlines()) if "loss" in r]
        assert steps == list(range(1, 51)), steps
    finally:
        proc.kill()
        proc.wait()
        restore()
