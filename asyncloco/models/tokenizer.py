"""The project tokenizer: a byte-level BPE trained offline on the embedded corpus.

Two are shipped (no network): ``embedded``, 4,096 entries (``asyncloco/data/tokenizer/``), for the CPU-sized
presets ``tiny``/``small``, and ``embedded-32k``, 32,000 entries (``asyncloco/data/tokenizer-32k/``), the
vocabulary size of the paper, so that its presets ``20m``/``60m``/``150m`` have the paper's parameter counts
(21.2 M / 59.3 M / 151.2 M) offline. ``task.tokenizer: null`` picks the preset's (:func:`default_tokenizer`);
any other ``AutoTokenizer`` name or local path works too (``load_tokenizer("gpt2")`` reads the hub cache or
downloads). Retrain with ``python scripts/train_tokenizer.py [--vocab-size 32000 --out ...]`` (deterministic
for a given corpus).

Byte-level BPE round-trips every string exactly (``decode(encode(text)) == text``, unicode
included) because it never produces an unknown token and adds no prefix space. One special token,
``<|endoftext|>``, is bos, eos and pad at once: packing puts it between documents, generation stops
on it, and padding never reaches the loss because training sequences are packed to full length.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_TOKENIZER_DIR",
    "PAPER_TOKENIZER_DIR",
    "EMBEDDED_TOKENIZERS",
    "default_tokenizer",
    "END_OF_TEXT",
    "load_tokenizer",
    "save_tokenizer",
    "tokenizer_fingerprint",
    "train_byte_level_bpe",
]

logger = logging.getLogger(__name__)

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
PAPER_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer-32k"
EMBEDDED_TOKENIZERS = {"embedded": DEFAULT_TOKENIZER_DIR, "embedded-32k": PAPER_TOKENIZER_DIR}


def default_tokenizer(preset: str) -> str:
    """The shipped tokenizer a preset uses when ``task.tokenizer`` is null: ``embedded-32k`` for a preset whose
    shape names the paper's 32,000-entry vocabulary (20m, 60m, 150m), else the 4,096-entry ``embedded``."""
    from asyncloco.models.presets import get_preset

    return "embedded-32k" if get_preset(preset).vocab_size == 32_000 else "embedded"
END_OF_TEXT = "<|endoftext|>"


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with ``vocab_size`` entries (256 byte symbols + merges + 1 special).

    ``min_frequency=2`` keeps one-off merges out; training is deterministic for a given text order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least 258 (256 bytes, "
                         "the special token and one merge); use e.g. 4096")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(name_or_path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The project tokenizer by default; otherwise any ``AutoTokenizer`` hub name or local directory.

    A tokenizer without a pad token gets ``pad_token = eos_token`` so batching code never has to ask.
    """
    if name_or_path is None or str(name_or_path) in EMBEDDED_TOKENIZERS:
        directory = EMBEDDED_TOKENIZERS[str(name_or_path or "embedded")]
        if not (directory / "tokenizer.json").is_file():
            size = "--vocab-size 32000 " if directory == PAPER_TOKENIZER_DIR else ""
            raise ValueError(f"the project tokenizer is missing from {directory}; "
                             f"rebuild it with `python scripts/train_tokenizer.py {size}--out {directory}`")
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    elif Path(name_or_path).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=True)
    else:  # a hub name: the local cache first, then the hub — failing fast when it is unreachable (models/hub.py)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=True)
        except (OSError, ValueError):
            from asyncloco.models.hub import require_hub

            require_hub(str(name_or_path), "tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    if tokenizer.eos_token is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no eos token, which packing needs between documents; "
                         "pick a causal-LM tokenizer (e.g. 'gpt2') or the project default (tokenizer: null)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> None:
    """``save_pretrained`` that older transformers (4.x) can read back as well.

    transformers 5 records its fast-tokenizer class as ``TokenizersBackend``, a name 4.x does not
    know; ``PreTrainedTokenizerFast`` loads the same ``tokenizer.json`` in both.
    """
    out = Path(out_dir)
    tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of the tokenizer's full definition (vocabulary, merges, normalization, specials).

    Used in data-cache keys, so two tokenizers that share a name but differ in content never share
    a cache entry.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:  # slow tokenizers: the vocabulary is the best stable description we have
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = json.dumps([tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token])
    return hashlib.sha256((definition + specials).encode("utf-8")).hexdigest()[:16]
