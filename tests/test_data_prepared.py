"""Prepared corpora (asyncloco/models/prepared.py): `asyncloco data prepare` packs exactly what the
in-memory pipeline packs, resumes after an interruption, refuses a bad source in one line; a run names the corpus
by its manifest digest, fetches and verifies only the shard files its leases touch, refuses a damaged one by name,
and the coordinator's re-run of a lease reads bitwise the batches the peer trained on."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest
import torch

from asyncloco.config import RunConfig
from asyncloco.models.config import LMTaskConfig
from asyncloco.models.data import pack_documents, prepare_source
from asyncloco.models.prepared import (
    MANIFEST_NAME,
    CorruptShard,
    PreparedCorpus,
    manifest_digest,
    prepare_corpus,
)
from asyncloco.models.tokenizer import load_tokenizer
from asyncloco.workloads import build_workload

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the of and a to in is was he for it with as his on be at by had not are but from or have an they which one "
         "you were her all she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people mr how too little state good very make world still").split()
SEQ, ROWS_PER_FILE, HELD, EVERY = 15, 24, 6, 9


def documents(n: int = 240, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(n)]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def prepare(texts: Any, out: Path, **options: Any) -> dict[str, Any]:
    options = {"tokenizer": "embedded", "source": {"test": True}, "seq_len": SEQ, "rows_per_shard": ROWS_PER_FILE,
               "held_out_rows": HELD, "held_out_every": EVERY, "progress": False, "batch_docs": 8, **options}
    return prepare_corpus(texts, out, **options)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    prepare(documents(), out)
    return out


def files_of(out: Path, manifest: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(training rows in file order, held-out rows), read straight from the files the manifest lists."""
    dtype = np.dtype(manifest["dtype"])
    train = np.concatenate([np.fromfile(out / e["file"], dtype=dtype).reshape(-1, SEQ + 1) for e in manifest["shards"]])
    held = np.fromfile(out / manifest["held_out"]["file"], dtype=dtype).reshape(-1, SEQ + 1)
    return train, held


def test_prepare_packs_the_stream_pack_documents_packs(corpus_dir, tokenizer) -> None:
    manifest = json.loads((corpus_dir / MANIFEST_NAME).read_bytes())
    assert (corpus_dir / MANIFEST_NAME).read_bytes() == json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    reference = pack_documents(documents(), tokenizer, SEQ).numpy()
    ids = np.arange(len(reference))
    held_mask = (ids % EVERY == 0) & (ids // EVERY < HELD)
    train, held = files_of(corpus_dir, manifest)
    assert manifest["dtype"] == "uint16" and train.dtype == np.uint16  # a 4,096-entry vocabulary
    assert np.array_equal(held, reference[held_mask]) and len(held) == HELD
    assert np.array_equal(train, reference[~held_mask])
    assert [e["rows"] for e in manifest["shards"][:-1]] == [ROWS_PER_FILE] * (len(manifest["shards"]) - 1)
    assert manifest["train_rows"] == len(train) and manifest["seq_len"] == SEQ
    assert manifest["tokenizer"]["digest"] and manifest["held_out"]["rows"] == HELD
    # a finished directory is returned as it is; another preparation into it is refused
    assert prepare(documents(), corpus_dir) == manifest
    with pytest.raises(ValueError, match="already holds a different prepared corpus"):
        prepare(documents(), corpus_dir, seq_len=SEQ + 1)


def test_workers_and_a_token_cap_give_the_same_bytes(tmp_path, corpus_dir) -> None:
    manifest = json.loads((corpus_dir / MANIFEST_NAME).read_bytes())
    parallel = prepare(documents(), tmp_path / "parallel", workers=2)
    assert manifest_digest(parallel) == manifest_digest(manifest)
    capped = prepare(documents(), tmp_path / "capped", max_train_rows=50)
    assert capped["train_rows"] == 50 and [e["rows"] for e in capped["shards"]] == [24, 24, 2]
    assert [e["sha256"] for e in capped["shards"][:2]] == [e["sha256"] for e in manifest["shards"][:2]]


def test_resume_after_an_interruption_continues_to_the_same_corpus(tmp_path, corpus_dir) -> None:
    texts = documents()
    read: list[int] = []

    def interrupted() -> Iterator[str]:
        for index, text in enumerate(texts):
            if index == 150:
                raise KeyboardInterrupt
            yield text

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        prepare(interrupted(), out)
    state = json.loads((out / "prepare-state.json").read_text())
    done = [e["file"] for e in state["shards"]]
    assert len(done) >= 2 and not (out / MANIFEST_NAME).exists()
    stamps = {name: (out / name).stat().st_mtime_ns for name in done}

    def counted() -> Iterator[str]:
        for index, text in enumerate(texts):
            read.append(index)
            yield text

    manifest = prepare(counted(), out)
    assert manifest_digest(manifest) == manifest_digest(json.loads((corpus_dir / MANIFEST_NAME).read_bytes()))
    assert {name: (out / name).stat().st_mtime_ns for name in done} == stamps  # completed files were not rewritten
    assert not (out / "prepare-state.json").exists() and not list(out.glob("prepare-*"))
    with pytest.raises(KeyboardInterrupt):
        prepare(interrupted(), tmp_path / "again")
    with pytest.raises(ValueError, match="interrupted preparation with other arguments"):
        prepare(texts, tmp_path / "again", held_out_rows=HELD + 1)  # resuming needs the same arguments


def test_a_bad_source_is_refused_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    from asyncloco.cli import main
    from asyncloco.models.hub import HubUnreachable

    with pytest.raises(ValueError, match="matches no file"):
        prepare_source(tmp_path / "x", source="json", path=str(tmp_path / "nothing*.jsonl"), tokenizer="embedded")
    (tmp_path / "broken.jsonl").write_text("{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match="cannot read json file.*broken.jsonl.*check that the source type"):
        prepare_source(tmp_path / "y", source="json", path=str(tmp_path / "broken.jsonl"), tokenizer="embedded")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable, match="HF_HUB_OFFLINE=1.*huggingface-cli download"):
        prepare_source(tmp_path / "z", source="hub", path="HuggingFaceFW/fineweb-edu", name="sample-10BT")
    capsys.readouterr()
    code = main(["data", "prepare", "--out", str(tmp_path / "w"), "--source", "hub", "--path", "allenai/c4",
                 "--name", "en", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("asyncloco: error: the hub dataset 'allenai/c4'") and err.count("\n") == 1


def run_config(corpus_dir: Path, cache: Path, **task: Any) -> RunConfig:
    manifest = json.loads((corpus_dir / MANIFEST_NAME).read_bytes())
    fields = {"kind": "lm", "model": "tiny", "source": "prepared", "manifest_digest": manifest_digest(manifest),
              "shards_from": str(corpus_dir), "seq_len": SEQ, "batch_size": 4, "num_shards": 3, "val_sequences": 4,
              "cache_dir": str(cache), **task}
    return RunConfig.model_validate({"task": fields, "inner": {"lr": 1e-3}, "schedule": {"max_local_steps": 6},
                                     "runtime": {"verify": {"enabled": True, "inner_state": "reset"}}})


def test_a_lease_reads_only_its_files_and_the_coordinator_rerun_reads_the_same_bytes(tmp_path, corpus_dir) -> None:
    from asyncloco.coordinator.rerun import Rerunner
    from asyncloco.train.inner import InnerTrainer

    cfg = run_config(corpus_dir, tmp_path / "peer-cache")
    peer = build_workload(cfg)
    coordinator = build_workload(run_config(corpus_dir, tmp_path / "coordinator-cache"))
    manifest = json.loads((corpus_dir / MANIFEST_NAME).read_bytes())
    train, held = files_of(corpus_dir, manifest)
    shard, start, steps = 1, 2, 3
    trained: list[torch.Tensor] = []
    reread: list[torch.Tensor] = []
    for workload, log in ((peer, trained), (coordinator, reread)):
        read = workload.batch
        workload.batch = lambda s, i, read=read, log=log: log.append(read(s, i)) or log[-1]  # type: ignore[method-assign]
    trainer = InnerTrainer.from_config(cfg, peer)
    theta = trainer.full_params()
    submitted = trainer.run(theta, shard, start, steps, 0).pseudo_gradient
    lease = _lease(shard, start, steps)
    assert torch.equal(Rerunner(cfg, coordinator).rerun(lease, theta), submitted)
    assert len(trained) == len(reread) == steps
    for mine, theirs in zip(trained, reread):
        assert mine.dtype == theirs.dtype == torch.int64 and torch.equal(mine, theirs)
    # a pure function of (manifest, shard, offsets): the rows the lease names, read straight from the files
    ids = peer.lease_row_ids(shard, start, steps)
    files, rows = divmod(ids.numpy(), manifest["rows_per_shard"])
    offsets = np.cumsum([0] + [e["rows"] for e in manifest["shards"]])
    assert np.array_equal(np.stack([t.numpy() for t in trained]), train[offsets[files] + rows].astype(np.int64))
    assert set(files.flatten()) <= set(peer.shard_files[shard].tolist())
    # only the files the lease touched (and the held-out file) were fetched into the peer's cache
    fetched = sorted(p.name for p in (tmp_path / "peer-cache" / "prepared" / manifest_digest(manifest)).glob("*.bin"))
    assert fetched == sorted({manifest["shards"][f]["file"] for f in set(files.flatten())} | {"heldout.bin"})
    # evaluation reads the manifest's held-out rows
    assert torch.equal(peer.rows[peer.val_ids].long(), torch.from_numpy(held[:4].astype(np.int64)))
    assert set(peer.evaluate(peer.build_model(0))) >= {"loss", "perplexity"}


def _lease(shard: int, start: int, steps: int) -> Any:
    from asyncloco.coordinator.logic import Lease

    return Lease(lease_id="L1", peer="p", shard=shard, start_offset=start, steps=steps, lr_offset=0, base_version=0,
                 issued_at=0.0, expected_finish=1.0, deadline=10.0)


def test_a_damaged_shard_file_is_refused_by_name(tmp_path, corpus_dir) -> None:
    import shutil

    source = tmp_path / "served"
    shutil.copytree(corpus_dir, source)
    cfg = run_config(source, tmp_path / "cache").task
    assert isinstance(cfg, LMTaskConfig)
    workload = build_workload(run_config(source, tmp_path / "cache"))
    ids = workload.lease_row_ids(0, 0, 1).flatten().numpy()
    name = f"train-{int(ids[0]) // ROWS_PER_FILE:05d}.bin"
    damaged = bytearray((source / name).read_bytes())
    damaged[5] ^= 1
    (source / name).write_bytes(bytes(damaged))
    with pytest.raises(CorruptShard, match=f"shard file {name} from .*served does not match manifest.*copy {name} again"):
        workload.batch(0, 0)
    assert not (tmp_path / "cache" / "prepared" / workload.corpus.digest / name).exists()  # type: ignore[union-attr]
    # a damaged cached copy is fetched again from an intact source
    good = build_workload(run_config(corpus_dir, tmp_path / "cache2"))
    expected = good.batch(0, 0)
    cached = tmp_path / "cache2" / "prepared" / good.corpus.digest / name  # type: ignore[union-attr]
    cached.write_bytes(bytes(damaged))
    assert torch.equal(build_workload(run_config(corpus_dir, tmp_path / "cache2")).batch(0, 0), expected)
    (cached.parent / MANIFEST_NAME).write_text("{}")  # and so is a damaged cached manifest
    assert torch.equal(build_workload(run_config(corpus_dir, tmp_path / "cache2")).batch(0, 0), expected)
    # a manifest that is not the one the run names
    wrong = run_config(corpus_dir, tmp_path / "cache3", manifest_digest="0" * 64)
    with pytest.raises(CorruptShard, match="not task.manifest_digest"):
        build_workload(wrong)


def test_shards_come_from_a_url_as_from_a_directory(tmp_path, corpus_dir) -> None:
    from_dir = build_workload(run_config(corpus_dir, tmp_path / "a"))
    from_url = build_workload(run_config(corpus_dir, tmp_path / "b", shards_from=corpus_dir.as_uri()))
    assert torch.equal(from_url.batch(2, 7), from_dir.batch(2, 7))
    missing = build_workload(run_config(corpus_dir, tmp_path / "c", shards_from=corpus_dir.as_uri()))
    assert isinstance(missing.corpus, PreparedCorpus)
    missing.corpus.shards_from = (tmp_path / "nowhere").as_uri()
    with pytest.raises(ValueError, match="cannot download .*nowhere/train-.*check task.shards_from"):
        missing.batch(2, 7)


def test_a_hub_dataset_repo_of_shards_is_its_resolve_url_and_offline_names_the_fix(tmp_path, monkeypatch,
                                                                                   corpus_dir) -> None:
    from asyncloco.models.hub import HubUnreachable
    from asyncloco.models.prepared import hub_url, token_dtype

    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example")
    assert hub_url("hf://datasets/me/fineweb-20m") == "https://hub.example/datasets/me/fineweb-20m/resolve/main"
    assert hub_url("hf://datasets/me/c4/prepared/20m") == "https://hub.example/datasets/me/c4/resolve/main/prepared/20m"
    with pytest.raises(ValueError, match="hf://datasets/<owner>/<repo>"):
        hub_url("hf://me/c4")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable, match="HF_HUB_OFFLINE=1 forbids.*--repo-type dataset me/fineweb-20m"):
        build_workload(run_config(corpus_dir, tmp_path / "c", shards_from="hf://datasets/me/fineweb-20m"))
    assert (token_dtype(32_000), token_dtype(65_536), token_dtype(100_277)) == ("uint16", "uint16", "uint32")


def test_prepared_config_rules() -> None:
    with pytest.raises(ValueError, match="needs task.manifest_digest"):
        LMTaskConfig(source="prepared", shards_from="/data")
    with pytest.raises(ValueError, match="not a sha256 hex digest"):
        LMTaskConfig(source="prepared", manifest_digest="abc", shards_from="/data")
    with pytest.raises(ValueError, match="set task.source: prepared"):
        LMTaskConfig(shards_from="/data")
    with pytest.raises(ValueError, match="--max-tokens"):
        LMTaskConfig(source="prepared", manifest_digest="a" * 64, shards_from="/d", max_train_sequences=100)


def test_prepared_corpus_survives_pickling(corpus_dir) -> None:
    import pickle

    manifest = json.loads((corpus_dir / MANIFEST_NAME).read_bytes())
    corpus = PreparedCorpus(manifest, corpus_dir)
    first = corpus.read_rows(np.array([3, 30, 1]))
    assert np.array_equal(pickle.loads(pickle.dumps(corpus)).read_rows(np.array([3, 30, 1])), first)


@pytest.mark.timeout(180)
def test_bench_prepare_smoke(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_prepare.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s per core" in proc.stdout and "peak RSS" in proc.stdout
