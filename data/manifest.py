"""A shard directory's `manifest.json`: its name and format, the compact encoding of its token counts, and
reading it back checked against this code's tokenizer (data/shards.py writes it; the loader, dataset.py,
and data/verify.py read it with `read_manifest`).

Shards are `<split>_<NNNNNN>.bin` files of little-endian uint32 tokens (DTYPE); the manifest lists each
one (file, split, tokens, sha256) and records the tokenizer, FORMAT_VERSION, each split's per-token-id
counts (`token_counts`) and whether the tokenization finished (`complete`).
"""
import base64
import json
import zlib

import numpy as np

from data import tokenizer as tok

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
DTYPE = "<u4"


class DataError(ValueError):
    """A problem with the token data (always names the manifest or shard file)."""


def encode_counts(counts):
    """Per-token-id counts as a compact manifest string: base64 of zlib-compressed little-endian uint64."""
    return base64.b64encode(zlib.compress(np.asarray(counts, dtype="<u8").tobytes(), 6)).decode("ascii")


def decode_counts(text):
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<u8").astype(np.int64)


def read_manifest(fs, root, manifest_path, vocab_size):
    """The manifest dict, checked against this code's tokenizer and format and the model's vocab."""
    try:
        with fs.open(f"{root}/{MANIFEST}", "rb") as f:
            m = json.loads(f.read().decode("utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        where = manifest_path.rsplit("/", 1)[0]
        what = f"{manifest_path}: no manifest" if fs.isdir(root) else f"{where}: no such directory"
        raise DataError(f"{what}; tokenize into it first (python -m data.tokenize_local --out {where} ...)") from None
    except ValueError as e:
        raise DataError(f"{manifest_path}: not valid JSON ({e}); re-tokenize the data") from None
    if not isinstance(m, dict):
        raise DataError(f"{manifest_path}: not a shard manifest (a JSON object); re-tokenize the data")
    if m.get("tokenizer") != tok.NAME:
        raise DataError(f"{manifest_path}: shards were tokenized with {m.get('tokenizer')!r}, but this "
                        f"code uses {tok.NAME!r}; re-tokenize the data")
    if m.get("dtype") != "uint32" or m.get("format") != FORMAT_VERSION:
        raise DataError(f"{manifest_path}: unsupported format {m.get('format')} / dtype {m.get('dtype')}")
    if int(m.get("vocab_size", 0)) > vocab_size:
        raise DataError(f"{manifest_path}: tokenizer vocab {m.get('vocab_size')} exceeds --vocab_size {vocab_size}; "
                        f"use --vocab_size {m.get('vocab_size')} or more")
    if not m.get("complete"):
        raise DataError(f"{manifest_path}: tokenization did not finish; rerun the tokenizer with --resume")
    return m
