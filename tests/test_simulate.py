"""The simulator: formulas pinned to hand-computed values, the field's rules of thumb, the CLI,
and calibration fitted on real (small) measurements of this CPU."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import pytest

from tinyinfer.errors import TinyInferError
from tinyinfer.simulate.model import (
    HARDWARE,
    MODEL_CONFIGS,
    Efficiency,
    Scenario,
    Simulation,
    SimulationError,
    bytes_per_weight,
    kv_bytes_per_token,
    model_preset,
    parameter_counts,
    simulate,
    sweep,
    weight_bytes,
)
from tinyinfer.simulate.presets import H200_LINK_MEASUREMENTS
from tinyinfer.simulate.quantity import Quantity, derive, evaluate, format_value, given

GB = 1e9


def sim(model: str, hardware: str, **knobs) -> Simulation:
    return simulate(Scenario.of(model, hardware, **knobs))


def part(step: Quantity, name: str) -> Quantity:
    """The linear or attention part of a step time, e.g. part(s.tpot, 'linear')."""
    return step.inputs[f"{name}_time"]


def weights_read(s: Simulation) -> Quantity:
    return part(s.tpot, "linear").inputs["memory_time"].inputs["bytes"]


# ---------------------------------------------------------------- formulas, by hand


def test_llama2_70b_kv_cache_at_32k_fp16_is_10_7_gb():
    s = sim("llama-2-70b", "h100", kv_precision="fp16", prompt_tokens=32768 - 256, output_tokens=256,
            num_gpus=4)
    assert s.kv_bytes_per_token.value == 2 * 80 * 8 * 128 * 2
    assert s.kv_per_sequence.value == 2 * 80 * 8 * 128 * 2 * 32768 == 10_737_418_240
    assert s.kv_per_sequence.human() == "10.7 GB"
    assert s.kv_for_batch.value == s.kv_per_sequence.value  # batch 1


def test_llama2_7b_weights_fp16_are_13_5_gb():
    model = model_preset("llama-2-7b")
    assert model.config.num_parameters == 6_738_415_616  # the published count
    q = weight_bytes(model, "fp16")
    assert q.value == 2 * 6_738_415_616
    assert q.human() == "13.5 GB"


def test_published_parameter_counts():
    counts = {name: parameter_counts(model_preset(name)).total for name in MODEL_CONFIGS}
    assert counts["gpt2"] == 124_439_808
    assert counts["llama-2-70b"] == 68_976_648_192
    assert counts["llama-3-8b"] == 8_030_261_248
    assert round(counts["qwen2.5-7b"] / 1e9, 2) == 7.62
    assert round(counts["mistral-7b"] / 1e9, 2) == 7.25


def test_mixtral_total_and_active_parameters():
    model = model_preset("mixtral-8x7b")
    assert (model.num_experts, model.experts_per_token) == (8, 2)
    p = parameter_counts(model)
    dense = model.config.num_parameters  # config_from_dict sees one MLP per layer
    expert = 32 * 3 * 4096 * 14336
    router = 32 * 4096 * 8
    assert p.total == dense + 7 * expert + router == 46_702_792_704
    assert p.active == dense + 1 * expert + router == 12_879_925_248
    # Memory holds every expert; a decode step at batch 1 reads only the two it routes to.
    s = sim("mixtral-8x7b", "h100", num_gpus=2)
    assert s.weight_memory.value == pytest.approx(2 * p.total)
    assert weights_read(s).inputs["experts_touched"].value == 2
    big = sweep(Scenario.of("mixtral-8x7b", "h100", num_gpus=2), "batch", [256])[0]
    assert weights_read(big).inputs["experts_touched"].value == pytest.approx(8 * (1 - 0.75 ** 256))


def test_int_formats_pay_for_their_scales():
    assert bytes_per_weight("int4", 128).value == 0.5 + 2 / 128
    assert bytes_per_weight("int4", 32, zero_points=True).value == 0.5 + 2.5 / 32
    assert bytes_per_weight("bf16").value == 2
    p = parameter_counts(model_preset("llama-2-7b"))
    assert weight_bytes(model_preset("llama-2-7b"), "int8").value == \
        p.quantizable * (1 + 2 / 4096) + p.kept * 2  # per output row
    assert weight_bytes(model_preset("llama-2-7b"), "fp32").value == 4 * p.total
    with pytest.raises(SimulationError, match="int4"):
        bytes_per_weight("int3")


def test_prefill_and_decode_by_hand():
    s = sim("llama-2-7b", "h100", prompt_tokens=1000, output_tokens=200)
    p = parameter_counts(model_preset("llama-2-7b"))
    flops_rate, bandwidth = 989e12 * 0.6, 3.35e12 * 0.8
    matmul = p.attention + p.mlp_per_expert + p.head
    linear = part(s.ttft, "linear")
    assert linear.value == pytest.approx(2 * matmul * 1000 / flops_rate)
    assert part(s.ttft, "attention").value == pytest.approx(2 * 32 * 32 * 128 * 1000 ** 2 / flops_rate)
    assert s.prefill_bound == "compute"
    read = 2 * (p.total - p.embedding)  # every weight but the embedding table (the head is untied)
    kv_read = 2 * 32 * 32 * 128 * 2 * (1000 + 200 / 2)
    assert s.tpot.value == pytest.approx(read / bandwidth + kv_read / bandwidth)
    assert s.decode_bound == "memory"
    assert s.e2e_latency.value == pytest.approx(s.ttft.value + 199 * s.tpot.value)


def test_knee_batch_is_where_decode_turns_compute_bound():
    base = Scenario.of("llama-3-8b", "h100", prompt_tokens=256, output_tokens=64)
    knee = simulate(base).knee_batch.value
    # Weight bytes per parameter (2) ÷ FLOPs per parameter per token (2) × the machine balance.
    assert knee == pytest.approx(989e12 * 0.6 / (3.35e12 * 0.8), rel=0.02)
    below, above = sweep(base, "batch", [math.floor(knee), math.ceil(knee) + 1])
    assert below.decode_bound == "memory" and above.decode_bound == "compute"
    # Attention reads each sequence's own KV cache: it stays memory-bound at any batch.
    attention = part(above.tpot, "attention").inputs
    assert attention["memory_time"].value > attention["compute_time"].value
    # 4-bit weights read 4x fewer bytes per FLOP: the knee comes about 4x sooner.
    int4 = simulate(Scenario.of("llama-3-8b", "h100", weight_precision="int4")).knee_batch.value
    assert knee / 4.5 < int4 < knee / 3


def test_speculative_decoding_from_acceptance_rate():
    s = sim("llama-2-7b", "h100", spec_k=4, spec_acceptance=0.8)
    assert s.spec_tokens_per_step.value == pytest.approx((1 - 0.8 ** 5) / (1 - 0.8))
    # Free drafts and a memory-bound verify of 5 tokens: the speedup is nearly the tokens per step.
    assert 0.9 * s.spec_tokens_per_step.value < s.spec_speedup.value <= s.spec_tokens_per_step.value
    perfect = sim("llama-2-7b", "h100", spec_k=3, spec_acceptance=1.0)
    assert perfect.spec_tokens_per_step.value == 4
    drafted = sim("llama-2-70b", "h100", num_gpus=4, spec_k=4, spec_acceptance=0.8, draft_model="llama-2-7b")
    assert drafted.spec_tpot.inputs["draft_step_time"].value > 0
    assert 1 < drafted.spec_speedup.value < s.spec_speedup.value


def test_tensor_parallel_adds_communication():
    one = sim("llama-2-13b", "h100")
    two = sim("llama-2-13b", "h100", num_gpus=2)
    assert two.weight_memory.value == one.weight_memory.value
    assert one.tpot.inputs["comm_time"].value == 0
    comm = two.tpot.inputs["comm_time"]
    # The H100 link is the datasheet's: one fixed latency, no hop latency measured.
    assert comm.value == pytest.approx((2 * 40 + 1) * (8e-6 + 2 * 1 / 2 * 1 * 5120 * 2 / 450e9))
    assert two.tpot.value < one.tpot.value  # twice the bandwidth outweighs 80 all-reduces here
    with pytest.raises(SimulationError, match="divide"):
        sim("gpt2", "h100", num_gpus=8)
    with pytest.raises(SimulationError, match="at most 1"):
        sim("llama-2-7b", "m2-max", num_gpus=2)


def test_comm_makes_two_all_reduces_a_layer_and_one_for_the_embedding():
    s = sim("llama-2-70b", "h200", num_gpus=4, prompt_tokens=512, output_tokens=128)
    comm = s.tpot.inputs["comm_time"]
    assert comm.inputs["all_reduces"].formula == "2 * layers + 1"
    assert comm.inputs["all_reduces"].value == 161
    wire = comm.inputs["wire_time"]
    h200 = HARDWARE["h200"]
    latency = h200.link_latency + 2 * 3 * h200.link_hop_latency
    assert wire.value == pytest.approx(latency + 2 * 3 / 4 * 8192 * 2 / h200.link_bandwidth)
    assert comm.value == pytest.approx(161 * wire.value)  # an ideal engine adds nothing to the wire


def test_engine_terms_of_tensor_parallelism_show_in_the_formulas(capsys):
    e = Efficiency(all_reduce_wait=0.5e-6, collective_overhead=30e-6)
    s = sim("llama-3-8b", "h200", num_gpus=2, efficiency=e)
    comm, host = s.tpot.inputs["comm_time"], s.tpot.inputs["host_time"]
    wire = comm.inputs["wire_time"].value
    assert comm.value == pytest.approx(65 * (wire + 0.5e-6 * 65))
    assert host.value == pytest.approx(65 * 30e-6)
    assert "all_reduces × collective_overhead" in host.explain()
    one = sim("llama-3-8b", "h200", efficiency=e)
    assert one.tpot.inputs["host_time"].value == 0  # one device: no all-reduces, nothing to pay
    out = run_cli(["--model", "llama-3-8b", "--hardware", "h200", "--tensor-parallel", "4", "--all-reduce-wait-us", "0.5",
                   "--collective-overhead-us", "30", "--explain", "tpot"], capsys)
    assert "all_reduces × (wire_time + engine_wait)" in out and "all_reduce_wait × all_reduces" in out
    assert "link_latency + 2 × (gpus - 1) × link_hop_latency" in out
    assert "tp_gpu_check_2026-11-26-h200x4.json" in out  # where the H200 link constants come from
    with pytest.raises(SimulationError, match="overheads"):
        sim("llama-3-8b", "h200", num_gpus=2, efficiency=Efficiency(all_reduce_wait=-1e-6))


def test_memory_fit_notes_and_max_concurrency():
    s = sim("llama-2-70b", "h100")
    assert s.max_concurrent.value == 0
    assert any("do not fit" in n for n in s.notes)
    fits = sim("llama-3-8b", "h100", batch=8, prompt_tokens=2048, output_tokens=2048)
    room = 80e9 * 0.9 - fits.weight_memory.value
    assert fits.max_concurrent.value == math.floor(room / (2 * 32 * 8 * 128 * 2 * 4096))
    assert not fits.notes


def test_quantity_formulas_are_what_computes_the_value():
    q = derive("kv", "B", "2 * layers * kv_heads * head_dim * kv_bytes",
               layers=80, kv_heads=8, head_dim=128, kv_bytes=given("kv_bytes", 2, "B"))
    assert q.value == 327680
    assert q.substituted() == "2 × 80 × 8 × 128 × 2 B"
    assert "2 × layers × kv_heads" in q.explain()
    with pytest.raises(ValueError, match="missing"):
        derive("x", "", "a * b", a=1)
    with pytest.raises(ValueError, match="not simple arithmetic"):
        evaluate("__import__('os').getcwd()", {})
    assert format_value(10_737_418_240, "B") == "10.7 GB"
    assert format_value(0.0253, "s") == "25.3 ms"


def test_every_number_explains_itself_down_to_givens():
    s = sim("llama-2-70b", "h100", num_gpus=2, spec_k=3, api_price_per_million=1.0)
    for _, q in s.rows():
        json.dumps(q.to_dict())
        text = q.explain()
        assert text.startswith(q.name)
    tree = s.quantity("tpot").explain()
    assert "3.35 TB/s" in tree and "NVIDIA H100" in tree and "2 × layers × kv_heads" in tree
    with pytest.raises(SimulationError, match="choose one of"):
        s.quantity("nope")


def test_bad_inputs_raise_errors_that_say_what_to_do():
    with pytest.raises(TinyInferError, match="use one of"):
        Scenario.of("llama-9", "h100")
    with pytest.raises(TinyInferError, match="aliases"):
        Scenario.of("llama-2-7b", "tpu")
    with pytest.raises(SimulationError, match="batch must be at least 1"):
        sim("llama-2-7b", "h100", batch=0)
    with pytest.raises(SimulationError, match="precision"):
        sim("llama-2-7b", "h100", kv_precision="int4")
    with pytest.raises(SimulationError, match="acceptance"):
        sim("llama-2-7b", "h100", spec_k=2, spec_acceptance=1.5)


def test_model_from_a_folder(tmp_path):
    _, _, raw = MODEL_CONFIGS["llama-2-7b"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    s = sim(str(tmp_path), "h100")
    assert s.total_parameters.value == 6_738_415_616


# ---------------------------------------------------------------- the field's rules of thumb


def test_c4_kv_cache_of_a_70b_model_at_32k():
    """C4 holds for the GQA 70B models (8 KV heads); a 13B without GQA needs more."""
    for name in ("llama-2-70b", "llama-3-70b"):
        kv = kv_bytes_per_token(model_preset(name).config, "fp16").value * 32768
        assert 10 * GB <= kv <= 20 * GB
    mha = kv_bytes_per_token(model_preset("llama-2-13b").config, "fp16").value * 32768
    assert mha > 20 * GB


def test_c11_quantization_memory_of_a_7b_model():
    model = model_preset("llama-2-7b")
    assert 13 * GB <= weight_bytes(model, "bf16").value <= 15 * GB  # ~14 GB at 16-bit
    assert 3.5 * GB <= weight_bytes(model, "int4").value <= 4.5 * GB  # ~4 GB at 4-bit


def test_c6_decode_speed_by_hardware_for_a_7b_model():
    """Llama-2-7B, 16-bit, one request, default efficiencies (60% compute, 80% bandwidth)."""
    speed = {hw: sim("llama-2-7b", hw, prompt_tokens=512).user_tokens_per_second.value for hw in HARDWARE}
    assert 5 <= speed["laptop-cpu"] <= 15
    assert 30 <= speed["rtx-4090"] <= 80
    for hw in ("h100-sxm", "h200", "a100-80gb"):
        assert speed[hw] >= 100
    assert speed["l4"] < 30  # a datacenter GPU that misses "100+": 300 GB/s
    cpu_int4 = sim("llama-2-7b", "laptop-cpu", weight_precision="int4", prompt_tokens=512)
    assert cpu_int4.user_tokens_per_second.value > 15  # 4-bit on a CPU beats the claimed range


def test_c5_time_to_first_token():
    assert sim("llama-3-8b", "h100", prompt_tokens=1000).ttft.value < 0.2
    assert 0.2 <= sim("llama-2-70b", "h100", num_gpus=4, prompt_tokens=4000).ttft.value <= 0.5
    assert sim("llama-2-7b", "laptop-cpu", prompt_tokens=500).ttft.value > 2


def test_c14_one_h100_serving_a_70b_model():
    """~40 tok/s for one request needs 8-bit weights; 20+ users at 2K tokens need 4-bit."""
    int8 = sim("llama-2-70b", "h100", weight_precision="int8", prompt_tokens=1536, output_tokens=512)
    assert 30 <= int8.user_tokens_per_second.value <= 50
    assert int8.max_concurrent.value < 20
    int4 = sim("llama-2-70b", "h100", weight_precision="int4", batch=20, prompt_tokens=1536,
               output_tokens=512)
    assert int4.max_concurrent.value >= 20
    assert int4.tpot.value <= 0.05  # acceptable: at least 20 tokens/s for every user


def test_c15_a_70b_model_costs_about_ten_times_a_7b_model():
    big, small = sim("llama-2-70b", "h100", num_gpus=2), sim("llama-2-7b", "h100")
    flops = [part(s.tpot, "linear").inputs["compute_time"].inputs["flops"].value for s in (big, small)]
    assert 9 <= flops[0] / flops[1] <= 11
    assert 9 <= big.weight_memory.value / small.weight_memory.value <= 11


def test_c20_self_hosting_pays_off_above_a_utilization():
    """Llama-3-8B on an H100 at $3/h against an API charging $0.20 per million tokens."""
    busy = Scenario.of("llama-3-8b", "h100", batch=64, api_price_per_million=0.20)
    s = simulate(busy)
    u = s.breakeven_utilization.value
    assert 0 < u < 1
    at_breakeven = simulate(Scenario.of("llama-3-8b", "h100", batch=64, utilization=u))
    assert at_breakeven.cost_per_million.value == pytest.approx(0.20)
    lonely = simulate(Scenario.of("llama-3-8b", "h100", batch=1, api_price_per_million=0.20))
    assert lonely.breakeven_utilization.value > 1  # one user at a time never pays off


# ---------------------------------------------------------------- the command line


def run_cli(argv: list[str], capsys) -> str:
    from tinyinfer.cli import simulate as cli_simulate

    parser = argparse.ArgumentParser(prog="tinyinfer")
    cli_simulate.add_parser(parser.add_subparsers(dest="command"))
    assert cli_simulate.run(parser.parse_args(["simulate", *argv])) == 0
    return capsys.readouterr().out


def test_cli_table_for_the_issue_example(capsys):
    out = run_cli(["--model", "llama-2-70b", "--hardware", "h100", "--context", "32768",
                   "--max-num-seqs", "16", "--tensor-parallel", "4", "--explain", "kv_per_sequence"], capsys)
    assert "KV cache per sequence" in out and "10.7 GB" in out
    assert "kv_per_sequence = kv_bytes_per_token × (prompt + output)" in out
    assert "2 × 80 × 8 × 128 × 2 B" in out
    assert "does not fit" in out  # 16 sequences of 32K need 172 GB of KV


def test_cli_sweep_plots_every_batch(capsys):
    out = run_cli(["--model", "llama-3-8b", "--sweep", "batch", "--values", "1,16,256,1024"], capsys)
    rows = [line.split()[0] for line in out.splitlines()[2:6]]
    assert rows == ["1", "16", "256", "1024"]
    assert "█" in out and "compute-bound" in out and "compute knee" in out


def test_cli_list_and_json(capsys):
    out = run_cli(["--list"], capsys)
    assert "mixtral-8x7b" in out and "12.9B params active" in out and "laptop-cpu" in out
    data = json.loads(run_cli(["--model", "gpt2", "--hardware", "cpu", "--json", "-"], capsys))
    assert data["weight_memory"]["value"] == pytest.approx(2 * 124_439_808)


def test_cli_context_must_leave_a_prompt():
    from tinyinfer.cli import simulate as cli_simulate

    parser = argparse.ArgumentParser()
    cli_simulate.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--context", "100", "--max-tokens", "256"])
    with pytest.raises(SimulationError, match="leaves no prompt"):
        cli_simulate.run(args)


# ---------------------------------------------------------------- calibration


def test_nnls_is_least_squares_with_non_negative_unknowns():
    from tinyinfer.simulate.calibrate import nnls

    rows = [[1, 1], [1, 2], [1, 3]]
    assert nnls(rows, [5, 8, 11]) == pytest.approx([2, 3])  # y = 2 + 3x exactly
    assert nnls(rows, [1, 3, 5]) == pytest.approx([0, 22 / 14])  # intercept -1 is not allowed
    assert nnls(rows, [10, 9, 8]) == pytest.approx([9, 0])  # a falling line: the mean, flat


@pytest.fixture(scope="module")
def cpu_measurements():
    """Real measurements of this CPU: microbenchmarks and a tiny Llama through the engine."""
    pytest.importorskip("torch")
    from tinyinfer.bench import measure
    from tinyinfer.simulate import calibrate as cal

    try:
        import tinyinfer.runners.torch_fast  # noqa: F401
        import tinyinfer.runners.torch_weights  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"the torch runner is not importable here: {exc}")
    tiny = cal.model_from_hf("tiny", {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256})
    micro = measure.measure_device("cpu", "fp32", nbytes=4 << 20, n=128)
    cases = [cal.CalibrationCase(tiny, 1, 16, 4), cal.CalibrationCase(tiny, 4, 48, 4),
             cal.CalibrationCase(tiny, 8, 16, 4), cal.CalibrationCase(tiny, 2, 96, 4, fit=False)]
    return cal, micro, measure.measure_engine(cases, "cpu", "fp32")


def test_calibration_on_real_cpu_measurements(cpu_measurements):
    from tinyinfer.bench.measure import hardware_for

    cal, micro, timings = cpu_measurements
    assert micro.copy_bandwidth > 1e6 and micro.matmul_flops > 1e6
    assert all(t.ttft > 0 and t.tpot > 0 for t in timings)
    hardware = hardware_for(micro)
    assert hardware.memory_bandwidth == micro.copy_bandwidth
    base = cal.fit_efficiency(hardware, micro, [])
    assert base == Efficiency(compute=1.0, attention=1.0, bandwidth=1.0)  # peaks: the measured rates
    fitted = cal.fit_efficiency(hardware, micro, timings)
    overheads = (fitted.step_overhead, fitted.prefill_seq_overhead, fitted.sample_cost)
    assert min(overheads) >= 0 and 0 < fitted.bandwidth <= 1.5 and 0 < fitted.compute <= 1.5

    def median_error(efficiency: Efficiency) -> float:
        rows = cal.compare(hardware, "fp32", efficiency, [t for t in timings if t.case.fit])
        return statistics.median(abs(c.error) for c in rows)

    # The roofline alone misses the engine's per-step costs; the fit accounts for them.
    assert median_error(fitted) < median_error(base)
    rows = cal.compare(hardware, "fp32", fitted, timings)
    assert [c.metric for c in rows] == ["TTFT", "TPOT"] * 4
    assert [c.fitted for c in rows[-2:]] == [False, False]
    report = cal.calibration_report(cal.Calibration(micro, hardware, fitted, rows))
    assert "--bandwidth-efficiency" in report and "held out" in report


# ---------------------------------------------------------------- tensor-parallel calibration (recorded)

RECORDED_TP = Path(__file__).resolve().parents[1] / H200_LINK_MEASUREMENTS


def test_tp_calibration_rows_load_from_the_json():
    from tinyinfer.simulate.calibrate_tp import load_recorded

    rec = load_recorded(RECORDED_TP)
    assert rec.device == "4 x NVIDIA H200" and rec.date == "2026-11-26"
    assert sorted({(p.gpus, p.nbytes) for p in rec.sweep}) == [
        (g, n) for g in (2, 4) for n in (2 << 10, 8 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20,
                                          16 << 20, 64 << 20)]
    assert [(r.label, r.fit) for r in rec.runs] == [
        ("llama-3-8b TP=1", True), ("llama-3-8b TP=2", True), ("llama-3-8b TP=4", True),
        ("llama-2-70b TP=4", False)]  # only the 8B also ran on one GPU: the 70B is held out
    raw = json.loads(RECORDED_TP.read_text())
    eight = rec.runs[1]
    assert eight.tpot == raw["llama3_8b_tp2"]["tpot_p50_ms"] / 1e3
    assert eight.comm == raw["llama3_8b_tp2"]["all_reduce_ms"] / 1e3
    assert (eight.precision, eight.prompt_tokens, eight.output_tokens) == ("bf16", 512, 128)


def test_h200_link_constants_are_the_fit_and_reproduce_the_sweep():
    """Within 15% for messages up to 256 KiB (decode) and from 16 MiB; 1-4 MiB, where NCCL changes
    protocol, run up to 35% slower than one latency and one bandwidth say."""
    from tinyinfer.simulate.calibrate_tp import (
        fit_link,
        load_recorded,
        predict_all_reduce,
    )

    rec = load_recorded(RECORDED_TP)
    h200 = HARDWARE["h200"]
    fitted = fit_link(h200, rec)
    for name in ("link_latency", "link_hop_latency", "link_bandwidth"):
        assert getattr(h200, name) == pytest.approx(getattr(fitted, name), rel=5e-3)  # rounded to 3 digits
    smallest = {p.gpus: p.seconds for p in rec.sweep if p.nbytes == 2 << 10}
    for gpus in (2, 4):  # the latency grows with the ring: 2 (gpus - 1) hops
        assert predict_all_reduce(h200, gpus, 2 << 10) == pytest.approx(smallest[gpus], rel=0.01)
    for p in rec.sweep:
        error = predict_all_reduce(h200, p.gpus, p.nbytes) / p.seconds - 1
        assert abs(error) < (0.15 if p.nbytes <= 256 << 10 or p.nbytes >= 16 << 20 else 0.35), p


def test_tp_calibration_fits_this_engine_and_predicts_the_held_out_70b(capsys):
    from tinyinfer.simulate.calibrate_tp import calibrate_recorded

    cal = calibrate_recorded(RECORDED_TP)
    e = cal.efficiency
    assert 0.7 < e.bandwidth < 0.9 and e.step_overhead > 0
    assert e.all_reduce_wait > 0 and e.collective_overhead > 0
    assert [(c.run.label, c.metric) for c in cal.comparisons] == [
        ("llama-3-8b TP=1", "TPOT"), ("llama-3-8b TP=2", "TPOT"), ("llama-3-8b TP=2", "comm"),
        ("llama-3-8b TP=4", "TPOT"), ("llama-3-8b TP=4", "comm"), ("llama-2-70b TP=4", "TPOT"),
        ("llama-2-70b TP=4", "comm")]
    for c in cal.comparisons:
        assert abs(c.error) < 0.10, c  # the held-out 70B included
        if c.run.gpus > 1:  # the wire alone misses most of this engine's tensor-parallel cost
            assert c.wire_only < 0.5 * c.measured
    out = run_cli(["--calibrate", str(RECORDED_TP)], capsys)
    assert "--all-reduce-wait-us" in out and "held out" in out and "64 MiB" in out


def test_tp_calibration_says_what_is_wrong_with_a_bad_file(tmp_path):
    from tinyinfer.simulate.calibrate_tp import load_recorded

    with pytest.raises(SimulationError, match="tp_gpu_check.py"):
        load_recorded(tmp_path / "missing.json")
    (tmp_path / "one.json").write_text(json.dumps({"device": "NVIDIA H200", "gpus": 1}))
    with pytest.raises(SimulationError, match="TP=1"):
        load_recorded(tmp_path / "one.json")


RECORDED_TP_PROFILED = Path(__file__).resolve().parents[1] / "docs/tp_scaling_2026-11-26-h100x4-final.json"


def test_tp_calibration_takes_profiled_runs_whose_collectives_were_untimed(capsys):
    """The engine's default runs time no collectives: a profile stage's collective kernel time is
    their all-reduce time, its median all-reduce kernel the wire (no sweep was recorded), and the
    preset keeps its bandwidth (8 KB messages say nothing about it)."""
    from tinyinfer.simulate.calibrate_tp import calibrate_recorded

    raw = json.loads(RECORDED_TP_PROFILED.read_text())
    cal = calibrate_recorded(RECORDED_TP_PROFILED)
    assert [(r.label, r.fit) for r in cal.recorded.runs] == [
        ("llama-3-8b TP=1", True), ("llama-3-8b TP=2", True), ("llama-3-8b TP=4", True)]
    tp2 = raw["8b_tp2_symm_mem_profile"]
    assert cal.recorded.runs[1].comm == tp2["profile"]["collective_kernel_ms_per_step"] / 1e3
    assert {(p.gpus, p.nbytes) for p in cal.recorded.sweep} == {(2, 8192), (4, 8192)}
    assert cal.hardware.link_bandwidth == HARDWARE["h100-sxm"].link_bandwidth
    assert cal.efficiency.collective_overhead > 0
    for c in cal.comparisons:
        assert abs(c.error) < 0.05, c
    out = run_cli(["--calibrate", str(RECORDED_TP_PROFILED)], capsys)
    assert "no message of 1 MiB or more was timed" in out and "--collective-overhead-us" in out


RECORDED_TP_PAIR = Path(__file__).resolve().parents[1] / "docs/tp_scaling_2026-11-26-h100x2.json"


def test_tp_calibration_reads_a_scaling_summary_and_either_scheduling(capsys):
    """tp_scaling.sh's summary (each group's recording by group) reads as one recording; its
    _async stages hold a step-by-step run and one with asynchronous scheduling, each fitted as
    its own engine (the same model, kernels and collectives; the host's time differs)."""
    from tinyinfer.simulate.calibrate_tp import calibrate_recorded

    raw = json.loads(RECORDED_TP_PAIR.read_text())
    tp2 = raw["8b_tp2_symm_mem_async_profile"]["8b_tp2_symm_mem_async_profile"]
    tpot = {}
    for asynchronous in (False, True):
        cal = calibrate_recorded(RECORDED_TP_PAIR, asynchronous)
        assert cal.recorded.device == "2 x NVIDIA H100 80GB HBM3"
        assert [r.label for r in cal.recorded.runs] == ["llama-3-8b TP=1", "llama-3-8b TP=2"]
        assert cal.recorded.runs[1].comm == tp2["profile"]["collective_kernel_ms_per_step"] / 1e3
        tpot[asynchronous] = cal.recorded.runs[1].tpot
        for c in cal.comparisons:
            assert abs(c.error) < 0.05, c
    assert tpot == {False: tp2["tpot_p50_ms"] / 1e3, True: tp2["async"]["tpot_p50_ms"] / 1e3}
    out = run_cli(["--calibrate", str(RECORDED_TP_PAIR), "--async-scheduling"], capsys)
    assert "asynchronous scheduling" in out and "--collective-overhead-us" in out
    with pytest.raises(SimulationError, match="no runs made with asynchronous scheduling"):
        calibrate_recorded(RECORDED_TP_PROFILED, asynchronous=True)


@pytest.mark.parametrize("preset", ["llama-2-7b", "llama-3-8b", "gpt2"])
def test_simulated_weight_memory_equals_the_quantizers_byte_count(preset):
    # The simulator estimates from parameter counts (config only); the weight-memory table
    # (quant.memory_row) counts every byte the quantizer writes, layer by layer. Both take the
    # scale and zero-point sizes from quant.formats; pinned together here: exact, except that
    # the simulator gives every int8 row hidden_size inputs (down_proj rows are longer, so
    # they carry fewer scales than it counts: +0.03 % at most).
    from tinyinfer.quant import memory_row

    config = model_preset(preset).config
    for sim_name, quant_name in (("fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int4-g128")):
        exact = memory_row(config, quant_name).total_bytes
        assert weight_bytes(config, sim_name).value == pytest.approx(
            exact, rel=5e-4 if sim_name == "int8" else 1e-12), sim_name
    asymmetric = memory_row(config, "int4-g128-asym").total_bytes
    assert weight_bytes(config, "int4", zero_points=True).value == pytest.approx(asymmetric, rel=1e-12)


def test_variant_stages_of_a_recording_stay_out_of_the_calibration(tmp_path):
    # tp_gpu_check.py's diagnostic stages run a different engine (no event timers, NCCL
    # options): calibrating on them would bend the fit (an untimed run reports 0 ms of comm).
    import copy

    from tinyinfer.simulate.calibrate_tp import load_recorded

    data = json.loads(Path(RECORDED_TP).read_text())
    untimed = copy.deepcopy(data["llama3_8b_tp2"])
    untimed["all_reduce_ms"], untimed["runner"]["time_collectives"] = 0.0, False
    data["llama3_8b_tp2_untimed"] = untimed
    data["llama3_8b_tp2_no_mixing"] = copy.deepcopy(data["llama3_8b_tp2"])
    (tmp_path / "variants.json").write_text(json.dumps(data))
    assert load_recorded(tmp_path / "variants.json").runs == load_recorded(RECORDED_TP).runs
