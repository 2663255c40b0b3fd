"""Admission of waiting requests: the cached prefix, copy-on-write, in-flight followers, owners.

A part of `Scheduler` (engine/scheduler.py), which owns the state these methods use (allocator,
page tables, prefix cache, running and waiting requests). `Scheduler.schedule` calls `_admit` for
each waiting request it considers:
  - the longest cached prefix of its known tokens is referenced (prefix_cache.PrefixCache), its
    last token always computed (for its logits). When the cached pages hold that token too (a
    repeated page-aligned prompt), the request shares every page and its first chunk reads that
    token's cached latent without writing it (`ScheduledChunk.in_cached_page`); an MTP engine,
    whose steps write a latent there that depends on the request's next token, copies that page
    on write instead (`cached_start`; the engine runs the copies before the step:
    `take_page_copies`);
  - a request whose next blocks another running request (the leader) computes waits for them, or,
    once the leader has scheduled them (this step or earlier), starts at once on the leader's
    pages (`in_flight_pages`, `_follow`): within a step every layer writes all tokens' latents
    before any token attends (attention/layouts.py), so it reads what the leader writes in the
    same step. GRPO groups and n > 1 then get their first tokens in the leader's step, not one
    step later. A follower whose whole prompt the leader's pages hold takes no token slot and
    none of the step's token budget: its logits row reads the leader's slot at its last position
    (`ScheduledChunk.num_slots`), so a step full of leaders' prompts still starts all their
    followers;
  - under owner layouts the owner is chosen by `choose_owner` (a follower takes its leader's).
"""

from __future__ import annotations

from splash_jax.engine.request import Request, Status
from splash_jax.kv.allocator import pages_for_tokens


def cached_start(hit_pages: int, num_tokens: int, page_size: int, share_last: bool = True) -> tuple[int, int]:
    """(first position to compute, pages to share as they are) for a request whose first
    hit_pages pages are cached. Its last token is always computed (for its logits), so a fully
    cached prompt computes one token. When the cached pages cover that token, the request shares
    the page holding it (share_last: its latent is read from there, not written; its next tokens
    start a new page, the prompt being page-aligned), or, without share_last, that page is copied
    on write (a private copy the request writes that token and its next ones to)."""
    computed = min(hit_pages * page_size, num_tokens - 1)
    return computed, hit_pages if share_last else min(hit_pages, computed // page_size)


def in_flight_pages(chain: list, hit: int, page_size: int) -> int:
    """How many leading pages of `request`'s chain it can take now from the running request (the
    leader) computing chain[hit] (0: none, it waits): the leader's own pages 0..m-1, through the
    cached ones below hit and the blocks from hit on that the leader computes and has scheduled
    (its tokens there are the chain's, so its pages hold the same latents)."""
    leader = chain[hit].computing  # running (PrefixCache.waits_for said so)
    m = hit
    while m < len(chain) and chain[m].computing is leader and leader.num_computed >= (m + 1) * page_size:
        m += 1
    return m if m > hit else 0


def leader_chunk(chunks: list, leader: Request, position: int) -> int | None:
    """The index of `leader`'s chunk among a step's chunks that computes `position` (None: none does)."""
    return next((i for i, c in enumerate(chunks) if c.request is leader and c.start <= position < c.end), None)


def cap_to_rows(request: Request, start: int, n: int, rows_left: int) -> int:
    """The longest chunk (<= n) whose logits rows fit in rows_left (>= 1)."""
    if request.wants_prompt_logprobs:
        return min(n, rows_left + max(start, request.prompt_lp_next) - start)
    return n


class Admission:
    """Admission methods of Scheduler (see the module docstring)."""

    def _admit(self, request: Request, budget: int, rows: int) -> int | None:
        """Admit `request` with its cached prefix: the tokens of its first chunk, 0 if it waits for
        a block another request is computing, None if it does not fit now (nothing changed).
        Some compute their whole prompt (Request.computes_whole_prompt). A cached page that holds
        its last token is shared (read, not written) or copied on write (`cached_start`)."""
        cache, size = self.cache, self.page_size
        if budget <= 0 and (cache is None or request.computes_whole_prompt or request.num_tokens % size):
            return None  # without budget only a follower of a whole (page-aligned) prompt may start
        chain, hit = [], 0
        if cache is not None and not request.computes_whole_prompt:
            chain = cache.chain(request, request.num_tokens // size)
            request.owner = self.choose_owner(chain, request)
            hit = cache.hits(chain, self.placement, request.owner)
            if cache.waits_for(chain, hit, request):
                shared = 0 if self.lookahead else in_flight_pages(chain, hit, size)
                if not shared:
                    cache.stats.deferred += 1
                    return 0
                return self._follow(request, chain, shared, budget, rows)
        else:
            request.owner = self.least_loaded_device()
        if budget <= 0:  # not a follower after all
            return None
        computed, shared = cached_start(hit, request.num_tokens, size, self.share_last_cached_page)
        remaining = request.num_tokens - computed
        n = self._chunk_tokens(request, computed, min(remaining, budget), rows)
        if n <= 0 or not self.enable_chunked_prefill and n < remaining:
            return None
        request.slot = self._free_slots.pop()
        request.device_pages = cache.take(request, chain, shared, self.placement) if shared else [[] for _ in range(self.n)]
        for d, pages in enumerate(request.device_pages):
            self.tables.append(request.slot, d, pages, self.placement, self.allocator)
        sources = {}  # copy-on-write: device -> the cached page (held while the private one is allocated)
        if shared < hit:
            sources = {d: chain[shared].pages[d] for d in self.placement.devices_of_page(shared, request.owner, self.n)}
            self.allocator.ref(list(sources.values()))
        fits = self.allocate(request, computed + n)
        if sources:
            self.allocator.free(list(sources.values()))
        if not fits:
            request.num_computed = 0
            self._release(request, cache_pages=False)
            return None
        if sources:
            entry = self.placement.entry_of(shared, self.n)
            self.page_copies += [(src, request.device_pages[d][entry]) for d, src in sources.items()]
            request.cache_nodes.append(chain[shared])  # the private copy holds that node's tokens
            cache.stats.copied_pages += len(sources)
        request.last_token_cached = shared * size > computed  # its one token's latent is in a page it shares
        return self._start(request, computed, chain, hit, n)

    def _follow(self, request: Request, chain: list, shared: int, budget: int, rows: int) -> int | None:
        """Admit `request` onto the first `shared` pages of the running request computing them
        (in_flight_pages): it references those pages (the leader's, not cached yet) and computes
        from where they end; a prompt they hold whole takes its last token's logits from the
        leader's slot (no token slot, no budget: ScheduledChunk.num_slots)."""
        leader, size, n = chain[shared - 1].computing, self.page_size, request.num_tokens
        whole = shared * size == n
        if whole and leader_chunk(self.step_chunks, leader, n - 1) is None:
            return 0  # the leader computed it in an earlier step: the cache holds it by the next
        computed = n - 1 if whole else shared * size
        count = 1 if whole else self._chunk_tokens(request, computed, min(n - computed, budget), rows)
        if count <= 0 or not self.enable_chunked_prefill and count < n - computed:
            return None
        request.owner, request.slot = leader.owner, self._free_slots.pop()
        held = self.placement.pages_needed(self.n, leader.owner, [[]] * self.n, shared * size, size)
        request.device_pages = [list(leader.device_pages[d][:k]) for d, k in enumerate(held)]
        self.allocator.ref([p for pages in request.device_pages for p in pages])
        for d, pages in enumerate(request.device_pages):
            self.tables.append(request.slot, d, pages, self.placement, self.allocator)
        if not self.allocate(request, computed + count):
            self._release(request, cache_pages=False)
            return None
        request.cache_nodes = list(chain[:shared])
        request.follows = leader if whole else None
        self.cache.stats.followed += 1
        return self._start(request, computed, chain, shared, count)

    def _start(self, request: Request, computed: int, chain: list, hit: int, n: int) -> int:
        """An admitted request runs from `computed` (its first chunk: n tokens)."""
        cache = self.cache
        request.num_computed = request.num_cacheable = computed
        if cache is not None:
            prompt = len(request.prompt_ids)
            cache.stats.queries += prompt
            cache.stats.hits += min(computed, prompt)
            if request.admissions == 0:
                request.num_cached_tokens = min(computed, prompt)
            cache.mark_computing(request, chain, hit, min(request.num_known, prompt) // self.page_size)
        request.admissions += 1
        request.status = Status.RUNNING
        request.order = next(self._order)
        self.running.append(request)
        return n

    def take_page_copies(self) -> list[tuple[int, int]]:
        """The (cached page, private page) copies admissions asked for since the last call: the
        engine runs them before the step that computes those requests' tokens."""
        copies, self.page_copies = self.page_copies, []
        return copies

    def cached_prefix(self, request: Request) -> int:
        """Tokens of a waiting request's prompt admission would find cached now (the policy prices
        only the rest); 0 without a cache, or for a request that computes its whole prompt."""
        if self.cache is None or request.computes_whole_prompt:
            return 0
        chain = self.cache.chain(request, request.num_tokens // self.page_size)
        if not chain:
            return 0
        hit = self.cache.hits(chain, self.placement, self.choose_owner(chain, request))
        return cached_start(hit, request.num_tokens, self.page_size)[0]  # (the same either way)

    def choose_owner(self, chain: list, request: Request | None = None) -> int:
        """Owner of a request whose cached prefix is `chain`. Under an owner-bound placement: among
        the devices whose pages in use after taking it (its pages less the prefix each already
        holds) stay within `balance_pages` of the lightest, the one holding most of its prefix;
        otherwise (and without a hit) the least loaded device. Counting what each device would
        add, not its load now, keeps a shared system prompt's owner from looking busy by the
        prefix alone (a second copy elsewhere costs the same pages again)."""
        least = self.least_loaded_device()
        if not chain or not self.placement.owner_bound or self.n == 1:
            return least
        hits = [self.cache.hits(chain, self.placement, d) for d in range(self.n)]
        if max(hits) == hits[least]:
            return least
        need = pages_for_tokens(request.num_tokens, self.page_size) if request is not None else len(chain)
        after = [self.allocator.pages_per_device - self.allocator.num_free(d) + max(0, need - hits[d])
                 for d in range(self.n)]
        room = min(after) + self.balance_pages
        return max((d for d in range(self.n) if after[d] <= room), key=lambda d: (hits[d], -after[d], -d))

    def least_loaded_device(self) -> int:
        """Owner for a new request: the device with the most free pages, then the fewest requests."""
        counts = [0] * self.n
        for r in self.running:
            counts[r.owner] += 1
        return max(range(self.n), key=lambda d: (self.allocator.num_free(d), -counts[d], -d))

    def admit_cached(self, request: Request, num_cached: int, reserve: int = 0) -> bool:
        """Run `request` as if its first `num_cached` tokens were already in the cache (benchmarks:
        the same work per decode step as after a real prefill, without its cost). False if it
        does not fit (nothing changes then)."""
        if not self._free_slots:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        request.device_pages = [[] for _ in range(self.n)]
        request.owner = self.least_loaded_device()
        request.slot = self._free_slots.pop()
        request.cacheable = False  # its first num_cached tokens were never computed
        if not self.allocate(request, num_cached + reserve):
            self._release(request)
            self.waiting.appendleft(request)
            return False
        request.num_computed = num_cached
        request.status = Status.RUNNING
        request.order = next(self._order)
        self.running.append(request)
        return True

