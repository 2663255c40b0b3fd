"""Per-step token masks of the constrained rows: one packed int32 bitmask per logits row
([rows, ceil(V / 32)], bit v of row i set = token v allowed), filled by llguidance's thread pool.

Rows without a grammar stay all ones, so one fixed-shape mask input serves every step and the
sampler programs never change with what a step's requests ask for.
"""

from __future__ import annotations

import time

import numpy as np


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class MaskBuilder:
    def __init__(self, vocab_size: int, threads: int | None = None):
        self.words = mask_words(vocab_size)
        self.threads = threads
        self._executor = None  # llguidance's thread pool, made on the first fill
        self.seconds = 0.0  # host time spent filling masks (stats: grammar host time per step)
        self.num_fills = 0
        self.num_rows = 0

    def open(self, rows: int) -> np.ndarray:
        return np.full((rows, self.words), -1, np.int32)

    def fill(self, rows: int, matchers: list, forced: list = ()) -> np.ndarray:
        """The [rows, words] mask with each (matcher, row) filled from its grammar's state and
        each (row, token) of `forced` allowing only that token (a spent reasoning budget)."""
        t = time.perf_counter()
        mask = self.open(rows)
        bits = mask.view(np.uint32)
        for row, token in forced:
            bits[row] = 0
            bits[row, token >> 5] = 1 << (token & 31)
        if matchers:
            import llguidance  # only structured outputs need it
            from llguidance.numpy import fill_next_token_bitmask_par

            if self._executor is None:
                self._executor = llguidance.LLExecutor(self.threads)
            fill_next_token_bitmask_par(self._executor, matchers, mask)
        self.seconds += time.perf_counter() - t
        self.num_fills += 1
        self.num_rows += len(matchers) + len(forced)
        return mask

    def summary(self) -> dict:
        return {"mask_fills": self.num_fills, "constrained_rows": self.num_rows, "mask_seconds": self.seconds,
                "mask_ms_per_fill": round(1e3 * self.seconds / self.num_fills, 4) if self.num_fills else 0.0}

