"""The training data loader: token shards (data/shards.py) -> global (x, y) batches laid out on the mesh.

- `TokenDataset(data_dir, split, vocab_size)`: reads `manifest.json` (local directory or fsspec URL;
  remote shards are downloaded once into a local cache), checks every shard (size, sha256, tokenizer,
  token ids < vocab_size) and memory-maps it. The split is the concatenation of its shards in order.
- `BatchLoader(dataset, T, global_batch, sharding, seed)`: window w is tokens [w*T, w*T + T + 1) of the
  split, so (x, y) = (window[:-1], window[1:]) and no window runs past the end of the data. Epoch e
  visits the (n_tokens - 1) // T windows in the order of a permutation seeded by (seed, e); global row
  r of step s is the (s * global_batch + r)-th window of that endless sequence. So `batch(s)` is a pure
  function of (s, seed, manifest): resuming needs only the step number, and the number of hosts does
  not change which tokens a step sees. Each process reads only the rows its own devices hold
  (`sharding.addressable_devices_indices_map`) and builds the global jax.Array with
  `jax.make_array_from_single_device_arrays`. `iterate(start)` prefetches on a background thread.
- `validation_batches(...)`: a fixed set of windows spread evenly over the val split, no shuffling.
- `ensure_bundled_shards(cache_dir)`: tokenizes the bundled corpus once into a cached shard directory
  whose val split is exactly the corpus' val documents.
"""
import hashlib
import json
import os
import queue
import shutil
import threading

import fsspec
import jax
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from data import shards as _shards
from data import tokenizer as _tok

BUNDLED_SHARD_SIZE = 1 << 20
_HASH_CHUNK = 1 << 24


class DataError(ValueError):
    """A problem with the token data (always names the manifest or shard file)."""


def default_cache_dir():
    return os.environ.get("JAXFORMER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxformer"))


# ----------------------------------------------------------------------------------------------------
# The bundled corpus
# ----------------------------------------------------------------------------------------------------

def ensure_bundled_shards(cache_dir: str) -> str:
    """Shard directory of the bundled KJV corpus (train + val splits), tokenized on first use.

    Built in a temporary directory and renamed into place, so a crash never leaves a half-written cache
    and concurrent callers agree on one result. Keyed by the corpus' sha256 and the tokenizer name.
    """
    from data import corpus
    key = _shards._file_sha256(corpus.PATH)[:16]
    out = os.path.join(os.path.abspath(cache_dir), f"kjv_{_tok.NAME}_{key}_s{BUNDLED_SHARD_SIZE}")
    if _complete(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _shards.tokenize(tmp, _shards.make_plan(_shards.BUNDLED), BUNDLED_SHARD_SIZE)
    try:
        if os.path.exists(out) and not _complete(out):
            shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    except OSError:
        if not _complete(out):
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _complete(d):
    try:
        with open(os.path.join(d, _shards.MANIFEST)) as f:
            return bool(json.load(f).get("complete"))
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------------
# Dataset
# ----------------------------------------------------------------------------------------------------

class TokenDataset:
    """One split of a shard directory, memory-mapped. `n_tokens`, `read(start, length)`."""

    def __init__(self, data_dir: str, split: str, vocab_size: int, cache_dir: str = None, verify: bool = True):
        self.data_dir, self.split, self.vocab_size = data_dir, split, int(vocab_size)
        fs, root = fsspec.core.url_to_fs(data_dir)
        root = root.rstrip("/")
        self.manifest_path = f"{data_dir.rstrip('/')}/{_shards.MANIFEST}"
        try:
            with fs.open(f"{root}/{_shards.MANIFEST}", "rb") as f:
                m = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            raise DataError(f"{self.manifest_path}: no manifest; tokenize first "
                            f"(python -m data.tokenize_local --out {data_dir} ...)") from None
        except ValueError as e:
            raise DataError(f"{self.manifest_path}: not valid JSON ({e})") from None
        self.manifest = m
        if m.get("tokenizer") != _tok.NAME:
            raise DataError(f"{self.manifest_path}: shards were tokenized with {m.get('tokenizer')!r}, but this "
                            f"code uses {_tok.NAME!r}; re-tokenize the data")
        if m.get("dtype") != "uint32" or m.get("format") != _shards.FORMAT_VERSION:
            raise DataError(f"{self.manifest_path}: unsupported format {m.get('format')} / dtype {m.get('dtype')}")
        if int(m.get("vocab_size", 0)) > self.vocab_size:
            raise DataError(f"{self.manifest_path}: tokenizer vocab {m.get('vocab_size')} exceeds the model's "
                            f"vocab_size {self.vocab_size}")
        if not m.get("complete"):
            raise DataError(f"{self.manifest_path}: tokenization did not finish; rerun the tokenizer with --resume")
        entries = [s for s in m["shards"] if s["split"] == split]
        if not entries:
            raise DataError(f"{self.manifest_path}: no shards for split {split!r} "
                            f"(splits present: {sorted({s['split'] for s in m['shards']})})")
        local = type(fs) is LocalFileSystem
        cache = None if local else os.path.join(cache_dir or default_cache_dir(), "shards",
                                                hashlib.sha256(data_dir.encode()).hexdigest()[:16])
        self.files, self.arrays = [], []
        for s in entries:
            name = f"{data_dir.rstrip('/')}/{s['file']}"
            if local:
                path = f"{root}/{s['file']}"
                self._check(path, name, s, verify)
            else:
                path = self._fetch(fs, f"{root}/{s['file']}", name, s, cache, verify)
            self.files.append(name)
            self.arrays.append(np.memmap(path, dtype=_shards.DTYPE, mode="r", shape=(int(s["tokens"]),)))
        self.sizes = np.array([int(s["tokens"]) for s in entries], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self.n_tokens = int(self.starts[-1])
        self.tokens_read = 0          # counter (tests check that a host reads only its own rows)

    def _fetch(self, fs, remote, name, entry, cache, verify):
        """Local copy of a remote shard in `cache` (downloaded atomically; a stale copy is replaced)."""
        os.makedirs(cache, exist_ok=True)
        path = os.path.join(cache, entry["file"])
        if os.path.exists(path):
            try:
                self._check(path, name, entry, verify)
                return path
            except DataError:
                os.remove(path)
        try:
            fs.get_file(remote, path + ".tmp")
        except FileNotFoundError:
            raise DataError(f"shard {name} listed in the manifest is missing") from None
        os.replace(path + ".tmp", path)
        self._check(path, name, entry, verify)
        return path

    def _check(self, path, name, entry, verify):
        want = 4 * int(entry["tokens"])
        try:
            size = os.path.getsize(path)
        except OSError:
            raise DataError(f"shard {name} listed in the manifest is missing") from None
        if size != want:
            raise DataError(f"shard {name} is truncated or corrupt: {size} bytes, the manifest says "
                            f"{entry['tokens']} tokens ({want} bytes); re-tokenize it")
        if not verify:
            return
        h, top = hashlib.sha256(), 0
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
                h.update(chunk)
                if chunk:
                    top = max(top, int(np.frombuffer(chunk, dtype=_shards.DTYPE).max()))
        if h.hexdigest() != entry["sha256"]:
            raise DataError(f"shard {name} is corrupt: sha256 {h.hexdigest()} != manifest {entry['sha256']}")
        if top >= self.vocab_size:
            raise DataError(f"shard {name} holds token id {top} >= vocab_size {self.vocab_size}")

    def read(self, start, length):
        """Tokens [start, start + length) of the split (across shard boundaries) as int32."""
        if start < 0 or start + length > self.n_tokens:
            raise IndexError(f"read [{start}, {start + length}) outside {self.n_tokens} tokens of {self.manifest_path}")
        out = np.empty(length, dtype=np.int32)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = 0
        while pos < length:
            off = start + pos - int(self.starts[i])
            take = min(length - pos, int(self.sizes[i]) - off)
            out[pos: pos + take] = self.arrays[i][off: off + take]
            pos += take
            i += 1
        self.tokens_read += length
        return out

    def n_windows(self, T):
        return max(0, (self.n_tokens - 1) // T)


# ----------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------

def _require_windows(dataset, T, global_batch):
    n = dataset.n_windows(T)
    if n < global_batch:
        raise DataError(f"{dataset.manifest_path}: split {dataset.split!r} has {dataset.n_tokens} tokens = {n} "
                        f"windows of T+1={T + 1} tokens, fewer than the global batch {global_batch}; "
                        f"use more data or a smaller batch/T")
    return n


def _row_blocks(sharding, shape, devices=None):
    """{(row_start, row_stop): [(device, column index)]} for `devices` (default: this process' devices)."""
    idx = sharding.devices_indices_map(shape) if devices is not None else sharding.addressable_devices_indices_map(shape)
    blocks = {}
    for d, index in idx.items():
        if devices is not None and d not in devices:
            continue
        rows = index[0] if index else slice(None)
        r0, r1, _ = rows.indices(shape[0])
        cols = index[1] if len(index) > 1 else slice(None)
        blocks.setdefault((r0, r1), []).append((d, cols))
    return blocks


def _assemble(dataset, T, window_ids, sharding):
    """The global [B, T] (x, y) jax.Arrays for these window ids; reads only the addressable rows."""
    B = len(window_ids)
    shape = (B, T)
    blocks = _row_blocks(sharding, shape)
    rows = sorted({r for (r0, r1) in blocks for r in range(r0, r1)})
    full_cols = all(cols == slice(None) or cols.indices(T) == (0, T, 1)
                    for targets in blocks.values() for _, cols in targets)
    if full_cols and rows == list(range(rows[0], rows[-1] + 1)):
        # the usual case (batch over dp, rows of a process contiguous): one call for the process' rows
        block = np.stack([dataset.read(int(w) * T, T + 1) for w in window_ids[rows[0]: rows[-1] + 1]])
        return (jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(block[:, :-1]), shape),
                jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(block[:, 1:]), shape))
    xs, ys, devs = [], [], []
    for (r0, r1), targets in blocks.items():
        block = np.stack([dataset.read(int(w) * T, T + 1) for w in window_ids[r0:r1]])
        for d, cols in targets:
            xs.append(np.ascontiguousarray(block[:, :-1][:, cols]))
            ys.append(np.ascontiguousarray(block[:, 1:][:, cols]))
            devs.append(d)
    return (jax.make_array_from_single_device_arrays(shape, sharding, jax.device_put(xs, devs)),
            jax.make_array_from_single_device_arrays(shape, sharding, jax.device_put(ys, devs)))


class BatchLoader:
    """Deterministic shuffled (x, y) batches: batch(step) is a pure function of (step, seed, manifest)."""

    def __init__(self, dataset, T: int, global_batch: int, sharding, seed: int, prefetch: int = 2):
        self.dataset, self.T, self.global_batch = dataset, int(T), int(global_batch)
        self.sharding, self.seed, self.prefetch = sharding, int(seed), max(1, int(prefetch))
        self.n_windows = _require_windows(dataset, self.T, self.global_batch)
        self._perms = {}
        self._lock = threading.Lock()
        self._workers = []

    def _perm(self, epoch):
        with self._lock:
            p = self._perms.get(epoch)
            if p is None:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                p = rng.permutation(self.n_windows)
                self._perms = {k: v for k, v in self._perms.items() if k >= epoch - 1}
                self._perms[epoch] = p
            return p

    def window_ids(self, step):
        """The global batch's window indices for this step (row r -> window)."""
        g = int(step) * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epoch, pos = g // self.n_windows, g % self.n_windows
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._perm(int(e))[pos[sel]]
        return out

    def epoch(self, step):
        return int(step) * self.global_batch // self.n_windows

    def local_rows(self, devices=None):
        """Global row indices the given devices hold (default: this process' addressable devices)."""
        blocks = _row_blocks(self.sharding, (self.global_batch, self.T), devices)
        return sorted({r for (r0, r1) in blocks for r in range(r0, r1)})

    def read_rows(self, step, rows):
        """Host int32 [len(rows), T+1] windows of these global rows of step `step`."""
        ids = self.window_ids(step)
        return np.stack([self.dataset.read(int(ids[r]) * self.T, self.T + 1) for r in rows])

    def batch(self, step):
        """(x, y): int32 jax.Arrays [global_batch, T] placed with `sharding`; y is x shifted by one."""
        return _assemble(self.dataset, self.T, self.window_ids(step), self.sharding)

    def iterate(self, start_step=0):
        """Yield batch(start_step), batch(start_step + 1), ... prepared `prefetch` ahead on a thread."""
        q = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work():
            s = start_step
            try:
                while not stop.is_set():
                    item = ("ok", self.batch(s))
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.05)
                            break
                        except queue.Full:
                            pass
                    s += 1
            except BaseException as e:  # surfaced in the consumer
                q.put(("error", e))

        t = threading.Thread(target=work, name="batch-prefetch", daemon=True)
        self._workers.append((stop, t))
        t.start()
        try:
            while True:
                kind, value = q.get()
                if kind == "error":
                    raise value
                yield value
        finally:
            stop.set()
            try:
                t.join(timeout=10)
            except Exception:  # interpreter shutdown: the daemon thread is going away anyway
                pass

    def close(self):
        for stop, t in self._workers:
            stop.set()
        for stop, t in self._workers:
            t.join(timeout=10)
        self._workers = []


def validation_window_ids(dataset, T, global_batch, n_batches):
    """Window ids of the fixed validation set: n_batches x global_batch windows spread evenly, in order."""
    n = _require_windows(dataset, T, global_batch)
    n_batches = max(1, min(int(n_batches), n // global_batch))
    stride = n // (n_batches * global_batch)
    ids = np.arange(n_batches * global_batch, dtype=np.int64) * stride
    return ids.reshape(n_batches, global_batch)


def validation_batches(dataset, T, global_batch, sharding, n_batches):
    """A fixed list of (x, y) batches (the same at every eval). Capped at what the split holds."""
    return [_assemble(dataset, T, ids, sharding)
            for ids in validation_window_ids(dataset, T, global_batch, n_batches)]
