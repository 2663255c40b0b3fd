"""A step-time bound on the prefill that shares steps with decodes (--max-step-ms-with-decodes).

Every decoding request waits for the whole step it rides in, so its time per output token is the
mean length of the steps it decodes through. A token budget bounds a step's tokens, not its time:
a chunk deep into a long prompt attends to everything before it, and on V2-Lite (one H100) 2,048
tokens at position 30K cost about as much as 4,000 fresh ones. This bound is in seconds, from a
fit of the engine's own timed steps (StepCost, `DispatchTiming.step_cost`):

    seconds = const + per_decode * decode tokens + sum over prompt chunks of
              (per_token * n + per_pair * attended_keys(start, n))

While any request decodes, `begin` cuts the step's token budget to what fits at depth 0 (snapped
down to a compiled step bucket, as the token cap is: steps run padded to their bucket), and `take`
shortens each prompt chunk to what the time left allows at its depth. A step always takes at least
`min_tokens` of prefill (or the chunk, if shorter), so a bound below the decode step's own time
slows prefill but never stops it. Steps without decodes keep the whole budget. Until the fit exists
(`DispatchTiming` fits long steps once 16 are timed) nothing is cut.

What the bound trades (benchmarks/probes/ttft_sim.py, benchmarks/ttft_trace.py, docs/performance.md):
more, shorter steps beside decodes, so prefill finishes later under load. On a long-prompt trace on
one H100, 80 ms halved the step p99 (222 -> 100 ms: a decode's longest waits) but raised TTFT (p50
+28%, p99 2.9x) and TPOT (p50 +44%, p99 +25%), and cost 1.6% of the output tokens per second.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from splash_jax.calibration import attended_keys


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A step's device time in seconds as a linear function of what it computes."""

    const_s: float
    per_token_s: float  # per prompt token computed
    per_pair_s: float  # per query-key pair of prompt attention (calibration.attended_keys)
    per_decode_s: float  # per decode token (a verify chunk's drafts count)

    def usable(self) -> bool:
        """A fit the bound can follow: time grows with prompt tokens, never shrinks with depth."""
        return self.per_token_s > 0 and self.per_pair_s >= 0 and math.isfinite(self.const_s)

    def chunk_s(self, start: int, n: int) -> float:
        return self.per_token_s * n + self.per_pair_s * attended_keys(start, n)

    def tokens_within(self, start: int, n: int, seconds: float) -> int:
        """The most tokens (<= n) a chunk from `start` computes in `seconds`: the root of
        per_pair * (n * start + n (n + 1) / 2) + per_token * n = seconds."""
        if seconds <= 0:
            return 0
        a = self.per_pair_s / 2
        b = self.per_token_s + self.per_pair_s * (start + 0.5)
        m = seconds / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)
        m = min(n, int(m))
        while m < n and self.chunk_s(start, m + 1) <= seconds:  # (rounding)
            m += 1
        while m > 0 and self.chunk_s(start, m) > seconds:
            m -= 1
        return m


class StepTimeCap:
    """Per step: the time left for prefill while requests decode (module docstring)."""

    def __init__(self, cap_s: float, cost: Callable[[], StepCost | None], min_tokens: int = 128):
        if not cap_s >= 0:
            raise ValueError(f"--max-step-ms-with-decodes must be >= 0, got {cap_s * 1e3}")
        self.cap_s, self.cost, self.min_tokens = cap_s, cost, min_tokens
        self._cost: StepCost | None = None
        self._left = math.inf  # seconds of prefill this step may still take (inf: no bound)
        self._taken = 0  # prefill tokens this step took so far
        self._cut = False  # the bound cut this step's budget or a chunk of it
        self.capped_steps = 0  # steps whose budget or chunks the bound cut (stats)

    def begin(self, budget: int, decode_tokens: int, buckets: tuple[int, ...]) -> int:
        """A new step with `decode_tokens` of decodes: its token budget (cut and snapped to a bucket
        when the bound applies)."""
        self._left, self._taken, self._cut = math.inf, 0, False
        cost = self.cost() if self.cap_s and decode_tokens else None
        if cost is None or not cost.usable():
            return budget
        self._cost = cost
        self._left = self.cap_s - cost.const_s - cost.per_decode_s * decode_tokens
        fresh = max(self.min_tokens, cost.tokens_within(0, budget, self._left))
        target = min(budget, decode_tokens + fresh)
        if target < budget:
            self._count_cut()
            return max((b for b in buckets if decode_tokens < b <= target), default=target)
        return budget

    def _count_cut(self) -> None:
        if not self._cut:
            self._cut = True
            self.capped_steps += 1

    def take(self, start: int, n: int) -> int:
        """A prompt chunk of up to `n` tokens from `start`: how many it may compute (0: none)."""
        if math.isinf(self._left) or n <= 0:
            return n
        m = self._cost.tokens_within(start, n, self._left)
        if self._taken < self.min_tokens:
            m = max(m, min(n, self.min_tokens - self._taken))
        if m < n:
            self._count_cut()
        self._left -= self._cost.chunk_s(start, m)
        self._taken += m
        return m
