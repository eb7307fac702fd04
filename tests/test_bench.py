"""The measurement code itself: workloads are reproducible and the metrics mean what they say."""

from __future__ import annotations

import tinyinfer
from tinyinfer import bench


def test_workload_is_reproducible_and_fits_the_context():
    a = bench.make_workload(50, 320, 256, seed=3)
    assert a == bench.make_workload(50, 320, 256, seed=3)
    assert a != bench.make_workload(50, 320, 256, seed=4)
    assert all(len(r.prompt_ids) + r.max_tokens <= 256 for r in a)


def test_batching_modes_produce_the_same_tokens_and_honest_waste(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder)
    results = bench.bench_batching(model, num_requests=12, max_num_seqs=4)
    assert {r.output_tokens for r in results} == {sum(r.max_tokens for r in
                                                      bench.make_workload(12, 320, 256, 0))}
    by_mode = {r.mode: r for r in results}
    paged, contiguous = by_mode["continuous + paged"], by_mode["continuous + contiguous"]
    # Paged waste is at most the unfilled tail of one page per sequence.
    assert paged.kv_waste < 16 / (16 + 4)
    assert contiguous.kv_waste > paged.kv_waste
    assert by_mode["static + paged"].steps >= paged.steps


def test_prefix_hit_skips_the_cached_pages(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    result = bench.bench_prefix(tinyinfer.load(folder), system_tokens=100, repeats=1)
    assert result.cached_tokens == 96
