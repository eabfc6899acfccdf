"""Helpers shared by the tokenizer tests: the expected token stream and the one a run wrote."""
import hashlib
import json

import numpy as np

from data import shards
from data import tokenizer as tok


def reference_tokens(docs):
    """What tokenizing docs must give: each document prefixed with <|endoftext|>, encode_ordinary."""
    enc = tok.get_tokenizer()
    return np.concatenate([np.array([tok.EOT_ID] + enc.encode_ordinary(t), dtype=np.uint32) for t in docs])


def shard_tokens(out_url):
    """(manifest, every shard's tokens in order) of a tokenizer output, each shard's size and sha256
    checked against the manifest."""
    out = shards.Output(out_url)
    m = json.loads(out.read_text(shards.MANIFEST))
    parts = []
    for s in m["shards"]:
        with out.fs.open(out.path(s["file"]), "rb") as f:
            data = f.read()
        assert len(data) == 4 * s["tokens"] and hashlib.sha256(data).hexdigest() == s["sha256"]
        parts.append(np.frombuffer(data, dtype="<u4"))
    return m, np.concatenate(parts)
