"""cl100k_base as transformers' tokenizer files (tokenizer.json, tokenizer_config.json), for convert.py's
export: AutoTokenizer encodes text exactly as data/tokenizer.py's tiktoken Encoding does, and every
special token keeps tiktoken's id.

The tokenizers library ignores the ids tokenizer.json gives its added tokens: it numbers them one after
another from the end of the BPE vocabulary, in the order listed. cl100k_base's BPE ranks end at 100255 and
its special tokens sit at 100257-100260 and 100276, so the unused ids between them (100256, 100261-100275)
are filled with placeholder special tokens, `<|reserved_ID|>`: the added tokens are then contiguous and
each lands on its own id.
"""
from data.tokenizer import EOT_ID, PATTERN, get_tokenizer

EOT = "<|endoftext|>"


def added_tokens(enc):
    """[(id, content)] from the first id past the BPE ranks to the last special token: cl100k_base's special
    tokens at their ids and a placeholder at each unused id (tiktoken decodes none of those)."""
    specials = {enc.encode_single_token(s): s for s in enc.special_tokens_set}
    n_ranks = sum(i not in specials and _is_rank(enc, i) for i in range(enc.n_vocab))
    assert all(_is_rank(enc, i) for i in range(n_ranks)), "the BPE vocabulary must be ids 0 to N - 1"
    return [(i, specials.get(i, f"<|reserved_{i}|>")) for i in range(n_ranks, enc.n_vocab)]


def _is_rank(enc, i):
    try:
        enc.decode_single_token_bytes(i)
        return True
    except KeyError:
        return False


def tokenizer_files(T):
    """{file name: JSON} for transformers' tokenizer: cl100k_base as data/tokenizer.py builds it, such that
    AutoTokenizer encodes text exactly as tiktoken's encode_ordinary (the special tokens in text are plain
    text, split_special_tokens) and tokenizer(text) prefixes <|endoftext|>, as every document here is."""
    enc = get_tokenizer()
    added = added_tokens(enc)
    ranks = {enc.decode_single_token_bytes(i): i for i in range(added[0][0])}
    char = byte_chars()
    text = lambda token: "".join(char[b] for b in token)
    # tokenizers' regex engine (Oniguruma, Ruby syntax) reads tiktoken's possessive `{1,3}+` as "one or more
    # runs of 1-3 digits" (a 7-digit number would be one piece); the plain greedy {1,3} splits digits as
    # tiktoken does, since nothing follows it in its alternative to backtrack into it.
    digits = r"\p{N}{1,3}+"
    assert digits in PATTERN, "data/tokenizer.py's pattern changed: check tokenizer_files' translation of it"
    template = lambda *parts: [{"SpecialToken": {"id": EOT, "type_id": 0}} if p == EOT
                               else {"Sequence": {"id": p, "type_id": 0}} for p in parts]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, s in added],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PATTERN.replace(digits, r"\p{N}{1,3}")}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "TemplateProcessing", "single": template(EOT, "A"),
                           "pair": template(EOT, "A", EOT, "B"),
                           "special_tokens": {EOT: {"id": EOT, "ids": [EOT_ID], "tokens": [EOT]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  # tiktoken takes a piece that is a token whole, before any merge
                  "ignore_merges": True,
                  "vocab": {text(token): rank for token, rank in ranks.items()},
                  "merges": [[text(a), text(b)] for a, b in bpe_merges(ranks)]},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False, "model_max_length": T}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def bpe_merges(ranks):
    """The merges, in rank order, that rebuild tiktoken's BPE: for each token of two or more bytes, the pair
    its bytes reach by merging, lowest rank first (tiktoken's order), every pair ranked below it. Tiktoken's
    merges inside any token's bytes run the same way, so one merge per token reproduces it."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pairs = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def byte_chars():
    """GPT-2's printable stand-in for each byte, as tokenizers' ByteLevel pre-tokenizer maps them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return {b: chr(b if b in printable else next(others)) for b in range(256)}
