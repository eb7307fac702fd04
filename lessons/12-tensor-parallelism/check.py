"""Lesson 12 checker: your splits against the engine's shard_weights; your all-reduce against a plain
sum; your step time against the simulator's (tinyinfer.simulate.model) on real presets."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.checking import (
    CaseFailed,
    Checklist,
    expect,
    expect_close,
    expect_equal,
    expect_raises,
)
from lessons.support import tiny_config, tiny_model
from tinyinfer.runners.numpy_ref import linear, silu
from tinyinfer.runners.tp.shard import shard_weights
from tinyinfer.simulate.model import Scenario, Simulation, model_preset, simulate
from tinyinfer.simulate.steps import all_reduce_count, rates

checks = Checklist()

SHAPE = dict(hidden=64, heads=8, kv_heads=4)  # intermediate 128: splits over 1, 2, 4 and 8 ranks
COLUMN, ROW = ("q", "k", "v", "gate", "up"), ("o", "down")


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    return tiny_model(seed, **SHAPE).runner.w


def compare_shards(ex: ModuleType, split: str, names: tuple[str, ...]) -> None:
    """The student's shard of every named weight equals the engine's, for every rank of 2 and 4."""
    config, weights = tiny_config(**SHAPE), tiny_weights()
    for world in (2, 4):
        for rank in range(world):
            engine = shard_weights(config, weights, rank, world)
            for name in (f"layers.{layer}.{n}.weight" for layer in range(config.num_layers) for n in names):
                got = getattr(ex, split)(weights[name], rank, world)
                expect_close(got, engine[name], f"{split}({name} {weights[name].shape}, rank={rank}, world={world})",
                             rtol=0, atol=0)


def mlp_weights(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A hidden state x [5, D] and layer 0's gate, up and down of the small model."""
    w = tiny_weights(seed)
    x = np.random.default_rng(seed).standard_normal((5, SHAPE["hidden"])).astype(np.float32)
    return x, w["layers.0.gate.weight"], w["layers.0.up.weight"], w["layers.0.down.weight"]


def step_inputs(s: Simulation) -> dict[str, float]:
    """decode_step_time's arguments, read from the simulator's own derivation of TPOT."""
    sc, tpot = s.scenario, s.tpot.inputs
    read = sum(tpot[part].inputs["memory_time"].inputs["bytes"].value  # type: ignore[union-attr]
               for part in ("linear_time", "attention_time"))
    r = rates(sc.hardware, sc.efficiency, sc.num_gpus, "bf16")
    return dict(bytes_per_step=read, bandwidth=sc.hardware.memory_bandwidth * sc.efficiency.bandwidth,
                world=sc.num_gpus, num_layers=sc.model.config.num_layers,
                message_bytes=sc.batch * sc.model.config.hidden_size * r.act_bytes.value,
                latency=r.all_reduce_latency.value, link_bandwidth=sc.hardware.link_bandwidth)


def expect_step_times(ex: ModuleType, model: str, hardware: str, batch: int, gpu_counts: tuple[int, ...]) -> None:
    for gpus in gpu_counts:
        s = simulate(Scenario.of(model, hardware, batch=batch, num_gpus=gpus))
        args = step_inputs(s)
        shown = ", ".join(f"{k}={v:.4g}" for k, v in args.items())
        expect_close(ex.decode_step_time(**args), s.tpot.value,
                     f"decode_step_time({shown}) for {s.scenario.model.title} on {gpus} x {s.scenario.hardware.title}",
                     rtol=1e-3)


@checks.case("q, k, v, gate, up of a small Llama (8 heads, 4 KV heads), every rank of 2 and 4", "column_parallel",
             "rank r keeps weight[r * out // world : (r + 1) * out // world], all input columns")
def column_shards(ex: ModuleType) -> None:
    compare_shards(ex, "column_parallel", COLUMN)


@checks.case("8 output rows over 3 ranks", "column_parallel",
             "every rank must own a whole share: raise ValueError when out % world != 0")
def column_uneven(ex: ModuleType) -> None:
    expect_raises(ValueError, lambda: ex.column_parallel(np.zeros((8, 4)), 0, 3), "column_parallel([8, 4], 0, 3)")


@checks.case("o and down of the same model, every rank of 2 and 4", "row_parallel",
             "rank r keeps weight[:, r * in // world : (r + 1) * in // world], all output rows")
def row_shards(ex: ModuleType) -> None:
    compare_shards(ex, "row_parallel", ROW)


@checks.case("8 input columns over 3 ranks", "row_parallel",
             "every rank must own a whole share: raise ValueError when in % world != 0")
def row_uneven(ex: ModuleType) -> None:
    expect_raises(ValueError, lambda: ex.row_parallel(np.zeros((4, 8)), 0, 3), "row_parallel([4, 8], 0, 3)")


@checks.case("each rank's partial equals the engine shard's, on 2 and 4 ranks", "mlp_partials",
             "rank r: h = silu(x @ gate_r.T) * (x @ up_r.T), then h @ down_r.T with your column / row shards")
def mlp_each_rank(ex: ModuleType) -> None:
    config = tiny_config(**SHAPE)
    x, gate, up, down = mlp_weights(1)
    names = {"layers.0.gate.weight": gate, "layers.0.up.weight": up, "layers.0.down.weight": down}
    for world in (2, 4):
        got = ex.mlp_partials(x, gate, up, down, world)
        if got is None or len(got) != world:
            raise CaseFailed(f"mlp_partials(x, gate, up, down, world={world}) should return {world} partials",
                             f"a list of {world} arrays [5, {SHAPE['hidden']}]", repr(got)[:120])
        for rank in range(world):
            w = {k.split(".")[2]: v for k, v in shard_weights(config, names, rank, world).items()}
            want = linear(silu(linear(x, w["gate"])) * linear(x, w["up"]), w["down"])
            expect_close(got[rank], want, f"rank {rank}'s partial of {world}", rtol=1e-4, atol=1e-5)


@checks.case("the partials add up to the whole MLP (one all-reduce), seeds 2-4", "mlp_partials",
             "no rank may need another's intermediate units: SiLU(gate) * up is elementwise")
def mlp_sum(ex: ModuleType) -> None:
    for seed in (2, 3, 4):
        x, gate, up, down = mlp_weights(seed)
        whole = linear(silu(linear(x, gate)) * linear(x, up), down)
        for world in (1, 2, 8):
            total = np.sum(np.asarray(ex.mlp_partials(x, gate, up, down, world), dtype=np.float64), axis=0)
            expect_close(total, whole, f"sum of mlp_partials(world={world}), seed {seed}", rtol=1e-4, atol=1e-5)


@checks.case("Llama-2-70B (80 layers), Llama-3-8B (32), a model of 8 layers, on 1, 2, 4 and 8 ranks",
             "all_reduce_count", "one for the embedding, then one after o and one after down in every layer; "
             "a single rank needs none")
def count(ex: ModuleType) -> None:
    for name in ("llama-2-70b", "llama-3-8b", None):
        config = model_preset(name).config if name else tiny_config(layers=8)
        for world in (1, 2, 4, 8):
            want = 0 if world == 1 else int(all_reduce_count(config).value)
            expect_equal(ex.all_reduce_count(config.num_layers, world), want,
                         f"all_reduce_count({config.num_layers}, {world})")


def expect_sum(ex: ModuleType, partials: list[np.ndarray], what: str) -> list[int]:
    """Every rank's result equals the plain sum; returns the bytes each rank sent."""
    want = np.sum(np.stack(partials).astype(np.float64), axis=0)
    out = ex.ring_all_reduce([p.copy() for p in partials])
    if not isinstance(out, tuple) or len(out) != 2:
        raise CaseFailed(f"{what} should return (results, bytes sent per rank)", "a tuple of 2", repr(out)[:120])
    results, sent = out
    expect_equal(len(results), len(partials), f"{what}: number of results (one per rank)")
    for rank, result in enumerate(results):
        expect_close(result, want, f"{what}: rank {rank}'s result", rtol=1e-5, atol=1e-5)
    expect_equal(len(sent), len(partials), f"{what}: number of byte counts (one per rank)")
    return [int(b) for b in sent]


@checks.case("2, 4 and 5 ranks, [16, 40] float32: the sum, and 2 (N - 1) / N of the message sent", "ring_all_reduce",
             "N - 1 reduce-scatter steps and N - 1 all-gather steps, each sending one chunk (message / N bytes)")
def ring_even(ex: ModuleType) -> None:
    rng = np.random.default_rng(5)
    for n in (2, 4, 5):
        partials = [rng.standard_normal((16, 40)).astype(np.float32) for _ in range(n)]
        sent = expect_sum(ex, partials, f"ring_all_reduce of {n} ranks")
        message = partials[0].nbytes
        expect_equal(sent, [2 * (n - 1) * message // n] * n, f"bytes each of {n} ranks sent ({message} B message)")


@checks.case("3 ranks, 100 float64 values (chunks of 34, 33 and 33)", "ring_all_reduce",
             "np.array_split(flat, N) allows uneven chunks; still, all ranks together send 2 (N - 1) messages")
def ring_uneven(ex: ModuleType) -> None:
    rng = np.random.default_rng(6)
    partials = [rng.standard_normal(100) for _ in range(3)]
    sent = expect_sum(ex, partials, "ring_all_reduce of 3 ranks")
    expect_equal(sum(sent), 2 * 2 * partials[0].nbytes, "bytes sent by all 3 ranks together")
    expect(all(2 * 2 * 33 * 8 <= b <= 2 * 2 * 34 * 8 for b in sent),
           "each rank sends 2 (N - 1) = 4 chunks of 33 or 34 values", f"bytes sent per rank: {sent}")


@checks.case("a single rank", "ring_all_reduce", "with N = 1 there are no steps: the result is the input, 0 bytes sent")
def ring_one(ex: ModuleType) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    expect_equal(expect_sum(ex, [x], "ring_all_reduce of 1 rank"), [0], "bytes sent by the only rank")


@checks.case("Llama-2-70B on 1, 2, 4 and 8 H200s (batch 1): the simulator's TPOT", "decode_step_time",
             "bytes_per_step / world / bandwidth + all_reduce_count(num_layers, world) x "
             "(latency + 2 (world - 1) / world x message_bytes / link_bandwidth)")
def step_70b(ex: ModuleType) -> None:
    expect_step_times(ex, "llama-2-70b", "h200", 1, (1, 2, 4, 8))


@checks.case("Llama-3-8B on 2 and 4 H100s at batch 8 (a bigger message)", "decode_step_time",
             "the message grows with the batch; each GPU sends 2 (world - 1) / world of it per all-reduce")
def step_8b(ex: ModuleType) -> None:
    expect_step_times(ex, "llama-3-8b", "h100-sxm", 8, (2, 4))


@checks.case("hand-made step times, unsorted counts, tolerance 5% and 0", "best_gpu_count",
             "fastest = min(times); return the smallest count whose time <= fastest * (1 + tolerance)")
def best_fixed(ex: ModuleType) -> None:
    for times, tolerance, want in (({1: 10.0, 2: 6.0, 4: 5.9, 8: 7.0}, 0.05, 2),
                                   ({1: 10.0, 2: 6.0, 4: 5.9, 8: 7.0}, 0.0, 4),
                                   ({8: 1.0, 2: 3.0, 4: 1.04, 1: 5.0}, 0.05, 4),
                                   ({1: 5.2, 2: 8.4, 4: 7.8}, 0.05, 1)):
        expect_equal(ex.best_gpu_count(dict(times), tolerance), want, f"best_gpu_count({times}, {tolerance})")


@checks.case("the simulator's TPOT for Llama-3-8B and Llama-2-70B on 1-8 H200s (counts that fit)", "best_gpu_count",
             "only the counts given are candidates; among those within tolerance of the fastest, the fewest")
def best_simulated(ex: ModuleType) -> None:
    for name in ("llama-3-8b", "llama-2-70b"):
        sims = {n: simulate(Scenario.of(name, "h200", num_gpus=n)) for n in (1, 2, 4, 8)}
        times = {n: s.tpot.value for n, s in sims.items() if s.max_concurrent.value >= 1}
        fastest = min(times.values())
        want = min(n for n, t in times.items() if t <= fastest * 1.05)
        shown = "{" + ", ".join(f"{n}: {1e3 * t:.2f} ms" for n, t in times.items()) + "}"
        expect_equal(ex.best_gpu_count(times), want, f"best_gpu_count({shown}) for {name}")
