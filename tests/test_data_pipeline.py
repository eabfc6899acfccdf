"""Tokenization pipeline (data/shards.py and its two drivers): exactness, crash-resume, fsspec targets.

The kill tests run the real driver as a subprocess and SIGKILL it through the JAXFORMER_TOKENIZE_KILL_AT
hook (data/shards.py). `fakegcs://` is a local stand-in for a GCS bucket whose rename is copy + delete
(not atomic), like gcsfs; memory:// cannot outlive a killed process, so it gets a plain write/read test.
"""
import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import fsspec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data import corpus, shards  # noqa: E402
from data import tokenizer as tok  # noqa: E402
import dataset  # noqa: E402
from data_util import reference_tokens, shard_tokens  # noqa: E402

FAKEGCS_ROOT_ENV = "FAKEGCS_ROOT"


# Executed here and at the start of the driver subprocesses (which should not pay for importing JAX).
FAKEGCS_SRC = '''
import os
import fsspec
from fsspec.implementations.local import LocalFileSystem


class FakeGCSFileSystem(LocalFileSystem):
    """fakegcs://bucket/key -> $FAKEGCS_ROOT/bucket/key; mv = copy then delete, as on GCS."""
    protocol = ("fakegcs",)
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("fakegcs://"):
            path = os.path.join(os.environ["FAKEGCS_ROOT"], path[len("fakegcs://"):])
        return path.rstrip("/") or "/"

    def mv(self, path1, path2, **kwargs):
        self.cp_file(path1, path2)
        self.rm_file(path1)


fsspec.register_implementation("fakegcs", FakeGCSFileSystem, clobber=True)
'''
exec(FAKEGCS_SRC)


def _docs():
    """Small, varied documents: the val chapters, an empty one, and one longer than two shards."""
    val = corpus.documents("val")
    return val[:20] + [""] + ["\n\n".join(corpus.documents("train")[:12])] + val[20:]


SHARD = 2_500


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    path = d / "docs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for t in _docs():
            f.write(json.dumps({"text": t, "meta": 1}) + "\n")
    return str(path)


def _files(out_url):
    out = shards.Output(out_url)
    res = {}
    for name in out.list():
        with out.fs.open(out.path(name), "rb") as f:
            res[name] = f.read()
    return res


@pytest.fixture(scope="module")
def reference_run(src, tmp_path_factory):
    """Uninterrupted in-process run of the small source: 1 val shard, the rest train."""
    out = str(tmp_path_factory.mktemp("ref") / "out")
    plan = shards.make_plan(src, val_shards=1)
    shards.tokenize(out, plan, SHARD)
    return out


def test_shards_equal_tiktoken_encoding(reference_run):
    m, toks = shard_tokens(reference_run)
    assert np.array_equal(toks, reference_tokens(_docs()))
    sizes = [s["tokens"] for s in m["shards"]]
    assert all(n == SHARD for n in sizes[:-1]) and 0 < sizes[-1] <= SHARD
    assert [s["split"] for s in m["shards"]] == ["val"] + ["train"] * (len(sizes) - 1)
    assert m["complete"] and m["tokenizer"] == "cl100k_base" and m["cursor"]["segment"] == 1
    assert len(sizes) >= 8


def test_local_file_types_share_the_datasets_path(tmp_path):
    docs = corpus.documents("val")[:5]
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


def test_bundled_split_is_the_corpus_split(tmp_path):
    d = dataset.ensure_bundled_shards(str(tmp_path / "cache"))
    assert dataset.ensure_bundled_shards(str(tmp_path / "cache")) == d    # cached
    m, toks = shard_tokens(d)
    val = [s for s in m["shards"] if s["split"] == "val"]
    assert len(val) == 1
    n_val = val[0]["tokens"]
    assert np.array_equal(toks[:n_val], reference_tokens(corpus.documents("val")))
    assert np.array_equal(toks[n_val:], reference_tokens(corpus.documents("train")))
    assert not [p for p in os.listdir(tmp_path / "cache") if ".tmp" in p]


class _Crash(Exception):
    pass


@pytest.mark.parametrize("event", ["doc", "tmp", "shard", "manifest"])
def test_resume_after_crash_at_every_point_in_process(src, reference_run, tmp_path, monkeypatch, event):
    """Crash (an exception where the kill hook fires) at every n, resume, compare byte for byte."""
    want = _files(reference_run)
    plan = shards.make_plan(src, val_shards=1)
    n_max = len(_docs()) if event == "doc" else len([k for k in want if k.endswith(".bin")])
    for n in range(1, n_max + 1, 2 if event == "doc" else 1):
        out = str(tmp_path / f"{event}{n}")
        monkeypatch.setenv(shards.KILL_ENV, f"{event}:{n}")

        def crash(ev, k):
            if shards._kill_point() == (ev, k):
                raise _Crash()
        monkeypatch.setattr(shards, "_maybe_kill", crash)
        with pytest.raises(_Crash):
            shards.tokenize(out, plan, SHARD)
        monkeypatch.delenv(shards.KILL_ENV)
        shards.tokenize(out, plan, SHARD, resume=True)
        assert _files(out) == want, (event, n)


def _driver(args, env_extra, check=True):
    code = "import sys; sys.path.insert(0, %r); exec(%r); from data.tokenize_local import main; " \
           "main(sys.argv[1:])" % (REPO, FAKEGCS_SRC)
    env = dict(os.environ)
    env.pop(shards.KILL_ENV, None)
    env.update(env_extra)
    p = subprocess.run([sys.executable, "-c", code, *args, "--no_progress"], env=env, cwd=REPO,
                       start_new_session=True, capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def _kill_chain(src, out, points, env, workers=2):
    """Run the multiprocessing driver, SIGKILLed at each point in turn, then resume to the end."""
    args = ["--source", src, "--out", out, "--shard_size", str(SHARD), "--val_shards", "1",
            "--workers", str(workers), "--batch_docs", "4"]
    carries = []
    for i, point in enumerate(points):
        p = _driver(args + (["--resume"] if i else []), dict(env, **{shards.KILL_ENV: point}), check=False)
        assert p.returncode == -9, (point, p.returncode, p.stderr[-3000:])
        m = json.loads(shards.Output(out).read_text(shards.MANIFEST)) if shards.Output(out).exists(
            shards.MANIFEST) else None
        assert m is None or not m["complete"]
        carries.append(m and m["cursor"]["carry"])
    _driver(args + ["--resume"], env)
    return carries


def test_sigkill_resume_local(src, reference_run, tmp_path):
    # mid-shard (after 7 documents), torn temp file, right after a manifest update with a document
    # straddling the boundary, shard renamed but not yet in the manifest
    # (the in-process test above covers every point; this checks that a real kill -9 of the driver and
    # its pool behaves the same)
    points = ["doc:7", "tmp:2", "manifest:2", "shard:1"]
    carries = _kill_chain(src, str(tmp_path / "out"), points, {})
    assert carries[2] > 0                       # that kill really was mid-document
    assert _files(str(tmp_path / "out")) == _files(reference_run)


def test_sigkill_resume_fake_gcs(src, reference_run, tmp_path, monkeypatch):
    env = {FAKEGCS_ROOT_ENV: str(tmp_path / "bucketroot")}
    monkeypatch.setenv(FAKEGCS_ROOT_ENV, env[FAKEGCS_ROOT_ENV])
    url = "fakegcs://bucket/tok"
    _kill_chain(src, url, ["tmp:1", "manifest:3"], env, workers=1)
    assert _files(url) == _files(reference_run)
    ds = dataset.TokenDataset(url, "train", tok.VOCAB_SIZE)
    ref = dataset.TokenDataset(reference_run, "train", tok.VOCAB_SIZE)
    assert ds.n_tokens == ref.n_tokens and np.array_equal(ds.read(0, ds.n_tokens), ref.read(0, ref.n_tokens))


def test_memory_fs_write_and_read(src, reference_run, tmp_path):
    url = "memory://jaxformer-test/tok"
    shards.tokenize(url, shards.make_plan(src, val_shards=1), SHARD)
    assert _files(url) == _files(reference_run)
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
    plan = shards.make_plan(shards.BUNDLED)
    mp_out, ray_out = str(tmp_path / "mp"), str(tmp_path / "ray")
    p = _driver(["--source", "bundled", "--out", mp_out, "--shard_size", "100000", "--workers", "2"], {})
    assert "val: 1 shards" in p.stdout
    tokenize_ray.run(ray_out, plan, 100_000, progress=False, batch_docs=64)
    got = _files(ray_out)
    assert got == _files(mp_out) and len(got) == 12          # 11 shards + manifest
    _, toks = shard_tokens(ray_out)
    assert np.array_equal(toks, reference_tokens(corpus.documents("val") + corpus.documents("train")))


def test_source_spec_kinds(tmp_path):
    assert shards.source_spec("HuggingFaceFW/fineweb-edu", hf_config="sample-350BT")["kind"] == "hf"
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        shards.source_spec(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown type"):
        (tmp_path / "a.xyz").write_text("x")
        shards.source_spec(str(tmp_path / "a.xyz"))
    (tmp_path / "a.csv").write_text("text\nx\n")
    assert shards.source_spec(str(tmp_path / "a.csv"))["builder"] == "csv"
    with pytest.raises(FileNotFoundError, match="b.csv"):         # a missing local file never goes to the Hub
        shards.source_spec("b.csv")
    with pytest.raises(ValueError, match="already provides both splits"):
        shards.make_plan("bundled", train_source="x")
    with pytest.raises(ValueError, match="either --source or"):
        shards.make_plan("HuggingFaceFW/fineweb-edu", train_source="x")
