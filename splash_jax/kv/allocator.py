"""Page allocator over a pool sharded by contiguous page ranges, one free list per device.

Device d owns global pages [d * pages_per_device, (d + 1) * pages_per_device). Layouts decide
which device's pages a request gets (its owner, all devices, or a stripe); this class only
hands out and takes back page ids, and answers capacity questions.
"""

from __future__ import annotations

import dataclasses


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
    def __init__(self, num_devices: int, pages_per_device: int, page_size: int):
        if pages_per_device < 1:
            raise ValueError(f"the KV pool has no pages (pages_per_device={pages_per_device})")
        self.num_devices = num_devices
        self.pages_per_device = pages_per_device
        self.page_size = page_size
        # Pop from the end; keep low ids first out for readable page tables.
        self._free = [
            list(range((d + 1) * pages_per_device - 1, d * pages_per_device - 1, -1)) for d in range(num_devices)
        ]

    @property
    def num_pages(self) -> int:
        return self.num_devices * self.pages_per_device

    def device_of(self, page: int) -> int:
        return page // self.pages_per_device

    def num_free(self, device: int = 0) -> int:
        return len(self._free[device])

    def allocate(self, n: int, device: int = 0) -> list[int]:
        free = self._free[device]
        if n > len(free):
            raise OutOfPages(f"device {device}: asked for {n} pages, {len(free)} free")
        taken = free[len(free) - n :][::-1]
        del free[len(free) - n :]
        return taken

    def free(self, pages: list[int]) -> None:
        for p in reversed(pages):
            self._free[self.device_of(p)].append(p)

    def usage(self) -> list[DeviceUsage]:
        return [DeviceUsage(d, self.pages_per_device, len(self._free[d])) for d in range(self.num_devices)]


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
