"""Continuous-batching scheduler in two halves: `schedule()` before a step, `update()` after it.

schedule() -> SchedulerOutput, in order:
  1. Running requests that decode (one token left to compute) get their token first.
  2. Running requests part-way through their prefill continue, within the token budget.
  3. Waiting requests are admitted in arrival order while the token budget, the request
     limit, free slots and free pages allow; a prompt longer than the remaining budget is chunked.
  Steps 2 and 3 follow engine/prefill_order.py: fcfs as above, or srpf (both together, shortest
  remaining prompt first within a bounded age); while requests decode it may cap prefill tokens.
  A scheduled chunk counts as computed at once (num_computed advances when it is scheduled), so
  the next step can be scheduled before this one's tokens reach the host (overlapped
  scheduling); a chunk that reaches the end of the sequence samples a token, which stays
  pending (on the device) until `update()` sees it. A request that has sampled its last allowed
  token (max_tokens, the model length) is not scheduled again: its pending token finishes it.
  A request whose next token needs a page when none is free preempts the most recently
  admitted running request not yet scheduled this step (or itself): its pages and slot are
  freed and it goes back to the front of the waiting queue keeping its output, to be recomputed.

With speculative decoding (engine/speculative.py) a decoding request may carry drafts: its chunk
computes its last token and the drafts, with a logits row each, from the rows left after every
decoding request has its one; update() keeps the accepted prefix and rolls num_computed back to it.
A drafter with a `lookahead` (MTP: its draft chain writes latents past a sampling chunk) gets
pages for those positions after the step is scheduled, from the pages left.

update(step, tokens) after a step's tokens reach the host: appends each sampled token, applies
the token-level stops (EOS, stop_token_ids, max_tokens, model length) and finishes requests
(freeing their pages and slots). Tokens of requests that finished meanwhile are dropped, so a
token sampled past a stop is never shown. Stop strings need text: the engine calls `finish()`.

With a prefix cache (kv/prefix_cache.py), admission (engine/admission.py) references the longest
cached prefix of the request's known tokens instead of computing it (its last token is always
computed: a cached page holding it is shared without writing it, or copied on write); under owner layouts the owner is the
device holding the longest prefix unless its load exceeds the least loaded device's by
`balance_pages`. A request whose next block another running request is computing starts on that
request's pages once it has scheduled them (in the same step), or waits (later requests may pass
it). After each dispatched step (`dispatched`), the full pages its
chunks completed are cached; a request that stops running leaves its pages cached.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time

from splash_jax.engine.admission import Admission, cap_to_rows
from splash_jax.engine.prefill_order import PrefillOrder
from splash_jax.engine.step_time_cap import StepTimeCap
from splash_jax.engine.request import Request, Status
from splash_jax.engine.spec_scheduling import SpeculativeScheduling, settle
from splash_jax.engine.speculative import accepted
from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.page_table import PageTables
from splash_jax.kv.placement import Placement
from splash_jax.kv.prefix_cache import CacheStats, PrefixCache
from splash_jax.structured.reasoning_gate import after_token

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step
    num_tokens: int
    samples: bool  # reaches the end of the sequence: a token is sampled
    lp_start: int = -1  # prompt logprobs: positions lp_start.. each get a logits row (-1: only the last)
    drafts: tuple[int, ...] = ()  # speculative drafts after its last known token (a logits row each, plus one)
    # A follower's last prompt token: the leader computes that position in the same step
    # (engine/admission.py) and writes its latent; this chunk takes no token slot and its logits
    # row reads the leader's slot there (the same tokens on the same pages: the same logits).
    leader: Request | None = None
    # A fully cached page-aligned prompt's last token (engine/admission.py): its latent is already
    # in the cached page the request shares, so the step reads it there and its write is dropped
    # (a page several requests reference is never written).
    in_cached_page: bool = False
    # An ahead chunk (overlapped speculation): scheduled behind a verify chunk of shift_k drafts
    # whose step is still on the device, as if it kept none; variants[a] are its drafts if it
    # keeps a. The device moves it a positions on (speculative_inputs.shift_ahead); the host does the
    # same when that chunk is applied (start += a, drafts = variants[a]).
    shift_k: int = 0
    variants: tuple[tuple[int, ...], ...] = ()
    admission: int = 0  # the request's admission it was scheduled in (a preempted one's later tokens move nothing)
    # Late-bound drafts (engine/late_drafts.py): how many of its drafts (of the variant its verify
    # chunk kept, for an ahead chunk) a lookup found after the real tokens; the rest are
    # placeholders. -1: every draft is a real one.
    real_drafts: int = -1

    @property
    def writes(self) -> bool:
        return self.leader is None and not self.in_cached_page

    @property
    def num_slots(self) -> int:
        """Token slots it takes in its step (and of the step's token budget): none for a
        follower's last prompt token (`leader`), num_tokens otherwise."""
        return 0 if self.leader is not None else self.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_rows(self) -> int:
        """Logits rows the chunk takes in its step: one, one per position from lp_start, or one per
        draft plus one."""
        if self.drafts:
            return len(self.drafts) + 1
        return self.end - self.lp_start if self.lp_start >= 0 else 1


@dataclasses.dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Request]


@dataclasses.dataclass
class TokenUpdate:
    """One sampled token as update() applied it."""

    request: Request
    token: int
    row: int  # its row in the step's outputs
    finish_reason: str | None  # set when a token-level stop finished the request
    stop_token: bool  # the token is EOS or a stop_token_id (its text is not shown)


def advance_grammar(request: Request, token: int) -> str | None:
    """Feed a sampled token to the request's grammar: "stop" once the grammar is complete (nothing
    may follow), "error" (with request.error set) if it rejects the token, else None."""
    g = request.grammar
    if not g.consume_token(token) or g.is_error():
        request.error = f"structured output: the grammar cannot continue after token {token} ({g.get_error() or 'rejected'})"
        log.warning("request %s: %s", request.request_id, request.error)
        return "error"
    return "stop" if g.is_stopped() else None


class Scheduler(Admission, SpeculativeScheduling):
    def __init__(
        self,
        allocator: PageAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        placement: Placement,
        max_model_len: int,
        pages_per_request: int,
        eos_ids: set[int] = frozenset(),
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = False,
        balance_pages: int = 0,
        max_logits_rows: int | None = None,
        prefill_order: PrefillOrder | None = None,
    ):
        self.allocator = allocator
        self.n = allocator.num_devices
        self.placement = placement
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_logits_rows = max_logits_rows or max_num_seqs  # logits rows per step (drafts take rows too)
        # Overlapped speculation (the engine sets it per step): drafts for requests whose last
        # token is still on the device, and ahead chunks behind verify chunks of up to
        # ahead_drafts drafts (StepShape.variants - 1).
        self.speculate_ahead, self.ahead_drafts = False, 0
        self.drafting_paused = False  # no drafts this step (a layout switch runs under overlapped speculation)
        # drafts behind a token still on the device are bound late (engine/late_drafts.py): a request
        # gets placeholders up to its cap for the late lookup to fill, not guessed drafts
        self.pad_drafts = False
        # The last step scheduled verifies drafts: with overlap, only its chunks can still be on
        # the device when the next is scheduled, so False means no request awaits a verify (the
        # scan for ahead chunks is skipped: at level 0 a step costs the host what it costs off).
        self.drafts_in_flight = False
        self.set_speculation(None, 0)
        self.max_model_len = max_model_len
        self.eos_ids = set(eos_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prefill_order = prefill_order or PrefillOrder()  # fcfs or srpf, the prefill cap beside decodes
        self.tables = PageTables(self.n, max_num_seqs, pages_per_request)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._order = itertools.count()
        self.num_preemptions = 0
        self.num_added = 0  # requests ever added (the policy looks again after arrivals)
        self.balance_pages = balance_pages
        self.cache_stats = CacheStats()
        self.cache: PrefixCache | None = PrefixCache(allocator, self.cache_stats) if enable_prefix_caching else None
        self.page_copies: list[tuple[int, int]] = []  # copy-on-write copies for the next step (take_page_copies)
        # A fully cached page-aligned prompt shares the page of its last token (its step reads that
        # latent, writes nothing). False (the engine sets it for MTP, whose steps write a latent
        # there that depends on the request's next token): that page is copied on write.
        self.share_last_cached_page = True
        self.step_chunks: list[ScheduledChunk] = []  # the chunks of the step being scheduled
        # --max-step-ms-with-decodes (engine/step_time_cap.py; the engine sets it): prompt chunks beside
        # decodes cut to a predicted step time
        self.step_time_cap: StepTimeCap | None = None

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn the prefix cache on or off (off forgets every cached page)."""
        if enabled and self.cache is None:
            self.cache = PrefixCache(self.allocator, self.cache_stats)
        elif not enabled and self.cache is not None:
            self.cache.clear()
            self.allocator.on_evict = None
            self.cache = None

    # --- queue management -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)
        self.num_added += 1

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stopped, aborted, failed): free its pages and slot."""
        if request.status == Status.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = Status.FINISHED
        request.finish_reason = request.finish_reason or reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def sampling_done(self, request: Request) -> bool:
        """It has sampled its last allowed token (which may still be pending)."""
        return request.num_generated >= request.params.max_tokens or request.num_tokens >= self.max_model_len

    # --- before a step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Chunks for the next step within the token budget and max_num_seqs logits rows (a
        request asking for prompt logprobs takes a row per prompt position it computes)."""
        budget, rows = self.max_num_batched_tokens, self.max_logits_rows
        chunks: list[ScheduledChunk] = []
        self.step_chunks = chunks  # this step's so far (admission: a follower's leader chunk)
        preempted: list[Request] = []
        scheduled: set[int] = set()
        todo = [r for r in self.running if r.num_tokens > r.num_computed]
        decoding = [r for r in todo if r.num_tokens - r.num_computed == 1 and not self.sampling_done(r)]
        prefilling = [r for r in todo if r.num_tokens - r.num_computed > 1]
        if self.speculate_ahead and self.drafts_in_flight:  # behind a verify chunk still on the device (as decodes)
            decoding += [r for r in self.running if self._goes_ahead(r)]
        drafts = self._propose(decoding, min(budget, rows))
        order = self.prefill_order  # engine/prefill_order.py: prefill work in order, its cap beside decodes
        decode_tokens = len(decoding) + sum(
            len(d[0]) if r.awaits_verify else len(d) for r in decoding if (d := drafts.get(id(r))))
        budget = order.prefill_budget(budget, decode_tokens)
        if self.step_time_cap is not None:
            budget = self.step_time_cap.begin(budget, decode_tokens, order.buckets)
        plan = order.plan(prefilling, self.waiting, time.monotonic())
        budget = order.finishing_budget(budget, decode_tokens, plan, self.waiting)
        deferred, admitting = [], True  # deferred: waiting for a block another request computes (kept in order)
        for request in decoding + plan:
            if not isinstance(request, Request):  # admit up to this many from the waiting queue's front
                if admitting:
                    budget, rows, admitting = self._admit_waiting(request, budget, rows, chunks, scheduled, deferred)
                continue
            if request not in self.running or budget == 0 or rows == 0:
                continue  # preempted by an earlier request of this step, or out of budget
            mine = drafts.get(id(request), ())
            if request.awaits_verify:  # an ahead chunk: variants of drafts, pages for the longest shift
                variants = mine or ((),)
                if len(variants[0]) + 1 > min(budget, rows):
                    variants = tuple(v[: min(budget, rows) - 1] for v in variants)
                behind = request.unapplied[-1]
                if not self._ensure_pages(request, behind.end + 1 + len(variants[0]), scheduled, preempted):
                    continue
                chunks.append(self._take_ahead(request, behind, variants))
                scheduled.add(id(request))
                budget -= chunks[-1].num_tokens
                rows -= chunks[-1].num_rows
                continue
            if mine and len(mine) + 1 > min(budget, rows):
                mine = ()
            if mine:
                n = 1 + len(mine)
                if not self._ensure_pages(request, request.num_computed + n, scheduled, preempted):
                    continue
                chunks.append(self._take(request, n, mine))
                scheduled.add(id(request))
                budget -= n
                rows -= n
                continue
            n = self._chunk_tokens(request, request.num_computed, min(request.num_tokens - request.num_computed, budget), rows)
            if n <= 0 or not self.enable_chunked_prefill and n < request.num_tokens - request.num_computed:
                continue
            if not self._ensure_pages(request, request.num_computed + n, scheduled, preempted):
                continue  # it preempted itself
            chunks.append(self._take(request, n))
            scheduled.add(id(request))
            budget -= n
            rows -= chunks[-1].num_rows
        self.waiting.extendleft(reversed(deferred))
        if self.lookahead:  # best effort, from the pages left: never preempts (missing pages cost drafts only)
            for c in chunks:
                if c.samples and c.request.status == Status.RUNNING:
                    # (an ahead chunk may move shift_k positions on: engine/spec_scheduling.py)
                    self.allocate(c.request, min(c.end + c.shift_k + self.lookahead, self.max_model_len))
        self.drafts_in_flight = any(c.drafts for c in chunks)
        return SchedulerOutput(chunks, preempted)

    def _admit_waiting(self, limit, budget: int, rows: int, chunks: list, scheduled: set, deferred: list):
        """Admit up to `limit` requests from the waiting queue's front while the budget, rows and
        slots allow -> (budget, rows left, False once one did not fit: admission stops, in order)."""
        while limit > 0 and self.waiting and rows > 0 and self._free_slots:  # (budget 0: followers only)
            limit -= 1
            request = self.waiting.popleft()
            if request.awaits_verify:  # preempted behind a verify chunk: its tokens so far are not known yet
                deferred.append(request)
                continue
            admitted = self._admit(request, budget, rows)
            if admitted is None:  # no room: admission stays in order
                self.waiting.appendleft(request)
                return budget, rows, False
            if admitted == 0:
                deferred.append(request)
                continue
            chunks.append(self._take(request, admitted))
            scheduled.add(id(request))
            budget -= chunks[-1].num_slots
            rows -= chunks[-1].num_rows
        return budget, rows, True

    def dispatched(self, chunks: list[ScheduledChunk]) -> None:
        """A step with these chunks was dispatched: their latents will be in the pool before any
        later step reads it, so the full pages of known tokens they completed can be cached."""
        cache = self.cache
        for c in chunks:
            r = c.request
            if r.status != Status.RUNNING:
                continue
            r.num_cacheable = max(r.num_cacheable, c.end)
            if cache is not None and r.cacheable:
                upto = min(r.num_cacheable, r.num_known) // self.page_size
                if upto > len(r.cache_nodes):
                    cache.insert(r, self.placement, upto)

    def _chunk_tokens(self, request: Request, start: int, n: int, rows: int) -> int:
        """The tokens a prompt chunk of up to `n` from `start` computes this step: within the logits
        rows left and the step-time bound (0: none this step)."""
        n = cap_to_rows(request, start, n, rows)
        return self.step_time_cap.take(start, n) if self.step_time_cap is not None else n

    def _take(self, request: Request, n: int, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        start = request.num_computed
        chunk = ScheduledChunk(request, start, n, start + n - len(drafts) == request.num_tokens, drafts=drafts,
                               leader=request.follows, in_cached_page=request.last_token_cached,
                               admission=request.admissions)
        request.follows, request.last_token_cached = None, False
        if chunk.samples:
            request.unapplied.append(chunk)
        request.num_unverified = len(drafts)
        if request.wants_prompt_logprobs:
            chunk.lp_start = max(start, request.prompt_lp_next)
            request.prompt_lp_next = start + n
        request.num_computed += n
        request.num_pending += chunk.samples
        return chunk

    def _ensure_pages(self, request: Request, upto: int, scheduled: set[int], preempted: list[Request]) -> bool:
        """Grow `request` to hold `upto` tokens, preempting others if needed; False if it preempted itself."""
        while not self.allocate(request, upto):
            victims = [r for r in self.running if id(r) not in scheduled and r is not request]
            victim = max(victims, key=lambda r: r.order) if victims else request
            self.preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def allocate(self, request: Request, upto: int) -> bool:
        """Give `request` the pages it needs on every device to hold `upto` tokens, or nothing."""
        need = self.placement.pages_needed(self.n, request.owner, request.device_pages, upto, self.page_size)
        if any(k > self.allocator.num_free(d) for d, k in enumerate(need)):
            return False
        for d, k in enumerate(need):
            if k:
                pages = self.allocator.allocate(k, d)
                request.device_pages[d] += pages
                self.tables.append(request.slot, d, pages, self.placement, self.allocator)
        return True

    def preempt(self, request: Request) -> None:
        """Free a running request's pages and slot and requeue it first; it keeps its output and recomputes."""
        log.debug("preempting %s (%d tokens computed)", request.request_id, request.num_computed)
        self.running.remove(request)
        self._release(request)
        request.status = Status.WAITING
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request, cache_pages: bool = True) -> None:
        """Give back a request's pages and slot; with a cache its full written pages stay cached
        (a preempted request finds its own prefix again)."""
        cache = self.cache
        if cache is not None:
            if cache_pages and request.cacheable and request.device_pages:
                upto = min(request.num_cacheable, request.num_known) // self.page_size
                if upto > len(request.cache_nodes):
                    cache.insert(request, self.placement, upto)
            cache.release(request)
        for pages in request.device_pages:
            self.allocator.free(pages)
        request.device_pages = []  # (its unapplied chunks stay listed: their tokens still apply, moving nothing)
        request.num_computed = request.num_cacheable = request.num_unverified = 0
        request.follows, request.last_token_cached = None, False
        if request.slot >= 0:
            self.tables.clear(request.slot)
            self._free_slots.append(request.slot)
            request.slot = -1

    # --- layout switches ----------------------------------------------------------------------
    def set_placement(self, placement: Placement) -> None:
        self.placement = placement

    def replace_pages(self, moves: list[tuple[Request, list[list[int]], int]], tables: PageTables) -> None:
        """A switch handed off: each (request, device_pages, owner) now holds `device_pages` under
        the new placement, and `tables` (built by the switch as it planned: each moved request's
        slot holds its new pages, every other slot is empty) replace the page tables."""
        for request, device_pages, owner in moves:
            request.device_pages, request.owner = device_pages, owner
        self.tables = tables

    # --- after a step -------------------------------------------------------------------------
    def update(self, chunks: list[ScheduledChunk], rows: list[int], tokens) -> list[TokenUpdate]:
        """Apply all of a finished step's sampled tokens (token-level stops only); see apply_tokens."""
        return list(self.apply_tokens(chunks, rows, tokens))

    def apply_tokens(self, chunks: list[ScheduledChunk], rows: list[int], tokens):
        """Apply a finished step's sampled tokens (tokens[rows[i]] for the i-th sampling chunk; a
        chunk with K drafts reads rows[i] - K .. rows[i]), yielding a TokenUpdate per token as it
        is applied: a caller that finishes a request (a stop string) before the next one drops the
        request's later tokens. Nothing is applied until the generator is consumed."""
        for chunk, row in zip((c for c in chunks if c.samples), rows):
            request = chunk.request
            request.num_pending -= 1
            current = settle(request, chunk)
            if request.status == Status.FINISHED:
                continue  # stopped or aborted while this step ran: its token is dropped
            if chunk.drafts:
                first = row - len(chunk.drafts)
                out = accepted(chunk.drafts, tokens[first : row + 1])
                self._verified(chunk, len(out) - 1, current)
                rows_out = range(first, first + len(out))
            else:
                out, rows_out = [int(tokens[row])], (row,)
            for token, r in zip(out, rows_out):
                if request.status == Status.FINISHED:
                    break  # a stop ended it earlier in this chunk: the rest is dropped
                yield self._apply(request, token, r)

    def _apply(self, request: Request, token: int, row: int) -> TokenUpdate:
        """Append one sampled token, feed it to the grammar unless it is reasoning (reasoning_gate:
        its state moves here with output_ids) and apply the token-level stops."""
        request.output_ids.append(token)
        p = request.params
        stop_token = token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)
        reason = advance_grammar(request, token) if after_token(request, token) else None
        if reason is None and stop_token and len(request.output_ids) >= p.min_tokens:
            reason, request.stop_reason = "stop", (token if token in p.stop_token_ids else None)
        elif reason is None and len(request.output_ids) >= p.max_tokens or request.num_known >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.finish(request, reason)
        return TokenUpdate(request, token, row, reason, stop_token and reason == "stop")
