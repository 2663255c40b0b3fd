"""Host time a switch adds to each moving step: taking the next chunk of page copies from the
per-pair queues and packing its index buffer (no devices involved; the steps have ~1-2 ms of host
time to spare on the H200 host, so this must stay well under that at any device count).

    python -m benchmarks.switch_host            # N = 2, 4, 8 devices; K = 16, 64, 256 pages per pair

Copies are random (source device, destination device) pairs over both pool segments, as many as
`--requests` requests x `--pages` pages each. Reports the one-off enqueue (locate + queue, at the
switch's start) and the per-step median/max, and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from benchmarks.common import table, write_results
from splash_jax.kv.allocator import PageAllocator
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
    write_results("switch_host", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
