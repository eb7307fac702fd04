"""Server metering in the Prometheus text format: counters, histograms and engine gauges.

Written out by hand (the format is a few lines per metric) so a reader sees exactly what a
scrape returns. The engine thread and the HTTP handlers both record, so a lock guards it.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass

# Seconds. TTFT spans queueing plus prefill; TPOT is one decode step shared by the batch.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after its latest step, published by the engine thread."""

    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    kv_pages_cached: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    steps: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from cached pages."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class Histogram:
    """Cumulative-bucket histogram as Prometheus defines it (le = less than or equal)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _escape(value: str) -> str:
    """A label value as the format wants it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


class Metrics:
    """Everything /metrics reports, recorded as requests arrive, run and finish."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) → count
        self.finished: Counter[str] = Counter()  # finish reason → sequences
        self.aborted: Counter[str] = Counter()  # why → requests the server gave up on
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def count_abort(self, reason: str) -> None:
        with self._lock:
            self.aborted[reason] += 1

    def add_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated

    def observe_sequence(self, reason: str, ttft: float | None, tpot: float | None,
                         latency: float) -> None:
        """One finished sequence: why it ended and how long its tokens took."""
        with self._lock:
            self.finished[reason] += 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            self.latency.observe(latency)

    def render(self, stats: EngineStats) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        with self._lock:
            lines = _header("tinyinfer_requests_total", "counter",
                            "HTTP requests answered, by endpoint and status code.")
            lines += [f"tinyinfer_requests_total{_labels(endpoint=e, status=str(s))} {n}"
                      for (e, s), n in sorted(self.requests.items())]
            lines += _header("tinyinfer_sequences_finished_total", "counter",
                             "Generated sequences by finish reason (stop, length, abort).")
            lines += [f"tinyinfer_sequences_finished_total{_labels(reason=r)} {n}"
                      for r, n in sorted(self.finished.items())]
            lines += _header("tinyinfer_request_aborts_total", "counter",
                             "Requests the server stopped early: client disconnect, timeout, shutdown.")
            lines += [f"tinyinfer_request_aborts_total{_labels(reason=r)} {n}"
                      for r, n in sorted(self.aborted.items())]
            for name, value, text in (
                ("tinyinfer_prompt_tokens_total", self.prompt_tokens, "Prompt tokens admitted."),
                ("tinyinfer_generation_tokens_total", self.generation_tokens, "Tokens generated."),
                ("tinyinfer_prefix_cache_queried_tokens_total", stats.prefix_queried_tokens,
                 "Prompt tokens looked up in the prefix cache."),
                ("tinyinfer_prefix_cache_hit_tokens_total", stats.prefix_hit_tokens,
                 "Prompt tokens served from cached KV pages."),
                ("tinyinfer_engine_steps_total", stats.steps, "Engine steps (model forward passes)."),
            ):
                lines += _header(name, "counter", text) + [f"{name} {value}"]
            for name, hist, text in (
                ("tinyinfer_time_to_first_token_seconds", self.ttft,
                 "Arrival to first generated token, per sequence."),
                ("tinyinfer_time_per_output_token_seconds", self.tpot,
                 "Mean time between generated tokens after the first, per sequence."),
                ("tinyinfer_e2e_request_latency_seconds", self.latency,
                 "Arrival to last token, per sequence."),
            ):
                lines += _header(name, "histogram", text) + hist.lines(name)
        for name, value, text in (
            ("tinyinfer_num_requests_running", stats.running, "Sequences in the running batch."),
            ("tinyinfer_num_requests_waiting", stats.waiting, "Sequences queued for admission."),
            ("tinyinfer_kv_pages_used", stats.kv_pages_used, "KV pages held by sequences."),
            ("tinyinfer_kv_pages_total", stats.kv_pages_total, "KV pages in the pool."),
            ("tinyinfer_kv_pages_cached", stats.kv_pages_cached,
             "KV pages carrying a prefix hash (held or evictable)."),
            ("tinyinfer_prefix_cache_hit_rate", stats.prefix_hit_rate,
             "Prefix-cache hit tokens / queried tokens since start."),
        ):
            lines += _header(name, "gauge", text) + [f"{name} {value}"]
        return "\n".join(lines) + "\n"
