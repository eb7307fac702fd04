"""Bad input gets a clear TinyInferError that says what to do, and loses nothing."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import tinyinfer
from tinyinfer.errors import (
    CheckpointError,
    ConfigError,
    ContextOverflowError,
    OutOfPagesError,
    PromptError,
    SamplingParamsError,
    TinyInferError,
    TokenizerError,
)


@pytest.fixture
def folder(oracle_model, tmp_path):
    """A private copy of a saved model that a test may damage."""
    src, _ = oracle_model("llama-gqa-untied")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def engine(oracle_model):
    src, _ = oracle_model("llama-gqa-untied")
    return tinyinfer.Engine(tinyinfer.load(src), num_pages=10, page_size=16)


def test_empty_prompts(engine):
    with pytest.raises(PromptError, match="empty"):
        engine.add_request([])
    with pytest.raises(PromptError, match="empty"):
        engine.add_request("")
    assert not engine.has_unfinished()


def test_prompt_longer_than_context(engine):
    too_long = [1] * (engine.model.config.max_model_len + 1)
    with pytest.raises(PromptError, match="context"):
        engine.add_request(too_long)
    with pytest.raises(PromptError, match="context"):
        engine.model.logits(too_long)


def test_prompt_plus_output_overflows_context(engine):
    limit = engine.model.config.max_model_len
    with pytest.raises(ContextOverflowError, match="max_tokens"):
        engine.add_request([1] * (limit - 5), tinyinfer.SamplingParams(max_tokens=10))


def test_token_outside_vocabulary(engine):
    with pytest.raises(PromptError, match="vocabulary"):
        engine.add_request([1, 2, 10_000])


def test_request_that_can_never_fit_the_page_pool(engine):
    with pytest.raises(OutOfPagesError, match="pages"):
        engine.add_request([1] * 200, tinyinfer.SamplingParams(max_tokens=50))


def test_bad_batch_leaves_nothing_queued(engine):
    with pytest.raises(PromptError):
        engine.generate([[1, 2], [], [3]])
    assert not engine.has_unfinished()
    assert engine.pool.num_used_pages == 0


def test_invalid_sampling_params():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(max_tokens=0),
                dict(min_p=2.0), dict(temperature=float("nan"))):
        with pytest.raises(SamplingParamsError, match=next(iter(bad))):
            tinyinfer.SamplingParams(**bad)


def test_model_without_tokenizer_refuses_text(engine):
    with pytest.raises(TokenizerError, match="tokenizer"):
        engine.add_request("hello")


def test_unknown_model_and_runner(tmp_path, folder):
    with pytest.raises(TinyInferError, match="neither a known model"):
        tinyinfer.load("nowhere")
    with pytest.raises(TinyInferError, match="nowhere': no such file or folder"):
        tinyinfer.load(tmp_path / "nowhere")
    with pytest.raises(TinyInferError, match="model.gguf': no such file or folder"):
        tinyinfer.load("model.gguf")
    with pytest.raises(TinyInferError, match="runner"):
        tinyinfer.load(folder, runner="jax")
    with pytest.raises(ConfigError, match="config.json"):
        tinyinfer.load(tmp_path)


def test_corrupt_config(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        tinyinfer.load(folder)


def test_unsupported_architecture(folder):
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "bert"
    config.pop("architectures", None)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="bert"):
        tinyinfer.load(folder)


@pytest.mark.parametrize("change, named", [
    (dict(model_type="foobar"), "model_type 'foobar'"),
    (dict(architectures=["FoobarForCausalLM"]), "FoobarForCausalLM"),
    (dict(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0),
     "embedding_multiplier"),  # Granite
    (dict(residual_multiplier=0.22), "residual_multiplier"),
    (dict(logits_scaling=8.0), "logits_scaling"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(num_local_experts=8), "num_local_experts"),
])
def test_configs_whose_math_tinyinfer_lacks_are_refused_by_name(folder, change, named):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=named):
        tinyinfer.load(folder)


def test_neutral_values_of_those_keys_still_load(folder):
    config = json.loads((folder / "config.json").read_text())
    neutral = dict(embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0,
                   partial_rotary_factor=1.0, num_local_experts=0, final_logit_softcapping=None)
    (folder / "config.json").write_text(json.dumps({**config, **neutral}))
    assert tinyinfer.load(folder).config.model_type == config["model_type"]


def test_truncated_safetensors(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt"):
        tinyinfer.load(folder)


def test_garbage_safetensors(folder):
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header....")
    with pytest.raises(CheckpointError, match="not JSON"):
        tinyinfer.load(folder)


def test_missing_weights_file(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        tinyinfer.load(folder)


def _rewrite(folder, change):
    from tinyinfer.weights import read_safetensors, write_safetensors

    tensors = {k: np.array(v) for k, v in read_safetensors(folder / "model.safetensors").items()}
    change(tensors)
    write_safetensors(folder / "model.safetensors", tensors)


def test_missing_tensor_is_named(folder):
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        tinyinfer.load(folder)


def test_misshaped_tensor_is_named_with_its_file(folder):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8]
    _rewrite(folder, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*model\.safetensors.*shape"):
        tinyinfer.load(folder)


def test_extra_tensor_is_reported(folder):
    _rewrite(folder, lambda t: t.update({"model.layers.7.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected"):
        tinyinfer.load(folder)


def test_sharded_index_naming_a_missing_shard(folder):
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing"):
        tinyinfer.load(folder)
