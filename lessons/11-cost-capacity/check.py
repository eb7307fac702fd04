"""Lesson 11 checker: your arithmetic against the simulator (tinyinfer.simulate.model) on real presets."""

from __future__ import annotations

from types import ModuleType

from lessons.checking import Checklist, expect_close, expect_equal
from tinyinfer.simulate.model import Scenario, model_preset, parameter_counts, simulate

checks = Checklist()

SCENARIOS = (
    dict(model="llama-3-8b", hardware="h100-sxm", batch=8),
    dict(model="mistral-7b", hardware="l4", weight_precision="int4", prompt_tokens=2000, output_tokens=500),
    dict(model="llama-2-70b", hardware="a100-80gb", batch=4),
    dict(model="mixtral-8x7b", hardware="h200", batch=32, utilization=0.3),
)


def sim(**knobs: object):
    knobs = dict(knobs)
    return simulate(Scenario.of(knobs.pop("model"), knobs.pop("hardware"), **knobs))


@checks.case("Llama-2-7B, Llama-2-70B, Mixtral 8x7B (2 of 8 experts per token)", "flops_per_token",
             "2 FLOPs (a multiply and an add) per active parameter")
def flops(ex: ModuleType) -> None:
    for name in ("llama-2-7b", "llama-2-70b", "mixtral-8x7b"):
        active = parameter_counts(model_preset(name)).active
        expect_close(ex.flops_per_token(active), 2 * active, f"flops_per_token({active:,}) for {name}")


@checks.case("four models on four GPUs, one of which cannot hold its weights", "max_concurrent",
             "floor((memory * memory_utilization - weights) / (kv_per_token * tokens)), and never below 0")
def capacity(ex: ModuleType) -> None:
    for knobs in SCENARIOS:
        s = sim(**knobs)
        sc = s.scenario
        got = ex.max_concurrent(sc.hardware.memory_bytes, sc.memory_utilization, s.weight_memory.value,
                                s.kv_bytes_per_token.value, sc.prompt_tokens + sc.output_tokens)
        expect_equal(got, int(s.max_concurrent.value), f"max_concurrent for {sc.model.title} on {sc.hardware.title}")


@checks.case("a batch sweep of Llama-3-8B on an H100, floors of 20, 60 and 500 tok/s", "users_served",
             "keep batches that fit (<= max_concurrent) and are fast enough; return the largest, or 0")
def users(ex: ModuleType) -> None:
    base = sim(model="llama-3-8b", hardware="h100-sxm", prompt_tokens=2000, output_tokens=2000)
    speeds = {b: sim(model="llama-3-8b", hardware="h100-sxm", prompt_tokens=2000, output_tokens=2000,
                     batch=b).user_tokens_per_second.value for b in (1, 4, 16, 64, 256)}
    cap = int(base.max_concurrent.value)
    for floor in (20.0, 60.0, 500.0):
        want = max((b for b, v in speeds.items() if b <= cap and v >= floor), default=0)
        expect_equal(ex.users_served(dict(speeds), cap, floor), want,
                     f"users_served(speeds by batch {{{', '.join(f'{b}: {v:.0f}' for b, v in speeds.items())}}}, "
                     f"max_concurrent={cap}, floor={floor:.0f})")


@checks.case("the simulator's $ per million tokens, at full and at 30% use", "cost_per_million_tokens",
             "price per second x seconds / (tokens x utilization) x 1e6")
def cost(ex: ModuleType) -> None:
    for knobs in SCENARIOS:
        s = sim(**knobs)
        sc = s.scenario
        tokens = sc.batch * (sc.prompt_tokens + sc.output_tokens)
        expect_close(ex.cost_per_million_tokens(sc.price, s.e2e_latency.value, tokens, sc.utilization),
                     s.cost_per_million.value, f"cost_per_million_tokens for {sc.model.title} on {sc.hardware.title}",
                     rtol=1e-9)


@checks.case("break-even against API prices of $0.10 and $0.60 per million", "breakeven_utilization",
             "at utilization u the cost is cost_at_full_use / u; solve cost = api price for u")
def breakeven(ex: ModuleType) -> None:
    for api in (0.10, 0.60):
        s = sim(model="llama-3-8b", hardware="h100-sxm", batch=32, api_price_per_million=api)
        expect_close(ex.breakeven_utilization(s.cost_per_million.value, api), s.breakeven_utilization.value,
                     f"breakeven_utilization(${s.cost_per_million.value:.3f}, ${api:.2f})", rtol=1e-9)
