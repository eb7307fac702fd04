"""The runner contract: every runner implements all of ModelRunner, and nothing probes for parts of it."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import tinyinfer
from tinyinfer.errors import TinyInferError
from tinyinfer.runners.numpy_ref import NumpyRunner
from tinyinfer.runners.runner import (
    AfterVerification,
    Feed,
    ModelRunner,
    Rounds,
    RunnerInfo,
    launch_rounds_stepwise,
    make_batch,
)
from tinyinfer.runners.torch_fast import TorchRunner
from tinyinfer.runners.tp.runner import TensorParallelRunner
from tinyinfer.runners.tp.shard import ShardRunner
from tinyinfer.weights import load_weights

ROOT = Path(__file__).resolve().parent.parent


def protocol_members() -> set[str]:
    """Every name ModelRunner declares: annotated attributes, properties and methods."""
    declared = set(ModelRunner.__annotations__)
    declared |= {name for name, value in vars(ModelRunner).items()
                 if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}
    return declared


def test_the_protocol_declares_what_the_engine_uses():
    assert protocol_members() == {"config", "name", "capture_attention", "last_attention", "last_timings",
                                  "info", "new_kv_cache", "forward", "forward_top", "launch_top", "launch_rounds",
                                  "launch_rounds_after", "copy_page", "close"}


@pytest.fixture(scope="module")
def runners(oracle_model):
    """One of each runner over the same weights (the tensor-parallel one with a single rank)."""
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder)
    weights = load_weights(folder, model.config)
    shard = ShardRunner(model.config, weights, rank=0, world=1, device="cpu", dtype="float32")
    return model.config, {
        "numpy": model.runner,
        "torch": TorchRunner(model.config, weights, device="cpu", dtype="float32"),
        "shard": shard,
        "tensor parallel": TensorParallelRunner(shard, conns=[], workers_alive=lambda: True,
                                                on_close=lambda: None),
    }


def test_every_runner_implements_every_member(runners):
    _, by_name = runners
    classes = {type(r) for r in by_name.values()}
    assert classes == {NumpyRunner, TorchRunner, ShardRunner, TensorParallelRunner}
    for name, runner in by_name.items():
        assert isinstance(runner, ModelRunner), name
        for member in protocol_members():
            assert hasattr(runner, member), f"{name} runner lacks {member}"
        assert isinstance(runner.info, RunnerInfo)
        assert runner.info.itemsize == 4 and runner.info.dtype == "float32" and runner.info.device == "cpu"
        assert runner.info.weight_bytes > 0
        if name != "tensor parallel":
            assert runner.last_timings == ()  # one process: no ranks to time


def test_forward_top_agrees_with_forward_on_every_runner(runners):
    config, by_name = runners
    prompt = list(range(3, 40, 3))
    for name, runner in by_name.items():
        kv = runner.new_kv_cache(4, 4)
        batch = make_batch([(prompt, 0, [0, 1, 2, 3], True)], 4)
        logits = runner.forward(batch, kv).astype(np.float64)
        top = runner.forward_top(batch, runner.new_kv_cache(4, 4), 5)
        assert top.ids.shape == (len(prompt), 5), name
        assert (top.ids == np.argsort(-logits, axis=-1, kind="stable")[:, :5]).all(), name
        np.testing.assert_allclose(top.values, np.take_along_axis(logits, top.ids, -1), rtol=1e-5, err_msg=name)
        m = logits.max(-1)
        np.testing.assert_allclose(top.logsumexp, m + np.log(np.exp(logits - m[:, None]).sum(-1)),
                                   rtol=1e-5, err_msg=name)
    assert by_name["tensor parallel"].info.tensor_parallel == 1
    assert len(by_name["tensor parallel"].info.rank_shares) == 1
    assert by_name["tensor parallel"].last_timings[0].rank == 0  # filled by the forward above


def test_launch_top_feeds_an_earlier_launch_argmax_on_every_runner(runners):
    """Two prompts prefilled by one launch; the next launch decodes them in the other order,
    its tokens fed from the first launch's argmax: the same as feeding those ids by hand."""
    _, by_name = runners
    prompts = ([3, 9, 27, 17], [5, 25, 61])
    prefill = [(prompts[0], 0, [0, 2], False), (prompts[1], 0, [1, 3], False)]
    for name, runner in by_name.items():
        results = []
        for fed in (False, True):
            kv = runner.new_kv_cache(4, 4)
            first = runner.launch_top(make_batch(prefill, 4), kv, 5)
            argmax = first.result().ids[:, 0]
            assert (first.result().ids == runner.forward_top(make_batch(prefill, 4),
                                                             runner.new_kv_cache(4, 4), 5).ids).all(), name
            tokens = [0, 0] if fed else [int(argmax[1]), int(argmax[0])]
            decode = make_batch([([tokens[0]], len(prompts[1]), [1, 3], False),
                                 ([tokens[1]], len(prompts[0]), [0, 2], False)], 4)
            feed = Feed(first, np.array([1, 0])) if fed else None
            results.append(runner.launch_top(decode, kv, 5, feed).result())
        by_hand, fed_top = results
        assert (fed_top.ids == by_hand.ids).all(), name
        np.testing.assert_allclose(fed_top.values, by_hand.values, rtol=1e-6, err_msg=name)


PROMPTS = ([3, 9, 27, 17], [5, 25, 61])
PAGES = ([0, 2, 4], [1, 3, 5])


def slot(pages: list[int], position: int, page_size: int = 4) -> int:
    return pages[position // page_size] * page_size + position % page_size


def rounds_by_hand(runner, kv, first, guesses: tuple[int, int]) -> np.ndarray:
    """The rule of launch_rounds, each step's argmax read on the host and fed back by hand:
    the first batch, then `guesses[b] - 1` one-token rounds for sequence b. -> ids [2, 4]."""
    top = runner.forward_top(first, kv, 1).ids[:, 0]
    last = np.searchsorted(first.logits_rows, first.query_starts[1:]) - 1
    ids = np.full((2, 4), -1)
    ids[:, 0] = top[last]
    for r in range(1, 4):
        live = [b for b in range(2) if guesses[b] > r]
        step = make_batch([([int(ids[b, r - 1])], int(first.context_lens[b]) + r - 1, PAGES[b], False)
                           for b in live], 4)
        ids[live, r] = runner.forward_top(step, kv, 1).ids[:, 0]
    return ids


def rounds_of(first, guesses: tuple[int, int]) -> Rounds:
    """Where each round's token goes: one position further a round; -1 once a sequence is done."""
    positions = np.full((3, 2), -1)
    slots = positions.copy()
    for b in range(2):
        for r in range(guesses[b] - 1):
            positions[r, b] = int(first.context_lens[b]) + r
            slots[r, b] = slot(PAGES[b], positions[r, b])
    return Rounds(positions, slots)


@pytest.mark.parametrize("catch_up", ["prompt", "one token", "two tokens"])
def test_launch_rounds_follows_the_rule_on_every_runner(runners, catch_up):
    """A catch-up step, then greedy rounds each fed its argmax of the round before (the second
    sequence stops after two guesses): every runner chooses the tokens the rule does, step by
    step with the host in the loop, and leaves the same K/V (the next step reads the same
    logits). The torch runner runs one-token and two-token catch-ups and their rounds as one
    function (on CUDA one graph), the rest round by round."""
    _, by_name = runners
    guesses = (4, 2)
    for name, runner in by_name.items():
        results = []
        for how in ("rounds", "by hand"):
            kv = runner.new_kv_cache(8, 4)
            if catch_up == "prompt":
                first = make_batch([(list(p), 0, pages, False) for p, pages in zip(PROMPTS, PAGES)], 4)
            else:
                runner.forward(make_batch([(list(p), 0, pages, False) for p, pages in zip(PROMPTS, PAGES)], 4), kv)
                extra = [[7], [11]] if catch_up == "one token" else [[7, 40], [11, 2]]
                first = make_batch([(tokens, len(p), pages, True)
                                    for tokens, p, pages in zip(extra, PROMPTS, PAGES)], 4)
            if how == "rounds":
                ids = runner.launch_rounds(first, kv, rounds_of(first, guesses)).result()
            else:
                ids = rounds_by_hand(runner, kv, first, guesses)
            after = make_batch([([1], int(first.context_lens[b]) + guesses[b] - 1, PAGES[b], False)
                                for b in range(2)], 4)
            results.append((ids, runner.forward(after, kv)))
        (ids, logits), (expected, expected_logits) = results
        assert ids.shape == (2, 4) and ids.dtype == np.int64, name
        assert (ids == expected).all(), (name, ids, expected)
        assert (ids[1, 2:] == -1).all(), name
        np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-5, err_msg=name)


def test_launch_top_takes_guesses_from_launched_rounds_beside_its_own_tokens_on_every_runner(runners):
    """A verification's batch: each sequence's last token, which the host knows, then its
    guesses fed from launched greedy rounds' argmaxes (row b (n + 1) + r) before anyone read
    them: the same as writing the rounds' ids in by hand. (The torch runner gathers them on its
    device; the others go through the host, the rule.)"""
    _, by_name = runners
    for name, runner in by_name.items():
        draft_kv = runner.new_kv_cache(8, 4)
        prefill = make_batch([(list(p), 0, pages, False) for p, pages in zip(PROMPTS, PAGES)], 4)
        runner.forward(prefill, draft_kv)
        first = make_batch([([7], 4, PAGES[0], True), ([11], 3, PAGES[1], True)], 4)
        rounds = runner.launch_rounds(first, draft_kv, rounds_of(first, (3, 3)))  # ids [2, 4]
        results = []
        for fed in (True, False):
            ids = rounds.result() if not fed else np.zeros((2, 4), dtype=np.int64)
            kv = runner.new_kv_cache(8, 4)
            runner.forward(prefill, kv)
            verify = make_batch([([5, *ids[0, :3]], 4, PAGES[0], True), ([6, *ids[1, :2]], 3, PAGES[1], True)], 4)
            feed = Feed(rounds, np.array([-1, 0, 1, 2, -1, 4, 5])) if fed else None
            results.append(runner.launch_top(verify, kv, 3, feed).result())
        fed_top, by_hand = results
        assert (rounds.result()[:, :3] >= 0).all() and (rounds.result()[:, 3] == -1).all(), name
        assert (fed_top.ids == by_hand.ids).all(), name
        np.testing.assert_allclose(fed_top.values, by_hand.values, rtol=1e-6, err_msg=name)


def test_launch_rounds_after_is_launch_rounds_on_what_the_verification_accepted_on_every_runner(runners):
    """Rounds launched behind a verification: each sequence's step and rounds picked by the
    guesses it accepts (sequence 0 all of its 2: its step feeds its last guess and the target's
    token, and it sits the last round out, which it would not have after keeping none;
    sequence 1 none: the target's token alone) equal ``launch_rounds`` of those, written by
    hand once the verification is read (-1 where a round is sat out included)."""
    _, by_name = runners
    for name, runner in by_name.items():
        out = []
        for after in (True, False):
            kv = runner.new_kv_cache(8, 4)
            runner.forward(make_batch([(list(p), 0, pages, False) for p, pages in zip(PROMPTS, PAGES)], 4), kv)
            verify = runner.launch_top(make_batch([([7, 1, 2], 4, PAGES[0], True), ([11, 3, 4], 3, PAGES[1], True)],
                                                  4), kv, 1)
            ids = verify.result().ids[:, 0]
            guesses = np.array([ids[0:2], [ids[3] + 1, ids[4]]])  # 0: both kept; 1: the first wrong
            positions = np.full((2, 3, 4), -1)
            for b, start in enumerate((5, 4)):  # the guesses' first positions
                for a in range(3):
                    positions[b, a, 0 if a == 2 else 1:] = start + a - 1 + np.arange(4)[0 if a == 2 else 1:]
            positions[0, 2, 3] = -1  # keeping both, sequence 0 has room for one round less (its lookahead)
            slots = np.where(positions >= 0, [[[slot(PAGES[b], max(p, 0)) for p in row] for row in positions[b]]
                                              for b in range(2)], -1)
            table = AfterVerification(verify, np.array([[0, 1, 2], [3, 4, 5]]), guesses, positions, slots,
                                      tuple(tuple(p) for p in PAGES), q=2)
            if after:
                out.append(runner.launch_rounds_after(kv, table).result())
            else:
                step = make_batch([([int(ids[1]), int(ids[2])], 6, PAGES[0], True), ([int(ids[3])], 4, PAGES[1], True)], 4)
                out.append(runner.launch_rounds(step, kv, Rounds(positions[[0, 1], [2, 0], 2:].T,
                                                                 slots[[0, 1], [2, 0], 2:].T)).result())
        assert (out[0] == out[1]).all() and out[0][0, -1] == -1 and out[0][1, -1] >= 0, name


def test_the_torch_runners_rounds_function_equals_the_stepwise_rule(runners):
    """The torch runner's one-function rounds (what a CUDA graph captures, run eagerly here) and
    the stepwise rule through its own launch_top: the same argmaxes, bit for bit the same K/V,
    every sequence guessing alike. (A sequence that sits rounds out still computes a row in
    them, so the others' rows run in a batch of another shape than the rule's, which may move
    their K/V in the last bits: the test above compares those within tolerance.)"""
    _, by_name = runners
    runner = by_name["torch"]
    out = []
    for launch in (runner.launch_rounds, lambda *a: launch_rounds_stepwise(runner, *a)):
        kv = runner.new_kv_cache(8, 4)
        runner.forward(make_batch([(list(p), 0, pages, False) for p, pages in zip(PROMPTS, PAGES)], 4), kv)
        first = make_batch([([7, 40], 4, PAGES[0], True), ([11, 2], 3, PAGES[1], True)], 4)
        out.append((launch(first, kv, rounds_of(first, (4, 4))).result(), kv.k[:, :6].clone(), kv.v[:, :6].clone()))
    (ids, k, v), (expected, k_rule, v_rule) = out
    assert (ids == expected).all()
    assert k.equal(k_rule) and v.equal(v_rule)


def test_launch_top_of_one_is_the_argmax_of_the_top_k_on_every_runner(runners):
    """k = 1 takes the torch runner's cheaper path (a max and a log-sum-exp, packed in one copy)."""
    _, by_name = runners
    batch = make_batch([([3, 9, 27, 17], 0, [0, 2], True), ([5, 25, 61], 0, [1, 3], True)], 4)
    for name, runner in by_name.items():
        top = runner.forward_top(batch, runner.new_kv_cache(4, 4), 5)
        one = runner.launch_top(batch, runner.new_kv_cache(4, 4), 1).result()
        assert one.ids.shape == one.values.shape == (7, 1) and one.ids.dtype == np.int64, name
        assert (one.ids[:, 0] == top.ids[:, 0]).all(), name
        np.testing.assert_allclose(one.values[:, 0], top.values[:, 0], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(one.logsumexp, top.logsumexp, rtol=1e-5, err_msg=name)


PROBE = re.compile(r"(getattr|hasattr)\(.*runner")


def test_nothing_probes_a_runner_for_optional_parts():
    probes = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
              for folder in ("tinyinfer", "tui", "lessons") for path in sorted((ROOT / folder).rglob("*.py"))
              for n, line in enumerate(path.read_text("utf-8").splitlines(), 1) if PROBE.search(line)]
    assert probes == []
    assert PROBE.search('size = getattr(model.runner, "dtype", None)')  # the pattern does catch one


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text("utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_speculative_policy_imports_no_runner():
    imports = imported_modules(ROOT / "tinyinfer" / "speculative.py")
    assert "tinyinfer.sampling" in imports  # the parse sees its imports
    assert not [m for m in imports if m == "tinyinfer.runners" or m.startswith("tinyinfer.runners.")]


def test_runners_do_not_import_the_trace():
    paths = sorted((ROOT / "tinyinfer" / "runners").rglob("*.py"))
    assert len(paths) > 5
    for path in paths:
        assert "tinyinfer.trace" not in imported_modules(path), path.name


def test_model_tokenizer_is_public_and_explains_its_absence(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder)
    assert not model.has_tokenizer
    with pytest.raises(tinyinfer.TokenizerError, match="has no tokenizer .*pass token ids"):
        model.tokenizer


@pytest.mark.parametrize("positions, slots", [
    ([[3, 4]], [[19, 20], [21, 22]]),  # shapes differ
    ([[3, -1]], [[19, 20]]),  # -1 in the positions alone
    ([[3, -1], [4, 5]], [[19, -1], [20, 21]]),  # back in after sitting a round out
])
def test_rounds_refuse_inconsistent_sitting_out(positions, slots):
    with pytest.raises(TinyInferError, match="rounds:"):
        Rounds(np.array(positions, dtype=np.int64), np.array(slots, dtype=np.int64))
