"""GGUF files (llama.cpp, Ollama, LM Studio) → a config, weights and a tokenizer.

A GGUF file holds a whole model: typed key-value metadata (the architecture and its sizes,
the tokenizer's vocabulary and merges, the chat template), then each tensor in a block format
of its own (F32, F16, Q8_0, Q4_1, Q4_K, ...). It is read here with the ``gguf`` package, the
reader llama.cpp itself ships, memory-mapped.

Three block formats are tinyinfer formats with another byte layout, so their weights stay
quantized (``info`` shows their real memory, the quantization panel their real codes):

* Q8_0 — 32 int8 codes and one float16 scale per block: int8-g32.
* Q4_0 — 32 nibbles and one float16 scale, weight = (nibble - 8) * scale: int4-g32.
* Q4_1 — 32 nibbles, a float16 scale and a float16 minimum, weight = nibble * scale + minimum:
  int4-g32-min.

Other block formats (the K-quants, Q5_*, ...) are dequantized to float32 as they load. The token
embedding and LM head (``token_embd``, ``output``) are dequantized too, unless the load asks to
keep them quantized (``quantize_head``): then they stay in their own block format, which need not
be the blocks' (SmolLM2's Q4_1 file stores its tied embedding as Q8_0).
llama.cpp's converter reorders the rows of a Llama model's q and k projections for its
interleaved RoPE; they are put back in Hugging Face's order here, so one model code serves both.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from tinyinfer.config import ModelConfig
from tinyinfer.errors import CheckpointError
from tinyinfer.quant import QuantConfig, QuantizedWeight, is_quantized_name, pack_int4
from tinyinfer.weights.names import map_weights
from tinyinfer.weights.safetensors_file import Bf16Array, WeightArray

import gguf
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

Q = gguf.GGMLQuantizationType
KEPT = {  # block formats that are tinyinfer formats
    Q.Q8_0: QuantConfig(8, 32),
    Q.Q4_0: QuantConfig(4, 32),
    Q.Q4_1: QuantConfig(4, 32, symmetric=False, minimum=True),
}
FLOATS = {Q.F32: np.float32, Q.F16: np.float16}
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # GGUF architecture -> model_type
# GGUF keys (after the architecture's prefix) -> the config.json key they stand for, so that
# config.py refuses what tinyinfer cannot compute in one place, whichever file it came from.
HF_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
    "attention.scale": "attention_multiplier",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_local_experts",
}
# GGUF tensor names (after "blk.N.") -> Hugging Face names (after "model.layers.N.")
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}"
       for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
    **{f"ffn_{name}.weight": f"mlp.{name}_proj.weight" for name in ("gate", "up", "down")},
}
# tokenizer.ggml.pre (llama.cpp's name for a byte-level pre-tokenizer) -> the regex it splits
# text with before bytes are merged; None: GPT-2's own, built into tokenizers' ByteLevel.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "default": None, "gpt-2": None,
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
    "qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of added tokens
HEAD_TENSORS = ("token_embd.weight", "output.weight")  # the embedding and LM head (absent when tied)
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def is_gguf(path: Path) -> bool:
    """Whether a path names a GGUF file (by its name: a model *folder* is never one)."""
    return path.suffix.lower() == ".gguf"


class GGUFCheckpoint:
    """One GGUF file, memory-mapped: its metadata, tensors, tokenizer and chat template."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            # the reader raises whatever a truncated or foreign file makes it trip over
            raise CheckpointError(f"{self.path} is not a readable GGUF file ({exc})") from None
        self.architecture = str(self.value("general.architecture"))
        if self.architecture not in ARCHITECTURES:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.architecture!r} is not "
                                  f"supported (tinyinfer runs {', '.join(ARCHITECTURES)})")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def value(self, key: str, default: Any = KeyError) -> Any:
        """A metadata value (strings decoded, arrays as lists); ``default`` if absent."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise CheckpointError(f"{self.path}: metadata {key} is missing")
            return default
        return field.contents()

    # ------------------------------------------------------------ config

    def hf_config(self) -> dict[str, Any]:
        """The metadata as the config.json it was converted from (what config.py reads)."""
        prefix = self.architecture + "."
        raw: dict[str, Any] = {"model_type": ARCHITECTURES[self.architecture], "hidden_act": "silu",
                               "torch_dtype": "float32"}
        for key, hf_key in HF_KEYS.items():
            value = self.value(prefix + key, None)
            if value is not None:
                raw[hf_key] = value
        raw["vocab_size"] = self.value(prefix + "vocab_size", len(self.tokens) or None)
        raw["tie_word_embeddings"] = "output.weight" not in self.tensors
        raw["bos_token_id"] = self.value("tokenizer.ggml.bos_token_id", None)
        raw["eos_token_id"] = [i for i in (self.value("tokenizer.ggml.eos_token_id", None),
                                           self.value("tokenizer.ggml.eot_token_id", None))
                               if i is not None]
        rope_dims = self.value(prefix + "rope.dimension_count", None)
        heads = raw.get("num_attention_heads")
        head_dim = raw.get("head_dim") or (raw["hidden_size"] // heads if heads else None)
        if rope_dims is not None and head_dim and rope_dims != head_dim:
            raw["partial_rotary_factor"] = rope_dims / head_dim
        scaling = self.value(prefix + "rope.scaling.type", None)
        if scaling not in (None, "none"):
            raw["rope_scaling"] = {"rope_type": scaling,
                                   "factor": self.value(prefix + "rope.scaling.factor", 1.0)}
        if "rope_freqs.weight" in self.tensors:
            raw["rope_freqs"] = "per-frequency RoPE factors (Llama 3.1's long-context scaling)"
        return raw

    # ------------------------------------------------------------ tokenizer

    @cached_property
    def tokens(self) -> list[str]:
        """The vocabulary, id by id (empty without tokenizer metadata); read once, it is long."""
        return self.value("tokenizer.ggml.tokens", [])

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.model" in self.reader.fields and bool(self.tokens)

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The tokenizer the metadata describes, built with the tokenizers library: byte-level
        BPE ("gpt2": vocabulary, merges, pre-tokenizer by name) or SentencePiece BPE ("llama":
        vocabulary with scores, byte fallback)."""
        if not self.has_tokenizer:
            raise CheckpointError(f"{self.path} has no tokenizer in its metadata")
        kind, tokens = self.value("tokenizer.ggml.model"), self.tokens
        types = self.value("tokenizer.ggml.token_type", [1] * len(tokens))
        vocab = {token: i for i, token in enumerate(tokens)}
        if kind == "gpt2":
            tokenizer = self._byte_level_bpe(vocab)
        elif kind == "llama":
            tokenizer = self._sentencepiece_bpe(vocab)
        else:
            raise CheckpointError(f"{self.path}: GGUF tokenizer model {kind!r} is not supported "
                                  "(gpt2 and llama are)")
        tokenizer.add_tokens([tokenizers.AddedToken(tokens[i], special=t == CONTROL, normalized=False)
                              for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)])
        return tokenizer

    def special_token_texts(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token and pad_token as text (what chat templates print)."""
        tokens = self.tokens
        texts = {}
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                          ("pad_token", "padding")):
            index = self.value(f"tokenizer.ggml.{key}_token_id", None)
            texts[name] = tokens[index] if index is not None and 0 <= index < len(tokens) else ""
        return texts

    def _byte_level_bpe(self, vocab: dict[str, int]) -> tokenizers.Tokenizer:
        merges = [tuple(m.split(" ", 1)) for m in self.value("tokenizer.ggml.merges")]
        pre = self.value("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise CheckpointError(f"{self.path}: GGUF pre-tokenizer {pre!r} is not supported "
                                  f"({', '.join(PRE_TOKENIZERS)} are)")
        tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3")))
        split = PRE_TOKENIZERS[pre]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in (None, "digits"))
        if split is None:
            tokenizer.pre_tokenizer = byte_level
        elif split == "digits":
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(tokenizers.Regex(split), "isolated"), byte_level])
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer

    def _sentencepiece_bpe(self, vocab: dict[str, int]) -> tokenizers.Tokenizer:
        """SentencePiece BPE as transformers rebuilds it: a merge for every split of a token
        into two tokens, the best-scored result first; bytes not in the vocabulary fall back
        to their <0xNN> tokens."""
        scores = self.value("tokenizer.ggml.scores")
        merges = sorted(((a, token[len(a):]) for token in vocab for a in _prefixes(token, vocab)),
                        key=lambda pair: (-scores[vocab[pair[0] + pair[1]]], vocab[pair[0]], vocab[pair[1]]))
        unk = self.value("tokenizer.ggml.unknown_token_id", None)
        tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
                                                    unk_token=None if unk is None else list(vocab)[unk]))
        prefix = self.value("tokenizer.ggml.add_space_prefix", True)
        tokenizer.normalizer = normalizers.Sequence(
            ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        return tokenizer

    # ------------------------------------------------------------ weights

    def weights(self, config: ModelConfig, head: bool = False) -> dict[str, WeightArray | QuantizedWeight]:
        """Runner weights by tinyinfer name; the linear layers in `kept_format` where it is one,
        and with ``head`` the embedding and LM head in their own block formats."""
        kept = self.kept_format(head)
        arrays: dict[str, WeightArray | QuantizedWeight] = {}
        origin: dict[str, str] = {}
        for name, tensor in self.tensors.items():
            hf_name = self._hf_name(name)
            if hf_name is None:
                continue
            quantized = kept is not None and (_is_linear(hf_name) or (head and name in HEAD_TENSORS))
            value = self._quantized(tensor) if quantized else self._floats(tensor)
            if self.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
                value = _unpermute_rows(value, heads)
            arrays[hf_name], origin[hf_name] = value, f"{self.path} ({name})"
        return map_weights(config, arrays, origin)

    def kept_format(self, head: bool = False) -> QuantConfig | None:
        """The tinyinfer format the linear layers stay in: one that all of their blocks are in,
        or None (floats, other block formats, or a mix: all dequantized). With ``head`` the
        embedding and LM head stay quantized too (``QuantConfig.head``), or a CheckpointError
        says why they cannot."""
        kinds = {tensor.tensor_type for name, tensor in self.tensors.items()
                 if _is_linear(self._hf_name(name) or "")}
        kept = KEPT.get(kinds.pop()) if len(kinds) == 1 else None
        if not head:
            return kept
        if kept is None:
            raise CheckpointError(f"{self.path}: its linear layers are not all in one of Q8_0, Q4_0 "
                                  "and Q4_1, so they load as floats: load it without quantize_head")
        for name in HEAD_TENSORS:
            tensor = self.tensors.get(name)
            if tensor is not None and tensor.tensor_type not in KEPT:
                raise CheckpointError(f"{self.path}: {name} is stored as {tensor.tensor_type.name}, "
                                      "not Q8_0, Q4_0 or Q4_1, so it cannot stay quantized: load it "
                                      "without quantize_head")
        return replace(kept, head=True)

    def stored_as(self) -> dict[str, int]:
        """Bytes of the file's tensors by block format, most first (F32, Q4_1, ...)."""
        sizes: Counter[str] = Counter()
        for tensor in self.tensors.values():
            sizes[tensor.tensor_type.name] += int(tensor.n_bytes)
        return dict(sizes.most_common())

    def _hf_name(self, name: str) -> str | None:
        if name in TOP_NAMES:
            return TOP_NAMES[name]
        if name == "rope_freqs.weight":
            return None  # refused with the config (hf_config), never a weight
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in BLOCK_NAMES:
            return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}"
        raise CheckpointError(f"{self.path}: tensor {name} is not part of a {self.architecture} "
                              "model tinyinfer can run")

    def _floats(self, tensor: Any) -> WeightArray:
        """A tensor as floats: F32/F16 as stored, BF16 left lazy, anything else dequantized."""
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest axis first
        kind = tensor.tensor_type
        if kind in FLOATS:
            return np.asarray(tensor.data).view(FLOATS[kind]).reshape(shape)
        if kind == Q.BF16:
            return Bf16Array(np.asarray(tensor.data).view(np.uint16).reshape(shape))
        try:
            values = gguf.quants.dequantize(np.asarray(tensor.data), kind)
        except (NotImplementedError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{self.path}: tensor {tensor.name} is stored as {kind.name}, "
                                  f"which tinyinfer cannot read ({exc})") from None
        return values.reshape(shape).astype(np.float32, copy=False)

    def _quantized(self, tensor: Any) -> QuantizedWeight:
        """A Q8_0 / Q4_0 / Q4_1 weight (a linear layer, the embedding or LM head) as the
        tinyinfer format with its numbers."""
        config = KEPT[tensor.tensor_type]
        n, out = (int(d) for d in tensor.shape)
        blocks = np.asarray(tensor.data).reshape(out, n // 32, -1)  # [out, groups, block bytes]
        scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]  # [out, groups]
        if config.bits == 8:
            codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, n)
            return QuantizedWeight(codes, scales, None, n, config)
        start = 4 if config.minimum else 2
        packed = blocks[..., start:]  # [out, groups, 16]: weight j low nibble, weight j + 16 high
        nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, n)
        mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if config.minimum else None
        return QuantizedWeight(pack_int4(nibbles), scales, None, n, config, mins)


def _prefixes(token: str, vocab: dict[str, int]) -> list[str]:
    """Each left part of a split of ``token`` into two vocabulary tokens."""
    return [token[:i] for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]


def _is_linear(hf_name: str) -> bool:
    parts = hf_name.split(".")
    runner_name = f"layers.0.{parts[-2].removesuffix('_proj')}.weight"
    return hf_name.startswith("model.layers.") and hf_name.endswith(".weight") and \
        is_quantized_name(runner_name)


def _unpermute_rows(value: WeightArray | QuantizedWeight, heads: int) -> WeightArray | QuantizedWeight:
    """Undo llama.cpp's q/k row order: within each head, rows (pair i, half j) go back to
    Hugging Face's (half j, pair i), the two halves RoPE rotates against each other."""
    out = value.shape[0]
    half = out // heads // 2
    order = np.arange(out).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)
    if isinstance(value, QuantizedWeight):
        rows = [None if a is None else a[order] for a in (value.zeros, value.mins)]
        return QuantizedWeight(value.data[order], value.scales[order], rows[0], value.in_features,
                               value.config, rows[1])
    return value[order]
