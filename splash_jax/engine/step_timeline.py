"""How long each kind of step takes while the engine runs back to back: the numbers that say
where serving latency (TPOT) goes.

A running request gets one token per step, so its TPOT is the mean interval between the steps
it was in. The interval between two consecutive step completions is the engine's real cadence
(device time plus whatever host work did not hide under it), and steps that carry prefill
tokens are longer than decode-only ones. Splitting the intervals by kind separates the two
causes of a TPOT above the bare decode step: prefill work mixed into decode steps (visible in
`with_prefill` and its share) and host work (a `decode_only` interval above the bare step time
that `benchmarks/decode_roofline.py` measures for the same batch; `host_cpu_p50_ms` is the engine
thread's own CPU time per step, which must stay below the device's step for overlap to hide it,
and an interval above both points at the GIL: the server's event loop running meanwhile).

Only intervals between completions of back-to-back `step()` calls count: after an idle wait
(no work) the next interval would measure the wait, so it is left out and counted as a gap.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepRecord:
    interval_s: float  # since the previous step's completion
    prefill_tokens: int  # tokens of prompts (positions before the prompt's end) in the step
    decode_rows: int  # requests decoding one generated token
    host_s: float = 0.0  # CPU time of the engine thread in the step() call that completed it


def classify(chunks) -> tuple[int, int]:
    """(prefill tokens, decode rows) of a step's scheduled chunks."""
    prefill = decode = 0
    for c in chunks:
        prompt = len(c.request.prompt_ids)
        if c.start >= prompt:
            decode += 1
        else:
            prefill += min(c.end, prompt) - c.start
            decode += max(0, c.end - max(c.start, prompt))
    return prefill, decode


class StepTimeline:
    """A ring of the last `maxlen` step intervals with their kind; `summary()` for `stats()`."""

    def __init__(self, maxlen: int = 4096):
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=maxlen)
        self._last_done: float | None = None
        self._open = False  # the last record still waits for its step() call's host time
        self.gaps = 0  # completions after an idle wait (interval not recorded)

    def reset(self) -> None:
        """Forget every record (a benchmark's runs, one at a time); the next completion is a gap."""
        self._records.clear()
        self._last_done, self._open = None, False

    def completed(self, now: float, chunks, back_to_back: bool) -> StepRecord | None:
        """A step completed at `now`; `back_to_back`: the previous step() call completed one too.
        -> its record (None: not back to back)."""
        self._open = False
        record = None
        if self._last_done is not None and back_to_back:
            prefill, decode = classify(chunks)
            record = StepRecord(now - self._last_done, prefill, decode)
            self._records.append(record)
            self._open = True
        elif self._last_done is not None:
            self.gaps += 1
        self._last_done = now
        return record

    def host_time(self, host_s: float) -> None:
        """The engine thread's CPU time in the step() call that completed the last step (scheduling,
        packing, dispatch, read-back, outputs: what overlapped scheduling must hide under the device)."""
        if self._open:
            self._records[-1] = dataclasses.replace(self._records[-1], host_s=host_s)
            self._open = False

    def summary(self) -> dict:
        rows = list(self._records)

        def stats(selected: list[StepRecord]) -> dict:
            if not selected:
                return {"steps": 0}
            ms = np.array([r.interval_s for r in selected]) * 1e3
            return {
                "steps": len(selected),
                "mean_ms": round(float(ms.mean()), 3),
                "p50_ms": round(float(np.percentile(ms, 50)), 3),
                "p99_ms": round(float(np.percentile(ms, 99)), 3),
                "host_cpu_p50_ms": round(float(np.percentile([r.host_s for r in selected], 50)) * 1e3, 3),
                "mean_decode_rows": round(float(np.mean([r.decode_rows for r in selected])), 1),
                "mean_prefill_tokens": round(float(np.mean([r.prefill_tokens for r in selected])), 1),
            }

        with_prefill = [r for r in rows if r.prefill_tokens]
        return {
            "decode_only": stats([r for r in rows if not r.prefill_tokens]),
            "with_prefill": stats(with_prefill),
            "prefill_share": round(len(with_prefill) / len(rows), 4) if rows else None,
            "time_share_with_prefill": round(sum(r.interval_s for r in with_prefill) / sum(r.interval_s for r in rows), 4)
            if rows else None,
            "gaps": self.gaps,
        }
