"""Cost of live layout switches: bytes moved, wall time, steps overlapped, per-step overhead.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m benchmarks.switching

For each ordered pair of layouts (12): the engine runs `--batch` requests decoding at
`--context` tokens in the source layout; the baseline is the median step time there; then the
switch starts and every step until it is done is timed. Overhead of a step = (its time -
baseline) / baseline. Reported per pair and as median / p99 over all transition steps (the
paper reports a median under 0.51%). On the CPU mesh 8 "devices" share 2 cores, so copies
cannot overlap compute: the CPU numbers bound the mechanics, not the GPU overhead.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time

import numpy as np

from benchmarks.common import percentiles, table, write_results
from benchmarks.harness import clear, inject_decoding
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig
from splash_jax.mesh.layouts import LAYOUT_NAMES

log = logging.getLogger("benchmarks.switching")


def timed_step(engine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def switch_to(engine, dst: str) -> None:
    h = engine.switch_layout(dst)
    while not h.done:
        engine.step()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="", help="v2-lite | v3 (dummy weights); empty = bundled model")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--baseline-steps", type=int, default=5)
    parser.add_argument("--chunk-pages", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-memory-gb", type=float, default=0.05)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("splash_jax.switch.controller").setLevel(logging.WARNING)
    model = ""
    if args.shape:
        model = str(shape_folder(args.shape, **({"num_hidden_layers": args.num_layers} if args.num_layers else {})))
    engine = Engine(EngineConfig(
        model=model, load_format="dummy" if model else "auto", layout="tp", num_devices=args.devices,
        page_size=args.page_size, kv_memory_gb=args.kv_memory_gb, max_model_len=args.context + 1024,
        max_num_seqs=args.batch, max_num_batched_tokens=max(args.batch, 8), enable_switching=True,
        switch_chunk_pages=args.chunk_pages, compile_cache_dir=None, dtype=args.dtype,
    ))
    rows, overheads = [], []
    for src, dst in itertools.permutations(LAYOUT_NAMES, 2):
        switch_to(engine, src)
        reqs = inject_decoding(engine, args.batch, args.context, tag=f"{src}{dst}")
        for _ in range(2):
            engine.step()  # settle
        base = float(np.median([timed_step(engine) for _ in range(args.baseline_steps)]))
        t0 = time.perf_counter()
        handle = engine.switch_layout(dst)
        during = []
        while not handle.done:
            during.append(timed_step(engine))
        wall = time.perf_counter() - t0
        step_overheads = [(t - base) / base for t in during]
        overheads += step_overheads
        info = handle.as_dict()
        rows.append({
            "pair": f"{src}->{dst}", "state": info["state"], "cache_MB": info["bytes_moved"] / 1e6,
            "weights_MB": info["plan"].get("weight_bytes_gathered", 0) / 1e6,
            "pages_copied": info["pages_copied"], "pages_reused": info["plan"].get("pages_reused"),
            "wall_ms": wall * 1e3, "handoff_ms": info["handoff_s"] * 1e3, "steps": len(during),
            "base_step_ms": base * 1e3, "overhead_median": float(np.median(step_overheads)) if during else None,
            "overhead_max": max(step_overheads) if during else None,
        })
        log.info("%s", rows[-1])
        clear(engine, reqs)
    summary = {"per_step_overhead": percentiles(overheads, (50, 99)), "transitions": len(rows)}
    print(table(rows, ["pair", "state", "cache_MB", "weights_MB", "pages_copied", "pages_reused", "wall_ms",
                       "handoff_ms", "steps", "base_step_ms", "overhead_median", "overhead_max"]))
    print(f"per-step overhead during transitions: median {summary['per_step_overhead']['p50']:.2%}, "
          f"p99 {summary['per_step_overhead']['p99']:.2%} (paper: median < 0.51%)")
    write_results("switching", {"args": vars(args), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
