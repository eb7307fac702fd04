"""The fast runner: the reference's forward pass in PyTorch, on CPU or CUDA.

Same function as ``numpy_ref.NumpyRunner``, arranged for speed:

* weights go to the device once, in the compute dtype (bf16 on CUDA by default), with
  q/k/v fused into one projection and gate/up into another, so each is one matrix product;
* K/V live in paged device tensors ``[layers, pages + 1, S, Hkv, hd]`` (the extra page is
  scratch for padded CUDA-graph rows), in the compute dtype or (``kv_cache_dtype="int8"``) as
  int8 codes with one float16 scale per token and KV head, quantized as they are written;
* one forward per mixed batch: all prefill chunks attend in one call, packed one sequence after
  another and reading earlier tokens through their page tables (a Triton kernel on CUDA;
  elsewhere ``scaled_dot_product_attention`` per sequence); all decoding sequences attend
  together, reading pages through their block tables (a Triton kernel on CUDA, a gather + mask
  elsewhere). A batch in which every sequence has the same few new tokens (verifying k drafted
  tokens: k + 1 each) takes the decode path too, a causal block per sequence, so decode and
  verification share one kernel;
* ``compile=True`` runs the per-layer tensor functions through ``torch.compile`` (fusing
  norms, residual adds and activations); ``cuda_graphs=True`` replays decode and verification
  steps from CUDA graphs captured per (tokens per sequence, padded batch size), and every other
  step of up to 512 tokens (prefill chunks, mixed steps, a draft's catch-up on a prompt) from
  graphs of each layer's parts before and after its attention, per padded token count, the
  attention eager between them (``torch_pieces``). Both default on for CUDA, off for CPU;
* greedy drafting (``launch_rounds``: a draft model's catch-up step, then k - 1 rounds, each fed
  its argmax of the one before) runs as one function, ``_greedy_rounds``, whose rounds take
  their tokens from the round before on the device, and with ``cuda_graphs`` replays it from
  one CUDA graph per (catch-up tokens per sequence, rounds, padded batch size). A small draft
  model's round is a few hundred short kernels: launched one round at a time, a round costs the
  host's staging, its copy in, the argmax and its copy out, about a step of the target on a
  tiny pair; in one graph the k rounds cost one staging and one replay, the device's time
  alone. Without graphs (CPU) the same function runs eagerly, which is what CI compares
  against the rule, round by round (``launch_rounds_stepwise``). The rounds' argmaxes stay on
  the device as well (``TokensFuture.argmax``), so the verification of the guesses can be
  launched behind the rounds with its guessed tokens gathered there (a ``Feed``) before the
  host has read them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from tinyinfer.config import ModelConfig, rope_inverse_frequencies
from tinyinfer.quant import QuantizedWeight
from tinyinfer.display import progress
from tinyinfer.errors import TinyInferError
from tinyinfer.runners import torch_layers as layers
from tinyinfer.runners import triton_env
from tinyinfer.runners.runner import (
    AfterVerification,
    Batch,
    Feed,
    RankTiming,
    Rounds,
    RunnerInfo,
    TokensFuture,
    TopFuture,
    TopLogits,
    check_kv_cache_dtype,
    launch_rounds_after_stepwise,
    launch_rounds_stepwise,
)
from tinyinfer.runners.torch_graphs import ChosenInputs, DecodeGraphs
from tinyinfer.runners.torch_layers import PrefillChunks
from tinyinfer.runners.torch_pieces import PieceGraphs
from tinyinfer.runners.torch_weights import DeviceWeights, pick_device, pick_dtype

DECODE_ATTENTION = ("auto", "triton", "torch")
PREFILL_ATTENTION = ("auto", "triton", "torch")
DECODE_PRODUCTS = ("auto", "triton", "torch")
# The most new tokens per sequence that a uniform batch may feed the decode path (and its CUDA
# graphs): a verification step of the most draft tokens the engine allows, 16, plus one.
MAX_DECODE_TOKENS = 17
# Decode steps of at most this many rows run the fused Triton products (decode_products="triton"):
# one row the matrix-vector kernels (torch_triton_gemv), two rows of fp16/bf16 weights their
# few-row program (both rows multiplied by each tile of weights it reads; FEW_ROWS), then up to
# FUSED_MAX_ROWS the batch-invariant row kernel (torch_triton_rows), one tile of 16 rows: past it
# the row kernel reads the weights once per 16 rows and cuBLAS is faster. With batch_invariant
# every step runs the row kernel.
FUSED_MAX_ROWS = 16
# Steps of up to this many rows of int8 / int4 weights run the fused products, a program per row,
# a tile's rows side by side so the second reads the words from L2 (an H100, 8B int8 + head, two
# sequences: 4.22 against 5.32 ms through the compiled functions; docs/quantization.md); more
# rows the compiled functions (from three rows at 8B the matrix units, which read the words once
# for 16 rows, are faster: 5.45 against 6.81 ms; at 1B three rows were a tie, 1.50 against 1.55).
QUANT_FEW_ROWS = 2
# The most tokens per sequence of the step before greedy rounds that ``launch_rounds`` runs as one
# function (and graph): a draft's catch-up of one token, or two (its last guess and the target's
# bonus token, when every guess was kept). Longer ones (a prompt) go round by round.
MAX_ROUNDS_CATCH_UP = 2
QUANT_KERNELS = ("auto", "triton", "torch")


@dataclass
class TorchKVCache:
    """K and V pages of every layer on the device: k[layer] is [P + 1, S, Hkv, hd]."""

    k: Tensor  # [L, P + 1, S, Hkv, hd]; page P is scratch for padded decode rows
    v: Tensor
    page_size: int
    # int8 K/V: k and v hold int8 codes, these one float16 scale per token and KV head
    k_scale: Tensor | None = None  # [L, P + 1, S, Hkv]
    v_scale: Tensor | None = None
    graphs: dict[int, DecodeGraphs] | None = field(default=None, repr=False)  # by tokens per sequence
    # greedy rounds' graphs (launch_rounds), by (catch-up tokens per sequence, rounds)
    round_graphs: dict[tuple[int, int], DecodeGraphs] | None = field(default=None, repr=False)

    def layer_scales(self, layer: int) -> dict[str, Tensor]:
        """One layer's scales as keyword arguments of the attention functions (none unless int8)."""
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    @property
    def num_pages(self) -> int:
        return self.k.shape[1] - 1

    @property
    def scratch_page(self) -> int:
        return self.num_pages


@dataclass(frozen=True)
class _DecodeGroup:
    """Sequences of one step that take the decode attention with the same q new tokens each."""

    rows: Tensor  # [Bg q] their rows, each sequence's q in order
    tables: Tensor  # [Bg, W] their page tables


@dataclass(frozen=True)
class _Step:
    """A batch as device tensors, split into decoding rows and prefill chunks."""

    token_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    slots: Tensor  # [T] int64
    decode_tables: Tensor | None  # [B, W] page tables when every row decodes (q rows a sequence)
    # beside prefill chunks (or, batch-invariant, beside other q's): the sequences on the decode
    # path, one group per number of new tokens
    decode_groups: tuple[_DecodeGroup, ...] = ()
    prefills: PrefillChunks | None = None  # the prefill chunks, packed; None when every row decodes
    prefill_rows: Tensor | None = None  # [Tp] their rows; None when every row is theirs
    logits_rows: Tensor | None = None  # [R]; None means every row


def quantized_fusion_pays(bits: set[int], hidden_size: int) -> bool:
    """Whether a quantized model's one-row steps run faster through the fused products than
    through the compiled glue and the unfused products, as measured on an H100 (docs/quantization.md):
    with int8 layers at every size (an 8B layer 94.3 against 100.6 us unfused), with int4 ones up
    to a hidden size of 2048 (a 1B layer 33.4 against 34.5 us); wider int4 layers are bound by the
    products' instructions, which the fused products' input work adds to (8B: 73.5 against 70.9).
    ``bits``: the quantized layers' code widths."""
    return bits <= {8} or hidden_size <= 2048


class TorchRunner:
    """Fast runner: fp32 / fp16 / bf16 on CPU or CUDA, same outputs as the reference."""

    name = "torch"
    # The contract's attention capture: the fused kernels keep no attention weights, so
    # ``last_attention`` stays empty whatever ``capture_attention`` says.
    capture_attention = False
    last_attention: tuple[list[np.ndarray], ...] = ()
    last_timings: tuple[RankTiming, ...] = ()  # one process

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray | Tensor],
                 device: str | None = None, dtype: str | None = None,
                 compile: bool | None = None, cuda_graphs: bool | None = None,
                 decode_attention: str = "auto", max_graph_batch: int = 256,
                 quant_kernel: str = "auto", kv_cache_dtype: str = "auto",
                 prefill_attention: str = "auto", decode_products: str = "auto",
                 batch_invariant: bool = False, pdl: bool | None = None):
        self.config = config
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        self.device = pick_device(device)
        on_cuda = self.device.type == "cuda"
        self.pdl = self._pick_pdl(pdl)
        int4 = any(isinstance(w, QuantizedWeight) and w.config.bits == 4 for w in weights.values())
        self.dtype = pick_dtype(dtype, on_cuda, int4)
        if cuda_graphs and not on_cuda:
            raise TinyInferError("CUDA graphs need a CUDA device: pass cuda_graphs=False on CPU")
        self.compile = on_cuda if compile is None else bool(compile)
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        if max_graph_batch < 1:
            raise TinyInferError(f"max_graph_batch must be at least 1, got {max_graph_batch}")
        self.max_graph_batch = max_graph_batch
        self.decode_attention_kind = self._pick_decode_attention(decode_attention)
        kernel = _triton_decode_attention() if self.decode_attention_kind == "triton" else None
        self.decode_attention: Callable[..., Tensor] = kernel or layers.paged_decode_attention
        self.prefill_attention_kind = self._pick_prefill_attention(prefill_attention)
        self.prefill_attention: Callable[..., Tensor] = (
            _triton_prefill_attention() if self.prefill_attention_kind == "triton"
            else layers.packed_prefill_attention)
        self.quant_kernel = self._pick_quant_kernel(quant_kernel)
        self.w = DeviceWeights.load(config, weights, self.device, self.dtype, quant_kernel=self.quant_kernel)
        rope = _rope_tables(config, self.device) if config.uses_rope else (None, None)
        self.cos, self.sin = rope
        self._eager = (layers.attention_input, layers.mlp_block, layers.final_logits)
        self._decode_fns = self._eager
        if self.compile:
            # Every runner adds a few cache entries per function (one row; the first size it
            # meets; then any number of rows, the layers' pieces' sizes included); past Dynamo's
            # default limit of 8 it would silently run eager.
            dynamo_config = torch._dynamo.config
            dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
            self._decode_fns = tuple(torch.compile(fn) for fn in self._eager)
        fusable = (self._fusable() if decode_products != "torch" and triton_env.runs_kernels(self.device)
                   else None)
        self.decode_products = self._pick_decode_products(decode_products, fusable)
        # the decode attention beside the fused products: the Triton kernel launched so that it
        # may start as the q|k|v product ends (programmatic dependent launch, where the card has it)
        self._fused_attention = self.decode_attention
        self._fused: dict[str, tuple[Callable[..., Any], ...]] = {}
        # steps of 2..few_rows rows take the fused products' "few" functions (16-bit weights: the
        # few-row program, FEW_ROWS; int8 / int4: a program per row, QUANT_FEW_ROWS; 1: none)
        self.few_rows = 1
        if self.decode_products == "triton":
            from tinyinfer.runners.torch_triton_gemv import FEW_ROWS

            self._fused = self._fused_layer_fns()
            self.few_rows = FEW_ROWS
            if fusable == "quantized":  # the row kernel reads 16-bit weights only
                del self._fused["rows"]
                self.few_rows = QUANT_FEW_ROWS
                if isinstance(self.w.head, layers.KernelWeight):
                    # a quantized head's product runs faster unfused, after the compiled norm
                    # (an H100: 96.8 against 117.3 us for the 8B int4 head; the 1B int4 + head
                    # two-row steps 0.92 / 0.94 against 0.97 / 0.99 ms fused; docs/quantization.md)
                    for kind in ("gemv", "few"):
                        attention_input, mlp_block, _ = self._fused[kind]
                        self._fused[kind] = (attention_input, mlp_block, self._decode_fns[2])
        if batch_invariant and ("rows" not in self._fused or self.decode_attention_kind != "triton"):
            raise TinyInferError("batch_invariant needs the fused products and the Triton decode "
                                 "attention (decode_products='triton', decode_attention='triton': "
                                 "CUDA or TRITON_INTERPRET=1, the triton package, RMSNorm, a "
                                 "gated MLP, unquantized float16/bfloat16 weights)")
        self.batch_invariant = bool(batch_invariant)
        if self._fused and self.decode_attention_kind == "triton":
            # batch_invariant: every row's context in the same number of splits whatever the
            # number of sequences (by default the splits fill the GPU for the batch at hand)
            splits = {"num_splits": _triton_max_splits()} if self.batch_invariant else {}
            self._fused_attention = functools.partial(self.decode_attention, pdl=True, **splits)
        self._greedy_reduce = torch.compile(greedy_reduce) if self.compile else greedy_reduce
        self._announced_compile = False
        # the layers' pieces, made at the first step no decode graph replays (_piece_graphs)
        self._pieces: PieceGraphs | None = None

    # ------------------------------------------------------------------ setup

    def _pick_pdl(self, choice: bool | None) -> bool:
        """Programmatic dependent launch of the fused decode products and the attention beside
        them (``triton_common``): a kernel's programs start while the previous kernel's finish,
        load their first weights, and wait for its results before reading them. None: on where
        the device supports it (a CUDA card of compute capability 9.0 or later, Triton
        installed), where it measured faster (an H100: the 1B step 1.06x, docs/fast-path.md);
        True elsewhere is refused. Steps on the compiled glue launch every kernel plainly: there
        it gained nothing (the unfused int4 products 0.98x) or, through Inductor's
        ``triton.enable_pdl`` on torch 2.11, changed the logits."""
        supported = triton_env.supports_dependent_launch(self.device)
        if choice and not supported:
            raise TinyInferError("pdl=True (programmatic dependent launch) needs a CUDA card of compute "
                                 "capability 9.0 or later and the triton package: leave pdl unset or pass pdl=False")
        return supported if choice is None else bool(choice)

    def _pick_decode_attention(self, choice: str) -> str:
        """"triton" (the kernel) where it applies, else "torch" (gather + mask); "auto" takes
        the kernel on CUDA only (``triton_env``)."""
        if choice not in DECODE_ATTENTION:
            raise TinyInferError(f"decode_attention must be one of {DECODE_ATTENTION}, got {choice}")
        even = self.config.head_dim % 2 == 0
        if choice == "torch" or (choice == "auto" and not (self.device.type == "cuda" and even)):
            return "torch"
        if not (even and (self.device.type == "cuda" or triton_env.INTERPRETED)):
            raise TinyInferError("the Triton decode kernel needs a CUDA device (or the CPU under "
                                 "TRITON_INTERPRET=1) and an even head_dim: use decode_attention='torch'")
        if _triton_decode_attention() is None:
            if choice == "triton":
                raise TinyInferError("decode_attention='triton' needs the triton package: "
                                     "install it or use decode_attention='torch'")
            return "torch"
        return "triton"

    def _pick_prefill_attention(self, choice: str) -> str:
        """"triton" (one kernel launch for every prefill chunk) where the Triton decode kernel
        could run (CUDA, an even head_dim, triton installed), else "torch"
        (scaled_dot_product_attention per sequence)."""
        if choice not in PREFILL_ATTENTION:
            raise TinyInferError(f"prefill_attention must be one of {PREFILL_ATTENTION}, got {choice}")
        usable = (self.device.type == "cuda" and self.config.head_dim % 2 == 0
                  and _triton_decode_attention() is not None)
        if choice == "triton" and not usable:
            raise TinyInferError("prefill_attention='triton' needs a CUDA device, an even head_dim "
                                 "and the triton package: use prefill_attention='torch'")
        return "triton" if choice == "triton" or (choice == "auto" and usable) else "torch"

    def _pick_decode_products(self, choice: str, fusable: str | None) -> str:
        """"triton": decode steps of up to FUSED_MAX_ROWS rows through the fused Triton products
        (``torch_triton_gemv``: norms, residual adds and SiLU·mul inside the matrix-vector
        kernels, their few-row program for two rows, ``torch_triton_rows`` for 3..16; int8/int4
        weights in the Triton kernels' layout through ``torch_quant_gemv``);
        "torch": the compiled layer functions and cuBLAS (or the quantized products); "auto":
        "triton" where it applies (CUDA, Triton installed, RMSNorm and a gated MLP) and every
        weight is fp16/bf16, or the quantized layers are int8 or the hidden size at most 2048: there
        the fused quantized products beat the compiled glue and the unfused products on an H100;
        wider int4 layers are bound by the products' instructions, which the fused products'
        input work adds to (docs/quantization.md). ``fusable``: what ``_fusable`` says, None
        where the kernels cannot run."""
        if choice not in DECODE_PRODUCTS:
            raise TinyInferError(f"decode_products must be one of {DECODE_PRODUCTS}, got {choice}")
        if choice == "torch":
            return "torch"
        if choice == "triton" and fusable is None:
            raise TinyInferError("decode_products='triton' needs a CUDA device (or the CPU under "
                                 "TRITON_INTERPRET=1), the triton package, "
                                 "RMSNorm, a gated MLP and float16/bfloat16 weights (or int8/int4 "
                                 "ones with quant_kernel 'triton' or 'auto'): use decode_products='torch'")
        fused_pays = fusable == "plain" or (fusable == "quantized" and quantized_fusion_pays(
            {p.bits for p in self._products() if isinstance(p, layers.KernelWeight)}, self.config.hidden_size))
        return "triton" if choice == "triton" or (fused_pays and self.device.type == "cuda") else "torch"

    def _products(self) -> list[Any]:
        """Every layer's product weights (q|k|v, o, gate|up, down)."""
        return [p[0] for layer in self.w.layers for p in (layer.qkv, layer.o, layer.mlp_in, layer.mlp_out)]

    def _fusable(self) -> str | None:
        """Whether the fused products take every weight: "plain" (fp16/bf16 tensors),
        "quantized" (some in the Triton kernels' int8/int4 layout), or None."""
        try:
            from tinyinfer.runners import torch_triton_gemv
        except ImportError as missing:  # a Triton too old for the kernels (no programmatic
            if not (missing.name or "").startswith("triton"):  # dependent launch); not our own
                raise
            return None
        w = self.w
        norms = [w.final_norm[1]] + [n[1] for layer in w.layers for n in (layer.attn_norm, layer.mlp_norm)]
        products = [w.head] + self._products()
        if w.pos_embed is not None or not torch_triton_gemv.applies(self.config.family == "llama", norms, products):
            return None
        return "plain" if all(isinstance(p, Tensor) for p in products) else "quantized"

    def _pick_quant_kernel(self, choice: str) -> str:
        """Which kernels multiply by int8 / int4 weights: "triton" (tinyinfer's, every format),
        "torch" (torch's int4 kernel where it takes the shape, its prefill rows dequantized by a
        Triton kernel where Triton is installed; else dequantize-then-multiply) or
        "auto": the Triton kernels on CUDA cards of compute capability 8.0 or later with Triton
        installed, elsewhere "torch"."""
        if choice not in QUANT_KERNELS:
            raise TinyInferError(f"quant_kernel must be one of {QUANT_KERNELS}, got {choice}")
        usable = (self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) >= (8, 0)
                  and triton_env.installed())
        if choice == "triton" and not (usable or (triton_env.INTERPRETED and triton_env.installed())):
            raise TinyInferError("quant_kernel='triton' needs Triton and a CUDA card of compute "
                                 "capability 8.0 or later (or the CPU under TRITON_INTERPRET=1): "
                                 "use quant_kernel='torch'")
        return choice if usable or choice == "triton" else "torch"

    def describe(self) -> dict[str, Any]:
        """What the runner chose: device, dtype, K/V storage, compile, CUDA graphs, decode
        attention, and the quantized products' kernels; ``pdl``: whether the fused decode
        products and their attention launch dependently (they run where decode_products is
        "triton")."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": self.kv_cache_dtype,
            "compile": self.compile,
            "cuda_graphs": self.cuda_graphs,
            "decode_attention": self.decode_attention_kind,
            "prefill_attention": self.prefill_attention_kind,
            "quant_kernel": self.quant_kernel,
            "decode_products": self.decode_products,
            "batch_invariant": self.batch_invariant,
            "pdl": self.pdl,
        }

    # ------------------------------------------------------------------ protocol

    @property
    def info(self) -> RunnerInfo:
        int8 = self.kv_cache_dtype == "int8"
        return RunnerInfo(name=self.name, dtype=str(self.dtype).removeprefix("torch."),
                          device=str(self.device), itemsize=1 if int8 else self.dtype.itemsize,
                          weight_bytes=self.w.streamed_bytes(), kv_cache_dtype=self.kv_cache_dtype,
                          kv_scale_bytes=2 if int8 else 0)

    def new_kv_cache(self, num_pages: int, page_size: int) -> TorchKVCache:
        """K/V pages on the device, plus one scratch page (int8 K/V: codes and their scales)."""
        c = self.config
        shape = (c.num_layers, num_pages + 1, page_size, c.num_kv_heads, c.head_dim)
        if self.kv_cache_dtype == "int8":
            def zeros(size: tuple[int, ...], dtype: torch.dtype) -> Tensor:
                return torch.zeros(size, dtype=dtype, device=self.device)

            return TorchKVCache(k=zeros(shape, torch.int8), v=zeros(shape, torch.int8),
                                page_size=page_size, k_scale=zeros(shape[:-1], torch.float16),
                                v_scale=zeros(shape[:-1], torch.float16))
        return TorchKVCache(k=torch.zeros(shape, dtype=self.dtype, device=self.device),
                            v=torch.zeros(shape, dtype=self.dtype, device=self.device),
                            page_size=page_size)

    def close(self) -> None:
        """Nothing outlives this runner: it runs in this process alone (a shard's group is the
        tensor-parallel runner's to close)."""

    def copy_page(self, kv_cache: TorchKVCache, src: int, dst: int) -> None:
        for pages in (kv_cache.k, kv_cache.v, kv_cache.k_scale, kv_cache.v_scale):
            if pages is not None:
                pages[:, dst].copy_(pages[:, src])

    def forward(self, batch: Batch, kv_cache: TorchKVCache) -> np.ndarray:
        """Run one mixed batch; write its K/V into the pages; return float32 logits [R, V]."""
        return self._device_logits(batch, kv_cache).float().cpu().numpy()

    def forward_top(self, batch: Batch, kv_cache: TorchKVCache, k: int) -> TopLogits:
        """The same forward pass, reducing logits to their top k per row on the device
        (``launch_top``, waited for: one reduction, the one the engine's steps use)."""
        return self.launch_top(batch, kv_cache, k).result()

    def launch_top(self, batch: Batch, kv_cache: TorchKVCache, k: int,
                   feed: Feed | None = None) -> TopFuture:
        """forward_top queued on the device (CUDA: returns before the step has run; CPU: at once
        computed). Fed tokens are gathered on the device from the source launch's argmax."""
        start = _timing_event(self.device)
        tokens = self._fed_tokens(batch, feed) if feed is not None else None
        return top_future(self._device_logits(batch, kv_cache, tokens), k, start, self._greedy_reduce)

    def launch_rounds(self, batch: Batch, kv_cache: TorchKVCache, rounds: Rounds) -> TokensFuture:
        """Greedy rounds as one function (``_greedy_rounds``), replayed from one CUDA graph with
        ``cuda_graphs``: one launch for the step and every round. A step of more than
        MAX_ROUNDS_CATCH_UP tokens per sequence (or of unequal ones, or one that wants only some
        rows' logits), no rounds, or a batch past the largest graph go round by round."""
        q = _uniform_tokens_per_seq(batch)
        n = rounds.num_rounds
        if (q is None or q > MAX_ROUNDS_CATCH_UP
                or not np.array_equal(batch.logits_rows, np.arange(batch.num_tokens))):
            return launch_rounds_stepwise(self, batch, kv_cache, rounds)
        with torch.no_grad(), triton_env.dependent_launch(self.pdl):
            if self.cuda_graphs:
                graphs = self._round_graphs(q, n, kv_cache)
                size = graphs.padded_size(batch.num_seqs) if graphs is not None else None
                if graphs is None or size is None:
                    return launch_rounds_stepwise(self, batch, kv_cache, rounds)
                ids = graphs.run(batch, size, rounds=_sat_out_after(rounds, graphs.rounds))[:, :n + 1]
            elif n:
                ids = self._greedy_rounds(kv_cache, q, *self._rounds_inputs(batch, rounds, kv_cache))
            else:
                return launch_rounds_stepwise(self, batch, kv_cache, rounds)
        return _tokens_future(ids, rounds.slots.T < 0)

    def launch_rounds_after(self, kv_cache: TorchKVCache, after: AfterVerification) -> TokensFuture:
        """The inputs chosen where the verification's argmax lies (``choose_after``), then the
        rounds as ``launch_rounds`` runs them: replayed from its CUDA graph with
        ``cuda_graphs``, else as one function (``_greedy_rounds``); nothing waits for the
        verification. The rule, ``launch_rounds_after_stepwise``, for a verification computed
        elsewhere, a step of more than MAX_ROUNDS_CATCH_UP tokens, and with graphs for no
        rounds or a batch past the largest graph (a graph after the host's wait beats an eager
        step there)."""
        argmax, n, q = after.verification.argmax, after.num_rounds, after.q
        if not isinstance(argmax, Tensor) or argmax.device != self.device or q > MAX_ROUNDS_CATCH_UP:
            return launch_rounds_after_stepwise(self, kv_cache, after)
        with torch.no_grad(), triton_env.dependent_launch(self.pdl):
            graphs = self._round_graphs(q, n, kv_cache) if self.cuda_graphs else None
            size = graphs.padded_size(after.num_seqs) if graphs is not None else None
            if self.cuda_graphs and size is None:
                return launch_rounds_after_stepwise(self, kv_cache, after)
            scratch = kv_cache.scratch_page * kv_cache.page_size
            positions = np.where(after.slots < 0, 0, after.positions)  # rows sitting out: position 0,
            slots = np.where(after.slots < 0, scratch, after.slots)  # the scratch page
            tables = (after.rows, after.guesses, positions, slots)
            flat = _uploaded(np.concatenate([t.reshape(-1) for t in tables]), self.device)  # one copy
            ends = np.cumsum([t.size for t in tables])
            chosen = choose_after(argmax, *(flat[end - t.size:end].view(t.shape) for t, end in zip(tables, ends)), q)
            # The staged batch holds the shapes and page tables; its tokens, positions and slots,
            # and the rounds', are the device's choice.
            rows = after.num_seqs * q
            batch = Batch(token_ids=np.zeros(rows, dtype=np.int64), positions=np.zeros(rows, dtype=np.int64),
                          query_starts=np.arange(after.num_seqs + 1, dtype=np.int64) * q,
                          context_lens=np.ones(after.num_seqs, dtype=np.int64), page_tables=after.page_tables,
                          slot_mapping=np.full(rows, scratch, dtype=np.int64),
                          logits_rows=np.arange(rows, dtype=np.int64))
            if graphs is not None:
                # staged rounds: every sequence computes them (the chosen positions and slots replace them)
                staged = Rounds(np.zeros((n, after.num_seqs), dtype=np.int64), np.full((n, after.num_seqs), scratch))
                ids = graphs.run(batch, size, rounds=_sat_out_after(staged, graphs.rounds), chosen=chosen)[:, :n + 1]
            else:
                tables_on_device = self._step_inputs(batch, kv_cache.page_size).decode_tables
                ids = self._greedy_rounds(kv_cache, q, chosen.tokens, chosen.positions, chosen.slots,
                                          tables_on_device, chosen.round_positions, chosen.round_slots)
            # -1 where the accepted count sits a round out (its slot the scratch page, as staged above)
            ids[:, 1:].masked_fill_((chosen.round_slots == scratch).T, -1)
        return _tokens_future(ids)

    def _rounds_inputs(self, batch: Batch, rounds: Rounds, kv: TorchKVCache) -> tuple[Tensor, ...]:
        """A uniform step and its rounds as device tensors, the way a rounds graph stages them
        (a round a sequence sits out decodes at position 0 into the scratch page)."""
        def tensor(values: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device)

        step = self._step_inputs(batch, kv.page_size)
        positions, slots = rounds.staged(kv.scratch_page * kv.page_size)
        return (step.token_ids, step.positions, step.slots, step.decode_tables, tensor(positions),
                tensor(slots))

    def _greedy_rounds(self, kv: TorchKVCache, q: int, tokens: Tensor, positions: Tensor,
                       slots: Tensor, tables: Tensor, round_positions: Tensor,
                       round_slots: Tensor) -> Tensor:
        """A step of q tokens per sequence, then one round per row of ``round_positions``, each
        sequence fed its argmax of the step before; -> the argmaxes [b, n + 1].

        # tokens, positions, slots: [b q]; tables: [b, W]; round_positions, round_slots: [n, b]
        Each step is ``_forward_step`` and each argmax ``reduce_top``'s, as launch_top has them,
        so the rounds compute what the stepwise rule computes."""
        def step(tokens: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
            logits = self._forward_step(_Step(tokens, positions, slots, decode_tables=tables),
                                        kv)  # [rows, V]
            return reduce_top(logits, 1, self._greedy_reduce)[0]  # [rows]

        argmax = step(tokens, positions, slots).view(-1, q)[:, -1]  # [b]: each sequence's last row
        chosen = [argmax]
        for round_position, round_slot in zip(round_positions, round_slots):
            argmax = step(argmax, round_position, round_slot)
            chosen.append(argmax)
        return torch.stack(chosen, dim=1)  # [b, n + 1]

    def _fed_tokens(self, batch: Batch, feed: Feed) -> Tensor:
        """The batch's tokens [T] as a device tensor, the fed ones read from the source's argmax
        where it lies."""
        argmax = feed.source.argmax
        # a source computed on the host, or on another device (a draft model placed elsewhere)
        if not isinstance(argmax, Tensor) or argmax.device != self.device:
            return torch.from_numpy(feed.host_tokens(batch.token_ids)).to(self.device)
        if (feed.rows >= 0).all():
            return argmax_rows(argmax, feed.rows)
        return fed_among_own(argmax, feed.rows, batch.token_ids)

    @torch.no_grad()
    def _device_logits(self, batch: Batch, kv_cache: TorchKVCache, tokens: Tensor | None = None) -> Tensor:
        """Logits [R, V] left on the device: through a CUDA graph for decode batches if captured.
        ``tokens`` [T] on the device replace the batch's token ids (a Feed)."""
        with triton_env.dependent_launch(self.pdl):
            if batch.num_tokens == batch.num_seqs and self.compile and not self._announced_compile:
                self._announce_compile()
                with progress.task("torch.compile: first decode step"):  # a spinner: one long call
                    return self._graph_or_step(batch, kv_cache, tokens)
            return self._graph_or_step(batch, kv_cache, tokens)

    def _graph_or_step(self, batch: Batch, kv_cache: TorchKVCache, tokens: Tensor | None = None) -> Tensor:
        # Not through _device_logits again: a subclass (a tensor-parallel shard) wraps that one,
        # and must see each step once.
        graphs = self._decode_graphs(batch, kv_cache)
        if graphs is not None:
            size = graphs.padded_size(batch.num_seqs)
            if size is not None:
                return graphs.run(batch, size, tokens)
        step = self._step_inputs(batch, kv_cache.page_size)
        if tokens is not None:
            step = dataclasses.replace(step, token_ids=tokens)
        pieces = self._piece_graphs(batch.num_tokens)
        if pieces is not None:
            return self._forward_pieces(step, kv_cache, pieces)
        return self._forward_step(step, kv_cache)

    def _piece_graphs(self, rows: int) -> PieceGraphs | None:
        """The layers' pieces for a step of ``rows`` tokens that no decode graph replays (a
        prefill, a mixed step, a catch-up on a prompt): with CUDA graphs, unless
        batch_invariant (whose prefill rows take the row kernel) or the step is longer than the
        largest piece size."""
        if not self.cuda_graphs or self.batch_invariant or PieceGraphs.padded_size(rows) is None:
            return None
        if self._pieces is None:
            self._pieces = self._layer_pieces()
        return self._pieces

    def _layer_pieces(self) -> PieceGraphs:
        """Each layer's parts before and after its attention, as the compiled layer functions
        (eager without compile) compute them; captured on CUDA."""
        attention_input, mlp_block, _ = self._decode_fns
        eps, gated, c = self.config.norm_eps, self.config.family == "llama", self.config

        def before(layer: Any) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
            return lambda x, residual: attention_input(x, residual, *layer.attn_norm, *layer.qkv, eps)

        def after(layer: Any) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
            return lambda x, attn: mlp_block(x, attn, *layer.o, *layer.mlp_norm, *layer.mlp_in,
                                             *layer.mlp_out, eps, gated)

        widths = (c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.num_heads * c.head_dim)
        return PieceGraphs([before(layer) for layer in self.w.layers], [after(layer) for layer in self.w.layers],
                           widths, self.dtype, self.device, capture=self.device.type == "cuda")

    def _forward_pieces(self, step: _Step, kv: TorchKVCache, pieces: PieceGraphs) -> Tensor:
        """``_forward_step`` through the layers' pieces: embed eagerly, replay each layer's two
        parts around its attention (eager, on the step's real rows), then the head on the logits
        rows."""
        x, residual = pieces.run(self._embedded(step), lambda layer, qkv: self._attention(layer, qkv, step, kv))
        return self._head(x, residual, step, self._decode_fns[2])

    # ------------------------------------------------------------------ the model

    def _fused_layer_fns(self) -> dict[str, tuple[Callable[..., Any], ...]]:
        """The fused Triton layer functions (decode_products="triton"), by kind: "gemv", the
        matrix-vector kernels for one-row steps; "few", the same functions for steps of a few rows
        (16-bit weights: their few-row program; int8 / int4: a program per row); "rows", the
        batch-invariant row kernel."""
        from tinyinfer.runners import torch_triton_gemv as gemv
        from tinyinfer.runners import torch_triton_rows as rows

        return {"gemv": (gemv.attention_input, gemv.mlp_block, gemv.final_logits),
                "few": (gemv.attention_input, gemv.mlp_block, gemv.final_logits),
                "rows": (rows.attention_input, rows.mlp_block, rows.final_logits)}

    def _layer_fns(self, step: _Step) -> tuple[tuple[Callable[..., Any], ...], Callable[..., Tensor]]:
        """The layer functions a step runs, and its decode attention, where the step is not replayed
        from a graph (with CUDA graphs, a step that no decode graph replays runs the compiled
        functions through the layers' pieces instead: ``_piece_graphs``). Prefill chunks (compute-
        bound, shapes that vary every step) run eager, with the decode rows beside them; decode
        steps (memory-bound, many small kernels) run the compiled functions, or the fused Triton
        products where they apply: one row the matrix-vector kernel, 2..FEW_ROWS rows its few-row
        program, up to FUSED_MAX_ROWS the batch-invariant row kernel; with batch_invariant, every
        step the row kernel, prefill chunks too, whatever its rows, so that a row is computed as it
        is alone (the prefill attention cuts each sequence into its own tiles, and the decode
        attention then splits every context alike). Quantized weights run two rows through the
        products' row axis and have no row kernel: their steps of more than two rows run the
        compiled functions."""
        rows = len(step.token_ids)
        if self.batch_invariant:
            return self._fused["rows"], self._fused_attention
        if step.prefills:
            return self._eager, self.decode_attention
        kind = "gemv" if rows == 1 else "few" if rows <= self.few_rows else "rows"
        if kind in self._fused and rows <= FUSED_MAX_ROWS:
            return self._fused[kind], self._fused_attention
        return self._decode_fns, self.decode_attention

    def _forward_step(self, step: _Step, kv: TorchKVCache) -> Tensor:
        """Embed, run every layer, and return float32 logits for the step's logits rows."""
        fns, attend = self._layer_fns(step)
        attention_input, mlp_block, final_logits = fns
        x = self._embedded(step)
        residual = torch.zeros_like(x)
        eps, gated = self.config.norm_eps, self.config.family == "llama"
        for i, layer in enumerate(self.w.layers):
            x, qkv = attention_input(x, residual, *layer.attn_norm, *layer.qkv, eps)
            attn = self._attention(i, qkv, step, kv, attend)  # [T, H hd]
            x, residual = mlp_block(x, attn, *layer.o, *layer.mlp_norm, *layer.mlp_in,
                                    *layer.mlp_out, eps, gated)
        return self._head(x, residual, step, final_logits)

    def _embedded(self, step: _Step) -> Tensor:
        """The step's tokens embedded (and their positions, GPT-2): [T, D]."""
        x = layers.embedding(self.w.embed, step.token_ids, self.dtype)
        if self.w.pos_embed is not None:
            x = x + self.w.pos_embed[step.positions]
        return x

    def _head(self, x: Tensor, residual: Tensor, step: _Step, final_logits: Callable[..., Tensor]) -> Tensor:
        """The last residual add, norm and LM head on the step's logits rows: float32 [R, V]."""
        if step.logits_rows is not None:
            x, residual = x[step.logits_rows], residual[step.logits_rows]
        return final_logits(x, residual, *self.w.final_norm, self.w.head, self.config.norm_eps)

    def _attention(self, layer: int, qkv: Tensor, step: _Step, kv: TorchKVCache,
                   attend: Callable[..., Tensor] | None = None) -> Tensor:
        """Decode rows attend together through their page tables (``attend``, the runner's
        decode attention unless given); prefill chunks together too."""
        attend = attend or self.decode_attention
        c = self.config
        k_cache, v_cache = kv.k[layer], kv.v[layer]  # [P + 1, S, Hkv, hd]
        scales = kv.layer_scales(layer)  # int8 K/V: k_scale, v_scale [P + 1, S, Hkv]

        def decode(rows: Tensor | None, tables: Tensor) -> Tensor:
            if rows is None:
                return attend(qkv, step.positions, step.slots, tables, k_cache, v_cache,
                              self.cos, self.sin, c.num_heads, **scales)
            return attend(qkv[rows], step.positions[rows], step.slots[rows], tables, k_cache,
                          v_cache, self.cos, self.sin, c.num_heads, **scales)

        if step.prefills is None and not step.decode_groups:
            return decode(None, step.decode_tables)
        rows, prefilled = step.prefill_rows, None
        if step.prefills is not None:
            prefilled = self.prefill_attention(qkv if rows is None else qkv[rows], step.prefills,
                                               k_cache, v_cache, self.cos, self.sin, c.num_heads,
                                               **scales)  # [Tp, H hd]
            if rows is None:  # every row is a prefill chunk's
                return prefilled
        out = qkv.new_empty((qkv.shape[0], c.num_heads * c.head_dim))  # [T, H hd]
        if prefilled is not None:
            out[rows] = prefilled
        for group in step.decode_groups:
            out[group.rows] = decode(group.rows, group.tables)
        return out

    # ------------------------------------------------------------------ inputs

    def _step_inputs(self, batch: Batch, page_size: int) -> _Step:
        """Move a batch to the device and sort its sequences into decodes and prefill chunks.

        Sequences of one new token decode; so do all sequences when each has the same q <=
        MAX_DECODE_TOKENS new tokens (a verification step); the rest are prefill chunks. With
        batch_invariant, every sequence of q <= MAX_DECODE_TOKENS new tokens decodes, whatever
        the others have (one decode launch per q): a short prompt alone has one q and would
        decode, and in a batch of other lengths it would otherwise be a prefill chunk, whose
        attention rounds differently."""
        def tensor(values: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device)

        def tables(seqs: np.ndarray) -> Tensor:  # [len(seqs), W], each row padded past its pages
            width = max(len(batch.page_tables[b]) for b in seqs)
            padded = np.zeros((len(seqs), width), dtype=np.int64)
            for row, b in enumerate(seqs):
                padded[row, :len(batch.page_tables[b])] = batch.page_tables[b]
            return tensor(padded)

        starts = batch.query_starts
        lengths = np.diff(starts)  # [B] new tokens per sequence
        all_rows = np.array_equal(batch.logits_rows, np.arange(batch.num_tokens))
        step = _Step(token_ids=tensor(batch.token_ids), positions=tensor(batch.positions),
                     slots=tensor(batch.slot_mapping), decode_tables=None,
                     logits_rows=None if all_rows else tensor(batch.logits_rows))
        if _uniform_tokens_per_seq(batch) is not None:
            return dataclasses.replace(step, decode_tables=tables(np.arange(batch.num_seqs)))
        decodes = lengths <= MAX_DECODE_TOKENS if self.batch_invariant else lengths == 1
        groups = tuple(_DecodeGroup(rows=tensor((starts[seqs][:, None] + np.arange(q)).ravel()),
                                    tables=tables(seqs))
                       for q in np.unique(lengths[decodes])
                       for seqs in [np.flatnonzero(decodes & (lengths == q))])
        prefilling = np.flatnonzero(~decodes)
        if not len(prefilling):
            return dataclasses.replace(step, decode_groups=groups)
        rows = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in prefilling])  # [Tp]
        return dataclasses.replace(
            step, decode_groups=groups, prefills=self._prefill_chunks(batch, prefilling, rows, page_size, tensor),
            prefill_rows=tensor(rows) if len(rows) < batch.num_tokens else None)

    def _prefill_chunks(self, batch: Batch, seqs: np.ndarray, rows: np.ndarray, page_size: int,
                        tensor: Callable[[np.ndarray], Tensor]) -> PrefillChunks:
        """The batch's sequences `seqs` packed in order (their rows `rows`), as the prefill
        attention reads them; with the Triton kernel, its work list of query tiles too."""
        starts = np.concatenate([[0], np.cumsum(np.diff(batch.query_starts)[seqs])])  # [Bp + 1]
        context_lens = [int(batch.context_lens[b]) for b in seqs]
        page_counts = [math.ceil(n / page_size) for n in context_lens]
        tables = np.zeros((len(seqs), max(page_counts)), dtype=np.int64)  # [Bp, W]
        for row, (b, count) in enumerate(zip(seqs, page_counts)):
            tables[row, :count] = batch.page_tables[b][:count]
        tiles = None
        if self.prefill_attention_kind == "triton":
            from tinyinfer.runners.torch_triton_prefill import query_tiles

            tiles = torch.from_numpy(query_tiles(starts)).to(self.device)
        return PrefillChunks(starts=tuple(int(s) for s in starts), context_lens=tuple(context_lens),
                             positions=tensor(batch.positions[rows]),
                             slots=tensor(batch.slot_mapping[rows]), page_tables=tensor(tables),
                             tiles=tiles)

    # ------------------------------------------------------------------ CUDA graphs

    def _decode_graphs(self, batch: Batch, kv: TorchKVCache) -> DecodeGraphs | None:
        """The cache's graphs for this batch's tokens per sequence, if it can replay one: every
        sequence has the same q new tokens and wants the logits of each."""
        q = _uniform_tokens_per_seq(batch)
        if not self.cuda_graphs or q is None:
            return None
        if not np.array_equal(batch.logits_rows, np.arange(batch.num_tokens)):
            return None
        if kv.graphs is None:
            kv.graphs = {}
        if q not in kv.graphs:
            kv.graphs[q] = DecodeGraphs(
                step=lambda tokens, positions, slots, tables: self._forward_step(
                    _Step(tokens, positions, slots, decode_tables=tables), kv),
                max_batch=self.max_graph_batch, table_width=self._table_width(kv),
                scratch_page=kv.scratch_page, page_size=kv.page_size, device=self.device,
                tokens_per_seq=q)
        return kv.graphs[q]

    def _round_graphs(self, q: int, rounds: int, kv: TorchKVCache) -> DecodeGraphs | None:
        """The cache's graphs of a q-token step followed by ``rounds`` greedy rounds, or by the
        fewest more that it has (the extra rounds run for nobody): a sequence's last steps, whose
        guesses its max_tokens cuts short, replay the graph of its full ones rather than capture
        one of each length. None for no rounds: the step alone replays its decode graph (one
        forward pass, where a rounds graph would run its rounds for nobody)."""
        if rounds == 0:
            return None
        if kv.round_graphs is None:
            kv.round_graphs = {}
        more = [n for p, n in kv.round_graphs if p == q and n >= rounds]
        if more:
            return kv.round_graphs[q, min(more)]
        if (q, rounds) not in kv.round_graphs:
            kv.round_graphs[q, rounds] = DecodeGraphs(
                step=functools.partial(self._greedy_rounds, kv, q),
                max_batch=self.max_graph_batch, table_width=self._table_width(kv),
                scratch_page=kv.scratch_page, page_size=kv.page_size, device=self.device,
                tokens_per_seq=q, rounds=rounds)
        return kv.round_graphs[q, rounds]

    def _table_width(self, kv: TorchKVCache) -> int:
        """Page-table columns a graph stages: a whole context's pages, or the pool's."""
        return min(math.ceil(self.config.max_model_len / kv.page_size), kv.num_pages)

    def _announce_compile(self) -> None:
        self._announced_compile = True
        print("tinyinfer: compiling the decode step's kernels (first decode; "
              "other batch sizes compile once more)", file=sys.stderr, flush=True)


def _uniform_tokens_per_seq(batch: Batch) -> int | None:
    """q when every sequence of the batch has the same q <= MAX_DECODE_TOKENS new tokens."""
    q, rest = divmod(batch.num_tokens, max(batch.num_seqs, 1))
    if rest or not 1 <= q <= MAX_DECODE_TOKENS:
        return None
    return q if np.array_equal(batch.query_starts, np.arange(batch.num_seqs + 1) * q) else None


def _sat_out_after(rounds: Rounds, num_rounds: int) -> Rounds:
    """``rounds`` followed by rounds that every sequence sits out, up to ``num_rounds``."""
    if rounds.num_rounds == num_rounds:
        return rounds
    extra = np.full((num_rounds - rounds.num_rounds, rounds.positions.shape[1]), -1, dtype=np.int64)
    return Rounds(np.concatenate([rounds.positions, extra]), np.concatenate([rounds.slots, extra]))


def _tokens_future(ids: Tensor, sat_out: np.ndarray | None = None) -> TokensFuture:
    """Argmaxes [B, n + 1] for the host, queued behind the rounds (on CUDA copied to pinned host
    memory without waiting, an event marking when they have landed); -1 where ``sat_out``
    [B, n] says a sequence sat a round out (it computed a row, for nobody; None: marked on the
    device already). They stay on the device too, for a Feed (a replayed graph's own output:
    read in stream order before its next replay, which only a later launch queues)."""
    def marked(host: np.ndarray) -> np.ndarray:
        if sat_out is None:
            return host
        host = host.copy()
        host[:, 1:][sat_out] = -1
        return host

    flat = ids.reshape(-1)  # the argmax a Feed reads: row b (n + 1) + r
    if ids.device.type != "cuda":
        return TokensFuture(lambda: marked(ids.numpy()), flat)
    host = ids.to("cpu", non_blocking=True)
    landed = torch.cuda.Event()
    landed.record()

    def wait() -> np.ndarray:
        landed.synchronize()
        return marked(host.numpy())

    return TokensFuture(wait, flat)


def _uploaded(values: np.ndarray, device: torch.device) -> Tensor:
    """Host integers as an int64 tensor on ``device``: through pinned memory on CUDA, so that
    the copy does not wait for the device."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def choose_after(argmax: Tensor, rows: Tensor, guesses: Tensor, positions: Tensor, slots: Tensor,
                 q: int) -> ChosenInputs:
    """``AfterVerification.chosen`` on the device, without reading the verification: each
    sequence's accepted count a from the verification's argmax [R] at its rows [B, k + 1] and
    its guesses [B, k] (-1: none), then its step's tokens (the verified tokens a - q + 1 .. a),
    positions and slots [B q] and its rounds' positions and slots [n, B] from the tables
    [B, k + 1, q + n] at a. A row that sits out reads token 0 (its position and slot staged by
    the caller: position 0, the scratch page)."""
    verified = argmax[rows.clamp(min=0)]  # [B, k + 1]
    same = (verified[:, :-1] == guesses) & (guesses >= 0)
    accepted = same.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    seqs = torch.arange(rows.shape[0], device=rows.device)
    step_rows = accepted[:, None] - q + 1 + torch.arange(q, device=rows.device)  # [B, q]
    tokens = verified.gather(1, step_rows.clamp(min=0)).masked_fill(step_rows < 0, 0)
    at_positions, at_slots = positions[seqs, accepted], slots[seqs, accepted]  # [B, q + n]
    return ChosenInputs(tokens.reshape(-1), at_positions[:, :q].reshape(-1), at_slots[:, :q].reshape(-1),
                        at_positions[:, q:].T, at_slots[:, q:].T)


def argmax_rows(argmax: Tensor, rows: np.ndarray) -> Tensor:
    """Rows ``rows`` [T] of a launch's argmax [R], on its device (a Feed's tokens)."""
    if np.array_equal(rows, np.arange(len(rows))):
        return argmax[:len(rows)]
    return argmax.index_select(0, _uploaded(rows, argmax.device))


def fed_among_own(argmax: Tensor, rows: np.ndarray, own: np.ndarray) -> Tensor:
    """Tokens [T] on argmax's device: row ``rows[i]`` of a launch's argmax, or the batch's own
    token ``own[i]`` where ``rows[i]`` is -1 (a verification: the last token the host knows, the
    guesses the draft's rounds left on the device). Both go over in one copy."""
    own_ids, fed_rows = _uploaded(np.stack([own, rows]), argmax.device)  # [T] each
    return torch.where(fed_rows >= 0, argmax[fed_rows.clamp(min=0)], own_ids)


def reduce_top(logits: Tensor, k: int, reduce: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
               ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Each row's argmax [R] and what the host reads of logits [R, V] for top k, on the device:
    greedy_reduce's pack [R, 3] for k = 1, else (ids, values, log-sum-exp). ``reduce`` is
    greedy_reduce, or a runner's compiled copy of it. (Tensor-parallel ranks all run it on the
    same gathered logits, so each holds the argmax rank 0 reads.)"""
    reduce = reduce or greedy_reduce
    logits = logits.float()
    if k == 1:  # greedy without logprobs: one fused reduction, one copy to the host
        argmax, packed = reduce(logits)  # [R], [R, 3]
        return argmax, (packed,)
    values, ids = torch.topk(logits, k, dim=-1)  # [R, k]
    return ids[:, 0], (ids, values, torch.logsumexp(logits, dim=-1))


def top_future(logits: Tensor, k: int, start: Any = None,
               reduce: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None) -> TopFuture:
    """The top k ids and values of each row of logits [R, V], and its log-sum-exp, for the host,
    queued behind the step: on CUDA they are copied to
    pinned host memory without waiting, and an event marks when they have landed (``start``, an
    event recorded before the step, times the step on the device). ``reduce`` as reduce_top's."""
    argmax, parts = reduce_top(logits, k, reduce)
    if logits.device.type != "cuda":
        top = _unpack_top([t.numpy() for t in parts])
        return TopFuture(argmax, lambda: top)
    host = [t.to("cpu", non_blocking=True) for t in parts]
    landed = torch.cuda.Event(enable_timing=start is not None)
    landed.record()

    def wait() -> TopLogits:
        landed.synchronize()
        return _unpack_top([t.numpy() for t in host])

    seconds = (lambda: start.elapsed_time(landed) / 1e3) if start is not None else (lambda: None)
    return TopFuture(argmax, wait, seconds)


def greedy_reduce(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's argmax [R] (the lowest id on ties, as the reference picks), and (max, argmax,
    log-sum-exp) [R, 3] in float64 (ids exact) for one copy to the host. A max is far cheaper
    than a top-k selection over a large vocabulary; compiled, it is two fused passes."""
    values, ids = logits.max(dim=-1)
    lse = values + torch.log(torch.exp(logits - values[:, None]).sum(dim=-1))
    return ids, torch.stack([values.double(), ids.double(), lse.double()], dim=1)


def _unpack_top(host: list[np.ndarray]) -> TopLogits:
    """TopLogits from what top_future copied: (ids, values, log-sum-exp), or greedy_reduce's pack."""
    if len(host) == 3:
        return TopLogits(*host)
    packed = host[0]  # [R, 3]
    return TopLogits(packed[:, 1:2].astype(np.int64), packed[:, 0:1].astype(np.float32),
                     packed[:, 2].astype(np.float32))


def _timing_event(device: torch.device) -> Any:
    """A CUDA event recorded now on the current stream (None off CUDA): a step's start."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _triton_max_splits() -> int:
    """The decode attention kernel's most context splits (Triton installed)."""
    from tinyinfer.runners import torch_triton

    return torch_triton.MAX_SPLITS


def _triton_decode_attention() -> Callable[..., Tensor] | None:
    """The Triton paged-decode kernel, or None where Triton is not installed or too old for it
    (an ImportError from tinyinfer's own modules is an error, not the slower path)."""
    try:
        from tinyinfer.runners import torch_triton
    except ImportError as missing:
        if not (missing.name or "").startswith("triton"):
            raise
        return None
    return torch_triton.paged_decode_attention


def _triton_prefill_attention() -> Callable[..., Tensor]:
    """The Triton prefill kernel (only asked for where the decode kernel imported)."""
    from tinyinfer.runners import torch_triton_prefill

    return torch_triton_prefill.paged_prefill_attention


def _rope_tables(config: ModelConfig, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin of every (position, frequency) angle, computed in float64, kept in float32.

    -> two [max_model_len, hd/2] tables, indexed by position.
    """
    inv_freq = np.asarray(rope_inverse_frequencies(config), dtype=np.float64)
    angles = np.arange(config.max_model_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    as_table = lambda a: torch.from_numpy(a.astype(np.float32)).to(device)  # noqa: E731
    return as_table(np.cos(angles)), as_table(np.sin(angles))
