"""What start-up compiled: programs, wall seconds and persistent-cache hits, per kind of program.

Cache hits are counted from jax's monitoring events (`/jax/compilation_cache/cache_hits`), which
fire in whichever thread compiles, so parallel compiles are counted too. The counters are
process-wide: two engines compiling at the same moment would see each other's hits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

from jax import monitoring

_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_hits = 0
_registered = False


def _listener(event: str, **kwargs) -> None:
    global _hits
    if event == _HIT:
        with _lock:
            _hits += 1


def _cache_hits() -> int:
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_listener(_listener)
            _registered = True
        return _hits


@dataclasses.dataclass
class CompileStats:
    programs: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    by_kind: dict = dataclasses.field(default_factory=dict)  # kind -> {"programs", "seconds", "cache_hits"}

    @contextlib.contextmanager
    def track(self, kind: str):
        """`with stats.track("steps") as rec: ...; rec["programs"] += n` adds that block's time and hits."""
        rec = {"programs": 0, "seconds": 0.0, "cache_hits": 0}
        hits0, t0 = _cache_hits(), time.perf_counter()
        try:
            yield rec
        finally:
            rec["seconds"] = time.perf_counter() - t0
            rec["cache_hits"] = _cache_hits() - hits0
            self.programs += rec["programs"]
            self.seconds += rec["seconds"]
            self.cache_hits += rec["cache_hits"]
            total = self.by_kind.setdefault(kind, {"programs": 0, "seconds": 0.0, "cache_hits": 0})
            for k in total:
                total[k] += rec[k]

    def summary(self) -> dict:
        return {
            "programs": self.programs, "seconds": round(self.seconds, 2), "cache_hits": self.cache_hits,
            "by_kind": {k: dict(v, seconds=round(v["seconds"], 2)) for k, v in self.by_kind.items()},
        }
