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
        operations however many pages; a switch records its destination's pages with `append_many`)."""
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

    def append_many(self, slots: list[int], device_pages: list[list[list[int]]], placement: Placement,
                    allocator: PageAllocator) -> None:
        """Record pages appended to several requests at once: `device_pages[i][d]` were just appended
        to device d's list of the request in `slots[i]`. A few array operations over every device
        and request (a switch builds the destination's tables this way while it plans, so its
        handoff only adds the last pages: rebuilding every slot there took 1.4-3.9 ms of host time
        on the H200 host at 64 requests x 64 pages, 2 devices)."""
        if not slots:
            return
        sl = np.asarray(slots, np.int64)
        if len(np.unique(sl)) != len(sl):
            raise ValueError("append_many needs distinct slots")
        runs = np.fromiter((len(p) for pages in device_pages for p in pages), np.int64, count=len(slots) * self.n)
        total = int(runs.sum())
        if total == 0:
            return
        chain = itertools.chain.from_iterable
        pages = np.fromiter(chain(chain(device_pages)), np.int64, count=total)
        first = np.repeat(np.cumsum(runs) - runs, runs)  # where each page's (request, device) run starts
        dev = np.repeat(np.tile(np.arange(self.n), len(sl)), runs)
        slot_of = np.repeat(sl, runs.reshape(len(sl), self.n).sum(axis=1))
        entry = self.entries[dev, slot_of] + (np.arange(total) - first)  # k in the device's whole list
        js = np.asarray(placement.page_index(dev, entry, self.n))
        if js.max() >= self.m:
            raise ValueError(f"page index {int(js.max())} exceeds the {self.m} pages a request may hold")
        _, segs, locals_ = allocator.locate(pages)
        self.local_of[dev, segs, slot_of, js] = locals_
        # compact: after the pages (device, segment, slot) holds, in entry order; a run holds one
        # (request, device)'s new pages, so a page's rank is a count within its run of its segment.
        extra_upto = np.cumsum(segs)
        extra_upto -= extra_upto[first] - segs[first]  # extra pages in the run up to this one
        rank = np.where(segs == 1, extra_upto - 1, np.arange(total) - first - extra_upto)
        self.compact[dev, segs, slot_of, self.count[dev, segs, slot_of] + rank] = locals_
        group = (dev * SEGMENTS + segs) * self.num_slots + slot_of
        self.count += np.bincount(group, minlength=self.count.size).reshape(self.count.shape).astype(np.int32)
        self.entries += np.bincount(dev * self.num_slots + slot_of, minlength=self.entries.size).reshape(
            self.entries.shape).astype(np.int32)
        held = (self.local_of[:, :, sl] >= 0).astype(np.int32)  # [devices, segments, slots, M]
        self.before[:, :, sl] = np.cumsum(held, axis=-1, dtype=np.int32) - held  # int32: 16x faster than int64 here
