"""`asyncloco export`: a coordinator checkpoint → a directory transformers loads offline, same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncloco.cli import main
from asyncloco.config import RunConfig
from asyncloco.coordinator.checkpoint import save_snapshot
from asyncloco.models.workload import flatten_params, load_flat_params
from asyncloco.workloads import build_workload


@pytest.mark.timeout(180)
def test_export_writes_the_checkpointed_theta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = RunConfig.model_validate(
        {"task": {"kind": "lm", "model": "tiny", "seq_len": 16, "batch_size": 2, "val_sequences": 4}}
    )
    workload = build_workload(cfg)
    model = workload.build_model(cfg.seed)
    theta = flatten_params(model) + 0.01 * torch.randn(sum(p.numel() for p in model.parameters()))
    save_snapshot(
        tmp_path / "ckpt",
        {"coordinator": {"params": theta, "version": 7}, "config": cfg.model_dump(mode="json")},
    )
    out = tmp_path / "model"
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)]) == 0

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    load_flat_params(model, theta)
    ids = tokenizer("It is a truth universally acknowledged", return_tensors="pt").input_ids
    model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_export_without_a_checkpoint_says_where_to_look(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def test_export_refuses_a_toy_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = RunConfig()
    save_snapshot(tmp_path, {"coordinator": {"params": torch.zeros(3), "version": 0}, "config": cfg.model_dump(mode="json")})
    assert main(["export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    assert "only language-model runs can be exported" in capsys.readouterr().err
