"""Decoder-only causal LMs built from configs alone (no hub download): standard ``LlamaForCausalLM``.

Paper sizes (async-DiLoCo / DiLoCo Table 6, chinchilla-style): 20M = 6 layers × hidden 256 × 4
heads, 60M = 3 × 896 × 16, 150M = 12 × 896 × 16; K/V (head) size 64 everywhere, so 896-wide models
have 16 × 64 = 1024-wide attention (``head_dim=64`` set explicitly, 896 / 16 = 56 would be wrong);
vocabulary 32,000.

Architecture choices (Llama flavour of "chinchilla-style"): pre-RMSNorm, rotary positions, no
biases, SwiGLU MLP of width ≈ 8/3 · hidden (rounded up to a multiple of 64), which has the same
parameter count as chinchilla's 4 · hidden two-matrix MLP.

Tied or untied embeddings: chosen per preset so that the count with the paper's 32,000-token
vocabulary lands in the paper's size class (``tests/test_models_presets.py`` pins the numbers):

=======  ========================  ===================  ===================
preset   transformer blocks        tied (one 32000×d)   untied (two)
=======  ========================  ===================  ===================
20m        4.82 M                  13.0 M               **21.2 M** (chosen)
60m       30.6 M                   **59.3 M** (chosen)  88.0 M
150m     122.5 M                   **151.2 M** (chosen) 179.9 M
=======  ========================  ===================  ===================

For the 20M model the embedding (8.2 M) is larger than all six blocks together, so the paper's count
only adds up with separate input and output matrices; the 896-wide models only add up tied.

``tiny`` (~0.37 M parameters with the project's 4,096-token vocabulary) is for CPU unit tests;
``small`` (~1.4 M) trains visibly on a laptop CPU in minutes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from asyncloco.config_base import StrictModel

if TYPE_CHECKING:  # torch / transformers load lazily: config validation must stay a cheap import
    from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["ModelPreset", "PRESETS", "build_causal_lm", "causal_lm_config", "count_parameters", "get_preset"]

logger = logging.getLogger(__name__)


def _swiglu_width(hidden: int) -> int:
    return -(-8 * hidden // 3 // 64) * 64  # ceil(8/3 · hidden) to a multiple of 64


class ModelPreset(StrictModel):
    """Shape of one decoder-only model. ``vocab_size`` is the paper's, used when none is given."""

    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=8)
    num_heads: int = Field(ge=1)
    head_dim: int = Field(default=64, ge=4)
    intermediate_size: int = Field(ge=8)
    tie_embeddings: bool
    vocab_size: int | None = Field(default=None, ge=2, description="default vocabulary; None: the tokenizer's")
    rope_theta: float = Field(default=10_000.0, gt=0)
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    initializer_range: float = Field(default=0.02, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "ModelPreset":
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        return self


PRESETS: dict[str, ModelPreset] = {
    "20m": ModelPreset(num_layers=6, hidden_size=256, num_heads=4, intermediate_size=_swiglu_width(256),
                       tie_embeddings=False, vocab_size=32_000),
    "60m": ModelPreset(num_layers=3, hidden_size=896, num_heads=16, intermediate_size=_swiglu_width(896),
                       tie_embeddings=True, vocab_size=32_000),
    "150m": ModelPreset(num_layers=12, hidden_size=896, num_heads=16, intermediate_size=_swiglu_width(896),
                        tie_embeddings=True, vocab_size=32_000),
    "tiny": ModelPreset(num_layers=2, hidden_size=64, num_heads=2, head_dim=32, intermediate_size=192,
                        tie_embeddings=True),
    "small": ModelPreset(num_layers=4, hidden_size=128, num_heads=4, head_dim=32, intermediate_size=384,
                         tie_embeddings=True),
}


def get_preset(preset: str | ModelPreset) -> ModelPreset:
    if isinstance(preset, ModelPreset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]


def causal_lm_config(
    preset: str | ModelPreset,
    vocab_size: int | None = None,
    seq_len: int = 256,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> LlamaConfig:
    """The ``LlamaConfig`` of a preset. ``vocab_size`` must match the tokenizer (``len(tokenizer)``)."""
    from transformers import LlamaConfig

    shape = get_preset(preset)
    vocab = vocab_size if vocab_size is not None else shape.vocab_size
    if vocab is None:
        raise ValueError(f"preset {preset!r} has no default vocabulary; pass vocab_size=len(tokenizer)")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        head_dim=shape.head_dim,
        hidden_act="silu",
        max_position_embeddings=seq_len,
        initializer_range=shape.initializer_range,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        use_cache=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def build_causal_lm(
    preset: str | ModelPreset | LlamaConfig,
    vocab_size: int | None = None,
    seq_len: int = 256,
    seed: int = 0,
    **special_token_ids: int | None,
) -> LlamaForCausalLM:
    """A freshly initialised causal LM, bit-identical for the same arguments and ``seed``.

    The global torch RNG is left untouched (initialisation runs inside ``fork_rng``).
    ``special_token_ids``: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for generation.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if isinstance(preset, LlamaConfig):
        config = preset
    else:
        config = causal_lm_config(preset, vocab_size, seq_len, **special_token_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(preset: str | ModelPreset, vocab_size: int | None = None) -> int:
    """Unique trainable parameters (tied embeddings counted once), without allocating them."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(causal_lm_config(preset, vocab_size))
    return sum(p.numel() for p in model.parameters())
