"""Dynamic workloads on every fixed layout and on the policy, same model and pool, one invocation.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.dynamic --num-devices 8 --time-scale 4
    python -m benchmarks.dynamic --shape v3 --num-layers 4 --num-devices 2 --dtype bfloat16 \\
        --page-size 64 --kv-memory-gb 40 --max-num-seqs 128 --max-num-batched-tokens 2048 \\
        --policy-calibration benchmarks/results/calibration_....json  (+ workload sizes)

One engine (switching enabled) serves every run: a fixed-layout run switches to its layout while
idle and runs with the policy off; the `auto` run starts in `--auto-start` with a fresh policy.
So every run has the same weights, pool, buckets and compiled programs.

Arrivals are by wall clock: a request is added at the first step boundary after its arrival
time, and its TTFT counts from the arrival time. A slower layout therefore falls behind and
queues, as a server would; arrivals by step would hand a slow layout the same batches as a fast
one and hide exactly the effect being measured. (Rollout and pressure arrive all at t=0, so for
them the two are the same.) The simulator (benchmarks/simulate.py) uses the same rule on its
simulated clock.

Reports per run: output tokens/s (all output tokens over the time the last one arrived), TTFT and
TPOT p50/p99, preemptions, switches; writes JSON (with every run's timeline and the policy's
decisions) and one timeline plot per workload: layout, running requests and KV use over time.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import jax
import numpy as np

from benchmarks import workloads as W
from benchmarks.common import percentiles, table, write_results
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.config import add_dataclass_args
from splash_jax.mesh.layouts import LAYOUT_NAMES, get_layout
from splash_jax.policy import TransitionAwarePolicy

log = logging.getLogger("benchmarks.dynamic")
COLORS = {"tp": "tab:blue", "dp": "tab:orange", "dop": "tab:green", "cp": "tab:red"}


@dataclasses.dataclass
class BenchConfig:
    shape: str = ""  # v2-lite | v3 (dummy weights); empty = the bundled model
    num_layers: int = 0  # with --shape: layers of the slice (0 = the full model)
    workloads: str = ",".join(W.WORKLOADS)
    runs: str = "tp,dp,dop,cp,auto"  # fixed layouts and/or auto
    auto_start: str = "dp"  # the layout the auto run starts in
    max_run_s: float = 600.0  # a run still going after this is stopped and marked incomplete
    plot: bool = True


@dataclasses.dataclass
class RequestRecord:
    arrival: float
    prompt_len: int
    output_len: int
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0


@dataclasses.dataclass
class Sample:
    """The engine after one step (a point of the timeline)."""

    t: float
    layout: str
    running: int
    waiting: int
    kv_used: float  # fraction of the pool's pages in use


def summarize(records: list[RequestRecord], samples: list[Sample], preemptions: int, switches: list) -> dict:
    done = [r for r in records if r.finished is not None]
    end = max((r.finished for r in done), default=0.0)
    tokens = sum(r.tokens for r in records)
    ttft = [r.first_token - r.arrival for r in records if r.first_token is not None]
    tpot = [(r.finished - r.first_token) / (r.tokens - 1) for r in done if r.tokens > 1]
    return {
        "requests": len(records), "completed": len(done), "output_tokens": tokens, "makespan_s": end,
        "tokens_per_s": tokens / end if end > 0 else 0.0, "ttft_s": percentiles(ttft, (50, 99)),
        "tpot_s": percentiles(tpot, (50, 99)), "preemptions": preemptions, "switches": switches, "steps": len(samples),
    }


def build_engine(config: EngineConfig, bench: BenchConfig) -> Engine:
    if bench.shape:
        config.model = str(shape_folder(bench.shape, **({"num_hidden_layers": bench.num_layers} if bench.num_layers else {})))
        config.load_format = "dummy"
    config.enable_switching, config.layout_policy = True, "off"  # the benchmark attaches the policy per run
    warm = config.warmup
    config.warmup = False
    t0 = time.perf_counter()
    engine = Engine(config)
    if warm:  # greedy programs only (every request here is greedy): half of compile_all's programs
        ex = engine.executor
        for name in LAYOUT_NAMES:
            layout = get_layout(name)
            for b in ex.buckets(layout):
                for moving in ((False, True) if ex.move_pages else (False,)):
                    ex.compiled(layout, b, moving, False)
        # First executions (GPU kernel loading, collectives set-up) before any timed run, as the
        # engine's own start-up does (--warmup-runs): otherwise the first layout run pays them.
        if dataclasses.replace(config, warmup=True).resolved_warmup_runs(jax.default_backend()):
            engine.run_every_program_once(full_sampler=False)
    log.info("engine ready in %.1fs (%d programs); token capacity per layout: %s", time.perf_counter() - t0,
             engine.executor.num_compiled, {k: v["tokens"] for k, v in engine.capacities().items()})
    return engine


def switch_idle(engine: Engine, dst: str) -> None:
    if engine.layout.name == dst:
        return
    h = engine.switch_layout(dst)
    while not h.done:
        engine.step()
    if h.state.value != "done":
        raise RuntimeError(f"switch to {dst} while idle: {h.state.value} ({h.reason})")


def run(engine: Engine, arrivals: list[W.Arrival], mode: str, bench: BenchConfig, seed: int) -> dict:
    """Serve `arrivals` in layout `mode` (or `auto`); the engine must be idle."""
    engine.policy = None
    switch_idle(engine, bench.auto_start if mode == "auto" else mode)
    if mode == "auto":
        engine.policy = TransitionAwarePolicy(engine, engine.config.policy)
    vocab = engine.model_config.vocab_size
    prompts = [W.prompt_ids(i, a.prompt_len, vocab, seed) for i, a in enumerate(arrivals)]
    records = [RequestRecord(a.t, a.prompt_len, a.output_len) for a in arrivals]
    preempt0 = engine.scheduler.num_preemptions
    history0 = len(engine.switcher.history)
    samples: list[Sample] = []
    nxt, t0, complete = 0, time.perf_counter(), True
    while nxt < len(arrivals) or engine.has_work():
        now = time.perf_counter() - t0
        while nxt < len(arrivals) and arrivals[nxt].t <= now:
            a = arrivals[nxt]
            engine.add_request(prompts[nxt], SamplingParams(max_tokens=a.output_len, ignore_eos=True), str(nxt))
            nxt += 1
        if not engine.has_work():
            time.sleep(max(0.0, arrivals[nxt].t - now))
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            r = records[int(o.request_id)]
            if o.delta_token_ids and r.first_token is None:
                r.first_token = now
            r.tokens += len(o.delta_token_ids)
            if o.finished:
                r.finished = now
        usage = engine.allocator.usage()
        samples.append(Sample(now, engine.layout.name, len(engine.scheduler.running), len(engine.scheduler.waiting),
                              sum(u.used_pages for u in usage) / sum(u.total_pages for u in usage)))
        if now > bench.max_run_s:
            log.warning("%s: stopped after %.0fs with %d requests unfinished", mode, now, sum(r.finished is None for r in records))
            for rid in [str(i) for i, r in enumerate(records) if r.finished is None and i < nxt]:
                engine.abort(rid)
            engine.flush()
            complete = False
            break
    switches = [{"t": h.started - t0, "from": h.src, "to": h.dst, "state": h.state.value, "bytes": h.bytes_moved}
                for h in engine.switcher.history[history0:]]
    if mode == "auto":  # the idle switch to the start layout is not the policy's
        switches = [s for s in switches if s["t"] >= 0]
    out = summarize(records, samples, engine.scheduler.num_preemptions - preempt0, switches)
    out |= {"complete": complete, "timeline": [dataclasses.asdict(s) for s in samples],
            "wrong_lengths": sum(r.tokens != r.output_len for r in records if r.finished is not None)}
    if mode == "auto":
        out["decisions"] = engine.policy.decisions
    engine.policy = None
    return out


def plot(workload: str, runs: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.9 * len(runs)), sharex=True, squeeze=False)
    for ax, (mode, res) in zip(axes[:, 0], runs.items()):
        tl = res["timeline"]
        if not tl:
            continue
        t = [s["t"] for s in tl]
        starts = [0.0] + t[:-1]
        for s0, s in zip(starts, tl):
            ax.axvspan(s0, s["t"], color=COLORS[s["layout"]], alpha=0.18, lw=0)
        ax.step(t, [s["running"] for s in tl], where="post", color="k", lw=1, label="running")
        ax.step(t, [s["waiting"] for s in tl], where="post", color="gray", lw=1, ls=":", label="waiting")
        ax.set_ylabel(f"{mode}\nrequests")
        kv = ax.twinx()
        kv.plot(t, [100 * s["kv_used"] for s in tl], color="purple", lw=1, label="KV use %")
        kv.set_ylim(0, 105)
        kv.set_ylabel("KV %")
        ax.set_title(f"{mode}: {res['tokens_per_s']:.4g} tok/s, {len(res['switches'])} switches", fontsize=9, loc="left")
    handles = [matplotlib.patches.Patch(color=c, alpha=0.3, label=n) for n, c in COLORS.items()]
    axes[0, 0].legend(handles=handles + axes[0, 0].get_lines(), fontsize=7, ncol=6, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(f"{workload}: layout (shading), requests and KV use over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)


def rows_of(results: dict) -> list[dict]:
    """One table row per (workload, run), with the run's throughput over the best fixed layout's."""
    rows = []
    for wl, runs in results.items():
        fixed = [r["tokens_per_s"] for m, r in runs.items() if m != "auto"]
        best = max(fixed) if fixed else None
        for mode, r in runs.items():
            rows.append({
                "workload": wl, "run": mode, "tok_s": r["tokens_per_s"], "vs_best_fixed": r["tokens_per_s"] / best if best else None,
                "ttft_p50": r["ttft_s"]["p50"], "ttft_p99": r["ttft_s"]["p99"], "tpot_p50": r["tpot_s"]["p50"],
                "tpot_p99": r["tpot_s"]["p99"], "preempt": r["preemptions"], "switches": len(r["switches"]),
                "steps": r["steps"], "done": f"{r['completed']}/{r['requests']}",
            })
    return rows


COLUMNS = ["workload", "run", "tok_s", "vs_best_fixed", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "preempt",
           "switches", "steps", "done"]


def engine_facts(engine: Engine) -> dict:
    """What the simulator needs to replay these runs on the same pool and limits."""
    c = engine.config
    return {
        "num_devices": engine.n, "page_size": c.page_size, "pages_per_device": engine.allocator.pages_per_device,
        "extra_pages_per_device": engine.extra_pages, "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens, "max_model_len": engine.max_model_len,
        "enable_chunked_prefill": c.enable_chunked_prefill, "switch_chunk_pages": c.switch_chunk_pages,
        "capacities": engine.capacities(),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    add_dataclass_args(p.add_argument_group("benchmark"), BenchConfig)
    add_dataclass_args(p.add_argument_group("workloads"), W.WorkloadConfig)
    # CPU-mesh sizes: a small pool (so the pressure workload exceeds TP's and DP's), few buckets.
    p.set_defaults(page_size=16, kv_memory_gb=0.005, max_num_seqs=32, max_num_batched_tokens=64, min_token_bucket=16)
    return p


def pick(args, cls):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def main(argv=None):
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("splash_jax.switch.controller").setLevel(logging.WARNING)
    config, bench, wcfg = EngineConfig.from_cli_args(args), pick(args, BenchConfig), pick(args, W.WorkloadConfig)
    engine = build_engine(config, bench)
    results, arrivals = {}, {}
    for wl in bench.workloads.split(","):
        arrivals[wl] = W.make(wl, wcfg)
        results[wl] = {}
        for mode in bench.runs.split(","):
            t0 = time.perf_counter()
            results[wl][mode] = run(engine, arrivals[wl], mode, bench, wcfg.workload_seed)
            r = results[wl][mode]
            log.info("%s / %s: %.4g tok/s, %d/%d done, %d switches, %.1fs", wl, mode, r["tokens_per_s"], r["completed"],
                     r["requests"], len(r["switches"]), time.perf_counter() - t0)
    rows = rows_of(results)
    print(table(rows, COLUMNS))
    facts = engine_facts(engine)
    path = write_results("dynamic", {
        "args": vars(args), "engine": facts, "policy": dataclasses.asdict(config.policy), "rows": rows,
        "arrivals": {k: [dataclasses.asdict(a) for a in v] for k, v in arrivals.items()}, "runs": results,
    })
    if bench.plot:
        for wl, runs in results.items():
            plot(wl, runs, path.with_name(path.stem + f"_{wl}.png"))
    return path


if __name__ == "__main__":
    main()
