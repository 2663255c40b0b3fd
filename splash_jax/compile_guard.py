"""Counts JAX traces and compilations, to prove that nothing compiles after warm-up."""

from __future__ import annotations

import contextlib
import threading

from jax import monitoring

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_lock = threading.Lock()
_active: list["CompileCounter"] = []
_registered = False


class CompileCounter:
    def __init__(self):
        self.events: list[str] = []

    @property
    def count(self) -> int:
        return len(self.events)


def _listener(event: str, duration: float, **kwargs) -> None:
    if event in _EVENTS:
        with _lock:
            for counter in _active:
                counter.events.append(event)


@contextlib.contextmanager
def count_compiles():
    """`with count_compiles() as c: ...` then `c.count` is the number of traces + compiles inside."""
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_listener)
            _registered = True
        counter = CompileCounter()
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
