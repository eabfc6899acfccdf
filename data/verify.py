"""The full check of a shard directory, separate from training start-up:

    python -m data.verify DIR_OR_URL [--vocab_size 100277] [--split train]

Reads every shard of the manifest once (local directory or any fsspec URL, streamed in chunks; nothing
is cached on disk) and checks its size, its sha256, that every token id is below the vocabulary, and
that the per-token counts add up to the manifest's `token_counts`. Prints one line per problem and a
summary; exits 1 when anything is wrong. Training itself only checks sizes at start
(dataset.TokenDataset) and token ids as it reads them.
"""
import argparse
import hashlib
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsspec  # noqa: E402
import numpy as np  # noqa: E402

from data import manifest  # noqa: E402
from data import tokenizer as tok  # noqa: E402

CHUNK = 1 << 24


def check_shard(fs, path, name, entry, vocab_size):
    """(problems, per-token counts) of one shard, read once in CHUNK-byte pieces."""
    h, size, top = hashlib.sha256(), 0, 0
    counts = np.zeros(vocab_size, dtype=np.int64)
    try:
        with fs.open(path, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                h.update(chunk)
                size += len(chunk)
                toks = np.frombuffer(chunk[: len(chunk) // 4 * 4], dtype=manifest.DTYPE)
                if toks.size:
                    top = max(top, int(toks.max()))
                    counts += np.bincount(toks[toks < vocab_size].astype(np.int64), minlength=vocab_size)
    except FileNotFoundError:
        return [f"shard {name} listed in the manifest is missing"], counts
    problems = []
    if size != 4 * int(entry["tokens"]):
        problems.append(f"shard {name} is truncated or corrupt: {size} bytes, the manifest says "
                        f"{entry['tokens']} tokens ({4 * int(entry['tokens'])} bytes)")
    if h.hexdigest() != entry["sha256"]:
        problems.append(f"shard {name} is corrupt: sha256 {h.hexdigest()} != manifest {entry['sha256']}")
    if top >= vocab_size:
        problems.append(f"shard {name} holds token id {top} >= vocab_size {vocab_size}")
    return problems, counts


def verify(data_dir, vocab_size=tok.VOCAB_SIZE, split=None, out=print):
    """All problems found in `data_dir` (an empty list when every check passes)."""
    fs, root = fsspec.core.url_to_fs(data_dir)
    root, base = root.rstrip("/"), data_dir.rstrip("/")
    m = manifest.read_manifest(fs, root, f"{base}/{manifest.MANIFEST}", vocab_size)
    entries = [s for s in m["shards"] if split is None or s["split"] == split]
    problems, totals = [], {}
    for i, s in enumerate(entries):
        p, counts = check_shard(fs, f"{root}/{s['file']}", f"{base}/{s['file']}", s, vocab_size)
        problems += p
        totals[s["split"]] = totals.get(s["split"], 0) + counts
        out(f"[{i + 1}/{len(entries)}] {s['file']}: {'ok' if not p else 'BAD'}")
    recorded = m.get("token_counts")
    if recorded is None:
        out(f"note: {base}/{manifest.MANIFEST} records no token counts (written by an older tokenizer)")
    else:
        for sp, counts in sorted(totals.items()):
            want = manifest.decode_counts(recorded[sp]) if sp in recorded else None
            if want is None or not np.array_equal(np.pad(want, (0, max(0, vocab_size - len(want))))[:vocab_size],
                                                  counts):
                problems.append(f"{base}/{manifest.MANIFEST}: token_counts of split {sp!r} do not match its shards")
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data_dir", help="shard directory or fsspec URL (gs://bucket/prefix)")
    p.add_argument("--vocab_size", type=int, default=tok.VOCAB_SIZE, help="token ids must be below this")
    p.add_argument("--split", default=None, help="check only this split (default: all)")
    a = p.parse_args(argv)
    try:
        problems = verify(a.data_dir, a.vocab_size, a.split)
    except manifest.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    print(f"{a.data_dir}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
