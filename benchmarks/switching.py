"""Cost of live layout switches, per ordered pair of layouts, against interleaved baselines.

    python -m benchmarks.switching --shape v2-lite --num-layers 4 --devices 2 --batch 64 \\
        --context 4096 --page-size 64 --chunk-pages 16 --kv-memory-gb 40 --dtype bfloat16
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m benchmarks.switching

For each of the 12 ordered pairs: `--batch` requests decode at `--context` tokens in the source
layout; the source baseline is the median of `--baseline-steps` steps just before the switch,
the destination baseline the median of as many steps after it (skipping the first two). Every
step of the switch is timed:
  migration steps  (source layout, carrying page copies inside the step program) vs the source baseline
  handoff step     (the batch boundary: a last source step is dispatched, then pages, weights and
                    layout change while it runs) vs the destination baseline
  handoff window   (the handoff step plus the next, the destination's first dispatch) vs one
                    source plus one destination step: what the handoff costs the token stream
Reported per pair: bytes moved, wall time, steps, handoff time, the overhead of the migration
steps (median, p99), the handoff step's and window's ratios, and the copy rate against the link bandwidth
measured in the same run (all_to_all of 256 MB per device). Nothing is pooled across pairs
except the summary line, which also says how many pairs meet the targets.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import percentiles, table, write_results
from benchmarks.harness import clear, inject_decoding
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig
from splash_jax.mesh.layouts import AXIS, LAYOUT_NAMES

log = logging.getLogger("benchmarks.switching")


def timed_step(engine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def switch_to(engine, dst: str) -> None:
    h = engine.switch_layout(dst)
    while not h.done:
        engine.step()


def link_bandwidth(mesh, mb: int = 256, reps: int = 10) -> float | None:
    """Bytes/s each device sends by all_to_all (what a page move uses), or None on one device."""
    n = mesh.shape[AXIS]
    if n < 2:
        return None
    x = jax.device_put(jnp.ones((n * mb * 2**20 // 2,), jnp.bfloat16), NamedSharding(mesh, P(AXIS)))
    f = jax.jit(jax.shard_map(
        lambda v: jax.lax.all_to_all(v.reshape(n, -1), AXIS, 0, 0, tiled=True).reshape(-1),
        mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
    ))
    jax.block_until_ready(f(x))
    t = time.perf_counter()
    for _ in range(reps):
        y = f(x)
    jax.block_until_ready(y)
    return mb * 2**20 * (n - 1) / n / ((time.perf_counter() - t) / reps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="", help="v2-lite | v3 (dummy weights); empty = bundled model")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--baseline-steps", type=int, default=8)
    parser.add_argument("--chunk-pages", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-memory-gb", type=float, default=0.05)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile-threads", type=int, default=1, help="ahead-of-time compiles in parallel")
    parser.add_argument("--pairs", default="", help="comma-separated src-dst pairs (default: all 12)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("splash_jax.switch.controller").setLevel(logging.WARNING)
    model = ""
    if args.shape:
        model = str(shape_folder(args.shape, **({"num_hidden_layers": args.num_layers} if args.num_layers else {})))
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(
        model=model, load_format="dummy" if model else "auto", layout="tp", num_devices=args.devices,
        page_size=args.page_size, kv_memory_gb=args.kv_memory_gb, max_model_len=args.context + 1024,
        max_num_seqs=args.batch, max_num_batched_tokens=max(args.batch, 8), enable_switching=True,
        switch_chunk_pages=args.chunk_pages, compile_cache_dir=None, dtype=args.dtype, compile_threads=args.compile_threads,
        min_token_bucket=max(args.batch, 8),  # decode-only workload: one bucket per layout is enough
    ))
    log.info("engine ready in %.1fs (%d programs)", time.perf_counter() - t0, engine.executor.num_compiled)
    link = link_bandwidth(engine.mesh)
    log.info("link bandwidth (all_to_all, 256 MB): %s GB/s per device", f"{link / 1e9:.0f}" if link else "n/a")
    pairs = [tuple(p.split("-")) for p in args.pairs.split(",")] if args.pairs else list(itertools.permutations(LAYOUT_NAMES, 2))
    rows, all_overheads = [], []
    for src, dst in pairs:
        switch_to(engine, src)
        reqs = inject_decoding(engine, args.batch, args.context, tag=f"{src}{dst}")
        for _ in range(3):
            engine.step()  # settle
        base_src, base_phases = [], []
        for _ in range(args.baseline_steps):
            base_src.append(timed_step(engine))
            base_phases.append(engine.last_step_ms)
        base_src = float(np.median(base_src))
        t0 = time.perf_counter()
        handle = engine.switch_layout(dst)
        start_ms = (time.perf_counter() - t0) * 1e3  # planning, between two steps (a step is in flight)
        during, during_phases = [], []
        while not handle.done:
            during.append(timed_step(engine))
            during_phases.append({k: round(v, 3) for k, v in engine.last_step_ms.items()})
        handoff_phases = engine.last_step_ms  # the step that handed off (after dispatching in the source)
        wall = time.perf_counter() - t0
        after = [timed_step(engine) for _ in range(args.baseline_steps + 2)]
        base_dst = float(np.median(after[2:]))  # the destination's steps once the switch is behind
        migration, handoff_step = during[:-1], during[-1] if during else None
        # What the handoff costs the token stream: the handoff step's host work may leave the
        # device busy with queued steps, so the step after it can be short. The two steps
        # around the boundary against one source and one destination step (1.0: free).
        window = (handoff_step + after[0]) / (base_src + base_dst) if handoff_step else None
        overheads = [(t - base_src) / base_src for t in migration]
        all_overheads += overheads
        info = handle.as_dict()
        copy_s = sum(migration)
        rows.append({
            "pair": f"{src}->{dst}", "state": info["state"], "cache_MB": info["bytes_moved"] / 1e6,
            "weights_MB": info["plan"].get("weight_bytes_gathered", 0) / 1e6,
            "pages_copied": info["pages_copied"], "pages_reused": info["plan"].get("pages_reused"),
            "wall_ms": wall * 1e3, "steps": len(during), "start_ms": start_ms, "handoff_ms": info["handoff_s"] * 1e3,
            "base_src_ms": base_src * 1e3, "base_dst_ms": base_dst * 1e3,
            "overhead_median": float(np.median(overheads)) if overheads else None,
            "overhead_p99": float(np.percentile(overheads, 99)) if overheads else None,
            "handoff_step_x": handoff_step / base_dst if handoff_step else None,
            "handoff_window_x": window, "first_dst_steps_ms": [t * 1e3 for t in after[:2]],
            "migration_steps_ms": [round(t * 1e3, 3) for t in migration],  # to find the p99 steps
            "migration_step_phases_ms": during_phases[:-1],
            "catch_ups": info["catch_ups"], "pages_at_handoff": info["pages_at_handoff"],
            "copy_GBps": info["bytes_moved"] / copy_s / 1e9 if copy_s and info["bytes_moved"] else None,
            "copy_of_link": info["bytes_moved"] / copy_s / link if copy_s and link and info["bytes_moved"] else None,
            "handoff_phases_ms": info["handoff_phases_ms"], "handoff_step_ms": handoff_step * 1e3 if handoff_step else None,
            # where the handoff step's wall time went (engine.last_step_ms) against the source's
            # steps (median per phase): the handoff phase holds the handoff; wait is device time
            "handoff_step_phases_ms": handoff_phases,
            "base_step_phases_ms": {k: float(np.median([p[k] for p in base_phases])) for k in base_phases[0]},
        })
        log.info("%s", rows[-1])
        clear(engine, reqs)
        engine.flush()
    summary = {
        "per_step_overhead_all_pairs": percentiles(all_overheads, (50, 99)) if all_overheads else None,
        "pairs": len(rows),
        # Only pairs with migration steps have an overhead; metadata-only pairs are not counted as passing.
        "copying_pairs": sum(1 for r in rows if r["overhead_median"] is not None),
        "copying_pairs_median_le_1pct": sum(1 for r in rows if r["overhead_median"] is not None and r["overhead_median"] <= 0.01),
        "copying_pairs_p99_le_10pct": sum(1 for r in rows if r["overhead_p99"] is not None and r["overhead_p99"] <= 0.10),
        "pairs_handoff_step_le_1.1x": sum(1 for r in rows if r["handoff_step_x"] is not None and r["handoff_step_x"] <= 1.1),
        "pairs_handoff_window_le_1.1x": sum(1 for r in rows if r["handoff_window_x"] is not None and r["handoff_window_x"] <= 1.1),
        "link_GBps": link / 1e9 if link else None,
        "compiled_programs": engine.executor.num_compiled,
    }
    print(table(rows, ["pair", "state", "cache_MB", "weights_MB", "pages_copied", "wall_ms", "steps", "start_ms", "handoff_ms",
                       "base_src_ms", "base_dst_ms", "overhead_median", "overhead_p99", "handoff_step_x", "handoff_window_x",
                       "copy_GBps", "copy_of_link"]))
    print(f"summary: {summary}")
    path = write_results("switching", {"args": vars(args), "rows": rows, "summary": summary})
    plot(rows, path.with_suffix(".png"))


def plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [r["pair"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(x - 0.27, [100 * (r["overhead_median"] or 0) for r in rows], 0.27, label="migration step overhead, median (%)")
    ax.bar(x, [100 * ((r["handoff_step_x"] or 1) - 1) for r in rows], 0.27, label="handoff step vs destination (%)")
    ax.bar(x + 0.27, [100 * ((r["handoff_window_x"] or 1) - 1) for r in rows], 0.27,
           label="handoff step + next vs one source + one destination step (%)")
    ax.axhline(1, color="gray", lw=0.8, ls="--")
    ax.set_xticks(x, names, rotation=45)
    ax.set_ylabel("% over baseline")
    ax.legend()
    ax.set_title("Layout switches: per-step overhead by pair")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
