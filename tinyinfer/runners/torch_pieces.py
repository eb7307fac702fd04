"""CUDA graphs of a step's layers between its attentions: the steps no decode graph holds.

A decode step replays one CUDA graph (``torch_graphs``). A prefill chunk, a step that mixes
prefill chunks with decoding rows, or a draft model's catch-up on a prompt cannot: how its
attention runs depends on how many tokens each sequence brings, which changes every step.
Launched kernel by kernel from Python, such a step of a short prompt costs the host far more
than the device (an H100's host: 10 ms for the 8B shape's 16-token prompt, 24 ms for a 1B int4
draft's catch-up on 17 tokens; the device is done in a fraction of that).

The layers between two attentions, though, treat every row alike: a residual add, a norm, the
products, an activation. So, as vLLM's piecewise graphs do, each layer is cut at its attention:
the part before it (residual add, norm, q|k|v product) and the part after (o product, residual
add, norm, MLP) are captured once per padded token count (16, 32, ... 512), each reading and
writing fixed buffers. A step copies its embedded tokens in, pads the rows with zeros and, per
layer, replays the part before, runs the attention eagerly on its real rows (through the page
tables, exactly as without graphs), copies the result in and replays the part after. Padding
rows compute values no real row reads: every operation of a piece works row by row.

Without capture (the CPU, where CI runs) the pieces run as plain calls on the same buffers, so
the padding and the buffers' flow are checked there against the reference.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch
from torch import Tensor

from tinyinfer.runners.torch_graphs import collection_paused

# Padded token counts with captured pieces; finer steps past 128 tokens, where the products'
# work (not the host) starts to set the step's time and padding would add to it.
PIECE_TOKEN_SIZES = (16, 32, 64, 128, 192, 256, 384, 512)

# before(x, residual) -> (x + residual, qkv); after(x, attn) -> (x, the MLP's output)
Before = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
After = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class PieceGraphs:
    """Each layer's part before and after its attention, captured per padded token count.

    ``before[i]`` and ``after[i]`` are layer i's functions on [T, ...] rows; ``widths`` are
    (hidden size, q|k|v width, attention output width). The buffers hold the most rows of any
    size, each size a view of their first rows, so all sizes share them (and one memory pool).
    """

    def __init__(self, before: Sequence[Before], after: Sequence[After], widths: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device, capture: bool):
        self.before, self.after = list(before), list(after)
        self.capture = capture
        most = PIECE_TOKEN_SIZES[-1]
        hidden, qkv, attn = widths
        self.x = torch.zeros(most, hidden, dtype=dtype, device=device)
        self.residual = torch.zeros(most, hidden, dtype=dtype, device=device)
        self.qkv = torch.zeros(most, qkv, dtype=dtype, device=device)
        self.attn = torch.zeros(most, attn, dtype=dtype, device=device)
        self.pieces: dict[int, list[tuple[Callable[[], None], Callable[[], None]]]] = {}
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.pool = None

    @staticmethod
    def padded_size(rows: int) -> int | None:
        """The smallest size that holds a step of ``rows`` tokens, or None past the largest."""
        return next((s for s in PIECE_TOKEN_SIZES if s >= rows), None)

    def run(self, x: Tensor, attend: Callable[[int, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
        """Every layer over the embedded rows ``x`` [T, D] (T at most the largest size), with
        ``attend(layer, qkv [T, ...]) -> [T, H hd]`` between each layer's two parts; -> (x, the
        last MLP's output), [T, D] each: views of the buffers, valid until the next run."""
        rows = x.shape[0]
        size = self.padded_size(rows)
        if size is None:
            raise ValueError(f"a step of {rows} tokens is longer than the largest piece size")
        if size not in self.pieces:  # first: its warm-up runs write the buffers
            self.pieces[size] = self._capture(size)
        self.x[:rows].copy_(x)
        self.x[rows:size].zero_()
        self.residual[:size].zero_()
        for layer, (before, after) in enumerate(self.pieces[size]):
            before()
            self.attn[:rows].copy_(attend(layer, self.qkv[:rows]))
            after()
        return self.x[:rows], self.residual[:rows]

    def release(self) -> None:
        """Free every captured graph (captured again if run)."""
        for graph in self.graphs:
            graph.reset()
        self.graphs.clear()
        self.pieces.clear()
        self.pool = None

    def _calls(self, size: int) -> list[tuple[Callable[[], None], Callable[[], None]]]:
        """Each layer's two parts on the first ``size`` rows of the buffers, writing them back."""
        x, residual, qkv, attn = (b[:size] for b in (self.x, self.residual, self.qkv, self.attn))

        def before_call(fn: Before) -> Callable[[], None]:
            def call() -> None:
                new_x, new_qkv = fn(x, residual)
                x.copy_(new_x)
                qkv.copy_(new_qkv)
            return call

        def after_call(fn: After) -> Callable[[], None]:
            def call() -> None:
                new_x, new_residual = fn(x, attn)
                x.copy_(new_x)
                residual.copy_(new_residual)
            return call

        return [(before_call(b), after_call(a)) for b, a in zip(self.before, self.after)]

    def _capture(self, size: int) -> list[tuple[Callable[[], None], Callable[[], None]]]:
        """Warm up (compiling if asked) on a side stream, then record each part in its own
        graph, every graph in one memory pool: they run one after another, never together."""
        calls = self._calls(size)
        if not self.capture:
            return calls
        print(f"tinyinfer: capturing CUDA graphs of the layers for steps of up to {size} tokens "
              "(once per size)", file=sys.stderr, flush=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for pair in calls:
                    for call in pair:
                        call()
        torch.cuda.current_stream().wait_stream(side)
        replays = []
        with collection_paused():
            for pair in calls:
                replayed = []
                for call in pair:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        call()
                    self.pool = graph.pool()
                    self.graphs.append(graph)
                    replayed.append(graph.replay)
                replays.append((replayed[0], replayed[1]))
        return replays
