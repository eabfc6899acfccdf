"""One document source: its JSON-able spec (recorded in the manifest's plan) and its documents, in a fixed
order (data/shards.py packs their tokens into shards).

Documents come from a Hugging Face dataset name (streamed with `datasets`) or local / fsspec files
recognised by extension (.txt, .json, .jsonl, .parquet, .csv, optionally compressed; a missing file is
an error, never a Hub lookup). Parquet goes through `datasets` too; text, JSON and CSV are read here,
since pyarrow rejects a whole file for one bad byte or lone-surrogate escape. A bad document (undecodable
bytes, lone surrogates: repaired to U+FFFD; null or non-string text, a row without the text field, a
line that is not a JSON object: skipped) is counted and named (source, row) in a warning, with a summary
at the end; a skipped document still counts for the cursor, so resuming stays exact. A compressed file
cut short (an interrupted download) or damaged keeps what could be read: the rest of it is one bad
document, always warned about.
"""
import collections
import csv
import gzip
import hashlib
import io
import itertools
import json
import os
import re
import sys
import zlib

import fsspec

from data import corpus

BUNDLED = "bundled"
_FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                  ".csv": "csv"}
# a missing path with one of these endings is a file the user meant, never a Hugging Face dataset name
_DATA_FILE_ENDINGS = tuple(_FILE_BUILDERS) + (".tsv", ".gz", ".bz2", ".zst", ".xz", ".arrow", ".md")
_SURROGATES = re.compile("[\ud800-\udfff]")
# how a compressed file cut short (an interrupted download) or damaged shows when read
_UNREADABLE = (EOFError, zlib.error, gzip.BadGzipFile)
# this many leading rows of a source without the text field mean a wrong --text_field, not bad rows
_FIELD_GUARD = 100


class SourceError(ValueError):
    """A problem with the tokenizer's flags, sources or output: the drivers print it as one line, exit 2."""


def _extension(path):
    """The file type's extension, past a compression suffix: 'a.jsonl.gz' -> '.jsonl'."""
    p = path[:-3] if path.endswith((".gz", ".zst")) else path
    p = p[:-4] if p.endswith(".bz2") else p
    return os.path.splitext(p)[1].lower()


def _builder_for(path):
    ext = _extension(path)
    if ext not in _FILE_BUILDERS:
        raise SourceError(f"source file {path}: unknown type {ext!r}; expected one of {sorted(_FILE_BUILDERS)}"
                          f" (optionally .gz)")
    return _FILE_BUILDERS[ext]


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _looks_like_file(p):
    return p.lower().endswith(_DATA_FILE_ENDINGS)


def source_spec(source, hf_config=None, hf_split="train", text_field="text", max_docs=None, max_tokens=None):
    """A JSON-able description of one document source (recorded in the manifest).

    `source` is a Hugging Face dataset name (streamed), one or more local files / a directory / a glob
    (comma-separated), or "bundled:train" / "bundled:val" for the bundled corpus' splits. max_tokens: the
    source ends with the document that brings its tokens to at least this many (recorded only when set,
    so that manifests written without it resume unchanged).
    """
    if source.startswith(BUNDLED + ":"):
        split = source.split(":", 1)[1]
        if split not in corpus.SPLITS:
            raise SourceError(f"bundled source split must be one of {corpus.SPLITS}, got {source!r}")
        # recorded by content, not path, so a manifest does not depend on where the repo is checked out
        spec = {"kind": BUNDLED, "split": split, "sha256": file_sha256(corpus.PATH), "text_field": "text"}
    else:
        parts = [s for s in source.split(",") if s]
        local = [p for p in parts if os.path.exists(p) or any(c in p for c in "*?[") or "://" in p]
        if local and len(local) == len(parts):
            files = []
            for p in parts:
                if os.path.isdir(p):
                    files += sorted(os.path.join(p, f) for f in os.listdir(p)
                                    if not f.startswith(".") and os.path.isfile(os.path.join(p, f)))
                else:
                    files.append(p)
            builders = {_builder_for(f) for f in files}
            if len(builders) != 1:
                raise SourceError(f"source {source!r} mixes file types {sorted(builders)}; use one type per source")
            spec = {"kind": "files", "builder": builders.pop(),
                    "files": [f if "://" in f else os.path.abspath(f) for f in files], "text_field": text_field}
        else:
            missing = [p for p in parts if p not in local]
            if any(p.startswith((".", "/")) or _looks_like_file(p) for p in missing):
                raise FileNotFoundError(f"source {source!r}: no such file or directory: {missing}")
            spec = {"kind": "hf", "name": source, "config": hf_config, "split": hf_split, "text_field": text_field}
    spec["max_docs"] = max_docs
    if max_tokens is not None:
        spec["max_tokens"] = max_tokens
    return spec


class DocProblems:
    """Bad documents met while reading: each one counted and (the first `show` this process meets, and every
    file cut short) warned about with its source and row; `summary()` at the end.

    `total` counts them by kind over every process that wrote the output (the manifest keeps it in the
    resume cursor). A document's problem joins it once the cursor has passed the document (`commit`), since
    a resumed run reads the documents after the cursor again: none is counted twice, none lost."""

    def __init__(self, total=None, show=20):
        self.total, self.pending = collections.Counter(total or {}), collections.deque()
        self.show, self.shown = show, 0

    def note(self, source, row, what, index, always=False):
        """A bad document, number `index` of its segment's document order."""
        self.pending.append((index, what))
        if always or self.shown < self.show:
            print(f"warning: {source} row {row}: {what}", file=sys.stderr, flush=True)
        elif self.shown == self.show:
            print("warning: more bad documents: counted, not shown", file=sys.stderr, flush=True)
        self.shown += not always

    def commit(self, before):
        """The problems of the documents numbered below `before` join `total`."""
        while self.pending and self.pending[0][0] < before:
            self.total[self.pending.popleft()[1]] += 1

    def summary(self):
        if not self.total:
            return ""
        return (f"{sum(self.total.values()):,} bad document(s): "
                + "; ".join(f"{n:,} {what}" for what, n in self.total.most_common()))


def clean_text(value):
    """(text or None, problem or None): a str the tokenizer accepts, or None for a document to skip.
    Undecodable bytes (read as surrogate escapes) and lone surrogates become U+FFFD."""
    if value is None:
        return None, "skipped: null text"
    if isinstance(value, bytes):
        value = value.decode("utf-8", "surrogateescape")
    if not isinstance(value, str):
        return None, f"skipped: text of type {type(value).__name__}, not a string"
    if _SURROGATES.search(value):
        return _SURROGATES.sub("\ufffd", value), "repaired: undecodable bytes or lone surrogates -> U+FFFD"
    return value, None


def _open_bytes(path):
    return fsspec.open(path, "rb", compression="infer")


def _text_rows(path):
    with _open_bytes(path) as f:
        yield 0, {"text": f.read().decode("utf-8", "surrogateescape")}


def _json_rows(path):
    """Rows of a JSON Lines file (one object per line; a .jsonl always), or of a .json holding an array of
    objects or strings. Read here rather than by pyarrow, which rejects a whole file for one lone-surrogate
    escape or bad byte."""
    with _open_bytes(path) as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        if first == b"[" and _extension(path) == ".json":
            try:
                rows = json.loads((first + f.read()).decode("utf-8", "surrogateescape"))
            except ValueError as e:
                raise SourceError(f"source file {path}: not valid JSON ({e})") from None
            for j, r in enumerate(rows):
                yield j, (r if isinstance(r, dict) else {"text": r})
            return
        j = 0                          # JSON Lines, streamed
        for line in itertools.chain([first + f.readline()], f):
            if not line.strip():
                continue
            try:
                r = json.loads(line.decode("utf-8", "surrogateescape"))
            except ValueError:
                r = _Bad("skipped: not valid JSON")
            yield j, (r if isinstance(r, (dict, _Bad)) else _Bad("skipped: a JSON line that is not an object"))
            j += 1


def _csv_rows(path):
    csv.field_size_limit(2**31 - 1)            # documents are longer than csv's 128 KiB default
    with _open_bytes(path) as fb:
        reader = csv.reader(io.TextIOWrapper(fb, encoding="utf-8", errors="surrogateescape", newline=""))
        header = next(reader, [])
        for j, rec in enumerate(reader):
            yield j, dict(zip(header, rec))


class _Bad:
    """A row that is no document: `what` is wrong with it; `always` warned about (a file cut short)."""

    def __init__(self, what, always=False):
        self.what, self.always = what, always


def _rows(spec):
    """(source name, row number, row dict) of a source, in a fixed order."""
    if spec["kind"] == "hf":
        import datasets  # heavy import, only where documents are read
        ds = datasets.load_dataset(spec["name"], spec["config"], split=spec["split"], streaming=True)
        for j, row in enumerate(ds):
            yield spec["name"], j, row
        return
    builder = "json" if spec["kind"] == BUNDLED else spec["builder"]
    for path in ([corpus.PATH] if spec["kind"] == BUNDLED else spec["files"]):
        if builder == "parquet":
            import datasets
            rows = enumerate(datasets.load_dataset("parquet", data_files=[path], split="train", streaming=True))
        else:
            rows = {"text": _text_rows, "json": _json_rows, "csv": _csv_rows}[builder](path)
        j = -1
        try:
            for j, row in rows:
                yield path, j, row
        except _UNREADABLE as e:   # keep what was read: one bad row, as the rest of the source is fine
            yield path, j + 1, _Bad(f"skipped: the rest of the file, cut short or damaged ({type(e).__name__}: "
                                    f"{e})", always=True)


def iter_documents(spec, start=0, problems=None):
    """Texts of a source from document index `start` on, in a fixed order; None for a document that is
    skipped (it still counts as a document, so the resume cursor is unchanged). Bad documents before
    `start` were reported by the run that read them."""
    problems = problems if problems is not None else DocProblems()
    field_, limit = spec["text_field"], spec.get("max_docs")
    want_val = spec.get("split") == "val"
    i, seen_field, lacking = 0, False, 0
    for source, row_no, row in _rows(spec):
        if spec["kind"] == BUNDLED and (row["book"] in corpus.VAL_BOOKS) != want_val:
            continue
        if limit is not None and i >= limit:
            return
        if isinstance(row, dict) and not seen_field:
            seen_field = field_ in row
            lacking += not seen_field
            if lacking == _FIELD_GUARD:
                raise SourceError(f"source {source}: none of the first {lacking} rows has the field {field_!r} "
                                  f"(fields: {sorted(row)}); pass --text_field")
        if i >= start:
            if isinstance(row, _Bad):
                text, what, always = None, row.what, row.always
            else:
                text, what = clean_text(row.get(field_)) if field_ in row else (None, f"skipped: no field {field_!r}")
                always = False
            if what:
                problems.note(source, row_no, what, i, always)
            yield text
        i += 1
