"""Online serving benchmark against the OpenAI-compatible server, like `vllm bench serve`.

Requests arrive as a Poisson process at --request-rate (inf: all at once), at most
--max-concurrency in flight, with random token-id prompts of --input-len tokens and
--output-len generated tokens (ignore_eos, so lengths are exact; --range-ratio r draws each
uniformly from [len * (1 - r), len * (1 + r)]). Every request streams; the client timestamps
each SSE chunk, which gives per request:
  TTFT  time to the first token
  TPOT  (latency - TTFT) / (output tokens - 1)
  ITL   gaps between successive chunks
and for the run: request and token throughput, mean / median / p99 of each. Results go to a
table on stdout and JSON in benchmarks/results/serving_<machine>_<timestamp>.json.

  python benchmarks/serving.py                          # starts `python -m serve.main` itself
  python benchmarks/serving.py --server-args "--max-num-seqs 32" --num-prompts 500 --request-rate 20
  python benchmarks/serving.py --base-url http://127.0.0.1:8000 --max-concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import numpy as np
from tqdm.auto import tqdm

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from splash_jax.paths import DEFAULT_MODEL  # noqa: E402
from splash_jax.tokenizer import Tokenizer  # noqa: E402

log = logging.getLogger("serving_bench")


@dataclasses.dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    kind: str = "plain"  # "json": constrained by JSON_SCHEMA; "logprobs": asks for 5 top logprobs


@dataclasses.dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


# --- workload ------------------------------------------------------------------------------
def sample_requests(tokenizer: Tokenizer, args: argparse.Namespace, rng: np.random.Generator) -> list[BenchRequest]:
    """Random token ids (no BOS/EOS) so prompt lengths are exact whatever the text looks like."""
    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio)))
        return rng.integers(lo, hi + 1, size=args.num_prompts)

    special = {tokenizer.bos_id, tokenizer.eos_id}
    vocab = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    requests = [
        BenchRequest([int(t) for t in rng.choice(vocab, size=int(n))], int(m))
        for n, m in zip(lengths(args.input_len), lengths(args.output_len))
    ]
    # --json-fraction / --logprobs-fraction of the requests, spread evenly: a constrained and a logprobs mix
    for i, r in enumerate(requests):
        u = (i * 0.6180339887) % 1.0
        if u < args.json_fraction:
            r.kind = "json"
        elif u < args.json_fraction + args.logprobs_fraction:
            r.kind = "logprobs"
    return requests


async def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> AsyncIterator[int]:
    for i in range(n):
        yield i
        if rate != float("inf") and i + 1 < n:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


# --- one request ---------------------------------------------------------------------------
# A schema whose output can run long (a free string), so constrained requests decode as many steps as the others.
JSON_SCHEMA = {"type": "object", "properties": {"notes": {"type": "string"}}, "required": ["notes"]}


def payload(args: argparse.Namespace, model: str, request: BenchRequest, tokenizer: Tokenizer) -> dict:
    body = {
        "model": model, "max_tokens": request.output_len, "temperature": args.temperature, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True,
    }
    if request.kind == "json":
        body["structured_outputs"] = {"json": JSON_SCHEMA}
    elif request.kind == "logprobs":
        body["logprobs"] = 5 if args.endpoint == "completions" else True
        if args.endpoint == "chat":
            body["top_logprobs"] = 5
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": tokenizer.decode(request.prompt_ids)}]
    else:
        body["prompt"] = request.prompt_ids
    return body


async def send(client: httpx.AsyncClient, path: str, body: dict) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    last = result.start
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                now = time.perf_counter()
                if any(c.get("token_ids") for c in event.get("choices", [])):
                    if result.ttft == 0.0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                if event.get("usage"):
                    result.prompt_len = event["usage"]["prompt_tokens"]
                    result.output_len = event["usage"]["completion_tokens"]
        result.latency = last - result.start
        result.ok = result.output_len > 0
        if not result.ok:
            result.error = "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run(args: argparse.Namespace, base_url: str, model: str, requests: list[BenchRequest], tokenizer: Tokenizer,
              barrier=None):
    """-> (results, start, end, this process's CPU seconds). barrier: other client processes start with this one."""
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    limit = args.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    rng = np.random.default_rng(args.seed + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        warm = await send(client, path, payload(args, model, BenchRequest(requests[0].prompt_ids, 2), tokenizer))
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(limit)
        if barrier is not None:
            await asyncio.to_thread(barrier.wait)
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=barrier is not None)

        async def one(i: int) -> RequestResult:
            async with gate:
                result = await send(client, path, payload(args, model, requests[i], tokenizer))
            bar.update(1)
            return result

        t0, cpu0 = time.perf_counter(), time.process_time()
        tasks = [asyncio.create_task(one(i)) async for i in poisson_arrivals(len(requests), args.request_rate, rng)]
        results = await asyncio.gather(*tasks)
        t1 = time.perf_counter()
        bar.close()
    return results, t0, t1, time.process_time() - cpu0


def _client_process(args, base_url, model, requests, tokenizer, barrier, queue) -> None:
    queue.put(asyncio.run(run(args, base_url, model, requests, tokenizer, barrier)))


def run_clients(args, base_url: str, model: str, requests: list[BenchRequest], tokenizer: Tokenizer):
    """The load from --client-processes processes (one Python client saturates near 60 streams of
    fast tokens), each with its share of the requests and of the concurrency and rate, started
    together. -> (results, duration, the busiest client's CPU seconds)."""
    n = args.client_processes
    if n <= 1:
        results, t0, t1, cpu = asyncio.run(run(args, base_url, model, requests, tokenizer))
        return results, t1 - t0, cpu
    import copy
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # the client imports no accelerator runtime
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = []
    for k in range(n):
        sub = copy.copy(args)
        sub.max_concurrency = max(1, (args.max_concurrency or len(requests)) // n)
        sub.request_rate = args.request_rate / n
        sub.seed = args.seed + 17 * k
        procs.append(ctx.Process(target=_client_process, args=(sub, base_url, model, requests[k::n], tokenizer, barrier, queue)))
    for p in procs:
        p.start()
    parts = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    results = [r for part in parts for r in part[0]]
    return results, max(p[2] for p in parts) - min(p[1] for p in parts), max(p[3] for p in parts)


# --- report --------------------------------------------------------------------------------
def step_intervals(metrics_text: str) -> dict:
    """The server's step cadence by kind from /metrics (splash_step_interval_ms, prefill share):
    TPOT above the bare decode step splits into prefill-carrying steps and slower decode steps."""
    out: dict = {}
    for line in metrics_text.splitlines():
        m = re.match(r'splash_step_interval_ms\{kind="(\w+)",stat="(\w+)"\} ([0-9.eE+-]+)', line)
        if m:
            out.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
        elif line.startswith("splash_step_prefill_share "):
            out["prefill_share"] = float(line.split()[1])
    return out



def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tokens": sum(r.prompt_len for r in ok), "output_tokens": sum(r.output_len for r in ok),
    }
    out["input_throughput"] = out["input_tokens"] / duration
    out["output_throughput"] = out["output_tokens"] / duration
    out["total_throughput"] = (out["input_tokens"] + out["output_tokens"]) / duration
    series = {
        "ttft_ms": [r.ttft * 1e3 for r in ok],
        "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl_ms": [x * 1e3 for r in ok for x in r.itl],
        "e2e_ms": [r.latency * 1e3 for r in ok],
    }
    for name, values in series.items():
        arr = np.array(values) if values else np.zeros(1)
        out[name] = {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        out["errors"] = errors[:10]
    return out


def table(s: dict) -> str:
    rows = [
        ("Successful requests", f"{s['completed']}"), ("Failed requests", f"{s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", f"{s['input_tokens']}"), ("Total generated tokens", f"{s['output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{s['total_throughput']:.1f}"),
    ]
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {title} (ms)", f"{s[key][stat]:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    line = "=" * (width + 12)
    return "\n".join([line, " Serving benchmark result ".center(width + 12, "="), *(f"{k:<{width}}{v:>12}" for k, v in rows), line])


def machine_tag(version: dict) -> str:
    kind = re.sub(r"[^a-z0-9]+", "-", version.get("device_kind", "unknown").lower()).strip("-")
    n = version.get("num_devices", 1)
    return kind + (f"x{n}" if n > 1 else "")


# --- the server under test -----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(server_args: str, ready_timeout: float, env: dict[str, str] | None = None) -> Iterator[str]:
    """`python -m serve.main` on a free local port until the block ends; its log in a temp file.
    env: variables set for the server beside this process's (XLA_PYTHON_CLIENT_MEM_FRACTION for two
    servers sharing a GPU)."""
    port = _free_port()
    log_file = tempfile.NamedTemporaryFile("w", prefix="serve_", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "serve.main", "--port", str(port), "--no-access-log", *shlex.split(server_args)]
    log.info("starting %s (log: %s)", " ".join(cmd), log_file.name)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                            env={**os.environ, **env} if env else None)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}); see {log_file.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready in {ready_timeout}s; see {log_file.name}")
            time.sleep(0.5)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("splash-jax", "jax", "jaxlib", "httpx", "numpy"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server; default: start `python -m serve.main`")
    parser.add_argument("--server-args", default="", help="flags for the server this script starts")
    parser.add_argument("--ready-timeout", type=float, default=1800, help="seconds to wait for the started server")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--tokenizer", default=str(DEFAULT_MODEL), help="model folder whose tokenizer makes the prompts")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="0: fixed lengths; r: uniform in len*(1±r)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--client-processes", type=int, default=1, help="client processes sharing the load (and the concurrency)")
    parser.add_argument("--json-fraction", type=float, default=0.0, help="share of requests constrained by a JSON schema")
    parser.add_argument("--logprobs-fraction", type=float, default=0.0, help="share of requests asking for 5 top logprobs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    parser.add_argument("--result-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    tokenizer = Tokenizer(args.tokenizer)
    requests = sample_requests(tokenizer, args, np.random.default_rng(args.seed))
    server = contextlib.nullcontext(args.base_url) if args.base_url else launched_server(args.server_args, args.ready_timeout)
    with server as base_url:
        model = args.model or httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
        server_version = httpx.get(base_url + "/version").json()
        log.info("benchmarking %s at %s (%s)", model, base_url, server_version)
        results, duration, client_cpu = run_clients(args, base_url, model, requests, tokenizer)
        layout = httpx.get(base_url + "/v1/layout").json()
        steps = step_intervals(httpx.get(base_url + "/metrics").text)
    summary = summarize(results, duration)
    summary["client_cpu_s"] = client_cpu  # the busiest client process's CPU: near duration_s, the client is the limit
    print(table(summary))
    if steps:
        print("engine step intervals (ms; back-to-back steps, by kind): " + json.dumps(steps))

    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "platform": platform.platform(), "cpu_count": os.cpu_count(), "server": server_version},
        "versions": versions(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "args": {k: (str(v) if isinstance(v, float) and v == float("inf") else v) for k, v in vars(args).items()},
        "model": model, "layout": layout, "summary": summary, "step_intervals_ms": steps,
        "requests": [
            {"prompt_len": r.prompt_len, "output_len": r.output_len, "ttft_s": r.ttft, "latency_s": r.latency, "error": r.error}
            for r in results
        ],
    }
    if not args.no_save:
        out_dir = pathlib.Path(args.result_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        path = out_dir / f"serving_{machine_tag(server_version)}_{stamp}.json"
        path.write_text(json.dumps(record, indent=1))
        log.info("wrote %s", path)
    return record


if __name__ == "__main__":
    main()
