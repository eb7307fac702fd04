"""The measurement code itself: workloads are reproducible and the metrics mean what they say."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import tinyinfer
from tinyinfer.bench import shapes as bs
from tinyinfer.bench import workloads as bench


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


def cli(*args: str, python: str = "") -> subprocess.CompletedProcess:
    """`tinyinfer ARGS` in a fresh interpreter, after running ``python`` in it."""
    code = f"import sys\n{python}\nfrom tinyinfer.cli.commands import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)


def table_cells(text: str) -> list[list[str]]:
    """A table's lines split where columns meet (two or more spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]


def test_peer_without_transformers_is_one_line_exit_2():
    # sys.modules[name] = None makes `import transformers` raise ImportError, as when it is absent
    done = cli("bench", "latency", "--peer", "transformers", python="sys.modules['transformers'] = None")
    assert done.returncode == 2
    assert done.stderr == ("tinyinfer: error: --peer transformers needs the transformers package "
                           "(pip install 'tinyinfer[test]' or transformers)\n")


def test_latency_table_with_a_peer_has_no_nan_and_separate_columns(oracle_model):
    folder, peer = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder)
    results = [bs.bench_latency(model, prompt_tokens=8, decode_tokens=4, repeats=1),
               bs.peer_latency(peer, model.config.vocab_size, prompt_tokens=8, decode_tokens=4, repeats=1)]
    text = bs.latency_table(results)
    assert "nan" not in text
    header, rule, ours, theirs, note = text.splitlines()
    header, rule, ours, theirs = table_cells("\n".join([header, rule, ours, theirs]))
    assert len(rule) == len(ours) == len(theirs) == len(header)
    assert theirs[header.index("p95 ms")] == theirs[header.index("roofline %")] == "–"
    assert theirs[header.index("request tok/s")] != "–"  # the peer's whole generate call
    assert json.loads(json.dumps(bs.as_dict(results[1])))["roofline_pct"] is None  # valid JSON, no NaN
    assert note.startswith(f"{results[0].label}: roofline = ")  # only rows with a roofline explain it


def test_latency_roofline_bytes_are_the_weights_plus_kv_at_the_mean_context(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder)
    result = bs.bench_latency(model, prompt_tokens=8, decode_tokens=4, repeats=1)
    kv = model.runner.info.kv_bytes_per_token(model.config) * (8 + 4 // 2)
    assert result.kv_bytes_per_step == kv
    assert result.bytes_per_step == model.runner.info.weight_bytes + kv
    note = bs.latency_table([result]).splitlines()[-1]
    assert f"{model.runner.info.weight_bytes / 1e9:.3f} GB of weights" in note
    assert f"{kv / 1e9:.3f} GB of K/V at the mean context (10 tokens)" in note
    assert result.warmup_s is not None and result.warmup_s > 0
    assert result.request_tokens_per_s is not None and result.request_tokens_per_s > 0


def test_batching_table_columns_never_run_together(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    text = bench.batching_table(bench.bench_batching(tinyinfer.load(folder), num_requests=6, max_num_seqs=2))
    header, rule, *rows = table_cells(text)
    assert len(rows) == len(bench.BATCHING_MODES)
    assert all(len(row) == len(header) == len(rule) for row in rows)


def test_throughput_lengths_fit_the_context():
    low, high = bs.offline_lengths(1024)
    assert (low, high) == (100, 512)
    assert bs.offline_lengths(8192) == bs.OFFLINE_LENGTHS
    workload = bs.offline_workload(64, 320, low, high, seed=0)
    assert all(len(r.prompt_ids) + r.max_tokens <= 1024 for r in workload)


def test_throughput_on_the_bundled_model_runs_without_flags_beyond_a_small_workload(tmp_path):
    # seed 5's request is 720 + 336 tokens at full length: past the bundled model's 1024
    out = tmp_path / "throughput.json"
    done = cli("bench", "throughput", "--requests", "1", "--seed", "5", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "lengths drawn from 100..512 instead of 100..1024" in done.stderr
    record, = json.loads(out.read_text())
    assert record["requests"] == 1 and record["output_tokens"] > 0
    assert set(record["threads"]) == {"blas", "torch"}


def test_latency_of_a_folder_quantized_as_it_loads_names_its_format(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    model, peer = bs.folder_models(str(folder), "numpy", None, None, with_peer=False, quantize="int4-g32")
    assert peer is None and model.quantization.name == "int4-g32"
    result = bs.bench_latency(model, prompt_tokens=8, decode_tokens=4, repeats=1)
    assert result.weights == "int4-g32"
    header, _, row, _note = table_cells(bs.latency_table([result]))
    assert row[header.index("weights")] == "int4-g32"
    float_model, _ = bs.folder_models(str(folder), "numpy", None, None, with_peer=False)
    assert bs.weights_name(float_model) == "float32"


def test_a_preset_quantized_for_the_bench_holds_codes_of_its_format():
    import torch

    from tinyinfer.runners import torch_layers as layers

    model, _ = bs.shape_models("gpt2", "cpu", "float32", max_len=64, quantize="int8")
    assert model.quantization.name == "int8"
    weights = model.runner.w.layers
    assert all(isinstance(layer.mlp_in[0], layers.Int8Weight) for layer in weights)
    assert weights[0].qkv[0].codes.data_ptr() != weights[1].qkv[0].codes.data_ptr()  # a copy per layer
    assert isinstance(model.runner.w.head, torch.Tensor)  # the head stays float
    result = bs.bench_throughput(model, bs.offline_workload(2, model.config.vocab_size, 4, 8, seed=0))
    assert result.weights == "int8" and result.output_tokens > 0


def test_quantize_with_a_transformers_peer_is_refused_in_one_line():
    done = cli("bench", "latency", "--preset", "gpt2", "--device", "cpu", "--quantize", "int8",
               "--peer", "transformers")
    assert done.returncode == 2
    assert done.stderr == ("tinyinfer: error: --peer transformers runs float weights: measure it in a "
                           "run without --quantize\n")


def test_bench_speculative_reports_both_plain_baselines(tmp_path):
    """bench speculative divides by plain decoding as the speculative engine steps (each step read
    before the next is launched) and by plain decoding with asynchronous scheduling, its fastest:
    both rates on the line and in the JSON, each speedup the speculative rate over its baseline,
    and every run's greedy tokens the same."""
    out = tmp_path / "spec.json"
    done = cli("bench", "speculative", "--speculative", "lookup", "--task", "rewrite", "--max-tokens", "12",
               "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["identical"] and result["plain_async_tokens_per_second"] > 0
    for key, base in (("speedup", "plain_tokens_per_second"), ("speedup_vs_async", "plain_async_tokens_per_second")):
        assert result[key] == pytest.approx(result["speculative_tokens_per_second"] / result[base])
    line = re.search(r"plain ([\d.]+) tok/s \(asynchronous scheduling ([\d.]+)\), speculative ([\d.]+) tok/s "
                     r"\(([\d.]+)x; ([\d.]+)x asynchronous plain\)", done.stdout)
    assert line, done.stdout
    assert float(line[2]) == pytest.approx(result["plain_async_tokens_per_second"], abs=0.06)
    assert float(line[5]) == pytest.approx(result["speedup_vs_async"], abs=0.006)


def test_acceptance_without_the_oracle_or_out_of_range_is_refused_in_one_line():
    done = cli("bench", "speculative", "--acceptance", "0.8")
    assert done.returncode == 2
    assert done.stderr == ("tinyinfer: error: --acceptance sets the oracle drafter's rate: add "
                           "--speculative oracle\n")
    done = cli("bench", "speculative", "--speculative", "oracle", "--acceptance", "1.5")
    assert done.returncode == 2
    assert done.stderr == "tinyinfer: error: --acceptance must be within 0..1, got 1.5\n"


def test_quantize_with_tensor_parallel_presets_is_refused_in_one_line():
    done = cli("bench", "latency", "--preset", "gpt2", "--device", "cpu", "--quantize", "int8",
               "--tensor-parallel", "2")
    assert done.returncode == 2
    assert done.stderr == ("tinyinfer: error: tensor parallelism shards float weights: drop --quantize "
                           "or --tensor-parallel\n")


def test_latency_with_an_int8_kv_cache_names_it_and_counts_its_bytes(tmp_path):
    """`bench latency --kv-cache-dtype int8` on a preset: the row says int8 KV, and the roofline's
    bytes per step count K/V at one byte per value plus the float16 scales."""
    out = tmp_path / "latency.json"
    runs = {}
    for kv in ("auto", "int8"):
        done = cli("bench", "latency", "--preset", "gpt2", "--device", "cpu", "--dtype", "float32",
                   "--prompt-tokens", "16", "--max-tokens", "3", "--kv-cache-dtype", kv, "--json", str(out))
        assert done.returncode == 0, done.stderr
        runs[kv], = json.loads(out.read_text())
    assert runs["int8"]["label"] == "gpt2 / torch, int8 KV" and runs["auto"]["label"] == "gpt2 / torch"
    config, _ = bs.shape_config("gpt2", 64)
    tokens = 16 + 3 // 2  # the context the roofline counts: the prompt and half the new tokens
    saved = runs["auto"]["bytes_per_step"] - runs["int8"]["bytes_per_step"]  # same weights in both
    assert saved == (config.kv_bytes_per_token(4) - config.kv_bytes_per_token(1, 2)) * tokens


def test_oracle_drafter_is_accepted_at_the_asked_rate():
    """The oracle proposes the target's greedy tokens, each corrupted with chance 1 - α: over
    hundreds of examined draft tokens (seeded) the target keeps a share within four standard
    errors of α, the output stays the plain greedy output, and the bench compares the speedup
    with the simulator's closed form."""
    from tinyinfer.bench.oracle import OracleDrafter

    target, draft = tinyinfer.load("bundled", runner="torch"), tinyinfer.load("bundled-draft", runner="torch")
    prompts = bench.speculative_prompts(target, "continue")
    for alpha in (0.6, 0.9):
        drafter = OracleDrafter(draft, alpha, seed=1)
        result = bench.bench_speculative(target, drafter, prompts, max_tokens=96, num_draft=4)
        verify_steps = result.output_tokens / (result.mean_accepted + 1)
        examined = round(result.mean_accepted * verify_steps)  # accepted alone: fewer than examined
        tolerance = 4 * (alpha * (1 - alpha) / 300) ** 0.5  # at least 300 examined tokens
        assert result.identical and result.asked_acceptance == alpha
        assert abs(result.token_acceptance - alpha) <= tolerance, (alpha, result.token_acceptance)
        assert result.acceptance_rate < result.token_acceptance  # drafts after a rejection unexamined
        assert examined >= 300 and result.closed_form_speedup > 0


def test_latency_with_async_scheduling_names_it_and_reports_no_idle_share_off_the_gpu(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder, runner="torch")
    results = [bs.bench_latency(model, prompt_tokens=8, decode_tokens=4, repeats=1, async_scheduling=flag)
               for flag in (False, True)]
    header, _, plain, overlapped, *_ = table_cells(bs.latency_table(results))
    assert overlapped[0] == plain[0] + ", async scheduling"
    # The device-idle share needs CUDA events: a CPU run leaves it blank rather than guess.
    assert plain[header.index("device idle %")] == overlapped[header.index("device idle %")] == "–"
    assert results[1].async_scheduling and results[1].device_idle_pct is None


@pytest.mark.parametrize("options", [["--speculative", "lookup"], ["--num-draft", "2", "--task", "rewrite"],
                                     ["--acceptance", "0.5"], ["--acceptance", "0"]])
def test_speculative_options_are_refused_for_other_workloads(options):
    """An option only bench speculative reads is an error elsewhere, not silently ignored."""
    done = cli("bench", "latency", *options)
    flags = [o for o in options if o.startswith("--")]
    verb, them = ("applies", "it") if len(flags) == 1 else ("apply", "them")
    assert done.returncode == 2
    assert done.stderr == (f"tinyinfer: error: {', '.join(flags)} {verb} to bench speculative only: drop {them} "
                           "for bench latency\n")


@pytest.mark.parametrize("workload, options, message", [
    ("batching", ["--max-tokens", "8", "--prompt-tokens", "16"],
     "--prompt-tokens applies to bench latency only; --max-tokens applies to bench latency and speculative: "
     "drop them for bench batching"),
    ("prefix", ["--preset", "gpt2"],
     "--preset applies to bench latency, throughput and speculative: drop it for bench prefix"),
    ("batching", ["--peer", "transformers"], "--peer applies to bench latency and throughput: drop it for bench batching"),
    ("speculative", ["--peer", "transformers"],
     "--peer applies to bench latency and throughput: drop it for bench speculative"),
    ("prefix", ["--max-tokens", "8"], "--max-tokens applies to bench latency and speculative: drop it for bench prefix"),
    ("prefix", ["--decode-tokens", "8"], "--max-tokens applies to bench latency and speculative: drop it for bench prefix"),
    ("latency", ["--system-tokens", "64"], "--system-tokens applies to bench prefix only: drop it for bench latency"),
    ("latency", ["--requests", "4", "--max-num-seqs", "2"],
     "--requests, --max-num-seqs apply to bench batching and throughput: drop them for bench latency"),
    ("speculative", ["--requests", "4"], "--requests applies to bench batching and throughput: drop it for bench speculative"),
])
def test_workload_options_are_refused_where_the_workload_does_not_read_them(workload, options, message):
    """Every option that only some workloads read is an error elsewhere (one line, nothing run),
    not silently ignored: bench batching --max-tokens 8 used to run its own lengths."""
    done = cli("bench", workload, *options)
    assert done.returncode == 2
    assert done.stderr == f"tinyinfer: error: {message}\n"
    assert done.stdout == ""


def test_async_scheduling_is_refused_where_bench_cannot_use_it():
    done = cli("bench", "prefix", "--async-scheduling")
    assert done.returncode == 2
    assert done.stderr == ("tinyinfer: error: --async-scheduling applies to bench latency, throughput "
                           "and speculative: drop it for bench prefix\n")
    done = cli("bench", "speculative", "--speculative", "lookup", "--async-scheduling")
    assert done.returncode == 2
    assert done.stderr == ("tinyinfer: error: --async-scheduling overlaps speculative steps with a draft "
                           "model only: drop it, or pass --speculative draft or oracle\n")


def test_bench_speculative_with_async_scheduling_launches_the_draft_ahead_and_says_so(tmp_path):
    """bench speculative --async-scheduling: the speculative engine launches a draft model's next
    rounds behind each verification; the line and the JSON say so, the tokens are plain greedy's."""
    out = tmp_path / "spec.json"
    done = cli("bench", "speculative", "--speculative", "draft", "--async-scheduling", "--max-tokens", "16",
               "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["identical"] and result["async_scheduling"] is True
    assert "draft drafter, asynchronous scheduling, k=4" in done.stdout
