"""The page copies a switch still has to run, one FIFO per device pair.

A moving step carries at most K pages per (source device, destination device) pair, so the
copies wait in one queue per pair and a step takes the first K of each: a few array slices per
step whatever the number of requests (walking the requests and their copies in Python cost
0.4 ms per step at 2 devices and 2-4 ms at 8 on the CPU mesh's host, inside steps that have
~1-2 ms of host time to spare on the H200 host). Copies are kept located (device, segment and
local id of both ends), so packing a step's index buffer needs no allocator lookups.
"""

from __future__ import annotations

import numpy as np

LOCATED_ROWS = 6  # source device, segment, local id; destination device, segment, local id
_REQUEST_ROW = LOCATED_ROWS  # a seventh row in the queues: which request the copy belongs to


class PairQueues:
    """Queued copies per device pair ([7, m] int64 each: the located rows, then a request code)."""

    def __init__(self, num_devices: int):
        self.n = num_devices
        self._queues = [np.zeros((LOCATED_ROWS + 1, 0), np.int64) for _ in range(num_devices * num_devices)]
        self._heads = [0] * (num_devices * num_devices)

    def __len__(self) -> int:
        return sum(q.shape[1] - h for q, h in zip(self._queues, self._heads))

    def add(self, located: np.ndarray, request_codes: np.ndarray) -> None:
        """Append copies ([6, m] located, in the order they should run) with their request codes."""
        if located.shape[1] == 0:
            return
        rows = np.concatenate([located, np.asarray(request_codes, np.int64)[None]])
        pair = located[0] * self.n + located[3]
        order = np.argsort(pair, kind="stable")
        bounds = np.searchsorted(pair[order], np.arange(self.n * self.n + 1))
        for p in np.flatnonzero(np.diff(bounds)):
            new = rows[:, order[bounds[p]:bounds[p + 1]]]
            self._queues[p] = np.concatenate([self._queues[p][:, self._heads[p]:], new], axis=1)
            self._heads[p] = 0

    def drop(self, request_code: int) -> int:
        """Forget a request's queued copies (it finished or was preempted). Returns how many."""
        dropped = 0
        for p, (q, h) in enumerate(zip(self._queues, self._heads)):
            keep = q[_REQUEST_ROW, h:] != request_code
            if not keep.all():
                dropped += int((~keep).sum())
                self._queues[p], self._heads[p] = q[:, h:][:, keep], 0
        return dropped

    def take(self, k: int | None = None) -> np.ndarray:
        """Remove and return the first k copies of every pair (all of them if k is None), [6, m]."""
        parts = []
        for p, (q, h) in enumerate(zip(self._queues, self._heads)):
            stop = q.shape[1] if k is None else min(q.shape[1], h + k)
            if stop > h:
                parts.append(q[:LOCATED_ROWS, h:stop])
                self._heads[p] = stop
        return np.concatenate(parts, axis=1) if parts else np.zeros((LOCATED_ROWS, 0), np.int64)
