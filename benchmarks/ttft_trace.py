"""Time to first token on real-traffic-shaped load, per prefill order (issue 46), one engine.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        .venv/bin/python -m benchmarks.ttft_trace --num-requests 24 --tokens-per-block 8 --time-scale 2 \\
        --max-num-batched-tokens 128 --unloaded-repeats 1 --policies fcfs:0,srpf:64
                                                (bundled model, the first 24 rows, each block as 8 tokens,
                                                 half speed: a smoke run of about a minute)
    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m benchmarks.ttft_trace --shape v2-lite --num-layers 27 \\
        --dtype bfloat16 --layout tp --page-size 64 --max-num-batched-tokens 8192 --max-model-len 34000 \\
        --kv-memory-gb 40 --max-num-seqs 128    (one H200, V2-Lite's 27 layers, dummy bf16 weights; each
                                                 policy replays 120 s: add e.g. --policies srpf:0,fcfs:4096
                                                 or srpf:2048,srpf:4096:2 in further runs to separate effects)

The trace (benchmarks/traces/mooncake_ttft.jsonl, Mooncake's format) is synthetic, made to match
the conversation trace the issue measured: 379 requests over 120 s, prompts 109..32,407 tokens
(mean 9.2K, median 6.1K), 300 output tokens on average, 12.5% of its 512-token blocks repeat an
earlier row's. It is made by
    .venv/bin/python -m benchmarks.traces.make_mooncake --sessions 375 --duration-s 120 \\
        --mean-turns 1.3 --think-s 20 --system-prompts 4 --system-blocks 4 --no-system 0.9 \\
        --user-median 7000 --user-sigma 1.3 --min-user 1 --max-blocks 64 --window-s 120 \\
        --out benchmarks/traces/mooncake_ttft.jsonl
It is replayed by the wall clock as benchmarks/dynamic.py replays it (`serve`: a request is added
at the first step boundary after its arrival; TTFT counts from the arrival), once per policy,
every run starting with an empty prefix cache, greedy with ignore_eos to each row's output length.

--policies: comma-separated NAME[:CAP[:WAIT[:LATE[:GAP[:AGING[:FINISH[:STEPMS]]]]]]] (engine/prefill_order.py; an empty
field takes its default): NAME fcfs or srpf,
CAP the prefill tokens a step may take while requests decode (0: no cap; default 0), WAIT srpf's age
bound in trace seconds (default --max-prefill-wait-s), multiplied by --time-scale as arrival
times are, LATE on, off, long or prefill: late dispatch (engine/dispatch_timing.py; default --late-dispatch;
long: the earlier rule, long prefill steps only, the lead from the whole dispatch; prefill: long prefill
steps only, the lead from the launch), GAP the step
buckets' --token-bucket-gap (default the engine's; 0: powers of two), AGING srpf's
--prefill-aging-tokens-per-s (per trace second), FINISH on or off:
--prefill-finish-early, STEPMS --max-step-ms-with-decodes (engine/step_time_cap.py; default 0, off).
The engine compiles the ladder of --token-bucket-gap, so a policy's GAP must
give a subset of it (0 under a power-of-two gap does): both ladders are served by one engine, in one run.
The default compares fcfs without late dispatch (the engine's order before 2026-12-06) with the GPU
default since (srpf, aging 7400 tokens/s, finish early, late dispatch of prefill steps) and with the
same holding decode steps too (--late-dispatch on).

Unloaded TTFT: the trace's median-length prompt and its longest, each alone on the idle engine
with an empty cache (--unloaded-repeats runs, the median kept). Reported per policy: TTFT and TPOT
p50/p99, output tokens/s, ttft_p50_over_unloaded_median, ttft_p99_over_unloaded_longest,
tpot_p99_over_p50, TTFT p50 per prompt-length quartile, the step intervals by kind
(engine/step_timeline.py), prefix-cache hit rate, and how many outputs equal the first policy's
(float32 on CPU: all; bf16 on a GPU, dummy weights, other chunkings flip near-tied tokens).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from benchmarks import workloads as W
from benchmarks.common import build_engine as common_build_engine
from benchmarks.common import parse_engine_and_bench, percentiles, table, write_results
from benchmarks.dynamic import serve, summarize
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.dispatch_timing import DispatchTimingConfig
from splash_jax.engine.dispatch_timing import resolved as late_dispatch_rules
from splash_jax.engine.prefill_order import PrefillOrder, ladder_sizes
from splash_jax.engine.step_timeline import StepTimeline

log = logging.getLogger("benchmarks.ttft_trace")
# benchmarks/traces/mooncake_ttft.jsonl = make_mooncake.generate(**TRACE) (the command above)
TRACE = {"sessions": 375, "duration_s": 120.0, "mean_turns": 1.3, "think_s": 20.0, "system_prompts": 4,
         "system_blocks": 4, "no_system": 0.9, "user_median": 7000, "user_sigma": 1.3, "min_user": 1, "max_blocks": 64,
         "window_s": 120.0}


@dataclasses.dataclass
class TraceBenchConfig:
    shape: str = ""  # v2-lite | v3 (dummy weights); empty = the bundled model
    num_layers: int = 0  # with --shape: layers of the slice (0 = the full model)
    trace: str = str(W.TRACES / "mooncake_ttft.jsonl")  # Mooncake-format JSONL
    block_size: int = 512  # tokens per hash id in the trace
    tokens_per_block: int = 0  # replay each block as this many tokens, output lengths scaled alike (0 = unscaled)
    num_requests: int = 0  # replay the first N rows (0 = all)
    time_scale: float = 1.0  # multiplies arrival times (and srpf's age bound)
    policies: str = "fcfs:0:1:off,srpf:0:100:prefill::7400:on,srpf:0:100:on::7400:on"  # NAME[:CAP[:WAIT[:LATE[:GAP[:AGING[:FINISH[:STEPMS]]]]]]], comma-separated (see above)
    unloaded_repeats: int = 3  # runs of each unloaded prompt (the median is kept)
    bench_seed: int = 0  # seeds block tokens
    max_run_s: float = 1800.0  # a run still going after this is stopped and marked incomplete


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str  # as given in --policies
    order: PrefillOrder
    late: str | None  # on | off | long (LATE_RULES); None: --late-dispatch
    gap: int | None  # None: --token-bucket-gap
    step_ms: float = 0.0  # --max-step-ms-with-decodes (engine/step_time_cap.py; 0: off)


# LATE: late dispatch's rules (engine/dispatch_timing.py); long: those of 2026-12-06 (long prefill
# steps only, held until 1.5x the whole dispatch's host time before their predicted end); prefill:
# long prefill steps only, with today's lead (short steps, decode-only ones among them, never held);
# on, off and prefill are the engine's --late-dispatch rules
LATE_RULES = {**{mode: late_dispatch_rules(mode, "gpu")[1] for mode in ("on", "off", "prefill")},
              "long": DispatchTimingConfig(min_step_s=0.02, short_steps=False, lead_from_launch=False)}


def parse_policies(spec: str, config, time_scale: float) -> list[Policy]:
    """--policies items; WAIT, AGING and FINISH default to `config`'s (an EngineConfig; auto: no
    aging and no finish-early, so an item means what it meant before those existed)."""
    out = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        if (not 1 <= len(parts) <= 8 or not parts[0] or len(parts) >= 4 and parts[3] not in (*LATE_RULES, "")
                or len(parts) >= 7 and parts[6] not in ("on", "off", "")):
            raise SystemExit(f"--policies takes NAME[:CAP[:WAIT[:LATE[:GAP[:AGING[:FINISH[:STEPMS]]]]]]] items (LATE on, off, "
                             f"long or prefill, FINISH on or off; a field left empty takes its default), got {item!r}")
        field = lambda i: parts[i] if len(parts) > i and parts[i] else None  # noqa: E731
        cap = int(field(1) or 0)
        wait = float(field(2) or config.max_prefill_wait_s)
        late = field(3)
        gap = None if field(4) is None else int(field(4))
        aging = float(field(5) or config.prefill_aging_tokens_per_s or 0.0)  # (auto: none, as before it existed)
        finish = (config.prefill_finish_early == "on") if field(6) is None else field(6) == "on"
        out.append(Policy(item.strip(), PrefillOrder(parts[0], wait * time_scale, cap, (), aging / time_scale, finish),
                          late, gap, float(field(7) or 0.0)))
    return out


def compiled_gap(engine: Engine) -> int:
    """The --token-bucket-gap the engine compiled its ladder with."""
    return engine.executor.compiled_ladder[3]


def build_engine(config: EngineConfig, c: TraceBenchConfig) -> Engine:
    return common_build_engine(config, c.shape, c.num_layers)


def use(engine: Engine, order: PrefillOrder, gap: int, step_ms: float = 0.0) -> None:
    """Serve with `order` and the ladder of `gap` from now on (the engine is idle), the cap snapped
    to that ladder's buckets."""
    try:
        engine.executor.use_bucket_gap(gap)
    except ValueError as e:
        raise SystemExit(f"--policies GAP: {e}") from None
    engine.scheduler.prefill_order = dataclasses.replace(order, buckets=ladder_sizes(engine.config, gap))
    engine.config.scheduling_policy, engine.config.max_prefill_wait_s = order.policy, order.max_wait_s
    engine.config.max_prefill_tokens_with_decodes = order.max_prefill_tokens_with_decodes
    engine.config.prefill_aging_tokens_per_s = order.aging_tokens_per_s
    engine.config.prefill_finish_early = "on" if order.finish_early else "off"
    engine.set_max_step_ms_with_decodes(step_ms)


def unloaded_ttft(engine: Engine, a: W.Arrival, c: TraceBenchConfig, gap: int) -> dict:
    """TTFT of `a`'s prompt alone on the idle engine, cold cache, fcfs (nothing else runs), its
    steps from the ladder of `gap`."""
    use(engine, PrefillOrder(), gap)
    alone = dataclasses.replace(a, t=0.0, output_len=1)
    runs = []
    for _ in range(c.unloaded_repeats):
        r = serve(engine, [alone], c.bench_seed, "on", c.max_run_s, "unloaded").records[0]
        runs.append(r.first_token - r.arrival)
    return {"prompt_len": a.prompt_len, "ttft_s": float(np.median(runs)), "runs_s": runs}


def by_quartile(records) -> list[dict]:
    """TTFT p50 of the requests in each quarter of the prompt lengths (shortest first)."""
    done = sorted((r for r in records if r.first_token is not None), key=lambda r: r.prompt_len)
    out = []
    for part in np.array_split(np.arange(len(done)), 4):
        rs = [done[i] for i in part]
        if rs:
            out.append({"prompt_len": [rs[0].prompt_len, rs[-1].prompt_len],
                        "ttft_s": percentiles([r.first_token - r.arrival for r in rs], (50, 99))})
    return out


def run(engine: Engine, arrivals: list[W.Arrival], name: str, order: PrefillOrder, late: str, gap: int,
        c: TraceBenchConfig, step_ms: float = 0.0) -> dict:
    use(engine, order, gap, step_ms)
    engine.timeline = StepTimeline()  # this run's step intervals only
    engine.dispatch_timing = engine.new_dispatch_timing(late != "off", LATE_RULES[late])  # and its own step timings
    t0 = time.perf_counter()
    s = serve(engine, arrivals, c.bench_seed, "on", c.max_run_s, name)
    out = summarize(s.records, s.samples, s.preemptions, [])
    out |= {"policy": order.policy, "max_wait_s": order.max_wait_s, "cap": order.max_prefill_tokens_with_decodes,
            "aging_tokens_per_s": order.aging_tokens_per_s, "finish_early": order.finish_early,
            "token_bucket_gap": gap, "max_step_ms_with_decodes": step_ms,
            "steps_cut_to_step_ms": engine.scheduler.step_time_cap.capped_steps if engine.scheduler.step_time_cap else 0,
            "complete": s.complete, "prefix_cache": s.prefix_cache, "host_ms": s.host_ms,
            "wrong_lengths": sum(r.tokens != r.output_len for r in s.records if r.finished is not None),
            "step_intervals": engine.timeline.summary(), "ttft_by_length_quartile": by_quartile(s.records),
            "late_dispatch": engine.dispatch_timing.summary(),
            "outputs": s.outputs, "run_s": time.perf_counter() - t0,
            # per request: prompt tokens, arrival, first token, finish (s from the run's start), output tokens
            "per_request": [[r.prompt_len, r.arrival, r.first_token, r.finished, r.tokens] for r in s.records]}
    return out


def ratio(a, b):
    return a / b if a is not None and b else None


def rows_of(results: dict, unloaded_by_gap: dict) -> list[dict]:
    """One table row per policy; its TTFT over the unloaded TTFT under the same ladder."""
    rows, first = [], next(iter(results.values()), None)
    for name, r in results.items():
        ttft, tpot, unloaded = r["ttft_s"], r["tpot_s"], unloaded_by_gap[r["token_bucket_gap"]]
        steps = r["step_intervals"]
        rows.append({
            "policy": name, "gap": r["token_bucket_gap"], "ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"], "tpot_p50": tpot["p50"],
            "tpot_p99": tpot["p99"], "tok_s": r["tokens_per_s"],
            "ttft_p50_over_unloaded_median": ratio(ttft["p50"], unloaded["median"]["ttft_s"]),
            "ttft_p99_over_unloaded_longest": ratio(ttft["p99"], unloaded["longest"]["ttft_s"]),
            "tpot_p99_over_p50": ratio(tpot["p99"], tpot["p50"]),
            "step_p99_ms": (steps.get("with_prefill") or {}).get("p99_ms"),
            "late_waits": r["late_dispatch"]["waits"] if r["late_dispatch"].get("holds", r["late_dispatch"]["enabled"]) else "off",
            "idle_launches": r["late_dispatch"].get("idle_launches"),
            "hit_rate": r["hit_rate"], "preempt": r["preemptions"], "done": f"{r['completed']}/{r['requests']}",
            "same_outputs": sum(a == b for a, b in zip(r["outputs"], first["outputs"])),
        })
    return rows


COLUMNS = ["policy", "gap", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "tok_s", "ttft_p50_over_unloaded_median",
           "ttft_p99_over_unloaded_longest", "tpot_p99_over_p50", "step_p99_ms", "late_waits", "idle_launches", "hit_rate", "preempt", "done",
           "same_outputs"]


def trace_stats(arrivals: list[W.Arrival], ratio_: float) -> dict:
    lens = np.array([a.prompt_len for a in arrivals]) / ratio_
    return {"requests": len(arrivals), "duration_s": arrivals[-1].t if arrivals else 0.0,
            "prompt_tokens_unscaled": {"mean": float(lens.mean()), "median": float(np.median(lens)),
                                       "min": float(lens.min()), "max": float(lens.max())},
            "output_tokens_mean": float(np.mean([a.output_len for a in arrivals])),
            "block_reuse": W.block_reuse(arrivals)}


def main(argv=None):
    # CPU sizes (the bundled model; --max-pages 512 applies to it only: with --shape memory sizes the pool)
    c, config = parse_engine_and_bench(__doc__, TraceBenchConfig, argv, defaults=dict(
        page_size=16, max_num_seqs=32, max_num_batched_tokens=256, min_token_bucket=16))
    logging.getLogger("jax").setLevel(logging.WARNING)
    if not c.shape and config.max_pages is None:
        config.max_pages = 512
    policies = parse_policies(c.policies, config, c.time_scale)
    arrivals = W.read_mooncake(c.trace, c.block_size, c.tokens_per_block, c.time_scale, c.num_requests)
    stats = trace_stats(arrivals, (c.tokens_per_block or c.block_size) / c.block_size)
    log.info("trace %s: %s", c.trace, stats)
    engine = build_engine(config, c)
    by_len = sorted(range(len(arrivals)), key=lambda i: arrivals[i].prompt_len)
    gaps = list(dict.fromkeys(compiled_gap(engine) if p.gap is None else p.gap for p in policies))
    unloaded_by_gap = {}
    for gap in gaps:
        unloaded_by_gap[gap] = u = {"median": unloaded_ttft(engine, arrivals[by_len[(len(by_len) - 1) // 2]], c, gap),
                                    "longest": unloaded_ttft(engine, arrivals[by_len[-1]], c, gap)}
        log.info("unloaded TTFT, gap %d: median-length prompt (%d tokens) %.4g s, longest (%d tokens) %.4g s", gap,
                 u["median"]["prompt_len"], u["median"]["ttft_s"], u["longest"]["prompt_len"], u["longest"]["ttft_s"])
    results = {}
    # --late-dispatch, for policies without LATE
    default_late = "off" if not engine.dispatch_timing.holds else "on" if engine.dispatch_timing.config.short_steps else "prefill"
    for p in policies:
        gap = compiled_gap(engine) if p.gap is None else p.gap
        results[p.name] = r = run(engine, arrivals, p.name, p.order, default_late if p.late is None else p.late, gap, c,
                                  p.step_ms)
        log.info("%s: TTFT p50 %.4g p99 %.4g s, TPOT p50 %.4g p99 %.4g s, %.4g tok/s, %d/%d done (%.1fs)", p.name,
                 r["ttft_s"]["p50"] or 0, r["ttft_s"]["p99"] or 0, r["tpot_s"]["p50"] or 0, r["tpot_s"]["p99"] or 0,
                 r["tokens_per_s"], r["completed"], r["requests"], r["run_s"])
    rows = rows_of(results, unloaded_by_gap)
    for gap, u in unloaded_by_gap.items():
        print(f"unloaded TTFT, gap {gap}: median-length prompt {u['median']['ttft_s']:.4g} s "
              f"({u['median']['prompt_len']} tokens), longest {u['longest']['ttft_s']:.4g} s "
              f"({u['longest']['prompt_len']} tokens)")
    print(table(rows, COLUMNS))
    unloaded = unloaded_by_gap[gaps[0]]
    return write_results("ttft_trace", {
        "bench": dataclasses.asdict(c), "engine": dataclasses.asdict(config), "trace": stats,
        "unloaded": unloaded, "unloaded_by_gap": unloaded_by_gap, "rows": rows,
        "runs": {k: {f: v for f, v in r.items() if f != "outputs"} for k, r in results.items()},
    })


if __name__ == "__main__":
    main()
