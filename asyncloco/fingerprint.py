"""What a peer must share with the coordinator for its pseudo-gradients to mean anything.

Two installs can build models with the same parameter count from the same run config and still
disagree: a preset with 4 attention heads instead of 2, another tokenizer file, a changed data
pipeline or codec. The coordinator would apply such a peer's updates without noticing. A
*fingerprint* is a short hash per component, computed on each side from what it really built:

* ``architecture`` — the model class, its (transformers) config without version stamps, and every
  parameter's name and shape;
* ``tokenizer`` — the vocabulary and special tokens (``"none"`` for tasks without one);
* ``data`` — the task config, the shard sizes and the exact first batch of every shard;
* ``codec`` — the run's codec name and the bytes it produces for a fixed tensor.

The peer sends its fingerprint (and software version) in a ``hello`` request; the coordinator
compares it with its own (:func:`mismatch_reason`) and refuses the peer with a message naming the
differing components and both sides' software versions.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch
from torch import nn

from asyncloco.config import RunConfig
from asyncloco.models.workload import Workload

__all__ = ["COMPONENTS", "run_fingerprint", "mismatch_reason", "check_fingerprint"]

COMPONENTS = ("architecture", "tokenizer", "data", "codec")
_VOLATILE_CONFIG_KEYS = {"transformers_version", "torch_dtype", "dtype", "_name_or_path", "_commit_hash"}


class _Hasher:
    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, value: Any) -> "_Hasher":
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            self._hash.update(f"tensor{tuple(tensor.shape)}{tensor.dtype}".encode())
            self._hash.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        elif isinstance(value, (tuple, list)):
            self._hash.update(f"seq{len(value)}".encode())
            for item in value:
                self.add(item)
        elif isinstance(value, bytes):
            self._hash.update(value)
        else:
            self._hash.update(json.dumps(value, sort_keys=True, default=str).encode())
        return self

    def hexdigest(self) -> str:
        return self._hash.hexdigest()[:16]


def _architecture(model: nn.Module) -> str:
    hasher = _Hasher().add(type(model).__name__)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        settings = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
        hasher.add(settings)
    else:
        hasher.add(repr(model))  # a plain torch module: its repr lists every layer and its sizes
    hasher.add([(name, list(p.shape)) for name, p in model.named_parameters()])
    return hasher.hexdigest()


def _tokenizer(workload: Workload) -> str:
    tokenizer = getattr(workload, "tokenizer", None)
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items())
    return _Hasher().add(vocab).add(sorted(tokenizer.special_tokens_map.items())).hexdigest()


def _data(cfg: RunConfig, workload: Workload) -> str:
    task = cfg.task.model_dump(mode="json")
    for model_key in ("model", "hidden"):  # the LM preset / the toy MLP's width: the architecture covers them
        task.pop(model_key, None)
    hasher = _Hasher().add(task).add(workload.shard_sizes())
    for shard in range(len(workload.shard_sizes())):
        hasher.add(workload.batch(shard, 0))
    return hasher.hexdigest()


def _codec(codec: str) -> str:
    from asyncloco.transport.codecs import encode

    probe = torch.linspace(-1.0, 1.0, 257, dtype=torch.float32) ** 3
    return _Hasher().add(codec).add(encode(codec, probe).to_bytes()).hexdigest()


def run_fingerprint(cfg: RunConfig, workload: Workload, model: nn.Module) -> dict[str, str]:
    """One short hash per :data:`COMPONENTS` entry for this side's model, tokenizer, data and codec."""
    return {
        "architecture": _architecture(model),
        "tokenizer": _tokenizer(workload),
        "data": _data(cfg, workload),
        "codec": _codec(cfg.runtime.codec),
    }


def check_fingerprint(value: Any) -> dict[str, str]:
    """A fingerprint received over the wire, validated (a map of the known components to short strings)."""
    if not isinstance(value, Mapping) or set(value) != set(COMPONENTS):
        raise ValueError(f"a fingerprint must map exactly {list(COMPONENTS)} to hashes, got {value!r}"[:300])
    if not all(isinstance(v, str) and 0 < len(v) <= 64 for v in value.values()):
        raise ValueError("fingerprint hashes must be strings of 1..64 characters")
    return {k: str(value[k]) for k in COMPONENTS}


def mismatch_reason(
    ours: Mapping[str, str], theirs: Mapping[str, str], our_version: str, their_version: str
) -> str | None:
    """``None`` when the fingerprints agree, else a message for the peer naming what differs and how to fix it."""
    differing = [name for name in COMPONENTS if ours.get(name) != theirs.get(name)]
    if not differing:
        return None
    return (
        f"this peer's {', '.join(differing)} differ{'s' if len(differing) == 1 else ''} from the coordinator's "
        f"(coordinator runs asyncloco {our_version}, this peer {their_version}): its updates would not fit the "
        f"run's model. Install the coordinator's version (pip install asyncloco=={our_version}) and join again"
    )
