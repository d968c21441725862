"""Data pipeline: local text/jsonl/parquet through `datasets` offline, exact packing, cache, config rules."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from asyncloco.models import data as data_module
from asyncloco.models.config import LMTaskConfig
from asyncloco.models.data import iter_documents, load_packed_rows, pack_documents, split_rows
from asyncloco.models.tokenizer import load_tokenizer

DOCUMENTS = [
    "The Devil's Dictionary defines a cynic as a blackguard whose faulty vision sees things as they are.",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition.",
    "A hacker is a person who enjoys exploring the details of programmable systems — naïvely? No.",
] * 4


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _write_sources(tmp_path) -> dict[str, str]:
    (tmp_path / "docs.txt").write_text("\n".join(DOCUMENTS) + "\n", encoding="utf-8")
    with open(tmp_path / "docs.jsonl", "w", encoding="utf-8") as out:
        for i, text in enumerate(DOCUMENTS):
            out.write(json.dumps({"id": i, "content": text}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": DOCUMENTS}), tmp_path / "docs.parquet")
    return {"text": str(tmp_path / "docs.txt"), "json": str(tmp_path / "*.jsonl"),
            "parquet": str(tmp_path / "docs.parquet")}


def test_pack_documents_is_the_eos_joined_token_stream_cut_into_rows(tokenizer) -> None:
    stream: list[int] = []
    for text in DOCUMENTS:
        stream += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    rows = pack_documents(DOCUMENTS, tokenizer, seq_len=15)
    n_rows = len(stream) // 16
    assert rows.dtype == torch.int32 and rows.shape == (n_rows, 16)
    assert rows.flatten().tolist() == stream[: n_rows * 16]
    capped = pack_documents(iter(DOCUMENTS), tokenizer, seq_len=15, max_rows=3)
    assert torch.equal(capped, rows[:3])


@pytest.mark.parametrize("source", ["text", "json", "parquet"])
def test_local_files_stream_through_datasets_offline(tmp_path, tokenizer, source) -> None:
    paths = _write_sources(tmp_path)
    field = "text" if source == "text" else "content"
    cfg = LMTaskConfig(source=source, path=paths[source], text_field=field, seq_len=15, batch_size=1,
                       num_shards=2, val_sequences=2, cache_dir=str(tmp_path / "cache"))
    assert list(iter_documents(cfg)) == DOCUMENTS
    assert torch.equal(load_packed_rows(cfg, tokenizer).long(), pack_documents(DOCUMENTS, tokenizer, 15).long())


def test_missing_text_field_and_missing_files_are_explained(tmp_path) -> None:
    paths = _write_sources(tmp_path)
    cfg = LMTaskConfig(source="json", path=paths["json"], cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no field 'text'.*set task.text_field"):
        next(iter_documents(cfg))
    cfg = LMTaskConfig(source="text", path=str(tmp_path / "nope*.txt"))
    with pytest.raises(ValueError, match="matches no file"):
        next(iter_documents(cfg))


def test_hub_source_streams_with_the_same_load_dataset_call(monkeypatch, tokenizer, tmp_path) -> None:
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return iter({"text": text} for text in DOCUMENTS * 100)

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    from asyncloco.models import hub

    checked = []  # the hub's reachability is checked first (one line and exit 2 offline: tests/test_overrides.py)
    monkeypatch.setattr(hub, "require_hub", lambda resource, kind: checked.append((resource, kind)))
    cfg = LMTaskConfig(source="hub", path="allenai/c4", name="en", seq_len=15, batch_size=1, num_shards=2,
                       max_train_sequences=4, val_sequences=2, cache_dir=str(tmp_path))
    rows = load_packed_rows(cfg, tokenizer)
    assert calls == [("allenai/c4", "en", {"split": "train", "streaming": True})]
    assert checked == [("allenai/c4", "dataset")]
    assert torch.equal(rows.long(), pack_documents(DOCUMENTS, tokenizer, 15)[:6].long())  # 4 train + 2 held out


def test_packed_rows_are_cached_by_content_key(monkeypatch, tmp_path, tokenizer) -> None:
    paths = _write_sources(tmp_path)
    cfg = LMTaskConfig(source="text", path=paths["text"], seq_len=15, batch_size=1, num_shards=2,
                       val_sequences=2, cache_dir=str(tmp_path / "cache"))
    first = load_packed_rows(cfg, tokenizer)
    assert len(list((tmp_path / "cache").glob("lm-*/manifest.json"))) == 1  # prepared once (models/prepared.py)

    def no_packing(*args, **kwargs):
        raise AssertionError("cache miss")

    monkeypatch.setattr(data_module, "prepare_corpus", no_packing)
    assert torch.equal(load_packed_rows(cfg, tokenizer), first)
    with pytest.raises(AssertionError, match="cache miss"):  # another seq_len is another key
        load_packed_rows(cfg.model_copy(update={"seq_len": 16}), tokenizer)


def test_split_rows_partitions_rows_iid_and_contiguous() -> None:
    val, shards = split_rows(103, val_rows=7, num_shards=4, iid=True, seed=5)
    everything = torch.cat([val, *shards]).sort().values
    assert torch.equal(everything, torch.arange(103))
    assert [len(s) for s in shards] == [24, 24, 24, 24]
    assert torch.equal(val, split_rows(103, 7, 4, True, seed=5)[0])
    assert not torch.equal(shards[0], split_rows(103, 7, 4, True, seed=6)[1][0])
    val_c, contiguous = split_rows(103, val_rows=7, num_shards=4, iid=False, seed=5)
    assert torch.equal(val_c, val)  # the held-out rows do not depend on the shard layout
    train = torch.cat(contiguous)
    assert torch.equal(train, train.sort().values)  # document order kept
    assert torch.equal(torch.cat([val_c, train]).sort().values, torch.arange(103))
    with pytest.raises(ValueError, match="lower task.val_sequences"):
        split_rows(7, 7, 1, True, 0)


def test_config_rules_fail_at_load_time() -> None:
    with pytest.raises(ValueError, match="needs task.max_train_sequences"):
        LMTaskConfig(source="hub", path="allenai/c4", name="en")
    with pytest.raises(ValueError, match="needs task.path"):
        LMTaskConfig(source="json")
    with pytest.raises(ValueError, match="only for source"):
        LMTaskConfig(path="x.txt")
    with pytest.raises(ValueError, match="not a preset"):
        LMTaskConfig(model="7b")
    with pytest.raises(ValueError, match="num_shards \\* batch_size = 32"):
        LMTaskConfig(num_shards=4, batch_size=8, max_train_sequences=31)
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        LMTaskConfig.model_validate({"kind": "lm", "seqlen": 128})
    assert LMTaskConfig(seq_len=256, batch_size=4).units_per_step == 1024
