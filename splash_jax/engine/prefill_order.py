"""Which prefill work a step takes first, and how much of it shares a step with decodes.

The scheduler (engine/scheduler.py) gives each step's token budget to decoding requests first
(one token each, plus drafts), then to prefill work: requests part-way through their prompt
(running) and requests not admitted yet (waiting). `PrefillOrder.plan` orders that prefill work:

  fcfs  running prefills in admission order, then the waiting queue in arrival order (a request
        that was preempted is at its front): the scheduler's order before this module existed.
  srpf  shortest remaining prefill first within a bounded age, over running and waiting requests
        together (a long prompt being prefilled no longer holds the budget while short ones wait):
          1. requests preempted earlier (they recompute what they had: never passed again);
          2. requests whose first token has waited more than `max_wait_s` since their arrival,
             oldest first (no prompt waits without bound behind a stream of shorter ones);
          3. the rest, fewest prompt tokens left to compute first (num_tokens - num_computed;
             a waiting request's cached prefix is not subtracted: looking it up for every
             waiting request every step costs a tree walk each), less `aging_tokens_per_s` for
             every second it has waited (0: none), ties by arrival.
        SGLang's schedule policies and vLLM's priority scheduling make similar choices; the age
        bound and the aging are ours. Aging trades the median for the tail more smoothly than the
        bound alone: a long prompt climbs the order while it waits instead of jumping to its front
        at `max_wait_s` (benchmarks/probes/ttft_sim.py, docs/performance.md).

`finish_early`: a step in which prompts can finish their prefill (in plan order, within the
budget) takes other prefill only up to the bucket that holds them and the decodes: their first
tokens then wait for their own work and that bucket's padding, not for a whole budget of longer
prompts' chunks (a 1K prompt used to ride an 8K-token step of ~120 ms on V2-Lite). A step where
nothing can finish keeps the whole budget, so long prompts lose only the filler they would have
got beside short ones.

`max_prefill_tokens_with_decodes` (0 = off): while any request decodes, a step's tokens (the
decodes' and prefill's together) stay within the largest compiled step bucket of at most that cap
plus the decode tokens, so a decode step is never one long prefill chunk (decode latency, TPOT,
stays near the decode step's time); steps without decodes use the whole budget. Snapping to a
bucket matters: the steps run padded to the next power of two, so a cap of 4096 counted in
prefill tokens alone put 4096 + 21 decode tokens into the 8192-token program, which costs about
what an uncapped step costs while doing half its prefill (the first H200 measurement of the cap,
docs/performance.md).
"""

from __future__ import annotations

import collections
import dataclasses
import math

POLICIES = ("fcfs", "srpf")
ALL = math.inf  # a plan entry: admit from the waiting queue's front until something does not fit


@dataclasses.dataclass(frozen=True)
class PrefillOrder:
    policy: str = "fcfs"  # fcfs | srpf
    max_wait_s: float = 1.0  # srpf: past this age (since arrival) a request goes first, oldest first
    max_prefill_tokens_with_decodes: int = 0  # prefill tokens per step while requests decode (0: no cap)
    buckets: tuple[int, ...] = ()  # the step programs' token sizes (engine/step_programs.bucket_ladder)
    aging_tokens_per_s: float = 0.0  # srpf: prompt tokens a request's rank gains per second waited
    finish_early: bool = False  # a step where prompts finish holds them and fills only its bucket

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"--max-prefill-wait-s must be >= 0, got {self.max_wait_s}")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ValueError(f"--max-prefill-tokens-with-decodes must be >= 0, got {self.max_prefill_tokens_with_decodes}")
        if not self.aging_tokens_per_s >= 0:
            raise ValueError(f"--prefill-aging-tokens-per-s must be >= 0, got {self.aging_tokens_per_s}")

    @classmethod
    def of(cls, config, gap: int = 0, platform: str = "cpu") -> PrefillOrder:
        """From an EngineConfig (its prefill settings as resolved on `platform`, and its step ladder;
        gap: the resolved --token-bucket-gap)."""
        policy, aging, finish = config.resolved_prefill_order(platform)
        return cls(policy, config.max_prefill_wait_s, config.max_prefill_tokens_with_decodes, ladder_sizes(config, gap),
                   aging, finish)

    def key(self, request, now: float) -> tuple:
        """srpf's rank of a request (smaller first): (tier, then within the tier)."""
        arrival = request.metrics.arrival
        if request.metrics.num_preemptions:
            return (0, arrival, 0)
        if now - arrival > self.max_wait_s:
            return (1, arrival, 0)
        left = request.num_tokens - request.num_computed
        return (2, left - self.aging_tokens_per_s * (now - arrival) if self.aging_tokens_per_s else left, arrival)

    def plan(self, prefilling: list, waiting: collections.deque, now: float) -> list:
        """The step's prefill work in order: running requests (continue their prefill) and numbers
        k (admit up to k requests from the front of `waiting`, which srpf sorts in place, so the
        queue's front is next in rank; the last entry is ALL). The scheduler stops admitting at
        the first request that does not fit, as before."""
        if self.policy == "fcfs":
            return prefilling + [ALL]
        key = {id(r): self.key(r, now) for r in (*prefilling, *waiting)}
        queue = sorted(waiting, key=lambda r: key[id(r)])  # stable: equal keys keep queue order
        waiting.clear()
        waiting.extend(queue)
        out, k = [], 0
        for r in sorted(prefilling, key=lambda r: key[id(r)]):
            while k < len(queue) and key[id(queue[k])] < key[id(r)]:
                k += 1
            if k:
                out.append(k)
                queue, k = queue[k:], 0
            out.append(r)
        return out + [ALL]

    def finishing_budget(self, budget: int, decode_tokens: int, plan: list, waiting) -> int:
        """With finish_early: `budget` cut to the smallest bucket holding `decode_tokens` and every
        prompt, in plan order (`plan` as `plan` returns it, over `waiting`), that finishes within
        it; `budget` when none can. A waiting request's cached prefix is not subtracted (it may
        finish in a smaller step than counted, never a larger one)."""
        if not self.finish_early:
            return budget
        room, need = budget - decode_tokens, 0
        for request in _in_order(plan, waiting):
            left = request.num_tokens - request.num_computed
            if left > room - need:
                break
            need += left
        if not need:
            return budget
        return min(budget, next((b for b in self.buckets if b >= decode_tokens + need), budget))

    def prefill_budget(self, budget: int, decode_tokens: int) -> int:
        """The step's token budget once the decodes' `decode_tokens` are counted in it. While
        anything decodes and a cap is set: the largest bucket of at most decode_tokens + cap that
        leaves prefill a token (without buckets, or with none such, decode_tokens + cap itself).
        A decode dropped from the step, preempted by another, leaves its token to prefill."""
        cap = self.max_prefill_tokens_with_decodes
        if not (decode_tokens and cap):
            return budget
        target = min(budget, decode_tokens + cap)
        return max((b for b in self.buckets if decode_tokens < b <= target), default=target)


def _in_order(plan: list, waiting):
    """The requests of a plan in order: its running requests, and for a number k the next k of
    `waiting` (ALL: the rest)."""
    queue = iter(waiting)
    for entry in plan:
        if isinstance(entry, (int, float)):
            count = 0
            while count < entry:
                request = next(queue, None)
                if request is None:
                    break
                count += 1
                yield request
        else:
            yield entry


def ladder_sizes(config, gap: int) -> tuple[int, ...]:
    """The token sizes of the engine's step programs under the layout that pads least (tp's), with
    `gap` the resolved --token-bucket-gap (EngineConfig.resolved_token_bucket_gap)."""
    from splash_jax.engine.step_programs import bucket_ladder

    return tuple(b.tokens for b in bucket_ladder(config.max_num_batched_tokens, 1, config.min_token_bucket, gap))
