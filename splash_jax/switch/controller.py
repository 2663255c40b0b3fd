"""Runs a layout switch alongside decoding: background page copies, then a batch-boundary handoff.

Phases of a switch (engine.step() drives them; nothing here blocks the caller):
  migrating: each step carries up to `chunk_pages` page copies per device pair INSIDE the step
             program (StepExecutor's `moving` variant: an all_to_all XLA runs beside the
             forward pass), so the moves cost no separate program the next step waits on.
             Only full pages are copied here: decode writes only at or after a request's last
             position, so a full page never changes again.
  handoff  : at the batch boundary after the background copies are done, right after the next
             step is dispatched (it still runs the source layout, so the handoff's host work
             overlaps its device time instead of leaving the device idle): plans extend to
             every page holding data (the partial last pages, requests admitted meanwhile), those
             few copies run (queued after that step), then page tables, owners, the pool's extra
             segment, the weights and the step executable change together.
A request that finishes or is preempted during the window drops its plan (its reserved pages
are freed). `cancel()` before handoff frees every reservation: the source layout is untouched.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections import Counter

import jax
import numpy as np

from splash_jax.kv.allocator import OutOfPages, pages_for_tokens
from splash_jax.mesh.layouts import Layout, get_layout
from splash_jax.switch.handle import SwitchHandle, SwitchState  # noqa: F401  (re-exported: tests, the engine)
from splash_jax.switch.migration import PageMover, WeightResharder, drop_extra_segment
from splash_jax.switch.page_copies import PageCopies
from splash_jax.switch.weight_moves import WeightMoves, _delete_replaced
from splash_jax.switch.programs import MOVER_LAYOUTS, handoff_chunk_pages, lower_extra_segment, weight_reshards

from splash_jax.switch.dst_tables import DestinationTables
from splash_jax.switch.planner import (
    SwitchRefused,
    TransitionPlan,
    capacity_check,
    choose_owner,
    pages_to_free,
    plan_request,
    plan_requests,
    plan_weights,
)

log = logging.getLogger(__name__)


class SwitchController(PageCopies, WeightMoves):
    """Owns the migration programs (compiled at start-up) and the switch in progress."""

    def __init__(self, engine, chunk_pages: int = 8, plan_pages: int = 1024):
        self.engine = engine
        self.chunk_pages = chunk_pages
        self.plan_pages = max(1, plan_pages)  # pages planned per batch boundary (see _plan_some)
        self._unplanned: collections.deque = collections.deque()  # (request, owner) the switch has yet to plan
        self._reset_queue()
        self.handoff_chunk_pages = self._handoff_chunk_pages()  # the handoff mover's compiled K
        ex = engine.executor
        layouts = [get_layout(n) for n in MOVER_LAYOUTS]  # one without and one with the extra segment
        self.movers = {}
        self.resharder = WeightResharder(engine.mesh)
        with ex.compile_stats.track("migration") as rec:  # the programs switch/programs.py enumerates
            for lay in layouts:
                structure = ex.kv_abstract(lay).num_segments
                if structure not in self.movers:
                    self.movers[structure] = PageMover(engine.mesh, ex.kv_abstract(lay), self.handoff_chunk_pages)
            for abstracts, src, dst in weight_reshards(ex):
                self.resharder.program(abstracts, src, dst)
            lowered = lower_extra_segment(engine.mesh, ex)
            self._make_extra = None if lowered is None else lowered.compile()
            rec["programs"] = len(self.movers) + len(self.resharder._programs) + (self._make_extra is not None)
        log.info("compiled %d migration programs in %.1fs (%d from the persistent cache)",
                 rec["programs"], rec["seconds"], rec["cache_hits"])
        self.active: tuple[SwitchHandle, TransitionPlan] | None = None
        # The last handoff's source pages the destination did not keep, freed one batch boundary
        # later (see _free_later): (handle, those pages).
        self._to_free: tuple[SwitchHandle, np.ndarray] | None = None
        # The params as the destination places them, resharded at the switch's start when memory
        # allows (the sources stay until the handoff); None: resharded at the handoff.
        self._prepared: list | None = None
        self._dst_tables: DestinationTables | None = None  # the switch's destination page tables, built as it plans
        self._spec_cache: dict[str, list] = {}  # per layout: every param leaf's spec (see _specs)
        self._leaf_bytes_cache: dict[tuple[str, int], int] = {}  # (layout, leaf) -> bytes per device
        self.max_catch_ups = 2  # background rounds for pages filled during the copies (see _catch_up)
        self.history: list[SwitchHandle] = []

    # --- API -------------------------------------------------------------------------------------
    def start(self, dst_name: str, preempt: bool = False) -> SwitchHandle:
        engine = self.engine
        dst = get_layout(dst_name)
        src = engine.layout
        handle = SwitchHandle(src.name, dst.name)
        if self.active is not None:
            return self._refuse(handle, f"a switch {self.active[0].src}->{self.active[0].dst} is already in progress")
        if dst.name == src.name:
            handle.state, handle.finished = SwitchState.DONE, time.perf_counter()
            return handle
        self.free_deferred()
        sched = engine.scheduler
        dst_pages = self._pages_per_device(dst)
        load: Counter = Counter()  # pages given to each device so far
        owners = {}
        for r in sorted(sched.running, key=lambda r: r.order):
            owners[r.request_id] = choose_owner(r, src, dst, engine.n, load, engine.config.page_size, dst_pages)
            load[owners[r.request_id]] += self._pages_of(r)
        reason = capacity_check(sched.running, dst, engine.allocator, dst_pages, engine.config.page_size, owners,
                                    src.kv_placement)
        while reason and preempt and sched.running:
            victim = max(sched.running, key=lambda r: r.order)
            sched.preempt(victim)
            handle.preempted.append(victim.request_id)
            owners.pop(victim.request_id, None)
            reason = capacity_check(sched.running, dst, engine.allocator, dst_pages, engine.config.page_size, owners,
                                    src.kv_placement)
        if reason:
            return self._refuse(handle, reason)
        params = [(p, x.nbytes) for p, x in engine.executor.param_items()]
        plan = TransitionPlan(
            src, dst, {}, plan_weights(params, src, dst),
            "add" if dst.heads_sharded and not src.heads_sharded else ("remove" if src.heads_sharded and not dst.heads_sharded else "keep"),
            engine.page_bytes,
        )
        self._reset_queue()
        self._dst_tables = DestinationTables(sched.tables, dst.kv_placement, engine.allocator)
        self._unplanned = collections.deque((r, owners[r.request_id]) for r in sorted(sched.running, key=lambda r: r.order))
        try:
            self._plan_some(plan)  # the first requests now; the rest at the next boundaries
        except (OutOfPages, SwitchRefused) as e:
            self._release(plan)
            return self._refuse(handle, f"not enough free pages to stage the switch: {e}")
        handle.pages_planned = plan.num_copies
        handle.plan = plan.summary()
        self._prepared = self._resharded_weights(dst, keep_sources=True) if self._room_for_both_weights(plan) else None
        handle.weights_early = self._prepared is not None
        self.active = (handle, plan)
        log.info("switch %s -> %s started: %s", src.name, dst.name, handle.plan)
        return handle

    def _pages_per_device(self, dst: Layout) -> int:
        """Pages each device holds under `dst` (its base segment, plus the extra one if head-sharded)."""
        return self.engine.allocator.pages_per_device + (self.engine.extra_pages if dst.heads_sharded else 0)

    def _pages_of(self, request) -> int:
        """Pages a request needs, counting the token its next step writes (as capacity_check does)."""
        return pages_for_tokens(request.num_tokens + 1, self.engine.config.page_size)

    def _handoff_chunk_pages(self) -> int:
        """Pages per device pair in one call of the handoff's mover (switch/programs.py)."""
        engine = self.engine
        return handoff_chunk_pages(self.chunk_pages, engine.config.max_num_seqs, engine.n, engine.page_bytes)

    def metrics(self) -> dict:
        """Totals over finished switches, and the last one."""
        done = [h for h in self.history if h.state == SwitchState.DONE]
        return {
            "count": len(done),
            "refused": sum(h.state == SwitchState.REFUSED for h in self.history),
            "cancelled": sum(h.state == SwitchState.CANCELLED for h in self.history),
            "bytes_moved": sum(h.bytes_moved for h in done),
            "duration_s": sum(h.duration_s or 0.0 for h in done),
            "steps_overlapped": sum(h.steps_overlapped for h in done),
            "last": self.history[-1].as_dict() if self.history else None,
        }

    # --- driven by engine.step() -----------------------------------------------------------------
    def before_step(self) -> None:
        """Before scheduling: give back the reservations of requests gone since, or cancel."""
        if self.active is None:
            return
        handle, plan = self.active
        self._drop_stale(plan)
        if handle._cancel:
            self._release(plan)
            self._finish(handle, SwitchState.CANCELLED)

    @property
    def has_deferred_work(self) -> bool:
        return self._to_free is not None

    def hand_off_if_ready(self) -> None:
        """After a step is dispatched (the batch boundary): hand off once the background copies
        are done. The step just queued runs in the source layout while this host work runs. The
        boundary after a handoff frees the source pages it did not keep."""
        if self.active is None:
            self.free_deferred()
            return
        handle, plan = self.active
        if handle._cancel:
            return
        if self._unplanned:
            try:
                self._plan_some(plan)
            except (OutOfPages, SwitchRefused) as e:
                self._release(plan)
                handle.reason = f"not enough free pages to stage the switch: {e}"
                log.warning("switch %s -> %s refused while planning: %s", handle.src, handle.dst, handle.reason)
                self._finish(handle, SwitchState.REFUSED)
                return
            handle.pages_planned = plan.num_copies
            return
        if self._has_pending(plan):
            return
        self._drop_stale(plan)  # scheduling may have preempted some since before_step
        if self.engine.executor.move_pages and handle.catch_ups < self.max_catch_ups and self._catch_up(plan):
            handle.catch_ups += 1
            handle.pages_planned = plan.num_copies
            return  # the pages filled since planning are copied by the next steps
        self._handoff(handle, plan)

    def _catch_up(self, plan: TransitionPlan) -> bool:
        """Extend the planned requests to the full pages they wrote since planning, so background
        steps copy them and the handoff copies about one partial page per request (one mover call
        instead of several: 1-6 ms of host time at a handoff on the H200 host). Requests admitted
        meanwhile are left to the handoff (reserving their pages early would crowd the source
        layout into preempting). True if copies the steps may run were added (a page held as
        partly filled becomes one once the request writes past it). Out of pages: stop here (the
        handoff preempts)."""
        ready = lambda: sum(p.ready_copies for p in plan.requests.values())  # noqa: E731
        before = ready()
        try:
            self._extend_plans(plan, full_pages_only=True)
        except (OutOfPages, SwitchRefused):
            pass
        self._dst_tables.record(plan.requests.values())
        return ready() > before

    # --- internals ---------------------------------------------------------------------------------
    def _plan_some(self, plan: TransitionPlan) -> None:
        """Plan the next requests in admission order, about `plan_pages` pages' worth (every page
        with data; a partly filled last page is held for the handoff), and queue their copies
        (located now, so a moving step only slices). Planning is ~0.1 ms per request on the CPU
        host, so a whole batch at once could cost one boundary 5-35 ms; in slices the copies of
        the first requests ride the steps while the rest are planned. Requests no longer running
        are skipped (the handoff plans any that run again); one preempted and admitted again
        meanwhile is planned from its new pages."""
        engine = self.engine
        running = {r.request_id: r for r in engine.scheduler.running}
        budget, items = self.plan_pages, []
        while self._unplanned and budget > 0:
            r, owner = self._unplanned.popleft()
            if running.get(r.request_id) is not r or r.request_id in plan.requests:
                continue
            items.append((r, owner, r.num_stable, None))  # drafts awaiting verification are not final
            budget -= pages_for_tokens(r.num_stable, engine.config.page_size)
        if not self._plan_at_once(plan, items):
            for r, owner, upto, _ in items:
                plan.requests[r.request_id] = plan_request(
                    r, plan.src, plan.dst, engine.allocator, base_only=not plan.dst.heads_sharded, owner=owner,
                    upto_tokens=upto, shared=plan.shared,
                )
        self._enqueue(plan)
        self._dst_tables.record(plan.requests.values())

    def _drop_stale(self, plan: TransitionPlan) -> None:
        """Requests that finished or were preempted since planning (even if admitted again: their
        source pages were freed and may belong to others now): give back their reservations."""
        running = {r.request_id for r in self.engine.scheduler.running}
        for rid in [rid for rid, p in plan.requests.items() if rid not in running or p.stale]:
            self.engine.allocator.free(plan.requests.pop(rid).reserved)
            self._forget(rid)

    def _release(self, plan: TransitionPlan) -> None:
        for p in plan.requests.values():
            self.engine.allocator.free(p.reserved)
        self._drop_shared(plan)
        plan.requests.clear()
        self._unplanned.clear()
        self._dst_tables = None
        if self._prepared is not None:  # resharded weights the cancelled switch no longer needs
            _delete_replaced(self._prepared, self.engine.executor.params)
            self._prepared = None
        self._reset_queue()

    def _drop_shared(self, plan: TransitionPlan) -> None:
        """Drop the switch's own references on its copies of shared pages (after the handoff ran
        them, or on cancel); requests that use them keep theirs."""
        self.engine.allocator.free(plan.shared.held())
        plan.shared.copies.clear()
        plan.shared.dst_of.clear()

    def _handoff(self, handle: SwitchHandle, plan: TransitionPlan) -> None:
        engine, t0 = self.engine, time.perf_counter()
        sched, src, dst = engine.scheduler, plan.src, plan.dst
        last = [t0]

        def phase(name: str) -> None:
            now = time.perf_counter()
            handle.handoff_phases_ms[name] = (now - last[0]) * 1e3
            last[0] = now

        # Steps are still queued on the device. Buffers the handoff deletes (resharded weight
        # leaves, the extra segment) are freed only once those steps are done, so the device is
        # waited for only when the new buffers would not fit beside them (the wait costs up to two
        # steps); deleting a buffer a queued program still reads is safe (PjRt frees it after).
        if self._must_wait_for_memory(plan):
            jax.block_until_ready((engine.executor.pool, engine.executor.params))
        phase("wait_for_device")
        # 1. Extend plans to every page holding data (and plan requests admitted meanwhile).
        self._extend_plans(plan, full_pages_only=False, preempted=handle.preempted)
        phase("extend_plans")
        self._copy(handle, plan)
        phase("copy_last_pages")
        # 2. Page tables and owners change; pages the destination does not keep are freed, at
        #    the next boundary when the pool has room (see _free_later).
        sched.set_placement(dst.kv_placement)
        to_free = pages_to_free(plan.requests.values(), src)
        later = self._free_later(plan)
        if not later:
            plan.pages_freed = self._free_pages(to_free)
        ex = engine.executor
        phase("free_pages")
        # 3. Pool segment and weights, in the order that never needs both memories at once.
        if plan.extra_segment == "remove":
            plan.cached_evicted = engine.allocator.remove_extra_segment()  # cached pages held by no request there
            ex.apply_to_pool(drop_extra_segment)
        early = self._prepared is not None
        params = self._prepared if early else self._resharded_weights(dst)
        self._prepared = None
        if early:  # the sources the source layout's steps read until now (freed once those are done)
            _delete_replaced(ex.params, params)
        kv = ex.pool
        if plan.extra_segment == "add" and self._make_extra is not None:
            extra_latent, extra_rope = self._make_extra()
            kv = dataclasses.replace(kv, extra_latent=extra_latent, extra_rope=extra_rope)
            engine.allocator.add_extra_segment(engine.extra_pages)
        phase("pool_and_weights")
        # 4. The page tables built while planning (plus the last pages) replace the source's; then
        #    the executor's params, pool and layout change together.
        tables = self._dst_tables.final(plan.requests.values())
        self._dst_tables = None
        sched.replace_pages([(p.request, p.dst_pages, p.owner) for p in plan.requests.values()], tables)
        if sched.cache is not None:  # the moved requests' cached pages are named where they now are too
            for p in plan.requests.values():
                sched.cache.register(p.request, dst.kv_placement)
        handle.plan = plan.summary()  # before the switch's own references go
        self._drop_shared(plan)
        plan.cached_pages = engine.allocator.num_cached()
        ex.swap(dst, params, kv)
        engine.layout = dst
        phase("page_tables")
        handle.handoff_s = time.perf_counter() - t0
        handle.plan.update(cached_pages_kept=plan.cached_pages, cached_pages_evicted=plan.cached_evicted)
        if later:
            handle.plan["pages_freed"] = None  # counted at the next boundary
            self._to_free = (handle, to_free)
        self._finish(handle, SwitchState.DONE)
        log.info("switch %s -> %s done: %s", src.name, dst.name, handle.as_dict())

    def _extend_plans(self, plan: TransitionPlan, full_pages_only: bool, preempted: list[str] | None = None) -> None:
        """Extend the planned requests to their full pages (catch-up), or every running request to
        every page holding data, planning those admitted since the switch started (handoff). Out of pages:
        with `preempted` (the handoff) the newest request is preempted (recomputed later, nothing
        lost) and the loop goes on; otherwise the error propagates."""
        engine, sched, src, dst = self.engine, self.engine.scheduler, plan.src, plan.dst
        page_size = engine.config.page_size
        todo = self._to_extend(plan, full_pages_only)
        lead = next((i for i, (_, _, existing) in enumerate(todo) if existing is None), len(todo))
        if lead and self._plan_at_once(plan, [(r, e.owner, upto, e) for r, upto, e in todo[:lead]]):
            todo = todo[lead:]  # the extensions of existing plans before the first new one, at once
        if not todo:
            return
        dst_pages = self._pages_per_device(dst)
        load: Counter = Counter()  # pages per owner, as in start()
        for p in plan.requests.values():
            load[p.owner] += self._pages_of(p.request)
        for r, upto, _ in todo:
            if r not in sched.running:
                continue  # preempted below to make room for an earlier request
            while True:
                try:
                    existing = plan.requests.get(r.request_id)
                    owner = existing.owner if existing else choose_owner(r, src, dst, engine.n, load, page_size, dst_pages)
                    plan.requests[r.request_id] = plan_request(
                        r, src, dst, engine.allocator, base_only=not dst.heads_sharded, owner=owner,
                        upto_tokens=upto, existing=existing, shared=plan.shared,
                    )
                    if existing is None:
                        load[owner] += self._pages_of(r)
                    break
                except (OutOfPages, SwitchRefused):
                    if preempted is None:
                        raise
                    # No room to finish the plan: recompute the newest request later (nothing is lost).
                    victim = max(sched.running, key=lambda q: q.order)
                    if victim.request_id in plan.requests:
                        engine.allocator.free(plan.requests.pop(victim.request_id).reserved)
                        self._forget(victim.request_id)
                    sched.preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is r:
                        break

    def _to_extend(self, plan: TransitionPlan, full_pages_only: bool) -> list[tuple]:
        """(request, tokens to plan, its plan or None) for each running request with pages to plan,
        in admission order; a held last page that is full now is released on the way."""
        page_size = self.engine.config.page_size
        todo = []
        for r in sorted(self.engine.scheduler.running, key=lambda r: r.order):
            # steps copy only pages that are final (num_stable: not holding drafts a verify step may reject)
            upto = (r.num_stable // page_size) * page_size if full_pages_only else r.num_computed
            existing = plan.requests.get(r.request_id)
            if full_pages_only and existing is None:
                continue  # admitted since the switch started: planned at the handoff, as before
            held = existing is not None and existing.held_from is not None
            if held and r.num_stable >= existing.planned_pages * page_size:
                existing.held_from = None  # the held last page is full now (dispatched steps wrote it): steps may copy it
            if existing is not None and pages_for_tokens(upto, page_size) <= existing.planned_pages:
                continue  # nothing new to plan (a held, partly filled last page is copied at the handoff)
            todo.append((r, upto, existing))
        return todo

    def _plan_at_once(self, plan: TransitionPlan, items: list) -> bool:
        """Plan `items` ((request, owner, tokens, plan to extend or None)) with one plan_requests
        call. False, with nothing changed, when some device lacks the pages for all of them: the
        caller then plans them one at a time (preempting or failing where the first does not fit)."""
        try:
            plans = plan_requests(items, plan.src, plan.dst, self.engine.allocator, base_only=not plan.dst.heads_sharded,
                                  shared=plan.shared)
        except OutOfPages:
            return False
        for p in plans:
            plan.requests[p.request.request_id] = p
        return True

    def _free_later(self, plan: TransitionPlan) -> bool:
        """Whether the handoff leaves freeing the source pages to the next batch boundary (0.5-1.6
        ms of host time on the H200 host, taken off the handoff's boundary): not when the extra
        segment goes (its pages must be free first), nor when some device has fewer free pages than
        the next step could ask for (one per running request plus a full token budget), so no
        request is preempted for want of pages that are about to be freed."""
        if plan.extra_segment == "remove":
            return False
        engine = self.engine
        cfg = engine.config
        need = len(engine.scheduler.running) + pages_for_tokens(cfg.max_num_batched_tokens, cfg.page_size)
        return all(engine.allocator.num_free(d) >= need for d in range(engine.n))

    def _free_pages(self, to_free: np.ndarray) -> int:
        self.engine.allocator.free(to_free)
        return len(to_free)

    def free_deferred(self) -> None:
        """Free the last handoff's source pages that its destination did not keep, if still
        pending (found at the handoff: pages the destination allocated since were free then, so
        they are never among them)."""
        if self._to_free is not None:
            handle, to_free = self._to_free
            self._to_free = None
            handle.plan["pages_freed"] = self._free_pages(to_free)

    def _finish(self, handle: SwitchHandle, state: SwitchState) -> None:
        handle.state, handle.finished = state, time.perf_counter()
        self.active = None
        self.history.append(handle)

    def _refuse(self, handle: SwitchHandle, reason: str) -> SwitchHandle:
        log.warning("switch %s -> %s refused: %s", handle.src, handle.dst, reason)
        handle.reason = reason
        self._finish(handle, SwitchState.REFUSED)
        return handle
