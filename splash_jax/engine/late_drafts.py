"""Late-bound n-gram drafts: an overlapped step whose n-gram drafts are written once the step
before it has returned its tokens, just before its launch.

Behind a step still on the device, an n-gram lookup must guess the token that step samples (and,
for an ahead chunk, how many of its drafts it keeps), so its drafts lag a step: on the bundled
model the lag cost 28-57% of the drafts kept (docs/speculative.md). Reading the step back before
scheduling the next one (--speculative-ngram-drafts sync) drafts from the real tokens but leaves
the device idle for the host's whole schedule, pack and output work; on a 4-layer model a drafting
step took 1.6-2.0 ms against 1.1 ms overlapped (one H100). Late binding keeps the schedule and the
pack overlapped: the step is packed with placeholder drafts, then the host reads the step in flight
back, looks each dependent chunk's drafts up after the tokens it returned, and writes them over the
placeholders in the packed buffer. Only the lookups and the launch wait for the device.

A chunk keeps its shape (the drafts verified, its rows and pages), so it is scheduled with
placeholders up to its cap (Scheduler.pad_drafts), not with guessed drafts: the only lookup per
request and step is the late one, as for a synchronous step. Where that lookup finds fewer drafts,
the placeholders after them stay and only lower what the step may keep (a draft never changes an
output); acceptance counts only the real ones (`ScheduledChunk.real_drafts`). A request whose last
late lookup found nothing goes back to guessed lookups (NgramDrafter.worth_placeholders), so text
that does not repeat verifies no placeholders.
Greedy outputs are those of decoding one token per step either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from splash_jax.engine.step_packer import PackedStep, StepShape


def depends_on_step_in_flight(chunk) -> bool:
    """Whether the chunk's drafts were proposed behind a token still on the device (placeholders, or
    after a guess of that token): an ahead chunk (its verify chunk in flight), or a verify chunk
    whose first token that step samples."""
    return bool(chunk.drafts) and (chunk.shift_k > 0 or chunk.start >= chunk.request.num_known)


def bind_late_drafts(shape: StepShape, chunks: Sequence, packed: PackedStep, tokens: np.ndarray, drafter) -> int:
    """Replace placeholder (or guessed) drafts with those after the tokens the step before returned
    (`tokens`: its token vector on the host, row 0 the tokens by logits row, row 1 each verify
    chunk's kept count) in `packed.rep` and on the chunks (drafts; an ahead chunk's variant for the count that step
    kept, which the host moves it to when that step is applied). -> the chunks rebound."""
    spec = shape.replicated_spec()
    rep, rows = packed.rep, shape.rows
    bound = 0
    for i, c in enumerate(chunks):
        if not depends_on_step_in_flight(c):
            continue
        r, k = c.request, len(c.drafts)
        first = int(packed.last_rows[i]) - k  # the chunk's first logits row: row first + j verifies draft j
        if c.shift_k:  # kept a of the verify chunk before it, then sampled tokens[0, its first row + a]
            behind = r.unapplied[0]
            prow = r.pending_row
            a = int(tokens[1, prow])
            prefix = tuple(behind.drafts[:a]) + (int(tokens[0, prow - c.shift_k + a]),)
        else:
            prefix = (int(tokens[0, r.pending_row]),)
        late = drafter.propose_known(r, k, prefix)[:k]
        c.real_drafts = len(late)
        if not late:
            continue
        if c.shift_k:
            v = list(c.variants[a])
            v[: len(late)] = late
            c.variants = c.variants[:a] + (tuple(v),) + c.variants[a + 1 :]
            at = spec.offset("var_draft") + a * rows + first
            rep[at : at + k] = v
        else:
            v = list(c.drafts)
            v[: len(late)] = late
            c.drafts = tuple(v)
            at = spec.offset("tokens") + int(packed.base[i]) + 1  # the token slots after the chunk's first
            rep[at : at + k] = v
            at = spec.offset("s_draft") + first
            rep[at : at + k] = v
        bound += 1
    return bound
