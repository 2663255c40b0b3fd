"""Probe: where a drafting n-gram step's time goes in each --speculative-ngram-drafts mode.

    python -m benchmarks.probes.ngram_drafts_host                            # bundled model, batch 8
    python -m benchmarks.probes.ngram_drafts_host --modes late,sync --batches 1,8 --workload repeat
    python -m benchmarks.probes.ngram_drafts_host --idle-device --profile-steps 0   # host time on CPU

The modes differ in what waits for what: `sync` reads the step in flight back before scheduling
(host work and device work in series), `late` schedules and packs behind it and rewrites the
drafts just before the launch (engine/late_drafts.py), `ahead` drafts after a guess. This runs the
same greedy requests at a fixed K (no draft budget, so every mode drafts at every step) on one
engine, the modes alternating, and reports per decode step: wall time, the engine thread's host
time by phase (engine.last_step_ms; `late` waits for the device inside `dispatch`), drafts kept,
and on a GPU the busy time per step from a profiler trace. Prints a table, writes JSON.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

from benchmarks.common import parse_engine_and_bench, table, write_results
from benchmarks.probes.mtp_level0 import busy, host_profile, run_once
from benchmarks.speculative import prompts
from splash_jax.engine import Engine

log = logging.getLogger("benchmarks.probes.ngram_drafts_host")


@dataclasses.dataclass
class ProbeConfig:
    modes: str = "late,sync,ahead"  # --speculative-ngram-drafts modes, alternated
    batches: str = "8"
    max_tokens: int = 256
    workload: str = "repeat"  # benchmarks/speculative.py's prompts
    drafts: int = 3  # K at every step
    repeats: int = 3  # timed runs per (mode, batch); medians reported
    profile_steps: int = 20  # decode steps under the profiler (GPU busy); 0: none
    host_profile_steps: int = 0  # decode steps under cProfile (top host functions per mode); 0: none
    # Also time each mode's host work with the device idle: before each step() the step in flight is
    # waited for, so on XLA:CPU the step program does not share the cores with the host (its wall
    # times then say nothing; the host phases do).
    idle_device: bool = False


def main(argv=None):
    probe, config = parse_engine_and_bench(__doc__, ProbeConfig, argv)
    engine = Engine(dataclasses.replace(config, speculative_method="ngram", speculative_tokens=probe.drafts,
                                        speculative_adaptive=False))
    modes = probe.modes.split(",")
    rows = []
    for batch in [int(b) for b in probe.batches.split(",")]:
        texts = prompts(probe.workload, batch, 1200)
        run_once(engine, texts, 16)  # first runs of this batch's buckets
        results = {m: [] for m in modes}
        idle = {m: [] for m in modes}
        for _ in range(probe.repeats):  # alternate, so drift hits every mode
            for m in modes:
                engine.config.speculative_ngram_drafts = m
                engine.set_speculative("ngram", probe.drafts)
                results[m].append((*run_once(engine, texts, probe.max_tokens), engine.stats()["speculative"]))
                if probe.idle_device:
                    engine.set_speculative("ngram", probe.drafts)
                    idle[m].append(run_once(engine, texts, probe.max_tokens, idle_device=True))
        for m in modes:
            engine.config.speculative_ngram_drafts = m
            engine.set_speculative("ngram", probe.drafts)
            runs = results[m]
            seconds = statistics.median(r[0] for r in runs)
            steps = statistics.median(r[1] for r in runs)
            phases = {k: statistics.median(r[2].get(k, 0.0) / max(r[1], 1) for r in runs) for k in runs[0][2]}
            spec = runs[-1][3]
            idle_host = (statistics.median(sum(v for k, v in r[2].items() if k != "wait") / max(r[1], 1) for r in idle[m])
                         if idle[m] else None)
            prof = busy(engine, texts, probe.profile_steps) if probe.profile_steps else None
            hosts = host_profile(engine, texts, probe.host_profile_steps) if probe.host_profile_steps else []
            for fn, us, calls in hosts:
                log.info("batch %d %s host: %8.1f us/step %5.1f calls/step  %s", batch, m, us, calls, fn)
            rows.append({
                "batch": batch, "mode": m, "seconds": seconds, "tok_per_s": batch * probe.max_tokens / seconds,
                "decode_steps": steps, "ms_per_step": seconds / max(steps, 1) * 1e3,
                "kept_per_verify": spec["mean_accepted_per_step"], "late_bound_chunks": spec["late_bound_chunks"],
                "host_ms_per_step": sum(v for k, v in phases.items() if k != "wait"),
                "idle_device_host_ms_per_step": idle_host,
                "schedule_ms": phases.get("schedule"), "dispatch_ms": phases.get("dispatch"),
                "complete_ms": phases.get("complete"), "wait_ms": phases.get("wait"), "read_first_ms": phases.get("read_first"),
                "gpu_busy_ms": prof.busy_ms if prof else None, "gpu_window_ms": prof.window_ms if prof else None,
                "host_profile": hosts,
            })
    print(table(rows, ["batch", "mode", "tok_per_s", "decode_steps", "ms_per_step", "kept_per_verify", "gpu_busy_ms",
                       "gpu_window_ms", "host_ms_per_step", "idle_device_host_ms_per_step", "schedule_ms", "dispatch_ms", "complete_ms", "wait_ms",
                       "read_first_ms"]))
    write_results("ngram_drafts_host", {"config": dataclasses.asdict(probe), "rows": rows})


if __name__ == "__main__":
    main()
