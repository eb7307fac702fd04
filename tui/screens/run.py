"""The main screen: the panels, the walkthrough narration, and every control of a run.

The screen owns the session. Engine steps run in a thread worker so the interface never
freezes; what the panels show flows down through reactive attributes bound to them.
"""

from __future__ import annotations

import dataclasses

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer
from textual.worker import Worker, WorkerState

from tinyinfer import SamplingParams
from tinyinfer.errors import TinyInferError
from tinyinfer.trace import StepTrace
from tui.frames import Frame
from tui.narration import Narration, Story, narrate, precision_switched, speculation_switched
from tui.options import Options
from tui.panels import PANELS
from tui.panels.narration import NarrationPanel
from tui.panels.quantization import QuantReport, next_precision, report_of
from tui.compare import Comparison, default_kind
from tui.scenarios import SUGGESTIONS
from tui.screens.compare import CompareScreen
from tui.screens.help import HelpScreen
from tui.screens.prompt import PromptScreen
from tui.screens.sampling import SamplingScreen
from tui.session import DEFAULT_SAMPLING, Session
from tui.statusbar import StatusBar, StatusPart, line_text

TOP_K_STEPS = (0, 50, 20, 5, 1)  # fewer candidates to the right (0 is off: all of them)
TOP_P_STEPS = (1.0, 0.95, 0.9, 0.75, 0.5)  # smaller nucleus to the right
FEATURE_ACTIONS = {"precision": "quantization", "quant_layer": "quantization"}  # keys of a feature


def nudge(values: tuple, current, direction: int):
    """The neighbour of current in an ordered list, stopping at the ends (from the start if absent)."""
    i = values.index(current) if current in values else 0
    return values[min(len(values) - 1, max(0, i + direction))]


def cycle(values: tuple, current, direction: int):
    """The next value of a list after current, wrapping around (the first if current is absent)."""
    i = values.index(current) if current in values else -direction
    return values[(i + direction) % len(values)]


def features(session: Session) -> frozenset[str]:
    """Engine features a run uses, so their panels appear (a replay: what its trace shows)."""
    drafted = any(p.draft_tokens for t in session.frames[-1].traces for p in t.seqs)
    return frozenset(({"speculative"} if session.source.drafter or drafted else set())
                     | ({"quantization"} if session.source.precision else set())
                     | ({"tensor-parallel"} if session.tensor_parallel > 1 else set()))


def sampling_for(session: Session) -> SamplingParams:
    """The knobs' starting point: the defaults at the scenario's temperature."""
    if session.scenario is None:
        return DEFAULT_SAMPLING
    return dataclasses.replace(DEFAULT_SAMPLING, temperature=session.scenario.temperature)


class RunScreen(Screen):
    """Panels over a live or replayed run, with step / run / back and the sampling knobs."""

    BINDINGS = [
        Binding("space", "step", "Step", tooltip="Run one engine step (or replay the next recorded one)"),
        Binding("r", "toggle_run", "Run", tooltip="Run steps one after another, or pause"),
        Binding("b", "back", "Back", tooltip="Step back: show the previous frame (recorded, not re-run)"),
        Binding("n", "new_prompt", "New", tooltip="New prompt: a fresh engine running one prompt"),
        Binding("a", "add_request", "Add", tooltip="Add a request that joins the running batch"),
        Binding("s", "sampling", "Sampling",
                tooltip="Type exact temperature / top-k / top-p / min-p / max tokens"),
        Binding("c", "compare", "Compare", tooltip="Compare side by side: the same requests with "
                "speculative decoding on/off, fp32/int8/int4 weights, paged/contiguous memory, "
                "a real instruct model"),
        Binding("question_mark", "help", "Help", tooltip="This help"),
        Binding("right", "step", "Step forward", show=False),
        Binding("left", "back", "Step back (replays recorded steps)", show=False),
        Binding("end", "live", "Back to the newest step", show=False),
        Binding("x", "abort", "Abort the followed sequence", show=False),
        Binding("f", "follow", "Follow the next sequence (next token, attention)", show=False),
        Binding("t", "temperature(-0.1)", "Temperature down", show=False),
        Binding("T", "temperature(0.1)", "Temperature up", show=False),
        Binding("k", "top_k(1)", "Top-k: fewer candidates", show=False),
        Binding("K", "top_k(-1)", "Top-k: more candidates", show=False),
        Binding("p", "top_p(1)", "Top-p: smaller nucleus", show=False),
        Binding("P", "top_p(-1)", "Top-p: larger nucleus", show=False),
        Binding("l", "layer(1)", "Attention: next layer", show=False),
        Binding("L", "layer(-1)", "Attention: previous layer", show=False),
        Binding("h", "head(1)", "Attention: next head", show=False),
        Binding("H", "head(-1)", "Attention: previous head", show=False),
        Binding("i", "toggle_ids", "Show token ids / text", show=False),
        Binding("v", "swap", "Panels", tooltip="Small screens: show the next of the panels that share a slot"),
        Binding("w", "toggle_walkthrough", "Walkthrough narration on / off", show=False),
        Binding("d", "toggle_speculative", "Speculative decoding on / off (restarts the requests)",
                show=False),
        Binding("m", "precision", "Weights: fp32 → int8 → int4 (reloads, restarts the requests)",
                show=False),
        Binding("j", "quant_layer(1)", "Quantization: next weight's histogram", show=False),
        Binding("J", "quant_layer(-1)", "Quantization: previous weight's histogram", show=False),
    ]

    frame: reactive[Frame | None] = reactive(None)
    narration: reactive[Narration | None] = reactive(None, init=False)
    show_ids: reactive[bool] = reactive(False)
    show_timings: reactive[bool] = reactive(True)
    focus_seq: reactive[int | None] = reactive(None)
    sampling: reactive[SamplingParams] = reactive(DEFAULT_SAMPLING)
    layer_index: reactive[int] = reactive(0)
    head_index: reactive[int] = reactive(0)
    runner: reactive[str] = reactive("numpy")
    kv_bytes_per_page: reactive[int | None] = reactive(None)
    drafter: reactive[str] = reactive("")
    quant_report: reactive[QuantReport | None] = reactive(None)
    quant_layer: reactive[int] = reactive(0)
    features: reactive[frozenset[str]] = reactive(frozenset(), init=False, always_update=True)
    walkthrough: reactive[bool] = reactive(True, init=False)
    running: reactive[bool] = reactive(False, init=False)
    status: reactive[tuple[StatusPart, ...]] = reactive(())
    swap: reactive[int] = reactive(0, init=False, always_update=True)

    def __init__(self, session: Session, options: Options) -> None:
        super().__init__()
        self.session = session
        self.options = options
        self._job: Worker | None = None
        self.busy = False  # an engine step is in flight
        self._suggestion = 0
        self._swappable: list[str] = []
        self._comparisons: dict[str, Comparison] = {}  # run for this session already
        self.set_reactive(RunScreen.show_timings, options.show_timings)
        self.set_reactive(RunScreen.walkthrough, options.walkthrough)
        self.set_reactive(RunScreen.runner, session.source.runner)
        self.set_reactive(RunScreen.kv_bytes_per_page, session.kv_bytes_per_page)
        self.set_reactive(RunScreen.drafter, session.source.drafter)
        self.set_reactive(RunScreen.sampling, sampling_for(session))

    @property
    def status_text(self) -> str:
        """The whole status line, every part (the bar drops parts when the terminal is narrow)."""
        return line_text(self.status)

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status").data_bind(parts=RunScreen.status, running=RunScreen.running)
        yield NarrationPanel().data_bind(RunScreen.narration)
        with Grid(id="panels"):
            for cls in PANELS:
                panel = cls()
                if cls.SWAPPABLE:
                    panel.add_class("swap")
                yield panel.data_bind(**{name: getattr(RunScreen, name) for name in cls.BINDS})
        footer = Footer()
        footer.compact = True  # 80 columns hold every key (a reactive in every Textual this project takes)
        yield footer

    def on_mount(self) -> None:
        self._timer = self.set_interval(self.options.run_interval, self._tick, pause=True)
        self.features = features(self.session)
        self.watch_walkthrough(self.walkthrough)
        self.show_frame()
        self._show_quantization()

    def adopt(self, session: Session) -> None:
        """Show a new session (a new prompt, speculative decoding switched)."""
        self.session = session
        self._comparisons = {}
        self.focus_seq = None
        self.drafter = session.source.drafter
        self.sampling = sampling_for(session)
        self.features = features(session)
        self.show_frame()
        self._show_quantization()

    # ------------------------------------------------------------------ showing

    def show_frame(self) -> None:
        """Put the session's current frame on every panel, the narration and the status line."""
        session = self.session
        frame = session.frame
        self.frame = frame
        scenario = session.scenario
        self.narration = narrate(frame, Story(scenario.intro if scenario else "", session.source.precision,
                                              replay=not session.is_live))
        frames = f"frame {session.cursor + 1}/{len(session.frames)} "
        where = "live" if session.at_end and session.is_live else frames + (
            "end of recording" if session.at_end else "replaying recorded steps")
        source = session.source
        parts = [StatusPart(f"step {frame.steps_done}", 9, 0), StatusPart(where, 5, 0),
                 StatusPart(source.model, 8, 1), StatusPart(source.runner, 7, 1)]
        if session.tensor_parallel > 1:
            parts.append(StatusPart(f"{session.tensor_parallel} ranks", 4, 1))
        if source.precision:
            parts.append(StatusPart(source.precision, 3, 1))
        parts.append(StatusPart(source.scenario, 1, 1))
        if self.drafter:
            parts.append(StatusPart(f"drafts: {self.drafter}", 6, 1))
        self.status = tuple(parts)

    def watch_narration(self, narration: Narration | None) -> None:
        for panel in self.query(".panel"):
            panel.set_class(self.walkthrough and narration is not None and panel.id == narration.panel,
                            "-highlight")
        if self.walkthrough and narration is not None and narration.panel in self._swappable:
            self.swap = self._swappable.index(narration.panel)

    def watch_swap(self, swap: int) -> None:
        for i, panel_id in enumerate(self._swappable):
            self.query_one(f"#{panel_id}").set_class(i == swap, "-current")

    def watch_features(self, features: frozenset[str]) -> None:
        """Show the panels of engine features this run uses; hide the others everywhere."""
        for cls in PANELS:
            self.query_one(f"#{cls.PANEL_ID}").set_class(
                cls.FEATURE is not None and cls.FEATURE not in features, "-off")
        for feature in {cls.FEATURE for cls in PANELS if cls.FEATURE}:
            self.set_class(feature in features, f"-with-{feature}")
        self._swappable = [cls.PANEL_ID for cls in PANELS if cls.SWAPPABLE
                           and (cls.FEATURE is None or cls.FEATURE in features)]
        # a run about a feature starts with the feature's own panel in the shared slot
        featured = [i for i, cls in enumerate(c for c in PANELS if c.PANEL_ID in self._swappable)
                    if cls.FEATURE is not None]
        self.swap = featured[0] if featured else 0

    def watch_walkthrough(self, on: bool) -> None:
        self.set_class(not on, "-free")
        self.watch_narration(self.narration)

    def watch_running(self, running: bool) -> None:
        if running:
            self._timer.resume()
        else:
            self._timer.pause()

    # ------------------------------------------------------------------ stepping

    def action_step(self) -> None:
        """Show the next frame: replay a recorded one, or run the engine once at the live end."""
        if self.busy:
            return
        if self.session.forward():
            self.show_frame()
            return
        if not self.session.engine_has_work:
            self.running = False
            self.notify("Nothing left to run: press n for a new prompt or a to add a request.",
                        title="Done" if self.session.is_live else "End of recording")
            return
        self.session.begin_step()
        self.busy = True
        self._job = self._run_step()

    @work(thread=True, exit_on_error=False, group="engine")
    def _run_step(self) -> None:
        trace = self.session.compute_step()
        self.app.call_from_thread(self._stepped, trace)

    def _stepped(self, trace: StepTrace) -> None:
        self.session.finish_step(trace)
        self.busy = False
        self.show_frame()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:
            self.busy = False
            self.running = False
            self.notify(str(event.worker.error), title="The engine step failed", severity="error")

    def _tick(self) -> None:
        if not self.busy:
            self.action_step()

    def action_toggle_run(self) -> None:
        self.running = not self.running and self.session.can_forward

    def action_back(self) -> None:
        if not self.busy and self.session.back():
            self.show_frame()

    def action_live(self) -> None:
        self.session.cursor = len(self.session.frames) - 1
        self.show_frame()

    def _live(self) -> bool:
        """Whether there is an engine to change; a replay says why not."""
        if not self.session.is_live:
            self.notify("This is a recorded run: there is no model to run new requests.",
                        severity="warning")
        return self.session.is_live

    async def _idle(self) -> None:
        """Stop running and wait for a step in flight, so the engine can be changed."""
        self.running = False
        if self._job is not None:
            await self._job.wait()

    # ------------------------------------------------------------------ requests

    def _suggest(self) -> str:
        self._suggestion += 1
        return SUGGESTIONS[self._suggestion % len(SUGGESTIONS)]

    def action_new_prompt(self) -> None:
        if self._live():
            self.app.push_screen(
                PromptScreen("New prompt (starts a fresh engine)", self._suggest()), self._new_prompt)

    async def _new_prompt(self, prompt: str | None) -> None:
        if prompt is None:
            return
        await self._idle()
        try:
            self.adopt(self.session.restart(prompt))
        except TinyInferError as exc:
            self.notify(str(exc), title="Cannot start that prompt", severity="error")

    def action_add_request(self) -> None:
        if self._live():
            self.app.push_screen(
                PromptScreen("Add a request to the running batch", self._suggest()), self._add_request)

    async def _add_request(self, prompt: str | None) -> None:
        if prompt is None:
            return
        await self._idle()
        try:
            self.session.add_request(prompt, self.session.next_params(self.sampling))
        except TinyInferError as exc:
            self.notify(str(exc), title="Cannot add that request", severity="error")
            return
        self.show_frame()

    async def action_abort(self) -> None:
        seq = self.frame.focus(self.focus_seq) if self.frame else None
        if seq is None or seq.state == "finished":
            self.notify("No unfinished sequence to abort: f chooses one.", severity="warning")
            return
        if not self._live():
            return
        await self._idle()
        self.session.abort(seq.request_id)
        self.show_frame()

    async def action_toggle_speculative(self) -> None:
        if not self._live():
            return
        await self._idle()
        speculation = self.session.speculation
        on = speculation is not None and not speculation.on
        try:
            name = speculation.name if speculation is not None else ""
            self.adopt(self.session.restart(speculative=on, intro=speculation_switched(on, name)))
        except TinyInferError as exc:
            self.notify(str(exc), title="Cannot switch speculative decoding", severity="error")
            return
        self.notify(f"Speculative decoding {'on' if on else 'off'}: the requests start again.")

    async def action_compare(self) -> None:
        """The same requests under other settings, side by side (a new screen; escape returns)."""
        if not self._live():
            return
        await self._idle()
        self.app.push_screen(CompareScreen(self.session, default_kind(self.session), self._comparisons,
                                           self.show_timings, self.options.device))

    # ------------------------------------------------------------------ quantization

    def _show_quantization(self) -> None:
        """The running model's quantization error, measured when it loaded, if this run shows it."""
        live = bool(self.session.source.precision) and self.session.engine is not None
        self.quant_report = report_of(self.session.engine.model) if live else None

    async def action_precision(self) -> None:
        """Reload the model at the next weight precision and run the same requests again."""
        if not self._live():
            return
        await self._idle()
        before = self.session.source.precision or "fp32"
        after = next_precision(before)
        self.busy = True
        self.notify(f"Reloading the model with {after} weights …")
        self._job = self._requantize(after, precision_switched(after, before))

    @work(thread=True, exit_on_error=False, group="engine")
    def _requantize(self, precision: str, intro: str) -> None:
        try:
            session = self.session.requantize(precision, intro, self.options.device)
        except TinyInferError as exc:
            self.app.call_from_thread(self._requantized, None, str(exc))
            return
        self.app.call_from_thread(self._requantized, session, "")

    def _requantized(self, session: Session | None, error: str) -> None:
        self.busy = False
        if session is None:
            self.notify(error, title="Cannot switch the weight precision", severity="error")
            return
        self.adopt(session)
        self.notify(f"Weights now {session.source.precision}: the requests start again.")

    def action_quant_layer(self, delta: int) -> None:
        self.quant_layer += delta

    # ------------------------------------------------------------------ knobs

    def action_sampling(self) -> None:
        self.app.push_screen(SamplingScreen(self.sampling), self._set_sampling)

    def _set_sampling(self, params: SamplingParams | None) -> None:
        if params is not None:
            self.sampling = params

    def action_temperature(self, delta: float) -> None:
        t = min(2.0, max(0.0, round(self.sampling.temperature + delta, 1)))
        self.sampling = dataclasses.replace(self.sampling, temperature=t)

    def action_top_k(self, direction: int) -> None:
        self.sampling = dataclasses.replace(
            self.sampling, top_k=nudge(TOP_K_STEPS, self.sampling.top_k, direction))

    def action_top_p(self, direction: int) -> None:
        self.sampling = dataclasses.replace(
            self.sampling, top_p=nudge(TOP_P_STEPS, self.sampling.top_p, direction))

    def action_follow(self) -> None:
        ids = [s.seq_id for s in self.frame.seqs if s.seq_id is not None] if self.frame else []
        self.focus_seq = cycle(tuple(ids) + (None,), self.focus_seq, 1)

    def action_layer(self, delta: int) -> None:
        self.layer_index += delta

    def action_head(self, delta: int) -> None:
        self.head_index += delta

    def action_toggle_ids(self) -> None:
        self.show_ids = not self.show_ids

    def action_swap(self) -> None:
        self.swap = (self.swap + 1) % len(self._swappable)

    def action_toggle_walkthrough(self) -> None:
        self.walkthrough = not self.walkthrough

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A feature's keys work only in runs that use the feature; v only where panels share a
        slot (a small screen), so that the footer offers it there."""
        if action == "swap":
            return self.has_class("-narrow") or self.has_class("-short")
        feature = FEATURE_ACTIONS.get(action)
        return feature is None or feature in self.features

    def on_resize(self) -> None:
        self.call_after_refresh(self.refresh_bindings)  # the breakpoint classes have moved by then

    def action_help(self) -> None:
        keys = [b for b in self.BINDINGS if self.check_action(b.action.split("(")[0], ())]
        self.app.push_screen(HelpScreen(keys))
