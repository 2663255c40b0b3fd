"""A drafter whose acceptance rate is set, not earned: for benchmarks of what speculative decoding
buys at a given acceptance on a real-size model with dummy weights (whose drafts, from n-grams or
an untrained MTP layer, would almost never be accepted).

It replays the target's own greedy output for each prompt, recorded beforehand with speculation
off. At output position q the draft is the recorded token with probability p and otherwise a
token that is never it ((truth + 1) % vocab), decided once per (seed, prompt, q), so asking again,
or through `propose_after`, gives the same draft at the same position. Greedy verification keeps
a draft iff it is the target's argmax, i.e. the recorded token, so every drafted position is
accepted independently with probability p. A verify step with K drafts stops at the first
rejection, so it accepts on average

    E[accepted] = p + p^2 + ... + p^K          (expected_accepted(p, K))

and outputs one token more (the correction or the bonus token); the engine's `acceptance_rate`
(accepted / drafted) is then E[accepted] / K, which equals p only for K = 1.

A request whose prompt was not recorded gets no drafts, nor does one whose output has left the
recording (a bf16 near-tie flipped a token): past that point the recording no longer predicts the
target, and drafting it would lower the acceptance below the set one.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from splash_jax.engine.request import Request


def expected_accepted(p: float, k: int) -> float:
    """Mean drafts a verify step of k drafts accepts when each is accepted with probability p."""
    return sum(p**i for i in range(1, k + 1))


def position_uniforms(seed: int, prompt: Sequence[int], n: int) -> np.ndarray:
    """n uniforms in [0, 1), one per output position, fixed by (seed, prompt) alone."""
    digest = hashlib.blake2b(np.asarray(prompt, np.int64).tobytes(), digest_size=16).digest()
    key = [seed & 0xFFFFFFFF, *np.frombuffer(digest, np.uint32).tolist()]
    return np.random.default_rng(key).random(n)


class _Track:
    """One request's drafts and how far its output was checked against the recording."""

    __slots__ = ("checked", "diverged", "drafts", "truth")

    def __init__(self, truth: list[int], drafts: list[int]):
        self.truth, self.drafts, self.checked, self.diverged = truth, drafts, 0, False


class SetAcceptanceDrafter:
    """Drafts from recorded greedy continuations, each right with probability `p` (module doc).

    continuations: prompt token ids (a tuple) -> the target's greedy output ids for it, recorded
    with speculation off. Use with `engine.set_speculative("custom", k, drafter=...)`."""

    def __init__(self, continuations: Mapping[tuple[int, ...], Sequence[int]], p: float, seed: int = 0,
                 vocab_size: int | None = None):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"acceptance probability p must be in [0, 1], got {p}")
        vocab = vocab_size or 1 + max((max(t, default=0) for t in continuations.values()), default=0)
        if vocab < 2:
            raise ValueError("a wrong draft needs a vocabulary of at least 2 tokens")
        self.p, self.seed, self.vocab_size = p, seed, vocab
        self._drafts: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
        for prompt, truth in continuations.items():
            prompt = tuple(int(t) for t in prompt)
            truth_arr = np.asarray(truth, np.int64)
            right = position_uniforms(seed, prompt, len(truth_arr)) < p
            drafts = np.where(right, truth_arr, (truth_arr + 1) % vocab)
            self._drafts[prompt] = (truth_arr.tolist(), drafts.tolist())
        # per request object (a prompt is hashed once per request, not once per step)
        self._tracks: weakref.WeakKeyDictionary[Request, _Track | None] = weakref.WeakKeyDictionary()
        self.num_diverged = 0  # requests whose output left the recording (drafting stopped)

    def _track(self, request: Request) -> _Track | None:
        try:
            return self._tracks[request]
        except KeyError:
            entry = self._drafts.get(tuple(request.prompt_ids))
            track = _Track(*entry) if entry is not None else None
            self._tracks[request] = track
            return track

    def _follows_truth(self, track: _Track, request: Request, prefix: Sequence[int] = ()) -> bool:
        """Whether the request's output (then `prefix`) is still the recorded one: checks only the
        tokens it gained since the last call."""
        if track.diverged:
            return False
        out, truth = request.output_ids, track.truth
        n = len(out)
        if track.checked > n:  # preempted and recomputed from scratch, or a new output list
            track.checked = 0
        if out[track.checked:n] != truth[track.checked:n]:
            track.diverged = True
            self.num_diverged += 1
            return False
        track.checked = n
        return not prefix or list(prefix) == truth[n : n + len(prefix)]

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to k drafts for output positions len(output_ids) onwards."""
        return self._at(request, k, ())

    def propose_after(self, request: Request, k: int, prefix: tuple[int, ...]) -> list[int]:
        """Up to k drafts that follow the known tokens, then `prefix`, then one token not known
        yet (overlapped speculation proposes before the step in flight returns its tokens):
        output positions len(output_ids) + len(prefix) + 1 onwards."""
        return self._at(request, k, prefix, skip=1)

    def _at(self, request: Request, k: int, prefix: Sequence[int], skip: int = 0) -> list[int]:
        if k <= 0:
            return []
        track = self._track(request)
        if track is None or not self._follows_truth(track, request, prefix):
            return []
        q = len(request.output_ids) + len(prefix) + skip
        return track.drafts[q : q + k]
