"""Running a test's engine another way for a moment (and always back)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def overlap(engine, on: bool):
    """The engine with overlapped scheduling on or off inside the block, on again after."""
    engine.set_overlap(on)
    try:
        yield engine
    finally:
        engine.set_overlap(True)


def generate_plain(engine, prompts, params):
    """engine.generate without overlapped scheduling (the reference an overlapped run must equal)."""
    with overlap(engine, False):
        return engine.generate(prompts, params)
