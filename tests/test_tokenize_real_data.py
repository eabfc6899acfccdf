"""Tokenizing real-world text: bad documents are repaired or skipped, counted and named (source, row),
never a crash, and resuming past them stays exact; local files by extension (.csv included) never go
to the Hub; a source too small for --val_shards plus a training shard is a clear error."""
import gzip
import json

import numpy as np
import pytest

import tokenize_faults
from data import shards
from data_util import reference_tokens, shard_tokens

FFFD = "\ufffd"


GOOD = ["In the beginning was the word. " * 20, "And the word was good. " * 30, "The end. " * 25]


@pytest.fixture
def bad_jsonl(tmp_path):
    """Good documents around every kind of bad one, gzipped like a real dump."""
    lines = [json.dumps({"text": GOOD[0]}).encode(),
             b'{"text": "bad \xff\xfe bytes"}',                 # not UTF-8
             b'{"text": null}',
             b'{"text": "lone \\ud800 surrogate"}',             # valid JSON, not encodable text
             b'{"text": 42}',
             b'{"text": "truncated',                             # not JSON
             b'["a", "list"]',
             b'{"body": "no text field"}',
             json.dumps({"text": GOOD[1]}).encode(),
             b"",
             json.dumps({"text": GOOD[2]}).encode()]
    p = tmp_path / "dump.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return str(p)


WANT = [GOOD[0], f"bad {FFFD}{FFFD} bytes", f"lone {FFFD} surrogate", GOOD[1], GOOD[2]]


def test_bad_documents_are_repaired_or_skipped_counted_and_named(bad_jsonl, tmp_path, capsys):
    out = str(tmp_path / "out")
    m = shards.tokenize(out, shards.make_plan(train_source=bad_jsonl), 1_000)
    assert np.array_equal(shard_tokens(out)[1], reference_tokens(WANT))
    err = capsys.readouterr().err
    for row, what in [(1, "repaired: undecodable bytes"), (2, "skipped: null text"), (3, "repaired: undecodable bytes "
                      "or lone surrogates"), (4, "skipped: text of type int, not a string"), (5, "skipped: not valid JSON"),
                      (6, "skipped: a JSON line that is not an object"), (7, "skipped: no field 'text'")]:
        assert f"warning: {bad_jsonl} row {row}: {what}" in err, (row, err)
    assert "tokenize: 7 bad document(s): 2 repaired" in err
    assert m["complete"] and m["cursor"] == {"segment": 1, "docs": 0, "carry": 0}


class _Crash(Exception):
    pass


def crash():
    raise _Crash()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_resume_over_bad_documents_is_exact(bad_jsonl, tmp_path, monkeypatch, n):
    """Skipped documents still count for the cursor: a crash after the n-th packed document resumes to
    the same bytes, and the bad documents before the cursor are not reported again."""
    plan = shards.make_plan(train_source=bad_jsonl)
    shards.tokenize(str(tmp_path / "ref"), plan, 300)
    out = str(tmp_path / "out")
    with monkeypatch.context() as m:
        tokenize_faults.install(m.setattr, ("doc", n), crash)
        with pytest.raises(_Crash):
            shards.tokenize(out, plan, 300)
    shards.tokenize(out, plan, 300, resume=True)
    assert shards.Output(out).list() == shards.Output(str(tmp_path / "ref")).list()
    for name in shards.Output(out).list():
        assert open(f"{out}/{name}", "rb").read() == open(f"{tmp_path}/ref/{name}", "rb").read(), name


def test_csv_and_text_files_are_local_sources(tmp_path, capsys):
    (tmp_path / "docs.csv").write_bytes(b"id,text\n1,\"" + GOOD[0].encode() + b"\"\n2,\"multi\nline, quoted\"\n"
                                        b"3,caf\xe9\n")                      # Latin-1 byte: repaired
    (tmp_path / "a.txt").write_bytes(GOOD[1].encode() + b"\x80")
    for source, want in [(str(tmp_path / "docs.csv"), [GOOD[0], "multi\nline, quoted", f"caf{FFFD}"]),
                         (str(tmp_path / "a.txt"), [GOOD[1] + FFFD])]:
        out = str(tmp_path / ("out_" + source.rsplit(".", 1)[1]))
        shards.tokenize(out, shards.make_plan(train_source=source), 1_000)
        assert np.array_equal(shard_tokens(out)[1], reference_tokens(want)), source
    err = capsys.readouterr().err
    assert f"{tmp_path / 'docs.csv'} row 2: repaired" in err and f"{tmp_path / 'a.txt'} row 0: repaired" in err


def test_source_too_small_for_val_shards_says_what_shard_size_works(tmp_path):
    src = tmp_path / "small.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in GOOD))
    n = len(reference_tokens(GOOD))
    plan = shards.make_plan(str(src), val_shards=2)
    with pytest.raises(ValueError, match=rf"only {n:,} tokens: --val_shards 2 shards of --shard_size 1,000 leave "
                                         rf"nothing for training. Use --shard_size {n // 3:,} or less"):
        shards.tokenize(str(tmp_path / "a"), plan, 1_000)
    m = shards.tokenize(str(tmp_path / "b"), plan, n // 3)          # the suggested size works
    assert [s["split"] for s in m["shards"]] == ["val", "val", "train"] + ["train"] * (len(m["shards"]) - 3)
