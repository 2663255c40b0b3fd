"""Compiled programs shared within one process.

An engine built again with the same configuration (a notebook re-running its setup cell, a test's
reference engine beside the engine under test, a restart after an error) lowers the same
programs, and XLA would compile each again: jax caches compiles per traced function, and a new
engine traces new functions. Entries are keyed by the lowered module's text (shapes, shardings,
donations, memory kinds), the compile options and the devices, so one is only reused where XLA
would have compiled the same executable. Bounded (least recently used out); `clear()` drops all.
"""

from __future__ import annotations

import collections
import hashlib
import threading

MAX_ENTRIES = 256

_entries: collections.OrderedDict[tuple, object] = collections.OrderedDict()
_lock = threading.Lock()
stats = {"hits": 0, "compiles": 0}


def compile_lowered(lowered, options: dict | None, devices: tuple):
    """lowered.compile(compiler_options=options), or the executable an identical program got.
    devices: the ids (and platform) of the devices the program runs on."""
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), tuple(sorted((options or {}).items())), devices)
    with _lock:
        hit = _entries.get(key)
        if hit is not None:
            _entries.move_to_end(key)
            stats["hits"] += 1
            return hit
    compiled = lowered.compile(compiler_options=options or None)
    with _lock:
        _entries[key] = compiled
        stats["compiles"] += 1
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)
    return compiled


def clear() -> None:
    """Forget every entry (their executables are freed once no engine holds them)."""
    with _lock:
        _entries.clear()
