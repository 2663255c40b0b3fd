"""Dynamic workloads on every fixed layout and on the policy, same model and pool, one invocation.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.dynamic --num-devices 8 --time-scale 4
    python -m benchmarks.dynamic --shape v3 --num-layers 4 --num-devices 2 --dtype bfloat16 \\
        --page-size 64 --kv-memory-gb 40 --max-num-seqs 128 --max-num-batched-tokens 2048 \\
        --policy-calibration benchmarks/results/calibration_....json  (+ workload sizes)
    ... python -m benchmarks.dynamic --num-devices 8 --time-scale 4 --workloads multiturn,grouped,mooncake \\
        --prefix-caching on,off --runs dp,dop,auto      (shared prefixes, with and without the cache)

One engine (switching enabled) serves every run: a fixed-layout run switches to its layout while
idle and runs with the policy off; the `auto` run starts in `--auto-start` with a fresh policy.
So every run has the same weights, pool, buckets and compiled programs.

Arrivals are by wall clock: a request is added at the first step boundary after its arrival
time, and its TTFT counts from the arrival time. A slower layout therefore falls behind and
queues, as a server would; arrivals by step would hand a slow layout the same batches as a fast
one and hide exactly the effect being measured. (Rollout and pressure arrive all at t=0, so for
them the two are the same.) The simulator (benchmarks/simulate.py) uses the same rule on its
simulated clock.

Workloads with shared prefixes (multiturn, grouped, mooncake: benchmarks/workloads.py) name their
prompts' token blocks; a multiturn follow-up is submitted at the first step boundary after the
turn it follows finished (+ its think time), its TTFT counted from then. `--prefix-caching on,off`
runs every (workload, layout) once per setting, each run starting with an empty cache (it
overrides --enable-prefix-caching); `ideal` emulates a cache that holds every page-aligned
prefix an earlier request had (its pages admitted as computed, the engine's cache off; pages are
not shared, so memory is not what a cache would use). With more than one setting, results are
keyed "workload/setting".

Reports per run: output tokens/s (all output tokens over the time the last one arrived), TTFT and
TPOT p50/p99, preemptions, switches, prompt tokens computed (submitted - served from the cache),
hit rate (cached / submitted prompt tokens), copies per shared page (devices holding each cached
page of the workload's shared prefixes after the run: benchmarks/cache_census.py) and, under
dp/dop, how many owner devices requests got (JSON: requests_per_owner); writes JSON (with every
run's timeline and the policy's decisions) and one timeline plot per workload: layout, running
requests and KV use.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import logging
import time

import jax

from benchmarks import workloads as W
from benchmarks.cache_census import census
from benchmarks.common import percentiles, table, write_results
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.config import add_dataclass_args
from splash_jax.mesh.layouts import LAYOUT_NAMES, get_layout
from splash_jax.policy import TransitionAwarePolicy

log = logging.getLogger("benchmarks.dynamic")
COLORS = {"tp": "tab:blue", "dp": "tab:orange", "dop": "tab:green", "cp": "tab:red"}
CACHING = ("on", "off", "ideal")


@dataclasses.dataclass
class BenchConfig:
    shape: str = ""  # v2-lite | v3 (dummy weights); empty = the bundled model
    num_layers: int = 0  # with --shape: layers of the slice (0 = the full model)
    workloads: str = ",".join(W.WORKLOADS)  # comma-separated: rollout agentic pressure trace multiturn grouped mooncake
    runs: str = "tp,dp,dop,cp,auto"  # fixed layouts and/or auto
    auto_start: str = "dp"  # the layout the auto run starts in
    prefix_caching: str = "on"  # per run, each starting empty: on, off and/or ideal (emulated), comma-separated
    max_run_s: float = 600.0  # a run still going after this is stopped and marked incomplete
    plot: bool = True


@dataclasses.dataclass
class RequestRecord:
    arrival: float | None  # None: a follow-up not submitted yet
    prompt_len: int
    output_len: int
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    cached: int = 0  # prompt tokens served from the prefix cache (ideal: admitted as computed)
    session: int = -1
    turn: int = 0


@dataclasses.dataclass
class Sample:
    """The engine after one step (a point of the timeline)."""

    t: float
    layout: str
    running: int
    waiting: int
    kv_used: float  # fraction of the pool's pages in use
    pages_used: int | None = None  # pages referenced (cached pages no request holds are free)


def summarize(records: list[RequestRecord], samples: list[Sample], preemptions: int, switches: list) -> dict:
    done = [r for r in records if r.finished is not None]
    end = max((r.finished for r in done), default=0.0)
    tokens = sum(r.tokens for r in records)
    ttft = [r.first_token - r.arrival for r in records if r.first_token is not None]
    tpot = [(r.finished - r.first_token) / (r.tokens - 1) for r in done if r.tokens > 1]
    submitted = [r for r in records if r.arrival is not None]
    prompt, cached = sum(r.prompt_len for r in submitted), sum(r.cached for r in submitted)
    pages = [s.pages_used for s in samples if s.pages_used is not None]
    return {
        "requests": len(records), "completed": len(done), "output_tokens": tokens, "makespan_s": end,
        "tokens_per_s": tokens / end if end > 0 else 0.0, "ttft_s": percentiles(ttft, (50, 99)),
        "tpot_s": percentiles(tpot, (50, 99)), "preemptions": preemptions, "switches": switches, "steps": len(samples),
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
        "hit_rate": cached / prompt if prompt else 0.0, "peak_pages_used": max(pages) if pages else None,
    }


def build_engine(config: EngineConfig, bench: BenchConfig, sampled: bool = False) -> Engine:
    """One engine for every run, switching enabled; `sampled`: some request samples (temperature
    > 0), so the full-sampler programs are compiled too (else only the greedy ones)."""
    if bench.shape:
        config.model = str(shape_folder(bench.shape, **({"num_hidden_layers": bench.num_layers} if bench.num_layers else {})))
        config.load_format = "dummy"
    config.enable_switching, config.layout_policy = True, "off"  # the benchmark attaches the policy per run
    warm = config.warmup
    config.warmup = False
    t0 = time.perf_counter()
    engine = Engine(config)
    if warm:  # greedy programs only unless a request samples: half of compile_all's programs
        ex = engine.executor
        for name in LAYOUT_NAMES:
            layout = get_layout(name)
            for b in ex.buckets(layout):
                for moving in ((False, True) if ex.move_pages else (False,)):
                    for full in (False, True) if sampled else (False,):
                        ex.compiled(layout, b, moving, full)
        # First executions (GPU kernel loading, collectives set-up) before any timed run, as the
        # engine's own start-up does (--warmup-runs): otherwise the first layout run pays them.
        if dataclasses.replace(config, warmup=True).resolved_warmup_runs(jax.default_backend()):
            engine.run_every_program_once(full_sampler=sampled)
    log.info("engine ready in %.1fs (%d programs); token capacity per layout: %s", time.perf_counter() - t0,
             engine.executor.num_compiled, {k: v["tokens"] for k, v in engine.capacities().items()})
    return engine


def switch_idle(engine: Engine, dst: str) -> None:
    if engine.layout.name == dst:
        return
    h = engine.switch_layout(dst)
    while not h.done or engine.has_work():  # and the boundary after the handoff that frees source pages
        engine.step()
    if h.state.value != "done":
        raise RuntimeError(f"switch to {dst} while idle: {h.state.value} ({h.reason})")


def set_caching(engine: Engine, caching: str) -> None:
    """Put an idle engine's prefix cache in `caching`'s state, empty: on (cold), off, ideal (off:
    the emulation admits cached prefixes itself)."""
    if caching not in CACHING:
        raise ValueError(f"prefix caching must be one of {', '.join(CACHING)}, got {caching!r}")
    if not hasattr(engine, "set_prefix_caching"):
        if caching == "on":
            raise RuntimeError("prefix caching 'on' needs Engine.set_prefix_caching (the engine core's prefix cache)")
        return  # an engine without a prefix cache is 'off'
    engine.set_prefix_caching(False)  # drops every cached page
    if caching == "on":
        engine.set_prefix_caching(True)


def prefix_stats(engine: Engine) -> dict | None:
    return (engine.stats().get("prefix_cache") or None) if hasattr(engine, "set_prefix_caching") else None


@dataclasses.dataclass
class Served:
    records: list[RequestRecord]
    samples: list[Sample]
    prompts: list[list[int] | None]  # each request's prompt ids (None: never submitted)
    outputs: list[list[int]]  # each request's generated ids
    complete: bool
    preemptions: int
    prefix_cache: dict | None  # the engine's prefix-cache counters over the run (queries, hits, evictions)
    host_ms: dict | None = None  # per step: the scheduler's host time (lookups, admission) and the dispatch's (cache inserts)
    owners: list[int | None] | None = None  # each request's owner device at its first admission under dp/dop, else None


def serve(engine: Engine, arrivals: list[W.Arrival], seed: int, caching: str = "off", max_run_s: float = 600.0,
          label: str = "") -> Served:
    """Serve `arrivals` on an idle engine by the wall clock, prefix caching as `caching` says.

    Open arrivals are added at the first step boundary after their time, a follow-up at the first
    one after the request it follows finished plus its delay; TTFT counts from those times.
    `ideal`: a request whose prompt starts with a page-aligned prefix an earlier request had
    (W.PrefixIndex: its prompt from submission, its prompt + output but the last token, whose KV
    was never computed, once finished) is admitted
    with that prefix counted as computed (Scheduler.admit_cached), the rest prefilled; when it
    does not fit it waits, in order, ahead of the scheduler's queue."""
    set_caching(engine, caching)
    vocab, page = engine.model_config.vocab_size, engine.config.page_size
    n = len(arrivals)
    records = [RequestRecord(a.t if a.follows < 0 else None, a.prompt_len, a.output_len, session=a.session, turn=a.turn)
               for a in arrivals]
    prompts: list[list[int] | None] = [None] * n
    outputs: list[list[int]] = [[] for _ in range(n)]
    followers = collections.defaultdict(list)
    for i, a in enumerate(arrivals):
        if a.follows >= 0:
            followers[a.follows].append(i)
    opened = sorted((i for i, a in enumerate(arrivals) if a.follows < 0), key=lambda i: arrivals[i].t)
    due: list[tuple[float, int]] = []  # follow-ups: (time, index)
    index = W.PrefixIndex(page) if caching == "ideal" else None
    pending: collections.deque = collections.deque()  # ideal: (request, cached tokens) not admitted yet
    cache0, preempt0 = prefix_stats(engine), engine.scheduler.num_preemptions
    samples: list[Sample] = []
    owners: list[int | None] = [None] * n
    seen = [False] * n
    phases: dict[str, list[float]] = {"schedule": [], "dispatch": []}

    def submit(i: int, t: float) -> None:
        a = arrivals[i]
        history = None if a.follows < 0 else prompts[a.follows] + outputs[a.follows]
        ids = prompts[i] = W.build_prompt(a, i, vocab, seed, history)
        params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=a.temperature,
                                seed=W.sampling_seed(i, seed) if a.temperature > 0 else None)
        request = engine.make_request(ids, params, str(i))
        engine.add_request(request)
        records[i].arrival = t
        if index is not None:
            k = index.shared(ids)
            index.add(ids)
            if k:
                engine.scheduler.waiting.remove(request)  # admitted by admit_cached, in order
                pending.append((request, k))
                records[i].cached = k

    nxt, t0, complete = 0, time.perf_counter(), True
    while True:
        now = time.perf_counter() - t0
        while nxt < len(opened) and arrivals[opened[nxt]].t <= now:
            submit(opened[nxt], arrivals[opened[nxt]].t)
            nxt += 1
        while due and due[0][0] <= now:
            t, i = heapq.heappop(due)
            submit(i, t)
        while pending and engine.scheduler.admit_cached(*pending[0]):
            pending.popleft()
        if pending and not engine.has_work():  # does not fit an idle pool as cached: prefill it all
            request, _ = pending.popleft()
            log.warning("%s: request %s does not fit as cached in an idle pool; prefilled", label, request.request_id)
            records[int(request.request_id)].cached = 0
            engine.scheduler.waiting.append(request)
        if not engine.has_work():
            nexts = ([arrivals[opened[nxt]].t] if nxt < len(opened) else []) + ([due[0][0]] if due else [])
            if not nexts:
                break
            time.sleep(max(0.0, min(nexts) - now))
            continue
        delay = engine.dispatch_delay_s()  # a long prefill step runs: arrivals until shortly before it ends join the next
        if delay > 0.0:
            nexts = ([arrivals[opened[nxt]].t] if nxt < len(opened) else []) + ([due[0][0]] if due else [])
            time.sleep(max(0.0, min([delay] + [t - now for t in nexts])))
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        phases["schedule"].append(engine.last_step_ms["schedule"])
        phases["dispatch"].append(engine.last_step_ms["dispatch"])
        owner_bound = engine.layout.kv_placement.owner_bound
        for request in engine.scheduler.running:
            i = int(request.request_id)
            if not seen[i]:
                seen[i] = True
                owners[i] = request.owner if owner_bound else None
        for o in outs:
            i = int(o.request_id)
            r = records[i]
            if o.delta_token_ids and r.first_token is None:
                r.first_token = now
            r.tokens += len(o.delta_token_ids)
            outputs[i] += o.delta_token_ids
            if index is None:
                r.cached = max(r.cached, o.num_cached_tokens)
            if o.finished:
                r.finished = now
                if index is not None:  # its KV: every token but the last one sampled
                    index.add(prompts[i] + outputs[i][:-1])
                for f in followers[i]:
                    heapq.heappush(due, (now + arrivals[f].t, f))
        usage = engine.allocator.usage()
        used = sum(u.used_pages for u in usage)
        samples.append(Sample(now, engine.layout.name, len(engine.scheduler.running), len(engine.scheduler.waiting),
                              used / sum(u.total_pages for u in usage), used))
        if now > max_run_s:
            log.warning("%s: stopped after %.0fs with %d requests unfinished", label, now,
                        sum(r.finished is None for r in records))
            for request, _ in pending:
                engine.scheduler.waiting.append(request)
            for i, r in enumerate(records):
                if r.finished is None and prompts[i] is not None:
                    engine.abort(str(i))
            engine.flush()
            complete = False
            break
    cache1 = prefix_stats(engine)
    delta = None
    if cache0 is not None and cache1 is not None:
        delta = {k: cache1[k] - cache0.get(k, 0) for k in ("queries", "hits", "evictions", "deferred") if k in cache1}
        delta |= {"hit_rate": delta["hits"] / delta["queries"] if delta.get("queries") else 0.0,
                  "cached_pages": cache1.get("cached_pages"), "enabled": cache1.get("enabled")}
    host = {k: percentiles(v, (50, 99)) for k, v in phases.items()}
    return Served(records, samples, prompts, outputs, complete, engine.scheduler.num_preemptions - preempt0, delta,
                  host, owners)


def run(engine: Engine, arrivals: list[W.Arrival], mode: str, bench: BenchConfig, seed: int,
        caching: str = "on") -> dict:
    """Serve `arrivals` in layout `mode` (or `auto`) with prefix caching `caching`; the engine must be idle."""
    engine.policy = None
    switch_idle(engine, bench.auto_start if mode == "auto" else mode)
    if mode == "auto":
        engine.policy = TransitionAwarePolicy(engine, engine.config.policy)
    history0 = len(engine.switcher.history)
    t0 = time.perf_counter()
    s = serve(engine, arrivals, seed, caching, bench.max_run_s, f"{mode}/{caching}")
    switches = [{"t": h.started - t0, "from": h.src, "to": h.dst, "state": h.state.value, "bytes": h.bytes_moved}
                for h in engine.switcher.history[history0:]]
    if mode == "auto":  # the idle switch to the start layout is not the policy's
        switches = [x for x in switches if x["t"] >= 0]
    out = summarize(s.records, s.samples, s.preemptions, switches)
    out |= {"complete": s.complete, "caching": caching, "prefix_cache": s.prefix_cache,
            "timeline": [dataclasses.asdict(x) for x in s.samples],
            "wrong_lengths": sum(r.tokens != r.output_len for r in s.records if r.finished is not None),
            # Where the cache holds the workload's shared prefixes after the run (copies per page), and
            # under dp/dop how many requests each owner device got (cache-aware owners vs balance).
            "cache_census": census(engine, arrivals, seed),
            "requests_per_owner": dict(sorted(collections.Counter(o for o in s.owners if o is not None).items())),
            "owners": s.owners}
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
    """One table row per (workload, run), with the run's throughput over the best fixed layout's
    (of the same prefix-caching setting: a results key is "workload" or "workload/setting") and
    its prompt tokens computed over the same run's with caching off (when that ran too)."""
    rows = []
    for key, runs in results.items():
        fixed = [r["tokens_per_s"] for m, r in runs.items() if m != "auto"]
        best = max(fixed) if fixed else None
        off = results.get(key.split("/")[0] + "/off", {})
        for mode, r in runs.items():
            base = off.get(mode, {}).get("computed_tokens")
            rows.append({
                "workload": key.split("/")[0], "run": mode, "caching": r.get("caching"), "tok_s": r["tokens_per_s"],
                "vs_best_fixed": r["tokens_per_s"] / best if best else None,
                "ttft_p50": r["ttft_s"]["p50"], "ttft_p99": r["ttft_s"]["p99"], "tpot_p50": r["tpot_s"]["p50"],
                "tpot_p99": r["tpot_s"]["p99"], "preempt": r["preemptions"], "switches": len(r["switches"]),
                "computed": r.get("computed_tokens"), "hit_rate": r.get("hit_rate"),
                "computed_vs_off": r["computed_tokens"] / base if base and "computed_tokens" in r else None,
                "copies": (r.get("cache_census") or {}).get("copies_per_shared_page"),
                "owners": len(r.get("requests_per_owner") or {}) or None,
                "steps": r["steps"], "done": f"{r['completed']}/{r['requests']}",
            })
    return rows


COLUMNS = ["workload", "run", "caching", "tok_s", "vs_best_fixed", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
           "preempt", "switches", "computed", "computed_vs_off", "hit_rate", "copies", "owners", "steps", "done"]


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
    settings = bench.prefix_caching.split(",")
    for c in settings:
        if c not in CACHING:
            raise SystemExit(f"--prefix-caching takes {', '.join(CACHING)} (comma-separated), got {c!r}")
    if "on" in settings and not hasattr(Engine, "set_prefix_caching"):
        raise SystemExit("--prefix-caching on needs Engine.set_prefix_caching (the engine core's prefix cache); "
                         "until it lands, pass --prefix-caching off (or off,ideal)")
    made = {wl: W.make(wl, wcfg) for wl in bench.workloads.split(",")}
    engine = build_engine(config, bench, sampled=any(a.temperature > 0 for v in made.values() for a in v))
    results, arrivals = {}, {}
    for wl, arr in made.items():
        for caching in settings:
            key = wl if len(settings) == 1 else f"{wl}/{caching}"
            arrivals[key], results[key] = arr, {}
            for mode in bench.runs.split(","):
                t0 = time.perf_counter()
                results[key][mode] = r = run(engine, arr, mode, bench, wcfg.workload_seed, caching)
                log.info("%s / %s / caching %s: %.4g tok/s, %d/%d done, %d switches, hit rate %.2f, %.1fs", wl, mode,
                         caching, r["tokens_per_s"], r["completed"], r["requests"], len(r["switches"]), r["hit_rate"],
                         time.perf_counter() - t0)
    rows = rows_of(results)
    print(table(rows, COLUMNS))
    facts = engine_facts(engine)
    path = write_results("dynamic", {
        "args": vars(args), "engine": facts, "policy": dataclasses.asdict(config.policy), "rows": rows,
        "arrivals": {k: [dataclasses.asdict(a) for a in v] for k, v in arrivals.items()}, "runs": results,
    })
    if bench.plot:
        for wl, runs in results.items():
            plot(wl, runs, path.with_name(path.stem + f"_{wl.replace('/', '-')}.png"))
    return path


if __name__ == "__main__":
    main()
