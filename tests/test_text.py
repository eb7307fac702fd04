"""Text in, text out: tokenizer, streaming, stop strings and the CLI on a model with a real BPE."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tinyinfer


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


def test_streamed_text_equals_final_text(model):
    params = tinyinfer.SamplingParams(temperature=0.9, seed=7, max_tokens=40)
    streamed = "".join(tinyinfer.Engine(model).stream("To be, or not", params))
    final = tinyinfer.Engine(model).generate("To be, or not", params)[0]
    assert streamed == final.text
    assert final.text == model.tokenizer.decode(final.token_ids)


def test_stop_string_cuts_text_and_finishes(model):
    params = tinyinfer.SamplingParams(temperature=0.9, seed=3, max_tokens=60)
    full = tinyinfer.Engine(model).generate("The slings", params)[0].text
    stop = full[10:12]
    cut = tinyinfer.Engine(model).generate("The slings", tinyinfer.SamplingParams(
        temperature=0.9, seed=3, max_tokens=60, stop=stop))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.find(stop)]
    streamed = "".join(tinyinfer.Engine(model).stream("The slings", tinyinfer.SamplingParams(
        temperature=0.9, seed=3, max_tokens=60, stop=stop)))
    assert streamed == cut.text


def test_eos_token_finishes_unless_ignored(model):
    eos = model.tokenizer.eos_token_id
    assert eos is not None
    stop_on = tinyinfer.SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(eos,))
    out = tinyinfer.Engine(model).generate("No more", stop_on)[0]
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == eos


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyinfer", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_generate_streams_the_engine_output(model, text_model_folder):
    result = run_cli("generate", "To be", "--model", str(text_model_folder),
                     "--temperature", "0", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    expected = tinyinfer.Engine(model).generate(
        "To be", tinyinfer.SamplingParams(temperature=0, max_tokens=12))[0].text
    assert result.stdout == "To be" + expected + "\n"


def test_cli_info_describes_the_model(text_model_folder):
    result = run_cli("info", "--model", str(text_model_folder))
    assert result.returncode == 0, result.stderr
    assert "GQA" in result.stdout and "KV cache per token" in result.stdout


def test_cli_info_reads_what_the_files_hold(tmp_path):
    import os
    import shutil

    out = tmp_path / "int8"
    assert run_cli("quantize", "--model", "bundled", "--bits", "8", "-o", str(out)).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    result = run_cli("info", "--model", str(out))
    assert result.returncode == 0, result.stderr
    stored = next(line for line in result.stdout.splitlines() if line.startswith("stored as"))
    assert "int8" in stored and "in 1 file" in stored and "quantized as" in result.stdout
    broken = tmp_path / "truncated"
    shutil.copytree(out, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate((broken / "model.safetensors").stat().st_size // 2)
    result = run_cli("info", "--model", str(broken))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("tinyinfer: error: ") and "corrupt" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_errors_are_one_clear_line(text_model_folder, tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.startswith("tinyinfer: error: model") and "Traceback" not in result.stderr
    result = run_cli("generate", "hi", "--model", str(text_model_folder), "--top-p", "0")
    assert result.returncode == 2 and "--top-p must be" in result.stderr  # the flag, not the API's field
    result = run_cli("generate", "hi", "--model", str(text_model_folder), "--dtype", "int8")
    assert result.returncode == 2 and "float32 or float64" in result.stderr
    result = run_cli("generate", "hi", "--model", str(text_model_folder), "--max-tokens", "100000")
    assert result.returncode == 2 and "context" in result.stderr and result.stdout == ""


def test_padding_ids_beyond_the_tokenizer_have_no_text(model):
    """A model whose embedding is larger than its vocabulary can emit ids without text."""
    from tinyinfer.tokenizer import IncrementalDecoder

    tok = model.tokenizer
    decoder = IncrementalDecoder(tok)
    assert decoder.push(tok.vocab_size + 3) == ""
    assert decoder.push(tok.encode("To")[0]) == "To"
    with pytest.raises(tinyinfer.TokenizerError):
        tok.decode([tok.vocab_size + 3])


@pytest.fixture(scope="module")
def sentencepiece_model(sentencepiece_model_folder):
    return tinyinfer.load(sentencepiece_model_folder)


def test_sentencepiece_text_continues_the_prompt(sentencepiece_model):
    # The text is what decoding prompt and output together adds to the prompt's text: the first
    # generated word keeps its space (vLLM's choice; decoding the output alone would strip it).
    model, tok = sentencepiece_model, sentencepiece_model.tokenizer
    params = tinyinfer.SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    final = tinyinfer.Engine(model).generate("To be, or not", params)[0]
    byte_tokens = [i for i in final.token_ids if tok.holds_back(i)]
    assert byte_tokens  # the random model samples byte-fallback tokens: runs of them are text too
    prompt = tok.encode("To be, or not")
    assert tok.decode(prompt) + final.text == tok.decode(prompt + final.token_ids)
    assert "".join(tinyinfer.Engine(model).stream("To be, or not", params)) == final.text


def test_an_end_token_after_byte_tokens_ends_their_run(sentencepiece_model):
    # A run of byte-fallback tokens is held back until it ends; an end token ends it too.
    model = sentencepiece_model
    params = dict(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    ids = tinyinfer.Engine(model).generate("To be, or not", tinyinfer.SamplingParams(**params))[0].token_ids
    k = next(k for k in range(1, len(ids))
             if model.tokenizer.holds_back(ids[k - 1]) and ids[k] not in ids[:k])
    out = tinyinfer.Engine(model).generate("To be, or not", tinyinfer.SamplingParams(
        **params, stop_token_ids=(ids[k],)))[0]
    assert out.token_ids == ids[:k + 1] and out.finish_reason == "stop"
    prompt = model.tokenizer.encode("To be, or not")
    whole, before = model.tokenizer.decode(prompt + ids[:k]), model.tokenizer.decode(prompt)
    assert out.text == whole[len(before):] != model.tokenizer.decode(prompt + ids[:k - 1])[len(before):]
