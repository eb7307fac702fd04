"""Lesson 06 experiment: your allocator places real K/V; then paged vs contiguous memory waste (C9)."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.support import claim, heading, heldout_text, load_model, table
from tinyinfer.bench import workloads as bench
from tinyinfer.model import Model
from tinyinfer.runners.runner import make_batch

BLOCK = 16


def interleaved(impl: ModuleType, m: Model, seqs: list[list[int]],
                chunk: int) -> tuple[float, dict[int, list[int]], dict[int, tuple[int, list[int]]]]:
    """Prefill sequences in mixed batches of chunks, on pages from the student's allocator.

    Sequence 1 finishes early and is freed, so the last sequence reuses its pages. Returns
    the largest logit difference from computing each sequence alone, the page tables, and for
    each sequence the step it finished at and the pages it gave back.
    """
    num_pages = sum(-(-len(s) // BLOCK) for s in seqs[:-1]) + 1  # the last sequence needs freed pages
    allocator = impl.PageAllocator(num_pages, BLOCK)
    kv = m.runner.new_kv_cache(num_pages, BLOCK)
    done = {i: 0 for i in range(len(seqs) - 1)}  # tokens computed; the last joins later
    tables: dict[int, list[int]] = {}
    freed: dict[int, tuple[int, list[int]]] = {}
    worst = 0.0
    step = 0
    while done:
        step += 1
        entries, order = [], []
        for i, start in done.items():
            end = min(start + chunk, len(seqs[i]))
            allocator.allocate(i, end)
            entries.append((seqs[i][start:end], start, list(allocator.page_table(i)), True))
            order.append((i, start, end))
        logits = m.runner.forward(make_batch(entries, BLOCK), kv)  # [rows, V]
        row = 0
        for i, start, end in order:
            alone = m.logits(seqs[i][:end])[start:end]  # the same positions, no paging tricks
            worst = max(worst, float(np.abs(logits[row:row + end - start] - alone).max()))
            row += end - start
            done[i] = end
            if end == len(seqs[i]):
                tables[i] = list(allocator.page_table(i))
                del done[i]
                allocator.free(i)
                freed[i] = (step, tables[i])
                if i == 1:
                    done[len(seqs) - 1] = 0  # the newcomer takes the freed pages
    return worst, tables, freed


def workload(m: Model, quick: bool) -> list[bench.Request]:
    """Chat-like requests (log-normal prompt and output lengths); quick mode shortens the outputs."""
    requests = bench.make_workload(4 if quick else 24, m.config.vocab_size, m.config.max_model_len, seed=0)
    if quick:
        return [bench.Request(r.prompt_ids[:64], min(r.max_tokens, 16)) for r in requests]
    return requests


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Real attention on the student's pages; then measured KV waste next to the student's formulas."""
    m = load_model(model)
    ids = m.tokenizer.encode(heldout_text(12000))
    seqs = [ids[0:45], ids[500:530], ids[1000:1070], ids[2000:2040]]

    heading("your allocator places the K/V of 4 sequences, prefilled together in chunks of 8")
    worst, tables, freed = interleaved(impl, m, seqs, 8)
    step_1, pages_1 = freed[1]
    for i, pages in sorted(tables.items()):
        marked = ", ".join(f"{p}*" if i != 1 and p in pages_1 else str(p) for p in pages)
        when = f", complete at step {freed[i][0]}, then freed"
        print(f"sequence {i} ({len(seqs[i])} tokens): pages [{marked}]{when}")
    print(f"* a page sequence 1 held until it was freed after step {step_1}: freed pages go back to the "
          "allocator's free list and a later sequence gets them when its turn comes, so one page number "
          "appears in two tables, at different times (sequence 3 joined only after sequence 1 was freed)")
    print(f"largest logit difference from running each sequence alone: {worst:.2e}"
          f" -> {'the scattered pages give the same answers' if worst < 1e-3 else 'WRONG answers'}")

    heading("the engine: the same requests with paged and with contiguous KV allocation")
    requests = workload(m, quick)
    kwargs = dict(max_num_seqs=16, page_size=BLOCK, enable_prefix_caching=False,
                  num_pages=min(16, len(requests)) * -(-m.config.max_model_len // BLOCK))
    results = [bench.run_workload(m, requests, mode, kv_allocation=mode.split()[0], **kwargs)
               for mode in ("paged", "contiguous")]
    final = [len(r.prompt_ids) + r.max_tokens for r in requests]
    paged_formula = impl.paged_waste(final, BLOCK)
    contiguous_formula = impl.contiguous_waste(final, m.config.max_model_len)
    print(table(("allocation", "measured waste (time-averaged)", "your formula (final lengths)", "tok/s"),
                [("paged", f"{100 * results[0].kv_waste:.1f}%", f"{100 * paged_formula:.1f}%",
                  results[0].tokens_per_second),
                 ("contiguous", f"{100 * results[1].kv_waste:.1f}%", f"{100 * contiguous_formula:.1f}%",
                  results[1].tokens_per_second)]))
    mean = float(np.mean(final))
    print(f"{len(requests)} requests, {mean:.0f} tokens each on average; contiguous reserves "
          f"{m.config.max_model_len} ({100 * mean / m.config.max_model_len:.0f}% used at the end)")

    paged, contiguous = results[0].kv_waste, results[1].kv_waste
    paged_ok, contiguous_ok = paged < 0.05, 0.6 <= contiguous <= 0.8
    used = mean / m.config.max_model_len
    why = [f"paging leaves about half a page per sequence empty, {BLOCK // 2} of ~{mean:.0f} tokens"
           + ("" if paged_ok else "; longer requests make that share smaller"),
           f"contiguous waste is 1 minus the share of the {m.config.max_model_len}-token reservation "
           f"that requests use ({100 * used:.0f}% here)"
           + ("" if contiguous_ok else "; the claim's 60-80% means requests that use 20-40% of it")]
    claim("C9", f"contiguous wastes {100 * contiguous:.0f}% of reserved KV slots, paged {100 * paged:.1f}%",
          True if paged_ok and contiguous_ok else (None if paged_ok or contiguous_ok else False), "; ".join(why))

if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
