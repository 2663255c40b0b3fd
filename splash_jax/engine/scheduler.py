"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step, in order:
  1. Running requests that decode (one token left to compute) get their token first.
  2. Running requests part-way through their prefill continue, within the token budget.
  3. Waiting requests are admitted in arrival order while the token budget, the request
     limit and free pages allow; a prompt longer than the remaining budget is chunked.
A request whose next token needs a page when none is free preempts the most recently
admitted running request not yet scheduled this step (or itself): its pages are freed and it
goes back to the front of the waiting queue keeping its output, to be recomputed later.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging

from splash_jax.engine.request import Request, Status
from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.placement import pages_needed

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (== request.num_computed)
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def tokens(self) -> list[int]:
        return self.request.token_slice(self.start, self.start + self.num_tokens)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        kv_placement: str = "replicated",
    ):
        self.allocator = allocator
        self.n = allocator.num_devices
        self.kv_placement = kv_placement
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._order = itertools.count()
        self.num_preemptions = 0

    # --- queue management -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drop a request (finished or aborted) and free its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for request in decoding + prefilling:
            if request not in self.running or budget == 0:
                continue  # preempted by an earlier request of this step, or out of budget
            n = min(request.num_tokens - request.num_computed, budget)
            if not self.enable_chunked_prefill and n < request.num_tokens - request.num_computed:
                continue
            if not self._ensure_pages(request, request.num_computed + n, scheduled):
                continue  # it preempted itself
            chunks.append(ScheduledChunk(request, request.num_computed, n))
            scheduled.add(id(request))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            remaining = request.num_tokens - request.num_computed
            if not self.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            request.device_pages = [[] for _ in range(self.n)]
            request.owner = self.least_loaded_device()
            if not self.allocate(request, request.num_computed + n):
                break  # admission only when its pages are there
            self.waiting.popleft()
            request.status = Status.RUNNING
            request.order = next(self._order)
            self.running.append(request)
            chunks.append(ScheduledChunk(request, request.num_computed, n))
            scheduled.add(id(request))
            budget -= n
        return chunks

    def _ensure_pages(self, request: Request, upto: int, scheduled: set[int]) -> bool:
        """Grow `request` to hold `upto` tokens, preempting others if needed; False if it preempted itself."""
        while not self.allocate(request, upto):
            victims = [r for r in self.running if id(r) not in scheduled and r is not request]
            victim = max(victims, key=lambda r: r.order) if victims else request
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def allocate(self, request: Request, upto: int) -> bool:
        """Give `request` the pages it needs on every device to hold `upto` tokens, or nothing."""
        need = pages_needed(self.kv_placement, self.n, request.owner, request.device_pages, upto, self.page_size)
        if any(k > self.allocator.num_free(d) for d, k in enumerate(need)):
            return False
        for d, k in enumerate(need):
            if k:
                request.device_pages[d] += self.allocator.allocate(k, d)
        return True

    def least_loaded_device(self) -> int:
        """Owner for a new request: the device with the most free pages, then the fewest requests."""
        counts = [0] * self.n
        for r in self.running:
            counts[r.owner] += 1
        return max(range(self.n), key=lambda d: (self.allocator.num_free(d), -counts[d], -d))

    def preempt(self, request: Request) -> None:
        """Free a running request's pages and requeue it first; it keeps its output and recomputes."""
        log.debug("preempting %s (%d tokens computed)", request.request_id, request.num_computed)
        self.running.remove(request)
        self._release(request)
        request.status = Status.WAITING
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        for pages in request.device_pages:
            self.allocator.free(pages)
        request.device_pages = []
        request.num_computed = 0
