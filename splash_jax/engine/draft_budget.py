"""How many drafts each request verifies in a step: the K that makes the most tokens per second,
measured rather than predicted.

A first version predicted it: a request's expected yield 1 + alpha + ... + alpha^k against the
measured cost of a step of that many tokens. On an H200 (V2-Lite, set acceptance 0.3, batch 32)
it predicted 1.17x and measured 0.99x: overlapped steps, host work and the yield of the last
steps of each request are not in that arithmetic. So the budget measures what each cap of drafts
per request yields: a cap L in 0..K is a level; each decode-only step reports its interval (back
to back with the one before) and the tokens it output, per batch bucket (1, 2-3, 4-7, 8-15, ...
decoding requests: a step's cost and what a draft is worth change with the batch, so rates
measured at one size do not decide another).

A level's rate is its tokens per step over its median interval (seconds of its own last WINDOW
steps). Tokens per step are compared on the same steps: a step at level L also tells what every
lower level would have output there, since a request capped at l < L would have verified the first
l of the same drafts (drafts are prefixes of longer ones: n-gram, MTP and set-acceptance alike) and
kept min(kept, l) (`step_yields`). So level l's tokens are level l-1's times the ratio of their
yields over the last WINDOW drafting steps that ran at l or above (over older stored ones if none
did). Compared by their own steps' tokens, two levels read the request's text at different places:
on the bundled model's `repeat` prompts at batch 1, 5-step readings of level 2 made 1.7-3.0 tokens
a step, and a server whose drafts were kept 98% of the time read level 3 below level 2 and ran
level 2 (docs/speculative.md, "Tokens per step compared on the same steps").

It runs the best level of the step's bucket. A new bucket starts at the
best level of the nearest one measured (K for the first) and measures the other levels in turn,
one every LEARN_EVERY steps for EXPLORE_STEPS measured steps (level 0 first, then K, then the
rest). Until it has run FOLLOW_STEPS steps, a bucket that has not measured every level runs the
current best level of the nearest bucket that has: a batch passing through (the drain of a
batch of requests, where every step has fewer requests than the last) neither pays for trying
levels there nor keeps readings of a batch that shrank while they were taken (on an H200 at
acceptance 0.3, the drain of a batch of 128 measured 64-127 requests once, at level 3 early in
the drain and level 0 late, and ran level 3 there since). Then every EXPLORE_EVERY steps it
runs another level for EXPLORE_STEPS measured steps, in turn level 0 (the level the others must beat by OFF_MARGIN), a neighbour above and one below,
its rate then from those steps alone (never an old reading), so a change of load or acceptance
moves it; while the best level holds, the period doubles up to MAX_EXPLORE_EVERY (what
exploring a losing level costs shrinks), unless it beats level 0 by less than THIN_MARGIN: then
every exploration reads level 0 again, at the first period. Level 0 is speculation off (plain
overlapped steps).

Within a level, a request whose own drafts are rarely kept (alpha below MIN_ALPHA: kept /
(kept + first misses), decayed, from a prior of one of each) gets none, so a request whose
drafts are always rejected ends with k = 0 whatever the level. It is not cut off for good: after
PROBE_GAP more of its own tokens it drafts once more (a probe); a probe that keeps a draft starts
its record again from that chunk (it drafts at every step), one that keeps none doubles the gap
(up to MAX_PROBE_GAP). Without probes the first misses decided a request's whole output: on the
bundled model's `repeat` workload at batch 8, 3 of 8 requests missed their first 8 drafts (their
text repeats only later), drafted nothing for their other ~248 tokens, and the closed batch lasted
as many steps as with speculation off.

vLLM and SGLang turn speculation down by batch-size thresholds; this measures instead (the issue
"Speculative decoding that pays at every batch size").
"""

from __future__ import annotations

import collections
import dataclasses

PRIOR_KEPT, PRIOR_MISSED = 1.0, 1.0  # a new request starts at alpha = 0.5
DECAY = 0.98  # per verify chunk: a request's older drafts count less (its text changes)
MIN_ALPHA = 0.12  # a request whose drafts are kept less often than this drafts none
PROBE_GAP, MAX_PROBE_GAP = 16, 256  # ... until this many more of its tokens; a probe that keeps none doubles it
WINDOW = 10  # a level's rate: tokens over seconds of its last this many measured steps
# A level with drafts runs only if its rate beats level 0's by this much. Step intervals jitter
# by 10-30% from step to step with host work (V2-Lite, H200, batch 8-64), so rates of a few steps
# read at different times differ by up to ~10% with no real difference; at 5% the budget ran
# level 2 at batch 8 and acceptance 0.3, whose steps made 9% fewer tokens per second than off.
# 15%: on an H100 (V2-Lite, acceptance 0.3, batch 128, five runs) the runs whose best level read
# 1.18-1.19x level 0 gained 1.18-1.20x over the full batch (1.01-1.04x closed), the two whose best
# read 1.08x and 1.11x gained 1.02-1.03x over the full batch and lost the closed batch (0.91-0.94x):
# their drafting spread the requests apart, and the drain cost more than the steps gained.
OFF_MARGIN = 0.15
# While the best level beats level 0 by less than this, the next exploration reads level 0 again and
# the period does not grow: on an H100 (V2-Lite, set acceptance 0.3, batch 8) level 0 read 798 tok/s
# in its 5 steps against 1,069 with speculation off, level 3 ran at 1,007, and the next reading of
# level 0 was due after the run had ended (the period had doubled).
THIN_MARGIN = 1.3
EXPLORE_EVERY, EXPLORE_STEPS = 48, 5  # another level runs this many measured steps this often
MAX_EXPLORE_EVERY = 384  # the period doubles up to this while the best level holds
LEARN_EVERY = 12  # until every level of a batch bucket is measured, another runs this often
FOLLOW_STEPS = 36  # a bucket runs this many steps at a learned neighbour's best before learning its own


def keeps_k(request) -> bool:
    """A request whose K the budget never changes: a seeded sampled one (which token a row draws
    depends on its draft, so a K that followed the batch would make its output depend on the batch)."""
    return request.params.seed is not None and request.params.temperature > 0


@dataclasses.dataclass
class Acceptance:
    """A request's record of its drafts (kept, first misses), decayed per verify chunk, and while
    it drafts none (alpha below MIN_ALPHA) when it probes again (module docstring)."""

    kept: float = 0.0
    missed: float = 0.0
    probe_at: int | None = None  # while cut off: the output length at which it drafts once more
    probe_gap: int = PROBE_GAP

    @property
    def alpha(self) -> float:
        return (self.kept + PRIOR_KEPT) / (self.kept + self.missed + PRIOR_KEPT + PRIOR_MISSED)

    def alpha_for_drafting(self, generated: int) -> float:
        """alpha as the budget's `caps` reads it when the request has `generated` output tokens:
        MIN_ALPHA (drafts allowed) at a due probe. The first call after the cut sets the probe."""
        a = self.alpha
        if a >= MIN_ALPHA:
            return a
        if self.probe_at is None:
            self.probe_at = generated + self.probe_gap
        return MIN_ALPHA if generated >= self.probe_at else a

    def record(self, drafts: int, kept: int) -> None:
        if self.alpha < MIN_ALPHA:  # a probe: a verify chunk of a request already cut off
            if kept:  # its text changed: its record starts again from this chunk
                self.kept, self.missed, self.probe_at, self.probe_gap = float(kept), float(kept < drafts), None, PROBE_GAP
            else:  # the next probe: twice as many tokens from the next step
                self.missed = self.missed * DECAY + (kept < drafts)
                self.probe_at, self.probe_gap = None, min(2 * self.probe_gap, MAX_PROBE_GAP)
            return
        self.kept = self.kept * DECAY + kept
        self.missed = self.missed * DECAY + (kept < drafts)


def _median(values) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def batch_bucket(requests: int) -> int:
    """The batch sizes that share measured rates: 1, 2-3, 4-7, 8-15, ... decoding requests (a
    step's cost and a draft's worth change with the batch: drafts that pay at 4 may lose at 64)."""
    return max(requests, 1).bit_length()


def step_yields(made, level: int) -> tuple[int, ...]:
    """Tokens a decode step at `level` output (`made`: each request's), and would have output at
    each lower level: a request capped at l verifies the first l of its drafts and keeps min(kept, l),
    so it outputs min(made, l + 1) -> (yield at 0, ..., yield at level). Counted by distinct values
    (at most level + 1 of them): a sum per level over every request took 85 us a step at batch 128."""
    counts = collections.Counter(made).items()
    return tuple(sum(n * min(m, lv + 1) for m, n in counts) for lv in range(level + 1))


class _Levels:
    """Measured steps by level at one batch bucket, and the exploration state there."""

    def __init__(self, max_k: int, start: int):
        self.max_k = max_k
        self.window: dict[int, collections.deque] = {}  # level -> its last WINDOW steps: (yields, seconds)
        # sums[l] = [yields at l, yields at l - 1] over the stored steps at level >= l (l = 0: [yields at 0,
        # steps], the requests per step), kept as steps come and go: the ratios where no recent step ran at l
        self._sums = [[0, 0] for _ in range(max_k + 1)]
        self.recent: collections.deque = collections.deque(maxlen=WINDOW)  # yields of the last drafting steps, any level
        self.samples: dict[int, int] = {}  # level -> steps measured
        self.level = self.best = start  # the level chosen last; the best measured one
        self._fresh: int | None = None  # an explored level whose next reading replaces its window
        self._step = 0
        self._exploring = 0  # steps left at an explored level
        self._turn = 0  # which candidate the next exploration tries
        self._period = EXPLORE_EVERY  # steps between explorations (doubles while the best holds)
        self._next = LEARN_EVERY  # the step of the next exploration
        self.followed = 0  # steps run at a learned neighbour's best level (FOLLOW_STEPS)
        # a step's pick reads every level's rate: each median interval is kept until its level's next
        # reading, the rates until any reading (computing them all each step took 28 us of the 2-core
        # host, a few % of a batch-1 step)
        self._interval: dict[int, float] = {}
        self._rate: dict[int, float] | None = None

    @property
    def learned(self) -> bool:
        """Every level measured."""
        return all(self.samples.get(lv, 0) >= EXPLORE_STEPS for lv in range(self.max_k + 1))

    @property
    def rate(self) -> dict[int, float]:
        """Tokens per second by level (of the levels with steps of their own): tokens per step
        compared on the same steps (module docstring) over the median interval of the level's own
        last WINDOW steps (one step held up by the host, 2x its neighbours, moves a mean interval
        of 5 steps by 20% and the median not at all)."""
        if self._rate is None:
            rate, sums = {}, self._sums
            tokens = sums[0][0] / sums[0][1] if sums[0][1] else 0.0
            for lv in range(self.max_k + 1):
                if lv:
                    # the ratio over the last drafting steps that ran at lv or above, else over every
                    # stored one (a stale level's readings would otherwise drag every level above it)
                    above = [y for y in self.recent if len(y) > lv]
                    kept, below = (sum(y[lv] for y in above), sum(y[lv - 1] for y in above)) if above else sums[lv]
                    if not below:  # no step ran at lv or above
                        break
                    tokens *= kept / below
                if self.window.get(lv):
                    if lv not in self._interval:
                        self._interval[lv] = _median(s for _, s in self.window[lv])
                    rate[lv] = tokens / self._interval[lv]
            self._rate = rate
        return self._rate

    def _count(self, yields: tuple[int, ...], sign: int) -> None:
        sums = self._sums
        sums[0][0] += sign * yields[0]
        sums[0][1] += sign
        for lv in range(1, len(yields)):
            sums[lv][0] += sign * yields[lv]
            sums[lv][1] += sign * yields[lv - 1]

    def observe(self, level: int, yields: tuple[int, ...], seconds: float) -> None:
        """A step at `level` output yields[level] tokens (and would have output yields[l] at level l)."""
        self._rate = None
        self._interval.pop(level, None)
        window = self.window.setdefault(level, collections.deque())
        if level == self._fresh:  # an exploration's readings replace the level's old ones
            while window:
                self._count(window.popleft()[0], -1)
            self._fresh = None
        if len(window) == WINDOW:
            self._count(window.popleft()[0], -1)
        entry = (tuple(yields[: level + 1]), seconds)
        window.append(entry)
        self._count(entry[0], +1)
        if level:
            self.recent.append(entry[0])
        self.samples[level] = self.samples.get(level, 0) + 1

    def pick(self) -> int:
        self.level = self._pick()
        return self.level

    def _pick(self) -> int:
        if self._exploring:
            self._exploring -= 1
            return self.level
        rate = self.rate
        if self.samples.get(self.best, 0) >= EXPLORE_STEPS:
            best = max(rate, key=rate.get)
            # drafts must beat no drafts by more than the noise of a few steps' rates: when they
            # are about even, off costs nothing (no verify rows, no drafting) and never loses
            best = best if rate[best] > (1 + OFF_MARGIN) * rate.get(0, 0.0) else 0
            if best != self.best:  # load or acceptance moved: look around again soon
                self.best, self._period = best, EXPLORE_EVERY
                self._next = min(self._next, self._step + EXPLORE_EVERY)
        self._step += 1
        if self._step < self._next or not self.max_k:
            return self.best
        unmeasured = [lv for lv in (0, self.max_k, *range(1, self.max_k)) if self.samples.get(lv, 0) < EXPLORE_STEPS]
        if unmeasured:  # learning: each level in turn, often
            explore = next((lv for lv in unmeasured if lv != self.best), self.best)
            self._next = self._step + LEARN_EVERY
        elif self.best and rate.get(self.best, 0.0) < THIN_MARGIN * rate.get(0, 0.0):
            # drafts win by little: level 0 is read again, as often as at first (one low reading of it
            # would otherwise keep a losing level for hundreds of steps)
            explore, self._fresh, self._next = 0, 0, self._step + EXPLORE_EVERY
        else:  # level 0 (the level the others must beat) and the neighbours in turn, less often while the best holds
            candidates = list(dict.fromkeys(x for x in (0, self.best + 1, self.best - 1)
                                            if 0 <= x <= self.max_k and x != self.best))
            explore = candidates[self._turn % len(candidates)]
            self._turn += 1
            self._fresh = explore
            self._next = self._step + self._period
            self._period = min(2 * self._period, MAX_EXPLORE_EVERY)
        if explore == self.best:
            return self.best
        self._exploring = EXPLORE_STEPS  # (its first step is not measured)
        return explore


class DraftBudget:
    """Draft caps per step from measured tokens per second by level and batch bucket (see the
    module docstring)."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.buckets: dict[int, _Levels] = {}  # batch_bucket -> its levels
        self.level = max_k  # the level of the step chosen last
        self.key: tuple[int, int] | None = None  # (bucket, level) of the step chosen last, until taken
        self._bucket = 0  # the bucket of the step chosen last
        self._observed: tuple[int, int] | None = None  # the key of the last step observed
        self.steps = 0  # steps it chose for
        self.drafts = 0  # draft caps it gave over those steps
        self.requests = 0  # decoding requests over those steps
        self.steps_without = 0  # steps at level 0

    def take_key(self) -> tuple[int, int] | None:
        """(bucket, level) the step being dispatched was chosen at (None: not chosen by the budget,
        e.g. drafting paused); each key is taken once."""
        key, self.key = self.key, None
        return key

    def observe(self, key: tuple[int, int], yields: tuple[int, ...], seconds: float) -> None:
        """A decode-only step chosen at `key` = (bucket, level) took `seconds` and output yields[level]
        tokens, yields[l] at each lower level l (`step_yields`). The first step at a new key is left
        out: its interval and tokens still carry the previous level's steps in flight (an ahead
        chunk, the overlapped host work)."""
        previous, self._observed = self._observed, key
        if seconds <= 0 or key != previous:
            return
        self.buckets[key[0]].observe(key[1], yields, seconds)

    def choose_level(self, requests: int) -> int:
        """The level of the next step, of `requests` decoding requests; `self.key` is its (bucket,
        level) (the engine reports the step's tokens for it). Level 0 needs nothing more: the
        scheduler then drafts for no one (a step as cheap on the host as with speculation off)."""
        self._bucket = bucket = batch_bucket(requests)
        levels = self.buckets.get(bucket)
        if levels is None:  # a new batch size starts at the level of the nearest one measured
            near = min(self.buckets, key=lambda b: abs(b - bucket), default=None)
            levels = self.buckets[bucket] = _Levels(self.max_k, self.max_k if near is None else self.buckets[near].best)
        guide = None
        if not levels.learned and levels.followed < FOLLOW_STEPS:  # passing through, perhaps: a learned neighbour's best
            guide = min((b for b, lv in self.buckets.items() if b != bucket and lv.learned),
                        key=lambda b: abs(b - bucket), default=None)
        if guide is not None:
            levels.followed += 1
            levels.level = self.level = level = self.buckets[guide].best
        else:
            self.level = level = levels.pick()
        self.key = (bucket, level)
        self.steps += 1
        self.requests += requests
        self.steps_without += level == 0
        return level

    def caps(self, alphas: list[float], limits: list[int]) -> list[int]:
        """Drafts per request at the level chosen last (parallel to alphas: its acceptance, limits:
        at most this many)."""
        out = [min(k, self.level) if a >= MIN_ALPHA else 0 for a, k in zip(alphas, limits)]
        self.drafts += sum(out)
        return out

    def choose(self, alphas: list[float], limits: list[int]) -> list[int]:
        """choose_level and caps in one call."""
        self.choose_level(len(alphas))
        return self.caps(alphas, limits)

    @property
    def rate(self) -> dict[int, float]:
        """Tokens per second by level at the batch bucket of the last step."""
        levels = self.buckets.get(self._bucket)
        return levels.rate if levels else {}

    def summary(self) -> dict:
        levels = self.buckets.get(self._bucket)
        return {
            "mean_k": self.drafts / self.requests if self.requests else 0.0,
            "level": levels.best if levels else self.max_k, "steps_without_drafts": self.steps_without,
            "tokens_per_s_by_level": {k: round(v, 1) for k, v in sorted(self.rate.items())},
            # per batch bucket, keyed by its smallest batch: (best level, tokens per second by level)
            "by_batch": {1 << (b - 1): {"level": lv.best, "tokens_per_s_by_level": {
                k: round(v, 1) for k, v in sorted(lv.rate.items())}} for b, lv in sorted(self.buckets.items())},
        }
