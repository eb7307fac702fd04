"""Write a Hugging Face model folder as a GGUF file, as llama.cpp's converter lays one out.

The tests' way to a GGUF file of any block format without downloading one: the writer and
the block quantizers are the ``gguf`` package's own (llama.cpp's Python side); the metadata
keys, tensor names and the q/k row order for Llama's interleaved RoPE follow llama.cpp's
convert_hf_to_gguf.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from tinyinfer.weights import read_checkpoint

Q = gguf.GGMLQuantizationType
BLOCK = {"input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         **{f"self_attn.{h}_proj.{kind}": f"attn_{g}.{kind}"
            for h, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for kind in ("weight", "bias")},
         **{f"mlp.{n}_proj.weight": f"ffn_{n}.weight" for n in ("gate", "up", "down")}}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP:
        return TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{BLOCK[rest]}"


def permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of q/k for its interleaved RoPE (what the loader must undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, path: Path, linear_type: Q = Q.F32, other_type: Q = Q.F32,
               tokenizer: bool = True, architecture: str | None = None, chat_template: str | None = None,
               extra: dict[str, float] | None = None) -> Path:
    """``folder`` (config.json + safetensors, maybe tokenizer.json) as one GGUF file; ``extra``
    adds float metadata under the architecture's prefix."""
    config = json.loads((folder / "config.json").read_text())
    arch = architecture or {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    for key, value in (extra or {}).items():
        writer.add_float32(f"{arch}.{key}", value)
    if tokenizer:
        _add_tokenizer(writer, folder, config["vocab_size"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    tensors, _ = read_checkpoint(folder)
    for hf_name, value in tensors.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        w = np.asarray(value, dtype=np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute_for_gguf(w, heads if "q_proj" in hf_name else kv_heads)
        linear = hf_name.startswith("model.layers.") and w.ndim == 2
        kind = linear_type if linear else (other_type if w.ndim == 2 else Q.F32)
        if kind == Q.F32:
            writer.add_tensor(gguf_name(hf_name), w)
        elif kind == Q.F64:
            writer.add_tensor(gguf_name(hf_name), w.astype(np.float64))
        elif kind == Q.F16:
            writer.add_tensor(gguf_name(hf_name), w.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json as GGUF's "gpt2" tokenizer (vocabulary, merges, types)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    vocab.update({content: t["id"] for content, t in added.items()})
    tokens = [""] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for i in range(vocab_size):
        tokens[i] = f"[PAD{i}]"
    for token, i in vocab.items():
        tokens[i] = token
        special = added.get(token, {}).get("special")
        types[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.NORMAL
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = [i for token, i in vocab.items() if token in added]
    if eos:
        writer.add_eos_token_id(eos[-1])


def write_sentencepiece_vocab(hf_tokenizer, path: Path, add_space_prefix: bool = True) -> Path:
    """A vocabulary-only GGUF (metadata, no tensors) of a SentencePiece-style BPE tokenizer, laid
    out as llama.cpp's converter writes Llama-2's: tokens with scores (earlier merges score
    higher), token types (unknown, control, byte, normal)."""
    data = json.loads(hf_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    types = [gguf.TokenType.UNKNOWN if t == "<unk>" else gguf.TokenType.CONTROL if t in specials
             else gguf.TokenType.BYTE if t.startswith("<0x") and len(t) == 6
             else gguf.TokenType.NORMAL for t in tokens]
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 2),
                       (writer.add_rope_dimension_count, 32), (writer.add_vocab_size, len(tokens))):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_unk_token_id(vocab["<unk>"])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
