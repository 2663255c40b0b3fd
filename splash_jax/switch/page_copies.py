"""The page copies of a switch: queued per device pair as requests are planned, carried a chunk
at a time inside ordinary steps (`step_moves`), and the rest run by the standalone mover at the
handoff (`_copy`). `PageCopies` is a part of SwitchController (switch/controller.py), which owns
the queue state these methods keep."""

from __future__ import annotations

import numpy as np

from splash_jax.switch.copy_queue import PairQueues
from splash_jax.switch.handle import SwitchHandle
from splash_jax.switch.migration import PageChunk, chunk_buffer, locate_copies, move_sentinel, pack_located
from splash_jax.switch.planner import TransitionPlan

SHARED_CODE = -1  # the request code of the switch's own copies (of pages several requests share)


class PageCopies:
    """Copy queue and movers of SwitchController (see the module docstring)."""

    def step_moves(self):
        """The page copies the next step carries ([N, 4*N*K] index buffer), or None."""
        if self.active is None or not self.engine.executor.move_pages:
            return None
        handle, plan = self.active
        if handle._cancel:
            return None
        located = self._take(plan)
        if located.shape[1] == 0:
            return None
        (chunk,) = pack_located(located, self.engine.n, self.chunk_pages, move_sentinel(self.engine.allocator))
        handle.steps_overlapped += 1
        handle.pages_copied += chunk.count
        handle.bytes_moved += chunk.count * self.engine.page_bytes
        return chunk_buffer(chunk)

    def empty_moves(self) -> np.ndarray:
        """A moving step's index buffer that copies nothing (every receive slot dropped)."""
        return chunk_buffer(self._empty_chunk(self.chunk_pages))

    def _empty_chunk(self, k: int) -> PageChunk:
        n = self.engine.n
        zeros = np.zeros((n, n, k), np.int32)
        return PageChunk(zeros, zeros, np.full((n, n, k), move_sentinel(self.engine.allocator), np.int32), zeros, 0)

    def run_mover_once(self) -> None:
        """Run the handoff mover of the current pool structure on a chunk that copies nothing (at
        start-up, per layout): a program's first call takes jax's slow dispatch path (~2 ms on
        the H200 host), which otherwise lands on the first real handoff."""
        ex = self.engine.executor
        mover = self.movers[ex.kv_abstract(ex.layout).num_segments]
        chunk = self._empty_chunk(self.handoff_chunk_pages)
        ex.apply_to_pool(lambda kv: mover(kv, chunk))

    def _has_pending(self, plan: TransitionPlan) -> bool:
        """Copies still to run inside the steps (the held ones wait for the handoff)."""
        return len(self._queue) > 0 or any(self._queued.get(rid, 0) < p.ready_copies for rid, p in plan.requests.items())

    def _enqueue(self, plan: TransitionPlan, held_too: bool = False) -> None:
        """Queue every copy planned since the last call that may run now (the held ones of partly
        filled pages too if `held_too`: the handoff), located (one vectorized locate for all
        requests), in admission order within each device pair."""
        new, codes, counts = [], [], []
        for rid, p in plan.requests.items():
            have, upto = self._queued.get(rid, 0), (len(p.copies) if held_too else p.ready_copies)
            if have >= upto:
                continue
            if rid not in self._codes:
                self._codes[rid] = self._next_code
                self._next_code += 1
            new += p.copies[have:upto]
            codes.append(self._codes[rid])
            counts.append(upto - have)
            self._queued[rid] = upto
        shared = plan.shared.copies[self._shared_queued:]
        if shared:  # copies of shared pages belong to the switch, not to a request: never dropped
            new += shared
            codes.append(SHARED_CODE)
            counts.append(len(shared))
            self._shared_queued = len(plan.shared.copies)
        if new:
            self._queue.add(locate_copies(new, self.engine.allocator), np.repeat(np.array(codes, np.int64), counts))

    def _take(self, plan: TransitionPlan) -> np.ndarray:
        """The next copies ([6, M] located): the first chunk_pages waiting for each device pair."""
        self._enqueue(plan)
        return self._queue.take(self.chunk_pages)

    def _copy(self, handle: SwitchHandle, plan: TransitionPlan) -> None:
        """Run every pending copy now with the standalone mover (handoff: the last few pages)."""
        self._enqueue(plan, held_too=True)
        pending = self._queue.take()
        if pending.shape[1] == 0:
            return
        engine = self.engine
        ex = engine.executor
        mover = self.movers[ex.kv_abstract(ex.layout).num_segments]
        for chunk in pack_located(pending, engine.n, self.handoff_chunk_pages, move_sentinel(engine.allocator)):
            ex.apply_to_pool(lambda kv, chunk=chunk: mover(kv, chunk))
        moved = pending.shape[1]
        handle.pages_copied += moved
        handle.pages_at_handoff += moved
        handle.bytes_moved += moved * engine.page_bytes

    def _reset_queue(self) -> None:
        self._queue = PairQueues(self.engine.n)  # planned copies not yet run, per device pair
        self._queued: dict[str, int] = {}  # per planned request: how many of its copies were queued
        self._codes: dict[str, int] = {}  # per planned request: its code in the queues
        self._next_code = 0
        self._shared_queued = 0  # the switch's copies of shared pages queued so far

    def _forget(self, rid: str) -> None:
        """Drop a request's queued copies (it is no longer planned)."""
        self._queued.pop(rid, None)
        code = self._codes.pop(rid, None)
        if code is not None:
            self._queue.drop(code)
