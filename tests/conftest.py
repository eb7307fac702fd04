"""Shared fixtures: small random Hugging Face models saved to disk, the oracle for our loaders."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tinyinfer.runners import threads

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Test models are tiny, and the suite runs several engines in one process on shared cores: one
# thread avoids the thread pools' overhead, which dominates their step time and explodes when
# the cores are busy. Exported as OMP_NUM_THREADS, so torch (imported later) and subprocesses
# start with one too.
threads.use(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Each entry: (transformers class name, config class name, config kwargs). Sizes are tiny so
# the whole oracle suite runs in seconds, but every architectural feature is exercised.
ORACLE_CONFIGS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    "llama-gqa-untied": ("LlamaForCausalLM", "LlamaConfig",
                         dict(vocab_size=320, hidden_size=64, intermediate_size=160,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256, tie_word_embeddings=False)),
    "llama-mqa-tied": ("LlamaForCausalLM", "LlamaConfig",
                       dict(vocab_size=320, hidden_size=64, intermediate_size=160,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                            max_position_embeddings=256, tie_word_embeddings=True)),
    "llama3-rope-scaling": ("LlamaForCausalLM", "LlamaConfig",
                            dict(vocab_size=320, hidden_size=64, intermediate_size=160,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256, rope_theta=500000.0,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64})),
    "llama-head-dim": ("LlamaForCausalLM", "LlamaConfig",
                       dict(vocab_size=320, hidden_size=64, intermediate_size=160, head_dim=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256)),
    "qwen2-bias": ("Qwen2ForCausalLM", "Qwen2Config",
                   dict(vocab_size=320, hidden_size=64, intermediate_size=160,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, tie_word_embeddings=True)),
    # A target/draft pair over an 8-token vocabulary, for statistical tests of sampling.
    "tiny-vocab-target": ("LlamaForCausalLM", "LlamaConfig",
                          dict(vocab_size=8, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=64, initializer_range=0.3)),
    "tiny-vocab-draft": ("LlamaForCausalLM", "LlamaConfig",
                         dict(vocab_size=8, hidden_size=8, intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                              max_position_embeddings=64, initializer_range=0.3)),
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(vocab_size=320, hidden_size=64, intermediate_size=160,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256, sliding_window=None)),
}


def build_hf_model(name: str, folder: Path, dtype=None):
    """Create a random transformers model from ORACLE_CONFIGS[name], save it, return it (eval)."""
    import torch
    import transformers

    model_cls, config_cls, kwargs = ORACLE_CONFIGS[name]
    config = getattr(transformers, config_cls)(
        **kwargs, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, model_cls)(config).eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def oracle_model(tmp_path_factory):
    """Factory: name -> (folder, transformers model in float32), cached per session."""
    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = (folder, build_hf_model(name, folder))
        return cache[name]

    return get


SAMPLE_TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die—to sleep,\n"
    "No more; and by a sleep to say we end\n"
) * 4


def train_small_tokenizer(folder: Path, vocab_size: int) -> None:
    """Train a byte-level BPE of at most vocab_size ids (eos last) and save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([SAMPLE_TEXT], trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))


def train_sentencepiece_tokenizer(folder: Path, vocab_size: int) -> None:
    """Train a Llama-2-style BPE of vocab_size ids and save tokenizer.json: <unk>, <s>, </s>,
    the 256 byte-fallback tokens <0x00>..<0xFF>, then pieces with ▁ for spaces."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    base.train_from_iterator([SAMPLE_TEXT], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        if len(vocab) < vocab_size:
            vocab.setdefault(token, len(vocab))
    merges = [tuple(m) for m in trained["merges"] if "".join(m) in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="session")
def text_model_folder(tmp_path_factory) -> Path:
    """A random Llama (GQA) with a real byte-level BPE tokenizer: for text-level engine tests."""
    folder = tmp_path_factory.mktemp("text-llama")
    build_hf_model("llama-gqa-untied", folder)
    train_small_tokenizer(folder, ORACLE_CONFIGS["llama-gqa-untied"][2]["vocab_size"])
    return folder


def nan_embedding_copy(src: Path, dst: Path, token_id: int) -> Path:
    """A copy of a model folder whose embedding row of ``token_id`` is NaN: a real fault that
    gives every sequence holding that token NaN logits and leaves the others untouched."""
    import shutil

    import numpy as np

    from tinyinfer.weights import read_safetensors, write_safetensors

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = {k: np.array(v) for k, v in read_safetensors(dst / "model.safetensors").items()}
    tensors["model.embed_tokens.weight"][token_id] = np.nan
    write_safetensors(dst / "model.safetensors", tensors)
    return dst


@pytest.fixture(params=["numpy", "torch"])
def runner_name(request) -> str:
    """Run a test once per model runner: the reference and the fast path must agree."""
    return request.param


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (Textual's pilot) run on asyncio only."""
    return "asyncio"


# Ctrl-C in a terminal reaches a program whose SIGINT is not ignored. A test run started in the
# background by a shell without job control ignores SIGINT, and its children would inherit
# that: a child that a test interrupts first puts Python's own SIGINT handler back.
INTERRUPTIBLE = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def interruptible_tinyinfer(*args: str) -> list[str]:
    """The command line of `python -m tinyinfer ARGS` in a child that SIGINT interrupts."""
    run = "import runpy; runpy.run_module('tinyinfer', run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", INTERRUPTIBLE + run, *args]



@pytest.fixture(scope="session")
def sentencepiece_model_folder(tmp_path_factory) -> Path:
    """A random Llama (GQA) with a Llama-2-style tokenizer: ▁ for spaces, <0xNN> byte fallback."""
    folder = tmp_path_factory.mktemp("sentencepiece-llama")
    build_hf_model("llama-gqa-untied", folder)
    train_sentencepiece_tokenizer(folder, ORACLE_CONFIGS["llama-gqa-untied"][2]["vocab_size"])
    return folder


@pytest.fixture
def without_triton_interpreter(monkeypatch):
    """The CPU as it is without Triton's interpreter, whatever the environment the suite runs
    in (a developer may export TRITON_INTERPRET=1 for the whole suite): for the tests of the
    runner's refusals of the Triton kernels on the CPU."""
    from tinyinfer.runners import triton_env

    monkeypatch.setattr(triton_env, "INTERPRETED", False)
