"""Stop strings over incrementally decoded text: where one ends, and what text may be shown yet."""

from __future__ import annotations


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def find_stop(text: str, stops: list[str], delta_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the newest delta: (cut position, the stop string)."""
    best = None
    window_start = max(0, len(text) - delta_len - max(len(s) for s in stops))
    for s in stops:
        idx = text.find(s, window_start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best
