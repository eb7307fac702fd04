"""CUDA graphs of a step's layers between its attentions: the steps no decode graph holds.

A decode step replays one CUDA graph (``torch_graphs``). A prefill chunk, a step that mixes
prefill chunks with decoding rows, or a draft model's catch-up on a prompt cannot: how its
attention runs depends on how many tokens each sequence brings, which changes every step.
Launched kernel by kernel from Python, such a step of a short prompt costs the host far more
than the device (an H100's host: 26 ms for the 8B shape's 16-token prompt, 37 ms for a 1B int4
draft's catch-up on 17 tokens and its three rounds; the device is done in a fraction of that).

The layers between two attentions, though, treat every row alike: a residual add, a norm, the
products, an activation. So, as vLLM's piecewise graphs do, each layer is cut at its attention:
the part before it (residual add, norm, q|k|v product) and the part after (o product, residual
add, norm, MLP) are captured once per padded token count (16, 32, ... 512, every size at the
first step that needs one), each reading and writing fixed buffers. A step copies its embedded
tokens in (zeros in the padding rows of x and the residual) and, per layer, replays the part
before, runs the attention eagerly on its real rows (through the page tables, exactly as without
graphs), copies the result in and replays the part after. Padding rows compute values no real
row reads, whatever the buffers held before: every operation of a piece works row by row. (The
padded count, not the real one, then decides which kernel a quantized product takes: a step of
200 rows multiplies as one of 256 does.)

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
Parts = tuple[Callable[[], None], Callable[[], None]]  # a layer's two parts, on one size's rows


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
        self.pieces: dict[int, list[Parts]] = {}
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
        if not self.pieces:  # first: the warm-up runs write the buffers
            self.pieces = self._capture_all()
        self.x[:rows].copy_(x)
        self.x[rows:size].zero_()
        self.residual[:size].zero_()
        for layer, (before, after) in enumerate(self.pieces[size]):
            before()
            self.attn[:rows].copy_(attend(layer, self.qkv[:rows]))
            after()
        return self.x[:rows], self.residual[:rows]

    def _calls(self, size: int) -> list[Parts]:
        """Each layer's two parts on the first ``size`` rows of the buffers, writing them back."""
        x, residual, qkv, attn = (b[:size] for b in (self.x, self.residual, self.qkv, self.attn))

        def part(fn: Before | After, second: Tensor, outputs: tuple[Tensor, Tensor]) -> Callable[[], None]:
            def call() -> None:  # fn(x, second), written back into the buffers
                for buffer, value in zip(outputs, fn(x, second)):
                    buffer.copy_(value)
            return call

        return [(part(b, residual, (x, qkv)), part(a, attn, (x, residual)))
                for b, a in zip(self.before, self.after)]

    def _capture_all(self) -> dict[int, list[Parts]]:
        """Every size at once, at the first step that needs one, so that no later step (a
        server's first long prompt) waits for a capture, or for torch.compile to see a new
        number of rows. All or none: a capture that fails (out of memory) is tried again at the
        next step."""
        if self.capture:
            print(f"tinyinfer: capturing CUDA graphs of the layers for steps of "
                  f"{PIECE_TOKEN_SIZES[0]} to {PIECE_TOKEN_SIZES[-1]} tokens (once)",
                  file=sys.stderr, flush=True)
        return {size: self._capture(size) for size in PIECE_TOKEN_SIZES}

    def _capture(self, size: int) -> list[Parts]:
        """Warm up (compiling if asked) on a side stream, then record each part in its own
        graph, every graph in one memory pool: they run one after another, never together."""
        calls = self._calls(size)
        if not self.capture:
            return calls
        replays = []
        with torch.cuda.device(self.x.device):  # the buffers' card, whichever is current
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    for pair in calls:
                        for call in pair:
                            call()
            torch.cuda.current_stream().wait_stream(side)
            with collection_paused():
                for pair in calls:
                    replayed = []
                    for call in pair:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self.pool):
                            call()
                        self.pool = graph.pool()
                        replayed.append(graph.replay)  # holds the graph
                    replays.append((replayed[0], replayed[1]))
        return replays
