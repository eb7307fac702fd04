"""Our loaders and reference forward pass, pinned to Hugging Face transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyinfer
from tests.conftest import ORACLE_CONFIGS
from tinyinfer.runners.runner import make_batch

NAMES = sorted(ORACLE_CONFIGS)


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def hf_logits(model, ids: list[int], dtype=torch.float32) -> np.ndarray:
    with torch.no_grad():
        return model.to(dtype)(torch.tensor([ids])).logits[0].double().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_float32_logits_match_transformers(name, oracle_model):
    folder, hf = oracle_model(name)
    model = tinyinfer.load(folder)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 45).tolist()
    ours = model.logits(ids)
    assert ours.dtype == np.float32 and ours.shape == (45, model.config.vocab_size)
    assert relative_error(ours, hf_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_float64_logits_match_transformers_tightly(name, oracle_model):
    folder, hf = oracle_model(name)
    model = tinyinfer.load(folder, dtype="float64")
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, 30).tolist()
    ref = hf_logits(hf, ids, torch.float64)
    hf.float()
    assert relative_error(model.logits(ids).astype(np.float64), ref) <= 1e-6


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied", "llama-mqa-tied", "qwen2-bias"])
@pytest.mark.parametrize("prompt_len", [1, 7, 40])
def test_greedy_generation_matches_transformers(name, prompt_len, oracle_model):
    folder, hf = oracle_model(name)
    model = tinyinfer.load(folder, dtype="float64")
    prompt = np.random.default_rng(prompt_len).integers(0, model.config.vocab_size, prompt_len).tolist()
    engine = tinyinfer.Engine(model)
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=32)
    ours = engine.generate([prompt], params)[0].token_ids
    with torch.no_grad():
        theirs = hf.double().generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                                      min_new_tokens=32, pad_token_id=0)[0, prompt_len:].tolist()
    hf.float()
    assert ours == theirs


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_cached_decode_equals_full_forward(name, page_size, oracle_model):
    """Every decode step through the paged cache equals recomputing the whole sequence."""
    folder, _ = oracle_model(name)
    model = tinyinfer.load(folder, dtype="float64")
    runner = model.runner
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 30).tolist()
    table = [5, 2, 7, 0, 3, 6, 1, 4]  # pages deliberately out of order
    kv = runner.new_kv_cache(len(table), page_size)
    prefill = 11
    runner.forward(make_batch([(ids[:prefill], 0, table, False)], page_size), kv)
    for pos in range(prefill, len(ids)):
        step = runner.forward(make_batch([(ids[pos:pos + 1], pos, table, False)], page_size), kv)
        full = model.logits(ids[: pos + 1])[-1]
        np.testing.assert_allclose(step[0], full, rtol=0, atol=1e-9 * np.abs(full).max())
