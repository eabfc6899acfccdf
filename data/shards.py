"""The tokenization core shared by both drivers (data/tokenize_local.py, data/tokenize_ray.py).

A *plan* is an ordered list of segments, each a document source and the split its shards go to:

- one source, `split="auto"`: the first `val_shards` shards are val, the rest train;
- separate sources, `split="val"` / `split="train"`: each segment's last (partial) shard is flushed when
  its source ends, so every shard holds one split only. The bundled corpus (`--source bundled`) is the
  plan [val: the KJV val books, train: the KJV train books].

Each segment's documents come from data/sources.py, in a fixed order (a Hugging Face dataset or local /
fsspec files; a bad document is repaired or skipped, counted and named, and still counts for the cursor).
Each document is encoded as [<|endoftext|>] + encode_ordinary(text) and the token stream is packed
contiguously into shards of exactly `shard_size` uint32 tokens (little-endian, `<split>_<NNNNNN>.bin`;
a segment's last shard may be shorter).

`manifest.json` next to the shards (data/manifest.py) records the plan, each closed shard (file, split,
tokens, sha256), the tokenizer, each split's per-token-id counts (`token_counts`, compressed: the loader's
unigram entropy comes from them) and the resume cursor, rewritten after every shard:

    cursor = {"segment": i, "docs": d, "carry": c, "bad_docs": {kind: n}}

meaning: in segment i, documents [0, d) are consumed and everything before the open shard is written;
the open shard starts with the last c tokens of document d-1 (the document that straddled the last
shard boundary; c may exceed shard_size for a very long document); n bad documents of each kind came
before the documents a resume reads again, whichever process read them. On `--resume` the core skips d-1
documents, re-encodes document d-1, keeps its last c tokens and carries on, so the output is
byte-identical to an uninterrupted run whatever instant the process was killed at: shard and manifest
writes are atomic (temp file + rename), a shard written but not yet in the manifest is simply written
again with the same bytes, and leftover temp files are removed.

The drivers only differ in how a batch of documents gets encoded (`encode_batch`): an ordered,
bounded-window map over a multiprocessing pool or Ray tasks (`ordered_map`).
"""
import collections
import errno
import functools
import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from data import tokenizer as tok
from data.manifest import DTYPE, FORMAT_VERSION, MANIFEST, decode_counts, encode_counts
from data.sources import BUNDLED, DocProblems, SourceError, iter_documents, source_spec

DEFAULT_SHARD_SIZE = 100_000_000
DEFAULT_HF_NAME = "HuggingFaceFW/fineweb-edu"
DEFAULT_HF_CONFIG = "sample-350BT"


# what the drivers report as one line, exit 2 (a missing source file, an --out that holds another run)
CLI_ERRORS = (SourceError, FileNotFoundError, FileExistsError)


class OutputError(Exception):
    """--out cannot be written (read-only, full, no such bucket; or its store stopped answering): the
    drivers print it as one line and exit with `exit_code`: 2 when it could never be written as given,
    1 when it may work again later (a store that is down: --resume then continues exactly)."""

    def __init__(self, url, cause):
        permanent = (isinstance(cause, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError))
                     or getattr(cause, "errno", None) in (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES,
                                                          errno.EFBIG)
                     or 400 <= (getattr(cause, "code", None) or 0) < 500)
        self.exit_code = 2 if permanent else 1
        what = describe_error(cause)
        if isinstance(cause, FileNotFoundError) and "://" in url:
            what = f"no such bucket, or this account cannot see it: {what}"
        super().__init__(f"--out {url}: cannot write there ({what}); choose an --out this process can write"
                         if permanent else f"--out {url}: its store did not answer ({what}); rerun with --resume "
                                           f"once it does: it continues exactly")


# gcsfs logs every request it gives up on, with a screenful of aiohttp frames, and then raises the same error
# to its caller, which reports it in one line (OutputError, DataUnavailable, a run file's warning, the
# lock's refusal, SaveFailed)
logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


def store_errors():
    """What a failing disk or object store raises: OSError (aiohttp's connection errors are OSErrors too),
    aiohttp's other client errors and gcsfs' HTTP errors (as a tuple, for an except clause)."""
    import aiohttp
    from gcsfs.retry import HttpError
    return OSError, aiohttp.ClientError, HttpError


def describe_error(e):
    """An exception in one line: an OS error's own text, else its type and first line."""
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return text if isinstance(e, OSError) and e.errno else f"{type(e).__name__}: {text}"


def _on_out(method):
    """An Output method whose store errors become OutputError, naming --out."""
    @functools.wraps(method)
    def wrapped(self, *args):
        try:
            return method(self, *args)
        except store_errors() as e:
            raise OutputError(self.url, e) from e
    return wrapped


# ----------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------

def make_plan(source=None, train_source=None, val_source=None, val_shards=1, **spec_kw):
    """Segments for the CLI's source flags: `--source X` or `--train_source X --val_source Y`."""
    for flag, value in (("--source", source), ("--train_source", train_source), ("--val_source", val_source)):
        if value is not None and not value.strip(", "):
            raise SourceError(f"{flag} {value!r} names no source: give its dataset or files, or drop {flag}")
    if source == BUNDLED:
        if train_source or val_source:
            raise SourceError("--source bundled already provides both splits; drop --train_source/--val_source")
        return [{"split": "val", "source": source_spec("bundled:val")},
                {"split": "train", "source": source_spec("bundled:train")}]
    if source:
        if train_source or val_source:
            raise SourceError("give either --source or --train_source/--val_source, not both")
        return [{"split": "auto", "val_shards": int(val_shards), "source": source_spec(source, **spec_kw)}]
    if not train_source:
        raise SourceError("no source: pass --source (HF dataset name, local files, or 'bundled') "
                          "or --train_source [--val_source]")
    plan = []
    if val_source:
        plan.append({"split": "val", "source": source_spec(val_source, **spec_kw)})
    plan.append({"split": "train", "source": source_spec(train_source, **spec_kw)})
    return plan


# ----------------------------------------------------------------------------------------------------
# Encoding (runs in the workers)
# ----------------------------------------------------------------------------------------------------

def encode_batch(texts):
    """[EOT] + encode_ordinary(text) for each text (none for None) -> (flat uint32 tokens, int64
    per-document lengths)."""
    enc = tok.get_tokenizer()
    arrays = [None if t is None else np.asarray(enc.encode_ordinary(t), dtype=np.uint32) for t in texts]
    lengths = np.fromiter((0 if a is None else len(a) + 1 for a in arrays), dtype=np.int64, count=len(arrays))
    flat = np.empty(int(lengths.sum()), dtype=np.uint32)
    pos = 0
    for a in arrays:
        if a is None:                 # a skipped document: no tokens, but it counts for the cursor
            continue
        flat[pos] = tok.EOT_ID
        flat[pos + 1: pos + 1 + len(a)] = a
        pos += 1 + len(a)
    return flat, lengths


def batched(iterable, max_docs, max_chars):
    """Group texts into lists of at most max_docs documents / about max_chars characters."""
    batch, chars = [], 0
    for t in iterable:
        batch.append(t)
        chars += len(t or "")
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def ordered_map(submit, fetch, items, window):
    """Map in order with at most `window` items in flight: submit(item) -> handle, fetch(handle) -> result."""
    pending = collections.deque()
    for item in items:
        pending.append(submit(item))
        if len(pending) >= window:
            yield fetch(pending.popleft())
    while pending:
        yield fetch(pending.popleft())


def serial_map(batches):
    return map(encode_batch, batches)


# ----------------------------------------------------------------------------------------------------
# Output (local dir or any fsspec URL)
# ----------------------------------------------------------------------------------------------------

class Output:
    """A directory on any fsspec filesystem, with atomic whole-file writes."""

    def __init__(self, url):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, name):
        return f"{self.root}/{name}"

    @_on_out
    def exists(self, name):
        return self.fs.exists(self.path(name))

    @_on_out
    def read_text(self, name):
        with self.fs.open(self.path(name), "rb") as f:
            return f.read().decode("utf-8")

    @_on_out
    def write_atomic(self, name, data):
        """A file system: temp file + rename. An object store: one upload to the final name, since an
        object appears only whole, when its upload completes (and a "rename" there is copy + delete)."""
        target = self.path(name)
        tmp = self.path(name + ".tmp") if self.local else target
        self.fs.makedirs(self.root, exist_ok=True)
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        if tmp != target:
            self.fs.mv(tmp, target)

    @_on_out
    def remove_temps(self):
        if not self.fs.exists(self.root):
            return
        for p in self.fs.ls(self.root, detail=False):
            if str(p).endswith(".tmp"):
                self.fs.rm(p)

    @_on_out
    def list(self):
        if not self.fs.exists(self.root):
            return []
        return sorted(os.path.basename(str(p).rstrip("/")) for p in self.fs.ls(self.root, detail=False))


# ----------------------------------------------------------------------------------------------------
# Packing + manifest
# ----------------------------------------------------------------------------------------------------

@dataclass
class Writer:
    out: Output
    plan: list
    shard_size: int
    shards: list = field(default_factory=list)
    cursor: dict = field(default_factory=lambda: {"segment": 0, "docs": 0, "carry": 0})
    complete: bool = False
    # split -> per-token-id counts of its closed shards (the loader's unigram entropy); None when resuming
    # a manifest written before counts were recorded (then none are recorded)
    counts: dict = field(default_factory=dict)
    bad_docs: dict = field(default_factory=dict)    # kind -> bad documents before the cursor (all processes)

    def __post_init__(self):
        self.problems = DocProblems(self.bad_docs)
        self._buf = np.empty(self.shard_size, dtype=np.uint32)
        self._fill = 0

    # -- manifest ------------------------------------------------------------------------------------
    def manifest(self):
        m = {"format": FORMAT_VERSION, "tokenizer": tok.NAME, "vocab_size": tok.VOCAB_SIZE,
             "eot_id": tok.EOT_ID, "dtype": "uint32", "byteorder": "little",
             "shard_size": self.shard_size, "plan": self.plan, "shards": self.shards,
             "cursor": dict(self.cursor, bad_docs=dict(sorted(self.problems.total.items()))),
             "complete": self.complete}
        if self.counts is not None:
            m["token_counts"] = {k: encode_counts(v) for k, v in sorted(self.counts.items())}
        return m

    def _write_manifest(self):
        self.out.write_atomic(MANIFEST, (json.dumps(self.manifest(), indent=1) + "\n").encode())

    @classmethod
    def open(cls, out_url, plan, shard_size, resume):
        out = Output(out_url)
        if out.exists(MANIFEST):
            if not resume:
                raise FileExistsError(f"{out.path(MANIFEST)} already exists: pass --resume to continue it, "
                                      f"or choose an empty --out")
            m = json.loads(out.read_text(MANIFEST))
            if m.get("tokenizer") != tok.NAME or m.get("format") != FORMAT_VERSION:
                raise SourceError(f"{out.path(MANIFEST)}: written with tokenizer {m.get('tokenizer')!r} "
                                  f"format {m.get('format')}, this is {tok.NAME!r} format {FORMAT_VERSION}")
            if m["plan"] != json.loads(json.dumps(plan)) or m["shard_size"] != shard_size:
                raise SourceError(f"{out.path(MANIFEST)}: --resume with different sources or --shard_size than "
                                  f"the run that wrote it (manifest plan {m['plan']}, shard_size {m['shard_size']})")
            counts = m.get("token_counts")
            counts = ({k: decode_counts(v) for k, v in counts.items()} if counts is not None
                      else None if m["shards"] else {})
            cursor = dict(m["cursor"])
            w = cls(out, plan, shard_size, shards=m["shards"], complete=m["complete"], counts=counts,
                    bad_docs=cursor.pop("bad_docs", {}), cursor=cursor)
        else:
            w = cls(out, plan, shard_size)
        out.remove_temps()
        return w

    # -- shards --------------------------------------------------------------------------------------
    def _split_of_next(self, seg):
        if seg["split"] != "auto":
            return seg["split"]
        return "val" if len(self.shards) < seg["val_shards"] else "train"

    def _close_shard(self, seg, tokens):
        split = self._split_of_next(seg)
        idx = sum(1 for s in self.shards if s["split"] == split)
        name = f"{split}_{idx:06d}.bin"
        data = np.ascontiguousarray(tokens, dtype=DTYPE).tobytes()
        self.out.write_atomic(name, data)
        self.shards.append({"file": name, "split": split, "tokens": len(tokens),
                            "sha256": hashlib.sha256(data).hexdigest()})
        if self.counts is not None:
            c = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=tok.VOCAB_SIZE)
            self.counts[split] = self.counts.get(split, 0) + c

    def run(self, encode_map, progress=None, batch_docs=256, batch_chars=1 << 20):
        """Tokenize every remaining segment. encode_map(iterable of text batches) -> iterable of
        encode_batch results, in order."""
        if self.complete:
            return self
        for si in range(self.cursor["segment"], len(self.plan)):
            seg = self.plan[si]
            if si == self.cursor["segment"]:
                docs, carry = self.cursor["docs"], self.cursor["carry"]
            else:
                docs, carry = 0, 0
            self._fill = 0
            start = docs - 1 if carry else docs
            texts = iter_documents(seg["source"], start=start, problems=self.problems)
            doc_index = start
            first = bool(carry)
            # --max_tokens: the segment ends with the document that reaches it (never inside one, so that
            # a resume's carried tail is the document's own); its closed shards count from the manifest
            budget, packed = seg["source"].get("max_tokens"), self._segment_tokens(seg)
            for flat, lengths in encode_map(batched(texts, batch_docs, batch_chars)):
                if first:                               # the straddling document: keep only its tail
                    first = False
                    n0 = int(lengths[0])
                    self._pack(seg, si, flat[n0 - carry: n0], doc_index + 1, progress)
                    packed += carry
                    flat, lengths = flat[int(lengths[0]):], lengths[1:]
                    doc_index += 1
                offs = np.concatenate([[0], np.cumsum(lengths)])
                for j in range(len(lengths)):
                    if budget is not None and packed >= budget:
                        break
                    doc_index += 1
                    self._pack(seg, si, flat[offs[j]:offs[j + 1]], doc_index, progress)
                    packed += int(lengths[j])
                if budget is not None and packed >= budget:
                    break
            if seg["split"] == "auto":
                self._check_train_shard(seg)
            else:
                self._check_some_text(seg, doc_index)
            if self._fill:
                self._close_shard(seg, self._buf[: self._fill])
                self._fill = 0
            self.cursor = {"segment": si + 1, "docs": 0, "carry": 0}
            self.problems.commit(float("inf"))        # the segment is done: a resume reads none of it again
            self.complete = si + 1 == len(self.plan)
            self._write_manifest()
        if self.problems.total:
            print(f"tokenize: {self.problems.summary()}", file=sys.stderr, flush=True)
        return self

    def _segment_tokens(self, seg):
        """Tokens of the segment's closed shards: a plan's segments write splits of their own (auto: all)."""
        return sum(s["tokens"] for s in self.shards if seg["split"] in ("auto", s["split"]))

    def _check_train_shard(self, seg):
        """With one source split by --val_shards, refuse to end with no training shard at all."""
        if self._split_of_next(seg) == "train" and (self._fill or any(s["split"] == "train" for s in self.shards)):
            return
        n = sum(s["tokens"] for s in self.shards) + self._fill
        fit = n // (seg["val_shards"] + 1)
        raise SourceError(f"the source has only {n:,} tokens: --val_shards {seg['val_shards']} shards of --shard_size "
                          f"{self.shard_size:,} leave nothing for training. "
                          + (f"Use --shard_size {fit:,} or less (or fewer --val_shards, or more data); "
                             if fit else "Use more data; ")
                          + f"remove {self.out.url} first (it holds this run's partial output)")

    def _check_some_text(self, seg, n_docs):
        """A --train_source or --val_source without text would leave its split silently empty."""
        if self._fill or any(s["split"] == seg["split"] for s in self.shards):
            return
        flag, spec = f"--{seg['split']}_source", seg["source"]
        files = spec.get("files") or [spec.get("name") or spec["kind"]]
        name = files[0] + (f" and {len(files) - 1} more file(s)" if len(files) > 1 else "")
        raise SourceError(f"{flag} {name}: its {n_docs:,} document(s) hold no text, so the {seg['split']} split "
                          f"would be empty; give {flag} a source with text (or check --text_field)")

    def _pack(self, seg, si, toks, docs_after, progress):
        """Append one document's tokens; close every shard it fills. docs_after = documents consumed."""
        pos, n = 0, len(toks)
        while pos < n:
            take = min(self.shard_size - self._fill, n - pos)
            self._buf[self._fill: self._fill + take] = toks[pos: pos + take]
            self._fill += take
            pos += take
            if self._fill == self.shard_size:
                self._close_shard(seg, self._buf)
                self._fill = 0
                # tokens of this document not in a closed shard yet (they start the open shard)
                self.cursor = {"segment": si, "docs": docs_after, "carry": n - pos}
                # a resume starts at the straddling document (when some of it is carried), so its problem waits
                self.problems.commit(docs_after - 1 if pos < n else docs_after)
                self._write_manifest()
        if progress is not None:
            progress(n)


def tokenize(out, plan, shard_size=DEFAULT_SHARD_SIZE, resume=False, encode_map=serial_map, progress=None,
             batch_docs=256):
    """Run (or resume) a plan into `out` and return the final manifest dict."""
    w = Writer.open(out, plan, shard_size, resume)
    w.run(encode_map, progress=progress, batch_docs=batch_docs)
    return w.manifest()


def add_common_args(p):
    p.add_argument("--source", default=None,
                   help=f"HF dataset name streamed with `datasets` (e.g. {DEFAULT_HF_NAME}), local "
                        "text/json/jsonl(.gz)/parquet files or a directory (comma-separated), or 'bundled' "
                        "for the bundled KJV corpus with its own val split")
    p.add_argument("--train_source", default=None, help="separate train source (instead of --source)")
    p.add_argument("--val_source", default=None, help="separate val source, tokenized into val shards")
    p.add_argument("--hf_config", default=None, help=f"HF dataset config (e.g. {DEFAULT_HF_CONFIG})")
    p.add_argument("--hf_split", default="train")
    p.add_argument("--text_field", default="text")
    p.add_argument("--max_docs", type=int, default=None, help="stop each source after this many documents")
    p.add_argument("--max_tokens", type=int, default=None,
                   help="stop each source at the end of the document that brings it to this many tokens (a "
                        "budget: the guide's moe1B run reads 26.2B tokens in 100,000 steps, 6.8B to its stop)")
    p.add_argument("--out", required=True, help="output directory or fsspec URL (gs://bucket/prefix)")
    p.add_argument("--shard_size", type=int, default=DEFAULT_SHARD_SIZE, help="tokens per shard")
    p.add_argument("--val_shards", type=int, default=1,
                   help="with --source: the first this many shards are val, the rest train")
    p.add_argument("--resume", action="store_true", help="continue the run recorded in OUT/manifest.json")
    p.add_argument("--batch_docs", type=int, default=256, help="documents per worker task")
    p.add_argument("--no_progress", action="store_true")
    return p


def run_cli(a, run):
    """The drivers' main after parsing: run(plan) -> manifest, then the summary line and 0; a problem
    with the flags, sources or --out: one `error:` line and 2 (OutputError: its own exit code)."""
    try:
        m = run(plan_from_args(a))
    except CLI_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"{a.out}: {summary(m)}")
    return 0


def plan_from_args(a):
    if a.max_tokens is not None and a.max_tokens < 1:
        raise SourceError(f"--max_tokens must be a positive number of tokens, got {a.max_tokens}")
    if a.source is None and a.train_source is None:
        a.source = DEFAULT_HF_NAME
        a.hf_config = a.hf_config or DEFAULT_HF_CONFIG
    return make_plan(a.source, a.train_source, a.val_source, a.val_shards, hf_config=a.hf_config,
                     hf_split=a.hf_split, text_field=a.text_field, max_docs=a.max_docs, max_tokens=a.max_tokens)


def progress_bar(disable=False):
    from tqdm import tqdm
    bar = tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=disable, smoothing=0.05)
    return bar, bar.update


def summary(m):
    by = collections.Counter()
    for s in m["shards"]:
        by[s["split"]] += s["tokens"]
    return ", ".join(f"{k}: {sum(1 for s in m['shards'] if s['split'] == k)} shards {v:,} tokens"
                     for k, v in sorted(by.items()))
