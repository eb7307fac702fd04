"""Tensor parallelism (Megatron style): one rank's shard of the model and its collectives.

Every rank runs the same forward pass on its own slice of the weights:

* attention: q/k/v are column-parallel — rank r owns query heads ``[r H/N, (r+1) H/N)`` and
  the KV heads they read, ``[r Hkv/N, (r+1) Hkv/N)`` — so attention needs no communication
  and each rank stores only its KV heads in every page. The output projection is row-parallel
  (rank r owns the input columns of its heads); each rank's product is a partial sum, and one
  all-reduce adds them into the full [T, D] output.
* MLP: gate/up (or GPT-2's fc) column-parallel over the intermediate size F, down (proj)
  row-parallel, one all-reduce after it.
* embedding and LM head: vocabulary-parallel. Rank r owns vocabulary rows ``[r Vs, (r+1) Vs)``
  (Vs = ceil(V / N), the last shard padded); a token outside the shard embeds to zeros and an
  all-reduce assembles the embedding; each rank computes logits for its own vocabulary slice,
  and an all-gather puts the slices side by side on every rank.

Biases of row-parallel layers (o, down / proj) live on rank 0 only, so the all-reduce adds
them once. Norms and GPT-2's position table are small and replicated.

The all-reduces go through NCCL, or (``all_reduce="symm_mem"``, CUDA) through torch's symmetric memory: each rank copies its partial sum into a buffer every peer can read over
NVLink and one kernel reads and adds them all ("one-shot"), with no NVLink multicast. Messages
of a decode step are a few KB, where NCCL's fixed cost per call dominates. ``all_reduce="push"``
sends the small ones through ``push_all_reduce`` instead (each rank writes its part into every
peer's buffer, no barrier: one trip across the link) and the rest as "symm_mem" does. "auto",
the default, takes push where every GPU of the split can read every other's memory, else NCCL
(gloo on CPU).

A rank's shard is itself a smaller model — H/N heads, Hkv/N KV heads, F/N intermediate size —
so it runs on ``TorchRunner``'s weights, KV pages and attention, with the all-reduces put
between its layers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from tinyinfer.config import ModelConfig
from tinyinfer.errors import TinyInferError
from tinyinfer.runners import torch_layers as layers
from tinyinfer.runners import triton_env
from tinyinfer.runners.runner import (
    ALL_REDUCES,
    AfterVerification,
    Batch,
    RankShare,
    RankTiming,
    Rounds,
    RunnerInfo,
    TokensFuture,
    launch_rounds_after_stepwise,
    launch_rounds_stepwise,
)
from tinyinfer.runners.torch_fast import TorchKVCache, TorchRunner, _Step, reduce_top
from tinyinfer.runners.torch_graphs import DecodeGraphs
from tinyinfer.runners.torch_pieces import PieceGraphs
from tinyinfer.runners.torch_weights import random_weights
from tinyinfer.weights import Bf16Array

if TYPE_CHECKING:
    from tinyinfer.runners.tp.push_all_reduce import PushAllReduce

WeightArray = np.ndarray | Bf16Array | Tensor

# torch 2.13 renamed all_gather_into_tensor; older releases (2.11, ...) have only that name
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
# Messages up to 4 MB (a 512-token prefill chunk of a 4096-wide model) take the one-shot kernel:
# through NCCL a 128-token prefill's all-reduces cost ~160 us of host time each, and prefill is
# host-bound; larger messages (long prefill chunks) go through NCCL, bandwidth-optimal there.
SYMM_MEM_MAX_BYTES = 4 << 20


def pick_all_reduce(choice: str, device_type: str, gpus: list[int] | None) -> str:
    """"nccl", "symm_mem" or "push" for ``choice``; "auto" (the default) takes push where the
    ranks' GPUs (all on this host: ``gpus``; None when they span hosts) can all read each other's
    memory (symm_mem there without Triton), else nccl (gloo on CPU). Raises TinyInferError for a
    choice this machine cannot run."""
    if choice not in ALL_REDUCES:
        raise TinyInferError(f"all_reduce must be one of {ALL_REDUCES}, got {choice!r}")
    if choice in ("symm_mem", "push") and device_type != "cuda":
        raise TinyInferError(f"all_reduce={choice!r} reads peers' GPU memory: it needs CUDA "
                             "(use all_reduce='nccl', or gloo's default on CPU)")
    if choice == "push" and not triton_env.installed():
        raise TinyInferError("all_reduce='push' is a Triton kernel: install triton, or use "
                             "all_reduce='symm_mem'")
    if choice != "auto":
        return choice
    peers = (device_type == "cuda" and gpus is not None and len(gpus) > 1
             and all(torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b))
    if not peers:
        return "nccl"
    return "push" if triton_env.installed() else "symm_mem"  # push is a Triton kernel


def check_tensor_parallel(config: ModelConfig, world: int, device_type: str, gpu_count: int) -> None:
    """Raise TinyInferError unless ``world`` ranks can split this model on this machine."""
    if not isinstance(world, int) or world < 1:
        raise TinyInferError(f"tensor_parallel must be a positive integer, got {world}")
    shares = (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads),
              ("MLP intermediate size", config.intermediate_size))
    for what, count in shares:
        if count % world:
            fits = [n for n in range(1, config.num_kv_heads + 1)
                    if all(c % n == 0 for _, c in shares)]
            raise TinyInferError(
                f"tensor_parallel={world} does not divide the model's {count} {what}: each rank "
                f"must own a whole share; this model splits over {_either(fits)} ranks")
    if device_type == "cuda" and world > gpu_count:
        raise TinyInferError(
            f"tensor_parallel={world} needs {world} GPUs (one per rank) but this machine has "
            f"{gpu_count}: lower tensor_parallel to at most {gpu_count}")


def _either(sizes: list[int]) -> str:
    """'1, 2 or 4'."""
    return ", ".join(map(str, sizes[:-1])) + f" or {sizes[-1]}" if len(sizes) > 1 else str(sizes[0])


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shape of one rank's shard: a model with 1/N of the heads, KV heads and MLP width."""
    return dataclasses.replace(config, num_heads=config.num_heads // world,
                               num_kv_heads=config.num_kv_heads // world,
                               intermediate_size=config.intermediate_size // world)


@dataclass(frozen=True)
class VocabShard:
    """Which vocabulary rows a rank owns: ``[start, start + rows)``, the first ``valid`` real."""

    start: int
    rows: int  # ceil(V / N), the same on every rank so the gathered slices stack
    valid: int  # rows that are real tokens (the last shard may be padding past V)

    @classmethod
    def of(cls, vocab_size: int, rank: int, world: int) -> VocabShard:
        rows = math.ceil(vocab_size / world)
        start = rank * rows
        return cls(start, rows, max(0, min(rows, vocab_size - start)))


def rank_shares(config: ModelConfig, world: int) -> tuple[RankShare, ...]:
    """Which heads, KV heads, MLP units and vocabulary rows each of ``world`` ranks owns."""
    def span(size: int, rank: int) -> tuple[int, int]:
        part = _part(size, rank, world)
        return part.start, part.stop

    shares = []
    for rank in range(world):
        vocab = VocabShard.of(config.vocab_size, rank, world)
        start = min(vocab.start, config.vocab_size)
        shares.append(RankShare(rank, span(config.num_heads, rank), span(config.num_kv_heads, rank),
                                span(config.intermediate_size, rank), (start, start + vocab.valid)))
    return tuple(shares)


def shard_weights(config: ModelConfig, weights: Mapping[str, WeightArray], rank: int,
                  world: int) -> dict[str, WeightArray]:
    """Cut the reference-named weights down to rank ``rank``'s shard (slices, not copies)."""
    c, hd = config, config.head_dim
    q_rows = _part(c.num_heads * hd, rank, world)
    kv_rows = _part(c.num_kv_heads * hd, rank, world)
    f_rows = _part(c.intermediate_size, rank, world)
    columns = {"q": q_rows, "k": kv_rows, "v": kv_rows, "gate": f_rows, "up": f_rows, "fc": f_rows}
    rows = {"o": q_rows, "down": f_rows, "proj": f_rows}
    vocab = VocabShard.of(c.vocab_size, rank, world)
    out: dict[str, WeightArray] = {}
    for name, value in weights.items():
        if not isinstance(value, (np.ndarray, Bf16Array, Tensor)):
            raise TinyInferError(f"weight {name} is a {type(value).__name__}: tensor parallelism "
                                 "shards float weights only; load without quantize=")
        placement = _placement(name)
        if placement == "vocab":
            out[name] = _pad_rows(value[vocab.start:vocab.start + vocab.valid], vocab.rows)
        elif placement == "column":  # output rows: weight [out, in] and bias [out]
            out[name] = value[columns[name.split(".")[2]]]
        elif placement == "row":  # input columns of weight [out, in]
            out[name] = value[:, rows[name.split(".")[2]]]
        elif placement == "replicated" or rank == 0:
            out[name] = value  # a row-parallel bias only on rank 0: the all-reduce adds it once
    return out


def _placement(name: str) -> str:
    """How a reference-named weight is split: vocab, column, row, row_bias or replicated."""
    if name in ("embed", "lm_head"):
        return "vocab"
    parts = name.split(".")  # "embed", "final_norm.weight", "layers.3.q.bias", ...
    if parts[0] != "layers":
        return "replicated"  # final norm, GPT-2 positions
    if parts[2] in ("q", "k", "v", "gate", "up", "fc"):
        return "column"
    if parts[2] in ("o", "down", "proj"):
        return "row" if parts[3] == "weight" else "row_bias"
    return "replicated"  # the blocks' norms


def random_shard_weights(config: ModelConfig, rank: int, world: int, device: str,
                         dtype: str | None, seed: int = 0) -> dict[str, Tensor]:
    """Random weights of rank ``rank``'s shard only, made on its device (benchmark shapes).

    A model too big for one device never exists whole: every rank draws its own shard.
    Replicated weights (norms, GPT-2 positions) are drawn from one seed on every rank, so
    the copies agree; the model is a different random model for each ``world``.
    """
    local = dataclasses.replace(shard_config(config, world),
                                vocab_size=VocabShard.of(config.vocab_size, rank, world).rows)
    weights = random_weights(local, device, dtype, seed=seed + 1 + rank)
    common = torch.Generator(device=device).manual_seed(seed)
    for name in sorted(weights):
        placement = _placement(name)
        if placement == "row_bias" and rank:
            del weights[name]
        elif placement == "replicated" and not name.endswith("norm.weight"):
            w = weights[name]
            weights[name] = (torch.randn(w.shape, generator=common, device=w.device) * 0.02).to(w.dtype)
    return weights


def _part(size: int, rank: int, world: int) -> slice:
    share = size // world
    return slice(rank * share, (rank + 1) * share)


def _pad_rows(value: WeightArray, rows: int) -> WeightArray:
    """Zero rows appended so every rank's vocabulary shard has the same height."""
    missing = rows - value.shape[0]
    if missing == 0:
        return value
    if isinstance(value, Bf16Array):
        return Bf16Array(_pad_rows(value.bits, rows))  # zero bits are +0.0 in bf16
    if isinstance(value, Tensor):
        return torch.cat([value, value.new_zeros((missing, *value.shape[1:]))])
    return np.concatenate([value, np.zeros((missing, *value.shape[1:]), dtype=value.dtype)])


def mlp_after_attention(x: Tensor, attn_out: Tensor, norm_w: Tensor, norm_b: Tensor | None,
                        in_w: Tensor, in_b: Tensor | None, out_w: Tensor, out_b: Tensor | None,
                        eps: float, gated: bool) -> tuple[Tensor, Tensor]:
    """``torch_layers.mlp_block`` after its output projection, which TP must all-reduce first.

    attn_out: [T, D], already summed over ranks. -> (x [T, D], this rank's partial MLP output [T, D]).
    """
    x = x + attn_out
    h = layers.linear(layers.norm(x, norm_w, norm_b, eps), in_w, in_b)  # [T, F/N]
    if gated:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h, approximate="tanh")
    return x, layers.linear(h, out_w, out_b)


class _CommClock:
    """Times collectives: CUDA events on a GPU (no extra synchronisation), perf_counter on CPU.

    Inside a CUDA graph capture the events are "external": they become event-record nodes of
    the graph, so every replay records them again and the same spans time the replayed step.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.enabled = enabled  # off: collectives are only counted (no events, no clock reads)
        self.spans: dict[str, list[Any]] = _no_spans()
        self.captured: dict[str, list[Any]] = _no_spans()  # recorded while a graph is captured

    def reset(self, replayed: dict[str, list[Any]] | None = None) -> None:
        """Start a step: no spans yet, or the spans a replayed graph recorded again."""
        self.spans = _no_spans()
        for kind, spans in (replayed or {}).items():
            self.spans[kind].extend(spans)

    def take_captured(self) -> dict[str, list[Any]]:
        """The spans a graph capture just recorded (they time each replay of that graph)."""
        captured, self.captured = self.captured, _no_spans()
        return captured

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Time what runs inside (or only count it, when disabled)."""
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        spans = (self.captured if capturing else self.spans)[kind]
        if not self.enabled:
            yield
            spans.append(None)
        elif self.cuda:
            # external=: event-record nodes in a captured graph (only passed while capturing,
            # so eager steps also run on torch releases that lack the argument)
            start, end = (torch.cuda.Event(enable_timing=True, **({"external": True} if capturing else {}))
                          for _ in range(2))
            start.record()
            yield
            end.record()
            spans.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            spans.append(time.perf_counter() - t0)

    def run(self, kind: str, collective: Any, *args: Any, **kwargs: Any) -> None:
        with self.span(kind):
            collective(*args, **kwargs)

    def seconds(self, kind: str) -> float:
        """Total time of one kind of span; call after the step's results reached the host."""
        if not self.enabled:
            return 0.0
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in self.spans[kind]) / 1e3
        return float(sum(self.spans[kind]))


def _graph_events_supported() -> bool:
    """Whether this torch can record timing events as nodes of a CUDA graph."""
    return "external" in inspect.signature(torch.cuda.Event).parameters


def _no_spans() -> dict[str, list[Any]]:
    return {"all_reduce": [], "gather": [], "forward": []}


class ShardRunner(TorchRunner):
    """One rank's slice of the model: TorchRunner on a shard config, with all-reduces between layers.

    ``weights`` are the whole model's (cut here), or this rank's shard already when ``presharded``.
    ``time_collectives=True`` times every collective (CUDA events, recorded into the decode
    graphs too) and the forward pass; by default they are only counted and the step's time is
    reported as compute. ``all_reduce`` is "nccl", "symm_mem" or "push" (see the module doc; the launcher
    resolves "auto").

    Decode steps replay CUDA graphs as on one GPU: the all-reduces and the logits all-gather
    are captured with the layers, and every rank captures the same step at the same moment,
    because every rank runs the same commands in the same order. Decode steps run the fused
    Triton products where one GPU would (``decode_products``, "auto" by default): the
    residual add and norm after each all-reduce become the next product's prologue.

    Every rank ends a step with the whole vocabulary's logits [R, V] (``launch_logits``; rank 0
    reduces them through TorchRunner's ``launch_top``). Call ``connect()`` on every rank once
    ``torch.distributed`` is initialised, then use the shards in the same order on all ranks.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, WeightArray], rank: int,
                 world: int, device: str | None = None, dtype: str | None = None,
                 compile: bool | None = None, presharded: bool = False,
                 time_collectives: bool = False, all_reduce: str = "nccl", **options: Any):
        shard = weights if presharded else shard_weights(config, weights, rank, world)
        super().__init__(shard_config(config, world), shard, device=device, dtype=dtype,
                         compile=compile, **options)
        self.full_config = config
        self.rank, self.world = rank, world
        self.vocab = VocabShard.of(config.vocab_size, rank, world)
        if all_reduce not in ALL_REDUCES[1:]:
            raise TinyInferError(f"a shard's all_reduce is one of {ALL_REDUCES[1:]}, got {all_reduce!r}")
        self.all_reduce_kind = all_reduce
        if self.cuda_graphs and time_collectives and not _graph_events_supported():
            raise TinyInferError(f"torch {torch.__version__} cannot time collectives inside CUDA "
                                 "graphs (torch.cuda.Event has no external=): upgrade torch, or "
                                 "pass time_collectives=False or cuda_graphs=False")
        self.clock = _CommClock(self.device, time_collectives)
        # A layer's functions: attention input (residual add, norm, q|k|v), the o product (a
        # partial sum, all-reduced next), the MLP after the all-reduce, the head. The o product
        # stays eager on the torch path (one cuBLAS call); decode steps take the fused Triton
        # products where TorchRunner chose them (decode_products; _fused_layer_fns below).
        eager = (layers.attention_input, mlp_after_attention, layers.final_logits)
        compiled = tuple(torch.compile(f) for f in eager) if self.compile else eager
        self._eager = (eager[0], layers.linear, *eager[1:])
        self._decode_fns = (compiled[0], layers.linear, *compiled[1:])
        self._graph_sets: weakref.WeakSet[DecodeGraphs] = weakref.WeakSet()
        self._symm: list[Tensor] = []  # two symmetric buffers, used in turn (symm_mem, push)
        self._symm_turn = 0
        self._push: PushAllReduce | None = None  # small messages (push)
        self._group_name = ""

    def describe(self) -> dict[str, Any]:
        """TorchRunner's choices, plus the all-reduce and whether collectives are timed."""
        return {**super().describe(), "all_reduce": self.all_reduce_kind,
                "time_collectives": self.clock.enabled}

    def _fused_layer_fns(self) -> dict[str, tuple[Callable[..., Any], ...]]:
        """TorchRunner's fused layer functions in a shard's shape: the o and down products end in
        an all-reduce, so they run plain, and the residual add after each all-reduce becomes the
        next product's prologue."""
        from tinyinfer.runners import torch_triton_gemv as gemv
        from tinyinfer.runners import torch_triton_rows as rows

        return {"gemv": (gemv.attention_input, gemv.gemv, gemv.mlp_after_attention, gemv.final_logits),
                "few": (gemv.attention_input, gemv.gemv, gemv.mlp_after_attention, gemv.final_logits),
                "rows": (rows.attention_input, rows.rows_product, rows.mlp_after_attention,
                         rows.final_logits)}

    def connect(self) -> None:
        """Set up this rank's side of the collectives (every rank, once the group exists)."""
        if self.all_reduce_kind == "nccl" or self.world == 1:
            return
        from torch.distributed import _symmetric_memory as symm_mem

        group = dist.group.WORLD
        assert group is not None
        self._group_name = group.group_name
        # Two buffers in turn: a rank writes buffer b only after every peer entered the
        # all-reduce that used the other one, so after each finished reading b last time.
        numel = SYMM_MEM_MAX_BYTES // self.dtype.itemsize
        for _ in range(2):
            buffer = symm_mem.empty(numel, dtype=self.dtype, device=self.device)
            symm_mem.rendezvous(buffer, self._group_name)
            self._symm.append(buffer)
        if self.all_reduce_kind == "push":
            from tinyinfer.runners.tp.push_all_reduce import PushAllReduce  # imports Triton: CUDA only

            self._push = PushAllReduce.in_symmetric_memory(self._group_name, self.rank, self.world,
                                                           self.dtype, self.device)

    @property
    def info(self) -> RunnerInfo:
        """TorchRunner's, plus how the whole model is split over the ranks."""
        return dataclasses.replace(super().info, tensor_parallel=self.world,
                                   rank_shares=rank_shares(self.full_config, self.world))

    def _decode_graphs(self, batch: Batch, kv: TorchKVCache) -> DecodeGraphs | None:
        """TorchRunner's, remembered so that ``release_graphs`` finds every one still alive."""
        graphs = super()._decode_graphs(batch, kv)
        if graphs is not None:
            self._graph_sets.add(graphs)
        return graphs

    def _piece_graphs(self, rows: int) -> PieceGraphs | None:
        """None: a shard's layers end in collectives, which TorchRunner's pieces do not hold, so
        steps that no decode graph replays run as they are."""
        return None

    def launch_rounds(self, batch: Batch, kv: TorchKVCache, rounds: Rounds) -> TokensFuture:
        """One launch per round, not TorchRunner's rounds in one graph, whose collectives the
        other ranks would not join (each of their rounds is a command of its own). The
        tensor-parallel runner sends a ``launch_top`` per round and never calls this: it keeps
        a shard from inheriting the one-graph version."""
        return launch_rounds_stepwise(self, batch, kv, rounds)

    def launch_rounds_after(self, kv: TorchKVCache, after: AfterVerification) -> TokensFuture:
        """The rule, for the same reason as ``launch_rounds``."""
        return launch_rounds_after_stepwise(self, kv, after)

    def release_graphs(self) -> None:
        """Free every decode graph of this shard, before its communicators are torn down:
        NCCL cannot destroy a communicator under live graphs that captured its collectives
        (a dropped cache's graphs may wait in a reference cycle for the garbage collector)."""
        for graphs in list(self._graph_sets):
            graphs.release()
        if self.device.type == "cuda":  # no queued kernel reads or (push: a peer's) writes them
            torch.cuda.synchronize(self.device)
        self._symm.clear()
        self._push = None

    def _device_logits(self, batch: Batch, kv: TorchKVCache, tokens: Tensor | None = None) -> Tensor:
        """TorchRunner's step; a replayed graph's collectives are timed by the spans it captured."""
        self.clock.reset()
        graphs = self._decode_graphs(batch, kv)
        size = graphs.padded_size(batch.num_seqs) if graphs is not None else None
        if graphs is None or size is None:
            return super()._device_logits(batch, kv, tokens)
        new = size not in graphs.graphs
        logits = super()._device_logits(batch, kv, tokens)
        if new:
            graphs.timers[size] = self.clock.take_captured()
        self.clock.reset(graphs.timers[size])
        return logits

    def _all_reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's [T, D] partial result (in place through NCCL)."""
        if self.world == 1:
            return x
        with self.clock.span("all_reduce"):
            if self._push is not None and self._push.fits(x):
                return self._push(x)
            if self._symm and x.dtype == self.dtype and x.numel() * x.element_size() <= SYMM_MEM_MAX_BYTES:
                buffer = self._symm[self._symm_turn][:x.numel()].view(x.shape)
                self._symm_turn ^= 1
                out = torch.empty_like(x)
                torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, x.contiguous(), "sum",
                                                                self._group_name, out)
                return out
            dist.all_reduce(x)
        return x

    def _embed(self, token_ids: Tensor) -> Tensor:
        """Vocabulary-parallel lookup: own rows, zeros elsewhere, summed over ranks.  -> [T, D]."""
        local = token_ids - self.vocab.start
        mine = (local >= 0) & (local < self.vocab.valid)
        x = self.w.embed[local.clamp(0, self.vocab.rows - 1)] * mine[:, None].to(self.dtype)
        return self._all_reduce(x)

    def _forward_step(self, step: _Step, kv: TorchKVCache) -> Tensor:
        """Embed, run every layer with its two all-reduces, gather the vocabulary slices;
        -> float32 logits of the whole vocabulary [R, V], on every rank."""
        with self.clock.span("forward"):
            return self._all_gather_vocab(self._layers(step, kv))

    def _layers(self, step: _Step, kv: TorchKVCache) -> Tensor:
        (attention_input, o_product, mlp_rest, final_logits), attend = self._layer_fns(step)
        w = self.w
        x = self._embed(step.token_ids)  # [T, D]
        if w.pos_embed is not None:
            x = x + w.pos_embed[step.positions]
        residual = torch.zeros_like(x)
        eps, gated = self.config.norm_eps, self.config.family == "llama"
        for i, layer in enumerate(w.layers):
            x, qkv = attention_input(x, residual, *layer.attn_norm, *layer.qkv, eps)  # [T, (H + 2 Hkv) hd / N]
            attn = self._attention(i, qkv, step, kv, attend)  # [T, H hd / N]: this rank's heads
            attn_out = self._all_reduce(o_product(attn, *layer.o))  # row-parallel o -> [T, D]
            x, partial = mlp_rest(x, attn_out, *layer.mlp_norm, *layer.mlp_in, *layer.mlp_out, eps, gated)
            residual = self._all_reduce(partial)  # row-parallel down -> [T, D]
        if step.logits_rows is not None:
            x, residual = x[step.logits_rows], residual[step.logits_rows]
        return final_logits(x, residual, *w.final_norm, w.head, eps)  # [R, Vs]

    def _all_gather_vocab(self, local: Tensor) -> Tensor:
        """Every rank's vocabulary slice side by side, on every rank.  [R, Vs] -> [R, V]."""
        if self.world == 1:
            return local
        rows = local.shape[0]
        parts = local.new_empty((self.world * rows, local.shape[1]))  # rank r's slice at rows r R..
        with self.clock.span("gather"):
            _all_gather(parts, local.contiguous())
        # [N, R, Vs] -> [R, N Vs]; the last slice's padding rows fall past V
        whole = parts.view(self.world, rows, -1).permute(1, 0, 2).reshape(rows, -1)
        return whole[:, :self.full_config.vocab_size]

    def launch_logits(self, batch: Batch, kv: TorchKVCache, tokens: Tensor | None = None) -> Tensor:
        """Queue every rank's part of one step (``tokens`` [T] on the device replace the batch's
        token ids); -> float32 logits of the whole vocabulary [R, V], on every rank."""
        return self._device_logits(batch, kv, tokens)

    def captures_graph(self, batch: Batch, kv: TorchKVCache) -> bool:
        """Whether this step would capture a new CUDA graph (rather than replay or run eagerly)."""
        graphs = self._decode_graphs(batch, kv)
        size = graphs.padded_size(batch.num_seqs) if graphs is not None else None
        return graphs is not None and size is not None and size not in graphs.graphs

    def top_argmax(self, logits: Tensor, k: int) -> Tensor:
        """Each row's argmax [R] by the reduction rank 0's ``launch_top`` runs for top k: every
        rank holds the same gathered logits, so a worker's argmax is the token rank 0 reads."""
        return reduce_top(logits, k, self._greedy_reduce)[0]

    def finish_timing(self, started: float) -> Callable[[], RankTiming]:
        """For the step just launched (at ``started``, perf_counter): call once it has finished
        on the device, for its RankTiming. Counts are taken now (the next launch resets them);
        timed spans, which a replayed graph records again, are read on the call — so with
        ``time_collectives`` call it before the next step."""
        if self.clock.enabled:
            return lambda: self._timing(time.perf_counter() - started)
        counted = self._timing(0.0)
        return lambda: dataclasses.replace(counted, compute_s=time.perf_counter() - started)

    def _timing(self, total: float) -> RankTiming:
        reduce_s, gather_s = self.clock.seconds("all_reduce"), self.clock.seconds("gather")
        return RankTiming(self.rank, max(0.0, total - reduce_s - gather_s), reduce_s, gather_s,
                          len(self.clock.spans["all_reduce"]), self.clock.seconds("forward"))
