"""Speculative decoding: draft proposals, the acceptance rule, and its counters.

A decoding request with K drafts d_1..d_K runs one verify chunk of 1 + K tokens (its last known
token, then the drafts) with a logits row per position, in an ordinary step program (the MLA
kernels already take several query tokens per request). Row i's token t_i is drawn from the
target distribution after d_1..d_i, so the output is t_0 if t_0 != d_1, else d_1 then t_1 if
t_1 != d_2, ...: the accepted drafts and one more token (a correction, or a bonus token when
every draft is accepted). Greedy rows draw by argmax, so the output equals non-speculative
decoding token for token. Sampled rows use the rejection rule of speculative sampling with a
one-token draft distribution (sampler.py: accept d with probability p(d), else draw from p with d
removed), so every token still follows the target distribution.

Latents of rejected drafts were written to the cache at positions the request has not reached;
the scheduler rolls `num_computed` back to the accepted tokens, so the next step rewrites those
slots before any query reads them (attention reads only positions below each query's length).

Drafts come from the request itself (`NgramDrafter`, prompt lookup: no model, as vLLM's and
SGLang's n-gram method) or from the checkpoint's multi-token-prediction layer (`MtpDrafter`: the
device computes them right after each step, engine/mtp_draft.py, and they reach the host with the
step's tokens). Requests that speculation cannot serve exactly with these programs run
one token per step: penalties (the step's penalty history would count rejected drafts), grammars
and reasoning budgets (a mask per draft position needs the grammar advanced through the drafts;
a draft may cross the budget), and requests still owed prompt logprobs.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from splash_jax.engine.request import Request
from splash_jax.engine.speculative_inputs import DEVICE_DRAFT, device_draft_code
from splash_jax.structured.reasoning_gate import needs_masks

METHODS = ("off", "ngram", "mtp")  # the CLI's; the library also takes "custom" with a drafter object
LIBRARY_METHODS = METHODS + ("custom",)


def can_speculate(request: Request, ahead: bool = False) -> bool:
    """Whether drafts for `request` keep its outputs exactly as without speculation (see above).
    ahead: overlapped speculation, where drafts may follow a token still on the device."""
    p = request.params
    return ((request.num_pending == 0 or ahead) and not needs_masks(request) and not p.uses_penalties
            and not request.wants_prompt_logprobs)


def propose_ahead(drafter, request: Request, k: int, behind: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Drafts of an ahead chunk (scheduler.ScheduledChunk.shift_k), one variant per count a of the
    drafts `behind` (its verify chunk still on the device) that step may keep: variant a follows
    the known tokens, behind[:a] and the token that step samples there (not known yet). Variants
    have one length (shorter ones padded with their last draft, or 0: a draft never changes an
    output, only what a step yields)."""
    variants = [list(drafter.propose_after(request, k, tuple(behind[:a]))[:k]) if k else [] for a in range(len(behind) + 1)]
    width = max(map(len, variants))
    return tuple(tuple(v + [v[-1] if v else 0] * (width - len(v))) for v in variants)


def max_drafts(request: Request, k: int, max_model_len: int) -> int:
    """Drafts worth verifying: one verify step outputs at most drafts + 1 tokens, so never more
    than the tokens max_tokens still allows, less one, nor past the model length."""
    left = request.params.max_tokens - len(request.output_ids) - 1
    return max(0, min(k, left, max_model_len - request.num_known - 1))


def accepted(drafts, tokens) -> list[int]:
    """The tokens a verify chunk outputs: tokens[i] (drawn at position i) is kept, and the next
    draft is checked against it, until one differs; all K drafts accepted adds tokens[K]."""
    out = []
    for i, d in enumerate(drafts):
        t = int(tokens[i])
        out.append(t)
        if t != d:
            return out
    out.append(int(tokens[len(drafts)]))
    return out


class NgramDrafter:
    """Prompt lookup: the longest suffix n-gram (max_n down to min_n tokens) that occurred before
    in the request's prompt + output; its most recent earlier occurrence's continuation is the
    draft (copying code under edit, quoting a retrieved passage). Each request keeps an index of
    its n-grams (NgramIndex), extended by the tokens it gained since the last step, so a lookup
    costs a few dictionary reads, not a scan of the sequence. A long prompt is indexed over a few
    steps (NgramIndex.TOKENS_PER_EXTEND per call), the request drafting nothing until then."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"--speculative-ngram-min ({min_n}) must be in [1, --speculative-ngram-max ({max_n})]")
        self.min_n, self.max_n = min_n, max_n
        self._index: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def _of(self, request: Request) -> NgramIndex:
        index = self._index.get(request)
        if index is None:
            index = self._index[request] = NgramIndex(self.min_n, self.max_n)
        index.extend(request)
        return index

    def propose(self, request: Request, k: int) -> list[int]:
        return self._of(request).lookup(k, ()) if k > 0 else []

    def propose_after(self, request: Request, k: int, prefix: tuple[int, ...]) -> list[int]:
        """Drafts to follow the known tokens, `prefix`, then one token not known yet (overlapped
        speculation): a lookup guesses that token, and a second lookup, after known + prefix + the
        guess, proposes the k drafts: those a lookup would make once the step in flight returned
        the guess (the drafts are right only if the guess was: n-gram drafts lag a step). Taking
        the k tokens after the guess from the first lookup's occurrence instead matched an older
        context: on the bundled model at K = 3 it made 1.57 / 1.98 / 2.71 tokens per verify step
        on copy / fresh / repeat against 2.00 / 2.38 / 2.96 (docs/speculative.md). Both lookups
        take k tokens, so where the drafts in flight agree with the guesses, one variant's second
        lookup is the next variant's first (NgramIndex memoizes them): about K + 2 lookups for
        an ahead chunk's K + 1 variants, not 2(K + 1)."""
        if k <= 0:
            return []
        index = self._of(request)
        guess = index.lookup(k, prefix)[:1]
        return index.lookup(k, prefix + tuple(guess)) if guess else []

    def propose_known(self, request: Request, k: int, prefix: tuple[int, ...]) -> list[int]:
        """Drafts after the known tokens and `prefix`, tokens the host has read back but not yet
        applied to the request (late-bound drafts, engine/late_drafts.py): what propose() returns
        once they are applied."""
        if k <= 0:
            return []
        index = self._of(request)
        found = index.lookup(k, tuple(prefix))
        index.late_found = bool(found)
        return found

    def worth_placeholders(self, request: Request) -> bool:
        """Whether a chunk of this request behind a token still on the device is scheduled with
        placeholders for a late lookup to fill, without guessing: unless its last late lookup found
        nothing (text that does not repeat would verify placeholders every step; its chunks follow
        the guessed lookups until a guess finds drafts again)."""
        index = self._index.get(request)
        return index is None or index.late_found


class NgramIndex:
    """One request's n-grams (min_n..max_n tokens) -> the latest start that has a token after it:
    ngram_draft's answer for the known tokens, kept up to date as tokens arrive.

    It takes at most TOKENS_PER_EXTEND new tokens per extend() call and proposes nothing while it
    lags the request (`behind`): a long prompt is indexed over a few steps, not in one. Indexing
    runs on the engine thread between two steps, so every running request's next token waits for
    it: a 32K-token prompt in one call held it 27 ms (an H100 host's CPU and the 2-core repository
    host alike, benchmarks/probes/ngram_index.py); in calls of 1,024 tokens, 1.5 ms on average and 5.4 ms
    at most (the 2-core host with tests beside it; the longest call resizes the grown dict)."""

    TOKENS_PER_EXTEND = 1024

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.seq: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> latest start j with j + n < len(seq)
        self.behind = False  # the request knows tokens past seq: lookups propose nothing until caught up
        self._memo: dict[tuple, list[int]] = {}  # (k, prefix) -> lookup's answer while seq is unchanged
        self.late_found = True  # the last late-bound lookup found drafts (NgramDrafter.worth_placeholders)

    def extend(self, request: Request) -> None:
        known = request.num_known
        size = len(self.seq)
        if known <= size:
            self.behind = False
            return
        self._memo.clear()
        stop = min(known, size + self.TOKENS_PER_EXTEND)
        self.behind = stop < known
        self.seq += request.token_slice(size, stop)
        seq = self.seq
        # Windows that now have a continuation: starts j with size <= j + n < stop. Their tuples are
        # built by zip over n shifted slices and inserted in order of j, so the latest start wins, as
        # a loop over j would, but in C (1.6-2x faster on a 32K-token prompt, the probe above).
        for n in range(self.min_n, self.max_n + 1):
            lo, hi = max(0, size - n), stop - n
            if hi > lo:
                self.latest.update(zip(zip(*(seq[lo + i : hi + i] for i in range(n))), range(lo, hi)))

    def lookup(self, k: int, prefix: tuple[int, ...]) -> list[int]:
        """ngram_draft(known + prefix, k, min_n, max_n) from the index (prefix: a few tokens past it);
        nothing while the index lags the request. Memoized until the index next grows; reads only
        the last max_n known tokens besides the answer, not a copy of the whole sequence (an ahead
        chunk looks its request up K + 2 times or more a step)."""
        if self.behind:
            return []
        hit = self._memo.get((k, prefix))
        if hit is None:
            hit = self._memo[(k, prefix)] = self._lookup(k, prefix)
        return list(hit)

    def _lookup(self, k: int, prefix: tuple[int, ...]) -> list[int]:
        seq, known = self.seq, len(self.seq)
        size = known + len(prefix)
        base = max(0, known - self.max_n)  # tail[i] = (known + prefix)[base + i]: every window that reaches past the index
        tail = seq[base:] + list(prefix) if prefix else seq[base:]
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = tail[size - n - base :]
            start = -1
            for j in range(size - n - 1, max(known - n, 0) - 1, -1):  # windows reaching past the index, latest first
                if tail[j - base : j - base + n] == suffix:
                    start = j
                    break
            if start < 0:
                start = self.latest.get(tuple(suffix), -1)
                if start + n > known - 1:  # (the index holds only windows with a known continuation)
                    start = -1
            if start >= 0:
                lo, hi = start + n, start + n + k  # (known + prefix)[lo:hi]
                if hi <= known:
                    return seq[lo:hi]
                if lo >= base:
                    return tail[lo - base : hi - base]
                return seq[lo:] + list(prefix[: hi - known])
        return []


class MtpDrafter:
    """Drafts the MTP layer computed on the device after the request's last step (engine/mtp_draft.py):
    the engine records them as the step's tokens reach the host, keyed by the number of tokens the
    request knew then. A request with no such drafts (first step after admission or preemption, a
    step whose drafts were not computed, a request not scheduled in the previous step) runs one
    token this step and has drafts again after it. `lookahead`: positions past a sampling chunk the
    draft chain writes MTP latents at (the scheduler gives them pages when it can)."""

    def __init__(self, num_tokens: int):
        self.k = num_tokens
        self.lookahead = max(0, num_tokens - 1)
        self._drafts: dict[Request, tuple[int, list[int]]] = {}
        self.runner = None  # the engine's MtpDraftRunner: which drafts are still on the device

    def record(self, request: Request, drafts) -> None:
        """Drafts that continue `request` from the tokens it knows now. A chunk of its already
        dispatched with them still on the device (propose_after's codes) learns them here, before
        its own tokens are applied."""
        drafts = [int(t) for t in drafts]
        self._drafts[request] = (request.num_known, drafts)
        for c in request.unapplied:
            if c.drafts and c.drafts[0] <= DEVICE_DRAFT:
                c.drafts = tuple(drafts[: len(c.drafts)])

    def forget(self) -> None:
        self._drafts.clear()

    def prune(self) -> None:
        """Drop drafts of requests that finished or moved on (called once per step)."""
        self._drafts = {r: v for r, v in self._drafts.items() if not r.is_finished and v[0] == r.num_known}

    def propose(self, request: Request, k: int) -> list[int]:
        entry = self._drafts.get(request)
        if k <= 0 or entry is None or entry[0] != request.num_known or request.num_computed != request.num_known - 1:
            return []
        return entry[1][:k]

    def propose_after(self, request: Request, k: int, after: tuple[int, ...]) -> list[int]:
        """Drafts after a token still on the device (overlapped scheduling): the draft program of
        the step in flight computes them from wherever that step's verify chunk ends, so one set
        serves every count `after` it may keep. They are not on the host yet: each is a code the
        next step program reads from the device (speculative_inputs.device_draft_code), replaced by its
        value when that step's drafts are read back (record)."""
        row = self.runner.chain_row(request) if self.runner is not None else None
        if k <= 0 or row is None:
            return []
        return [device_draft_code(row, j, self.k) for j in range(min(k, self.k))]


def ngram_draft(seq: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq's longest suffix n-gram."""
    size = len(seq)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = seq[size - n:]
        # windows starting at 0..size-n-1: each is an earlier occurrence candidate (not the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(seq[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


@dataclasses.dataclass
class SpeculativeStats:
    """Counters for stats() and /metrics: drafts proposed and accepted, per verify chunk."""

    k: int
    verify_chunks: int = 0  # request-steps that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    histogram: list[int] = dataclasses.field(default_factory=list)  # [a]: verify chunks that accepted a drafts
    ahead_chunks: int = 0  # chunks scheduled behind a verify chunk still on the device (overlapped speculation)
    late_bound: int = 0  # chunks whose n-gram drafts were filled just before launch (engine/late_drafts.py)

    def __post_init__(self):
        self.histogram = self.histogram or [0] * (self.k + 1)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.verify_chunks += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.histogram[num_accepted] += 1

    def summary(self, method: str) -> dict:
        chunks = self.verify_chunks
        return {
            "method": method, "num_speculative_tokens": self.k, "verify_chunks": chunks,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_per_step": self.accepted_tokens / chunks if chunks else 0.0,
            "accepted_histogram": list(self.histogram), "ahead_chunks": self.ahead_chunks,
            "late_bound_chunks": self.late_bound,
        }
