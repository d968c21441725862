"""``task:`` section for language-model runs (``kind: lm``); built by :func:`asyncloco.models.lm.build_lm_workload`.

Data sources, one code path (``datasets.load_dataset(..., streaming=True)``) for all of them:

* ``embedded`` (default): the shipped public-domain English corpus (~1.6 M tokens with the project
  tokenizer), no network.
* ``text`` / ``json`` / ``parquet``: local files; ``path`` is a file, a glob or a list of them. ``text``
  makes one document per line; ``json`` reads JSON Lines; ``text_field`` names the text column.
* ``hub``: a Hugging Face hub dataset streamed (never fully downloaded), e.g. ``path: allenai/c4``
  with ``name: en``, or ``path: HuggingFaceFW/fineweb`` with ``name: sample-10BT``. Needs
  ``max_train_sequences`` (the stream is read only that far).
* ``prepared``: a corpus made ahead of time by ``asyncloco data prepare`` (docs/data-prepare.md), named by
  ``manifest_digest``; ``shards_from`` is the directory, http(s) URL or hub dataset repo
  (``hf://datasets/<owner>/<repo>[/<folder>]``) that holds its ``manifest.json`` and shard files. Each process fetches only the shard files its batches touch into ``cache_dir``,
  checks them against the manifest's sha256 and memory-maps them; evaluation reads the manifest's
  held-out rows (the first ``val_sequences``). See :mod:`asyncloco.models.prepared`.

Documents are tokenized, joined with the tokenizer's eos token and packed into rows of
``seq_len + 1`` tokens (inputs = row[:-1], targets = row[1:]); ``val_sequences`` rows are held out
(seeded), the rest split into ``num_shards`` shards: ``iid: true`` deals rows out by a seeded
permutation, ``iid: false`` cuts them into contiguous runs in document order (e.g. Austen vs. Jargon
File vs. Devil's Dictionary for the embedded corpus), the heterogeneous-data setting.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncloco.config_base import StrictModel
from asyncloco.models.presets import PRESETS

__all__ = ["LMTaskConfig", "ToyTaskConfig"]


class LMTaskConfig(StrictModel):
    kind: Literal["lm"] = "lm"
    model: str = Field("tiny", description="model preset: tiny, small, 20m, 60m, 150m")
    tokenizer: str | None = Field(None, description="AutoTokenizer name or path, or a shipped one: embedded (4,096), "
                                  "embedded-32k (32,000); None: the preset's (embedded-32k for 20m/60m/150m)")
    source: Literal["embedded", "text", "json", "parquet", "hub", "prepared"] = "embedded"
    path: str | list[str] | None = Field(None, description="files/glob(s) for text/json/parquet, dataset id for hub")
    name: str | None = Field(None, description="hub dataset configuration, e.g. 'en' for allenai/c4")
    split: str = "train"
    text_field: str = "text"
    seq_len: int = Field(128, ge=2, description="tokens per training sequence (the paper uses 256 / 1,024)")
    batch_size: int = Field(8, ge=1, description="sequences per inner step")
    eval_batch_size: int | None = Field(None, ge=1, description="default: batch_size")
    num_shards: int = Field(4, ge=1)
    iid: bool = True
    max_train_sequences: int | None = Field(None, ge=1, description="cap on training rows; required for hub")
    val_sequences: int = Field(64, ge=1, description="held-out rows evaluated by evaluate()")
    seed: int = Field(0, description="seeds the held-out split, the shard split and per-epoch orders")
    cache_dir: str | None = Field(None, description="packed-token cache; default ~/.cache/asyncloco (XDG)")
    manifest_digest: str | None = Field(None, description="source prepared: the corpus's manifest digest (sha256 hex), "
                                        "as `asyncloco data prepare` printed it")
    shards_from: str | None = Field(None, description="source prepared: directory, http(s) URL or hub dataset repo "
                                    "(hf://datasets/<owner>/<repo>[/<folder>]) holding its manifest.json and shard files")

    @model_validator(mode="after")
    def _check(self) -> "LMTaskConfig":
        if self.model not in PRESETS:
            raise ValueError(f"task.model {self.model!r} is not a preset; choose one of {sorted(PRESETS)}")
        if self.source == "embedded" and self.path is not None:
            raise ValueError("task.path is only for source text/json/parquet/hub; remove it or set task.source")
        if self.source == "prepared":
            return self._check_prepared()
        if self.manifest_digest is not None or self.shards_from is not None:
            raise ValueError("task.manifest_digest and task.shards_from name a prepared corpus; set task.source: "
                             "prepared, or remove them")
        if self.source != "embedded" and not self.path:
            hint = "a dataset id such as 'allenai/c4'" if self.source == "hub" else "a file, glob or list of files"
            raise ValueError(f"task.source={self.source!r} needs task.path: {hint}")
        if self.name is not None and self.source != "hub":
            raise ValueError("task.name (a hub dataset configuration) is only used with task.source='hub'")
        if self.source == "hub" and self.max_train_sequences is None:
            raise ValueError("task.source='hub' streams the dataset and needs task.max_train_sequences "
                             "to know where to stop, e.g. 100000")
        if self.max_train_sequences is not None and self.max_train_sequences < self.num_shards * self.batch_size:
            raise ValueError(f"task.max_train_sequences={self.max_train_sequences} gives some of the "
                             f"{self.num_shards} shards less than one batch of {self.batch_size}; raise it to "
                             f">= num_shards * batch_size = {self.num_shards * self.batch_size}")
        return self

    def _check_prepared(self) -> "LMTaskConfig":
        if not self.manifest_digest or not self.shards_from:
            raise ValueError("task.source='prepared' needs task.manifest_digest (printed by `asyncloco data prepare`) "
                             "and task.shards_from (the directory or URL holding its manifest.json and shard files)")
        digest = self.manifest_digest.lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"task.manifest_digest {self.manifest_digest!r} is not a sha256 hex digest (64 characters)")
        if self.path is not None or self.name is not None:
            raise ValueError("task.path and task.name describe a source to read; a prepared corpus is read from "
                             "task.shards_from: remove them")
        if self.max_train_sequences is not None:
            raise ValueError("task.max_train_sequences does not apply to a prepared corpus (its size is fixed when "
                             "it is prepared: `asyncloco data prepare --max-tokens`); remove it")
        return self

    @property
    def units_per_step(self) -> int:
        """Tokens consumed by one inner step (the unit of DyLU throughput reports)."""
        return self.batch_size * self.seq_len


class ToyTaskConfig(StrictModel):
    """Paper §6 toy: classify a mixture of mixtures of Gaussians with a one-hidden-layer MLP."""

    kind: Literal["toy"] = "toy"
    dim: int = Field(512, ge=1)
    classes: int = Field(4, ge=2)
    clusters_per_class: int = Field(8, ge=1)
    noise: float = Field(0.5, gt=0)
    points: int = Field(128_000, ge=64)
    eval_points: int = Field(4_096, ge=32)
    hidden: int = Field(256, ge=1, description="MLP hidden units (the notebook used 65,000)")
    batch_size: int = Field(32, ge=1)
    num_shards: int = Field(4, ge=1)
    iid: bool = True
    seed: int = 0
