"""Prefix reuse: the prefix-caching issue's two workloads, each served with the cache off, on, and
an ideal cache emulated, by ONE engine (same compiled programs) in one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        .venv/bin/python -m benchmarks.prefix_reuse                 (bundled model, tiny sizes)
    python -m benchmarks.prefix_reuse --shape v2-lite --dtype bfloat16 --page-size 64 \\
        --kv-memory-gb 40 --max-num-seqs 128 --max-num-batched-tokens 8192 --max-model-len 16384 \\
        --agent-conversations 32 --agent-turns 8 --agent-system 4096 --agent-tool 256 --agent-answer 128 \\
        --grouped-prompts 16 --grouped-samples 8 --grouped-prompt 2048 --grouped-output 256
                                                   (one H200, V2-Lite's 27 layers, dummy bf16 weights:
                                                    the issue's sizes; grouped's output length is ours)
Workloads (benchmarks/workloads.py builds both; prompt tokens are seeded random ids >= 2):
  agent    C conversations x T turns, all starting with the same S-token system prompt; each turn
           appends a U-token tool result, and the model answers A tokens (greedy, ignore_eos).
           Closed loop: a conversation's next turn is submitted when its previous answer
           finished, with that answer's generated ids in its history, so turn k's prompt is the
           system prompt + every earlier tool result and answer + its own tool result.
  grouped  G prompts of P tokens, each sampled K times (temperature 1, seeded per request), all
           submitted at once (GRPO-style rollouts).
Modes, each starting with an empty cache:
  off      engine.set_prefix_caching(False);
  on       the engine's automatic prefix cache;
  ideal    the cache off, and each request's known-shared prefix (the longest page-aligned prefix
           of its prompt that an earlier request's prompt, or finished prompt + answer but its last
           token, had; at most all but its last prompt token) admitted as computed (Scheduler.admit_cached), the rest
           prefilled: the compute an unbounded cache filled at submission would save. Its pages are
           not shared, so its page use is the cache-off one, and a preempted request recomputes all.
Reports, per (workload, mode): wall time (first arrival to last token), output tokens/s, TTFT
p50/p99, prompt tokens submitted and computed (submitted - served from the cache), computed over
the off run's, hit rate (cached / submitted), peak pages referenced, throughput over the ideal's;
agent: TTFT p50 per turn (logged, in the JSON and the plot); the engine's own cache counters;
how many outputs equal the off run's (greedy agent answers should, up to float ties).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import time

import numpy as np

from benchmarks import workloads as W
from benchmarks.common import build_engine as common_build_engine
from benchmarks.common import percentiles, table, write_results
from benchmarks.dynamic import CACHING, serve, summarize
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.config import add_dataclass_args

log = logging.getLogger("benchmarks.prefix_reuse")
WORKLOADS = ("agent", "grouped")
COLORS = {"off": "tab:gray", "on": "tab:blue", "ideal": "tab:green"}


@dataclasses.dataclass
class PrefixBenchConfig:
    shape: str = ""  # v2-lite | v3 (dummy weights); empty = the bundled model
    num_layers: int = 0  # with --shape: layers of the slice (0 = the full model)
    workloads: str = "agent,grouped"  # comma-separated: agent, grouped
    modes: str = "off,on,ideal"  # comma-separated, run in this order: off, on, ideal
    bench_seed: int = 0  # seeds prompt tokens and sampling
    agent_conversations: int = 4  # agent: conversations (issue: 32)
    agent_turns: int = 3  # agent: turns per conversation (issue: 8)
    agent_system: int = 256  # agent: system-prompt tokens shared by every conversation (issue: 4096)
    agent_tool: int = 32  # agent: tool-result tokens appended each turn (issue: 256)
    agent_answer: int = 16  # agent: answer tokens, greedy (issue: 128)
    agent_think_s: float = 0.0  # agent: seconds between an answer and the next turn's submission
    grouped_prompts: int = 4  # grouped: distinct prompts (issue: 16)
    grouped_samples: int = 4  # grouped: samples per prompt (issue: 8)
    grouped_prompt: int = 128  # grouped: prompt tokens (issue: 2048)
    grouped_output: int = 16  # grouped: output tokens per sample
    grouped_temperature: float = 1.0  # grouped: sampling temperature (seeded per request)
    max_run_s: float = 1800.0  # a run still going after this is stopped and marked incomplete
    plot: bool = True  # write a plot beside the JSON


def arrivals_of(workload: str, c: PrefixBenchConfig) -> list[W.Arrival]:
    wc = W.WorkloadConfig(
        workload_seed=c.bench_seed, multiturn_conversations=c.agent_conversations, multiturn_turns=c.agent_turns,
        multiturn_system=c.agent_system, multiturn_tool=c.agent_tool, multiturn_answer=c.agent_answer,
        multiturn_think_s=c.agent_think_s, grouped_prompts=c.grouped_prompts, grouped_samples=c.grouped_samples,
        grouped_prompt=c.grouped_prompt, grouped_output=c.grouped_output, grouped_temperature=c.grouped_temperature,
    )
    return W.make({"agent": "multiturn", "grouped": "grouped"}[workload], wc)


def build_engine(config: EngineConfig, c: PrefixBenchConfig) -> Engine:
    return common_build_engine(config, c.shape, c.num_layers)


def run(engine: Engine, workload: str, arrivals: list[W.Arrival], mode: str, c: PrefixBenchConfig) -> dict:
    t0 = time.perf_counter()
    s = serve(engine, arrivals, c.bench_seed, mode, c.max_run_s, f"{workload}/{mode}")
    out = summarize(s.records, s.samples, s.preemptions, [])
    turns = sorted({r.turn for r in s.records})
    out |= {
        "mode": mode, "complete": s.complete, "wall_s": out["makespan_s"], "prefix_cache": s.prefix_cache,
        "wrong_lengths": sum(r.tokens != r.output_len for r in s.records if r.finished is not None),
        "outputs": s.outputs, "run_s": time.perf_counter() - t0, "host_ms": s.host_ms,
    }
    if workload == "agent":
        out["ttft_by_turn"] = {k: percentiles([r.first_token - r.arrival for r in s.records
                                                if r.turn == k and r.first_token is not None], (50, 99)) for k in turns}
    return out


def rows_of(results: dict) -> list[dict]:
    rows = []
    for wl, runs in results.items():
        off, ideal = runs.get("off"), runs.get("ideal")
        for mode, r in runs.items():
            rows.append({
                "workload": wl, "mode": mode, "wall_s": r["wall_s"], "tok_s": r["tokens_per_s"],
                "ttft_p50": r["ttft_s"]["p50"], "ttft_p99": r["ttft_s"]["p99"], "submitted": r["prompt_tokens"],
                "computed": r["computed_tokens"],
                "computed_vs_off": r["computed_tokens"] / off["computed_tokens"] if off and off["computed_tokens"] else None,
                "hit_rate": r["hit_rate"], "peak_pages": r["peak_pages_used"],
                "vs_ideal": r["tokens_per_s"] / ideal["tokens_per_s"] if ideal and ideal["tokens_per_s"] else None,
                "preempt": r["preemptions"], "done": f"{r['completed']}/{r['requests']}",
                "sched_ms_p50": r["host_ms"]["schedule"]["p50"], "sched_ms_p99": r["host_ms"]["schedule"]["p99"],
                "dispatch_ms_p50": r["host_ms"]["dispatch"]["p50"],
            })
    return rows


COLUMNS = ["workload", "mode", "wall_s", "tok_s", "ttft_p50", "ttft_p99", "submitted", "computed", "computed_vs_off",
           "hit_rate", "peak_pages", "vs_ideal", "preempt", "done", "sched_ms_p50", "sched_ms_p99", "dispatch_ms_p50"]


def digests(outputs: list[list[int]]) -> list[str]:
    """A short digest of each request's output ids (compare runs of other processes and machines)."""
    return [hashlib.sha1(np.asarray(o, np.int64).tobytes()).hexdigest()[:12] for o in outputs]


def same_outputs(runs: dict) -> dict:
    """Per mode: how many requests' outputs equal the off run's."""
    if "off" not in runs:
        return {}
    ref = runs["off"]["outputs"]
    return {m: sum(a == b for a, b in zip(r["outputs"], ref)) for m, r in runs.items() if m != "off"}


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    agent = results.get("agent", {})
    for mode, r in agent.items():
        turns = sorted(r["ttft_by_turn"], key=int)
        axes[0].plot([int(k) for k in turns], [r["ttft_by_turn"][k]["p50"] for k in turns], "o-",
                     color=COLORS.get(mode), label=mode)
    if agent:
        axes[0].set_xticks(sorted({int(k) for r in agent.values() for k in r["ttft_by_turn"]}))
    axes[0].set_xlabel("turn")
    axes[0].set_ylabel("TTFT p50 (s)")
    axes[0].set_title("agent: TTFT by turn", fontsize=9, loc="left")
    if agent:
        axes[0].legend(fontsize=8)
    names = list(results)
    modes = list(dict.fromkeys(m for runs in results.values() for m in runs))
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        xs = [i + j * width for i, wl in enumerate(names) if mode in results[wl]]
        ys = [results[wl][mode]["wall_s"] for wl in names if mode in results[wl]]
        axes[1].bar(xs, ys, width, color=COLORS.get(mode), label=mode)
    axes[1].set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(names))], names)
    axes[1].set_ylabel("wall time (s)")
    axes[1].set_title("wall time by workload and mode", fontsize=9, loc="left")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    add_dataclass_args(p.add_argument_group("benchmark"), PrefixBenchConfig)
    # CPU sizes: every workload's requests fit the pool at once without a cache; few buckets.
    # (--max-pages 256 applies to the bundled model only: with --shape the pool is sized by memory.)
    p.set_defaults(page_size=16, max_num_seqs=32, max_num_batched_tokens=128, min_token_bucket=16)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    config = EngineConfig.from_cli_args(args)
    c = PrefixBenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PrefixBenchConfig)})
    if not c.shape and config.max_pages is None:
        config.max_pages = 256
    modes, workloads = c.modes.split(","), c.workloads.split(",")
    bad = [m for m in modes if m not in CACHING] + [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown mode or workload {bad[0]!r} "
                         f"(modes: {', '.join(CACHING)}; workloads: {', '.join(WORKLOADS)})")
    if "on" in modes and not hasattr(Engine, "set_prefix_caching"):
        raise SystemExit("mode 'on' needs Engine.set_prefix_caching (the engine core's prefix cache); "
                         "until it lands, run --modes off,ideal")
    engine = build_engine(config, c)
    results, arrivals = {}, {}
    for wl in workloads:
        arrivals[wl] = arrivals_of(wl, c)
        results[wl] = {}
        for mode in modes:
            results[wl][mode] = r = run(engine, wl, arrivals[wl], mode, c)
            log.info("%s / %s: %.3g s, %.4g tok/s, %d/%d prompt tokens computed, hit rate %.3f, engine cache %s (%.1fs)",
                     wl, mode, r["wall_s"], r["tokens_per_s"], r["computed_tokens"], r["prompt_tokens"], r["hit_rate"],
                     r["prefix_cache"], r["run_s"])
            for k, v in r.get("ttft_by_turn", {}).items():
                log.info("  %s / %s turn %d: TTFT p50 %.4g s, p99 %.4g s", wl, mode, k, v["p50"], v["p99"])
    rows = rows_of(results)
    print(table(rows, COLUMNS))
    same = {wl: same_outputs(runs) for wl, runs in results.items()}
    log.info("outputs equal to the off run's: %s", same)
    path = write_results("prefix_reuse", {
        "bench": dataclasses.asdict(c), "engine": dataclasses.asdict(config), "rows": rows,
        "same_outputs_as_off": same, "runs": {wl: {m: {k: v for k, v in r.items() if k != "outputs"}
                                                     | {"output_digests": digests(r["outputs"])}
                                                    for m, r in runs.items()} for wl, runs in results.items()},
        "arrivals": {k: [dataclasses.asdict(a) for a in v] for k, v in arrivals.items()},
    })
    if c.plot:
        plot(results, path.with_suffix(".png"))
    return path


if __name__ == "__main__":
    main()
