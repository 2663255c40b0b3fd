"""Probe: what an MTP engine's steps without drafts cost against speculation off (and, with
--engines, what a speculative step's host work costs).

    python -m benchmarks.probes.mtp_level0                       # the bundled model and its MTP head
    python -m benchmarks.probes.mtp_level0 --batches 1,8 --max-tokens 256
    JAX_PLATFORMS=cpu python -m benchmarks.probes.mtp_level0 --engines off,mtp0,mtp3,ngram3 \
        --batches 8 --idle-device --profile-steps 0 --workload repeat

The draft budget turns drafts off (level 0) when they do not pay, and "never loses" needs such
steps to cost what speculation off costs. An MTP engine still writes every position's MTP latent
(drafting may resume over it), inside the step program of a step that samples its own tokens.
This runs the same greedy requests on two engines of one process:
  off   an engine without an MTP layer, speculation off (overlapped), the baseline of
        benchmarks/speculative.py
  mtp0  an MTP engine with K = 3 whose draft budget is held at level 0
  mtp3  (--engines) an MTP engine drafting K = 3 every step (no budget), drafts inside greedy
        step programs (--mtp-drafts-in-step-max-tokens 512)
  ngram3 (--engines) n-gram drafts, K = 3 every step (no budget)
and reports per decode step: wall time, the engine thread's host time by phase
(engine.last_step_ms), and on a GPU the busy time and kernels per step from a profiler trace
(benchmarks/profiling.py). Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import jax

from benchmarks.common import parse_engine_and_bench, table, write_results
from benchmarks.profiling import device_busy
from benchmarks.speculative import prompts
from splash_jax.engine import Engine, EngineConfig, SamplingParams

log = logging.getLogger("benchmarks.probes.mtp_level0")


@dataclasses.dataclass
class ProbeConfig:
    batches: str = "1,8"
    max_tokens: int = 256
    workload: str = "fresh"  # benchmarks/speculative.py's prompts
    repeats: int = 3  # timed runs per (engine, batch); medians reported
    profile_steps: int = 20  # decode steps under the profiler (GPU busy); 0: none
    host_profile_steps: int = 100  # decode steps under cProfile (the host functions that differ); 0: none
    # each step() starts once the step in flight is done (run_once's idle_device): host phases without the
    # step program sharing the cores, what to compare on XLA:CPU (its wall times then say nothing)
    idle_device: bool = False
    engines: str = "off,mtp0"  # of off, mtp0, mtp3, ngram3 (the module docstring); NAME@FIELD=VALUE: an engine option changed (engine_overrides)


def hold_level_zero(engine: Engine) -> None:
    """The engine's draft budget chooses level 0 for every step (and reports no step to learn from)."""
    budget = engine.draft_budget

    def choose_level(requests: int) -> int:
        budget.level, budget.key = 0, None
        return 0

    budget.choose_level = choose_level


def run_once(engine: Engine, texts: list[str], max_tokens: int, idle_device: bool = False) -> tuple[float, int, dict]:
    """(seconds, decode steps, summed host ms by phase over them) of the prompts to completion.
    idle_device: each step() starts once the step in flight is done, so its host work never shares
    the machine with a step program (XLA:CPU runs on the host's cores; wall times then say nothing)."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, t in enumerate(texts):
        engine.add_request(t, params, request_id=f"r{i}")
    phases: dict[str, float] = {}
    steps, t0 = 0, time.perf_counter()
    while engine.has_work():
        if idle_device and engine._inflight is not None and engine._inflight.result is not None:
            jax.block_until_ready(engine._inflight.result.tokens)
        engine.step()
        if engine.scheduler.running and not engine.scheduler.waiting:
            steps += 1
            for k, v in engine.last_step_ms.items():
                phases[k] = phases.get(k, 0.0) + v
    return time.perf_counter() - t0, steps, phases


def start_decoding(engine: Engine, texts: list[str], max_tokens: int, prefix: str) -> None:
    """The prompts admitted, prefilled and a few tokens into decoding (steps measured from here
    are decode steps of the whole batch)."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, t in enumerate(texts):
        engine.add_request(t, params, request_id=f"{prefix}{i}")
    while engine.scheduler.waiting or any(r.num_generated < 8 for r in engine.scheduler.running):
        engine.step()


def finish(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def busy(engine: Engine, texts: list[str], steps: int):
    """GPU busy per step over `steps` decode steps in the middle of a run."""
    start_decoding(engine, texts, 4 * steps + 64, "p")
    prof = device_busy(engine.step, steps)
    finish(engine)
    return prof


def host_profile(engine: Engine, texts: list[str], steps: int, top: int = 14) -> list[tuple[str, float, float]]:
    """(function, own us per step, calls per step) of the `top` costliest functions by own time
    over `steps` decode steps under cProfile (its overhead inflates Python-heavy functions; a call
    into C, such as a program's launch, is timed as it is)."""
    import cProfile
    import pstats

    start_decoding(engine, texts, steps + 64, "h")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    finish(engine)
    stats = pstats.Stats(prof).stats
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{fn.rsplit('/', 1)[-1]}:{line}({name})", tt / steps * 1e6, nc / steps)
            for (fn, line, name), (_, nc, tt, _, _) in ranked]


def engine_overrides(spec: str) -> tuple[str, dict]:
    """NAME[@FIELD=VALUE...] -> (NAME, EngineConfig fields to change): engines of one process that
    differ in an option (--graph-update, --graph-scheduling, ...), an A/B where the host's speed
    drifts alike for both sides."""
    name, *pairs = spec.split("@")
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    overrides = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        key = key.replace("-", "_")
        if key not in fields or not value:
            raise ValueError(f"engine {spec!r}: {pair!r} is not FIELD=VALUE of an EngineConfig field")
        kind = type(getattr(EngineConfig(), key))
        overrides[key] = (value.lower() == "true") if kind is bool else kind(value) if kind in (int, float) else value
    return name, overrides


def make_engine(config, spec: str) -> Engine:
    """One of the probe's engines (the module docstring), its speculation set; NAME@FIELD=VALUE
    changes an engine option (engine_overrides)."""
    name, options = engine_overrides(spec)
    if name not in ("off", "mtp0", "mtp3", "ngram3"):
        raise ValueError(f"unknown engine {name!r} (off, mtp0, mtp3, ngram3)")
    method = "ngram" if name in ("off", "ngram3") else "mtp"
    overrides = {"speculative_method": method, "speculative_tokens": 3, **options}
    if name in ("mtp3", "ngram3"):  # K = 3 every step: no draft budget
        overrides["speculative_adaptive"] = False
    if name == "mtp3":
        overrides["mtp_drafts_in_step_max_tokens"] = 512
    engine = Engine(dataclasses.replace(config, **overrides))
    engine.set_speculative("off" if name == "off" else method, None if name == "off" else 3)
    if name == "mtp0":
        hold_level_zero(engine)
    return engine


def main(argv=None):
    probe, config = parse_engine_and_bench(__doc__, ProbeConfig, argv)
    engines = {name: make_engine(config, name) for name in probe.engines.split(",")}
    rows = []
    for batch in [int(b) for b in probe.batches.split(",")]:
        texts = prompts(probe.workload, batch, 1200)
        for name, engine in engines.items():
            run_once(engine, texts, 16)  # first runs of this batch's buckets
        results = {name: [] for name in engines}
        for _ in range(probe.repeats):  # alternate, so drift hits both
            for name, engine in engines.items():
                results[name].append(run_once(engine, texts, probe.max_tokens, probe.idle_device))
        for name, engine in engines.items():
            seconds = statistics.median(r[0] for r in results[name])
            steps = statistics.median(r[1] for r in results[name])
            phases = {k: statistics.median(r[2].get(k, 0.0) / max(r[1], 1) for r in results[name])
                      for k in results[name][0][2]}
            prof = busy(engine, texts, probe.profile_steps) if probe.profile_steps else None
            hosts = host_profile(engine, texts, probe.host_profile_steps) if probe.host_profile_steps else []
            for fn, us, calls in hosts:
                log.info("batch %d %s host: %8.1f us/step %5.1f calls/step  %s", batch, name, us, calls, fn)
            rows.append({
                "batch": batch, "engine": name, "seconds": seconds, "tok_per_s": batch * probe.max_tokens / seconds,
                "decode_steps": steps, "tokens_per_step": batch * probe.max_tokens / steps if steps else None,
                "wall_ms_per_step": prof.window_ms if prof else None,
                "host_ms_per_step": sum(v for k, v in phases.items() if k != "wait"),
                "schedule_ms": phases.get("schedule"), "dispatch_ms": phases.get("dispatch"),
                "complete_ms": phases.get("complete"), "wait_ms": phases.get("wait"),
                "gpu_busy_ms": prof.busy_ms if prof else None, "kernels_per_step": prof.kernels if prof else None,
                "top_kernels": prof.top if prof else None,
                "host_profile": hosts,
            })
        for r in rows:  # over the off engine of the same options (NAME@FIELD=VALUE), else plain off
            options = r["engine"].partition("@")[2]
            off = next((o for o in rows if o["batch"] == batch and o["engine"] == ("off@" + options if options else "off")),
                       next((o for o in rows if o["batch"] == batch and o["engine"] == "off"), None))
            if r["batch"] == batch and off is not None:
                r["tok_s_over_off"] = r["tok_per_s"] / off["tok_per_s"]
        log.info("batch %d: %s at %.3fx of off", batch, rows[-1]["engine"], rows[-1].get("tok_s_over_off", float("nan")))
    print(table(rows, ["batch", "engine", "tok_per_s", "tok_s_over_off", "tokens_per_step", "wall_ms_per_step", "gpu_busy_ms",
                       "kernels_per_step", "host_ms_per_step", "schedule_ms", "dispatch_ms", "complete_ms", "wait_ms"]))
    write_results("mtp_level0", {"config": dataclasses.asdict(probe), "rows": rows})


if __name__ == "__main__":
    main()
