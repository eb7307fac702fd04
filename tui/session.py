"""A run the TUI shows: a live engine (or a recorded trace) and the frames seen so far.

The session holds the frames and a cursor. Stepping forward past the last frame runs the
engine once; stepping back only moves the cursor, and stepping forward again replays the
recorded frames. Nothing here imports Textual: the screens call these methods from workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tinyinfer
from tinyinfer.errors import TinyInferError
from tinyinfer.model import BUNDLED
from tinyinfer.quant import QuantConfig
from tinyinfer.speculative import Drafter, DraftModelDrafter, PromptLookupDrafter
from tinyinfer.trace import StepTrace, read_trace
from tui.frames import (
    Frame,
    SeqView,
    Token,
    after_abort,
    after_add,
    after_step,
    replay_frames,
    start_frame,
)
from tui.options import Options
from tui.scenarios import SCENARIOS, Arrival, Scenario

DEFAULT_SAMPLING = tinyinfer.SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=0)


@dataclass(frozen=True)
class Source:
    """Where a session's frames come from, in words for the status bar."""

    model: str  # model name, or the trace file for a replay
    runner: str  # "numpy", "torch" or "replay"
    scenario: str
    drafter: str = ""  # the speculative drafter in words; empty when speculative decoding is off
    precision: str = ""  # weight precision (fp32, int8, ...) when the run is about it, else empty


@dataclass(frozen=True)
class Speculation:
    """How to make a drafter for speculative decoding, and whether a session uses one."""

    make: Callable[[], Drafter]  # the drafter for each new engine
    name: str
    num_draft: int = 4
    on: bool = False


class Session:
    """Frames of one run and a cursor over them; live sessions also own the engine."""

    def __init__(self, frames: list[Frame], source: Source, engine: tinyinfer.Engine | None = None,
                 scenario: Scenario | None = None, record: Path | None = None, seed: int = 0,
                 kv_bytes_per_page: int | None = None, speculation: Speculation | None = None):
        self.frames = frames
        self.cursor = 0
        self.source = source
        self.engine = engine
        self.scenario = scenario
        self.pending: list[tuple[Arrival, int]] = []  # scenario requests not yet added
        self.record = record
        self.kv_bytes_per_page = kv_bytes_per_page
        self.speculation = speculation
        self._seed = seed
        self._requests = 0

    # ------------------------------------------------------------------ construction

    @classmethod
    def live(cls, model: tinyinfer.Model, scenario: Scenario, seed: int = 0,
             record: Path | None = None, speculation: Speculation | None = None,
             **engine_options: Any) -> Session:
        """Start a scenario on a loaded model: requests due at step 0 are queued already.
        `engine_options` are EngineConfig fields that replace the scenario's (comparisons)."""
        lens = [len(model.tokenizer.encode(a.prompt)) for a in scenario.arrivals]
        speculating = speculation is not None and speculation.on
        options = dict(num_pages=scenario.pool_pages(lens), page_size=scenario.page_size,
                       max_num_seqs=scenario.max_num_seqs,
                       max_num_batched_tokens=scenario.max_num_batched_tokens, seed=seed,
                       detail="full", num_draft=speculation.num_draft if speculating else 4)
        engine = tinyinfer.Engine(model, drafter=speculation.make() if speculating else None,
                                  **{**options, **engine_options})
        source = Source(model.name, model.runner.name, scenario.name,
                        speculation.name if speculating else "",
                        precision_of(model) if scenario.quantize is not None else "")
        if record is not None:
            record.write_text("", encoding="utf-8")
        session = cls([], source, engine, scenario, record=record, seed=seed,
                      kv_bytes_per_page=engine.page_bytes, speculation=speculation)
        session.pending = [(a, i) for i, a in enumerate(scenario.arrivals)]
        first = tuple(session._submit(a, i) for a, i in session._due(0))
        session.frames = [start_frame(first, engine.pool_view())]
        return session

    @classmethod
    def replay(cls, path: Path) -> Session:
        """Frames of a recorded trace (JSON lines from tinyinfer.trace.write_trace); no model."""
        try:
            traces = list(read_trace(str(path)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TinyInferError(f"cannot replay {path}: {exc}") from exc
        if not traces:
            raise TinyInferError(f"{path} holds no steps to replay: record a run with --record FILE")
        return cls(replay_frames(traces), Source(path.name, "replay", "replay"))

    def restart(self, prompt: str | None = None, speculative: bool | None = None,
                intro: str | None = None) -> Session:
        """A fresh engine on the same model and pool shape: a new prompt, or the same requests
        with speculative decoding switched on or off (and `intro` as the walkthrough's opening)."""
        assert self.engine is not None and self.scenario is not None
        scenario = self.scenario if prompt is None else self.scenario.with_prompt(prompt)
        if intro is not None:
            scenario = dataclasses.replace(scenario, intro=intro)
        speculation = self.speculation
        if speculative is not None:
            if speculation is None:
                raise TinyInferError("speculative decoding needs a drafter, and none was set up")
            speculation = dataclasses.replace(speculation, on=speculative)
        return Session.live(self.engine.model, scenario, self._seed, self.record, speculation)

    def requantize(self, precision: str, intro: str, device: str | None = None) -> Session:
        """Reload the model with weights in `precision` ("fp32", "int8", "int4", ...) and start
        the same requests again on a fresh engine (slow: call from a worker)."""
        assert self.engine is not None and self.scenario is not None
        if self.tensor_parallel > 1:
            raise TinyInferError(f"the weights are split over {self.tensor_parallel} processes, and "
                                 "tensor parallelism splits float weights only: run without "
                                 "--tensor-parallel to switch precision")
        model = reload(self.engine.model, precision, device)
        scenario = dataclasses.replace(self.scenario, quantize=precision, intro=intro)
        return Session.live(model, scenario, self._seed, self.record, self.speculation)

    # ------------------------------------------------------------------ where we are

    @property
    def seed(self) -> int:
        """The sampling seed the scenario's requests are drawn with."""
        return self._seed

    @property
    def frame(self) -> Frame:
        return self.frames[self.cursor]

    @property
    def tensor_parallel(self) -> int:
        """How many processes the model is split over, as the traces say (1: not split)."""
        pool = self.frames[-1].pool
        return len(pool.ranks) if pool is not None and pool.ranks else 1

    @property
    def is_live(self) -> bool:
        return self.engine is not None

    @property
    def at_end(self) -> bool:
        return self.cursor == len(self.frames) - 1

    @property
    def engine_has_work(self) -> bool:
        """Whether running the engine once more would do anything."""
        return self.engine is not None and (self.engine.has_unfinished() or bool(self.pending))

    @property
    def can_forward(self) -> bool:
        return not self.at_end or self.engine_has_work

    def back(self) -> bool:
        if self.cursor == 0:
            return False
        self.cursor -= 1
        return True

    def forward(self) -> bool:
        """Replay the next recorded frame; False at the end (the engine must step instead)."""
        if self.at_end:
            return False
        self.cursor += 1
        return True

    # ------------------------------------------------------------------ live stepping

    def begin_step(self) -> None:
        """Queue the scenario's requests due now (main thread, before the engine steps)."""
        assert self.engine is not None
        for arrival, index in self._due(self.engine.step_count):
            self._submit(arrival, index)

    def compute_step(self) -> StepTrace:
        """Run the engine once (slow: call from a worker thread)."""
        assert self.engine is not None
        return self.engine.step()

    def finish_step(self, trace: StepTrace) -> Frame:
        """Record the step as the newest frame and show it."""
        frame = after_step(self.frames[-1], trace)
        self._push(frame)
        if self.record is not None:
            with self.record.open("a", encoding="utf-8") as f:
                f.write(trace.to_json() + "\n")
        return frame

    def add_request(self, prompt: str, params: tinyinfer.SamplingParams) -> SeqView:
        """Queue a request now; it joins the running batch at the next step."""
        assert self.engine is not None
        self._requests += 1
        seq = self._queue(prompt, params)
        self._push(after_add(self.frames[-1], seq, self.engine.pool_view()))
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages."""
        assert self.engine is not None
        self.engine.abort_request(request_id)
        self._push(after_abort(self.frames[-1], request_id, self.engine.pool_view()))

    def token(self, token_id: int) -> Token:
        """A token with its own text (live: from the tokenizer, bytes decoded leniently)."""
        assert self.engine is not None
        raw = self.engine.model.tokenizer.token_bytes(token_id)
        return Token(token_id, raw.decode("utf-8", errors="replace"))

    def next_params(self, base: tinyinfer.SamplingParams) -> tinyinfer.SamplingParams:
        """Sampling for a request added by hand: the chosen settings with a fresh seed."""
        return tinyinfer.SamplingParams(max_tokens=base.max_tokens, temperature=base.temperature,
                                        top_k=base.top_k, top_p=base.top_p, min_p=base.min_p,
                                        seed=self._seed + 1000 + self._requests)

    # ------------------------------------------------------------------ internals

    def _due(self, step: int) -> list[tuple[Arrival, int]]:
        idle = self.engine is not None and not self.engine.has_unfinished()
        due = [(a, i) for a, i in self.pending if a.at_step <= step or idle]
        if idle and due:  # nothing is running: the earliest waiting arrival comes now
            due = [d for d in due if d[0].at_step == min(a.at_step for a, _ in due)]
        self.pending = [p for p in self.pending if p not in due]
        return due

    def _submit(self, arrival: Arrival, index: int) -> SeqView:
        assert self.scenario is not None
        params = tinyinfer.SamplingParams(
            max_tokens=arrival.max_tokens, temperature=self.scenario.temperature,
            top_p=DEFAULT_SAMPLING.top_p, seed=self._seed + index)
        return self._queue(arrival.prompt, params)

    def _queue(self, prompt: str, params: tinyinfer.SamplingParams) -> SeqView:
        assert self.engine is not None
        request_id = self.engine.add_request(prompt, params)
        ids = self.engine.completion(request_id).prompt_ids
        return SeqView(request_id, None, tuple(self.token(t) for t in ids), prompt_len=len(ids),
                       arrival_step=self.engine.step_count)

    def _push(self, frame: Frame) -> None:
        self.frames.append(frame)
        self.cursor = len(self.frames) - 1


def precision_of(model: tinyinfer.Model) -> str:
    """The model's weight format: 'fp32' (as loaded, unquantized) or its QuantConfig's name."""
    return model.quantization.name if model.quantization is not None else "fp32"


def normalized(precision: str) -> str:
    """A precision's canonical name: 'int4' -> 'int4-g128'; 'fp32' stays."""
    return precision if precision == "fp32" else QuantConfig.parse(precision).name


def reload(model: tinyinfer.Model, precision: str, device: str | None = None) -> tinyinfer.Model:
    """The same checkpoint, runner and K/V storage with linear weights in `precision` ("fp32":
    unquantized)."""
    source = model.name if model.name in BUNDLED else model.path
    return tinyinfer.load(source, runner=model.runner.name, device=device,
                          quantize="none" if precision == "fp32" else precision, measure_error=True,
                          kv_cache_dtype=model.runner.info.kv_cache_dtype)


def load_model(options: Options, quantize: str | None = None) -> tinyinfer.Model:
    """The model the options name. With --tensor-parallel it is split over worker processes (on
    the CPU unless a device is given): load it before a Textual app runs, whose stand-in for
    sys.stderr has no file descriptor for multiprocessing to pass on, and close its runner after.
    The ranks time their collectives: the ranks panel shows each rank's all-reduce time."""
    split = options.tensor_parallel > 1
    return tinyinfer.load(options.model, runner=options.runner,
                          device=options.device or ("cpu" if split else None), quantize=quantize,
                          tensor_parallel=options.tensor_parallel, measure_error=True,
                          kv_cache_dtype=options.kv_cache_dtype,
                          **({"time_collectives": True} if split else {}))


def speculation_for(options: Options, model: tinyinfer.Model, on: bool) -> Speculation:
    """The drafter a run can switch on: the one asked for, else a draft model if there is one,
    else prompt lookup."""
    draft = options.draft_model_name()
    if draft is None:
        return Speculation(PromptLookupDrafter, "prompt lookup", options.num_draft, on)
    draft_model = tinyinfer.load(draft, runner=model.runner.name, device=options.device,
                                 quantize=options.draft_quantize, quantize_head=options.draft_quantize_head,
                                 kv_cache_dtype=options.kv_cache_dtype)
    return Speculation(lambda: DraftModelDrafter(draft_model), f"draft model {draft_model.name}",
                       options.num_draft, on)


def open_session(options: Options, model: tinyinfer.Model | None = None) -> Session:
    """Read a replay, or load the model (unless given) and start the scenario (slow: worker)."""
    options.check()
    if options.replay is not None:
        return Session.replay(options.replay)
    scenario = SCENARIOS[options.scenario]
    if options.quantize is not None:
        scenario = dataclasses.replace(scenario, quantize=options.quantize)
    wanted = scenario.quantize
    if model is None:
        model = load_model(options, None if wanted in (None, "fp32") else wanted)
    elif wanted is not None and normalized(wanted) != precision_of(model):
        model = reload(model, wanted, options.device)
    if not model.has_tokenizer:
        raise TinyInferError(f"{model.name} has no tokenizer, so the TUI cannot show its text: "
                             "pass a model folder with tokenizer files")
    speculation = speculation_for(options, model, options.speculative or scenario.speculative)
    return Session.live(model, scenario, options.seed, options.record, speculation)
