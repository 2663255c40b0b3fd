"""Per-step records of an engine's run, for benchmarks that must say where time went (which steps
were slow, at which draft level, with how many requests), not only how long the run took."""

from __future__ import annotations

import gc
import time


class StepTrace:
    """Each completed step of an engine while on: milliseconds since the previous completion, tokens
    it output, requests in it, and the draft budget's level for it (None: not chosen by the budget).
    It wraps the engine's completion hook, so what it times is what the engine's own timeline sees."""

    def __init__(self, engine):
        self.engine, self.steps, self.on = engine, [], False
        inner, self._last = engine._complete, None
        self.gc_ms, self.gc_runs, self._gc_t0 = 0.0, 0, 0.0  # garbage collections while on: their pauses

        def collecting(phase, info):
            if not self.on:
                return
            if phase == "start":
                self._gc_t0 = time.perf_counter()
            else:
                self.gc_ms += (time.perf_counter() - self._gc_t0) * 1e3
                self.gc_runs += 1

        gc.callbacks.append(collecting)

        def complete(step, back_to_back=False):
            out = inner(step, back_to_back)
            if self.on:
                now = time.perf_counter()
                key = step.draft_key
                self.steps.append((round((now - self._last) * 1e3, 3) if self._last else None,
                                   sum(len(o.new_token_ids) for o in out), len(step.chunks), key[1] if key else None))
                self._last = now
            return out

        engine._complete = complete

    def start(self) -> None:
        self.steps, self._last, self.on = [], None, True
        self.gc_ms, self.gc_runs = 0.0, 0
        self.engine.timeline.reset()

    def stop(self) -> list[tuple]:
        """The steps since start(): (ms since the previous, tokens, requests, level); the first has None ms."""
        steps, self.steps, self._last, self.on = self.steps, [], None, False
        return steps

    def host(self) -> dict:
        """The run's host side: the engine thread's CPU time per decode step (p50, from its own
        timeline) and the garbage collections' count and pauses."""
        decode = self.engine.timeline.summary()["decode_only"]
        return {"host_cpu_p50_ms": decode.get("host_cpu_p50_ms"), "interval_p50_ms": decode.get("p50_ms"),
                "gc_runs": self.gc_runs, "gc_ms": round(self.gc_ms, 3)}


def full_batch_rate(steps: list[tuple], batch: int) -> float | None:
    """Tokens per second over the steps in which all `batch` requests decoded (a closed batch's
    steady state, before its drain: once requests finish at different steps, as they do when
    drafts are kept unevenly, the last ones run in small, inefficient steps)."""
    full = [(ms, tokens) for ms, tokens, rows, _ in steps if ms is not None and rows == batch and tokens]
    ms = sum(m for m, _ in full)
    return sum(t for _, t in full) / ms * 1e3 if ms else None
