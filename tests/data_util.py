"""Helpers shared by the data tests: the bundled corpus' documents, the expected token stream and the one a
run wrote, and the multiprocessing tokenizer run as a subprocess, SIGKILLed at chosen points."""
import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

from data import corpus, manifest, shards
from data import tokenizer as tok
from ceiling import CEILING_S

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SHARD = 2_500                   # shard size of the small tokenizer source's runs


def corpus_documents(split):
    """Chapter texts of one split of the bundled corpus, in canonical order, read here independently of
    data/sources.py (which the tests check against it)."""
    assert split in corpus.SPLITS, split
    with gzip.open(corpus.PATH, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r["text"] for r in rows if (r["book"] in corpus.VAL_BOOKS) == (split == "val")]


def tokenize_docs():
    """Small, varied documents: the val chapters, an empty one, and one longer than two shards."""
    val = corpus_documents("val")
    return val[:20] + [""] + ["\n\n".join(corpus_documents("train")[:12])] + val[20:]


def reference_tokens(docs):
    """What tokenizing docs must give: each document prefixed with <|endoftext|>, encode_ordinary."""
    enc = tok.get_tokenizer()
    return np.concatenate([np.array([tok.EOT_ID] + enc.encode_ordinary(t), dtype=np.uint32) for t in docs])


def shard_tokens(out_url):
    """(manifest, every shard's tokens in order) of a tokenizer output, each shard's size and sha256
    checked against the manifest."""
    out = shards.Output(out_url)
    m = json.loads(out.read_text(manifest.MANIFEST))
    parts = []
    for s in m["shards"]:
        with out.fs.open(out.path(s["file"]), "rb") as f:
            data = f.read()
        assert len(data) == 4 * s["tokens"] and hashlib.sha256(data).hexdigest() == s["sha256"]
        parts.append(np.frombuffer(data, dtype="<u4"))
    return m, np.concatenate(parts)


def output_files(out_url):
    """{name: bytes} of every file in a tokenizer output (temp files included)."""
    out = shards.Output(out_url)
    res = {}
    for name in out.list():
        with out.fs.open(out.path(name), "rb") as f:
            res[name] = f.read()
    return res


def run_driver(args, env_extra, point="none", check=True):
    """data.tokenize_local with these flags as a subprocess in its own session, killed at `point`
    ("EVENT:N", tests/tokenize_faults.py) or not ("none")."""
    env = dict(os.environ, **env_extra)
    p = subprocess.run([sys.executable, os.path.join(TESTS, "tokenize_faults.py"), point, *args, "--no_progress"],
                       env=env, cwd=REPO, start_new_session=True, capture_output=True, text=True, timeout=CEILING_S)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def kill_chain(src, out, points, env, workers=2):
    """Run the multiprocessing driver, SIGKILLed at each point in turn (each a --resume of the last),
    then resume to the end. Returns the manifest's carry after each kill (None: no manifest yet)."""
    args = ["--source", src, "--out", out, "--shard_size", str(SHARD), "--val_shards", "1",
            "--workers", str(workers), "--batch_docs", "4"]
    carries = []
    for i, point in enumerate(points):
        p = run_driver(args + (["--resume"] if i else []), env, point, check=False)
        assert p.returncode == -9, (point, p.returncode, p.stderr[-3000:])
        o = shards.Output(out)
        m = json.loads(o.read_text(manifest.MANIFEST)) if o.exists(manifest.MANIFEST) else None
        assert m is None or not m["complete"]
        carries.append(m and m["cursor"]["carry"])
    run_driver(args + ["--resume"], env)
    return carries
