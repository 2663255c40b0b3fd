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
        """Record pages just appended to `device_pages[device]` of the request in `slot`."""
        if not pages:
            return
        _, segments, locals_ = allocator.locate(pages)
        for seg, local in zip(segments.tolist(), locals_.tolist()):
            k = int(self.entries[device, slot])
            j = placement.page_index(device, k, self.n)
            if j >= self.m:
                raise ValueError(f"page index {j} exceeds the {self.m} pages a request may hold")
            c = int(self.count[device, seg, slot])
            self.local_of[device, seg, slot, j] = local
            self.compact[device, seg, slot, c] = local
            self.count[device, seg, slot] = c + 1
            self.before[device, seg, slot, j + 1 :] += 1
            self.entries[device, slot] = k + 1

    def rebuild(self, slot: int, device_pages: list[list[int]], placement: Placement, allocator: PageAllocator) -> None:
        """A request's pages changed wholesale (a layout switch): rewrite its slot."""
        self.clear(slot)
        for d, pages in enumerate(device_pages):
            self.append(slot, d, pages, placement, allocator)
