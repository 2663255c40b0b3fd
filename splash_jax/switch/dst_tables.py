"""The destination layout's page tables, built while a switch plans, adopted at its handoff.

Each time plans are made or extended (the start's slices, catch-up rounds, the handoff) the
destination pages planned since are appended to these tables in one call, so the handoff only
appends the last pages (rebuilding every running request's slot there took 1.4-3.9 ms of host
time on the H200 host at 64 requests x 64 pages, 2 devices). A plan's rows are its request's slot
(unchanged while the plan is current); rows of plans dropped since (finished, preempted) are
cleared before adoption.
"""

from __future__ import annotations

from collections.abc import Collection

from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.page_table import PageTables
from splash_jax.kv.placement import Placement
from splash_jax.switch.planner import RequestPlan


class DestinationTables:
    def __init__(self, like: PageTables, placement: Placement, allocator: PageAllocator):
        self.tables = PageTables(like.n, like.num_slots, like.m)
        self.placement, self.allocator = placement, allocator
        # per slot: (the plan whose pages its rows hold, its planned_pages then, its pages recorded per device)
        self._recorded: dict[int, tuple[RequestPlan, int, list[int]]] = {}

    def record(self, plans: Collection[RequestPlan]) -> None:
        """Append the destination pages planned since the last call (one append_many for all)."""
        slots, new = [], []
        for p in plans:
            slot = p.request.slot
            if slot < 0 or p.stale:
                continue  # no longer running, or its slot may be another request's: dropped before the handoff
            rec = self._recorded.get(slot)
            if rec is not None and rec[0] is p and rec[1] == p.planned_pages:
                continue  # nothing planned since
            have = rec[2] if rec is not None and rec[0] is p else None
            if rec is not None and have is None:
                self.tables.clear(slot)  # the rows of a plan dropped since
            have = have or [0] * len(p.dst_pages)
            slots.append(slot)
            new.append([pages[h:] for pages, h in zip(p.dst_pages, have)])
            self._recorded[slot] = (p, p.planned_pages, [len(pages) for pages in p.dst_pages])
        self.tables.append_many(slots, new, self.placement, self.allocator)

    def final(self, plans: Collection[RequestPlan]) -> PageTables:
        """The tables holding exactly `plans` (the handoff's): their last pages appended, the rows
        of every other plan recorded earlier cleared."""
        self.record(plans)
        live = {id(p) for p in plans}
        for slot, (p, _, _) in list(self._recorded.items()):
            if id(p) not in live:
                self.tables.clear(slot)
                del self._recorded[slot]
        return self.tables
