"""Tokenization: the offline cl100k_base tokenizer, the bundled corpus, and the shard writers."""
