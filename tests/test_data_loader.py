"""dataset.py: deterministic batches, exact restart, per-host rows, validation set, clear errors."""
import importlib.util
import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dataset
from data import shards
from data import tokenizer as tok
from data_util import REPO, corpus_documents

T, B = 32, 16


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small shard directory: ~21k val tokens in 3000-token shards (val) and a few train docs."""
    d = str(tmp_path_factory.mktemp("shards") / "out")
    src = tmp_path_factory.mktemp("src")
    (src / "val").mkdir()
    (src / "train").mkdir()
    for i, t in enumerate(corpus_documents("val")[:6]):
        (src / "val" / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    for i, t in enumerate(corpus_documents("train")[:8]):
        (src / "train" / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    plan = shards.make_plan(train_source=str(src / "train"), val_source=str(src / "val"))
    shards.tokenize(d, plan, 3_000)
    return d


def _mesh(shape=(2, 2, 2)):
    return Mesh(np.array(jax.devices()).reshape(shape), ("dp", "pp", "tp"))


def _sharding(shape=(2, 2, 2)):
    return NamedSharding(_mesh(shape), P("dp", None))


def _np(batch):
    return tuple(np.asarray(a) for a in batch)


def test_batch_layout_and_shift(data_dir):
    ds = dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE)
    assert len(ds.files) > 1 and ds.n_tokens == sum(ds.sizes)
    sh = _sharding()
    loader = dataset.BatchLoader(ds, T, B, sh, seed=0)
    x, y = loader.batch(7)
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int32
    assert x.sharding == sh and y.sharding == sh
    xn, yn = _np((x, y))
    ids = loader.window_ids(7)
    for r in range(B):                          # row r is window ids[r]: tokens [w*T, w*T + T + 1)
        w = ds.read(int(ids[r]) * T, T + 1)
        assert np.array_equal(xn[r], w[:-1]) and np.array_equal(yn[r], w[1:])
    # every device holds its dp block of rows, whole columns, identical across pp/tp
    for shard in x.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), xn[shard.index])


def test_batch_is_pure_function_of_step_restart(data_dir):
    sh = _sharding()
    a = dataset.BatchLoader(dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE), T, B, sh, seed=3)
    steps = [0, 1, 5, 40, 41]                   # 40+ crosses into later epochs
    before = {s: _np(a.batch(s)) for s in steps}
    # "restart": fresh objects, batches requested in a different order, and via the prefetch iterator
    b = dataset.BatchLoader(dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE), T, B, sh, seed=3)
    for s in reversed(steps):
        assert all(np.array_equal(u, v) for u, v in zip(_np(b.batch(s)), before[s])), s
    it = b.iterate(40)
    for s in (40, 41):
        assert all(np.array_equal(u, v) for u, v in zip(_np(next(it)), before[s]))
    b.close()
    # another seed gives another order; the mesh shape does not change the data of a step
    c = dataset.BatchLoader(dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE), T, B, sh, seed=4)
    assert not np.array_equal(_np(c.batch(0))[0], before[0][0])
    d = dataset.BatchLoader(dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE), T, B, _sharding((8, 1, 1)),
                            seed=3)
    assert all(np.array_equal(u, v) for u, v in zip(_np(d.batch(5)), before[5]))


def test_a_resume_continues_after_the_sequences_consumed_whatever_the_batch_size(data_dir):
    """The data position is a count of sequences: a loader of half the batch started after 3 batches of
    the first (consumed = position(3)) reads exactly the rows the first would read next."""
    ds = dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE)
    a = dataset.BatchLoader(ds, T, B, _sharding(), seed=2)
    b = dataset.BatchLoader(ds, T, B // 2, _sharding(), seed=2, consumed=a.position(3))
    assert a.position(3) == b.position(0) == 3 * B and b.position(1) == 3 * B + B // 2
    assert np.array_equal(np.concatenate([b.window_ids(0), b.window_ids(1)]), a.window_ids(3))


def test_epochs_are_permutations_and_no_window_past_end(data_dir):
    ds = dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE)
    loader = dataset.BatchLoader(ds, T, B, _sharding(), seed=1)
    n = loader.n_windows
    assert n == (ds.n_tokens - 1) // T
    ids = np.concatenate([loader.window_ids(s) for s in range(3 * n // B + 2)])
    for e in range(3):
        epoch = ids[e * n:(e + 1) * n]
        assert sorted(epoch.tolist()) == list(range(n))      # each window exactly once per epoch
    assert not np.array_equal(ids[:n], ids[n:2 * n])           # reshuffled per epoch
    assert int(ids.max()) * T + T + 1 <= ds.n_tokens            # never past the end
    # the last window ends at most at the last token; one more would not fit
    assert ds.read((n - 1) * T, T + 1).shape == (T + 1,)
    with pytest.raises(IndexError):
        ds.read(n * T, T + 1)


def test_shuffle_is_a_permutation_of_any_size_without_materialising_it():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        p = dataset.shuffled_positions(np.arange(n), n, seed=0, epoch=0)
        assert sorted(p.tolist()) == list(range(n)), n
    n = 10_007
    a, b, c = (dataset.shuffled_positions(np.arange(n), n, s, e) for s, e in ((0, 0), (0, 1), (1, 0)))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05                 # no trace of the input order
    # any positions of a huge epoch, cheaply, and the same whichever way they are asked for
    big = 350 * 10**9 // 1024
    pos = np.array([0, 1, big // 2, big - 1], dtype=np.int64)
    q = dataset.shuffled_positions(pos, big, 3, 2)
    assert np.all((q >= 0) & (q < big)) and len(set(q.tolist())) == 4
    assert np.array_equal(q[[2, 0]], dataset.shuffled_positions(pos[[2, 0]], big, 3, 2))


def test_two_hosts_read_exactly_the_global_batch(data_dir):
    """Simulate two processes holding devices 0-3 and 4-7: each reads only its rows, together all."""
    sh = _sharding((2, 2, 2))
    step = 9
    full = dataset.BatchLoader(dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE), T, B, sh, seed=0)
    xg, yg = _np(full.batch(step))
    devs = jax.devices()
    parts = []
    for half in (devs[:4], devs[4:]):
        ds = dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE)
        host = dataset.BatchLoader(ds, T, B, sh, seed=0)
        rows = host.local_rows(half)
        block = host.read_rows(step, rows)
        assert ds.bytes_read == 4 * len(rows) * (T + 1)         # nothing but its own rows
        parts.append((rows, block))
    (ra, ba), (rb, bb) = parts
    assert ra == list(range(B // 2)) and rb == list(range(B // 2, B))
    assert np.array_equal(np.concatenate([ba, bb])[:, :-1], xg)
    assert np.array_equal(np.concatenate([ba, bb])[:, 1:], yg)
    # a layout whose per-device blocks are not whole rows (columns split over tp) takes the
    # per-device path and gives the same global arrays
    sh2 = NamedSharding(_mesh(), P("dp", "tp"))
    x2, y2 = _np(dataset.BatchLoader(dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE), T, B, sh2,
                                     seed=0).batch(step))
    assert np.array_equal(x2, xg) and np.array_equal(y2, yg)


def test_validation_batches_are_fixed(data_dir):
    sh = _sharding()
    ds = dataset.TokenDataset(data_dir, "val", tok.VOCAB_SIZE)
    v1 = [_np(b) for b in dataset.validation_batches(ds, T, B, sh, 3)]
    v2 = [_np(b) for b in dataset.validation_batches(dataset.TokenDataset(data_dir, "val", tok.VOCAB_SIZE),
                                                      T, B, sh, 3)]
    assert len(v1) == 3
    for (a, b), (c, d) in zip(v1, v2):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    assert not np.array_equal(v1[0][0], v1[1][0])
    # spread over the whole split, in order, never past the end; capped at what the split holds
    ids = dataset.validation_window_ids(ds, T, B, 3)
    assert np.all(np.diff(ids.ravel()) > 0) and ids.max() * T + T + 1 <= ds.n_tokens
    assert len(dataset.validation_batches(ds, T, B, sh, 10_000)) == ds.n_windows(T) // B


def test_range_reads_equal_the_shard_bytes_and_entropy_is_the_manifest_counts(data_dir, copy_dir):
    ds = dataset.TokenDataset(data_dir, "train", tok.VOCAB_SIZE)
    allt = np.concatenate([np.fromfile(os.path.join(data_dir, os.path.basename(f)), dtype="<u4") for f in ds.files])
    starts = [0, 2_990, 5_999, ds.n_tokens - 40, 123]       # inside, across one / two shard boundaries, at the end
    rows = ds.read_many(starts, 40)
    for r, s in zip(rows, starts):
        assert np.array_equal(r, allt[s:s + 40].astype(np.int32))
    assert ds.bytes_read == 4 * 5 * 40
    counts = np.bincount(allt.astype(np.int64), minlength=tok.VOCAB_SIZE)
    p = counts[counts > 0] / counts.sum()
    assert np.array_equal(ds.token_counts(), counts)
    assert ds.unigram_entropy() == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    _edit_manifest(copy_dir, lambda m: m.pop("token_counts"))   # a manifest from before counts: still loads
    old = dataset.TokenDataset(copy_dir, "train", tok.VOCAB_SIZE)
    assert old.unigram_entropy() is None and np.array_equal(old.read(5_999, 40), rows[2])


def test_pod_scale_split_opens_without_reading_and_a_host_reads_only_its_rows(tmp_path):
    """2,000 sparse shards of 1e8 tokens (800 GB that take no disk): opening lists them once (nothing is
    hashed or downloaded), and one host of 8 reads exactly its 32 rows x (T + 1) tokens per step."""
    spec = importlib.util.spec_from_file_location("data_bench", os.path.join(REPO, "scripts", "data_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.bench_pod_scale(str(tmp_path / "pod"), 2000, 100_000_000, steps=3)
    assert r["startup_s"] < 5.0                 # data/README.md: 0.1 s; reading 800 GB would take hours
    assert r["payload_ratio"] == 1.0 and 1.0 <= r["wire_ratio"] < 1.01


def test_bundled_shards_load(bundled_shards):
    d = bundled_shards
    val = dataset.TokenDataset(d, "val", tok.VOCAB_SIZE)
    enc = tok.get_tokenizer()
    assert val.n_tokens == sum(1 + len(enc.encode_ordinary(t)) for t in corpus_documents("val"))
    assert dataset.TokenDataset(d, "train", tok.VOCAB_SIZE).n_tokens > 900_000


# --- errors, each naming the file ----------------------------------------------------------------------

@pytest.fixture
def copy_dir(data_dir, tmp_path):
    d = str(tmp_path / "copy")
    shutil.copytree(data_dir, d)
    return d


def _edit_manifest(d, fn):
    p = os.path.join(d, "manifest.json")
    with open(p) as f:
        m = json.load(f)
    fn(m)
    with open(p, "w") as f:
        json.dump(m, f)


def test_error_truncated_shard(copy_dir):
    p = os.path.join(copy_dir, "train_000001.bin")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 4)
    with pytest.raises(dataset.DataError, match="train_000001.bin is truncated"):
        dataset.TokenDataset(copy_dir, "train", tok.VOCAB_SIZE)


def test_corrupt_shard_is_found_by_data_verify(copy_dir, capsys):
    """A flipped byte keeps the size: training start-up does not hash (it opens), data.verify names it."""
    from data import verify
    assert verify.main([copy_dir]) == 0
    p = os.path.join(copy_dir, "train_000000.bin")
    with open(p, "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x00\x00\x00")
    dataset.TokenDataset(copy_dir, "train", tok.VOCAB_SIZE)
    capsys.readouterr()
    assert verify.main([copy_dir]) == 1
    err = capsys.readouterr().err
    assert "train_000000.bin is corrupt: sha256" in err
    assert "token_counts of split 'train' do not match" in err
    assert "val_" not in err


def test_error_missing_shard(copy_dir):
    os.remove(os.path.join(copy_dir, "val_000000.bin"))
    with pytest.raises(dataset.DataError, match="val_000000.bin .*missing"):
        dataset.TokenDataset(copy_dir, "val", tok.VOCAB_SIZE)


def test_error_tokenizer_mismatch(copy_dir):
    _edit_manifest(copy_dir, lambda m: m.update(tokenizer="gpt2"))
    with pytest.raises(dataset.DataError, match=r"manifest.json: .*'gpt2'.*cl100k_base"):
        dataset.TokenDataset(copy_dir, "train", tok.VOCAB_SIZE)


def test_error_token_id_out_of_vocab(copy_dir):
    with pytest.raises(dataset.DataError, match=r"manifest.json: tokenizer vocab 100277 exceeds --vocab_size 1000; "
                                                 r"use --vocab_size 100277 or more"):
        dataset.TokenDataset(copy_dir, "val", 1000)
    _edit_manifest(copy_dir, lambda m: m.update(vocab_size=1000))      # a manifest that understates it
    ds = dataset.TokenDataset(copy_dir, "val", 1000)                     # found as soon as it is read
    with pytest.raises(dataset.DataError, match=r"val_000000.bin holds token id 100257 >= --vocab_size 1000 at "
                                                 r"token 0 \(byte 0\)"):
        ds.read(0, 10)


def test_error_incomplete_or_missing_manifest(copy_dir, tmp_path):
    _edit_manifest(copy_dir, lambda m: m.update(complete=False))
    with pytest.raises(dataset.DataError, match="manifest.json: tokenization did not finish"):
        dataset.TokenDataset(copy_dir, "train", tok.VOCAB_SIZE)
    with pytest.raises(dataset.DataError, match="nowhere: no such directory; tokenize into it first"):
        dataset.TokenDataset(str(tmp_path / "nowhere"), "train", tok.VOCAB_SIZE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(dataset.DataError, match="empty/manifest.json: no manifest; tokenize into it first"):
        dataset.TokenDataset(str(tmp_path / "empty"), "train", tok.VOCAB_SIZE)


def test_error_too_little_data(data_dir):
    ds = dataset.TokenDataset(data_dir, "val", tok.VOCAB_SIZE)
    n = ds.n_windows(T)
    with pytest.raises(dataset.DataError, match=rf"--T {T}: split 'val' of .*manifest.json has .* {n} windows .* "
                                                 rf"global batch {n + 1}; use --T {T - 1} or less"):
        dataset.BatchLoader(ds, T, n + 1, _sharding((1, 1, 8)), seed=0)
    dataset.BatchLoader(ds, T - 1, n + 1, _sharding((1, 1, 8)), seed=0)     # the T it suggests fits
    with pytest.raises(dataset.DataError, match="manifest.json"):
        dataset.validation_batches(ds, 4096, B, _sharding(), 2)


def test_validation_set_is_the_same_windows_on_every_mesh(data_dir):
    """main.py's validation set is --eval_steps batches of --val_batch_size sequences in all: the same
    tokens on (1,1,1), (2,2,2) and (2,1,2), so val numbers compare across meshes and slices."""
    import main
    import sharding
    import utils
    val = {}
    for mesh in ((1, 1, 1), (2, 2, 2), (2, 1, 2)):
        cfg = utils.override(utils.PRESETS["tiny"], data_dir=data_dir, T=T, val_batch_size=8, eval_steps=3,
                             max_tokens=0, n_device_axis=mesh)
        utils.validate(cfg, jax.device_count())
        rows = NamedSharding(sharding.make_mesh(mesh), P("dp", None))
        _, batches, _ = main.load_data(cfg, rows)
        val[mesh] = [np.asarray(x) for x, _ in batches]
        assert len(batches) == 3 and all(x.shape == (8, T) and x.sharding == rows for x, _ in batches)
    for mesh in ((2, 2, 2), (2, 1, 2)):
        assert all(np.array_equal(a, b) for a, b in zip(val[mesh], val[(1, 1, 1)])), mesh
