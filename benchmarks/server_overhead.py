"""What serving costs over the bare engine: server TPOT against the engine step, one machine, one run.

    python -m benchmarks.server_overhead --shape v2-lite            # GPU: V2-Lite, dummy bf16 weights
    python -m benchmarks.server_overhead --shape tiny --quick       # CPU smoke run

1. The bare engine step (benchmarks/decode_roofline.py, in a subprocess that frees the device when
   it ends): decode at each --streams batch with --context tokens cached, overlapped, greedy; its
   wall time and the GPU busy time from a profiler trace.
2. `python -m serve.main` on the same model and flags (the engine core in its own process), and
   benchmarks/serving.py against it at each --streams concurrency: TPOT p50, output tok/s, and from
   /metrics the core loop thread's CPU seconds per engine step. Then the largest concurrency with
   --json-fraction 0.25 --logprobs-fraction 0.25 (constrained and logprob requests mixed in), and
   again on a server with --api-server-count 2.
3. The largest concurrency's requests through the engine alone (benchmarks/offline.py): the output
   tok/s the server is compared with.
The core's CPU per step is its loop thread's CPU time; CUDA may spin while the loop waits for a
step's tokens, so the time blocked in that wait is reported beside it and subtracted in
`core_cpu_less_wait_over_gpu_step`.
Rows and `tpot_over_engine_step` (TPOT p50 / bare step, keyed by streams) go to
benchmarks/results/server_overhead_<machine>_<time>.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import subprocess
import sys
import time

import httpx

from benchmarks import serving
from benchmarks.common import RESULTS, table, write_results
from benchmarks.shapes import shape_with_tokenizer
from serve.metrics import LATE_DISPATCH_COUNTERS
from splash_jax.paths import DEFAULT_MODEL

log = logging.getLogger("benchmarks.server_overhead")


def bare_steps(args, folder_args: list[str]) -> dict[int, dict]:
    """decode_roofline rows by batch (a subprocess: the device is free again when it returns)."""
    before = set(RESULTS.glob("decode_roofline_*.json"))
    cmd = [sys.executable, "-m", "benchmarks.decode_roofline", *folder_args, "--batches", ",".join(map(str, args.streams)),
           "--contexts", str(args.context), "--sampling", "greedy", "--no-sync", "--steps", str(args.steps),
           "--kv-memory-gb", str(args.kv_memory_gb), "--max-num-seqs", str(max(args.streams)),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len)]
    if args.unroll_max_tokens is not None:
        cmd += ["--unroll-max-tokens", str(args.unroll_max_tokens)]
    log.info("bare engine: %s", shlex.join(cmd))
    subprocess.run(cmd, check=True)
    path = max(set(RESULTS.glob("decode_roofline_*.json")) - before, key=lambda p: p.stat().st_mtime)
    return {row["batch"]: row for row in json.loads(path.read_text())["rows"]}


def offline(args, server_args: str) -> dict:
    """The same largest-concurrency workload through the engine alone (benchmarks/offline.py: every
    request queued at once, max_num_seqs of them running): the output tok/s the server should reach."""
    before = set(RESULTS.glob("offline_*.json"))
    cmd = [sys.executable, "-m", "benchmarks.offline", *shlex.split(server_args), "--num-prompts", str(2 * max(args.streams)),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len_64)]
    log.info("offline engine: %s", shlex.join(cmd))
    subprocess.run(cmd, check=True)
    path = max(set(RESULTS.glob("offline_*.json")) - before, key=lambda p: p.stat().st_mtime)
    return json.loads(path.read_text())["summary"]


# the late dispatch's counters per cell (steps held, idle launches after a hold, ...), as /metrics names them
LATE_COUNTERS = tuple(f"splash_engine_late_dispatch_{suffix}_total" for suffix, _, _ in LATE_DISPATCH_COUNTERS)


def counters(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics").text
    out = {f"phase_{m.group(1)}": float(m.group(2))
           for m in re.finditer(r'^splash_engine_step_host_seconds_total\{phase="(\w+)"\} (\S+)$', text, re.M)}
    for name in ("splash_engine_steps_total", "splash_engine_core_loop_cpu_seconds_total", "splash_api_servers",
                 "splash_engine_device_wait_seconds_total", *LATE_COUNTERS):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


def serve_cell(base: str, args, streams: int, api_servers: int, mix: bool) -> dict:
    output_len = args.output_len if streams < 64 else args.output_len_64
    prompts = max(2 * streams, 4)
    argv = ["--base-url", base, "--tokenizer", str(args.tokenizer), "--num-prompts", str(prompts),
            "--max-concurrency", str(streams), "--input-len", str(args.input_len), "--output-len", str(output_len),
            "--no-save", "--client-processes", str(args.client_processes if streams >= 32 else 1)]
    if mix:
        argv += ["--json-fraction", "0.25", "--logprobs-fraction", "0.25"]
    time.sleep(0.6)  # the stats snapshot refreshes every 0.25 s
    c0 = counters(base)
    record = serving.main(argv)
    time.sleep(0.6)
    c1 = counters(base)
    steps = c1["splash_engine_steps_total"] - c0["splash_engine_steps_total"]
    cpu = c1["splash_engine_core_loop_cpu_seconds_total"] - c0["splash_engine_core_loop_cpu_seconds_total"]
    wait = c1["splash_engine_device_wait_seconds_total"] - c0["splash_engine_device_wait_seconds_total"]
    s = record["summary"]
    phases = {k[6:]: round((c1[k] - c0.get(k, 0.0)) / steps * 1e3, 3) for k in c1 if k.startswith("phase_") and steps}
    if not api_servers:  # no core process: its loop CPU is not counted apart from the HTTP side's
        cpu = None
    return {"streams": streams, "api_servers": api_servers, "mix": "25% json, 25% logprobs" if mix else "plain",
            "engine": "core process" if api_servers else "in the server process",
            "client_cpu_over_duration": s["client_cpu_s"] / s["duration_s"] if s.get("client_cpu_s") else None,
            "output_len": output_len, "completed": s["completed"], "failed": s["failed"],
            "tpot_p50_ms": s["tpot_ms"]["median"], "tpot_p99_ms": s["tpot_ms"]["p99"], "ttft_p50_ms": s["ttft_ms"]["median"],
            "output_tok_s": s["output_throughput"], "core_cpu_ms_per_step": cpu / steps * 1e3 if steps and cpu is not None else None,
            "core_wait_ms_per_step": wait / steps * 1e3 if steps else None,
            "core_cpu_less_wait_ms_per_step": (cpu - wait) / steps * 1e3 if steps and cpu is not None else None,
            "engine_steps": steps, "core_step_ms_by_phase": phases,
            "late_dispatch_counts": {name[len("splash_engine_late_dispatch_"):-len("_total")]: c1[name] - c0[name] for name in LATE_COUNTERS}}


def add_cell_args(p: argparse.ArgumentParser, kv_memory_gb: float) -> None:
    """The model, server and client flags `serve_cell` and the servers it runs against read."""
    p.add_argument("--shape", default="v2-lite")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--tokenizer", default=str(DEFAULT_MODEL), help="tokenizer the shape takes (its vocabulary size too)")
    p.add_argument("--streams", default="1,8,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512, help="below 64 streams")
    p.add_argument("--output-len-64", type=int, default=128, help="at 64 streams and more")
    p.add_argument("--kv-memory-gb", type=float, default=kv_memory_gb)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--server-args", default="", help="more flags for every server")
    p.add_argument("--client-processes", type=int, default=4, help="benchmark client processes at 32 streams and more")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_args(p, kv_memory_gb=40)
    p.add_argument("--context", type=int, default=512, help="cached tokens per request in the bare step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--unroll-max-tokens", type=int, default=None,
                   help="the engine flag, for the bare step, the servers and the engine alone (default: the engine's)")
    p.add_argument("--no-api-server-2", action="store_true", help="skip the --api-server-count 2 server")
    p.add_argument("--in-process", action="store_true", help="also serve with --no-engine-process (api_servers 0 rows)")
    args = p.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    overrides = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
    folder = shape_with_tokenizer(args.shape, args.tokenizer, **overrides)
    layer_args = ["--num-layers", str(args.num_layers)] if args.num_layers else []
    bare = bare_steps(args, ["--shape", args.shape, "--tokenizer", str(args.tokenizer), *layer_args])
    server_args = (f"--model {folder} --load-format dummy --max-num-seqs {max(args.streams)} "
                   f"--max-num-batched-tokens {args.max_num_batched_tokens} --kv-memory-gb {args.kv_memory_gb} "
                   f"--max-model-len {args.max_model_len} {args.server_args}")
    if args.unroll_max_tokens is not None:
        server_args += f" --unroll-max-tokens {args.unroll_max_tokens}"
    rows = []
    with serving.launched_server(server_args, 1800) as base:
        for streams in args.streams:
            rows.append(serve_cell(base, args, streams, 1, mix=False))
        rows.append(serve_cell(base, args, max(args.streams), 1, mix=True))
    if args.in_process:  # the one-process server as it was (the engine on a thread beside HTTP), for comparison
        with serving.launched_server(server_args + " --no-engine-process", 1800) as base:
            for streams in args.streams:
                rows.append(serve_cell(base, args, streams, 0, mix=False))
    if not args.no_api_server_2:
        with serving.launched_server(server_args + " --api-server-count 2", 1800) as base:
            deadline = time.monotonic() + 120
            while counters(base)["splash_api_servers"] < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            rows.append(serve_cell(base, args, max(args.streams), 2, mix=False))
    engine_alone = offline(args, server_args)
    for row in rows:
        b = bare.get(row["streams"], {})
        row["engine_step_ms"], row["gpu_busy_ms"] = b.get("engine_ms"), b.get("gpu_busy_ms")
        row["tpot_over_engine_step"] = row["tpot_p50_ms"] / b["engine_ms"] if b.get("engine_ms") else None
        if row["streams"] == max(args.streams):  # the same requests through the engine alone
            row["engine_tok_s"] = engine_alone["output_tokens_per_s"]
            row["tok_s_over_engine"] = row["output_tok_s"] / row["engine_tok_s"]
        busy = b.get("gpu_busy_ms")
        row["core_cpu_over_gpu_step"] = row["core_cpu_ms_per_step"] / busy if busy and row["core_cpu_ms_per_step"] else None
        less = row["core_cpu_less_wait_ms_per_step"]
        row["core_cpu_less_wait_over_gpu_step"] = less / busy if busy and less is not None else None
    cols = ["streams", "api_servers", "mix", "client_cpu_over_duration", "engine_step_ms", "gpu_busy_ms", "tpot_p50_ms", "tpot_over_engine_step",
            "output_tok_s", "engine_tok_s", "tok_s_over_engine", "core_cpu_ms_per_step", "core_wait_ms_per_step",
            "core_cpu_over_gpu_step", "core_cpu_less_wait_over_gpu_step", "failed"]
    print(table(rows, cols))
    plain = {r["streams"]: r["tpot_over_engine_step"] for r in rows if r["mix"] == "plain" and r["api_servers"] == 1}
    write_results("server_overhead", {"args": {k: v for k, v in vars(args).items()}, "server_args": server_args,
                                      "tpot_over_engine_step": plain, "bare_engine": bare,
                                      "engine_alone_offline": engine_alone, "rows": rows})


if __name__ == "__main__":
    main()
