"""A switch as its caller sees it: its state and what it did (pages, bytes, steps, handoff time)."""

from __future__ import annotations

import dataclasses
import enum
import time


class SwitchState(enum.Enum):
    MIGRATING = "migrating"
    DONE = "done"
    CANCELLED = "cancelled"
    REFUSED = "refused"


@dataclasses.dataclass
class SwitchHandle:
    """What `engine.switch_layout` returns: progress now, metrics when done."""

    src: str
    dst: str
    state: SwitchState = SwitchState.MIGRATING
    reason: str | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)
    finished: float | None = None
    pages_planned: int = 0
    pages_copied: int = 0
    pages_at_handoff: int = 0  # copies the handoff itself ran (the rest rode inside steps)
    catch_ups: int = 0  # background rounds for pages filled during the copies
    weights_early: bool = False  # the changed weight leaves were resharded at the start, not the handoff
    bytes_moved: int = 0
    steps_overlapped: int = 0
    handoff_s: float = 0.0
    handoff_phases_ms: dict = dataclasses.field(default_factory=dict)  # where the handoff's host time went
    preempted: list[str] = dataclasses.field(default_factory=list)
    plan: dict = dataclasses.field(default_factory=dict)
    _cancel: bool = False

    def cancel(self) -> None:
        """Ask to stop before handoff; the engine stays in the source layout."""
        self._cancel = True

    @property
    def done(self) -> bool:
        return self.state != SwitchState.MIGRATING

    @property
    def progress(self) -> float:
        if self.done:
            return 1.0
        return self.pages_copied / self.pages_planned if self.pages_planned else 0.0

    @property
    def duration_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.started

    def as_dict(self) -> dict:
        return {
            "src": self.src, "dst": self.dst, "state": self.state.value, "reason": self.reason,
            "progress": self.progress, "pages_copied": self.pages_copied, "pages_at_handoff": self.pages_at_handoff,
            "catch_ups": self.catch_ups, "weights_early": self.weights_early, "bytes_moved": self.bytes_moved,
            "steps_overlapped": self.steps_overlapped, "duration_s": self.duration_s, "handoff_s": self.handoff_s,
            "handoff_phases_ms": dict(self.handoff_phases_ms), "preempted": list(self.preempted), "plan": self.plan,
        }
