"""A dispatched step until its tokens are read back, and the two things such a step may still owe:
the sampling of its grammar rows (their masks need the previous step's tokens) and the prompt
logprobs its prefill rows carried (docs/structured_outputs.md)."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from splash_jax.engine.executor import StepLogits, StepResult
from splash_jax.engine.request import Request
from splash_jax.engine.sampler import FULL_MODE, SamplerMode
from splash_jax.engine.scheduler import ScheduledChunk
from splash_jax.structured.masks import MaskBuilder
from splash_jax.structured.reasoning_gate import mask_row


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose tokens have not been read back yet."""

    chunks: list[ScheduledChunk]
    rows: list[int]  # output row of each sampling chunk
    result: StepResult | None  # None while its sampling waits for grammar masks (`logits` holds the forward pass)
    want_logprobs: bool
    prompt_rows: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (chunk, first row, count)
    logits: StepLogits | None = None
    mode: SamplerMode = FULL_MODE
    mask: np.ndarray | concurrent.futures.Future | None = None  # its grammar masks, or their fill in progress
    draft_key: tuple[int, int] | None = None  # (batch bucket, level) the draft budget chose it at (engine/draft_budget.py)
    dispatch_end: float | None = None  # when its dispatch returned (engine/dispatch_timing.py)
    prefill_tokens: int = 0  # prompt tokens it computes
    features: tuple[float, ...] = ()  # what its device time is fitted to (engine/dispatch_timing.py)
    host_tokens: np.ndarray | None = None  # its token vector once read back (DeviceSteps._read_tokens)
    read_wait_s: float = 0.0  # how long that read blocked


class GrammarMasks:
    """Fills the masks of a step's grammar rows from their grammars as the host has them (or the
    reasoning gate's: all ones while reasoning, only the end token once the budget is spent): on its
    own thread when the caller overlaps (llguidance releases the GIL, so the engine thread
    schedules and packs the next step meanwhile), else at once."""

    def __init__(self, builder: MaskBuilder):
        self.builder = builder
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="splash-grammar")

    def start(self, step: InFlight, threaded: bool) -> None:
        rows = step.logits.logits.shape[0]
        matchers, forced = [], []  # (matcher, row); (row, the only allowed token: a spent reasoning budget)
        for c, row in zip((c for c in step.chunks if c.samples), step.rows):
            if not c.request.is_finished:
                m = mask_row(c.request)
                if isinstance(m, int):
                    forced.append((row, m))
                elif m is not None:
                    matchers.append((m, row))
        fill = self.builder.fill
        step.mask = self._thread.submit(fill, rows, matchers, forced) if threaded else fill(rows, matchers, forced)

    def take(self, step: InFlight) -> np.ndarray:
        """The step's masks (waiting for their fill), handed over once."""
        if step.mask is None:
            self.start(step, threaded=False)
        mask, step.mask = step.mask, None
        return mask.result() if isinstance(mask, concurrent.futures.Future) else mask


def collect_prompt_logprobs(request: Request, logprobs, first: int, count: int) -> None:
    """Append a step's prompt-logprob rows [first, first + count) to the request's entries."""
    if request.is_finished or not count:
        return
    chosen, top_ids, top_lp = logprobs
    request.prompt_lps += chosen[first : first + count].tolist()
    k = request.params.prompt_logprobs
    if k:
        request.prompt_tops += [dict(zip(i[:k].tolist(), v[:k].tolist())) for i, v in
                                zip(top_ids[first : first + count], top_lp[first : first + count])]
