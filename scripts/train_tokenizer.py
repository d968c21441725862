#!/usr/bin/env python
"""Train the project's byte-level BPE tokenizer on the embedded corpus, offline.

    python scripts/train_tokenizer.py                       # -> asyncloco/data/tokenizer/, vocab 4096
    python scripts/train_tokenizer.py --vocab-size 8192 --out /tmp/tok

The output directory loads with ``transformers.AutoTokenizer.from_pretrained(out)`` (no network).
4,096 entries keep the embedding of the CPU-sized presets small (tiny: 4096 x 64) while still
compressing English to ~4 characters per token on this corpus.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from asyncloco.models.corpus import EMBEDDED_CORPUS, iter_corpus_texts
from asyncloco.models.tokenizer import DEFAULT_TOKENIZER_DIR, save_tokenizer, train_byte_level_bpe

logger = logging.getLogger("train_tokenizer")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--corpus", type=Path, default=EMBEDDED_CORPUS)
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_TOKENIZER_DIR} (the shipped one)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds of work: vocab 512 on the corpus' first 200 texts (tests; needs --out)")
    args = parser.parse_args()
    if args.smoke and args.out is None:
        parser.error("--smoke needs --out (it must not overwrite the shipped tokenizer)")
    args.out = args.out or DEFAULT_TOKENIZER_DIR

    started = time.perf_counter()
    texts = list(iter_corpus_texts(args.corpus))
    if args.smoke:
        texts, args.vocab_size = texts[:200], 512
    tokenizer = train_byte_level_bpe(texts, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, args.out)
    n_tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    n_chars = sum(len(text) for text in texts)
    logger.info("trained vocab %d in %.1f s; corpus: %d chars -> %d tokens (%.2f chars/token); saved to %s",
                len(tokenizer), time.perf_counter() - started, n_chars, n_tokens, n_chars / n_tokens, args.out)
    if args.json:
        args.json.write_text(json.dumps({"vocab_size": len(tokenizer), "texts": len(texts), "chars": n_chars,
                                         "tokens": n_tokens, "chars_per_token": n_chars / n_tokens, "out": str(args.out),
                                         "seconds": time.perf_counter() - started}, indent=1))


if __name__ == "__main__":
    main()
