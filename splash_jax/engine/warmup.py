"""Running every compiled program once at start-up, so the first real step of each kind pays no
first-run cost (CUDA graph capture, autotuning, allocations); `Engine.run_every_program_once`."""

from __future__ import annotations

import logging
import time

import jax

from splash_jax.engine.sampler import FULL_MODE, SAMPLER_MODES
from splash_jax.engine.step_packer import pack_step
from splash_jax.kv.page_copy import no_copies
from splash_jax.mesh.layouts import LAYOUT_NAMES

log = logging.getLogger(__name__)


def run_every_program_once(engine, full_sampler: bool = True) -> int:
    """Execute each compiled step program once on an all-padding step (no request; padding rows
    write no page a request owns), in every layout when switching, and end in the layout the engine
    started in. Returns the number of programs run (sampler and MTP draft programs included). Only while idle;
    the start-up switches it makes are not counted in the switch history. full_sampler=False: the
    greedy programs only (a caller that compiled only those)."""
    if engine.scheduler.running or engine.scheduler.waiting or engine._inflight is not None:
        raise RuntimeError("run_every_program_once needs an idle engine")
    start, t0, count, samplers = engine.layout.name, time.perf_counter(), 0, set()
    switcher = engine.switcher
    history = list(switcher.history) if switcher is not None else []
    # One device: every layout runs TP's programs (StepExecutor.program_layout), so one pass does.
    others = [n for n in LAYOUT_NAMES if n != start] if switcher is not None and engine.n > 1 else []
    policy, engine.policy = engine.policy, None  # no policy decision between these switches
    try:
        for name in [start] + others:
            switch_while_idle(engine, name)
            ex = engine.executor
            if switcher is not None:
                switcher.run_mover_once()
                count += 1
            ex.copy_pages(no_copies(engine.allocator))  # copy-on-write's page copy (kv/page_copy.py)
            count += 1
            moves = [None] + ([switcher.empty_moves()] if switcher is not None and ex.move_pages else [])
            for bucket in ex.buckets(engine.layout):
                for expanded in (False, True) if ex.expands(engine.layout, bucket) else (False,):
                    shape = ex.shape(engine.layout, bucket, expanded)
                    packed = pack_step(shape, [], engine.scheduler.tables, engine.slot_sampling, engine.config.page_size)
                    for move in moves if not expanded else [None]:
                        for full in (False, True) if full_sampler else (False,):
                            # a full step once per sampler mode, so every sampler program runs too
                            for mode in SAMPLER_MODES if full else (FULL_MODE,):  # greedy: no sampler program
                                out = ex.run(bucket, packed.rep, packed.dev, move, full, expanded, mode)
                                if full and ex.fuses(bucket, move is not None, expanded):
                                    # that ran the fused program; a deferred (grammar) step runs
                                    # the step that returns logits, then the sampler program
                                    ex.sample(ex.run(bucket, packed.rep, packed.dev, move, full, expanded, mode, defer=True), mode)
                                    count += 1
                                if full:
                                    samplers.add((shape.rows, mode))
                            count += 1
                            if engine.mtp is not None and move is None and not full:
                                # the (layout, bucket) draft programs (drafting, latents only), which serve every variant
                                for keep in (True, False):
                                    engine.mtp.arm(bucket, expanded, packed, [], engine.scheduler.tables, keep=keep)
                                    engine.mtp.fire(out.tokens)
                                    count += 1
                                if engine.mtp.takes_in_step(bucket) and not expanded:  # the step program with drafts inside
                                    ex.run(bucket, packed.rep, packed.dev, inline=engine.mtp.drafts_in_step(
                                        bucket, packed, [], engine.scheduler.tables))
                                    count += 1
                                engine.mtp.drop()  # nothing of warm-up's is read back
        switch_while_idle(engine, start)
        count += len(samplers)
    finally:
        engine.policy = policy
    jax.block_until_ready(engine.executor.pool)
    engine.executor.reset_sampling_state()  # padding rows leave no history or pending tokens behind
    if switcher is not None:
        switcher.history[:] = history
    log.info("ran %d step programs once each in %.1fs (first-run costs paid at start-up)", count, time.perf_counter() - t0)
    return count


def switch_while_idle(engine, name: str) -> None:
    if name == engine.layout.name:
        return
    handle = engine.switch_layout(name)
    while not handle.done:
        engine.step()  # idle: the handoff happens at this batch boundary
    if handle.state.value != "done":
        raise RuntimeError(f"switch to {name} while idle did not finish: {handle.state.value} ({handle.reason})")
