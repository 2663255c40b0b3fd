"""Probe: a fully cached prompt's TTFT against the decode step, and the cache's host time per step.

    python -m benchmarks.probes.cached_ttft --shape v2-lite --dtype bfloat16 --kv-memory-gb 40 \\
        --max-num-seqs 128 --max-num-batched-tokens 8192

1. A P-token prompt (4,096) runs once (computing and caching it), then the same prompt again
   (--repeats times, medians):
   its TTFT over the engine's decode step at batch 1 (the median interval between that request's
   tokens), as `ttft_over_decode_step`. Admission finds every page cached and computes the last
   token: by default it shares the page of that token and reads its cached latent (`shared`);
   `copied` copies that page on write first, as an MTP engine does (--last-page picks; both are
   timed in turn on one engine). Before copy-on-write the whole last page, 64 tokens, was computed
   again: 4.3 steps on one H200.
   --trace: one more such request under the profiler, its first step's host phases (add_request,
   schedule, dispatch, the program's call) beside its GPU kernels (`first_step_trace`).
2. R requests (64) decoding with distinct 1K-token prompts: the scheduler's and the dispatch's
   host time per step (engine.last_step_ms) with caching on and off, in the same engine.
Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from benchmarks.common import parse_engine_and_bench, percentiles, table, write_results
from benchmarks.profiling import timeline, union_ns
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, SamplingParams

log = logging.getLogger("benchmarks.probes.cached_ttft")


@dataclasses.dataclass
class ProbeConfig:
    shape: str = ""  # v2-lite | v3 (dummy weights); empty = the bundled model
    num_layers: int = 0  # with --shape: layers of the slice (0 = the full model)
    prompt_tokens: int = 4096  # the prompt run twice
    decode_tokens: int = 32  # tokens the cached request generates (its step intervals time a decode step)
    repeats: int = 5  # cached requests timed one after another (medians reported; one TTFT is noisy)
    requests: int = 64  # decoding requests for the host-time part
    context: int = 1024  # their prompt tokens
    steps: int = 64  # decode steps timed per setting
    # how a fully cached prompt treats the page of its last token, each timed in turn on one engine:
    # shared (the default: read in place, nothing written) and/or copied (copy-on-write, as MTP engines do)
    last_page: str = "shared,copied"
    # one more cached request (the first mode) under the profiler: where its first step's time goes,
    # host phases beside the GPU's kernels (`first_step_trace` in the JSON)
    trace: bool = False


def ids(rng, n, vocab):
    return rng.integers(2, vocab, n).tolist()


def timed_request(engine, prompt, max_tokens):
    """(TTFT, token times, cached tokens, host ms per phase of the steps until the first token) of
    one request served alone."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    times, cached, phases = [], 0, []
    while engine.has_work():
        outs = engine.step()
        if not times:
            phases.append({k: round(v, 3) for k, v in engine.last_step_ms.items()})
        for o in outs:
            if o.request_id == rid and o.delta_token_ids:
                times.append(time.perf_counter() - t0)
                cached = o.num_cached_tokens
            if o.request_id == rid and o.error:
                raise RuntimeError(f"the probe's request failed: {o.error}")
    if not times:
        raise RuntimeError("the probe's request returned no token")
    return times, cached, phases


def annotated(obj, name: str, label: str):
    """Wrap obj.name in a profiler annotation `probe:label` (an instance attribute; undone by delattr)."""
    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
        with jax.profiler.TraceAnnotation("probe:" + label):
            return fn(*args, **kwargs)
    setattr(obj, name, wrapped)
    return lambda: delattr(obj, name)


def first_step_trace(engine, prompt, max_tokens) -> dict:
    """One cached request under the profiler: for its first step and for its later decode steps, ms
    from the step's dispatch start to its first kernel, the kernels' span and busy time, and from the
    last kernel's end to the return of the step() call that read the tokens."""
    undo = [annotated(engine, "add_request", "add_request"), annotated(engine, "_dispatch", "dispatch"),
            annotated(engine.scheduler, "schedule", "schedule"), annotated(engine.executor, "run", "run"),
            annotated(engine, "step", "step")]
    try:
        host, kernels = timeline(lambda: timed_request(engine, prompt, max_tokens))
    finally:
        for u in undo:
            u()
    dispatches = [e for e in host if e[0] == "probe:dispatch"]
    steps = [e for e in host if e[0] == "probe:step"]
    runs = [e for e in host if e[0] == "probe:run"]
    adds = [e for e in host if e[0] == "probe:add_request"]
    rows = []
    for i, (_, d0, d1) in enumerate(dispatches):
        nxt = dispatches[i + 1][1] if i + 1 < len(dispatches) else float("inf")
        ks = [k for k in kernels if d0 <= k[0] < nxt]
        if not ks:
            continue
        first, last = ks[0][0], max(b for _, b in ks)
        busy = union_ns(ks)
        run = next((r for r in runs if d0 <= r[1] <= d1), None)
        read = next((s for s in steps if s[2] >= last), None)  # the step() call that returned after its last kernel
        rows.append({"dispatch_ms": (d1 - d0) / 1e6, "program_call_ms": (run[2] - run[1]) / 1e6 if run else None,
                     "dispatch_start_to_first_kernel_ms": (first - d0) / 1e6,
                     "call_start_to_first_kernel_ms": (first - run[1]) / 1e6 if run else None,
                     "kernel_span_ms": (last - first) / 1e6, "gpu_busy_ms": busy / 1e6, "kernels": len(ks),
                     "last_kernel_to_return_ms": (read[2] - last) / 1e6 if read else None})
    out = {"add_request_ms": (adds[0][2] - adds[0][1]) / 1e6 if adds else None,
           "add_request_end_to_first_dispatch_ms": (dispatches[0][1] - adds[0][2]) / 1e6 if adds and dispatches else None,
           "first_step": rows[0] if rows else None,
           "decode_steps_median": {k: float(np.median([r[k] for r in rows[2:]])) for k in rows[0]
                                   if all(r[k] is not None for r in rows[2:])} if len(rows) > 3 else None}
    log.info("first step under the profiler: %s", out)
    return out


def host_times(engine, c, rng, caching: bool):
    engine.set_prefix_caching(caching)
    vocab = engine.model_config.vocab_size
    for i in range(c.requests):
        engine.add_request(ids(rng, c.context, vocab), SamplingParams(max_tokens=c.steps + 64, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running):
        engine.step()  # prefills
    sched, disp, wall = [], [], []
    for _ in range(c.steps):
        t = time.perf_counter()
        engine.step()
        wall.append((time.perf_counter() - t) * 1e3)
        sched.append(engine.last_step_ms["schedule"])
        disp.append(engine.last_step_ms["dispatch"])
    for rid in list(engine._requests):
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return {"caching": caching, "running": c.requests, "schedule_ms": percentiles(sched, (50, 99)),
            "dispatch_ms": percentiles(disp, (50, 99)), "step_ms": percentiles(wall, (50, 99))}


def main(argv=None):
    c, config = parse_engine_and_bench(__doc__, ProbeConfig, argv, "probe")
    if c.shape:
        config.model = str(shape_folder(c.shape, **({"num_hidden_layers": c.num_layers} if c.num_layers else {})))
        config.load_format = "dummy"
    engine = Engine(config)
    rng = np.random.default_rng(0)
    prompt = ids(rng, c.prompt_tokens, engine.model_config.vocab_size)
    engine.set_prefix_caching(True)
    cold, _, _ = timed_request(engine, prompt, c.decode_tokens)
    modes = c.last_page.split(",")
    if not set(modes) <= {"shared", "copied"}:
        raise SystemExit(f"--last-page takes shared and/or copied, got {c.last_page!r}")
    warm = {m: [] for m in modes}
    copied = {m: 0 for m in modes}
    for _ in range(max(c.repeats, 1)):  # the modes interleaved, so drift falls on both
        for m in modes:
            engine.scheduler.share_last_cached_page = m == "shared"
            before = engine.stats()["prefix_cache"]["copied_pages"]
            warm[m].append(timed_request(engine, prompt, c.decode_tokens))
            copied[m] += engine.stats()["prefix_cache"]["copied_pages"] - before
    engine.scheduler.share_last_cached_page = modes[0] == "shared"
    traced = first_step_trace(engine, prompt, c.decode_tokens) if c.trace else None
    engine.scheduler.share_last_cached_page = True
    rows, phases = [], {}
    for m in modes:
        firsts = [w[0][0] for w in warm[m]]
        step = float(np.median([np.median(np.diff(w[0])) for w in warm[m]]))
        phases[m] = warm[m][-1][2]
        rows.append({"last_page": m, "cold_ttft_ms": cold[0] * 1e3, "cached_ttft_ms": float(np.median(firsts)) * 1e3,
                     "cached_tokens": warm[m][-1][1], "decode_step_ms": step * 1e3,
                     "ttft_over_decode_step": float(np.median(firsts)) / step,
                     "cached_ttft_ms_each": [round(f * 1e3, 3) for f in firsts], "copied_pages": copied[m]})
        log.info("%s: host ms per phase of the cached request's steps up to its first token: %s", m, phases[m])
    ttft = rows[0]
    hosts = [host_times(engine, c, rng, on) for on in (False, True)] if c.requests else []
    print(table(rows, [k for k in rows[0] if k != "cached_ttft_ms_each"]))
    if hosts:  # --requests 0: no host-time part
        print(table([{"caching": h["caching"], "running": h["running"], "schedule_p50": h["schedule_ms"]["p50"],
                      "schedule_p99": h["schedule_ms"]["p99"], "dispatch_p50": h["dispatch_ms"]["p50"],
                      "step_p50": h["step_ms"]["p50"]} for h in hosts],
                    ["caching", "running", "schedule_p50", "schedule_p99", "dispatch_p50", "step_p50"]))
    write_results("cached_ttft", {"config": dataclasses.asdict(c), "engine": dataclasses.asdict(config),
                                  "ttft": ttft, "ttft_by_last_page": rows, "first_token_steps_host_ms": phases,
                                  "first_step_trace": traced,
                                  "host": hosts})


if __name__ == "__main__":
    main()
