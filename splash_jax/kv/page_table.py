"""Persistent per-slot page tables: what a step needs about a request's pages, kept up to date.

Every running request holds a slot (0 <= slot < max_num_seqs). For each (device d, pool segment
g, slot s) these numpy arrays describe the request's pages in position order:
  local_of[d, g, s, j]  local page id (within d's segment g) holding page index j, or -1
  before[d, g, s, j]    how many of the request's pages with index < j that (d, g) holds
  compact[d, g, s, m]   the m-th page (d, g) holds, in position order (the kernel's table row)
  count[d, g, s]        pages (d, g) holds
They change only when pages are added (append: O(M)) or a slot is cleared, so packing a step
is a few fancy-index gathers over the scheduled slots, never a rebuild from lists. With them, a
token at position p (page j = p // S) attends kv_len = before*S + (p % S + 1 if held) cached
positions in (d, g), and its latent goes to local_of (or is dropped when not held there).
"""

from __future__ import annotations

import itertools

import numpy as np

from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.placement import Placement

SEGMENTS = 2  # base + extra; a layout without the extra segment uses the first only


class PageTables:
    def __init__(self, num_devices: int, num_slots: int, pages_per_request: int):
        self.n, self.num_slots, self.m = num_devices, num_slots, pages_per_request
        shape = (num_devices, SEGMENTS, num_slots, pages_per_request)
        self.local_of = np.full(shape, -1, np.int32)
        self.before = np.zeros(shape, np.int32)
        self.compact = np.zeros(shape, np.int32)
        self.count = np.zeros(shape[:3], np.int32)
        self.entries = np.zeros((num_devices, num_slots), np.int32)  # len(device_pages[d]) per slot

    def clear(self, slot: int) -> None:
        self.local_of[:, :, slot] = -1
        self.before[:, :, slot] = 0
        self.compact[:, :, slot] = 0
        self.count[:, :, slot] = 0
        self.entries[:, slot] = 0

    def append(self, slot: int, device: int, pages: list[int], placement: Placement, allocator: PageAllocator) -> None:
        """Record pages just appended to `device_pages[device]` of the request in `slot` (a few array
        operations however many pages; a handoff rewrites whole slots with `rebuild_many`)."""
        if not len(pages):
            return
        _, segments, locals_ = allocator.locate(pages)
        segments, locals_ = np.asarray(segments, np.int64), np.asarray(locals_, np.int32)
        k0 = int(self.entries[device, slot])
        js = np.asarray(placement.page_index(device, np.arange(k0, k0 + len(locals_)), self.n))
        if js[-1] >= self.m:  # page_index grows with the entry
            raise ValueError(f"page index {int(js[-1])} exceeds the {self.m} pages a request may hold")
        self.local_of[device, segments, slot, js] = locals_
        for seg in np.unique(segments).tolist():
            mine = locals_[segments == seg]
            c = int(self.count[device, seg, slot])
            self.compact[device, seg, slot, c : c + len(mine)] = mine
            self.count[device, seg, slot] = c + len(mine)
            held = (self.local_of[device, seg, slot] >= 0).astype(np.int32)
            self.before[device, seg, slot] = np.cumsum(held) - held  # held pages with a smaller index
        self.entries[device, slot] = k0 + len(locals_)

    def rebuild(self, slot: int, device_pages: list[list[int]], placement: Placement, allocator: PageAllocator) -> None:
        """A request's pages changed wholesale (a layout switch): rewrite its slot."""
        self.rebuild_many([slot], [device_pages], placement, allocator)

    def rebuild_many(self, slots: list[int], device_pages: list[list[list[int]]], placement: Placement,
                     allocator: PageAllocator) -> None:
        """Several requests' pages changed wholesale (a handoff): rewrite their slots together, a
        few array operations per device for all of them (not per request)."""
        if not slots:
            return
        sl = np.asarray(slots, np.int64)
        if len(np.unique(sl)) != len(sl):
            raise ValueError("rebuild_many needs distinct slots")
        self.local_of[:, :, sl] = -1
        self.before[:, :, sl] = 0
        self.compact[:, :, sl] = 0
        self.count[:, :, sl] = 0
        self.entries[:, sl] = 0
        for d in range(self.n):
            lens = np.array([len(pages[d]) for pages in device_pages], np.int64)
            total = int(lens.sum())
            if total == 0:
                continue
            pages = np.fromiter(itertools.chain.from_iterable(request[d] for request in device_pages), np.int64, count=total)
            slot_of = np.repeat(sl, lens)
            entry = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)  # k within its request
            js = np.asarray(placement.page_index(d, entry, self.n))
            if js.max() >= self.m:
                raise ValueError(f"page index {int(js.max())} exceeds the {self.m} pages a request may hold")
            _, segs, locals_ = allocator.locate(pages)
            self.local_of[d, segs, slot_of, js] = locals_
            # compact: the m-th page of (segment, slot) in entry order (= position order)
            group = segs * self.num_slots + slot_of
            order = np.argsort(group, kind="stable")
            g = group[order]
            first = np.r_[True, g[1:] != g[:-1]]
            start = np.maximum.accumulate(np.where(first, np.arange(total), 0))
            self.compact[d, segs[order], slot_of[order], np.arange(total) - start] = locals_[order]
            self.count[d] += np.bincount(group, minlength=SEGMENTS * self.num_slots).reshape(SEGMENTS, self.num_slots).astype(np.int32)
            self.entries[d, sl] = lens
            held = (self.local_of[d][:, sl] >= 0).astype(np.int32)  # [segments, slots, M]
            self.before[d][:, sl] = np.cumsum(held, axis=-1) - held
