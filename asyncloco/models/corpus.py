"""The embedded English corpus shipped in ``asyncloco/data/corpus.jsonl.xz``.

3,555 public-domain documents (Jane Austen's novels by chapter, the Jargon File by entry, the Devil's
Dictionary by entry; ~5.9 M characters), in that fixed order. Sources and licensing:
``asyncloco/data/CORPUS_LICENSE.md``; rebuild with ``python scripts/build_corpus.py``.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Iterator
from pathlib import Path

__all__ = ["EMBEDDED_CORPUS", "iter_corpus_texts"]

EMBEDDED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus.jsonl.xz"


def iter_corpus_texts(path: Path = EMBEDDED_CORPUS) -> Iterator[str]:
    """The documents' texts, in corpus order (cheap: ~0.2 s to decompress all of it)."""
    with lzma.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)["text"]
