"""gs:// end to end against a real GCS server: the pinned gcp-storage-emulator on 127.0.0.1, conftest's
`gcs_emulator` (data/emulator.py says how gcsfs and tensorstore are pointed at it). Tokenize to gs:// with
kill -9 and --resume (byte-identical to a clean local run), train from gs:// shards with the run
directory on gs:// (checkpoints through Orbax/tensorstore, metrics as part objects), kill -9 and resume
exactly (the killed run's lock taken over), two processes of one run sharing one gs:// run directory, a second
run refused there, and the store going down under a run and a tokenizer (one line each, the unwritten
metrics spilled locally and written by the next start)."""
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
from run_util import MESH1, TINY_FLAGS, unoptimized
from ceiling import CEILING_S

BUCKET = "jaxformer"            # the bucket of conftest's gcs_emulator (the module's server)


def test_tokenize_to_gcs_kill_9_resume_is_byte_identical(gcs_emulator, src, reference_run):
    """Killed mid-shard, halfway through uploading a shard (a torn upload never becomes an object),
    right after a manifest update mid-document, after a shard upload before the manifest lists it:
    resumed, the bucket holds exactly the clean local run's bytes."""
    url = f"gs://{BUCKET}/tok"
    carries = kill_chain(src, url, ["doc:7", "tmp:2", "manifest:2", "shard:1"], gcs_emulator, workers=1)
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


def test_tokenize_to_a_bucket_that_does_not_exist_is_one_line(gcs_emulator):
    p = subprocess.run([sys.executable, "-m", "data.tokenize_local", "--source", "bundled", "--out",
                        "gs://nosuchbucket/x", "--workers", "0", "--no_progress"], cwd=REPO,
                       env=dict(os.environ, **gcs_emulator), capture_output=True, text=True, timeout=CEILING_S)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr[-3000:]
    assert p.stderr.startswith("error: --out gs://nosuchbucket/x: cannot write there (no such bucket, or this "
                               "account cannot see it: "), p.stderr


@pytest.fixture(scope="module")
def gs_shards(gcs_emulator, reference_run):
    url = f"gs://{BUCKET}/shards"
    fs, path = fsspec.core.url_to_fs(url)
    fs.put(reference_run.rstrip("/") + "/", path, recursive=True)
    return url


def _cmd(out, data_dir, steps, args=()):
    return [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, *MESH1, "--output_dir", out, "--name", "run",
            "--training_steps", str(steps), "--data_dir", data_dir, *args]


def _main(cpu_env, out, data_dir, steps, extra_env=None, args=()):
    return subprocess.run(_cmd(out, data_dir, steps, args), cwd=REPO, env=dict(cpu_env, **(extra_env or {})),
                          capture_output=True, text=True, timeout=CEILING_S)


def _kill_after_checkpoint(cpu_env, out, data_dir, step, log):
    """main.py on out, SIGKILLed (from outside) once Orbax lists its checkpoint of `step` as complete; the
    run is given 100 x more steps, so it cannot end first. Returns the newest complete checkpoint's step."""
    with open(log, "w") as f:
        proc = subprocess.Popen(_cmd(out, data_dir, 100 * step), cwd=REPO, env=cpu_env, stdout=f, stderr=f)
    deadline = time.time() + CEILING_S
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


def test_train_from_gcs_with_run_dir_on_gcs_kill_9_resumes_exactly(gcs_emulator, cpu_env, gs_shards, local_losses,
                                                                   tmp_path):
    """Same shards, local vs gs://: the same losses; on gs:// a kill -9 once the checkpoint of step 10 is
    complete and a restart continue bit-for-bit. Nothing is written to a local 'gs:' directory."""
    cpu_env, want = dict(cpu_env, **gcs_emulator), local_losses
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


def test_two_processes_share_one_gcs_run_dir(gcs_emulator, cpu_env, gs_shards, local_losses, tmp_path):
    """Two jax processes (one CPU device each, gloo) on one dp=2 mesh, reading gs:// shards and
    writing one gs:// run directory: each writes its own part of every checkpoint (Orbax, through
    tensorstore), process 0 the metrics; the losses are the one-process run's."""
    from launch_util import free_port
    out, steps = f"gs://{BUCKET}/two", 6
    # XLA at -O0: both processes compile this dp=2 program (of this test alone) at once; the losses are the same
    # to the tolerance below.
    e = dict(cpu_env, **gcs_emulator, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2",
             **unoptimized({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}))
    cmd = [sys.executable, os.path.join(REPO, "main.py"), *TINY_FLAGS, "--n_device_axis", "2", "1", "1",
           "--train_batch_size", "4", "--val_batch_size", "4", "--output_dir", out, "--name", "run",
           "--training_steps", str(steps), "--data_dir", gs_shards]
    logs = [tmp_path / f"process{i}.log" for i in (0, 1)]      # files, not pipes: neither can block on output
    procs = [subprocess.Popen(cmd, cwd=REPO, env=dict(e, JAX_PROCESS_ID=str(i)), stdout=open(logs[i], "w"),
                              stderr=subprocess.STDOUT) for i in (0, 1)]
    for p, log in zip(procs, logs):
        assert p.wait(timeout=CEILING_S) == 0, log.read_text()[-4000:]
    fs = fsspec.filesystem("gs")
    fs.invalidate_cache()
    got = _losses(rundir.read_run_file(f"{out}/run", "metrics.jsonl"))
    assert sorted(got) == list(range(1, steps + 1))
    np.testing.assert_allclose([got[k] for k in got], [local_losses[k] for k in got], rtol=1e-5, atol=1e-6)
    written = fs.find(f"{BUCKET}/two/run/checkpoints/{steps}")
    assert any("ocdbt.process_0" in w for w in written) and any("ocdbt.process_1" in w for w in written)


def test_second_run_is_refused_then_a_store_outage_is_one_line_and_the_next_start_loses_no_record(
        cpu_env, reference_run, tmp_path):
    """A run with its data and run directory on gs:// holds the directory: a second one (even with
    --restart) exits 2 naming the holder and touches nothing. Then the store goes down (the emulator killed
    from outside) while the run reads its data and a tokenizer writes there: each exits 1 with one error
    line naming its URL, no traceback, and the metrics the run could not write are spilled to a local file
    that one line names, with a part name no writer takes. The store back, the same command resumes from
    the checkpoint and writes the spill first: every step is in metrics.jsonl once, in order, and the
    resumed steps' losses are the first session's."""
    import gcsfs.core
    store = tmp_path / "store"
    store.mkdir()
    proc, url = emulator.start(bucket=BUCKET, data_dir=str(store))      # objects survive a restart on its port
    restore = emulator.point_this_process_at(url)
    e = dict(cpu_env, **emulator.emulator_env(url))
    out, data, log = f"gs://{BUCKET}/outage", f"gs://{BUCKET}/outage-shards", tmp_path / "first.log"
    fs = gcsfs.core.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)
    fs.put(reference_run.rstrip("/") + "/", data.removeprefix("gs://"), recursive=True)
    with open(log, "w") as f:          # a checkpoint (and its metrics part) at step 10, the next at 20
        first = subprocess.Popen(_cmd(out, data, 100_000), cwd=REPO, env=e, stdout=f, stderr=f)
    tokenizer = None
    try:
        deadline = time.time() + CEILING_S
        # the lock is taken before the compile that precedes the first step's line
        while not fs.exists(f"{BUCKET}/outage/run/lock") and "jaxformer started" not in log.read_text():
            assert first.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        lock = fs.info(f"{BUCKET}/outage/run/lock")
        second = subprocess.run(_cmd(out, data, 3, ["--restart"]), cwd=REPO, env=e, capture_output=True,
                                text=True, timeout=CEILING_S)
        assert second.returncode == 2, second.stderr[-4000:]
        assert f"{out}/run is in use by another run: pid {first.pid} on {socket.gethostname()}" in second.stderr
        fs.invalidate_cache()
        assert fs.info(f"{BUCKET}/outage/run/lock")["generation"] == lock["generation"]
        assert not fs.exists(f"{BUCKET}/outage/run/replaced")

        # the store goes down once the checkpoint of step 10 is complete (Orbax's mark on a bucket): its async
        # save can outlast step 12 on a loaded machine, and killed mid-save the run's error is the save's
        while "step     12 |" not in log.read_text() or not fs.exists(f"{BUCKET}/outage/run/checkpoints/10/"
                                                                         "commit_success.txt"):
            assert first.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
            fs.invalidate_cache()
        proc.kill()
        proc.wait()
        tokenizer = subprocess.run([sys.executable, "-m", "data.tokenize_local", "--source", "bundled", "--out",
                                    f"gs://{BUCKET}/tok", "--workers", "0", "--no_progress"], cwd=REPO, env=e,
                                   capture_output=True, text=True, timeout=CEILING_S)
        assert first.wait(timeout=CEILING_S) == 1, log.read_text()[-4000:]
        text = log.read_text()
        assert "Traceback" not in text and "ERROR:" not in text, text[-4000:]
        errors = re.findall(r"error: .*", text)          # after the progress bar's last refresh, on its line
        assert len(errors) == 1 and errors[0].startswith(f"error: could not read {data} (Cannot connect to host"), (
            text[-4000:])
        spill = re.search(r"WARNING: (\d+) record\(s\) could not be written to \S+ \(.*\); they are in (\S+): the "
                          r"next start of this run on this host writes them there first \(or by hand: upload it "
                          r"as (\S+), then delete", text)
        assert spill and spill[3] == f"{out}/run/metrics.jsonl.parts/000001.{os.path.basename(spill[2])}", text[-4000:]
        assert tokenizer.returncode == 1 and tokenizer.stderr.splitlines() == [
            f"error: --out gs://{BUCKET}/tok: its store did not answer (Cannot connect to host 127.0.0.1:"
            f"{url.rsplit(':', 1)[1]} ssl:default [Connect call failed ('127.0.0.1', {url.rsplit(':', 1)[1]})]); "
            f"rerun with --resume once it does: it continues exactly"], tokenizer.stderr[-4000:]
    finally:
        proc.kill()
        proc.wait()
        first.kill()
        first.wait()
    proc, url = emulator.start(port=int(url.rsplit(":", 1)[1]), bucket=BUCKET, data_dir=str(store))
    try:
        resumed = _main(e, out, data, 14)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert f"wrote {spill[1]} record(s) an earlier process could not write to {out}/run/metrics.jsonl" in (
            resumed.stdout)
        assert "resumed from" in resumed.stdout and not os.path.exists(spill[2])
        fs = gcsfs.core.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)
        parts = fs.ls(f"{BUCKET}/outage/run/metrics.jsonl.parts", detail=False)
        assert [p.rsplit("/", 1)[1] for p in parts if not p.rsplit("/", 1)[1].isdigit()] == [spill[3].rsplit("/", 1)[1]]
        recs = [r for r in map(json.loads, rundir.read_run_file(f"{out}/run", "metrics.jsonl").splitlines())
                if "loss" in r]
        before, after = recs[:-4], recs[-4:]               # the first session's steps, then the resumed 11-14
        assert [r["step"] for r in before] == list(range(1, len(before) + 1)) and len(before) >= 12, recs
        assert [r["step"] for r in after] == [11, 12, 13, 14]
        assert [r["loss"] for r in after if r["step"] <= len(before)] == [r["loss"] for r in before[10:14]]
    finally:
        proc.kill()
        proc.wait()
        restore()
