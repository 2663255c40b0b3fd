"""Page allocator over a pool sharded by contiguous page ranges, one free list per device.

The pool has a base segment and, while attention weights are head-sharded, an extra segment
made of the memory those weights no longer use. Global page ids:
  base : device d owns [d*B, (d+1)*B)
  extra: device d owns [N*B + d*E, N*B + (d+1)*E)
Layouts decide which devices a request's pages go to; this class hands out and takes back
ids (base pages first, so the extra segment empties easily) and answers capacity questions.
"""

from __future__ import annotations

import dataclasses

import numpy as np


class OutOfPages(RuntimeError):
    """The device has fewer free pages than asked for (callers preempt or wait)."""


@dataclasses.dataclass
class DeviceUsage:
    device: int
    total_pages: int
    free_pages: int

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

    def remove_extra_segment(self) -> None:
        if any(len(f) != self.extra_per_device for f in self._free_extra):
            raise RuntimeError("the extra segment still holds pages in use")
        self.extra_per_device = 0
        self._free_extra = [[] for _ in range(self.num_devices)]

    def extra_pages_in_use(self) -> int:
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

    # --- pages ----------------------------------------------------------------------------
    def num_free(self, device: int = 0) -> int:
        return len(self._free[device]) + len(self._free_extra[device])

    def num_free_base(self, device: int = 0) -> int:
        return len(self._free[device])

    def allocate(self, n: int, device: int = 0, base_only: bool = False) -> list[int]:
        """n pages of `device`, base segment first (only the base segment if `base_only`), in the
        order n calls of allocate(1) would give them."""
        base, extra = self._free[device], ([] if base_only else self._free_extra[device])
        if n > len(base) + len(extra):
            raise OutOfPages(f"device {device}: asked for {n} {'base ' if base_only else ''}pages, {len(base) + len(extra)} free")
        taken = []
        for free in (base, extra):
            k = min(n - len(taken), len(free))
            if k:
                taken += free[len(free) - k :][::-1]
                del free[len(free) - k :]
        return taken

    def free(self, pages) -> None:
        """Return pages to their devices' free lists (last page first, so the next allocation
        takes them back in their original order); one list extend per (device, segment)."""
        if len(pages) == 0:
            return
        rev = np.asarray(pages, np.int64)[::-1]
        device, segment, _ = self.locate(rev)
        group = device * 2 + segment
        for g in np.unique(group).tolist():
            (self._free_extra if g % 2 else self._free)[g // 2].extend(rev[group == g].tolist())

    def usage(self) -> list[DeviceUsage]:
        total = self.pages_per_device + self.extra_per_device
        return [DeviceUsage(d, total, self.num_free(d)) for d in range(self.num_devices)]


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
