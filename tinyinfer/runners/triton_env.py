"""Where tinyinfer's Triton kernels run, known without importing Triton.

On CUDA devices; and, under Triton's CPU interpreter (``TRITON_INTERPRET=1``: the tests, or a
learner stepping through a kernel in a debugger), on the CPU. The runner's "auto" choices take
the kernels on CUDA only, since the interpreter is for reading and checking them and far too
slow to serve; asked for by name (``decode_products="triton"``, ``decode_attention="triton"``,
``quant_kernel="triton"``, ``batch_invariant=True``), they run wherever ``runs_kernels`` says.
The prefill attention kernel is not among them: its tests call it directly.

It also says whether the kernels launched now use programmatic dependent launch
(``launches_dependent``; ``triton_common`` explains it): the runner's ``pdl`` option, applied
with ``dependent_launch`` around its steps, on cards that support it.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from typing import Iterator

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels


def installed() -> bool:
    """Whether the triton package is installed (importing it may still fail: too old)."""
    return importlib.util.find_spec("triton") is not None


def runs_kernels(device: torch.device) -> bool:
    """Whether Triton kernels can run on this device's tensors."""
    return installed() and (device.type == "cuda" or INTERPRETED)


_dependent = contextvars.ContextVar("tinyinfer_dependent_launch", default=False)
_capable: dict[torch.device, bool] = {}


def supports_dependent_launch(device: torch.device) -> bool:
    """Whether Triton kernels on this device can use programmatic dependent launch: a CUDA card
    of compute capability 9.0 or later, Triton installed, not its CPU interpreter (which has no
    ``gdc_wait``)."""
    if device not in _capable:
        _capable[device] = (installed() and not INTERPRETED and device.type == "cuda"
                            and torch.cuda.get_device_capability(device) >= (9, 0))
    return _capable[device]


@contextlib.contextmanager
def dependent_launch(on: bool) -> Iterator[None]:
    """Launch tinyinfer's Triton kernels started in this block (this thread or task) with
    programmatic dependent launch where the device supports it (``on``), or without it."""
    token = _dependent.set(on)
    try:
        yield
    finally:
        _dependent.reset(token)


def launches_dependent(device: torch.device) -> bool:
    """Whether a kernel launched now on ``device`` uses programmatic dependent launch: inside
    ``dependent_launch(True)``, on a device that supports it."""
    return _dependent.get() and supports_dependent_launch(device)
