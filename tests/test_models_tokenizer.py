"""Project tokenizer and embedded corpus: exact round-trips, offline reload, training determinism."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from transformers import AutoTokenizer

from asyncloco.models.corpus import iter_corpus_texts
from asyncloco.models.tokenizer import (
    DEFAULT_TOKENIZER_DIR,
    END_OF_TEXT,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_byte_level_bpe,
)

SAMPLES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,"
    " must be in want of a wife.",
    "  leading spaces, double  spaces,\ttabs and\nnew lines\r\n",
    "Unicode: café naïve Ångström — “quotes” 日本語 Ελληνικά 🙂🚀",
    "code: def f(x):\n    return x ** 2  # squared",
    "",
]


def test_project_tokenizer_round_trips_exactly() -> None:
    tokenizer = load_tokenizer()
    assert len(tokenizer) == 4096
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == END_OF_TEXT
    assert tokenizer.eos_token_id == 0
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # common English compresses into whole-word tokens
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(" the house of Mr. Knightley"))
    assert tokens[:3] == ["Ġthe", "Ġhouse", "Ġof"]


def test_project_tokenizer_reloads_through_auto_tokenizer_offline() -> None:
    config = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # readable by transformers 4.x too
    auto = AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER_DIR), local_files_only=True)
    ours = load_tokenizer()
    for text in SAMPLES:
        assert auto.encode(text) == ours.encode(text)
    assert tokenizer_fingerprint(auto) == tokenizer_fingerprint(ours)


def test_training_is_deterministic_and_saved_form_reloads(tmp_path) -> None:
    texts = [text for _, text in zip(range(40), iter_corpus_texts())]
    first = train_byte_level_bpe(texts, vocab_size=600)
    second = train_byte_level_bpe(texts, vocab_size=600)
    assert len(first) == 600
    assert first.get_vocab() == second.get_vocab()
    save_tokenizer(first, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    sample = SAMPLES[2]
    assert reloaded.encode(sample) == first.encode(sample)
    assert reloaded.decode(reloaded.encode(sample)) == sample
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(first)
    assert tokenizer_fingerprint(reloaded) != tokenizer_fingerprint(load_tokenizer())


def test_too_small_vocab_is_explained() -> None:
    with pytest.raises(ValueError, match="at least 258"):
        train_byte_level_bpe(["text"], vocab_size=100)


def test_embedded_corpus_is_large_real_english() -> None:
    texts = list(iter_corpus_texts())
    assert len(texts) == 3555
    assert sum(len(text) for text in texts) == 5_861_455
    assert texts[0].startswith("CHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich")
    assert texts[-1].startswith("ZOOLOGY, n.")
