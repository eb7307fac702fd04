"""Speculative decoding on one GPU: correctness checks, then timings (C10).

    PYTHONPATH=. python3 scripts/gpu_spec_bench.py --out $OUT [--only checks,bundled,oracle,exactness,profile]
        [--draft-quantize int4 --draft-quantize-head]

(--device cpu --target qwen2.5-0.5b --draft qwen2.5-0.5b --tokens 6 --prompts 1 runs the
oracle and bundled sections' code on a CPU, as a dry run.)

Sections (each writes its results to OUT/gpu_spec_bench.json as soon as it finishes):

* checks   the paged decode kernel with q = 5 query rows per sequence against the torch
           version, and row for row against q = 1 (bit equality); a verification step through
           a CUDA graph against the same step eager; greedy draft rounds replayed from one CUDA
           graph against the same function eager and the stepwise rule (argmaxes, K/V); graphs
           captured while dropped caches' graphs wait for the collector (capture_gc)
* bundled  plain vs speculative decoding of the bundled pair (draft model drafter, k = 2, 4), twice in
           the same process, with what each timed run compiled (Triton kernels, Dynamo frames);
           the second pass also with the draft's rounds launched one by one (the stepwise rule,
           as before the rounds ran in one graph), for a before/after in the same process
* oracle   llama-3-8b shape (random weights) as target, the llama-3.2-1b shape as draft model,
           the oracle drafter at acceptance 0.6 / 0.8 / 0.9 x k = 2 / 4 / 8, each against the
           simulator's closed form at the measured costs; the draft shape's own plain step time;
           beside the plain baseline (the engine as speculative decoding runs it, each step read
           before the next is launched), plain decoding with asynchronous scheduling, its fastest
           (the bundled and exactness sections' rows have both baselines too, one per section).
           With --draft-quantize FORMAT [--draft-quantize-head] the same rows again with the
           draft shape in that format (random codes), against the same plain baseline;
           --stepwise-too: each row's first alpha at each k again with the rounds one by one
* profile  where a speculative cycle's time goes: the oracle at the first of --alphas and of --ks
           (a = 0.8, k = 4 by default) with each draft
           (bf16, and --draft-quantize's), per cycle the draft rounds' span on the device, its
           wait before the verification, the verification's span and the wait after it until
           the next rounds, against the rounds graph and the verification graph replayed alone;
           and the host's turn in each cycle (the verification's result on the host to the next
           rounds replayed) split among the functions that run in it (HostTurns)
* exactness bf16 greedy speculative vs plain decoding, token for token: the bundled pair with
           and without batch_invariant (every prompt, k = 2, 4, 8), and the oracle's target shape
           with batch_invariant (the oracle drafter over the draft shape, timed as well)
* async_exact the asynchronous speculative engine (rounds launched behind each verification)
           against the synchronous one under the oracle at a = 0.8, k = 4 (the same tokens, and
           how many inputs the device chose), then the draft shape as its own draft model
           (batch_invariant): every guess kept, synchronous and asynchronous
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from tinyinfer.bench import shapes as bs
from tinyinfer.bench import workloads as bench
from tinyinfer.bench.oracle import OracleDrafter
from tinyinfer.engine import Engine
from tinyinfer.model import load
from tinyinfer.runners import torch_fast
from tinyinfer.runners.runner import AfterVerification, Rounds, launch_rounds_stepwise, make_batch
from tinyinfer.sampling import SamplingParams
from tinyinfer.speculative import DraftModelDrafter, SpeculativeStats

SECTIONS = ("checks", "bundled", "oracle", "exactness", "async_exact", "profile")
ARGS = argparse.Namespace()
SAVE = [lambda: None]  # writes the results so far


def log(text: str) -> None:
    print(text, flush=True)


def check_kernel(results: dict) -> None:
    """q = 5 rows per sequence: Triton vs torch (bf16, long contexts), and q = 5 vs q = 1 rows."""
    from tinyinfer.runners import torch_layers, torch_triton

    device, out = torch.device("cuda"), {}
    gen = torch.Generator(device=device).manual_seed(11)
    for heads, kv_heads, hd, batch in ((32, 8, 128, 1), (32, 8, 64, 4), (12, 12, 64, 3)):
        q_len, page, pages, length = 5, 16, 512, 1500
        k_cache, v_cache = torch.randn((2, pages, page, kv_heads, hd), generator=gen, device=device,
                                       dtype=torch.bfloat16).unbind(0)
        qkv = torch.randn((batch * q_len, (heads + 2 * kv_heads) * hd), generator=gen, device=device,
                          dtype=torch.bfloat16)
        first = torch.randint(0, length, (batch,), generator=gen, device=device)
        first[0] = length - q_len
        positions = (first[:, None] + torch.arange(q_len, device=device)).flatten()
        tables = torch.randperm(pages, generator=gen, device=device)[:batch * 100].view(batch, 100)
        seqs = torch.arange(batch, device=device).repeat_interleave(q_len)
        slots = tables[seqs, positions // page] * page + positions % page
        angles = torch.arange(4096, device=device, dtype=torch.float64)[:, None] * \
            torch.rand(hd // 2, generator=gen, device=device, dtype=torch.float64)
        cos, sin = angles.cos().float(), angles.sin().float()
        ref_cache = (k_cache.clone(), v_cache.clone())
        ref = torch_layers.paged_decode_attention(qkv, positions, slots, tables, *ref_cache, cos,
                                                  sin, heads).float()
        for splits in (None, 1):
            cache = (k_cache.clone(), v_cache.clone())
            got = torch_triton.paged_decode_attention(qkv, positions, slots, tables, *cache, cos, sin,
                                                      heads, num_splits=splits)
            err = float((got.float() - ref).norm() / ref.norm())
            same_cache = bool(torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1]))
            step_cache = (k_cache.clone(), v_cache.clone())
            rows_equal = True
            for j in range(q_len):  # the same tokens as q = 1 decode steps
                rows = torch.arange(batch, device=device) * q_len + j
                one = torch_triton.paged_decode_attention(qkv[rows], positions[rows], slots[rows],
                                                          tables, *step_cache, cos, sin, heads,
                                                          num_splits=splits)
                rows_equal &= bool(torch.equal(one, got[rows]))
            key = f"H{heads}/Hkv{kv_heads}/hd{hd}/B{batch}/q{q_len}/splits={splits or 'auto'}"
            out[key] = {"rel_error": err, "cache_identical": same_cache, "rows_equal_q1": rows_equal,
                        "ok": err <= 1e-2 and same_cache and rows_equal}
            log(f"  kernel {key}: rel error {err:.2e}, cache identical {same_cache}, "
                f"q=5 rows == q=1 rows: {rows_equal}")
    results["kernel"] = out


def check_graphs(results: dict) -> None:
    """A verification step (q = 5) replayed from a CUDA graph vs the same step eager."""
    graphed = load("bundled", runner="torch", device="cuda", dtype="bfloat16")
    eager = load("bundled", runner="torch", device="cuda", dtype="bfloat16", cuda_graphs=False)
    ids = np.random.default_rng(3).integers(0, graphed.config.vocab_size, 40).tolist()
    logits = []
    for model in (graphed, eager):
        runner, kv = model.runner, model.runner.new_kv_cache(8, 16)
        runner.forward(make_batch([(ids[:30], 0, [3, 1], False)], 16), kv)  # prefill
        out = [runner.forward(make_batch([(ids[30 + 5 * i:35 + 5 * i], 30 + 5 * i, [3, 1, 6], True)], 16), kv)
               for i in range(2)]  # two verification steps of 5 tokens
        logits.append(np.stack(out))
        if model is graphed:
            results["graph_check_captured_q"] = sorted(kv.graphs or {})
    diff = float(np.abs(logits[0] - logits[1]).max())
    results["graph_vs_eager"] = {"max_abs_diff": diff, "identical": bool(diff == 0.0),
                                 "same_argmax": bool((logits[0].argmax(-1) == logits[1].argmax(-1)).all())}
    log(f"  verify graph vs eager: {results['graph_vs_eager']}, graphs for q = {results['graph_check_captured_q']}")


def check_rounds(results: dict) -> None:
    """Greedy draft rounds (a 2-token catch-up, then 3 rounds, batch of 3) on the bundled draft
    in bf16: replayed from one CUDA graph, the same function eager (cuda_graphs=False), and the
    stepwise rule (one launch_top per round, each replayed from its decode graph)."""
    graphed = load("bundled-draft", runner="torch", device="cuda", dtype="bfloat16")
    eager = load("bundled-draft", runner="torch", device="cuda", dtype="bfloat16", cuda_graphs=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, graphed.config.vocab_size, n).tolist() for n in (30, 21, 44)]
    tables = [[3, 1, 6, 9], [0, 2, 7, 10], [4, 5, 8, 11]]
    out = {}
    for name, model, launch in (("graph", graphed, None), ("eager", eager, None),
                                ("stepwise", graphed, launch_rounds_stepwise)):
        runner, kv = model.runner, model.runner.new_kv_cache(16, 16)
        runner.forward(make_batch([(p, 0, t, False) for p, t in zip(prompts, tables)], 16), kv)
        ids = []
        for step in range(3):  # three proposals, the context growing by 2 tokens a step
            starts = [len(p) + 4 * step for p in prompts]
            first = make_batch([(rng_tokens, s, t, True) for rng_tokens, s, t in
                                zip(([7, 8], [9, 10], [11, 12]), starts, tables)], 16)
            positions = np.array([[s + 2 + r for s in starts] for r in range(3)])
            slots = np.array([[t[p // 16] * 16 + p % 16 for p, t in zip(row, tables)] for row in positions])
            rounds = Rounds(positions, slots)
            future = (launch(runner, first, kv, rounds) if launch else runner.launch_rounds(first, kv, rounds))
            ids.append(future.result())
        out[name] = (np.stack(ids), kv.k.float().cpu().numpy()[:, :12], kv.v.float().cpu().numpy()[:, :12])
        if name == "graph":
            results["rounds_check_captured"] = sorted(str(key) for key in (kv.round_graphs or {}))
    ref_ids, ref_k, ref_v = out["graph"]
    results["rounds_graph_vs"] = {
        name: {"same_ids": bool((ids == ref_ids).all()), "k_identical": bool((k == ref_k).all()),
               "v_identical": bool((v == ref_v).all()), "k_max_abs_diff": float(np.abs(k - ref_k).max())}
        for name, (ids, k, v) in out.items() if name != "graph"}
    log(f"  rounds graph vs: {results['rounds_graph_vs']}, captured {results['rounds_check_captured']}")


def check_capture_gc(results: dict) -> None:
    """Graphs captured while the graphs of dropped caches wait in reference cycles and the
    collector runs at nearly every allocation: a collection inside a capture would destroy one
    and fail the capture (torch_graphs.collection_paused keeps it out)."""
    model = load("bundled-draft", runner="torch", device="cuda", dtype="bfloat16")
    ids = np.random.default_rng(9).integers(0, model.config.vocab_size, 5).tolist()
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for _ in range(4):
            kv = model.runner.new_kv_cache(8, 16)
            model.runner.forward(make_batch([(ids, 0, [0, 1], True)], 16), kv)  # 5 rows: a graph
            del kv  # its graphs now wait in a cycle
        results["capture_gc"] = "ok"
    finally:
        gc.set_threshold(*threshold)
    log(f"  captures beside dropped graphs, collector at every allocation: {results['capture_gc']}")


def first_differences(plain: list[list[int]], spec: list[list[int]]) -> dict:
    """Token for token: how many outputs are identical, and where each first differs."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(plain, spec)]
    return {"identical_prompts": sum(f == len(x) for f, x in zip(first, plain)), "prompts": len(plain),
            "tokens_before_first_difference": first,
            "matching_prefix_share": sum(first) / sum(len(x) for x in plain)}


def on_the_verifications_path(drafter: OracleDrafter, big, prompts: list[list[int]], plain_ids: list[list[int]],
                              params: SamplingParams, k: int) -> list[list[int]]:
    """Point the oracle at the tokens the verification computes, as bench_speculative does: it
    follows plain decoding's, then the tokens of an untimed speculative pass over them (in bf16
    a k + 1-row verification may round off plain decoding's path, after which every guess of
    the plain tokens would be wrong). Returns the tokens it now follows."""
    drafter.follow(prompts, plain_ids)
    engine = Engine(big, max_num_seqs=1, detail="none", drafter=drafter, num_draft=k)
    followed = [engine.generate([p], params)[0].token_ids for p in prompts]
    drafter.follow(prompts, followed)
    return followed


def plain_async(model, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Plain decoding at its fastest, each prompt alone (step N + 1 launched before N is read:
    asynchronous scheduling): the baseline a section's speculative rows share."""
    return bench.greedy_alone(Engine(model, max_num_seqs=1, detail="none", async_scheduling=True),
                              prompts, ARGS.tokens, "plain, asynchronous")


def exactness(results: dict) -> None:
    """bf16 greedy, speculative vs plain, token for token, with and without batch_invariant:
    the bundled pair (its draft model, k = 2, 4, 8; every prompt alone, then all at once, plain
    and speculative, against each prompt's plain tokens alone), then the target shape with
    the oracle drafter over the draft shape (a = 0.8, k = 4 and a = 0.6, k = 8), timed too."""
    out: dict = {}
    results["exactness"] = out
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    draft = load("bundled-draft", runner="torch", device="cuda", dtype="bfloat16")
    for invariant in (True, False):
        target = load("bundled", runner="torch", device="cuda", dtype="bfloat16", batch_invariant=invariant)
        prompts = bench.speculative_prompts(target, "continue")[:ARGS.prompts or None]
        plain = [c.token_ids for c in Engine(target, max_num_seqs=1).generate(prompts, params)]
        for k in (2, 4, 8) if invariant and not ARGS.quick_exactness else (4,):
            engine = Engine(target, max_num_seqs=1, drafter=DraftModelDrafter(draft), num_draft=k)
            spec = [engine.generate([p], params)[0].token_ids for p in prompts]
            key = f"bundled k={k} batch_invariant={invariant}"
            out[key] = first_differences(plain, spec)
            log(f"  bf16 spec vs plain, {key}: {out[key]}")
        if ARGS.quick_exactness:
            continue
        # every prompt at once (decode steps of several sequences, verification of 4 x 5 rows),
        # plain and speculative, against the plain tokens of each prompt alone
        together = Engine(target, max_num_seqs=len(prompts))
        batched = Engine(target, max_num_seqs=len(prompts), drafter=DraftModelDrafter(draft), num_draft=4)
        for name, engine in (("plain", together), ("spec k=4", batched)):
            key = f"bundled {name}, {len(prompts)} prompts at once, batch_invariant={invariant}"
            out[key] = first_differences(plain, [c.token_ids for c in engine.generate(prompts, params)])
            log(f"  bf16 against plain alone, {key}: {out[key]}")
        SAVE[0]()
    del draft, target
    gc.collect()
    if ARGS.quick_exactness:
        return
    small, _ = bs.shape_models(ARGS.draft, ARGS.device, ARGS.dtype)
    big, _ = bs.shape_models(ARGS.target, ARGS.device, ARGS.dtype, batch_invariant=True)
    prompts = bench.speculative_prompts(big, "continue", ARGS.prompts or 4)
    plain = bench.greedy_alone(Engine(big, max_num_seqs=1, detail="none"), prompts, ARGS.tokens)
    out["target_plain_step_ms_batch_invariant"] = 1e3 * plain[1] / sum(len(o) for o in plain[0])
    fastest = plain_async(big, prompts)
    out["target_plain_async_step_ms_batch_invariant"] = 1e3 * fastest[1] / sum(len(o) for o in fastest[0])
    for alpha, k in ((0.8, 4), (0.6, 8)):
        r = bench.bench_speculative(big, OracleDrafter(small, alpha, seed=1), prompts, ARGS.tokens, k,
                                    plain=plain, plain_async=fastest)
        key = f"{ARGS.target} oracle a={alpha} k={k} batch_invariant=True"
        out[key] = {**dataclasses.asdict(r), "speedup": r.speedup, "speedup_vs_async_plain": r.speedup_vs_async}
        SAVE[0]()
        log(f"  {key}: identical {r.identical}, {r.speedup:.2f}x, acceptance {r.token_acceptance:.3f}, "
            f"draft {r.draft_step_ms:.2f} ms, verify {r.verify_ms:.2f} ms, plain {r.plain_step_ms:.2f} ms")


def checks(results: dict) -> None:
    for part in (check_kernel, check_graphs, check_rounds, check_capture_gc):
        if part.__name__.removeprefix("check_") not in ARGS.checks:
            continue
        try:
            part(results)
        except Exception:
            results[f"{part.__name__}_error"] = traceback.format_exc()
            log(results[f"{part.__name__}_error"])


class Compiles:
    """What was compiled while a block ran: Triton kernels (each compile or cache load, by the
    kernel's name) and Dynamo frames. A timed run should compile nothing."""

    def __enter__(self) -> dict:
        import triton

        self.seen: dict = {"triton": {}, "dynamo_frames": 0}
        self.frames = torch._dynamo.utils.counters["frames"]["ok"]

        def hook(**kwargs) -> bool:
            name = kwargs["repr"].split("[")[0]
            self.seen["triton"][name] = self.seen["triton"].get(name, 0) + 1
            return False  # compile as usual

        self.knobs = triton.knobs.runtime
        self.before = self.knobs.jit_cache_hook
        self.knobs.jit_cache_hook = hook
        return self.seen

    def __exit__(self, *exc) -> None:
        self.knobs.jit_cache_hook = self.before
        self.seen["dynamo_frames"] = torch._dynamo.utils.counters["frames"]["ok"] - self.frames


@contextlib.contextmanager
def rounds_stepwise(model, on: bool = True):
    """With ``on``, the model's runner launches greedy draft rounds one by one (the stepwise rule,
    launch_top per round fed on the device: how the rounds ran before they were one graph)."""
    if on:
        model.runner.launch_rounds = functools.partial(launch_rounds_stepwise, model.runner)
    try:
        yield
    finally:
        if on:
            del model.runner.launch_rounds


def bundled(results: dict) -> None:
    """The bundled pair, plain and k = 2, 4; each run's compiles recorded, and the whole
    section a second time in the same process (every shape met once)."""
    target = load("bundled", runner="torch", device=ARGS.device, dtype=ARGS.dtype)
    draft = load("bundled-draft", runner="torch", device=ARGS.device, dtype=ARGS.dtype)
    prompts = bench.speculative_prompts(target, "continue")[:ARGS.prompts or None]
    engine = Engine(target, max_num_seqs=1, detail="none")
    results["bundled"], results["bundled_again"] = [], []
    for key in ("bundled", "bundled_again"):
        with Compiles() as compiled:
            plain = bench.greedy_alone(engine, prompts, ARGS.tokens)
        results[f"{key}_plain_step_ms"] = 1e3 * plain[1] / sum(len(o) for o in plain[0])
        results[f"{key}_plain_compiles"] = compiled
        fastest = plain_async(target, prompts)
        results[f"{key}_plain_async_step_ms"] = 1e3 * fastest[1] / sum(len(o) for o in fastest[0])
        log(f"  {key} plain {results[f'{key}_plain_step_ms']:.3f} ms a token "
            f"({results[f'{key}_plain_async_step_ms']:.3f} asynchronous), compiled {compiled}")
        for k in (2, 4):
            for stepwise in (False, True) if key == "bundled_again" else (False,):
                with Compiles() as compiled, rounds_stepwise(draft, stepwise):
                    r = bench.bench_speculative(target, DraftModelDrafter(draft), prompts, ARGS.tokens, k,
                                                plain=plain, plain_async=fastest)
                results[key].append({**dataclasses.asdict(r), "speedup": r.speedup,
                                     "speedup_vs_async_plain": r.speedup_vs_async, "compiles": compiled,
                                     "draft_rounds": "stepwise" if stepwise else "one launch"})
                log(f"  {key} k={k}{' stepwise' if stepwise else ''}: {results[key][-1]}")
                SAVE[0]()


def draft_variants() -> list[tuple[str, str | None, bool]]:
    """(label, quantize, quantize_head) of each draft shape to run: bf16, then --draft-quantize's."""
    variants = [] if ARGS.no_bf16_draft and ARGS.draft_quantize else [("bf16", None, False)]
    if ARGS.draft_quantize:
        label = ARGS.draft_quantize + ("+head" if ARGS.draft_quantize_head else "")
        variants.append((label, ARGS.draft_quantize, ARGS.draft_quantize_head))
    return variants


def oracle(results: dict) -> None:
    big, _ = bs.shape_models(ARGS.target, ARGS.device, ARGS.dtype)
    prompts = bench.speculative_prompts(big, "continue", ARGS.prompts or 4)
    tokens = ARGS.tokens
    plain = bench.greedy_alone(Engine(big, max_num_seqs=1, detail="none"), prompts, tokens)
    results["target_plain_step_ms"] = 1e3 * plain[1] / sum(len(o) for o in plain[0])
    fastest = plain_async(big, prompts)
    results["target_plain_async_step_ms"] = 1e3 * fastest[1] / sum(len(o) for o in fastest[0])
    results["async_plain_identical"] = fastest[0] == plain[0]
    for label, quantize, head in draft_variants():
        suffix = "" if quantize is None else f"_{label}"
        small, _ = bs.shape_models(ARGS.draft, ARGS.device, ARGS.dtype, quantize=quantize,
                                   quantize_head=head)
        small_plain = bench.greedy_alone(Engine(small, max_num_seqs=1, detail="none"), prompts, tokens)
        results[f"draft_shape_plain_step_ms{suffix}"] = 1e3 * small_plain[1] / sum(len(o) for o in small_plain[0])
        log(f"  plain step: target {results['target_plain_step_ms']:.2f} ms, draft shape {label} "
            f"{results[f'draft_shape_plain_step_ms{suffix}']:.2f} ms")
        rows = []
        results[f"oracle{suffix}"] = rows
        for k in ARGS.ks:
            runs = [(a, False, s) for a in ARGS.alphas for s in ARGS.spec_scheduling]
            for alpha, stepwise, scheduling in runs + [(ARGS.alphas[0], True, "sync")] * ARGS.stepwise_too:
                with rounds_stepwise(small, stepwise):
                    r = bench.bench_speculative(big, OracleDrafter(small, alpha, seed=1), prompts, tokens, k,
                                                plain=plain, plain_async=fastest,
                                                spec_async=scheduling == "async")
                rows.append({**dataclasses.asdict(r), "speedup": r.speedup, "draft": label,
                             "speedup_vs_async_plain": r.speedup_vs_async,
                             "vs_closed_form": r.speedup / r.closed_form_speedup,
                             "draft_rounds": "stepwise" if stepwise else "one launch"})
                SAVE[0]()
                gc.collect()
                log(f"  oracle {label} a={alpha} k={k} {scheduling}{' stepwise' if stepwise else ''}: {r.speedup:.2f}x "
                    f"({rows[-1]['speedup_vs_async_plain']:.2f}x asynchronous plain; closed form "
                    f"{r.closed_form_speedup:.2f}x), identical {r.identical}, "
                    f"acceptance {r.token_acceptance:.3f}, draft {r.draft_step_ms:.2f} ms, verify "
                    f"{r.verify_ms:.2f} ms, rest {r.other_ms:.2f} ms, plain {r.plain_step_ms:.2f} ms")
        del small, small_plain
        gc.collect()
        torch.cuda.empty_cache()
    again = bench.greedy_alone(Engine(big, max_num_seqs=1, detail="none"), prompts, tokens)
    results["target_plain_step_ms_again"] = 1e3 * again[1] / sum(len(o) for o in again[0])


def replay_ms(graphs, size: int = 1, repeats: int = 50) -> float:
    """Median device time of one replay of a captured decode graph (CUDA events, back to back)."""
    graph, _ = graphs.graphs[size]
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def async_exact(results: dict) -> None:
    """Asynchronous speculative scheduling (the next rounds launched behind each verification,
    each sequence's inputs chosen on the device by what it accepts) against the same engine
    stepping synchronously, the oracle at a = 0.8, k = 4 with the last draft variant: the oracle
    fixes the guesses, so both verify the same tokens and must emit the same ones. Also whether
    the two-token catch-up's rounds graph ran (the device's choice, not the host's rule). Then
    the rounds themselves (``async_self``)."""
    big, _ = bs.shape_models(ARGS.target, ARGS.device, ARGS.dtype)
    label, quantize, head = draft_variants()[-1]
    small, _ = bs.shape_models(ARGS.draft, ARGS.device, ARGS.dtype, quantize=quantize, quantize_head=head)
    prompts = bench.speculative_prompts(big, "continue", 2)
    params = SamplingParams(temperature=0, max_tokens=ARGS.tokens, ignore_eos=True)
    plain_ids = [c.token_ids for c in Engine(big, max_num_seqs=1, detail="none").generate(prompts, params)]
    outputs, graphs, acceptance = {}, {}, {}
    choices = {"device": 0, "host": 0}  # how the rounds launched ahead got their inputs
    device_choice, host_choice = torch_fast.choose_after, AfterVerification.chosen

    def on_device(*args):
        choices["device"] += 1
        return device_choice(*args)

    def on_host(self):
        choices["host"] += 1
        return host_choice(self)

    followed = on_the_verifications_path(OracleDrafter(small, 0.8, seed=1), big, prompts, plain_ids, params, 4)
    torch_fast.choose_after, AfterVerification.chosen = on_device, on_host
    try:
        for scheduling in ("sync", "async"):
            drafter = OracleDrafter(small, 0.8, seed=1)
            drafter.follow(prompts, followed)
            engine = Engine(big, max_num_seqs=1, detail="none", drafter=drafter, num_draft=4,
                            async_scheduling=scheduling == "async")
            outputs[scheduling] = [engine.generate([p], params)[0].token_ids for p in prompts]
            graphs[scheduling] = sorted(engine.draft_run.kv_cache.round_graphs or {})
            acceptance[scheduling] = engine.spec_stats.token_acceptance
    finally:
        torch_fast.choose_after, AfterVerification.chosen = device_choice, host_choice
    results["async_exact"] = {"draft": label, "identical": outputs["sync"] == outputs["async"],
                              "tokens": sum(len(o) for o in outputs["sync"]), "choices": choices,
                              "token_acceptance": acceptance,
                              "round_graphs": {k: [list(g) for g in v] for k, v in graphs.items()}}
    log(f"  async vs sync speculative: identical {outputs['sync'] == outputs['async']}, graphs {graphs}, "
        f"inputs chosen {choices}, acceptance {acceptance}")
    del big, small, drafter, engine
    gc.collect()
    async_self(results["async_exact"])


def async_self(out: dict) -> None:
    """The rounds themselves, on the card: the draft shape (batch_invariant) as its own draft
    model, k = 4, synchronous and asynchronous. Every guess the draft makes is the target's own
    greedy token computed by the same kernels, so both must keep every guess (acceptance 1)
    and emit plain decoding's tokens; a round launched ahead from a wrong position or slot
    guesses something else and its acceptance drops (the oracle above fixes the guesses, so
    it cannot see this)."""
    invariant = ARGS.device.startswith("cuda")  # (a CPU dry run in float32 has no such kernels)
    target, draft = (bs.shape_models(ARGS.draft, ARGS.device, ARGS.dtype, batch_invariant=invariant)[0]
                     for _ in range(2))
    prompts = bench.speculative_prompts(target, "continue", 2)
    params = SamplingParams(temperature=0, max_tokens=ARGS.tokens, ignore_eos=True)
    plain_ids = [c.token_ids for c in Engine(target, max_num_seqs=1, detail="none").generate(prompts, params)]
    rows = {}
    for scheduling in ("sync", "async"):
        engine = Engine(target, max_num_seqs=1, detail="none", drafter=DraftModelDrafter(draft), num_draft=4,
                        async_scheduling=scheduling == "async")
        ids = [engine.generate([p], params)[0].token_ids for p in prompts]
        stats = engine.spec_stats
        rows[scheduling] = {"identical_to_plain": ids == plain_ids, "drafted": stats.drafted,
                            "accepted": stats.accepted, "acceptance": stats.acceptance_rate}
    out["self_draft"] = {"shape": ARGS.draft, "k": 4, "tokens": sum(len(o) for o in plain_ids), **rows}
    log(f"  the draft shape as its own draft: {out['self_draft']}")


def profile(results: dict) -> None:
    """Where a speculative cycle's time goes, for each draft (bf16, --draft-quantize's): the
    oracle at the first of --alphas and --ks over two prompts (profile_draft). If a cycle spans about its
    graphs' replays on the device, the host is off the critical path."""
    big, _ = bs.shape_models(ARGS.target, ARGS.device, ARGS.dtype)
    prompts = bench.speculative_prompts(big, "continue", 2)
    params = SamplingParams(temperature=0, max_tokens=ARGS.tokens, ignore_eos=True)
    out: dict = {}
    results["profile"] = out
    plain_ids = [c.token_ids for c in Engine(big, max_num_seqs=1, detail="none").generate(prompts, params)]
    for label, quantize, head in draft_variants():
        small, _ = bs.shape_models(ARGS.draft, ARGS.device, ARGS.dtype, quantize=quantize,
                                   quantize_head=head)
        for scheduling in ARGS.spec_scheduling:
            key = label if scheduling == "sync" else f"{label}_async"
            out[key] = profile_draft(big, small, prompts, plain_ids, params, scheduling == "async")
            log(f"  profile {key}: {json.dumps(out[key])}")
            SAVE[0]()
        del small
        gc.collect()
        torch.cuda.empty_cache()


def cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class HostTurns:
    """The host's turn of each speculative cycle, from the moment the verification's result is
    on the host to the moment the next rounds' graph is replayed, split among the functions
    that run in it (each one's time inside the turn, nested ones counted in their callers too):
    wrappers on the engine's, the draft run's, the scheduler's and the graphs' methods."""

    NAMES = (("engine", "generate"), ("engine", "step"), ("engine", "_greedy_advance"), ("engine", "_finish_step"),
             ("engine", "_run"), ("scheduler", "schedule"), ("engine", "_draft"), ("draft_run", "propose"),
             ("draft_run", "_catch_up"), ("draft_run", "_reserve"), ("draft_run", "_advance"),
             ("draft_run", "_propose_greedy"), ("small_runner", "launch_rounds"),
             ("small_runner", "_round_graphs"), ("graphs", "run"), ("graphs", "_stage"),
             ("drafter", "fixed_guesses"), ("engine", "_pack"), ("big_runner", "launch_top"),
             ("engine_module", "make_batch"), ("engine_module", "is_plain_greedy"),
             ("fast_module", "_uniform_tokens_per_seq"), ("fast_module", "_sat_out_after"),
             ("fast_module", "_tokens_future"), ("rounds", "__init__"), ("event", "record"),
             ("event", "synchronize"), ("event", "__new__"), ("pool", "slot"))

    def __init__(self, engine: Engine):
        from tinyinfer import engine as engine_module
        from tinyinfer.runners import torch_fast
        from tinyinfer.runners.torch_graphs import DecodeGraphs

        self.spans: list[tuple[str, float, float]] = []
        self.turn_marks: list[tuple[str, float]] = []  # ("result", t) / ("replay", t)
        owners = {"engine": engine, "scheduler": engine.scheduler, "draft_run": engine.draft_run,
                  "small_runner": engine.draft_run.runner, "big_runner": engine.model.runner,
                  "drafter": engine.drafter, "graphs": DecodeGraphs, "engine_module": engine_module,
                  "fast_module": torch_fast, "rounds": Rounds, "event": torch.cuda.Event,
                  "pool": engine.draft_run.pool}
        self.installed: list[tuple[object, str, object]] = []
        try:
            for owner_name, method in self.NAMES:
                self._wrap(owners[owner_name], method, f"{owner_name}.{method}")
            # the verification's result reaching the host, and the rounds graph's replay call
            self._wrap_result_marks(engine)
        except BaseException:
            self.remove()
            raise

    def _wrap(self, owner, method: str, label: str) -> None:
        original = getattr(owner, method, None)
        if original is None:  # a runner without it (the NumPy runner, in a dry run on a CPU)
            return
        spans = self.spans

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spans.append((label, start, time.perf_counter()))

        self.installed.append((owner, method, owner.__dict__.get(method)))
        setattr(owner, method, wrapped)

    def _wrap_result_marks(self, engine: Engine) -> None:
        runner, marks = engine.model.runner, self.turn_marks
        launch_top = runner.launch_top

        def launch_top_marked(*args, **kwargs):
            future = launch_top(*args, **kwargs)
            wait = future.result

            def result():
                value = wait()
                marks.append(("result", time.perf_counter()))
                return value
            future.result = result
            return future

        self.installed.append((runner, "launch_top", runner.__dict__.get("launch_top")))
        runner.launch_top = launch_top_marked
        from torch.cuda import CUDAGraph

        replay = CUDAGraph.replay

        def replay_marked(graph):
            marks.append(("replay", time.perf_counter()))
            return replay(graph)

        self.installed.append((CUDAGraph, "replay", CUDAGraph.__dict__.get("replay")))
        CUDAGraph.replay = replay_marked

    def remove(self) -> None:
        for owner, method, original in reversed(self.installed):
            if original is None:
                delattr(owner, method)
            else:
                setattr(owner, method, original)

    def breakdown(self) -> dict:
        """Medians over the cycles, in microseconds: the turn, and each function's time in it."""
        turns = []
        marks = self.turn_marks
        for (kind, t), nxt in zip(marks, marks[1:]):
            if kind == "result" and nxt[0] == "replay":
                turns.append((t, nxt[1]))
        per_turn = []
        for begin, end in turns:
            row = {"turn": end - begin}
            for label, a, b in self.spans:
                inside = min(b, end) - max(a, begin)
                if inside > 0:
                    row[label] = row.get(label, 0.0) + inside
            per_turn.append(row)
        labels = sorted({k for row in per_turn for k in row})
        return {"turns": len(per_turn),
                **{k: 1e6 * float(np.median([row.get(k, 0.0) for row in per_turn])) for k in labels},
                "requests": self.requests()}

    def requests(self) -> list[dict]:
        """Each request (a generate call): its milliseconds, its steps', the first three and the
        last three steps' (the prompt's prefill and the draft's first catch-up come first)."""
        out = []
        for label, begin, end in self.spans:
            if label != "engine.generate":
                continue
            steps = [1e3 * (b - a) for name, a, b in self.spans if name == "engine.step" and begin <= a and b <= end]
            if not steps:
                continue
            out.append({"ms": 1e3 * (end - begin), "steps": len(steps), "steps_ms": sum(steps),
                        "first_ms": steps[:3], "last_ms": steps[-3:], "median_ms": float(np.median(steps))})
        return out


def profile_draft(big, small, prompts: list[list[int]], plain_ids: list[list[int]],
                  params: SamplingParams, overlap: bool = False) -> dict:
    """Per speculative cycle at the first of --ks (the draft's rounds, one launch_rounds, then the target's
    verification, one launch_top): CUDA events recorded around both launches, each at its place
    in the stream, give the rounds' span, the device's wait between the rounds and the
    verification, the verification's span, and the wait from its end to the next cycle's rounds
    (the host's turn: result, acceptance, scheduling, staging). Then the graphs replayed alone:
    the draft's rounds (1- and 2-row catch-up, k - 1 rounds) and the target's k + 1-row verification, so
    a cycle's idle device time is its span less the replays. Works on any version of the
    engine whose runners have launch_rounds (it only wraps the two runners' launches). ``overlap``:
    asynchronous scheduling, the rounds launched behind the verification before (launch_rounds_after,
    wrapped as launch_rounds is)."""
    alpha, k = ARGS.alphas[0], ARGS.ks[0]
    drafter = OracleDrafter(small, alpha, seed=1)
    on_the_verifications_path(drafter, big, prompts, plain_ids, params, k)
    engine = Engine(big, max_num_seqs=1, detail="none", drafter=drafter, num_draft=k, async_scheduling=overlap)
    engine.generate([prompts[0]], params)  # warm-up: compile, capture
    engine.spec_stats = SpeculativeStats()
    cycles: list[dict] = []
    launch_rounds, launch_top = small.runner.launch_rounds, big.runner.launch_top
    launch_after = small.runner.launch_rounds_after

    def timed_rounds(batch, *args, **kwargs):
        begin = cuda_event()
        future = launch_rounds(batch, *args, **kwargs)
        cycles.append({"prompt": prompt_no[0], "rows": batch.num_tokens, "rounds": (begin, cuda_event())})
        return future

    def timed_after(kv, after):
        # Whether the verification these rounds follow had ended when the host launched them (it
        # would then be late: the device waits for the launch); and the launch's host time.
        late = bool(cycles) and "verify" in cycles[-1] and cycles[-1]["verify"][1].query()
        start = time.perf_counter()
        begin = cuda_event()
        future = launch_after(kv, after)
        cycles.append({"prompt": prompt_no[0], "rows": after.num_seqs * after.q, "rounds": (begin, cuda_event()),
                       "late": late, "launch_us": 1e6 * (time.perf_counter() - start)})
        return future

    def timed_top(*args, **kwargs):
        begin = cuda_event()
        future = launch_top(*args, **kwargs)
        if cycles and "verify" not in cycles[-1]:
            cycles[-1]["verify"] = (begin, cuda_event())
        return future

    prompt_no = [0]
    small.runner.launch_rounds, big.runner.launch_top = timed_rounds, timed_top
    small.runner.launch_rounds_after = timed_after
    host = None
    try:
        host = HostTurns(engine)
        for i, p in enumerate(prompts):
            prompt_no[0] = i
            engine.generate([p], params)
    finally:
        if host is not None:
            host.remove()
        del small.runner.launch_rounds, big.runner.launch_top, small.runner.launch_rounds_after
    torch.cuda.synchronize()
    rows = []
    for this, after in zip(cycles, cycles[1:] + [None]):
        if this["rows"] > 2 or "verify" not in this:
            continue  # a prompt's catch-up
        (rb, re), (vb, ve) = this["rounds"], this["verify"]
        row = {"catch_up_rows": this["rows"], "rounds_span_ms": rb.elapsed_time(re),
               "rounds_to_verify_ms": re.elapsed_time(vb), "verify_span_ms": vb.elapsed_time(ve)}
        if after is not None and after["prompt"] == this["prompt"]:
            row["verify_to_next_rounds_ms"] = ve.elapsed_time(after["rounds"][0])
            row["cycle_ms"] = rb.elapsed_time(after["rounds"][0])
        rows.append(row)
    kv, big_kv = engine.draft_run.kv_cache, engine.kv_cache
    stats = engine.spec_stats

    def median(key: str, keep=lambda r: True) -> float | None:
        values = [r[key] for r in rows if key in r and keep(r)]
        return float(np.median(values)) if values else None

    keys = ("rounds_span_ms", "rounds_to_verify_ms", "verify_span_ms", "verify_to_next_rounds_ms", "cycle_ms")
    round_graphs = kv.round_graphs or {}
    out = {"cycles": len(rows), **{key: median(key) for key in keys},
           **{f"{key}_{n}row": median(key, lambda r, n=n: r["catch_up_rows"] == n)
              for n in (1, 2) for key in ("rounds_span_ms", "cycle_ms")},
           **{f"replay_rounds_{q}row_catch_up_ms": replay_ms(round_graphs[q, k - 1])
              for q in (1, 2) if (q, k - 1) in round_graphs},
           "replay_verify_ms": replay_ms(big_kv.graphs[k + 1]) if k + 1 in (big_kv.graphs or {}) else None,
           "draft_token_ms": 1e3 * stats.draft_seconds / max(stats.drafted, 1),
           "verify_ms": 1e3 * stats.verify_seconds / max(stats.verify_steps, 1),
           "rest_ms": 1e3 * (stats.step_seconds - stats.draft_seconds - stats.verify_seconds)
           / max(stats.verify_steps, 1),
           "token_acceptance": stats.token_acceptance}
    ahead = [c for c in cycles if "late" in c]
    if ahead:
        out["launched_ahead"] = len(ahead)
        out["launched_after_the_verification_ended"] = sum(c["late"] for c in ahead)
        out["launch_after_host_us"] = float(np.median([c["launch_us"] for c in ahead]))
    out["host_turn_us"] = host.breakdown()
    for n in (1, 2):
        cycle, replay = out.get(f"cycle_ms_{n}row"), out.get(f"replay_rounds_{n}row_catch_up_ms")
        if cycle is not None and replay is not None and out["replay_verify_ms"] is not None:
            out[f"idle_ms_{n}row"] = cycle - replay - out["replay_verify_ms"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="a folder (made if missing) for gpu_spec_bench.json")
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--target", default="llama-3-8b")
    parser.add_argument("--draft", default="llama-3.2-1b")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=0, help="0: every prompt of the workload")
    parser.add_argument("--draft-quantize", default=None, metavar="FORMAT",
                        help="oracle, profile: also run the draft shape in this format (random codes)")
    parser.add_argument("--draft-quantize-head", action="store_true",
                        help="with --draft-quantize: the draft shape's embedding and LM head too")
    parser.add_argument("--no-bf16-draft", action="store_true",
                        help="with --draft-quantize: oracle and profile run the quantized draft alone")
    parser.add_argument("--ks", default="4,2,8", help="oracle: the draft lengths k, in order")
    parser.add_argument("--alphas", default="0.8,0.6,0.9", help="oracle: the acceptances, in order")
    parser.add_argument("--spec-scheduling", default="sync,async",
                        help="oracle: the speculative engine's scheduling, each in turn: sync (each step "
                             "read before the next drafts) and/or async (the next rounds launched behind "
                             "each verification)")
    parser.add_argument("--checks", default="kernel,graphs,rounds,capture_gc",
                        help="checks: which of kernel, graphs, rounds, capture_gc to run")
    parser.add_argument("--stepwise-too", action="store_true",
                        help="oracle: each k's first alpha again with the draft rounds launched one by one")
    parser.add_argument("--quick-exactness", action="store_true",
                        help="exactness: the bundled pair alone, k = 4, each of --prompts prompts alone")
    parser.add_argument("--no-piece-graphs", action="store_true",
                        help="run the steps no decode graph replays (prompts, a draft's catch-up) "
                             "kernel by kernel, as before the layers' pieces (torch_pieces), to compare")
    args = parser.parse_args(namespace=ARGS)
    if args.no_piece_graphs:
        from tinyinfer.runners.torch_fast import TorchRunner

        TorchRunner._piece_graphs = lambda self, rows: None  # type: ignore[method-assign]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.alphas = [float(a) for a in args.alphas.split(",")]
    args.spec_scheduling = args.spec_scheduling.split(",")
    if not set(args.spec_scheduling) <= {"sync", "async"}:
        parser.error(f"--spec-scheduling takes sync and/or async, not {','.join(args.spec_scheduling)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)  # a folder: OUT/gpu_spec_bench.json inside it
    out = Path(args.out) / "gpu_spec_bench.json"
    card = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    results: dict = {"device": card, "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    SAVE[0] = lambda: out.write_text(json.dumps(results, indent=2))
    for section in args.only.split(","):
        start = time.perf_counter()
        log(f"== {section}")
        try:
            globals()[section](results)
        except Exception:  # keep the other sections' numbers; record what failed
            results[f"{section}_error"] = traceback.format_exc()
            log(results[f"{section}_error"])
        results[f"{section}_seconds"] = time.perf_counter() - start
        out.write_text(json.dumps(results, indent=2))
        gc.collect()  # the section's models and engines (reference cycles) go before the next
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
