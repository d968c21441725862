"""Model presets: paper size classes, head size, determinism of initialisation."""

from __future__ import annotations

import pytest
import torch

from asyncloco.models.presets import PRESETS, build_causal_lm, causal_lm_config, count_parameters

PAPER_VOCAB = 32_000


@pytest.mark.parametrize(
    ("preset", "exact", "size_class"),
    [
        # vocab 32,000; 20m untied (2 x 8.19 M embeddings), 60m / 150m tied (see presets.py docstring)
        ("20m", 21_204_224, 20e6),
        ("60m", 59_299_968, 60e6),
        ("150m", 151_181_184, 150e6),
    ],
)
def test_paper_presets_land_in_their_size_class(preset: str, exact: int, size_class: float) -> None:
    n = count_parameters(preset, PAPER_VOCAB)
    assert n == exact
    assert abs(n - size_class) / size_class < 0.07  # within 7 % of the paper's nominal size
    assert PRESETS[preset].vocab_size == PAPER_VOCAB
    assert count_parameters(preset) == exact  # default vocabulary is the paper's


def test_cpu_presets_sizes_with_project_vocab() -> None:
    assert count_parameters("tiny", 4096) == 368_960  # 4096 x 64 tied embedding + 2 blocks
    assert count_parameters("small", 4096) == 1_377_408


def test_paper_shapes_use_head_size_64() -> None:
    config_20m = causal_lm_config("20m")
    assert (config_20m.num_hidden_layers, config_20m.hidden_size, config_20m.num_attention_heads) == (6, 256, 4)
    assert config_20m.head_dim == 64 and config_20m.tie_word_embeddings is False
    for name, layers in (("60m", 3), ("150m", 12)):
        config = causal_lm_config(name, seq_len=256)
        assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (layers, 896, 16)
        assert config.head_dim == 64 and config.tie_word_embeddings is True
        assert config.max_position_embeddings == 256
    with torch.device("meta"):
        model = build_causal_lm("60m")
    assert tuple(model.model.layers[0].self_attn.q_proj.weight.shape) == (16 * 64, 896)


def test_build_is_deterministic_per_seed_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = build_causal_lm("tiny", vocab_size=4096, seq_len=32, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    again = build_causal_lm("tiny", vocab_size=4096, seq_len=32, seed=7)
    other = build_causal_lm("tiny", vocab_size=4096, seq_len=32, seed=8)
    pairs = list(zip(first.parameters(), again.parameters()))
    assert len(pairs) == 20 and all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.lm_head.weight is first.model.embed_tokens.weight  # tiny is tied


def test_bad_preset_and_missing_vocab_are_explained() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        build_causal_lm("huge", 4096)
    with pytest.raises(ValueError, match="pass vocab_size=len"):
        causal_lm_config("tiny")


@pytest.mark.parametrize(("preset", "exact"), [("20m", 21_204_224), ("60m", 59_299_968), ("150m", 151_181_184),
                                                ("tiny", 368_960), ("small", 1_377_408)])
def test_offline_default_tokenizer_gives_each_preset_its_size(preset: str, exact: int) -> None:
    """With ``task.tokenizer: null`` and no hub, the paper's presets take the shipped 32,000-entry BPE
    (its vocabulary size), so a 20m run is the paper's 21.2 M model, not a 6.9 M one; tiny/small keep 4,096."""
    from asyncloco.models.tokenizer import default_tokenizer, load_tokenizer

    name = default_tokenizer(preset)
    tokenizer = load_tokenizer(name)
    assert (name, len(tokenizer)) == (("embedded-32k", 32_000) if preset in ("20m", "60m", "150m") else ("embedded", 4096))
    assert count_parameters(preset, len(tokenizer)) == exact
    assert tokenizer.decode(tokenizer("Asynchronous Local-SGD, naïvely.")["input_ids"]) == "Asynchronous Local-SGD, naïvely."
