"""When to schedule the next step while a long one runs: late enough that requests arriving
meanwhile join it, early enough that the device never waits for it.

With overlapped scheduling the next step is scheduled and dispatched as soon as the current one
is, so its host work hides under the device's. Behind a decode step (~10 ms) that is right.
Behind a long prefill step (100-250 ms for 8K tokens of V2-Lite on an H200) it means a request
arriving while that step runs misses the next step too, already packed, and waits for both
(issue 46: on the Mooncake-shaped trace 48% of the time is spent in prefill steps of 114 ms
on average). `DispatchTiming.delay_s` says how long the loop that drives the engine may still
wait for new requests before it schedules the next step: until `lead` before the step in flight
is predicted to end. The loops that call `EngineCore.step()` ask it (the core process's loop,
AsyncEngine's thread, benchmarks/dynamic.py's replay); `step()` itself never sleeps.

The prediction errs short, since a late dispatch that comes after the step ends leaves the device
idle while a short prediction only lets fewer arrivals in:
- a step's device time is its completion minus its start, start = the later of its dispatch's
  end and the previous step's completion; only completions the host waited for count (their time
  is the device's; a step found already done ended at some unknown earlier time, so the next one
  is taken to start at its own dispatch), and idle time before a late dispatch never counts, so
  late dispatches cannot lengthen the predictions that time them;
- a step's device time is fitted (least squares over the recent long steps) to its prefill
  tokens, its prefill query-key pairs (a chunk deep into a long prompt costs more per token than
  a fresh one), its decode rows and a constant; the prediction is that fit less one standard
  deviation of its residuals. Until `fit_samples` long steps are timed it is P times the cheapest
  time per prefill token among the recent steps of at least P prefill tokens (the only rule
  before the fit: it ignored depth and decodes and predicted the trace's 130 ms steps about 45 ms
  short, so arrivals in the last ~60 ms of a step still missed the next one);
- `lead` is the longest host time (schedule + dispatch) of the recent steps, times a margin, plus
  a fraction of the prediction.
Only a step predicted to run `min_step_s` or longer is waited on.

Measured with the cheapest-rate prediction (one H100, V2-Lite 27 layers, benchmarks/ttft_trace.py,
2026-12-05): the device never ran dry and throughput held, but TTFT barely moved: fcfs p50 0.302 ->
0.303 s (406 steps held back, 21 s of waiting); srpf p50 0.307 -> 0.286 s with p99 1.42 -> 1.75 s.
Under fcfs an arrival queues behind the prefill work already waiting, so joining the next step
earlier rarely changes when its own chunk runs. The trace replayed through the scheduler with
modelled steps (benchmarks/probes/ttft_sim.py) puts srpf's p50 at 0.212 / 0.237 / 0.263 s with a
lead of 4 ms / 60 ms / no late dispatch: how late the dispatch comes decides what it is worth.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from splash_jax.calibration import attended_keys
from splash_jax.engine.step_timeline import classify

MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class DispatchTimingConfig:
    min_prefill_tokens: int = 1024  # steps with fewer prefill tokens are neither timed nor waited on
    min_step_s: float = 0.02  # a step predicted shorter than this is not waited on
    lead_margin: float = 1.5  # times the longest recent host time to schedule and dispatch a step
    lead_floor_s: float = 0.002  # added to the lead
    lead_fraction: float = 0.1  # of the predicted device time, added to the lead
    history: int = 64  # steps remembered per kind
    min_samples: int = 4  # long steps timed before any wait
    fit_samples: int = 16  # long steps timed before the fit is used (before: the cheapest rate alone)


def resolved(mode: str, backend: str) -> bool:
    """--late-dispatch (default off) auto: on accelerators (on CPU the "device" shares the host's cores)."""
    if mode not in MODES:
        raise ValueError(f"--late-dispatch must be one of {', '.join(MODES)}, got {mode!r}")
    return backend != "cpu" if mode == "auto" else mode == "on"


class DispatchTiming:
    """Device times of recent steps and the delay before the next dispatch (module docstring)."""

    def __init__(self, enabled: bool, config: DispatchTimingConfig | None = None, clock=None):
        self.enabled = enabled
        self.config = config or DispatchTimingConfig()
        self.clock = clock or time.perf_counter
        # (features: 1, prefill tokens, query-key pairs / 1e6, decode rows; device s)
        self._timed: collections.deque[tuple[tuple[float, ...], float]] = collections.deque(maxlen=self.config.history)
        self._fit: tuple[np.ndarray, float] | None = None  # (coefficients, residual std), refitted per timed step
        self._host: collections.deque[float] = collections.deque(maxlen=16)
        self._last_done: float | None = None
        self._wait_from: float | None = None  # when delay_s first held the next step back
        self.waited_s = 0.0  # time the driving loops waited on delay_s (stats)
        self.waits = 0  # steps they held back

    def dispatched(self, step, host_s: float) -> None:
        """A step was dispatched now (`host_s`: its schedule and dispatch host time). Off: nothing
        (no per-step host work)."""
        if not self.enabled:
            return
        step.dispatch_end = self.clock()
        step.prefill_tokens, decode = classify(step.chunks)
        if step.prefill_tokens >= self.config.min_prefill_tokens:  # only long steps are timed or waited on
            step.features = (1.0, float(step.prefill_tokens), prefill_pairs(step.chunks) / 1e6, float(decode))
        self._host.append(host_s)
        if self._wait_from is not None:  # the loop waited on delay_s before this step
            self.waited_s += step.dispatch_end - host_s - self._wait_from
            self.waits += 1
            self._wait_from = None

    def completed(self, step, waited_s: float) -> None:
        """A step's tokens reached the host now, after the host blocked `waited_s` for them."""
        if not self.enabled:
            return
        now, waited = self.clock(), waited_s > 1e-4
        if waited and step.dispatch_end is not None and step.prefill_tokens >= self.config.min_prefill_tokens:
            start = step.dispatch_end if self._last_done is None else max(step.dispatch_end, self._last_done)
            self._timed.append((step.features, now - start))  # the device was still on it: its end is now
            self._refit()
        self._last_done = now if waited else None  # found done: it ended at some earlier time

    def _refit(self) -> None:
        if len(self._timed) < self.config.fit_samples:
            return
        x = np.array([f for f, _ in self._timed])
        y = np.array([d for _, d in self._timed])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-9)  # columns of comparable size
        coef = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
        residual = y - x @ coef
        self._fit = (coef, float(np.sqrt(residual @ residual / (len(y) - x.shape[1]))))  # unbiased: 4 fitted

    def predicted_s(self, tokens: int, features: tuple[float, ...] | None = None) -> float | None:
        """The device time a step of `tokens` prefill tokens (and `features`, as `dispatched` sets
        them) is expected to take at least: the fit less one residual deviation; before the fit,
        the cheapest recent rate times `tokens` (None: too few of the recent steps were as big)."""
        if tokens < self.config.min_prefill_tokens:
            return None
        if self._fit is not None and features is not None:
            coef, sd = self._fit
            return float(np.dot(coef, features)) - sd
        rates = [d / f[1] for f, d in self._timed if f[1] >= tokens]
        return min(rates) * tokens if len(rates) >= self.config.min_samples else None

    def lead_s(self, predicted_s: float = 0.0) -> float:
        c = self.config
        return max(self._host, default=0.0) * c.lead_margin + c.lead_floor_s + c.lead_fraction * predicted_s

    def delay_s(self, step) -> float:
        """Seconds the driving loop may still wait for requests before scheduling the next step
        (0: schedule now)."""
        if not self.enabled or step is None or step.dispatch_end is None:
            return 0.0
        duration = self.predicted_s(step.prefill_tokens, step.features or None)
        if duration is None or duration < self.config.min_step_s:
            return 0.0
        start = step.dispatch_end if self._last_done is None else max(step.dispatch_end, self._last_done)
        now = self.clock()
        delay = max(0.0, start + duration - self.lead_s(duration) - now)
        if delay and self._wait_from is None:
            self._wait_from = now
        return delay

    def summary(self) -> dict:
        rates = [d / f[1] for f, d in self._timed]
        fit = None if self._fit is None else {  # ms: per step, per 1K prefill tokens, per 1M pairs, per decode row
            "ms": [round(float(c) * 1e3, 4) for c in self._fit[0]], "residual_sd_ms": round(self._fit[1] * 1e3, 3)}
        return {"enabled": self.enabled, "waits": self.waits, "waited_s": round(self.waited_s, 3),
                "min_ms_per_1k_prefill_tokens": round(min(rates) * 1e6, 3) if rates else None, "fit": fit,
                "host_lead_ms": round(self.lead_s() * 1e3, 2)}


def prefill_pairs(chunks) -> float:
    """Query-key pairs of a step's prompt chunks: each prompt token attends to everything before it."""
    total = 0.0
    for c in chunks:
        prompt = len(c.request.prompt_ids)
        if c.start < prompt:
            total += attended_keys(c.start, min(c.end, prompt) - c.start)
    return total
