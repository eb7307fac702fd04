"""Lesson 05 experiment: your sampler picks the tokens of real generations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType

import numpy as np

import tinyinfer
from lessons.support import heading, load_model, plugged, table, track
from tinyinfer import sampling
from tinyinfer.sampling import SamplingParams

PROMPT = "MACBETH:\nIs this a dagger which I see before me,\n"
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "temperature 1.0": dict(temperature=1.0),
    "temperature 1.5": dict(temperature=1.5),
    "top-k 10": dict(temperature=1.0, top_k=10),
    "top-p 0.9": dict(temperature=1.0, top_p=0.9),
    "min-p 0.1": dict(temperature=1.0, min_p=0.1),
}


@contextmanager
def students_sampler(impl: ModuleType, kept: list[int]) -> Iterator[None]:
    """The engine samples with impl's processed_probs and sample; kept records tokens left in play."""
    def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
        p = np.asarray(impl.processed_probs(np.asarray(logits, dtype=np.float64), params.temperature,
                                            params.top_k, params.top_p, params.min_p))
        kept.append(int(np.count_nonzero(p)))
        return p

    with ExitStack() as stack:
        stack.enter_context(plugged(sampling, "probs_from_logits", probs_from_logits))
        stack.enter_context(plugged(sampling, "sample_from_probs", impl.sample))
        yield


def texts(model: tinyinfer.Model, settings: dict, seeds: range, tokens: int) -> list[str]:
    """One generation per seed, batched in one engine run."""
    params = [SamplingParams(max_tokens=tokens, seed=s, ignore_eos=True, **settings) for s in seeds]
    return [c.text for c in tinyinfer.Engine(model).generate([PROMPT] * len(params), params)]


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Generate with each setting and several seeds through the student's sampler."""
    m = load_model(model)
    tokens, seeds = (12, range(3)) if quick else (40, range(6))

    heading(f"{len(seeds)} seeds per setting, {tokens} tokens after {PROMPT!r}")
    rows, samples = [], {}
    for name, settings in track(SETTINGS.items(), "settings", total=len(SETTINGS)):
        kept: list[int] = []
        with students_sampler(impl, kept):
            outs = texts(m, settings, seeds, tokens)
        samples[name] = outs[0]
        rows.append((name, len(set(outs)), float(np.mean(kept)) if kept else "1 (argmax)",
                     max(kept) if kept else 1))
    print(table(("setting", f"distinct texts of {len(seeds)}", "tokens in play (mean)", "(max)"), rows))
    print(f"(the vocabulary has {m.config.vocab_size:,} tokens; for plain greedy decoding the engine "
          "takes the argmax itself and never calls a sampler)")

    heading("the first seed's text per setting")
    for name, text in samples.items():
        print(f"{name:>16}: {text.replace(chr(10), ' / ')}"[:110])

    heading("seeds make sampling reproducible")
    params = dict(temperature=1.0, top_p=0.9)
    with students_sampler(impl, []):
        first, again = texts(m, params, range(7, 8), tokens)[0], texts(m, params, range(7, 8), tokens)[0]
    engines = texts(m, params, range(7, 8), tokens)[0]
    print(f"your sampler, seed 7, twice: {'identical' if first == again else 'DIFFERENT'}")
    print(f"your sampler vs the engine's, seed 7: {'identical' if first == engines else 'DIFFERENT'}")
    print("No claim is tested here: sampling changes which tokens come out, not what they cost.")


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
