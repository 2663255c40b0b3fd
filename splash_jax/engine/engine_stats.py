"""The engine's statistics in one dict (Engine.stats()): read by the server's metrics, the
policy's explanations, notebooks and benchmarks."""

from __future__ import annotations

import time


def prefix_cache_stats(engine) -> dict:
    """The prefix cache's counters (the scheduler keeps them while caching is off too)."""
    cache = engine.scheduler.cache
    if cache is None:
        return {"enabled": False, **engine.scheduler.cache_stats.as_dict(), "cached_pages": 0,
                "evictions": engine.allocator.num_evictions, "nodes": 0}
    return {"enabled": True, **cache.summary()}


def engine_stats(engine) -> dict:
    """What Engine.stats() reports: queue, pages, throughput, cache, layout, switches, compiles."""
    usage = engine.allocator.usage()
    window = [t for t in engine._recent if t[0] > time.monotonic() - 10]
    span = (window[-1][0] - window[0][0]) if len(window) > 1 else 0.0
    return {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "pages_total": sum(u.total_pages for u in usage),
        "pages_used": sum(u.used_pages for u in usage),
        "tokens_used": sum(u.used_pages for u in usage) * engine.config.page_size,
        "kv_capacity_tokens": engine.kv_capacity_tokens(),
        "per_device": [u.__dict__ for u in usage],
        "generation_tokens_per_s": (sum(n for _, n in window[1:]) / span) if span > 0 else 0.0,
        "num_steps": engine.num_steps,
        "num_preemptions": engine.scheduler.num_preemptions,
        "prefix_cache": prefix_cache_stats(engine),
        "layout": engine.layout.name,
        "switch": engine.switcher.active[0].as_dict() if engine.switcher and engine.switcher.active else None,
        "switches": len([h for h in engine.switcher.history if h.state.value == "done"]) if engine.switcher else 0,
        "switch_metrics": engine.switcher.metrics() if engine.switcher else None,
        "policy": engine.policy.summary() if engine.policy else None,
        "num_devices": engine.n,
        "overlap_scheduling": engine.config.overlap_scheduling,
        "step_failures": engine.num_step_failures,
        "device_wait_s": engine.device_wait_s,
        "host_phase_ms": dict(engine.host_phase_ms),  # step() wall time by phase, summed (Engine.last_step_ms)  # the loop blocked reading back tokens
        "compiled_programs": engine.executor.num_compiled,
        "compile_seconds": round(engine.executor.compile_seconds, 2),
        "compile": engine.executor.compile_stats.summary(),  # start-up compiles: programs, seconds, cache hits
        "program_memory": engine.executor.memory_summary(),  # XLA temporaries per step program, the largest
        "step_intervals": engine.timeline.summary(),  # cadence by step kind (engine/step_timeline.py)
        "late_dispatch": engine.dispatch_timing.summary(),  # waits for arrivals behind long steps (engine/dispatch_timing.py)
        # --max-step-ms-with-decodes (engine/step_time_cap.py): steps whose prefill it cut
        "step_time_cap": {"max_step_ms": engine.config.max_step_ms_with_decodes,
                          "capped_steps": cap.capped_steps if (cap := engine.scheduler.step_time_cap) else 0},
        "structured_outputs": engine.masks.summary(),
        # drafts proposed and accepted (engine/speculative.py); None with speculation off
        "speculative": (dict(engine.scheduler.spec_stats.summary(engine.config.speculative_method),
                             adaptive=engine.draft_budget.summary() if engine.draft_budget is not None else None,
                             # MTP steps whose drafts a draft program computed after them / their own step program
                             mtp_launches=({"draft_programs": engine.mtp.num_dispatched, "in_step": engine.mtp.num_in_step}
                                           if engine.mtp is not None else None))
                        if engine.config.speculative_k else None),  # grammar mask fills: count, rows, host ms per fill
    }
