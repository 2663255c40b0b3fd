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
- a step of P prefill tokens takes at least P times the cheapest time per prefill token among
  the recent steps of at least P prefill tokens (a step's fixed costs, its decode rows' weight
  reads, spread over more tokens in a bigger step, and a chunk deep into a long prompt costs more
  per token than a fresh one: the minimum picks the cheapest case); the prediction ignores the
  step's decodes;
- `lead` is the longest host time (schedule + dispatch) of the recent steps, times a margin, plus
  a fraction of the prediction.
Only a step predicted to run `min_step_s` or longer is waited on.

Measured (one H100, V2-Lite 27 layers, benchmarks/ttft_trace.py, 2026-12-05): the device never ran
dry and throughput held, but TTFT barely moved: fcfs p50 0.302 -> 0.303 s (406 steps held back,
21 s of waiting); srpf p50 0.307 -> 0.286 s with p99 1.42 -> 1.75 s. Under fcfs an arrival queues
behind the prefill work already waiting, so joining the next step earlier rarely changes when its
own chunk runs. Hence off by default (--late-dispatch on/auto to use it).
"""

from __future__ import annotations

import collections
import dataclasses
import time

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
        self._timed: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.config.history)  # (P, s)
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
        step.prefill_tokens = classify(step.chunks)[0]
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
            self._timed.append((step.prefill_tokens, now - start))  # the device was still on it: its end is now
        self._last_done = now if waited else None  # found done: it ended at some earlier time

    def predicted_s(self, tokens: int) -> float | None:
        """The least device time a step of `tokens` prefill tokens is expected to take (None:
        too few of the recent steps were as big)."""
        rates = [d / p for p, d in self._timed if p >= tokens]
        if tokens < self.config.min_prefill_tokens or len(rates) < self.config.min_samples:
            return None
        return min(rates) * tokens

    def lead_s(self, predicted_s: float = 0.0) -> float:
        c = self.config
        return max(self._host, default=0.0) * c.lead_margin + c.lead_floor_s + c.lead_fraction * predicted_s

    def delay_s(self, step) -> float:
        """Seconds the driving loop may still wait for requests before scheduling the next step
        (0: schedule now)."""
        if not self.enabled or step is None or step.dispatch_end is None:
            return 0.0
        duration = self.predicted_s(step.prefill_tokens)
        if duration is None or duration < self.config.min_step_s:
            return 0.0
        start = step.dispatch_end if self._last_done is None else max(step.dispatch_end, self._last_done)
        now = self.clock()
        delay = max(0.0, start + duration - self.lead_s(duration) - now)
        if delay and self._wait_from is None:
            self._wait_from = now
        return delay

    def summary(self) -> dict:
        rates = [d / p for p, d in self._timed]
        return {"enabled": self.enabled, "waits": self.waits, "waited_s": round(self.waited_s, 3),
                "min_ms_per_1k_prefill_tokens": round(min(rates) * 1e6, 3) if rates else None,
                "host_lead_ms": round(self.lead_s() * 1e3, 2)}
