"""Tensor parallelism on CPU (gloo, 2 processes): the sharded model computes the plain runner's function.

Each class starts one tensor-parallel model (one worker process) for all its tests and closes
it afterwards: only one torch.distributed group can live in a process at a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tinyinfer
from tests.conftest import interruptible_tinyinfer
from tinyinfer import SamplingParams, TinyInferError
from tinyinfer.config import load_config
from tinyinfer.model import BUNDLED, Model, with_tokenizer
from tinyinfer.runners.runner import make_batch
from tinyinfer.runners.tp.launch import start_ranks
from tinyinfer.runners.tp.shard import (
    ShardRunner,
    VocabShard,
    check_tensor_parallel,
    shard_weights,
)
from tinyinfer.trace import RankShare, StepTrace
from tinyinfer.weights import load_weights

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch build has no gloo backend for CPU process groups")

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "To be, or not to be", "ROMEO: what light"]


def token_prompts(model, count: int = 4, length: int = 20, seed: int = 0) -> list[list[int]]:
    """Random token prompts (the oracle models have no tokenizer)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model.config.vocab_size, size=length - 3 * i).tolist() for i in range(count)]


def assert_same_function(tp, ref, ids: list[int]) -> None:
    """Full-sequence logits of the TP model equal the plain runner's within fp32 tolerance."""
    got, want = tp.logits(ids), ref.logits(ids)
    assert got.shape == want.shape == (len(ids), ref.config.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def generate(model, prompts, params: SamplingParams, **engine_options):
    """Token ids of every completion, and every step's trace."""
    engine = tinyinfer.Engine(model, **engine_options)
    ids = [engine.add_request(p, params) for p in prompts]
    traces = []
    while engine.has_unfinished():
        traces.append(engine.step())
    return [engine.release(i).token_ids for i in ids], traces


# ---------------------------------------------------------------------- bundled model


@pytest.fixture(scope="class")
def bundled_pair():
    tp = tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu", time_collectives=True)
    yield tp, tinyinfer.load("bundled", runner="torch", device="cpu")
    tp.runner.close()


class TestBundled:
    """The bundled model (4 heads, 2 KV heads, tied embedding) split over 2 ranks."""

    def test_step_trace_reports_each_ranks_compute_and_all_reduce_time(self, bundled_pair):
        engine = tinyinfer.Engine(bundled_pair[0])
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
        trace = engine.step()
        timings = trace.rank_timings
        assert {"rank0_compute", "rank0_all_reduce", "rank0_forward", "rank1_compute",
                "rank1_all_reduce", "rank1_forward"} == set(timings)
        assert not any(k.startswith("rank") for k in trace.timings)  # stages only: they add up
        assert timings["rank1_all_reduce"] > 0

    def test_logits_equal_tp1(self, bundled_pair):
        tp, ref = bundled_pair
        assert_same_function(tp, ref, ref.tokenizer.encode(PROMPTS[1] + ", wherefore art thou"))

    def test_forward_top_merges_vocabulary_slices(self, bundled_pair):
        tp, ref = bundled_pair
        ids = [ref.tokenizer.encode(p) for p in PROMPTS[:2]]
        block = 16
        batch = make_batch([(ids[0], 0, [0, 1], False), (ids[1], 0, [2, 3], False)], block)
        got = tp.runner.forward_top(batch, tp.runner.new_kv_cache(4, block), 20)
        want = ref.runner.forward_top(batch, ref.runner.new_kv_cache(4, block), 20)
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_allclose(got.values, want.values, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got.logsumexp, want.logsumexp, rtol=1e-5, atol=1e-4)

    def test_each_rank_holds_its_kv_heads_only(self, bundled_pair):
        tp, ref = bundled_pair
        local = tp.runner.new_kv_cache(3, 16).local.k
        full = ref.runner.new_kv_cache(3, 16).k
        assert full.shape[3] == 2 and local.shape == (*full.shape[:3], 1, full.shape[4])
        assert tp.runner.describe()["tensor_parallel"] == 2

    def test_greedy_generations_identical(self, bundled_pair):
        tp, ref = bundled_pair
        params = SamplingParams(max_tokens=24, temperature=0)
        got, _ = generate(tp, PROMPTS, params)
        want, _ = generate(ref, PROMPTS, params)
        assert got == want

    def test_sampled_generations_identical(self, bundled_pair):
        # Sampling needs full logits rows: this runs forward (the gathered [R, V]), not forward_top.
        tp, ref = bundled_pair
        params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7)
        got, _ = generate(tp, PROMPTS[:2], params)
        want, _ = generate(ref, PROMPTS[:2], params)
        assert got == want

    def test_chunked_prefill_and_preemption_give_same_tokens(self, bundled_pair):
        tp, ref = bundled_pair
        prompts = [ref.tokenizer.encode(PROMPTS[1] + " " + p) for p in PROMPTS]  # a shared prefix
        params = SamplingParams(max_tokens=20, temperature=0)
        options = dict(num_pages=22, page_size=4, max_num_seqs=4, max_num_batched_tokens=12)
        got, traces = generate(tp, prompts, params, **options)
        want, _ = generate(ref, prompts, params, **options)
        assert got == want
        assert any(t.preempted for t in traces), "the small pool should have forced a preemption"
        steps = [s for t in traces for s in t.seqs]
        assert any(s.kind == "prefill" and s.end < len(prompts[s.seq_id]) for s in steps), \
            "a prompt should have been prefilled in several chunks"
        assert any(t.prefix_hit_pages for t in traces), "the shared prefix should have hit the cache"

    def test_copy_page_copies_every_ranks_share(self, bundled_pair):
        tp, ref = bundled_pair
        ids = ref.tokenizer.encode(PROMPTS[2] + PROMPTS[3])[:8]
        block = 4
        results = []
        for runner in (tp.runner, ref.runner):
            kv = runner.new_kv_cache(4, block)
            runner.forward(make_batch([(ids[:7], 0, [0, 1], False)], block), kv)
            runner.copy_page(kv, 1, 3)  # a fork: the second page now also lives at page 3
            results.append(runner.forward(make_batch([(ids[7:8], 7, [0, 3], False)], block), kv))
        np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-4)

    def test_pool_view_says_which_rank_owns_which_heads(self, bundled_pair):
        engine = tinyinfer.Engine(bundled_pair[0])
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
        trace = engine.step()
        c = bundled_pair[0].config
        half_v = -(-c.vocab_size // 2)
        assert trace.pool.ranks == (
            RankShare(0, (0, 2), (0, 1), (0, c.intermediate_size // 2), (0, half_v)),
            RankShare(1, (2, 4), (1, 2), (c.intermediate_size // 2, c.intermediate_size), (half_v, c.vocab_size)))
        assert StepTrace.from_json(trace.to_json()) == trace  # recorded runs replay the view
        assert tinyinfer.Engine(bundled_pair[1]).pool_view().ranks == ()

    def test_last_timings_per_rank(self, bundled_pair):
        tp, ref = bundled_pair
        tp.logits(ref.tokenizer.encode(PROMPTS[0]))
        timings = tp.runner.last_timings
        assert [t.rank for t in timings] == [0, 1]
        layers = tp.config.num_layers
        for t in timings:
            assert t.num_all_reduces == 2 * layers + 1  # o and down per layer, and the embedding
            assert t.compute_s > 0 and t.all_reduce_s > 0 and t.gather_s >= 0

    def test_second_tensor_parallel_model_is_refused(self, bundled_pair):
        with pytest.raises(TinyInferError, match="close"):
            tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu")


# ---------------------------------------------------------------------- oracle GQA model


@pytest.fixture(scope="class")
def gqa_pair(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    tp = tinyinfer.load(folder, runner="torch", tensor_parallel=2, device="cpu")
    yield tp, tinyinfer.load(folder, runner="torch", device="cpu")
    tp.runner.close()


class TestOracleGQA:
    """A transformers Llama with GQA and an untied head: q, k, v, o, gate, up, down, lm_head all split."""

    def test_logits_equal_tp1(self, gqa_pair):
        tp, ref = gqa_pair
        assert_same_function(tp, ref, token_prompts(ref, count=1, length=40)[0])

    def test_greedy_generations_identical_with_batching(self, gqa_pair):
        tp, ref = gqa_pair
        params = SamplingParams(max_tokens=16, temperature=0)
        options = dict(num_pages=16, page_size=4, max_num_seqs=3, max_num_batched_tokens=16)
        prompts = token_prompts(ref)
        got, traces = generate(tp, prompts, params, **options)
        want, _ = generate(ref, prompts, params, **options)
        assert got == want
        assert any(t.preempted for t in traces)


# ---------------------------------------------------------------------- GPT-2, uneven vocabulary


@pytest.fixture(scope="class")
def gpt2_pair(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("gpt2-odd-vocab")
    config = transformers.GPT2Config(vocab_size=321, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(3)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    tp = tinyinfer.load(folder, runner="torch", tensor_parallel=2, device="cpu")
    yield tp, tinyinfer.load(folder, runner="torch", device="cpu")
    tp.runner.close()


class TestGPT2OddVocabulary:
    """GPT-2 (biases, position table, LayerNorm) with 321 tokens: the last vocabulary shard is padded."""

    def test_logits_equal_tp1(self, gpt2_pair):
        tp, ref = gpt2_pair
        assert_same_function(tp, ref, token_prompts(ref, count=1, length=30)[0])

    def test_greedy_generations_identical(self, gpt2_pair):
        tp, ref = gpt2_pair
        params = SamplingParams(max_tokens=12, temperature=0)
        prompts = token_prompts(ref, count=3)
        assert generate(tp, prompts, params)[0] == generate(ref, prompts, params)[0]

    def test_closed_model_refuses_work(self, gpt2_pair):
        tp, _ = gpt2_pair
        tp.runner.close()
        with pytest.raises(TinyInferError, match="closed"):
            tp.logits([1, 2, 3])


# ---------------------------------------------------------------------- one rank, and errors


def test_single_rank_runs_without_workers():
    path = BUNDLED["bundled"]
    config = load_config(path)
    tp = with_tokenizer(path, "bundled", config, start_ranks(config, path, 1, device="cpu"))
    try:
        ref = tinyinfer.load("bundled", runner="torch", device="cpu")
        assert_same_function(tp, ref, ref.tokenizer.encode(PROMPTS[3]))
        assert [t.num_all_reduces for t in tp.runner.last_timings] == [0]
    finally:
        tp.runner.close()


def test_int8_kv_cache_splits_like_a_float_one():
    """Each rank stores int8 codes and scales for its own KV heads; the split model computes the
    one-process int8 K/V model's function, chunked prefill and a shared prefix included."""
    tp = tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu", kv_cache_dtype="int8")
    try:
        ref = tinyinfer.load("bundled", runner="torch", device="cpu", kv_cache_dtype="int8")
        local = tp.runner.new_kv_cache(3, 16).local
        assert local.k.dtype == torch.int8 and local.k_scale.shape == (*local.k.shape[:3], 1)
        assert tp.runner.info.kv_bytes_per_token(tp.config) == ref.runner.info.kv_bytes_per_token(ref.config)
        assert_same_function(tp, ref, ref.tokenizer.encode(PROMPTS[3]))
        prompts = [ref.tokenizer.encode(PROMPTS[1] + " " + p) for p in PROMPTS]
        params = SamplingParams(max_tokens=24, temperature=0)
        options = dict(page_size=4, max_num_batched_tokens=12)
        got, traces = generate(tp, prompts, params, **options)
        want, _ = generate(ref, prompts, params, **options)
        assert got == want and any(t.prefix_hit_pages for t in traces)
    finally:
        tp.runner.close()


def test_vocabulary_shards_cover_the_vocabulary_once():
    shards = [VocabShard.of(321, rank, 2) for rank in range(2)]
    assert [(s.start, s.rows, s.valid) for s in shards] == [(0, 161, 161), (161, 161, 160)]
    config = load_config(BUNDLED["bundled"])
    weights = load_weights(BUNDLED["bundled"], config)
    parts = [shard_weights(config, weights, rank, 2) for rank in range(2)]
    np.testing.assert_array_equal(np.concatenate([p["layers.0.q.weight"] for p in parts]),
                                  weights["layers.0.q.weight"])
    np.testing.assert_array_equal(np.concatenate([p["layers.0.down.weight"] for p in parts], axis=1),
                                  weights["layers.0.down.weight"])
    assert parts[0]["layers.0.k.weight"].shape == (config.head_dim, config.hidden_size)


@pytest.mark.parametrize("world, what", [(3, "4 attention heads"), (4, "2 KV heads"), (0, "positive")])
def test_ranks_must_divide_heads(world, what):
    with pytest.raises(TinyInferError, match=what):
        tinyinfer.load("bundled", runner="torch", tensor_parallel=world, device="cpu")


@pytest.mark.parametrize("world", [3, 4])
def test_a_refused_split_offers_only_sizes_the_model_takes(world):
    # the bundled model: 4 heads, 2 KV heads; 4 ranks would split the heads but not the KV heads
    with pytest.raises(TinyInferError, match=r"this model splits over 1 or 2 ranks$"):
        tinyinfer.load("bundled", runner="torch", tensor_parallel=world, device="cpu")


def test_more_ranks_than_gpus_is_refused():
    config = load_config(BUNDLED["bundled"])
    check_tensor_parallel(config, 2, "cuda", 2)
    with pytest.raises(TinyInferError, match="needs 2 GPUs .* has 1"):
        check_tensor_parallel(config, 2, "cuda", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_gpus_is_refused():
    with pytest.raises(TinyInferError, match="CUDA is not available"):
        tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cuda")


def test_unsupported_options_are_refused(without_triton_interpreter):
    with pytest.raises(TinyInferError, match="quantize"):
        tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu", quantize="int8")
    with pytest.raises(TinyInferError, match="cuda:r"):
        tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cuda:1")
    config = load_config(BUNDLED["bundled"])
    with pytest.raises(TinyInferError, match="CUDA graphs"):
        ShardRunner(config, load_weights(BUNDLED["bundled"], config), 0, 1, device="cpu",
                    cuda_graphs=True)
    with pytest.raises(TinyInferError, match="needs a CUDA device.*use decode_products='torch'"):
        ShardRunner(config, load_weights(BUNDLED["bundled"], config), 0, 1, device="cpu",
                    decode_products="triton")
    with pytest.raises(TinyInferError, match="decode_products must be one of"):
        ShardRunner(config, load_weights(BUNDLED["bundled"], config), 0, 1, device="cpu",
                    decode_products="cublas")


def test_random_shapes_hold_one_shard_per_rank():
    # Benchmark shapes too big for one device: each rank draws only its shard.
    config = load_config(BUNDLED["bundled"])
    tp = Model(config=config, runner=start_ranks(config, None, 2, device="cpu"), path=Path("random"),
               name="random")
    try:
        shard = tp.runner.shard
        assert shard.w.layers[0].qkv[0].shape == ((4 + 2 * 2) * config.head_dim // 2, config.hidden_size)
        assert shard.w.layers[0].mlp_out[0].shape == (config.hidden_size, config.intermediate_size // 2)
        assert shard.w.head.shape == (config.vocab_size // 2, config.hidden_size)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        tokens, _ = generate(tp, [[1, 2, 3, 4, 5]], params)
        assert len(tokens[0]) == 8 and all(0 <= t < config.vocab_size for t in tokens[0])
        assert len(tp.runner.last_timings) == 2
        with pytest.raises(TinyInferError, match="no tokenizer"):
            tp.tokenizer
    finally:
        tp.runner.close()


def test_cli_generate_with_tensor_parallel_equals_one_process():
    import subprocess
    import sys

    def run(*extra: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "tinyinfer", "generate", "ROMEO:", "--runner", "torch",
             "--max-tokens", "12", "--temperature", "0", *extra],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert run("--tensor-parallel", "2") == run()
    refused = subprocess.run([sys.executable, "-m", "tinyinfer", "generate", "hi",
                              "--tensor-parallel", "2"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--runner torch" in refused.stderr


def test_cli_bench_latency_reports_ranks_and_all_reduce_time(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "latency.json"
    result = subprocess.run(
        [sys.executable, "-m", "tinyinfer", "bench", "latency", "--runner", "torch",
         "--tensor-parallel", "2", "--time-collectives", "--prompt-tokens", "16", "--max-tokens", "4",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "all-reduce" in result.stdout
    (row,) = json.loads(out.read_text())
    assert row["tensor_parallel"] == 2
    assert 0 < row["all_reduce_ms"] < row["tpot_p50_ms"]
    assert {"rank0_forward", "rank1_forward", "rank1_all_reduce"} <= set(row["rank_ms"])
    assert row["rank_ms"]["rank1_all_reduce"] < row["rank_ms"]["rank1_forward"] < row["tpot_p50_ms"]
    refused = subprocess.run(
        [sys.executable, "-m", "tinyinfer", "bench", "latency", "--runner", "torch",
         "--tensor-parallel", "2", "--peer", "transformers"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "without --tensor-parallel" in refused.stderr


def test_collectives_are_untimed_unless_asked_and_counted_either_way():
    params = SamplingParams(max_tokens=6, temperature=0)
    reference = tinyinfer.load("bundled", runner="torch", device="cpu")
    expected, _ = generate(reference, [[5, 6, 7, 8]], params)
    tp = tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu")
    try:
        tokens, _ = generate(tp, [[5, 6, 7, 8]], params)
        assert tokens == expected
        layers = tp.config.num_layers
        assert [(t.num_all_reduces, t.all_reduce_s, t.forward_s) for t in tp.runner.last_timings] == \
            [(2 * layers + 1, 0.0, 0.0)] * 2
        assert tp.runner.describe()["time_collectives"] is False
        assert tp.runner.describe()["all_reduce"] == "nccl"
    finally:
        tp.runner.close()


def test_serve_with_tensor_parallel_answers_as_one_process_and_stops_its_workers():
    import signal
    import socket
    import subprocess
    import time
    from pathlib import Path

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        interruptible_tinyinfer("serve", "--runner", "torch", "--tensor-parallel", "2", "--port",
                                str(port), "--served-model-name", "tp", "--log-level", "warning"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health").json()["model"] == "tp"
                break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        workers = [pid for pid in children  # the rank processes, not multiprocessing's resource tracker
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                            json={"model": "tp", "prompt": "ROMEO:", "max_tokens": 12, "temperature": 0})
        reference = tinyinfer.Engine(tinyinfer.load("bundled", runner="torch", device="cpu")).generate(
            "ROMEO:", SamplingParams(max_tokens=12, temperature=0))[0]
        assert answer.json()["choices"][0]["text"] == reference.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        assert "Traceback" not in proc.stderr.read()
        # serve joined its rank processes before exiting: none is left running as an orphan
        assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()
                    and "zombie" not in Path(f"/proc/{pid}/status").read_text()]
    finally:
        proc.kill()
        proc.wait()


def _kill_rank1() -> None:
    import multiprocessing
    import os
    import signal

    (worker,) = [p for p in multiprocessing.active_children() if p.name == "tinyinfer-tp-rank1"]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)


def _running_engine():
    """A TP=2 bundled model on CPU and an engine one step into a request."""
    tp = tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu")
    engine = tinyinfer.Engine(tp)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    return tp, engine


def test_a_dead_worker_gives_a_clear_error_not_a_hang():
    import time

    tp, engine = _running_engine()
    try:
        _kill_rank1()
        with pytest.raises(TinyInferError, match="worker process has stopped"):
            engine.step()
    finally:
        start = time.monotonic()
        tp.runner.close()
        assert time.monotonic() - start < 20  # no wait for the dead worker's shutdown


def test_a_worker_dying_mid_step_fails_that_step_cleanly_and_every_later_one():
    tp, engine = _running_engine()
    try:
        shard_step = tp.runner.shard.launch_top

        def dies_after_the_command_went_out(*args, **kwargs):
            _kill_rank1()  # the command is sent; rank 1 dies before the first all-reduce
            return shard_step(*args, **kwargs)

        tp.runner.shard.launch_top = dies_after_the_command_went_out
        with pytest.raises(TinyInferError, match="failed part-way"):
            engine.step()
        tp.runner.shard.launch_top = shard_step
        with pytest.raises(TinyInferError, match="out of step|has stopped"):
            engine.step()
    finally:
        tp.runner.close()


def test_closing_a_cpu_split_gives_this_process_its_threads_back():
    import torch

    from tinyinfer.runners import threads

    threads.use(4)  # each CPU rank, rank 0 included, takes a share: 2 of these 4
    try:
        for _ in range(2):
            tp = tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu")
            assert torch.get_num_threads() == 2
            tp.runner.close()
            assert torch.get_num_threads() == 4  # not halved again by the next load
    finally:
        threads.use(1)  # as tests/conftest.py set it


# ---------------------------------------------------------------------- exits and launchers


def _marked_env() -> tuple[dict[str, str], str]:
    """This environment plus a unique mark: every process a command starts inherits it."""
    import os
    import uuid

    mark = uuid.uuid4().hex
    return {**os.environ, "TINYINFER_TEST_MARK": mark}, mark


def _still_running(mark: str) -> list[int]:
    """Processes carrying the mark that are alive (not zombies)."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"TINYINFER_TEST_MARK={mark}".encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = next(line for line in (proc / "status").read_text().splitlines()
                         if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if "zombie" not in state:
            found.append(int(proc.name))
    return found


def _tinyinfer(*args: str, torchrun: int = 0) -> list[str]:
    import sys

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={torchrun}"] if torchrun else [sys.executable]
    return [*launcher, "-m", "tinyinfer", *args]


def test_bench_latency_exits_after_its_work_leaving_no_process_or_semaphore():
    import subprocess

    env, mark = _marked_env()
    result = subprocess.run(_tinyinfer("bench", "latency", "--runner", "torch", "--device", "cpu",
                                       "--tensor-parallel", "2", "--prompt-tokens", "8", "--max-tokens", "3"),
                            capture_output=True, text=True, env=env, timeout=300)  # a hang guard only
    assert result.returncode == 0, result.stderr
    assert "bundled / torch" in result.stdout
    for bad in ("leaked semaphore", "Traceback", "Fatal Python error"):
        assert bad not in result.stderr
    assert _still_running(mark) == []


def test_ctrl_c_mid_run_exits_130_with_no_traceback_and_no_worker_left():
    import os
    import signal
    import subprocess

    env, mark = _marked_env()
    proc = subprocess.Popen(
        interruptible_tinyinfer("bench", "latency", "--runner", "torch", "--device", "cpu",
                                "--tensor-parallel", "2", "--prompt-tokens", "8", "--max-tokens", "400"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the model is loaded, the ranks are up: the benchmark runs
            if line.startswith("model bundled"):
                break
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: every process of the group
        assert proc.wait(120) == 130
        err = proc.stderr.read()
        assert "Traceback" not in err and "leaked semaphore" not in err
        assert _still_running(mark) == []
    finally:
        proc.kill()
        proc.wait()


def test_torchrun_launch_generates_what_one_process_does_and_exits():
    import subprocess

    def run(*extra: str, torchrun: int = 0) -> subprocess.CompletedProcess:
        return subprocess.run(_tinyinfer("generate", "ROMEO:", "--runner", "torch", "--device", "cpu",
                                         "--max-tokens", "12", "--temperature", "0", *extra, torchrun=torchrun),
                              capture_output=True, text=True, env=env, timeout=300)

    env, mark = _marked_env()
    split = run("--tensor-parallel", "2", torchrun=2)
    assert split.returncode == 0, split.stderr
    assert split.stdout == run().stdout  # rank 1 printed nothing of its own
    assert "Traceback" not in split.stderr
    assert _still_running(mark) == []


def test_torchrun_with_another_process_count_is_refused_on_every_rank():
    import subprocess

    env, mark = _marked_env()
    result = subprocess.run(_tinyinfer("generate", "hi", "--runner", "torch", "--device", "cpu",
                                       "--tensor-parallel", "4", torchrun=2),
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "torchrun started 2 processes but tensor_parallel is 4" in result.stderr
    assert _still_running(mark) == []


def test_all_reduce_choices_and_their_refusals(monkeypatch):
    from tinyinfer.runners import triton_env
    from tinyinfer.runners.tp.shard import pick_all_reduce

    assert pick_all_reduce("auto", "cpu", [0, 1]) == "nccl"  # gloo's all-reduce on CPU
    assert pick_all_reduce("auto", "cuda", None) == "nccl"  # ranks on several hosts
    # GPUs of one host that read each other's memory (told so: this machine has none)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    for triton, choice in ((True, "push"), (False, "symm_mem")):  # push is a Triton kernel
        monkeypatch.setattr(triton_env, "installed", lambda triton=triton: triton)
        assert pick_all_reduce("auto", "cuda", [0, 1]) == choice
    with pytest.raises(TinyInferError, match="push' is a Triton kernel"):
        pick_all_reduce("push", "cuda", [0, 1])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) != (1, 0))
    assert pick_all_reduce("auto", "cuda", [0, 1]) == "nccl"
    monkeypatch.undo()
    for kind in ("symm_mem", "push"):
        with pytest.raises(TinyInferError, match="needs CUDA"):
            tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu", all_reduce=kind)
    with pytest.raises(TinyInferError, match="must be one of"):
        tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu", all_reduce="ring")


@pytest.mark.parametrize("flags, message", [
    (("--all-reduce", "nccl"), "apply to a model split with --tensor-parallel"),
    (("--tensor-parallel", "2", "--all-reduce", "symm_mem"), "needs CUDA"),
    (("--tensor-parallel", "2", "--all-reduce", "push"), "needs CUDA"),
])
def test_cli_all_reduce_flags_are_checked(flags, message):
    import subprocess

    result = subprocess.run(_tinyinfer("generate", "hi", "--runner", "torch", "--device", "cpu", *flags),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr
