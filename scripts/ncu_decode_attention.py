r"""The decode attention kernel at the 8B shape, bf16 and int8 K/V, each profiled once by Nsight
Compute (CUDA): 32 sequences at a 4,112-token context, as ``gpu_bench.py --only kv_cache`` times it.

Each variant is called twice: the first round compiles, the second is the one to profile (skip
the first three launches of the kernel). What docs/quantization.md reports for it came from:

    PYTHONPATH=. ncu --clock-control none --kernel-name _paged_decode_kernel \
        --launch-skip 3 --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        --section InstructionStats \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        --csv --page details python3 scripts/ncu_decode_attention.py > ncu.csv

The variants, in launch order: bf16 K/V (64 keys a step), int8 K/V (128 keys a step, the
default), int8 K/V at 64 keys a step (``KEY_TILE_ELEMENTS`` halved). The docs' table has them
before and after the kernel converted each tile where it is used.
"""

from __future__ import annotations

import torch

from tinyinfer.runners import torch_triton

BATCH, HEADS, KV_HEADS, HEAD_DIM, PAGE, CONTEXT = 32, 32, 8, 128, 16, 4112


def main() -> None:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    per_seq = CONTEXT // PAGE + 2
    pages = BATCH * per_seq + 1
    tables = torch.arange(BATCH * per_seq, device=device).view(BATCH, per_seq)
    positions = torch.full((BATCH,), CONTEXT - 1, device=device)
    slots = tables[:, (CONTEXT - 1) // PAGE] * PAGE + (CONTEXT - 1) % PAGE
    qkv = torch.randn((BATCH, (HEADS + 2 * KV_HEADS) * HEAD_DIM), device=device, dtype=torch.bfloat16,
                      generator=gen)
    angles = torch.arange(CONTEXT + PAGE, device=device, dtype=torch.float32)[:, None] * torch.rand(
        HEAD_DIM // 2, device=device, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    bf16 = [torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    int8 = [torch.randint(-127, 128, shape, device=device, dtype=torch.int8, generator=gen) for _ in range(2)]
    scales = [(torch.rand(shape[:3], device=device, generator=gen) * 0.03).half() for _ in range(2)]

    def attend(k_cache, v_cache, k_scale=None, v_scale=None) -> None:
        torch_triton.paged_decode_attention(qkv, positions, slots, tables, k_cache, v_cache, cos, sin, HEADS,
                                            k_scale=k_scale, v_scale=v_scale)

    tile = torch_triton.KEY_TILE_ELEMENTS
    for _ in range(2):  # compile, then the launches to profile
        attend(*bf16)
        attend(*int8, *scales)
        torch_triton.KEY_TILE_ELEMENTS = tile // 2
        attend(*int8, *scales)
        torch_triton.KEY_TILE_ELEMENTS = tile
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
