"""The one owner of KV pages: reference counts over a pool sharded by contiguous page ranges.

The pool has a base segment and, while attention weights are head-sharded, an extra segment
made of the memory those weights no longer use. Global page ids:
  base : device d owns [d*B, (d+1)*B)
  extra: device d owns [N*B + d*E, N*B + (d+1)*E)
Layouts decide which devices a request's pages go to; this class hands out and takes back
ids (base pages first, so the extra segment empties easily) and answers capacity questions.

Every holder of a page (a running request, a switch's reservation) holds one reference:
`allocate` gives pages with one, `ref` adds one, `free` drops one. A page at zero references
goes back to its device's free list, unless the prefix cache marked it cached: then it stays
as it is, evictable, in least-recently-released order, until an allocation on its device finds
no free page and evicts it (the cache is told, so it forgets the page). Nothing is freed or
reused while referenced; a cached page counts as free for capacity (it can be had at once).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np


class OutOfPages(RuntimeError):
    """The device has fewer free pages than asked for (callers preempt or wait)."""


@dataclasses.dataclass
class DeviceUsage:
    device: int
    total_pages: int
    free_pages: int  # free or cached-unreferenced (evictable)
    cached_pages: int = 0  # pages the prefix cache holds (referenced or not)

    @property
    def used_pages(self) -> int:
        return self.total_pages - self.free_pages


class PageAllocator:
    def __init__(self, num_devices: int, pages_per_device: int, page_size: int, extra_pages_per_device: int = 0):
        if pages_per_device < 1:
            raise ValueError(f"the KV pool has no pages (pages_per_device={pages_per_device})")
        self.num_devices = num_devices
        self.pages_per_device = pages_per_device  # base segment
        self.page_size = page_size
        self.extra_per_device = 0
        # Pop from the end; low ids come out first.
        self._free = [list(range((d + 1) * pages_per_device - 1, d * pages_per_device - 1, -1)) for d in range(num_devices)]
        self._free_extra: list[list[int]] = [[] for _ in range(num_devices)]
        self._refs = np.zeros(self.num_base_pages, np.int32)
        self._cached = np.zeros(self.num_base_pages, bool)
        # Cached pages at zero references, per (device, segment), oldest release first.
        self._evictable = [collections.OrderedDict() for _ in range(2 * num_devices)]
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets an evicted page
        self.num_evictions = 0
        if extra_pages_per_device:
            self.add_extra_segment(extra_pages_per_device)

    # --- segments -------------------------------------------------------------------------
    @property
    def num_base_pages(self) -> int:
        return self.num_devices * self.pages_per_device

    @property
    def num_pages(self) -> int:
        return self.num_devices * (self.pages_per_device + self.extra_per_device)

    def add_extra_segment(self, pages_per_device: int) -> None:
        if self.extra_per_device:
            raise RuntimeError("the extra segment already exists")
        self.extra_per_device = pages_per_device
        start = self.num_base_pages
        self._free_extra = [
            list(range(start + (d + 1) * pages_per_device - 1, start + d * pages_per_device - 1, -1))
            for d in range(self.num_devices)
        ]
        extra = self.num_devices * pages_per_device
        self._refs = np.concatenate([self._refs[:start], np.zeros(extra, np.int32)])
        self._cached = np.concatenate([self._cached[:start], np.zeros(extra, bool)])

    def remove_extra_segment(self) -> int:
        """Drop the extra segment; its cached pages no one references are evicted first (returns
        how many). Refused while a holder still references one of its pages."""
        start = self.num_base_pages
        if self.extra_per_device and self._refs[start:].any():
            raise RuntimeError("the extra segment still holds pages in use")
        evicted = 0
        for d in range(self.num_devices):
            lru = self._evictable[2 * d + 1]
            while lru:
                self._evict_one(lru)
                evicted += 1
        self.extra_per_device = 0
        self._free_extra = [[] for _ in range(self.num_devices)]
        self._refs, self._cached = self._refs[:start].copy(), self._cached[:start].copy()
        return evicted

    def extra_pages_in_use(self) -> int:
        """Extra-segment pages not free (referenced, or cached)."""
        return sum(self.extra_per_device - len(f) for f in self._free_extra) if self.extra_per_device else 0

    def locate(self, pages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(device, segment 0|1, local id within that device's segment) of global page ids."""
        pages = np.asarray(pages, np.int64)
        base = pages < self.num_base_pages
        device, local = np.divmod(pages, self.pages_per_device)
        if not base.all():  # the extra segment's arithmetic only where needed (half the work otherwise)
            extra_device, extra_local = np.divmod(pages - self.num_base_pages, max(self.extra_per_device, 1))
            device, local = np.where(base, device, extra_device), np.where(base, local, extra_local)
        return device, (~base).astype(np.int64), local

    def _lrus_of(self, pages: np.ndarray):
        """(LRU of a (device, segment), its pages of `pages` in order): grouped in one numpy pass
        instead of a lookup per page (a 32K-token prefix has 512)."""
        device, segment, _ = self.locate(pages)
        group = device * 2 + segment
        if (group == group[0]).all():
            return [(self._evictable[int(group[0])], pages.tolist())]
        return [(self._evictable[g], pages[group == g].tolist()) for g in np.unique(group).tolist()]

    def _where(self, page: int) -> int:
        """(device * 2 + segment) of one page."""
        if page < self.num_base_pages:
            return 2 * (page // self.pages_per_device)
        return 2 * ((page - self.num_base_pages) // self.extra_per_device) + 1

    # --- capacity -------------------------------------------------------------------------
    def num_free(self, device: int = 0) -> int:
        """Pages an allocation on `device` can have now (free, or cached and unreferenced)."""
        return (len(self._free[device]) + len(self._free_extra[device])
                + len(self._evictable[2 * device]) + len(self._evictable[2 * device + 1]))

    def num_free_base(self, device: int = 0) -> int:
        return len(self._free[device]) + len(self._evictable[2 * device])

    def num_cached(self, device: int | None = None) -> int:
        """Pages the prefix cache holds (on one device, or all)."""
        if device is None:
            return int(self._cached.sum())
        lo, hi = device * self.pages_per_device, (device + 1) * self.pages_per_device
        total = int(self._cached[lo:hi].sum())
        if self.extra_per_device:
            lo = self.num_base_pages + device * self.extra_per_device
            total += int(self._cached[lo : lo + self.extra_per_device].sum())
        return total

    def num_referenced(self) -> int:
        """Pages some holder references (in use; cached pages no one references are not)."""
        return int(np.count_nonzero(self._refs))

    def num_evictable(self, device: int) -> int:
        return len(self._evictable[2 * device]) + len(self._evictable[2 * device + 1])

    # --- pages ----------------------------------------------------------------------------
    def allocate(self, n: int, device: int = 0, base_only: bool = False) -> list[int]:
        """n pages of `device` with one reference each: free base pages, then free extra ones (not
        under `base_only`), then cached pages no one references, least recently released first
        (evicted from the cache). With no cached pages, in the order n calls of allocate(1) give."""
        base, extra = self._free[device], ([] if base_only else self._free_extra[device])
        lrus = [self._evictable[2 * device]] + ([] if base_only else [self._evictable[2 * device + 1]])
        have = len(base) + len(extra) + sum(len(q) for q in lrus)
        if n > have:
            raise OutOfPages(f"device {device}: asked for {n} {'base ' if base_only else ''}pages, {have} free")
        taken = []
        for free in (base, extra):
            k = min(n - len(taken), len(free))
            if k:
                taken += free[len(free) - k :][::-1]
                del free[len(free) - k :]
        for lru in lrus:
            while len(taken) < n and lru:
                taken.append(self._evict_one(lru))
        self._refs[taken] = 1
        return taken

    def _evict_one(self, lru: collections.OrderedDict) -> int:
        page, _ = lru.popitem(last=False)
        self._cached[page] = False
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def ref(self, pages) -> None:
        """One more reference on each page (a page listed twice gets two); a cached page at zero
        references stops being evictable."""
        if len(pages) == 0:
            return
        pages = np.asarray(pages, np.int64)
        revived = pages[self._refs[pages] == 0]
        if (~self._cached[revived]).any():
            raise RuntimeError(f"page {int(revived[~self._cached[revived]][0])} is free: it has no holder to share it with")
        if len(revived):
            for lru, ps in self._lrus_of(revived):
                for p in ps:
                    lru.pop(p, None)
        np.add.at(self._refs, pages, 1)

    def free(self, pages) -> None:
        """Drop one reference on each page. Pages left with none go back to their devices' free
        lists (last page first, so the next allocation takes them back in their original order),
        or, if cached, become evictable (last page first: a prefix's deepest page is evicted first)."""
        if len(pages) == 0:
            return
        rev = np.asarray(pages, np.int64)[::-1]
        if (self._refs[rev] <= 0).any():
            raise RuntimeError(f"page {int(rev[self._refs[rev] <= 0][0])} freed with no reference held")
        np.subtract.at(self._refs, rev, 1)
        done = rev[self._refs[rev] == 0]
        if len(np.unique(done)) != len(done):  # listed twice: keep each page once
            _, first = np.unique(done, return_index=True)
            done = done[np.sort(first)]
        cached = self._cached[done]
        if cached.any():
            for lru, ps in self._lrus_of(done[cached]):
                lru.update(dict.fromkeys(ps))  # in order, as lru[p] = None page by page
            done = done[~cached]
        if len(done) == 0:
            return
        device, segment, _ = self.locate(done)
        group = device * 2 + segment
        for g in np.unique(group).tolist():
            (self._free_extra if g % 2 else self._free)[g // 2].extend(done[group == g].tolist())

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    def refs_of(self, pages) -> np.ndarray:
        """Reference counts of many pages (a switch copies a page held more than once only once)."""
        return self._refs[np.asarray(pages, np.int64)]

    # --- the prefix cache's side -------------------------------------------------------------
    def mark_cached(self, page: int) -> None:
        """The prefix cache now identifies this page (it must be referenced: being filled or held)."""
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} marked cached with no reference held")
        self._cached[page] = True

    def uncache(self, page: int) -> None:
        """The cache forgets a page (not an eviction: it was dropped as a whole, e.g. on reset)."""
        if not self._cached[page]:
            return
        self._cached[page] = False
        if self._refs[page] == 0:
            self._evictable[self._where(page)].pop(page, None)
            device, segment, _ = self.locate([page])
            (self._free_extra if segment[0] else self._free)[int(device[0])].append(page)

    def usage(self) -> list[DeviceUsage]:
        total = self.pages_per_device + self.extra_per_device
        return [DeviceUsage(d, total, self.num_free(d), self.num_cached(d)) for d in range(self.num_devices)]

    def check_invariants(self) -> None:
        """Every page is in exactly one state: free (listed once), referenced, or cached at zero
        references (evictable, listed once). Tests call this; it is O(pages)."""
        state = np.zeros(self.num_pages, np.int32)
        for lst in self._free + self._free_extra:
            np.add.at(state, np.asarray(lst, np.int64), 1)
        for q in self._evictable:
            np.add.at(state, np.fromiter(q.keys(), np.int64, count=len(q)), 1)
        if (state > 1).any():
            raise AssertionError(f"page {int(np.flatnonzero(state > 1)[0])} listed twice")
        listed = state == 1
        evictable = np.zeros(self.num_pages, bool)
        for q in self._evictable:
            evictable[np.fromiter(q.keys(), np.int64, count=len(q))] = True
        if (evictable & ~self._cached[: self.num_pages]).any():
            raise AssertionError(f"page {int(np.flatnonzero(evictable & ~self._cached)[0])} is evictable but not cached")
        if (listed & ~evictable & self._cached[: self.num_pages]).any():
            raise AssertionError(f"page {int(np.flatnonzero(listed & ~evictable & self._cached)[0])} is free but cached")
        refd = self._refs[: self.num_pages] > 0
        if (listed & refd).any():
            raise AssertionError(f"page {int(np.flatnonzero(listed & refd)[0])} is listed free but referenced")
        if (~listed & ~refd).any():
            raise AssertionError(f"page {int(np.flatnonzero(~listed & ~refd)[0])} is lost (no reference, not listed)")
        if (self._refs < 0).any():
            raise AssertionError("negative reference count")


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
