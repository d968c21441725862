"""Export a trained causal LM as a standard Hugging Face directory (model + tokenizer).

The result loads offline with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
``AutoTokenizer.from_pretrained(out_dir)`` and generates text; weights are saved as fp32 safetensors
so a reload reproduces the exported logits exactly.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from asyncloco.models.tokenizer import save_tokenizer

__all__ = ["export_causal_lm"]

logger = logging.getLogger(__name__)


def export_causal_lm(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"export needs a transformers PreTrainedModel, got {type(model).__name__}; build the "
                         "model with asyncloco.models.presets.build_causal_lm or LMWorkload.build_model")
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, nn.Embedding), "a causal LM embeds tokens with nn.Embedding"
    embedding_rows = embedding.num_embeddings
    if embedding_rows < len(tokenizer):
        raise ValueError(f"the model embeds {embedding_rows} tokens but the tokenizer has {len(tokenizer)}; "
                         "export with the tokenizer the model was trained with")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_length=model.config.max_position_embeddings,
    )
    model.save_pretrained(str(out))
    save_tokenizer(tokenizer, out)
    logger.info("exported %s (%d parameters) to %s", type(model).__name__,
                sum(p.numel() for p in model.parameters()), out)
    return out
