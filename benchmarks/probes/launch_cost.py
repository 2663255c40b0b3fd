"""Host time to launch one decode step program: alone, queued behind the previous step, and
where that time goes (CUDA driver calls from a profiler trace).

XLA records a step's kernels in CUDA graphs (command buffers); a graph whose buffers moved must be
updated before it runs, and a loop whose step needs a value from the device (a dynamic offset
read back, an unknown trip count) makes the host wait for the device mid-launch. Each case calls
the same compiled greedy step program on an all-padding step and times the call itself:
  fresh     host buffers put on the device per call (what executor.run does), prev_tokens fed
            from the last call's output (the engine's chain)
  reused    the same device buffers every call for the packed step and prev_tokens
  tokens    the same packed buffers, prev_tokens chained
  fresh-fixed fresh packed buffers, the same prev_tokens buffer every call
First each case waits for the device after every call (the launch on an idle device); then each
runs `--calls` times back to back, nothing waited for (queued-*): if the launch takes as long as
the device's work the host waits for the device inside the launch; the wall time per call
against GPU busy says whether the device waited for the host.
Then `--trace-calls` queued calls of each case run under the profiler; host-side events (driver
API calls, XLA thunks) are summed by name per call, with the time each spent while the GPU was idle.

  PYTHONPATH=. python benchmarks/probes/launch_cost.py [--shape v2-lite] [--calls 200]
      [--no-scan-layers] [--xla-option xla_gpu_enable_dynamic_slice_fusion=false ...]
"""
import argparse
import collections
import glob
import logging
import shutil
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import table, write_results
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.step_packer import pack_step

log = logging.getLogger("probe.launch_cost")


def parse_option(text: str):
    key, _, value = text.partition("=")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value


QUEUED = ("reused", "tokens", "fresh-fixed", "fresh")  # queued cases: which inputs are fresh per call
# Host events that only wrap the launch (each contains the next): left out of the breakdown.
WRAPPERS = ("PjitFunction", "LoadedExecutable", "ExecuteHelper", "RawLoadedExecutable", "GpuExecutable::ExecuteThunks",
            "XLA GPU module")


def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def host_events(folder: str, calls: int, top: int) -> tuple[list[dict], float | None]:
    """Host-side trace events summed by name (ms and count per call, and ms per call spent while
    the GPU had no kernel running: what the host did while the device waited), and GPU busy per call."""
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    total, count, events, intervals = collections.Counter(), collections.Counter(), [], []
    for plane in data.planes:
        gpu = "gpu" in plane.name.lower()
        for line in plane.lines:
            if gpu and "stream" in line.name.lower():
                intervals += [(int(e.start_ns), int(e.start_ns) + int(e.duration_ns)) for e in line.events]
            elif not gpu:
                for e in line.events:
                    if e.name.startswith("$") or any(w in e.name for w in WRAPPERS):
                        continue
                    name = f"{plane.name.split('/')[-1][:12]}|{e.name[:70]}"
                    total[name] += e.duration_ns
                    count[name] += 1
                    events.append((int(e.start_ns), int(e.start_ns) + int(e.duration_ns), name))
    busy = _union(intervals)
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    in_gaps = collections.Counter()
    for a, b, name in events:  # overlap of each host event with the GPU's idle gaps
        for g0, g1 in gaps:
            if g0 >= b:
                break
            if g1 > a:
                in_gaps[name] += min(b, g1) - max(a, g0)
    rows = [{"event": k, "ms_per_call": v / calls / 1e6, "count_per_call": count[k] / calls,
             "ms_in_gpu_gaps": in_gaps[k] / calls / 1e6} for k, v in total.most_common(top)]
    busy_ms = sum(b - a for a, b in busy) / calls / 1e6 if intervals else None
    if gaps:
        rows.append({"event": "(GPU idle between kernels, inside the window)", "ms_per_call": sum(b - a for a, b in gaps) / calls / 1e6,
                     "count_per_call": len(gaps) / calls, "ms_in_gpu_gaps": None})
    return rows, busy_ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--trace-calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--xla-option", action="append", default=[], help="KEY=VALUE added to the step program's compile options")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = shape_folder(args.shape, **({"num_hidden_layers": args.num_layers} if args.num_layers else {}))
    engine = Engine(EngineConfig(model=str(folder), load_format="dummy", page_size=64, kv_memory_gb=8,
                                 max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=8, warmup=False,
                                 scan_layers=args.scan_layers, unroll_max_tokens=0, compile_cache_dir=""))
    ex = engine.executor
    for opt in args.xla_option:
        k, v = parse_option(opt)
        ex.compiler_options[(False, False)][k] = v
    bucket = ex.buckets(engine.layout)[0]
    packed = pack_step(ex.shape(engine.layout, bucket), [], engine.scheduler.tables, engine.slot_sampling,
                       engine.config.page_size)
    t = time.perf_counter()
    program = ex.compiled(engine.layout, bucket)
    compile_s = time.perf_counter() - t
    log.info("compiled in %.1fs with options %s", compile_s, ex.compiler_options[(False, False)])
    twin = ex._compile(ex.lower(engine.layout, bucket), False)  # a second copy: its own command buffers
    rep_d, dev_d = jax.device_put(packed.rep, ex.replicated), jax.device_put(packed.dev, ex.per_device)
    prev_fixed = ex.prev_tokens

    def call(case, wait=True):
        """case: fresh | reused | tokens (see the docstring); `fresh-fixed`: fresh packed buffers,
        the same prev_tokens buffer every call."""
        fresh_inputs = case in ("fresh", "fresh-fixed")
        rep = jax.device_put(packed.rep, ex.replicated) if fresh_inputs else rep_d
        dev = jax.device_put(packed.dev, ex.per_device) if fresh_inputs else dev_d
        prev = prev_fixed if case in ("reused", "fresh-fixed") else ex.prev_tokens
        t = time.perf_counter()
        out, ex.kv, ex.penalties = program(tuple(ex.params), ex.kv, ex.penalties, prev, rep, dev)
        launch = time.perf_counter() - t
        ex.prev_tokens = out.tokens
        if wait:
            jax.block_until_ready(out.tokens)
        return launch

    rows = []
    for case in ("fresh", "reused", "tokens", "fresh-fixed"):
        for _ in range(10):
            call(case)
        t = [call(case) for _ in range(args.calls)]
        rows.append({"case": case, "launch_ms_p50": float(np.median(t)) * 1e3, "launch_ms_p90": float(np.percentile(t, 90)) * 1e3})
        log.info("%s", rows[-1])
    for case in QUEUED:
        jax.block_until_ready(ex.kv)
        t0 = time.perf_counter()
        t = [call(case, wait=False) for _ in range(args.calls)]
        host = time.perf_counter() - t0
        jax.block_until_ready((ex.kv, ex.prev_tokens))
        wall = time.perf_counter() - t0
        rows.append({"case": f"queued-{case}", "launch_ms_p50": float(np.median(t)) * 1e3,
                     "launch_ms_p90": float(np.percentile(t, 90)) * 1e3,
                     "host_loop_ms_per_call": host / args.calls * 1e3, "wall_ms_per_call": wall / args.calls * 1e3})
        log.info("%s", rows[-1])
    traced = {}
    for case in QUEUED:
        folder_ = tempfile.mkdtemp(prefix="launch-prof-")
        try:
            jax.block_until_ready((ex.kv, ex.prev_tokens))
            with jax.profiler.trace(folder_):
                for _ in range(args.trace_calls):
                    call(case, wait=False)
                jax.block_until_ready((ex.kv, ex.prev_tokens))
            traced[case] = host_events(folder_, args.trace_calls, args.top)
        finally:
            shutil.rmtree(folder_, ignore_errors=True)
    print(f"compile {compile_s:.1f} s, options {ex.compiler_options[(False, False)]}")
    print(table(rows, ["case", "launch_ms_p50", "launch_ms_p90", "host_loop_ms_per_call", "wall_ms_per_call", "gpu_busy_ms_per_call"]))
    for case, (ev, busy_) in traced.items():
        print(f"traced queued-{case}: GPU busy {busy_:.3f} ms per call" if busy_ else f"traced queued-{case}")
        print(table(ev, ["event", "ms_per_call", "count_per_call", "ms_in_gpu_gaps"]))
    write_results("launch_cost", {"args": vars(args), "compile_s": compile_s, "compiler_options": ex.compiler_options[(False, False)], "rows": rows,
                                  "host_events": {case: ev for case, (ev, _) in traced.items()}})


if __name__ == "__main__":
    main()
