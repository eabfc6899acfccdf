"""Tokenizing real-world text: bad documents are repaired or skipped, counted and named (source, row),
never a crash, wherever they are in a file (its first row too, a compressed file cut short), and
resuming past them stays exact, their count included, after a SIGKILL; local files by extension
(.csv included) never go to the Hub; a source too small for --val_shards plus a training shard, or a
val source without text, is a clear error."""
import gzip
import json
import os
import subprocess
import zlib

import numpy as np
import pytest

import tokenize_faults
from data import manifest, shards
from data_util import SHARD, corpus_documents, output_files, reference_tokens, run_driver, shard_tokens, tokenize_docs

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
BAD_DOCS = {"repaired: undecodable bytes or lone surrogates -> U+FFFD": 2, "skipped: a JSON line that is not an object": 1,
            "skipped: no field 'text'": 1, "skipped: not valid JSON": 1, "skipped: null text": 1,
            "skipped: text of type int, not a string": 1}          # the manifest's count, by kind


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
    assert m["complete"] and m["cursor"] == {"segment": 1, "docs": 0, "carry": 0, "bad_docs": BAD_DOCS}


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


def driver(tmp_path, *args, point="none"):
    """data.tokenize_local as a user runs it (a subprocess; SIGKILLed at `point`) into tmp_path/out."""
    return run_driver(["--out", str(tmp_path / "out"), "--workers", "0", *args], {}, point, check=False)


def one_line_error(p):
    """The driver's stderr, checked to be one `error:` line and exit 2."""
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


@pytest.mark.parametrize("first,what", [(b'{"body": "no text field"}', "skipped: no field 'text'"),
                                        (b'["a", "list"]', "skipped: a JSON line that is not an object")],
                         ids=["no-text-field", "json-array"])
def test_a_bad_first_row_is_skipped_like_any_other(tmp_path, first, what):
    """A .jsonl is JSON Lines whatever its first line holds; a bad first row is one bad document."""
    src = tmp_path / "dump.jsonl"
    src.write_bytes(b"\n".join([first] + [json.dumps({"text": t}).encode() for t in GOOD]) + b"\n")
    p = driver(tmp_path, "--train_source", str(src), "--shard_size", "1000")
    assert p.returncode == 0, p.stderr[-3000:]
    assert np.array_equal(shard_tokens(str(tmp_path / "out"))[1], reference_tokens(GOOD))
    assert f"warning: {src} row 0: {what}" in p.stderr and "tokenize: 1 bad document(s)" in p.stderr


def test_a_source_whose_rows_lack_the_text_field_is_a_wrong_text_field(tmp_path):
    """Not a stream of bad rows to skip through (hours, on a Hub dataset): after the first 100 (the
    first 20 warned about) it stops, exit 2, saying so."""
    src = tmp_path / "dump.jsonl"
    src.write_text("".join(json.dumps({"content": t}) + "\n" for t in GOOD * 40))
    p = driver(tmp_path, "--train_source", str(src), "--shard_size", "1000")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (f"error: source {src}: none of the first 100 rows has the field "
                                                 f"'text' (fields: ['content']); pass --text_field")
    assert driver(tmp_path, "--train_source", str(src), "--shard_size", "1000", "--text_field", "content",
                  "--max_docs", "3").returncode == 0


def test_a_gz_cut_short_keeps_what_was_read_and_names_the_file(tmp_path):
    """An interrupted download: every whole line before the cut is tokenized, the rest of the file is one
    bad document named in a warning, and the job finishes (one bad file does not stop a long run)."""
    docs = corpus_documents("val")
    whole = gzip.compress(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in docs))
    src = tmp_path / "dump.jsonl.gz"
    src.write_bytes(whole[: len(whole) * 2 // 3])
    readable = zlib.decompressobj(wbits=31).decompress(src.read_bytes())      # what the cut left, read here
    kept = [json.loads(line)["text"] for line in readable.split(b"\n")[:-1]]
    assert 0 < len(kept) < len(docs)
    p = driver(tmp_path, "--train_source", str(src), "--shard_size", "5000")
    assert p.returncode == 0, p.stderr[-3000:]
    m, toks = shard_tokens(str(tmp_path / "out"))
    assert m["complete"] and np.array_equal(toks, reference_tokens(kept))
    warnings = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {src} row {len(kept)}: skipped: the rest of "
                                                         f"the file, cut short"), p.stderr


@pytest.mark.parametrize("val", ["", "empty.jsonl"], ids=["empty-flag", "no-documents"])
def test_a_val_source_without_text_is_refused_naming_the_flag(tmp_path, val):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in GOOD))
    p = driver(tmp_path, "--train_source", str(tmp_path / "train.jsonl"),
               "--val_source", val and str(tmp_path / val), "--shard_size", "1000")
    assert one_line_error(p).startswith(f"error: --val_source {tmp_path / val if val else repr('')}"), p.stderr
    assert not os.path.exists(tmp_path / "out")            # nothing half-written


def test_the_bad_document_count_survives_a_sigkill_and_resume(bad_jsonl, tmp_path):
    """The manifest counts the bad documents of every process that wrote it: a run SIGKILLed after the
    documents before its first shard boundary (bad ones among them) and resumed records and reports
    the same count as an uninterrupted one, and the same bytes."""
    args = ["--train_source", bad_jsonl, "--shard_size", "300"]
    ref = driver(tmp_path / "ref", *args)
    assert ref.returncode == 0 and "tokenize: 7 bad document(s)" in ref.stderr, ref.stderr[-3000:]
    killed = driver(tmp_path, *args, point="manifest:1")
    assert killed.returncode == -9, killed.stderr[-3000:]
    cursor = json.loads((tmp_path / "out" / manifest.MANIFEST).read_text())["cursor"]
    assert cursor["docs"] - (cursor["carry"] > 0) > 7          # past every bad document: a resume reads none
    resumed = driver(tmp_path, *args, "--resume")
    assert resumed.returncode == 0 and "warning:" not in resumed.stderr, resumed.stderr[-3000:]
    assert "tokenize: 7 bad document(s): 2 repaired" in resumed.stderr
    m = json.loads((tmp_path / "out" / manifest.MANIFEST).read_text())
    assert m["cursor"]["bad_docs"] == BAD_DOCS
    for name in os.listdir(tmp_path / "ref" / "out"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / "out" / name).read_bytes(), name


def _mount(tmp_path, *args):
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount here ({proc.stderr.strip()}): a read-only or full --out needs a mount")


@pytest.mark.parametrize("how, cause", [(("--bind", "-o", "ro"), "[Errno 30] Read-only file system"),
                                        (("-t", "tmpfs", "-o", "size=1m"), "[Errno 28] No space left on device")],
                         ids=["read-only", "full"])
def test_an_out_that_cannot_be_written_is_one_line(tmp_path, how, cause):
    """A read-only or full --out: one `error:` line naming --out and the OS error, exit 2 (a traceback and
    exit 1 before)."""
    disk = tmp_path / "disk"
    os.makedirs(disk)
    _mount(tmp_path, *how, *((str(disk),) if how[0] == "--bind" else ("tmpfs",)), str(disk))
    try:
        p = run_driver(["--source", "bundled", "--out", str(disk / "out"), "--workers", "0", "--shard_size",
                        "100000"], {}, check=False)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert one_line_error(p).startswith(f"error: --out {disk}/out: cannot write there ({cause}"), p.stderr
    assert p.stderr.strip().endswith("choose an --out this process can write")


def test_max_tokens_ends_a_source_with_the_document_that_reaches_it_and_resumes_exactly(src, tmp_path):
    """--max_tokens N: the source ends with the first document whose tokens bring it to N (never inside a
    document); killed after the first shard and resumed, the same bytes."""
    docs = tokenize_docs()
    lengths = np.cumsum([len(reference_tokens([d])) for d in docs])
    budget = int(lengths[len(lengths) // 2]) - 5               # inside a document, past several shards
    kept = int(np.searchsorted(lengths, budget)) + 1          # the documents up to the one reaching it
    args = ["--train_source", src, "--shard_size", str(SHARD), "--max_tokens", str(budget)]
    whole = driver(tmp_path / "whole", *args)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert np.array_equal(shard_tokens(str(tmp_path / "whole" / "out"))[1], reference_tokens(docs[:kept]))
    assert driver(tmp_path, *args, point="shard:1").returncode == -9
    assert driver(tmp_path, *args, "--resume").returncode == 0
    assert output_files(str(tmp_path / "out")) == output_files(str(tmp_path / "whole" / "out"))
    assert one_line_error(driver(tmp_path / "bad", *args[:-1], "0")) == (
        "error: --max_tokens must be a positive number of tokens, got 0")
