"""Prometheus metrics: per-request counters and latency histograms kept by the server, plus
engine gauges read from the engine's stats snapshot at scrape time (never from the engine
thread's live state, so a scrape never waits for a step).

With several front ends (--api-server-count N) each keeps its request metrics in files under one
directory (prometheus_client's multiprocess mode, as vLLM does), and whichever front end answers
/metrics sums them: the counters and histograms are the server's, not one process's."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splash_jax.engine.request import Request, RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
SHARED_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's name for the shared directory


def share_between_processes(directory: str) -> None:
    """From now on, request metrics made in this process and in processes it spawns live in files
    under `directory` (an empty directory, removed by the caller when the server stops). Call
    before the first ServerMetrics: spawned front ends read the variable when they import
    prometheus_client; this process has imported it already, so its value class is set here."""
    os.environ[SHARED_DIR_ENV] = directory
    values.ValueClass = values.MultiProcessValue()


class MonotonicCounters:
    """Counters exported from the engine's cumulative stats never go backwards: a value below the
    last one seen (the engine's count restarted) continues from the last exported value, and a
    missing value (None: the stats do not have it, or not yet) repeats it."""

    def __init__(self):
        self._lock = threading.Lock()  # scrapes may run concurrently
        self._last: dict[str, float] = {}  # the engine's last value
        self._base: dict[str, float] = {}  # what earlier runs of the engine's count added up to

    def __call__(self, name: str, value: float | None) -> float:
        with self._lock:
            last, base = self._last.get(name, 0.0), self._base.get(name, 0.0)
            if value is None:
                return base + last
            value = float(value)
            if value < last:
                base = self._base[name] = base + last
            self._last[name] = value
            return base + value


# (metric suffix, key of engine.stats()["late_dispatch"], help)
LATE_DISPATCH_COUNTERS = (
    ("waits", "waits", "Steps whose scheduling was held back for arrivals until shortly before the step in flight was "
                       "predicted to end (--late-dispatch)"),
    ("wait_seconds", "waited_s", "Seconds the engine loop held steps back (--late-dispatch)"),
    ("idle_launches", "idle_launches", "Launches that found the device already idle (the step before had ended)"),
    ("idle_after_wait", "idle_after_wait", "Held steps whose launch found the device idle: each lengthens the lead"),
    ("ended_in_launch", "ended_in_launch", "Held steps whose launch found the device busy and whose predecessor had ended "
                                           "when read: the device may have idled during the launch"),
)


class EngineStatsCollector(Collector):
    """Engine gauges and counters from `AsyncEngine.stats()`."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats
        self._counted = MonotonicCounters()

    def _counter(self, name: str, doc: str, value: float | None) -> CounterMetricFamily:
        return _counter(name, doc, self._counted(name, value))

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        total = s.get("pages_total", 0)
        yield _gauge("splash_num_requests_running", "Requests in the running batch", s.get("running", 0))
        yield _gauge("splash_num_requests_waiting", "Requests waiting for admission", s.get("waiting", 0))
        yield _gauge("splash_kv_cache_pages_used", "KV pages in use (all devices)", s.get("pages_used", 0))
        yield _gauge("splash_kv_cache_pages_total", "KV pages (all devices)", total)
        yield _gauge("splash_kv_cache_usage_ratio", "Fraction of KV pages in use", s.get("pages_used", 0) / total if total else 0.0)
        yield _gauge("splash_kv_cache_capacity_tokens", "Tokens the KV pool holds", s.get("kv_capacity_tokens", 0))
        yield _gauge("splash_generation_tokens_per_second", "Tokens generated per second (last 10 s)", s.get("generation_tokens_per_s", 0.0))
        yield _gauge("splash_engine_alive", "1 while the engine loop runs", float(s.get("engine_alive", False)))
        yield self._counter("splash_engine_steps", "Engine steps run", s.get("num_steps"))
        yield self._counter("splash_engine_step_errors", "Engine steps that raised", s.get("step_errors"))
        yield self._counter("splash_engine_device_step_failures", "Device steps that failed (the KV pool restarted "
                            "empty and the running requests were recomputed)", s.get("step_failures"))
        yield self._counter("splash_engine_core_loop_cpu_seconds", "CPU seconds of the engine core's loop thread "
                            "(with the core in its own process)", s.get("core_loop_cpu_s"))
        yield self._counter("splash_engine_device_wait_seconds", "Seconds the engine loop blocked on the device for "
                            "sampled tokens (a spinning wait counts as CPU too)", s.get("device_wait_s"))
        phases = CounterMetricFamily("splash_engine_step_host_seconds", "Wall seconds of the engine loop's step() by "
                                     "phase (schedule, dispatch, complete, wait, ...)", labels=["phase"])
        for phase, ms in sorted((s.get("host_phase_ms") or {}).items()):
            phases.add_metric([phase], self._counted(f"host_phase_{phase}", ms / 1e3))
        yield phases
        late = s.get("late_dispatch") or {}  # engine/dispatch_timing.py; absent or disabled: zeros
        for suffix, key, doc in LATE_DISPATCH_COUNTERS:
            yield self._counter(f"splash_engine_late_dispatch_{suffix}", doc, late.get(key))
        yield _gauge("splash_engine_late_dispatch_lead_seconds", "How long before a held step's predicted end the "
                     "next one is scheduled (host time to its launch, margin, backoff)",
                     (late.get("host_lead_ms") or 0.0) / 1e3 if late.get("holds", late.get("enabled")) else 0.0)
        yield self._counter("splash_engine_step_time_cap_steps", "Steps whose prefill beside decodes "
                            "--max-step-ms-with-decodes cut (engine/step_time_cap.py)",
                            (s.get("step_time_cap") or {}).get("capped_steps"))
        yield _gauge("splash_api_servers", "HTTP front-end processes connected to the engine core", s.get("front_ends", 1))
        yield _gauge("splash_engine_compiles_after_ready", "Traces and compiles in the engine core since it was ready "
                     "(0: every program was compiled at start-up)", s.get("compiles_after_ready", 0))
        yield self._counter("splash_num_preemptions", "Requests preempted (recomputed later)", s.get("num_preemptions"))
        yield self._counter("splash_layout_switches", "Attention layout switches completed", s.get("switches", s.get("num_switches")))
        cache = s.get("prefix_cache") or {}  # absent: an engine without prefix caching (zeros)
        yield self._counter("splash_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", cache.get("queries"))
        yield self._counter("splash_prefix_cache_hits", "Prompt tokens found in the prefix cache", cache.get("hits"))
        yield self._counter("splash_prefix_cache_evictions", "Pages evicted from the prefix cache", cache.get("evictions"))
        yield _gauge("splash_prefix_cache_pages", "KV pages the prefix cache holds", cache.get("cached_pages", 0))
        grammar = s.get("structured_outputs") or {}  # absent: an engine without structured outputs (zeros)
        yield self._counter("splash_grammar_mask_fills", "Steps whose grammar rows got token masks", grammar.get("mask_fills"))
        yield self._counter("splash_grammar_constrained_rows", "Logits rows sampled under a grammar mask",
                            grammar.get("constrained_rows"))
        yield self._counter("splash_grammar_mask_seconds", "Host seconds spent filling grammar masks (on the grammar thread)",
                            grammar.get("mask_seconds"))
        spec = s.get("speculative") or {}  # absent: speculation off (zeros)
        yield self._counter("splash_spec_decode_verify_chunks", "Request-steps that verified speculative drafts",
                            spec.get("verify_chunks"))
        yield self._counter("splash_spec_decode_draft_tokens", "Speculative draft tokens verified", spec.get("draft_tokens"))
        yield self._counter("splash_spec_decode_accepted_tokens", "Speculative draft tokens accepted", spec.get("accepted_tokens"))
        per_chunk = CounterMetricFamily("splash_spec_decode_accepted_per_step",
                                        "Verify chunks by the number of drafts they accepted", labels=["accepted"])
        for a, count in enumerate(spec.get("accepted_histogram") or []):
            per_chunk.add_metric([str(a)], self._counted(f"spec_accepted_{a}", count))
        yield per_chunk
        adaptive = spec.get("adaptive") or {}  # the draft budget (engine/draft_budget.py); absent: fixed K
        yield _gauge("splash_spec_decode_mean_drafts", "Mean drafts per decoding request per step the draft budget gave",
                     float(adaptive.get("mean_k", 0.0)))
        level = GaugeMetricFamily("splash_spec_decode_draft_level",
                                  "Drafts per request the budget runs at each batch-size bucket (its smallest batch)",
                                  labels=["batch"])
        rates = GaugeMetricFamily("splash_spec_decode_level_tokens_per_second",
                                  "Output tokens per second the budget measured at each level (drafts per request) "
                                  "and batch-size bucket: what it picks the level by", labels=["batch", "level"])
        for batch, bucket in (adaptive.get("by_batch") or {}).items():
            level.add_metric([str(batch)], float(bucket["level"]))
            for lv, rate in bucket["tokens_per_s_by_level"].items():
                rates.add_metric([str(batch), str(lv)], float(rate))
        yield level
        yield rates
        switch = s.get("switch") or {}
        yield _gauge("splash_layout_switch_in_progress", "1 while a layout switch migrates", float(bool(switch)))
        yield _gauge("splash_layout_switch_progress", "Fraction of the switch's pages copied", float(switch.get("progress", 0.0)))
        intervals = s.get("step_intervals") or {}
        cadence = GaugeMetricFamily(
            "splash_step_interval_ms", "Interval between back-to-back step completions (last 4096 steps) by step kind",
            labels=["kind", "stat"])
        for kind in ("decode_only", "with_prefill"):
            for stat in ("p50_ms", "mean_ms", "p99_ms", "host_cpu_p50_ms"):
                if stat in intervals.get(kind, {}):
                    cadence.add_metric([kind, stat.removesuffix("_ms")], float(intervals[kind][stat]))
        yield cadence
        if intervals.get("prefill_share") is not None:
            yield _gauge("splash_step_prefill_share", "Share of recent steps that carried prefill tokens",
                         float(intervals["prefill_share"]))
        layout = GaugeMetricFamily("splash_layout_info", "The current attention layout (value 1)", labels=["layout"])
        layout.add_metric([str(s.get("layout", "unknown"))], 1.0)
        yield layout


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]):
        disable_created_metrics()  # no *_created series: they double the output and nobody reads them
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splash_requests", "Generation requests finished (one per choice)", ["finish_reason"], registry=r)
        self.errors = Counter("splash_http_errors", "HTTP requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("splash_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("splash_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("splash_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("splash_time_per_output_token_seconds", "Mean time per token after the first", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("splash_e2e_request_latency_seconds", "Arrival to last token", buckets=E2E_BUCKETS, registry=r)
        engine = EngineStatsCollector(stats)
        r.register(engine)
        self.scraped = r
        shared = os.environ.get(SHARED_DIR_ENV)
        if shared:  # every front end's request metrics, summed, and the core's figures
            self.scraped = CollectorRegistry()
            MultiProcessCollector(self.scraped, path=shared)
            self.scraped.register(engine)

    def render(self) -> bytes:
        return generate_latest(self.scraped)

    def track(self, requests: Sequence[Request]) -> "RequestTracker":
        return RequestTracker(self, requests)


class RequestTracker:
    """Counts one HTTP request's engine requests as their outputs pass by."""

    def __init__(self, metrics: ServerMetrics, requests: Sequence[Request]):
        self.metrics = metrics
        self.start = time.monotonic()
        self._open = {r.request_id for r in requests}
        metrics.prompt_tokens.inc(sum(len(r.prompt_ids) for r in requests))

    def observe(self, out: RequestOutput) -> None:
        if out.delta_token_ids:
            self.metrics.generation_tokens.inc(len(out.delta_token_ids))
        if out.finished and out.request_id in self._open:
            self._open.discard(out.request_id)
            m = self.metrics
            m.requests.labels(out.finish_reason or "unknown").inc()
            if out.ttft is not None:
                m.ttft.observe(out.ttft)
            if out.tpot is not None:
                m.tpot.observe(out.tpot)
            m.e2e.observe(time.monotonic() - self.start)

    def close(self) -> None:
        """Requests that never finished (client gone, error) count as aborted."""
        if self._open:
            self.metrics.requests.labels("abort").inc(len(self._open))
            self._open.clear()


def num_switches(stats: dict) -> int:
    """Completed layout switches, under the engine's key ("switches"; "num_switches" also read)."""
    return int(stats.get("switches", stats.get("num_switches", 0)) or 0)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
