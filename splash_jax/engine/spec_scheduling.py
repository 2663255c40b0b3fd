"""The scheduler's speculative decoding: which decoding requests carry drafts and how many, the
ahead chunks of overlapped speculation, and what a verify chunk's result moves.

Drafts go only into logits rows left over once every decoding request has its own row, so
speculation never delays another request. With a DraftBudget (engine/draft_budget.py) the count
per request is capped by the level whose steps the engine measured making the most tokens per
second (none for requests whose drafts are rarely kept); without one every request that can
speculate takes up to K.

Overlapped speculation (`speculate_ahead`, set by the engine each step): the next step is
scheduled while this one is on the device, as for plain decoding. A request whose last step
sampled one token gets drafts after that token (drafter.propose_after(request, k, ())). A request
whose last step verifies drafts gets an *ahead chunk*: scheduled as if that verify chunk kept
none of its K drafts, with a variant of its own drafts for each count a it may keep
(speculative.propose_ahead) and pages for the longest case. The step program moves it by the a
the previous step returned (speculative_inputs.shift_ahead); the host does the same when the verify
chunk's tokens are applied (`_verified`). One chunk goes ahead of each verify chunk at most.
MTP drafts behind a step in flight are still on the device: MtpDrafter.propose_after returns codes
the step program reads there (speculative_inputs.device_draft_code), the same for every variant.
"""

from __future__ import annotations

import dataclasses

from splash_jax.engine.draft_budget import DraftBudget, keeps_k
from splash_jax.engine.request import Request, Status
from splash_jax.engine.speculative import SpeculativeStats, can_speculate, max_drafts, propose_ahead


class SpeculativeScheduling:
    """Speculative decoding of Scheduler (engine/scheduler.py), which owns the state used here."""

    def set_speculation(self, drafter, num_tokens: int, budget: DraftBudget | None = None) -> None:
        """drafter.propose(request, k) -> up to k draft token ids (None or num_tokens 0: off);
        budget: draft caps from measured tokens per second (None: K each); the counters start again."""
        self.drafter = drafter if num_tokens else None
        self.num_speculative_tokens = num_tokens if drafter is not None else 0
        # positions past a sampling chunk whose latents the drafter's device work writes (MTP's chain)
        self.lookahead = getattr(self.drafter, "lookahead", 0)
        self.spec_stats = SpeculativeStats(self.num_speculative_tokens)
        self.draft_budget = budget if self.drafter is not None else None

    def _goes_ahead(self, r: Request) -> bool:
        """An ahead chunk may follow r's verify chunk on the device: one chunk in flight, from this
        admission, its drafts no more than the ahead programs' variants, min_tokens met (the device
        shifts sampling steps but not the host's min_tokens suppression), and every position the
        chunk may land on inside the model (its pages are taken for the longest shift)."""
        if len(r.unapplied) != 1 or not r.awaits_verify:
            return False
        behind = r.unapplied[0]
        return (behind.admission == r.admissions and len(behind.drafts) <= self.ahead_drafts
                and len(r.output_ids) >= r.params.min_tokens and behind.end < self.max_model_len
                and not self.sampling_done(r) and can_speculate(r, ahead=True))

    def _draft_limit(self, r: Request) -> int:
        """The most drafts r's next chunk may verify (0: it cannot speculate now)."""
        if not can_speculate(r, ahead=self.speculate_ahead):
            return 0
        k = self.num_speculative_tokens
        if self.speculate_ahead:
            k = min(k, self.ahead_drafts)  # so the chunk after it can go ahead too
        if r.awaits_verify:  # an ahead chunk: its tokens start one past the verify chunk before it
            behind = r.unapplied[-1]
            return max(0, min(k, self.max_model_len - behind.end - 1, r.params.max_tokens - r.num_generated - 1))
        return max_drafts(r, k, self.max_model_len)

    def _propose(self, decoding: list[Request], room: int) -> dict[int, tuple]:
        """Drafts per decoding request (by id) within the `room` rows left once each decoding
        request has its own, in decode order. An ahead request (awaits_verify) gets a tuple of variants
        (speculative.propose_ahead), possibly of no drafts."""
        if self.drafter is None or self.drafting_paused or not decoding:
            return {}
        budget = self.draft_budget
        fixed = [keeps_k(r) for r in decoding] if budget else []
        if budget is not None and not budget.choose_level(len(decoding)) and not self.drafts_in_flight and not any(fixed):
            return {}  # level 0, and no verify chunk on the device to go ahead of: as with speculation off
        spare = room - len(decoding)
        limits = [self._draft_limit(r) for r in decoding]
        if budget is not None:
            chosen = budget.caps([r.acceptance.alpha_for_drafting(r.num_generated) for r in decoding],
                                [0 if f else k for f, k in zip(fixed, limits)])
            limits = [k if f else c for f, k, c in zip(fixed, limits, chosen)]
        out = {}
        for r, k in zip(decoding, limits):
            k = min(k, max(spare, 0))
            # behind a token still on the device, late-bound: k placeholders a lookup fills at launch
            late = k and self.pad_drafts and r.num_pending and self.drafter.worth_placeholders(r)
            if r.awaits_verify:
                behind = r.unapplied[-1].drafts
                out[id(r)] = ((0,) * k,) * (len(behind) + 1) if late else propose_ahead(self.drafter, r, k, behind)
                spare -= len(out[id(r)][0])
                continue
            if not k:
                continue
            if late:
                d = (0,) * k
            elif r.num_pending:  # behind its token still on the device: after a guess of it
                d = tuple(self.drafter.propose_after(r, k, ())[:k])
            else:
                d = tuple(self.drafter.propose(r, k)[:k])
            if d:
                out[id(r)] = d
                spare -= len(d)
        return out

    def _take_ahead(self, request: Request, behind, variants: tuple):
        """Schedule an ahead chunk behind `behind` (see ScheduledChunk.shift_k) as if that verify
        chunk kept none of its drafts: its last token is then at behind.start + 1."""
        chunk = dataclasses.replace(
            behind, start=behind.start + 1, num_tokens=1 + len(variants[0]), samples=True, lp_start=-1,
            drafts=variants[0], leader=None, shift_k=len(behind.drafts), variants=variants,
            admission=request.admissions)
        request.num_computed = chunk.end
        request.num_unverified = len(variants[0])
        request.num_pending += 1
        request.unapplied.append(chunk)
        self.spec_stats.ahead_chunks += 1
        return chunk

    def _verified(self, chunk, kept: int, current: bool) -> None:
        """A verify chunk's tokens reached the host and it kept `kept` drafts: count them, and (if
        it is still the request's latest state) make the latents of the last known token and the
        kept drafts final; the rejected drafts' slots are written again by the next step. An ahead
        chunk behind it moves on by `kept`, as the device moved it."""
        request = chunk.request
        drafted = drafts_counted(chunk, kept)
        if drafted or chunk.real_drafts < 0:  # (a late-bound chunk whose lookup found none drafted nothing)
            self.spec_stats.record(drafted, kept)
            request.acceptance.record(drafted, kept)
        if not (current and request.status == Status.RUNNING and chunk.admission == request.admissions):
            return
        ahead = request.unapplied[0] if request.unapplied else None
        if ahead is not None and ahead.shift_k:
            ahead.start, ahead.drafts, ahead.shift_k = ahead.start + kept, ahead.variants[kept], 0
            request.num_computed, request.num_unverified = ahead.end, len(ahead.drafts)
        else:
            request.num_computed, request.num_unverified = chunk.start + 1 + kept, 0
        request.num_cacheable = min(request.num_cacheable, request.num_computed)


def drafts_counted(chunk, kept: int) -> int:
    """The drafts a verified chunk proposed, for acceptance counts: its real ones (a late-bound
    chunk's placeholders left out, unless one was kept by chance)."""
    if chunk.real_drafts < 0:
        return len(chunk.drafts)
    return min(len(chunk.drafts), max(chunk.real_drafts, kept))


def settle(request: Request, chunk) -> bool:
    """Take `chunk` (and any older chunk a failed step left) off the request's unapplied list:
    whether it was there (False: dropped by a device failure's recovery)."""
    for i, c in enumerate(request.unapplied):
        if c is chunk:
            del request.unapplied[: i + 1]
            return True
    return False
