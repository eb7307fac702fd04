"""The bundled-model training script, end to end at --tiny size, and the shipped bundle folders."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
DATA = REPO / "tinyinfer" / "data"
EOT = "<|endoftext|>"
FOLDER_FILES = {
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer.tiktoken", "tokenizer_config.json"
}
SAMPLE = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n"
    "  It is the east, and Juliet is the sun.  1599 -- naïve café, 'tis ☀️!\t\r\n"
    f"{EOT}KING:\nNow is the winter of our discontent"
)
WORDS = (
    "the and of to my thou thee thy lord love king night day sweet good sir what "
    "is not be heaven death heart eyes speak come go hath doth shall will fair "
    "gentle noble sword crown blood grief honour whose where why o ay nay"
).split()
SPEAKERS = ("ROMEO", "Juliet", "First Lord", "KING HENRY", "Nurse")


def fake_work(seed: int, lines: int) -> str:
    """A deterministic play-shaped text: speaker lines, then a few lines of verse."""
    rng = random.Random(seed)
    out = [f"THE PLAY NUMBER {seed}", "", "by Nobody", ""]
    while len(out) < lines:
        out += ["", f"{rng.choice(SPEAKERS)}."]
        for _ in range(rng.randint(1, 4)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
            out.append(" ".join(words).capitalize() + rng.choice(",.;!?"))
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run `train_bundled.py train --tiny` on a corpus written here; returns its output folder."""
    root = tmp_path_factory.mktemp("bundled")
    works = root / "works"
    works.mkdir()
    for i, name in enumerate(("alpha", "beta", "gamma", "delta", "epsilon")):
        text = fake_work(i, 500)
        if name == "alpha":
            text = "Project Gutenberg boilerplate\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\n" + text
            text += "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence text\n"
        (works / f"{name}.txt").write_text(text, encoding="utf-8")
    out = root / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable, str(SCRIPTS / "train_bundled.py"), "train", "--tiny", "--device", "cpu",
        "--corpus-dir", str(works), "--test", "delta", "epsilon", "--dev", "gamma", "--out", str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_tiny_run_writes_both_folders_and_results(tiny_run: Path) -> None:
    results = json.loads((tiny_run / "results.json").read_text())
    assert results["corpus"]["test"]["works"] == ["delta", "epsilon"]
    assert results["corpus"]["dev"]["works"] == ["gamma"]
    for name in ("shakespeare", "shakespeare-draft"):
        assert {p.name for p in (tiny_run / name).iterdir()} == FOLDER_FILES
    for model in ("target", "draft"):
        bits = results["test"][model]["bits_per_byte"]
        assert math.isfinite(bits) and bits > 0
    spec = results["test"]["speculative"]
    assert 0 <= spec["greedy_agreement"] <= 1 and 0 <= spec["mean_accepted"] <= spec["k"] == 4
    assert sum(r["chosen"] for r in results["target_runs"]) == 1
    assert sum(r["chosen"] for r in results["draft_runs"]) == 1
    assert (tiny_run / "train.log").read_text().strip()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shakespeare", "shakespeare-draft"])
def test_tiny_folders_are_standard_llama_checkpoints(tiny_run: Path, name: str) -> None:
    import torch
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    folder = tiny_run / name
    config = json.loads((folder / "config.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    eot_id = config["vocab_size"] - 1
    assert config["model_type"] == "llama"
    assert config["eos_token_id"] == config["bos_token_id"] == eot_id
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["added_tokens_decoder"][str(eot_id)]["content"] == EOT
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys()
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logits = model(input_ids=torch.tensor([[eot_id, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, config["vocab_size"]) and torch.isfinite(logits).all()


def tokenizer_ids(folder: Path, text: str) -> tuple[list[int], list[int]]:
    """Ids of `text` from tokenizer.json (HF tokenizers) and from tokenizer.tiktoken (tiktoken)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ranks = load_tiktoken_bpe(str(folder / "tokenizer.tiktoken"))
    assert all(bytes([b]) in ranks for b in range(256))
    gpt2_pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding(
        "bundled", pat_str=gpt2_pattern, mergeable_ranks=ranks, special_tokens={EOT: hf.token_to_id(EOT)}
    )
    return hf.encode(text).ids, enc.encode(text, allowed_special={EOT})


@pytest.mark.slow
def test_tiny_tokenizer_files_agree_token_for_token(tiny_run: Path) -> None:
    from tinyinfer.tokenizer import load_tokenizer

    folder = tiny_run / "shakespeare"
    corpus_text = fake_work(7, 200)
    for text in (SAMPLE, corpus_text):
        hf_ids, tt_ids = tokenizer_ids(folder, text)
        assert hf_ids == tt_ids
        plain = text.replace(EOT, "")
        assert load_tokenizer(folder).encode(plain) == tokenizer_ids(folder, plain)[1]
    draft_json = tiny_run / "shakespeare-draft" / "tokenizer.json"
    assert (folder / "tokenizer.json").read_bytes() == draft_json.read_bytes()


def test_corpus_cleaning() -> None:
    sys.path.insert(0, str(SCRIPTS))
    import bundled_corpus

    raw = (
        "header\r\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nHAMLET\r\n\r\n\r\n\r\n"
        "Ham.\r\nTo be, or not to be:   \r\nthat is the question.\r\n\r\nTake up the bodies.\r\nGo.\r\n"
        "\r\nEnd of the Project Gutenberg EBook\r\nlicence\r\n"
    )
    assert bundled_corpus.clean_work(raw) == (
        "HAMLET\n\nHAM:\nTo be, or not to be:\nthat is the question.\n\nTake up the bodies.\nGo.\n"
    )


@pytest.mark.parametrize("name", ["shakespeare", "shakespeare-draft"])
def test_shipped_bundles_are_standard_and_match_tinyinfer(name: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    import tinyinfer

    folder = DATA / name
    assert {p.name for p in folder.iterdir()} >= FOLDER_FILES
    limit = 16_000_000 if name == "shakespeare" else 2_000_000
    assert (folder / "model.safetensors").stat().st_size <= limit
    hf_ids, tt_ids = tokenizer_ids(folder, SAMPLE)
    assert hf_ids == tt_ids
    model = tinyinfer.load(name.replace("shakespeare", "bundled"))
    ids = model.tokenizer.encode("ROMEO:\nBut, soft! what light through yonder window breaks?")
    ours = model.logits(ids)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=0)
