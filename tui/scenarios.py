"""Prepared classroom demos: which prompts arrive when, and how big the KV page pool is."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tinyinfer.engine_config import DEFAULTS


@dataclass(frozen=True)
class Arrival:
    """One request of a scenario: its prompt, the engine step it arrives at, its length."""

    prompt: str
    at_step: int = 0
    max_tokens: int = 24


@dataclass(frozen=True)
class Scenario:
    """A demo: requests, engine shape, and the one-line story the narration opens with."""

    name: str
    title: str
    intro: str
    arrivals: tuple[Arrival, ...]
    num_pages: int = 32  # 0: size the pool from the prompts so it is just too small (pressure)
    page_size: int = DEFAULTS.page_size
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    temperature: float = 0.8
    speculative: bool = False  # start with speculative decoding on
    quantize: str | None = None  # weight precision ("fp32", "int8", "int4", ...); None: not a topic

    def with_prompt(self, prompt: str) -> Scenario:
        """The same engine shape running one new prompt from step 0."""
        max_tokens = self.arrivals[0].max_tokens if self.arrivals else 24
        return replace(self, arrivals=(Arrival(prompt, 0, max_tokens),))

    def pool_pages(self, prompt_lens: list[int]) -> int:
        """Pages in the pool; for a pressure demo, enough for every prompt but not every output."""
        if self.num_pages:
            return self.num_pages
        bs = self.page_size
        alone = max(math.ceil((n + a.max_tokens) / bs) for n, a in zip(prompt_lens, self.arrivals))
        prompts = sum(math.ceil((n + 1) / bs) for n in prompt_lens)
        return max(alone, prompts)


PROLOGUE = (
    "Two households, both alike in dignity,\n"
    "In fair Verona, where we lay our scene,\n"
    "From ancient grudge break to new mutiny,\n"
    "Where civil blood makes civil hands unclean.\n\n"
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="single",
            title="one prompt, start to finish",
            intro="One prompt goes through the engine: tokenize, prefill, then decode token by token.",
            arrivals=(Arrival("ROMEO:\nBut soft, what light through yonder window breaks?\n", 0, 24),),
            num_pages=24,
        ),
        Scenario(
            name="batching",
            title="continuous batching with 4 requests",
            intro="Four requests of different lengths; two arrive later and join the running batch.",
            arrivals=(
                Arrival("To be, or not to be, that is the question:\n", 0, 12),
                Arrival("JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n", 0, 24),
                Arrival("Now is the winter of our discontent\n", 3, 16),
                Arrival("Friends, Romans, countrymen, lend me your ears;\n", 6, 10),
            ),
            num_pages=32,
        ),
        Scenario(
            name="prefix",
            title="a shared prompt prefix, cached",
            intro="Three requests start with the same prologue; later ones reuse its KV pages.",
            arrivals=(
                Arrival(PROLOGUE + "ROMEO:\n", 0, 12),
                Arrival(PROLOGUE + "JULIET:\n", 3, 12),
                Arrival(PROLOGUE + "MERCUTIO:\n", 6, 12),
            ),
            num_pages=32,
        ),
        Scenario(
            name="pressure",
            title="a tiny page pool: preemption",
            intro="Three requests share a pool too small for all their outputs: someone is preempted.",
            arrivals=(
                Arrival("To be, or not to be, that is the question:\n", 0, 48),
                Arrival("Whether 'tis nobler in the mind to suffer\n", 0, 48),
                Arrival("The slings and arrows of outrageous fortune,\n", 0, 48),
            ),
            num_pages=0,
            page_size=8,
        ),
        Scenario(
            name="chunked",
            title="chunked prefill: a long prompt in pieces",
            intro="Two requests decode; at step 4 a long prompt arrives, and each step's budget of "
                  "24 tokens splits its prefill over several steps while the others keep decoding.",
            arrivals=(
                Arrival("ROMEO:\n", 0, 16),
                Arrival("JULIET:\n", 0, 16),
                Arrival(PROLOGUE + "CHORUS:\nNow old desire doth in his death-bed lie,\n", 3, 8),
            ),
            num_pages=32,
            max_num_batched_tokens=24,
        ),
        Scenario(
            name="speculative",
            title="speculative decoding: draft, then verify",
            intro="A cheap drafter guesses a few tokens; the model checks them all in one pass.",
            arrivals=(Arrival("ROMEO:\nBut soft, what light through yonder window breaks?\n"
                              "It is the east, and Juliet is the sun.\n", 0, 32),),
            num_pages=24,
            temperature=0.0,
            speculative=True,
        ),
        Scenario(
            name="quantization",
            title="int8 / int4 weights: rounding error and the next token",
            intro="The model's linear weights are rounded to int8 (m switches fp32, int8, int4).",
            arrivals=(Arrival("ROMEO:\nBut soft, what light through yonder window breaks?\n", 0, 24),),
            num_pages=24,
            quantize="int8",
        ),
    )
}

# Offered (editable) when a learner adds a request or starts a new prompt.
SUGGESTIONS = (
    "ROMEO:\\nBut soft, what light through yonder window breaks?\\n",
    "JULIET:\\nWhat's in a name? That which we call a rose\\n",
    "HAMLET:\\nTo be, or not to be, that is the question:\\n",
    "MACBETH:\\nIs this a dagger which I see before me,\\n",
    PROLOGUE.replace("\n", "\\n") + "ROMEO:\\n",
)
