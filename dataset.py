"""The training data loader: token shards (data/shards.py) -> global (x, y) batches laid out on the mesh.

- `TokenDataset(data_dir, split, vocab_size)`: reads `manifest.json` (local directory or any fsspec URL)
  and checks the tokenizer and every shard's size against it (one directory listing); then reads only
  the byte ranges of the windows it is asked for. Nothing is downloaded or hashed at start, so start-up,
  memory and local disk do not grow with the number of shards; `python -m data.verify DIR` is the full
  sha256 check. The split is the concatenation of its shards in order.
- `BatchLoader(dataset, T, global_batch, sharding, seed)`: window w is tokens [w*T, w*T + T + 1) of the
  split, so (x, y) = (window[:-1], window[1:]) and no window runs past the end of the data. Epoch e
  visits the (n_tokens - 1) // T windows in the order of a permutation seeded by (seed, e); global row
  r of step s is the (position(s) + r)-th window of that endless sequence, position(s) = consumed +
  s * global_batch (`consumed`: sequences trained on before this loader). So `batch(s)` is a pure
  function of (s, consumed, seed, manifest): resuming needs only the sequence count, and neither the
  batch size nor the number of hosts changes which tokens follow. Each process reads only the rows its
  own devices hold (`sharding.addressable_devices_indices_map`) and builds the global jax.Array
  (`jax.make_array_from_process_local_data`, or per device when a device holds part of a row).
  `iterate(start)` prefetches on a background thread.
- `validation_batches(...)`: a fixed set of windows spread evenly over the val split, no shuffling; its
  batch size is global (main.py: --val_batch_size in all), so every mesh evaluates the same windows;
  `validation_bytes_per_token`, the text they spell, for bits per byte.
- `ensure_bundled_shards(cache_dir)`: tokenizes the bundled corpus once into a cached shard directory
  whose val split is exactly the corpus' val documents.
"""
import collections
import json
import os
import posixpath
import queue
import shutil
import threading

import fsspec
import jax
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from data import manifest as _manifest
from data import shards as _shards
from data import sources as _sources
from data import tokenizer as _tok
from data.manifest import DataError

BUNDLED_SHARD_SIZE = 1 << 20
_OPEN_FILES = 64               # local shard files kept open (LRU)


class DataUnavailable(DataError):
    """The data's store stopped answering (a GCS outage, a lost network): main() exits 1, not 2, since the
    same command resumes from the newest checkpoint once it answers again."""


def default_cache_dir():
    return os.environ.get("JAXFORMER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxformer"))


# ----------------------------------------------------------------------------------------------------
# The bundled corpus
# ----------------------------------------------------------------------------------------------------

def ensure_bundled_shards(cache_dir: str, say=lambda text: None) -> str:
    """Shard directory of the bundled KJV corpus (train + val splits), tokenized on first use (`say`
    is told so first: it takes a while).

    Built in a temporary directory and renamed into place, so a crash never leaves a half-written cache
    and concurrent callers agree on one result. Keyed by the corpus' sha256 and the tokenizer name.
    """
    from data import corpus
    key = _sources.file_sha256(corpus.PATH)[:16]
    # "_c": manifests with token counts (older caches without them are rebuilt, not reused)
    out = os.path.join(os.path.abspath(cache_dir), f"kjv_{_tok.NAME}_{key}_s{BUNDLED_SHARD_SIZE}_c")
    if _intact(out):
        return out
    say(f"tokenizing the bundled corpus (the King James Bible) into {out}, once"
        + (" more: the cached shards there are incomplete or damaged" if os.path.exists(out) else ""))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _shards.tokenize(tmp, _shards.make_plan(_sources.BUNDLED), BUNDLED_SHARD_SIZE)
        if os.path.exists(out) and not _intact(out):
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            if not _intact(out):
                raise
    finally:               # a build that failed (a full or read-only disk) or lost the race leaves nothing
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _intact(d):
    """Whether d holds a finished tokenization whose every shard has the size its manifest records (the
    loader's own check at start; python -m data.verify also hashes them)."""
    try:
        with open(os.path.join(d, _manifest.MANIFEST)) as f:
            m = json.load(f)
        return bool(m.get("complete")) and all(os.path.getsize(os.path.join(d, s["file"])) == 4 * int(s["tokens"])
                                               for s in m["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ----------------------------------------------------------------------------------------------------
# Dataset
# ----------------------------------------------------------------------------------------------------

class TokenDataset:
    """One split of a shard directory, read by byte range. `n_tokens`, `read(start, length)`, `read_many`.

    Opening reads the manifest and lists the directory once (every shard's size is checked against the
    manifest); nothing is downloaded or hashed, so start-up does not grow with the data. Reads go to
    the byte ranges of the windows asked for: `os.pread` on a small cache of open files for a local
    directory, one concurrent `cat_ranges` call per batch for an object store. Token ids are checked
    against vocab_size as they are read; the full sha256 check is `python -m data.verify DIR`.
    """

    def __init__(self, data_dir: str, split: str, vocab_size: int):
        self.data_dir, self.split, self.vocab_size = data_dir, split, int(vocab_size)
        self.fs, root = fsspec.core.url_to_fs(data_dir)
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.manifest_path = f"{data_dir.rstrip('/')}/{_manifest.MANIFEST}"
        try:
            self.manifest = m = _manifest.read_manifest(self.fs, self.root, self.manifest_path, self.vocab_size)
            entries = [s for s in m["shards"] if s["split"] == split]
            if not entries:
                raise DataError(f"{self.manifest_path}: no shards for split {split!r} "
                                f"(splits present: {sorted({s['split'] for s in m['shards']})})")
            self._check_sizes(entries)
        except _shards.store_errors() as e:
            raise self._unavailable(e) from None
        self.files = [f"{data_dir.rstrip('/')}/{s['file']}" for s in entries]
        self.paths = [f"{self.root}/{s['file']}" for s in entries]
        self.sizes = np.array([int(s["tokens"]) for s in entries], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self.n_tokens = int(self.starts[-1])
        self.bytes_read = 0           # bytes requested from storage (a host reads only its own rows)
        self._fds = collections.OrderedDict()
        self._lock = threading.Lock()

    def _check_sizes(self, entries):
        """Every shard of the split exists with 4 bytes per manifest token: one directory listing."""
        try:
            listing = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            listing = []
        sizes = {posixpath.basename(str(e["name"]).rstrip("/")): e.get("size") for e in listing}
        for s in entries:
            name, want = f"{self.data_dir.rstrip('/')}/{s['file']}", 4 * int(s["tokens"])
            if s["file"] not in sizes:
                raise DataError(f"shard {name} listed in the manifest is missing")
            if sizes[s["file"]] != want:
                raise DataError(f"shard {name} is truncated or corrupt: {sizes[s['file']]} bytes, the manifest "
                                f"says {s['tokens']} tokens ({want} bytes){self._remedy()}")

    def _pieces(self, start, length):
        """(position in the row, shard index, token offset in the shard, token count) covering tokens
        [start, start + length) of the split."""
        if start < 0 or start + length > self.n_tokens:
            raise IndexError(f"read [{start}, {start + length}) outside {self.n_tokens} tokens of {self.manifest_path}")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = 0
        while pos < length:
            off = start + pos - int(self.starts[i])
            take = min(length - pos, int(self.sizes[i]) - off)
            yield pos, i, off, take
            pos += take
            i += 1

    def read(self, start, length):
        """Tokens [start, start + length) of the split (across shard boundaries) as int32."""
        return self.read_many([start], length)[0]

    def read_many(self, starts, length):
        """int32 [len(starts), length]: row j is tokens [starts[j], starts[j] + length)."""
        out = np.empty((len(starts), length), dtype=np.int32)
        pieces = [(j, *p) for j, s in enumerate(starts) for p in self._pieces(int(s), length)]
        fetch = self._pread if self.local else self._cat_ranges
        for (j, pos, i, off, take), data in zip(pieces, fetch([(i, off, take) for _, _, i, off, take in pieces])):
            ids = np.frombuffer(data, dtype=_manifest.DTYPE)    # unsigned: a corrupt 0xFFFFFFFF is no -1
            if take and int(ids.max()) >= self.vocab_size:
                self._out_of_vocab(i, off, ids)
            out[j, pos: pos + take] = ids
        self.bytes_read += 4 * out.size
        return out

    def _out_of_vocab(self, i, off, ids):
        """Raise the DataError for the first id >= vocab_size in `ids`, tokens [off, ...) of shard i."""
        k = int(np.argmax(ids >= self.vocab_size))
        raise DataError(f"shard {self.files[i]} holds token id {int(ids[k])} >= --vocab_size {self.vocab_size} at "
                        f"token {off + k} (byte {4 * (off + k)}); check it with python -m data.verify {self.data_dir}")

    def _pread(self, pieces):
        res = []
        with self._lock:               # an fd is never closed (evicted) by another thread while read here
            for i, off, take in pieces:
                data = os.pread(self._fd(i), 4 * take, 4 * off)
                if len(data) != 4 * take:
                    raise DataError(f"shard {self.files[i]} is shorter than the manifest says{self._remedy()}")
                res.append(data)
        return res

    def _fd(self, i):
        """An open file descriptor for shard i from a small LRU (memory and fds stay flat with the shard
        count). Called with self._lock held."""
        fd = self._fds.pop(i, None)
        if fd is None:
            try:
                fd = os.open(self.fs._strip_protocol(self.paths[i]), os.O_RDONLY)
            except FileNotFoundError:
                raise DataError(f"shard {self.files[i]} listed in the manifest is missing") from None
            if len(self._fds) >= _OPEN_FILES:
                os.close(self._fds.popitem(last=False)[1])
        self._fds[i] = fd
        return fd

    def _cat_ranges(self, pieces):
        try:
            res = self.fs.cat_ranges([self.paths[i] for i, _, _ in pieces], [4 * off for _, off, _ in pieces],
                                     [4 * (off + take) for _, off, take in pieces], on_error="raise")
        except FileNotFoundError as e:
            raise DataError(f"a shard of {self.manifest_path} is missing ({e})") from None
        except _shards.store_errors() as e:
            raise self._unavailable(e) from None
        for (i, _, take), data in zip(pieces, res):
            if len(data) != 4 * take:
                raise DataError(f"shard {self.files[i]} is shorter than the manifest says{self._remedy()}")
        return res

    def _remedy(self):
        return (f"; python -m data.verify {self.data_dir} checks every shard; tokenize the data again into an "
                f"empty --out (python -m data.tokenize_local ...) to replace them")

    def _unavailable(self, e):
        return DataUnavailable(f"could not read {self.data_dir} ({_shards.describe_error(e)}); run the same command "
                               f"again once it can be read: training resumes from the newest checkpoint")

    def close(self):
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def token_counts(self):
        """Per-token-id counts of this split recorded at tokenization, or None for an older manifest."""
        enc = (self.manifest.get("token_counts") or {}).get(self.split)
        return None if enc is None else _manifest.decode_counts(enc)

    def unigram_entropy(self):
        """Entropy (nats) of this split's unigram distribution (the loss of the best model that ignores
        context), from the manifest's token counts; None when the manifest predates them."""
        counts = self.token_counts()
        if counts is None or not counts.sum():
            return None
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def n_windows(self, T):
        return max(0, (self.n_tokens - 1) // T)



# ----------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------

def _require_windows(dataset, T, global_batch):
    n = dataset.n_windows(T)
    if n < global_batch:
        fit = (dataset.n_tokens - 1) // global_batch         # the longest T that gives a batch of windows
        raise DataError(f"--T {T}: split {dataset.split!r} of {dataset.manifest_path} has {dataset.n_tokens} tokens = "
                        f"{n} windows of T+1 = {T + 1} tokens, fewer than the global batch {global_batch}; use "
                        + (f"--T {fit} or less, " if fit >= 2 else "") + "a smaller batch or more data")
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


def _rows_of(blocks):
    """The sorted global rows covered by _row_blocks' blocks."""
    return sorted({r for (r0, r1) in blocks for r in range(r0, r1)})


def read_windows(dataset, T, window_ids):
    """int32 [len(window_ids), T + 1]: row j is window window_ids[j], tokens [w*T, w*T + T + 1) of the split."""
    return dataset.read_many(np.asarray(window_ids, dtype=np.int64) * T, T + 1)


def _inputs_targets(windows):
    """(x, y) = (window[:-1], window[1:]) of each row, contiguous."""
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def _assemble(dataset, T, window_ids, sharding):
    """The global [B, T] (x, y) jax.Arrays for these window ids; reads only the addressable rows."""
    B = len(window_ids)
    shape = (B, T)
    blocks = _row_blocks(sharding, shape)
    rows = _rows_of(blocks)
    full_cols = all(cols == slice(None) or cols.indices(T) == (0, T, 1)
                    for targets in blocks.values() for _, cols in targets)
    if full_cols and rows == list(range(rows[0], rows[-1] + 1)):
        # the usual case (batch over dp, rows of a process contiguous): one call for the process' rows
        x, y = _inputs_targets(read_windows(dataset, T, window_ids[rows[0]: rows[-1] + 1]))
        return (jax.make_array_from_process_local_data(sharding, x, shape),
                jax.make_array_from_process_local_data(sharding, y, shape))
    xs, ys, devs = [], [], []
    for (r0, r1), targets in blocks.items():
        x, y = _inputs_targets(read_windows(dataset, T, window_ids[r0:r1]))
        for d, cols in targets:
            xs.append(np.ascontiguousarray(x[:, cols]))
            ys.append(np.ascontiguousarray(y[:, cols]))
            devs.append(d)
    return (jax.make_array_from_single_device_arrays(shape, sharding, jax.device_put(xs, devs)),
            jax.make_array_from_single_device_arrays(shape, sharding, jax.device_put(ys, devs)))


def _mix64(x):
    """splitmix64's finalizer: a well-mixed 64-bit hash of every element (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shuffled_positions(pos, n, seed, epoch, rounds=6):
    """perm[pos] for the permutation of range(n) seeded by (seed, epoch), without materialising perm
    (at the guide's scale an epoch has ~3e8 windows: 2.7 GB and seconds per permutation array).

    A balanced Feistel network on the smallest even bit width covering n is a bijection of [0, 4^h);
    cycle-walking (apply it again while the value is >= n) restricts it to a bijection of [0, n), in
    fewer than 4 walks on average. Time and memory are O(len(pos)) whatever n is."""
    n = int(n)
    h = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << h) - 1), np.uint64(h)
    keys = np.random.SeedSequence([int(seed), int(epoch)]).generate_state(rounds, dtype=np.uint64)

    def feistel(v):
        left, right = v >> shift, v & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << shift) | right

    out = feistel(np.asarray(pos, dtype=np.uint64))
    walk = out >= n
    while walk.any():
        out[walk] = feistel(out[walk])
        walk = out >= n
    return out.astype(np.int64)


class BatchLoader:
    """Deterministic shuffled (x, y) batches: batch(step) is a pure function of (step, seed, manifest).

    `consumed`: sequences (windows of the endless shuffled order) already trained on, so step 0 starts
    right after them; a resume passes the count its checkpoint recorded, whatever batch layout made it."""

    def __init__(self, dataset, T: int, global_batch: int, sharding, seed: int, prefetch: int = 2, consumed: int = 0):
        self.dataset, self.T, self.global_batch = dataset, int(T), int(global_batch)
        self.consumed = int(consumed)
        self.sharding, self.seed, self.prefetch = sharding, int(seed), max(1, int(prefetch))
        self.n_windows = _require_windows(dataset, self.T, self.global_batch)
        self._workers = []

    def position(self, step):
        """Sequences of the endless shuffled order consumed before batch `step`: the batch layout (row r of
        batch `step` is sequence position(step) + r)."""
        return self.consumed + int(step) * self.global_batch

    def window_ids(self, step):
        """The global batch's window indices for this step (row r -> window)."""
        g = self.position(step) + np.arange(self.global_batch, dtype=np.int64)
        epoch, pos = g // self.n_windows, g % self.n_windows
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = shuffled_positions(pos[sel], self.n_windows, self.seed, int(e))
        return out

    def local_rows(self, devices=None):
        """Global row indices the given devices hold (default: this process' addressable devices)."""
        return _rows_of(_row_blocks(self.sharding, (self.global_batch, self.T), devices))

    def read_rows(self, step, rows):
        """Host int32 [len(rows), T+1] windows of these global rows of step `step` (scripts/data_bench.py:
        what one host of a pod reads)."""
        return read_windows(self.dataset, self.T, self.window_ids(step)[np.asarray(rows, dtype=np.int64)])

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


def validation_bytes_per_token(dataset, T, global_batch, n_batches):
    """UTF-8 bytes per target token of the fixed validation set (validation_batches'), read whole on every
    process: val bits per byte = val cross-entropy / (ln 2 x this), comparable across tokenizers."""
    ids = validation_window_ids(dataset, T, global_batch, n_batches).reshape(-1)
    targets = read_windows(dataset, T, ids)[:, 1:]
    return float(_tok.token_bytes()[targets].sum()) / targets.size
