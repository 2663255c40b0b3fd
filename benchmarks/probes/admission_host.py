"""Probe: the scheduler's host time to admit a fully cached prompt, by prompt length.

    python -m benchmarks.probes.admission_host --tokens 4096,16384,32768 --placement replicated

An agent's next turn arrives with its whole history cached (16-32K tokens: 256-512 pages), and its
admission runs on the engine thread between two steps, so every running request's next token waits
for it. This builds a Scheduler alone (no model, no device): a first request computes and caches the
prompt, then --repeats identical requests are admitted one at a time; each one's first schedule()
call (the admission: the prefix-cache walk, page references, page tables) is timed. Prints a table
and writes JSON to benchmarks/results/. Host-only: run it on the machine whose host you care about.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from benchmarks.common import table, write_results
from splash_jax.engine.request import Request, SamplingParams
from splash_jax.engine.scheduler import Scheduler
from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.placement import OWNER, REPLICATED, STRIPED

log = logging.getLogger("benchmarks.probes.admission_host")
PLACEMENTS = {p.name: p for p in (REPLICATED, OWNER, STRIPED)}


def admission_ms(tokens: int, placement_name: str, devices: int, page_size: int, repeats: int) -> list[float]:
    """Milliseconds of each cached admission's schedule() call."""
    pages = tokens // page_size + 8
    sched = Scheduler(PageAllocator(devices, 4 * pages, page_size), 8, 8192, PLACEMENTS[placement_name],
                      tokens + page_size, pages, enable_prefix_caching=True)
    prompt = np.random.default_rng(0).integers(2, 100_000, tokens).tolist()

    def serve(rid: str) -> float:
        sched.add(Request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        first = None
        while sched.has_work():
            t = time.perf_counter()
            out = sched.schedule()
            first = time.perf_counter() - t if first is None else first
            sched.dispatched(out.chunks)
            sampled = [c for c in out.chunks if c.samples]
            sched.update(out.chunks, list(range(len(sampled))), np.full(len(sampled), 5))
        return first * 1e3

    serve("cold")
    return [serve(f"cached-{i}") for i in range(repeats)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,16384,32768", help="prompt lengths")
    p.add_argument("--placement", default="replicated", choices=sorted(PLACEMENTS), help="tp: replicated, dp and dop: owner, cp: striped")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        ms = admission_ms(tokens, args.placement, args.devices, args.page_size, args.repeats)
        rows.append({"tokens": tokens, "pages": tokens // args.page_size, "min_ms": min(ms),
                     "p50_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90))})
    print(table(rows, ["tokens", "pages", "min_ms", "p50_ms", "p90_ms"]))
    write_results("admission_host", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
