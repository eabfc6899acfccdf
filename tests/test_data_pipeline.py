"""Tokenization pipeline (data/shards.py and its two drivers): exactness, crash-resume, fsspec targets.

The kill tests run the real driver as a subprocess through tests/tokenize_faults.py, which watches its
writes and SIGKILLs it (and its pool) at chosen points; the in-process tests raise an exception at the
same points. `fakegcs://` (tests/fakegcs.py) is a local stand-in for a GCS bucket whose rename is
copy + delete (not atomic), like gcsfs; memory:// cannot outlive a killed process, so it gets a plain
write/read test. `src` and `reference_run` are conftest.py's.
"""
import os
import shutil

import fsspec
import numpy as np
import pytest

import dataset
import fakegcs
import tokenize_faults
from data import shards, sources
from data import tokenizer as tok
from data_util import (SHARD, corpus_documents, kill_chain, output_files, reference_tokens,
                       run_driver, shard_tokens, tokenize_docs)


def test_shards_equal_tiktoken_encoding(reference_run):
    m, toks = shard_tokens(reference_run)
    assert np.array_equal(toks, reference_tokens(tokenize_docs()))
    sizes = [s["tokens"] for s in m["shards"]]
    assert all(n == SHARD for n in sizes[:-1]) and 0 < sizes[-1] <= SHARD
    assert [s["split"] for s in m["shards"]] == ["val"] + ["train"] * (len(sizes) - 1)
    assert m["complete"] and m["tokenizer"] == "cl100k_base" and m["cursor"]["segment"] == 1
    assert len(sizes) >= 8


def test_local_file_types_share_the_datasets_path(tmp_path):
    docs = corpus_documents("val")[:5]
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": docs}), tmp_path / "a.parquet")
    for i, t in enumerate(docs):
        (tmp_path / "txt").mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    want = reference_tokens(docs)
    for source, field in [(str(tmp_path / "a.parquet"), "body"), (str(tmp_path / "txt"), "text")]:
        out = str(tmp_path / f"out_{field}")
        shards.tokenize(out, shards.make_plan(train_source=source, text_field=field), 1_000)
        m, toks = shard_tokens(out)
        assert np.array_equal(toks, want), source


def test_bundled_split_is_the_corpus_split(bundled_shards, jaxformer_cache):
    assert dataset.ensure_bundled_shards(jaxformer_cache) == bundled_shards    # cached
    m, toks = shard_tokens(bundled_shards)
    val = [s for s in m["shards"] if s["split"] == "val"]
    assert len(val) == 1
    n_val = val[0]["tokens"]
    assert np.array_equal(toks[:n_val], reference_tokens(corpus_documents("val")))
    assert np.array_equal(toks[n_val:], reference_tokens(corpus_documents("train")))
    assert not [p for p in os.listdir(jaxformer_cache) if ".tmp" in p]


class _Crash(Exception):
    pass


def crash():
    raise _Crash()


@pytest.mark.parametrize("event", tokenize_faults.EVENTS)
def test_resume_after_crash_at_every_point_in_process(src, reference_run, tmp_path, monkeypatch, event):
    """Crash (an exception where tokenize_faults.py would SIGKILL) at every n, resume, compare byte for byte."""
    want = output_files(reference_run)
    plan = shards.make_plan(src, val_shards=1)
    n_max = len(tokenize_docs()) if event == "doc" else len([k for k in want if k.endswith(".bin")])
    for n in range(1, n_max + 1, 2 if event == "doc" else 1):
        out = str(tmp_path / f"{event}{n}")
        with monkeypatch.context() as m:
            tokenize_faults.install(m.setattr, (event, n), crash)
            with pytest.raises(_Crash):
                shards.tokenize(out, plan, SHARD)
        shards.tokenize(out, plan, SHARD, resume=True)
        assert output_files(out) == want, (event, n)


def test_sigkill_resume_local(src, reference_run, tmp_path):
    # mid-shard (after 7 documents), torn temp file, right after a manifest update with a document
    # straddling the boundary, shard renamed but not yet in the manifest
    # (the in-process test above covers every point; this checks that a real kill -9 of the driver and
    # its pool behaves the same)
    points = ["doc:7", "tmp:2", "manifest:2", "shard:1"]
    carries = kill_chain(src, str(tmp_path / "out"), points, {})
    assert carries[2] > 0                       # that kill really was mid-document
    assert output_files(str(tmp_path / "out")) == output_files(reference_run)


def test_sigkill_resume_fake_gcs(src, reference_run, tmp_path, monkeypatch):
    env = {fakegcs.ROOT_ENV: str(tmp_path / "bucketroot")}
    monkeypatch.setenv(fakegcs.ROOT_ENV, env[fakegcs.ROOT_ENV])
    url = "fakegcs://bucket/tok"
    kill_chain(src, url, ["tmp:1", "manifest:3"], env, workers=1)
    assert output_files(url) == output_files(reference_run)
    ds = dataset.TokenDataset(url, "train", tok.VOCAB_SIZE)
    ref = dataset.TokenDataset(reference_run, "train", tok.VOCAB_SIZE)
    assert ds.n_tokens == ref.n_tokens and np.array_equal(ds.read(0, ds.n_tokens), ref.read(0, ref.n_tokens))


def test_memory_fs_write_and_read(src, reference_run, tmp_path):
    url = "memory://jaxformer-test/tok"
    shards.tokenize(url, shards.make_plan(src, val_shards=1), SHARD)
    assert output_files(url) == output_files(reference_run)
    for split in ("train", "val"):
        ds = dataset.TokenDataset(url, split, tok.VOCAB_SIZE)                  # range reads, no local copy
        ref = dataset.TokenDataset(reference_run, split, tok.VOCAB_SIZE)
        assert np.array_equal(ds.read(0, ds.n_tokens), ref.read(0, ref.n_tokens))
    fsspec.filesystem("memory").rm("/jaxformer-test", recursive=True)


def test_resume_refuses_other_settings(src, reference_run, tmp_path):
    out = str(tmp_path / "o")
    shutil.copytree(reference_run, out)
    with pytest.raises(FileExistsError, match="manifest.json"):
        shards.tokenize(out, shards.make_plan(src, val_shards=1), SHARD)
    with pytest.raises(ValueError, match="shard_size"):
        shards.tokenize(out, shards.make_plan(src, val_shards=1), SHARD + 1, resume=True)
    with pytest.raises(ValueError, match="different sources"):
        shards.tokenize(out, shards.make_plan(src, val_shards=2), SHARD, resume=True)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from data import tokenize_ray
    tokenize_ray.init_ray(num_cpus=2)
    yield ray
    ray.shutdown()


def test_multiprocessing_and_ray_drivers_are_byte_identical(local_ray, tmp_path):
    from data import tokenize_ray
    plan = shards.make_plan(sources.BUNDLED)
    mp_out, ray_out = str(tmp_path / "mp"), str(tmp_path / "ray")
    p = run_driver(["--source", "bundled", "--out", mp_out, "--shard_size", "100000", "--workers", "2"], {})
    assert "val: 1 shards" in p.stdout
    tokenize_ray.run(ray_out, plan, 100_000, progress=False, batch_docs=64)
    got = output_files(ray_out)
    assert got == output_files(mp_out) and len(got) == 12          # 11 shards + manifest
    _, toks = shard_tokens(ray_out)
    assert np.array_equal(toks, reference_tokens(corpus_documents("val") + corpus_documents("train")))


def test_source_spec_kinds(tmp_path):
    assert sources.source_spec("HuggingFaceFW/fineweb-edu", hf_config="sample-350BT")["kind"] == "hf"
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        sources.source_spec(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown type"):
        (tmp_path / "a.xyz").write_text("x")
        sources.source_spec(str(tmp_path / "a.xyz"))
    (tmp_path / "a.csv").write_text("text\nx\n")
    assert sources.source_spec(str(tmp_path / "a.csv"))["builder"] == "csv"
    with pytest.raises(FileNotFoundError, match="b.csv"):         # a missing local file never goes to the Hub
        sources.source_spec("b.csv")
    with pytest.raises(ValueError, match="already provides both splits"):
        shards.make_plan("bundled", train_source="x")
    with pytest.raises(ValueError, match="either --source or"):
        shards.make_plan("HuggingFaceFW/fineweb-edu", train_source="x")
