"""How many drafts each request verifies in a step: the K that makes the most tokens per second.

A verify chunk of k drafts yields 1 + a tokens, a = the drafts kept. With a request's drafts
each kept with probability alpha given the ones before were (a geometric run), the chunk's
expected yield is 1 + alpha + ... + alpha^k. The step's cost is what the engine measured for
decode-only steps of that many tokens: their bucket sets the padded work (a draft that moves
the step into the next bucket costs that bucket), and within a bucket the real rows (the MoE
reads the experts of real rows only, so a verify step costs more than a plain one of the same
bucket). So the best choice
over the batch is the number n of drafts, taken in order of their expected gain alpha_r^i (the
i-th draft of request r), that maximizes

    (decoding requests + sum of the n largest gains) / cost(decoding requests + n tokens)

n = 0 when no draft pays for the larger step: the step then decodes one token per request (and
overlaps, as any step). Costs are moving averages of the interval between back-to-back
decode-only steps (device time and host work that did not hide under it), by token count,
interpolated between counts measured in the same bucket; a bucket not measured yet is assumed
to cost what the dearest smaller one did, so the engine tries it once and learns. A step
smaller than any measured runs without drafts first (its own cost is the baseline every draft
is weighed against).
alpha per request is the running rate of kept drafts (kept / (kept + first misses)), from a
prior of one of each, so a request whose drafts are always rejected ends with k = 0.

vLLM and SGLang turn speculation down by batch size thresholds; this measures instead (the issue
"Speculative decoding that pays at every batch size").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PRIOR_KEPT, PRIOR_MISSED = 1.0, 1.0  # a new request starts at alpha = 0.5
DECAY = 0.98  # per verify chunk: a request's older drafts count less (its text changes)
COST_WEIGHT = 0.1  # moving-average weight of a new step interval


@dataclasses.dataclass
class Acceptance:
    """A request's record of its drafts (kept, first misses), decayed per verify chunk."""

    kept: float = 0.0
    missed: float = 0.0

    @property
    def alpha(self) -> float:
        return (self.kept + PRIOR_KEPT) / (self.kept + self.missed + PRIOR_KEPT + PRIOR_MISSED)

    def record(self, drafts: int, kept: int) -> None:
        self.kept = self.kept * DECAY + kept
        self.missed = self.missed * DECAY + (kept < drafts)


class DraftBudget:
    """Per-step draft counts from measured acceptance and step costs (see the module docstring)."""

    def __init__(self, bucket_of=None):
        self.bucket_of = bucket_of or (lambda tokens: 0)  # step tokens -> its bucket (ValueError beyond the largest)
        self.cost: dict[int, float] = {}  # step tokens -> seconds per decode-only step (moving average)
        self.steps = 0  # steps it chose for
        self.drafts = 0  # drafts it chose over those steps
        self.requests = 0  # decoding requests over those steps
        self.steps_without = 0  # steps where no draft paid

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode-only step of `tokens` tokens took `seconds` (back to back with the one before)."""
        old = self.cost.get(tokens)
        self.cost[tokens] = seconds if old is None else old + COST_WEIGHT * (seconds - old)

    def _costs(self, tokens: np.ndarray) -> np.ndarray:
        """Estimated seconds of decode-only steps of these token counts. Within a bucket (one
        program, padded alike) linear between measured counts and flat beyond them; a bucket not
        measured yet costs what the dearest smaller measured bucket did (optimistic: the engine
        tries it once and learns), or the cheapest larger one; inf past the largest bucket."""
        by_bucket: dict[int, list[int]] = {}
        for t in sorted(self.cost):
            by_bucket.setdefault(self._bucket(t), []).append(t)
        out = np.empty(len(tokens))
        for i, t in enumerate(tokens):
            b = self._bucket(int(t))
            if b is None:
                out[i:] = math.inf
                break
            xs = by_bucket.get(b)
            if xs:
                out[i] = np.interp(t, xs, [self.cost[x] for x in xs])
                continue
            smaller = [self.cost[x] for k, v in by_bucket.items() if k is not None and k < b for x in v]
            larger = [self.cost[x] for k, v in by_bucket.items() if k is not None and k > b for x in v]
            out[i] = max(smaller) if smaller else min(larger) if larger else 1.0
        return out

    def _bucket(self, tokens: int) -> int | None:
        try:
            return int(self.bucket_of(tokens))
        except ValueError:  # beyond every bucket
            return None

    def choose(self, alphas: list[float], limits: list[int], tokens: int) -> list[int]:
        """Drafts per request (parallel to alphas: its acceptance, limits: at most this many) for
        a step that already holds `tokens` tokens (one per decoding request)."""
        self.steps += 1
        self.requests += len(alphas)
        if not alphas or not any(limits) or not self.cost or tokens < min(self.cost):
            self.steps_without += 1  # (no cost measured at or below this step's size: measure it without drafts first)
            return [0] * len(alphas)
        gains, owner = [], []
        for r, (alpha, k) in enumerate(zip(alphas, limits)):
            a = min(max(alpha, 0.0), 0.999)
            gains += [a ** i for i in range(1, k + 1)]
            owner += [r] * k
        order = np.argsort(-np.asarray(gains), kind="stable")
        best = np.concatenate([[0.0], np.cumsum(np.asarray(gains)[order])])
        rate = (len(alphas) + best) / self._costs(tokens + np.arange(len(order) + 1))
        n = int(np.argmax(rate))
        out = [0] * len(alphas)
        for i in order[:n]:
            out[owner[i]] += 1
        self.drafts += n
        self.steps_without += n == 0
        return out

    def summary(self) -> dict:
        return {
            "mean_k": self.drafts / self.requests if self.requests else 0.0,
            "steps_without_drafts": self.steps_without,
            "step_cost_ms": {t: round(c * 1e3, 3) for t, c in sorted(self.cost.items())},
        }
