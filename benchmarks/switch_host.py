"""Host time of a switch's bookkeeping (no devices involved; the steps have ~1-2 ms of host time
to spare on the H200 host, so this must stay well under that at any device count):
  - each moving step: taking the next chunk of page copies from the per-pair queues and packing
    its index buffer; copies are random (source, destination) device pairs over both pool
    segments, `--requests` x `--pages`; plus the one-off enqueue (locate + queue) at the start;
  - the start: planning every running request's pages (`--requests` requests of `--pages` pages
    each, placed as the source layout places them) for each ordered pair of layouts.

    python -m benchmarks.switch_host            # N = 2, 4, 8 devices; K = 16, 64, 256 pages per pair

Prints two tables and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time

import numpy as np

from benchmarks.common import table, write_results
from splash_jax.kv.allocator import PageAllocator
from splash_jax.mesh.layouts import LAYOUT_NAMES, get_layout
from splash_jax.switch.planner import plan_request
from splash_jax.switch.copy_queue import PairQueues
from splash_jax.switch.migration import chunk_buffer, locate_copies, move_sentinel, pack_located

log = logging.getLogger("switch_host")


def random_plan(n: int, requests: int, pages: int, seed: int) -> tuple[PageAllocator, list[tuple[int, int]], np.ndarray]:
    rng = np.random.default_rng(seed)
    total = requests * pages
    alloc = PageAllocator(n, 2 * total + 16, 64, extra_pages_per_device=total + 16)
    src_dev, dst_dev = rng.integers(0, n, total), rng.integers(0, n, total)
    copies = [(alloc.allocate(1, int(a))[0], alloc.allocate(1, int(b))[0]) for a, b in zip(src_dev, dst_dev)]
    return alloc, copies, np.repeat(np.arange(requests), pages)


def measure(n: int, requests: int, pages: int, k: int, seed: int = 0) -> dict:
    alloc, copies, codes = random_plan(n, requests, pages, seed)
    queue = PairQueues(n)
    t0 = time.perf_counter()
    queue.add(locate_copies(copies, alloc), codes)
    enqueue = time.perf_counter() - t0
    steps = []
    while len(queue):
        t0 = time.perf_counter()
        (chunk,) = pack_located(queue.take(k), n, k, move_sentinel(alloc))
        chunk_buffer(chunk)
        steps.append(time.perf_counter() - t0)
    return {
        "devices": n, "requests": requests, "pages_per_request": pages, "chunk_pages": k,
        "copies": len(copies), "steps": len(steps), "enqueue_ms": enqueue * 1e3,
        "step_ms_median": float(np.median(steps)) * 1e3, "step_ms_max": float(np.max(steps)) * 1e3,
    }


def measure_planning(n: int, requests: int, pages: int, src_name: str, dst_name: str, page_size: int = 64,
                     repeats: int = 5) -> dict:
    """plan_request for every request (as a switch's start does): the fastest of `repeats`, ms."""
    import types

    src, dst = get_layout(src_name), get_layout(dst_name)
    per_device = requests * pages + 16
    best, copies = float("inf"), 0
    for _ in range(repeats):
        alloc = PageAllocator(n, 2 * per_device, page_size, extra_pages_per_device=per_device)
        reqs = []
        for i in range(requests):
            owner = i % n
            held = [src.kv_placement.pages_held(d, owner, n, pages) for d in range(n)]
            device_pages = [alloc.allocate(h, d) for d, h in enumerate(held)]
            reqs.append((types.SimpleNamespace(request_id=str(i), num_computed=pages * page_size - 1,
                                               device_pages=device_pages, order=i), owner))
        t0 = time.perf_counter()
        plans = [plan_request(r, src, dst, alloc, not dst.heads_sharded, owner) for r, owner in reqs]
        best = min(best, time.perf_counter() - t0)
        copies = sum(len(p.copies) for p in plans)
    return {"devices": n, "pair": f"{src_name}->{dst_name}", "requests": requests, "pages_per_request": pages,
            "plan_ms": best * 1e3, "copies": copies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--chunk-pages", default="16,64,256")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--pages", type=int, default=64, help="pages to copy per request (64 x 64 tokens = 4K context)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows = []
    for n in [int(x) for x in args.devices.split(",")]:
        for k in [int(x) for x in args.chunk_pages.split(",")]:
            rows.append(measure(n, args.requests, args.pages, k))
            log.info("N=%d K=%d: %.3f ms per step", n, k, rows[-1]["step_ms_median"])
    print(table(rows, ["devices", "chunk_pages", "copies", "steps", "enqueue_ms", "step_ms_median", "step_ms_max"]))
    planning = [measure_planning(n, args.requests, args.pages, a, b)
                for n in [int(x) for x in args.devices.split(",")]
                for a, b in itertools.permutations(LAYOUT_NAMES, 2)]
    print(table(planning, ["devices", "pair", "requests", "pages_per_request", "copies", "plan_ms"]))
    write_results("switch_host", {"args": vars(args), "rows": rows, "planning": planning})


if __name__ == "__main__":
    main()
