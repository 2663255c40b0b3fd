"""Host time to launch one decode step program: alone, queued behind the previous step, and
where that time goes (CUDA driver calls from a profiler trace).

XLA records a step's kernels in CUDA graphs (command buffers); a graph whose buffers moved must be
updated before it runs, and a loop whose step needs a value from the device (a dynamic offset
read back, an unknown trip count) makes the host wait for the device mid-launch. Each case calls
the same compiled greedy step program on an all-padding step and times the call itself:
  pinned    the packed step put in pinned host memory per call, the program moves it to the
            device (executor.step_input, the GPU default); prev_tokens fed from the last call's
            output (the engine's chain)
  device    the packed step put in device memory per call (--step-input-memory device)
  reused    the same device buffer every call for the packed step and prev_tokens
  tokens    the same packed buffer, prev_tokens chained
  sampled   as pinned, with the full step program (random draws, logprobs, penalties) and then
            the sampler program: the two launches of a step with sampling parameters
  sampled-device  as sampled, the packed step in device memory
  fused     the fused full step (executor.fuses: it samples inside, FULL_MODE like sampled), its
            packed step in pinned host memory: one launch, as the engine runs small full steps
  full-only as sampled-device without the sampler program (its logits dropped): whether what
            the sampler program allocates between two full steps moves the full step's buffers
  copied    as pinned, each call after the page-copy program (kv/page_copy.py, copying nothing):
            the first step of a fully cached prompt runs behind a copy-on-write copy; whether a
            program between two steps that rewrites the pool moves the step's graph buffers
First each case waits for the device after every call (the launch on an idle device); then
`--rounds` rounds run each case `--calls` times back to back, nothing waited for (queued-*): if
the launch takes as long as the device's work the host waits for the device inside the launch;
the wall time per call against GPU busy says whether the device waited for the host. Then
`--trace-calls` queued calls of each `--trace-cases` run under the profiler; host-side events
(driver API calls, XLA thunks) are summed by name per call, with the time each spent while the
GPU was idle. docs/kernels.md has the findings.

  PYTHONPATH=. python benchmarks/probes/launch_cost.py [--shape v2-lite] [--calls 200]
      [--no-scan-layers] [--unroll-max-tokens 8] [--xla-option xla_gpu_enable_dynamic_slice_fusion=false ...]
"""
import argparse
import collections
import glob
import logging
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import table, write_results
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.sampler import FULL_MODE
from splash_jax.engine.step_packer import pack_step, step_buffer
from splash_jax.kv.page_copy import no_copies

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


CASES = ("pinned", "device", "reused", "tokens", "sampled", "sampled-device", "fused", "full-only", "copied")  # which inputs are fresh per call (see the docstring)
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
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the queued cases (medians reported)")
    ap.add_argument("--trace-cases", default="pinned,copied", help="queued cases traced under the profiler")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--unroll-max-tokens", type=int, default=EngineConfig.unroll_max_tokens)
    ap.add_argument("--xla-option", action="append", default=[], help="KEY=VALUE added to the step program's compile options")
    ap.add_argument("--dump-hlo", default="", help="folder to write each compiled program's optimized HLO to")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = shape_folder(args.shape, **({"num_hidden_layers": args.num_layers} if args.num_layers else {}))
    engine = Engine(EngineConfig(model=str(folder), load_format="dummy", page_size=64, kv_memory_gb=8,
                                 max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=8, warmup=False,
                                 scan_layers=args.scan_layers, unroll_max_tokens=args.unroll_max_tokens,
                                 step_input_memory="device", compile_cache_dir=""))
    ex = engine.executor
    bucket = ex.buckets(engine.layout)[0]
    key = (False, ex.unrolled(bucket))
    for opt in args.xla_option:
        k, v = parse_option(opt)
        ex.compiler_options[key][k] = v
    packed = pack_step(ex.shape(engine.layout, bucket), [], engine.scheduler.tables, engine.slot_sampling,
                       engine.config.page_size)
    buffer = step_buffer(packed.rep, packed.dev)
    programs, shardings, compile_s = {}, {}, {}
    for memory in ("device", "pinned_host"):  # the step program for each place of its input
        shardings[memory] = ex.per_device.with_memory_kind(memory)
        ex.input_sharding = lambda full=False, s=shardings[memory]: s  # the probe picks, full or not
        t = time.perf_counter()
        programs[memory] = ex._compile(ex.lower(engine.layout, bucket), False, ex.unrolled(bucket))
        compile_s[memory] = time.perf_counter() - t
        log.info("compiled the %s-input program in %.1fs with options %s", memory, compile_s[memory], ex.compiler_options[key])
    full_programs = {}
    for memory in ("device", "pinned_host"):  # the full step program (then the sampler program)
        ex.input_sharding = lambda full=False, s=shardings[memory]: s
        t = time.perf_counter()
        full_programs[memory] = ex._compile(ex.lower(engine.layout, bucket, full=True), False, ex.unrolled(bucket))
        compile_s[f"full-{memory}"] = time.perf_counter() - t
    logit_rows = ex.shape(engine.layout, bucket).rows
    ex.sampler_program(logit_rows, FULL_MODE)
    ex.fused_max_tokens = bucket.tokens  # the fused variant of this bucket (the probe's engine may not fuse)
    ex.input_sharding = lambda full=False: shardings["pinned_host"]
    t = time.perf_counter()
    fused_program = ex._compile(ex.lower(engine.layout, bucket, full=True, mode=FULL_MODE), False, ex.unrolled(bucket))
    compile_s["fused"] = time.perf_counter() - t
    open_mask = ex.open_mask(logit_rows)
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        texts = {f"step-{m}": p.as_text() for m, p in programs.items()} | {f"full-{m}": p.as_text() for m, p in full_programs.items()}
        texts["sampler"] = ex.sampler_program(logit_rows, FULL_MODE).as_text()
        texts["fused"] = fused_program.as_text()
        for name, text in texts.items():
            with open(os.path.join(args.dump_hlo, f"{name}.hlo.txt"), "w") as f:
                f.write(text)
        log.info("wrote the optimized HLO of %s to %s", sorted(texts), args.dump_hlo)
    reused = jax.device_put(buffer, shardings["device"])
    no_copy = no_copies(engine.allocator)
    prev_fixed = ex.prev_tokens
    times = collections.defaultdict(list)  # case -> [(put s, launch s)]

    def call(case, wait=True):
        """One call of the step program with this case's inputs; returns the launch time."""
        t = time.perf_counter()
        memory = "device" if case in ("device", "reused", "tokens", "sampled-device", "full-only") else "pinned_host"
        buf = reused if case in ("reused", "tokens") else jax.device_put(buffer, shardings[memory])
        prev = prev_fixed if case == "reused" else ex.prev_tokens
        if case == "copied":
            ex.copy_pages(no_copy)
        t1 = time.perf_counter()
        if case == "fused":
            out, ex.kv, ex.penalties = fused_program(tuple(ex.params), ex.kv, ex.penalties, prev, buf, open_mask)
        elif case == "full-only":
            logits, ex.kv, ex.penalties = full_programs[memory](tuple(ex.params), ex.kv, ex.penalties, prev, buf)
            out = logits.sampling  # prev_tokens stay (a full step's tokens come from its sampler)
        elif case.startswith("sampled"):
            logits, ex.kv, ex.penalties = full_programs[memory](tuple(ex.params), ex.kv, ex.penalties, prev, buf)
            out = ex.sample(logits)
        else:
            out, ex.kv, ex.penalties = programs[memory](tuple(ex.params), ex.kv, ex.penalties, prev, buf)
        launch = time.perf_counter() - t1
        times[case].append((t1 - t, launch))
        if case != "full-only":
            ex.prev_tokens = out.tokens
        if wait:
            jax.block_until_ready(out)
        return launch

    rows = []
    for case in CASES:
        for _ in range(10):
            call(case)
        t = [call(case) for _ in range(args.calls)]
        rows.append({"case": case, "launch_ms_p50": float(np.median(t)) * 1e3, "launch_ms_p90": float(np.percentile(t, 90)) * 1e3})
        log.info("%s", rows[-1])
    walls = collections.defaultdict(list)  # case -> (wall, host loop) ms per call, one per round
    for _ in range(args.rounds):  # rounds interleave the cases, so a drift of the machine hits all
        for case in CASES:
            jax.block_until_ready((ex.kv, ex.prev_tokens))
            times[case] = []
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call(case, wait=False)
            host = time.perf_counter() - t0
            jax.block_until_ready((ex.kv, ex.prev_tokens))
            walls[case].append(((time.perf_counter() - t0) / args.calls * 1e3, host / args.calls * 1e3))
    for case in CASES:
        puts, t = [p for p, _ in times[case]], [l for _, l in times[case]]  # the last round's calls
        rows.append({"case": f"queued-{case}", "put_ms_p50": float(np.median(puts)) * 1e3,
                     "launch_ms_p50": float(np.median(t)) * 1e3, "launch_ms_p90": float(np.percentile(t, 90)) * 1e3,
                     "host_loop_ms_per_call": float(np.median([h for _, h in walls[case]])),
                     "wall_ms_per_call": float(np.median([w for w, _ in walls[case]])),
                     "wall_ms_rounds": [round(w, 3) for w, _ in walls[case]]})
        log.info("%s", rows[-1])
    traced = {}
    for case in [c for c in args.trace_cases.split(",") if c]:
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
    for case, (_, busy_) in traced.items():
        for row in rows:
            if row["case"] == f"queued-{case}":
                row["gpu_busy_ms_per_call"] = busy_
    print(f"compile {compile_s}, options {ex.compiler_options[key]}")
    print(table(rows, ["case", "put_ms_p50", "launch_ms_p50", "launch_ms_p90", "host_loop_ms_per_call",
                       "wall_ms_per_call", "gpu_busy_ms_per_call", "wall_ms_rounds"]))
    for case, (ev, busy_) in traced.items():
        print(f"traced queued-{case}: GPU busy {busy_:.3f} ms per call" if busy_ else f"traced queued-{case}")
        print(table(ev, ["event", "ms_per_call", "count_per_call", "ms_in_gpu_gaps"]))
    write_results("launch_cost", {"args": vars(args), "compile_s": compile_s, "compiler_options": ex.compiler_options[key],
                                  "rows": rows, "host_events": {case: ev for case, (ev, _) in traced.items()}})


if __name__ == "__main__":
    main()
