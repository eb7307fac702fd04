"""Where tinyinfer's Triton kernels run, known without importing Triton.

On CUDA devices; and, under Triton's CPU interpreter (``TRITON_INTERPRET=1``: the tests, or a
learner stepping through a kernel in a debugger), on the CPU. The runner's "auto" choices take
the kernels on CUDA only, since the interpreter is for reading and checking them and far too
slow to serve; asked for by name (``decode_products="triton"``, ``decode_attention="triton"``,
``quant_kernel="triton"``, ``batch_invariant=True``), they run wherever ``runs_kernels`` says.
The prefill attention kernel is not among them: its tests call it directly.
"""

from __future__ import annotations

import importlib.util
import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels


def installed() -> bool:
    """Whether the triton package is installed (importing it may still fail: too old)."""
    return importlib.util.find_spec("triton") is not None


def runs_kernels(device: torch.device) -> bool:
    """Whether Triton kernels can run on this device's tensors."""
    return installed() and (device.type == "cuda" or INTERPRETED)
