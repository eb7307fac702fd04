r"""The 8B shape's one-row products, bf16 and quantized, each profiled once by Nsight Compute (CUDA).

Each product is called twice: the first round compiles, the second is the one to profile (skip
the first 12 launches). What docs/quantization.md reports ("What bounds the quantized products")
came from:

    PYTHONPATH=. ncu --clock-control none --kernel-name 'regex:_fused_quant_kernel|_gemv_kernel' \
        --launch-skip 12 --launch-count 12 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        --section InstructionStats \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        --csv --page details python3 scripts/ncu_quant_products.py > ncu.csv

The products are those of a decode step (``torch_triton_gemv.gemv``: bf16 weights, or the
Triton kernels' int8 / int4-g128 layout), with the layer functions' prologues and epilogues:
q|k|v with the residual add and RMSNorm, o with the residual add, gate|up with RMSNorm and
silu(gate) * up, down. Random weights: a product's speed does not depend on their values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_quant_kernels import random_kernel_weight  # noqa: E402

from tinyinfer.runners import torch_triton_gemv as G  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FORMATS = ("bf16", "int8", "int4-g128")


def product(kind: str, fmt: str, device: torch.device, gen: torch.Generator):
    """One product of the 8B shape in one format, as a call with its inputs bound."""
    n, k = SHAPES[kind]
    w = (torch.randn((n, k), device=device, generator=gen, dtype=torch.bfloat16) * 0.02 if fmt == "bf16"
         else random_kernel_weight((n, k), fmt, device, gen))
    x = torch.randn((1, k), device=device, dtype=torch.bfloat16)
    r = torch.randn((1, n if kind == "o" else k), device=device, dtype=torch.bfloat16)
    norm = torch.ones(k, device=device, dtype=torch.bfloat16)
    total = torch.empty_like(x)
    if kind == "qkv":
        return lambda: G.gemv(x, w, norm=norm, residual=r, sum_out=total, eps=1e-5)
    if kind == "o":
        return lambda: G.gemv(x, w, add=r)
    if kind == "gate_up":
        return lambda: G.gemv(x, w, norm=norm, eps=1e-5, gated=True)
    return lambda: G.gemv(x, w)


def main() -> int:
    if not torch.cuda.is_available():
        print("this script needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    calls = [(fmt, kind, product(kind, fmt, device, gen)) for fmt in FORMATS for kind in SHAPES]
    for _, _, call in calls:  # compiles; the launches ncu skips
        call()
    torch.cuda.synchronize()
    for fmt, kind, call in calls:  # the launches ncu profiles, in this order
        print(fmt, kind, flush=True)
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
