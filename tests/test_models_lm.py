"""LM workload end to end on CPU: the tiny model learns the corpus, evaluation, export → reload → generate."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncloco.models.config import LMTaskConfig
from asyncloco.models.lm import LMWorkload, build_lm_workload
from asyncloco.models.workload import flatten_params, load_flat_params


@pytest.fixture(autouse=True)
def _one_thread():
    # a 0.4 M-parameter model is fastest single-threaded; more threads only fight over 2 cores
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> LMWorkload:
    cfg = LMTaskConfig(model="tiny", seq_len=32, batch_size=8, num_shards=2, max_train_sequences=2 * 8 * 20,
                       val_sequences=32, seed=0, cache_dir=str(tmp_path_factory.mktemp("lm-cache")))
    return build_lm_workload(cfg)


def _train(workload: LMWorkload, steps: int, seed: int = 0) -> tuple[torch.nn.Module, list[float]]:
    model = workload.build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for index in range(steps):
        loss = workload.loss(model, workload.batch(0, index))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return model, losses


def test_tiny_model_learns_the_corpus(workload) -> None:
    model = workload.build_model(seed=0)
    before = workload.evaluate(model)
    # a fresh model is near-uniform over the 4,096 tokens: loss ≈ ln 4096 = 8.318
    assert before["loss"] == pytest.approx(math.log(4096), abs=0.05)
    assert before["perplexity"] == pytest.approx(math.exp(before["loss"]))
    trained, losses = _train(workload, steps=30)
    after = workload.evaluate(trained)
    assert after["loss"] < before["loss"] - 1.0  # measured 8.32 → 6.65 on the held-out rows
    assert losses[-1] < losses[0] - 1.0


def test_training_reruns_bit_identically(workload) -> None:
    first, losses_a = _train(workload, steps=3, seed=4)
    second, losses_b = _train(workload, steps=3, seed=4)
    assert losses_a == losses_b
    assert torch.equal(flatten_params(first), flatten_params(second))


def test_evaluate_is_deterministic_and_restores_train_mode(workload) -> None:
    model = workload.build_model(seed=1)
    model.train()
    assert workload.evaluate(model) == workload.evaluate(model)
    assert model.training
    model.eval()
    workload.evaluate(model)
    assert not model.training


def test_export_reloads_with_identical_logits_and_generates(workload, tmp_path) -> None:
    model, _ = _train(workload, steps=2, seed=2)
    model.eval()
    out = workload.export(model, tmp_path / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    prompt = tokenizer("It is a truth universally acknowledged", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**prompt).logits, reloaded(**prompt).logits)
    generated = reloaded.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 6)
    assert tokenizer.decode(generated[0]).startswith("It is a truth universally acknowledged")

    from_theta = workload.export(flatten_params(model), tmp_path / "theta")  # the coordinator holds θ only
    reloaded_theta = AutoModelForCausalLM.from_pretrained(str(from_theta), local_files_only=True)
    assert torch.equal(flatten_params(reloaded_theta), flatten_params(model))


def test_flat_parameters_round_trip_through_a_fresh_replica(workload) -> None:
    source, _ = _train(workload, steps=1, seed=5)
    replica = workload.build_model(seed=6)
    load_flat_params(replica, flatten_params(source))
    batch = workload.batch(1, 0)
    assert torch.equal(workload.loss(source, batch), workload.loss(replica, batch))
