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

Since the evening of 2026-12-06 (the lead was ~45-55 ms on the trace's ~120 ms steps, and the model put ~10% of
TTFT p50 in it):
- the lead counts the host time until a step's launch (schedule, copy-on-write pages, pack), not
  its whole dispatch: the program's kernels are enqueued while the device runs the first ones, so
  the device waits only for what comes before the launch;
- `launching` checks, just before each launch, whether the step in flight has already ended, and
  `reading` again just before the host blocks on its tokens. A step already done when the host came to
  read it is not timed (its end is unknown: counting to now would count idle time and the next launch,
  lengthen the predictions and so the holds; on one H100 that fed back until held decode steps took
  1 s). A held
  step that finds the device idle grows a backoff added to the lead (x 1.5 + 2 ms: steps that got
  much faster than their fit are untimed while they idle the device, so it must outgrow any error),
  and each held step that finds it busy shrinks it by 5% (`summary()`: `idle_launches`,
  `idle_after_wait`, `backoff_ms`). A held step whose launch found the step before busy and whose
  read right after found it done is counted too (`ended_in_launch`): a device whose program starts
  only when its launch call returns (a CUDA graph) idled for part of that call, which `launching`
  cannot see; with `backoff_on_ended_in_launch` (off) such steps grow the backoff as well;
- short steps (decode-only steps, small prefills) are timed too, on a fit of their own (decode
  tokens, the context they read, prefill tokens, a constant), and held back when predicted to run
  `min_step_s` or longer: an arrival during decode steps (~15 ms each on the trace) joined the step
  after the next one, since each was dispatched a whole step ahead. A kind whose recent steps all ran
  under `min_step_s` (batch-1 decodes) is neither fitted nor held. Only with `--late-dispatch on`
  since 2026-12-06 22:30 (`short_steps`; auto holds prefill steps only): through the server at 64
  closed-loop streams holding ~12.6 ms decode steps cost TPOT 2-5% (`resolved`).
Measured (one H100, the trace, docs/performance.md "Late dispatch from the launch"): the lead fell
from ~33 to ~14 ms (+10% of the prediction), TTFT p50 0.234 -> 0.224 s, 2,220 steps held, one held
step found the device idle; decode steps, TPOT and throughput unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from splash_jax.calibration import attended_keys
from splash_jax.engine.step_time_cap import StepCost

MODES = ("auto", "on", "off", "prefill")
LONG, SHORT = "long", "short"  # step kinds, each timed and fitted on its own


@dataclasses.dataclass(frozen=True)
class DispatchTimingConfig:
    min_prefill_tokens: int = 1024  # a step with this many prefill tokens is long (its own fit); others are short
    min_step_s: float = 0.01  # a step predicted shorter than this is not waited on
    short_steps: bool = True  # short steps are timed and waited on too (False: long steps only, as before)
    lead_from_launch: bool = True  # the lead counts host time up to the launch (False: the whole dispatch)
    lead_margin: float = 1.5  # times the longest recent host time to schedule and launch a step
    lead_floor_s: float = 0.002  # added to the lead
    lead_fraction: float = 0.1  # of the predicted device time, added to the lead
    idle_backoff_s: float = 0.002  # a held step that finds the device idle at its launch: backoff x 1.5 + this
    max_backoff_s: float = 1.0  # the most the backoff grows to (a step longer than any: no hold)
    backoff_on_ended_in_launch: bool = False  # a held step whose predecessor ended during its launch grows it too
    backoff_decay: float = 0.95  # the backoff's factor per held step that finds the device busy
    history: int = 64  # steps remembered per kind
    min_samples: int = 4  # long steps timed before any wait
    fit_samples: int = 16  # steps of a kind timed before its fit is used (long steps before: the cheapest rate)
    refit_every: int = 16  # timed steps of a kind between refits (a refit costs ~100 us of host time)
    min_wait_s: float = 0.001  # without `reading`: a step is timed only if the host blocked this long for it


def resolved(mode: str, backend: str) -> tuple[bool, DispatchTimingConfig]:
    """--late-dispatch -> (enabled, its rules). prefill: long prefill steps are held, short steps
    (decode-only steps among them) never; on: short steps predicted `min_step_s` or longer too;
    auto: prefill on accelerators, off on CPU (there the "device" shares the host's cores).

    Why auto holds prefill steps only: through the server at 64 closed-loop streams (V2-Lite, one
    H100, ~12.6 ms decode steps) holding decode steps cost TPOT 2-5% and output tok/s 2-4% in three
    pairs of runs (benchmarks/probes/late_dispatch_serving.py; docs/performance.md), for a TTFT p50
    15% lower; a steady stream of decode steps has no arrival burst to gain from it."""
    if mode not in MODES:
        raise ValueError(f"--late-dispatch must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        mode = "off" if backend == "cpu" else "prefill"
    return mode != "off", DispatchTimingConfig(short_steps=mode == "on")


class _Timed:
    """The recent steps of one kind: (features, device seconds), their least-squares fit, and the
    host time up to their launch."""

    def __init__(self, config: DispatchTimingConfig):
        self.config = config
        self.samples: collections.deque[tuple[tuple[float, ...], float]] = collections.deque(maxlen=config.history)
        self.host: collections.deque[float] = collections.deque(maxlen=16)
        self.fit: tuple[list[float], float] | None = None  # (coefficients, residual std)
        self.longest = 0.0  # the longest device time among the samples at the last refit
        self.too_short = False  # at the last refit no sample ran min_step_s: no step of this kind is held
        self._since_fit = 0
        self._refits = 0

    def add(self, features: tuple[float, ...], seconds: float) -> None:
        self.samples.append((features, seconds))
        self._since_fit += 1
        c = self.config
        if len(self.samples) >= c.fit_samples and (self._since_fit >= c.refit_every or not self._refits):
            self._refit()

    def _refit(self) -> None:
        self._since_fit, self._refits = 0, self._refits + 1
        y = np.fromiter((d for _, d in self.samples), float, len(self.samples))
        self.longest = float(y.max())
        self.too_short = self.longest < self.config.min_step_s
        if self.too_short:  # (batch-1 decode steps: no fit, no host time spent on one)
            self.fit = None
            return
        x = np.array([f for f, _ in self.samples])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-9)  # columns of comparable size
        coef = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
        residual = y - x @ coef
        self.fit = (coef.tolist(), float(np.sqrt(residual @ residual / max(1, len(y) - x.shape[1]))))

    def predicted(self, features: tuple[float, ...]) -> float | None:
        """The fit less one residual deviation, never more than the longest step timed: a fit that
        extrapolates cannot hold the loop longer than any step seen."""
        if self.fit is None or not features:
            return None
        coef, sd = self.fit
        return min(sum(a * b for a, b in zip(coef, features)) - sd, self.longest)

    def summary(self) -> dict | None:
        host = sorted(self.host)
        return {"timed": len(self.samples), "fit_ms": None if self.fit is None else [round(float(c) * 1e3, 4) for c in self.fit[0]],
                "residual_sd_ms": None if self.fit is None else round(self.fit[1] * 1e3, 3),
                "host_to_launch_ms": {"p50": round(host[len(host) // 2] * 1e3, 3), "max": round(host[-1] * 1e3, 3)} if host else None}


class DispatchTiming:
    """Device times of recent steps and the delay before the next dispatch (module docstring)."""

    def __init__(self, enabled: bool, config: DispatchTimingConfig | None = None, clock=None, holds: bool | None = None):
        self.enabled = enabled  # steps are timed and fitted
        self.holds = enabled if holds is None else holds and enabled  # delay_s holds steps (False: timing only, step_cost)
        self.config = config or DispatchTimingConfig()
        self.clock = clock or time.perf_counter
        # long: (1, prefill tokens, query-key pairs / 1e6, decode tokens); short: (1, decode tokens,
        # context tokens the decodes read / 1e6, prefill tokens)
        self._kinds = {LONG: _Timed(self.config), SHORT: _Timed(self.config)}
        self._last_done: float | None = None
        self._wait_from: float | None = None  # when delay_s first held the next step back
        self._launch_at: float | None = None  # when the step being dispatched launched (`launching`)
        self._idle_at_launch = False
        self._read: tuple[object, bool] | None = None  # (step, done already) when the host came to read it
        self.backoff_s = 0.0  # added to the lead by held steps that found the device idle
        self.waited_s = 0.0  # time the driving loops waited on delay_s (stats)
        self.waits = 0  # steps they held back
        self.idle_launches = 0  # launches that found the step before already done (the device idle)
        self.idle_after_wait = 0  # of those, launches of held steps
        self.ended_in_launch = 0  # held steps whose predecessor ended while they launched (`reading`)
        self._held_busy = False  # the step dispatched last was held, and its launch found the device busy

    def launching(self, previous) -> None:
        """The step being dispatched launches now (its inputs packed); `previous`: the step still
        in flight, whose end (already reached: the device is idle) is checked without waiting."""
        if not self.enabled:
            return
        self._launch_at = self.clock()
        self._idle_at_launch = _done(previous)

    def reading(self, step) -> None:
        """The host is about to block on `step`'s tokens. Whether they are there already decides
        whether it is timed: a step that ended before the host came to read it ended at some unknown
        time, maybe during the next step's launch or the hold before it."""
        if self.enabled:
            self._read = (step, _done(step))
            if self._read[1] and self._held_busy:  # busy at the launch's start, done by its end
                self.ended_in_launch += 1
                if self.config.backoff_on_ended_in_launch:
                    self._grow_backoff()
            self._held_busy = False

    def dispatched(self, step, host_s: float) -> None:
        """A step was dispatched now (`host_s`: its schedule and dispatch host time). Off: nothing
        (no per-step host work)."""
        if not self.enabled:
            return
        c = self.config
        now = step.dispatch_end = self.clock()
        launch, self._launch_at = self._launch_at, None
        to_launch = launch - (now - host_s) if launch is not None and c.lead_from_launch else host_s
        prefill, decode, context = tally(step.chunks)
        step.prefill_tokens = prefill
        kind = LONG if prefill >= c.min_prefill_tokens else SHORT
        if kind == LONG:  # (query-key pairs only for long steps: a loop over the chunks)
            step.features = (1.0, float(prefill), prefill_pairs(step.chunks) / 1e6, float(decode))
        elif c.short_steps:
            step.features = (1.0, float(decode), context / 1e6, float(prefill))
        self._kinds[kind].host.append(max(0.0, to_launch))
        held, self._wait_from = self._wait_from, None
        if held is not None:  # the loop waited on delay_s before this step
            self.waited_s += now - host_s - held
            self.waits += 1
        if self._idle_at_launch:
            self.idle_launches += 1
            if held is not None:
                self.idle_after_wait += 1
                self._grow_backoff()
        elif held is not None:
            self.backoff_s *= c.backoff_decay
        self._held_busy = held is not None and not self._idle_at_launch
        self._idle_at_launch = False

    def _grow_backoff(self) -> None:
        c = self.config
        self.backoff_s = min(c.max_backoff_s, 1.5 * self.backoff_s + c.idle_backoff_s)

    def completed(self, step, waited_s: float) -> None:
        """A step's tokens reached the host now, after the host blocked `waited_s` for them."""
        if not self.enabled:
            return
        # Timed only if it was still running when the host came to read it (its end is now):
        # counting a step that ended unseen from its start to now would count idle time and the
        # next step's launch, lengthen the predictions and so the holds that idle the device
        # (measured: held decode steps grew to 1 s). A caller that does not call `reading`: timed
        # if the host blocked min_wait_s.
        read, self._read = self._read, None
        if read is not None and read[0] is step:
            running, ended_now = not read[1], not read[1]
        else:
            running, ended_now = waited_s >= self.config.min_wait_s, waited_s > 1e-4
        now = self.clock()
        if running and step.dispatch_end is not None and step.features:
            start = step.dispatch_end if self._last_done is None else max(step.dispatch_end, self._last_done)
            self._kinds[self._kind(step)].add(step.features, now - start)  # the device was still on it: its end is now
        self._last_done = now if ended_now else None  # (when the next step started, if it was queued)

    def _kind(self, step) -> str:
        return LONG if step.prefill_tokens >= self.config.min_prefill_tokens else SHORT

    def predicted_s(self, step) -> float | None:
        """The device time `step` (as `dispatched` left it) is expected to take at least: its
        kind's fit less one residual deviation; a long step before its fit: the cheapest recent
        rate times its prefill tokens (None: too few recent steps were as big, or a short step
        before its fit)."""
        kind = self._kind(step)
        timed = self._kinds[kind]
        if timed.too_short:
            return None
        predicted = timed.predicted(step.features)
        if predicted is not None or kind == SHORT:
            return predicted
        tokens = step.prefill_tokens
        rates = [d / f[1] for f, d in self._kinds[LONG].samples if f[1] >= tokens]
        return min(rates) * tokens if len(rates) >= self.config.min_samples else None

    def lead_s(self, predicted_s: float = 0.0) -> float:
        """How long before the step in flight is predicted to end the next one is scheduled: the
        longest recent host time up to a launch (either kind: the next step's kind is not known
        yet), a margin, a fraction of the prediction and what idle launches added."""
        c = self.config
        host = max((max(k.host, default=0.0) for k in self._kinds.values()), default=0.0)
        return host * c.lead_margin + c.lead_floor_s + c.lead_fraction * predicted_s + self.backoff_s

    def delay_s(self, step) -> float:
        """Seconds the driving loop may still wait for requests before scheduling the next step
        (0: schedule now)."""
        if not self.holds or step is None or step.dispatch_end is None:
            return 0.0
        if not self.config.short_steps and self._kind(step) == SHORT:
            return 0.0
        duration = self.predicted_s(step)
        if duration is None or duration < self.config.min_step_s:
            return 0.0
        start = step.dispatch_end if self._last_done is None else max(step.dispatch_end, self._last_done)
        now = self.clock()
        delay = max(0.0, start + duration - self.lead_s(duration) - now)
        if delay and self._wait_from is None:
            self._wait_from = now
        return delay

    def step_cost(self) -> StepCost | None:
        """The long steps' fit as a StepCost (its mean, not less a deviation as the holds use: a
        bound on step time wants the expected time), None before it exists."""
        fit = self._kinds[LONG].fit
        if fit is None:
            return None
        const, per_token, per_mpair, per_decode = fit[0]
        return StepCost(const, per_token, per_mpair / 1e6, per_decode)

    def summary(self) -> dict:
        long = self._kinds[LONG]
        rates = [d / f[1] for f, d in long.samples]
        fit = None if long.fit is None else {  # ms: per step, per 1K prefill tokens, per 1M pairs, per decode token
            "ms": [round(float(c) * 1e3, 4) for c in long.fit[0]], "residual_sd_ms": round(long.fit[1] * 1e3, 3)}
        return {"enabled": self.enabled, "holds": self.holds, "decode_steps_held": self.config.short_steps, "waits": self.waits, "waited_s": round(self.waited_s, 3),
                "min_ms_per_1k_prefill_tokens": round(min(rates) * 1e6, 3) if rates else None, "fit": fit,
                "host_lead_ms": round(self.lead_s() * 1e3, 2), "backoff_ms": round(self.backoff_s * 1e3, 2),
                "idle_launches": self.idle_launches, "idle_after_wait": self.idle_after_wait,
                "ended_in_launch": self.ended_in_launch,
                "kinds": {name: k.summary() for name, k in self._kinds.items()}}


def _done(step) -> bool:
    """Whether a dispatched step's tokens are computed (no wait; False when it has none to ask)."""
    is_ready = getattr(getattr(getattr(step, "result", None), "tokens", None), "is_ready", None)
    return bool(is_ready()) if is_ready is not None else False


def tally(chunks) -> tuple[int, int, int]:
    """(prefill tokens, decode tokens, context tokens the decode tokens read) of a step's chunks.
    Not step_timeline.classify: that counts decode rows, not tokens (a verify chunk is one row), and
    no context, for every step whether late dispatch is on or not, at half this loop's cost."""
    prefill = decode = context = 0
    for c in chunks:
        prompt = len(c.request.prompt_ids)
        if c.start >= prompt:
            decode += c.end - c.start
            context += c.end
        else:
            prefill += min(c.end, prompt) - c.start
            if c.end > prompt:
                decode += c.end - prompt
                context += c.end
    return prefill, decode, context


def prefill_pairs(chunks) -> float:
    """Query-key pairs of a step's prompt chunks: each prompt token attends to everything before it."""
    total = 0.0
    for c in chunks:
        prompt = len(c.request.prompt_ids)
        if c.start < prompt:
            total += attended_keys(c.start, min(c.end, prompt) - c.start)
    return total
