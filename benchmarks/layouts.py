"""Per-layout decode step time and KV capacity over a grid of (running requests, context).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m benchmarks.layouts
    python -m benchmarks.layouts --shape v2-lite --devices 8 --batches 8,64,256 --contexts 1024,8192   # GPUs

Each cell: `batch` requests decoding at `context` tokens (pages placed by the layout, see
benchmarks/harness.py), the mean engine step time, and whether the batch fits the layout's
pool at all. The winner per cell is the fastest layout that fits; a plot shows the map.
On the CPU mesh the 8 "devices" share 2 cores, so times there show mechanics, not speed.
"""

from __future__ import annotations

import argparse
import logging
import time

from benchmarks.common import machine_tag, table, write_results
from benchmarks.harness import clear, inject_decoding
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig
from splash_jax.mesh.layouts import LAYOUT_NAMES

log = logging.getLogger("benchmarks.layouts")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="", help="v2-lite | v3 (dummy weights); empty = bundled model")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layouts", default=",".join(LAYOUT_NAMES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="64,512")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kv-memory-gb", type=float, default=0.02)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    model = ""
    if args.shape:
        overrides = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
        model = str(shape_folder(args.shape, **overrides))
    rows = []
    for name in args.layouts.split(","):
        engine = Engine(EngineConfig(
            model=model, load_format="dummy" if model else "auto", layout=name, num_devices=args.devices,
            page_size=args.page_size, kv_memory_gb=args.kv_memory_gb, max_model_len=max(contexts) + 128,
            max_num_seqs=max(batches), max_num_batched_tokens=max(max(batches), 8), warmup=False,
            compile_cache_dir=None, dtype=args.dtype,
        ))
        capacity = engine.kv_capacity_tokens()
        for ctx in contexts:
            for b in batches:
                row = {"layout": name, "batch": b, "context": ctx, "capacity_tokens": capacity, "step_ms": None}
                try:
                    reqs = inject_decoding(engine, b, ctx, tag=name)
                except MemoryError:
                    row["fits"] = False
                    rows.append(row)
                    continue
                row["fits"] = True
                engine.step()  # compile
                engine.step()
                t = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                row["step_ms"] = (time.perf_counter() - t) / args.steps * 1e3
                row["tokens_per_s"] = b / row["step_ms"] * 1e3
                clear(engine, reqs)
                rows.append(row)
                log.info("%s", row)
        del engine
    winners = []
    for ctx in contexts:
        for b in batches:
            cell = [r for r in rows if r["batch"] == b and r["context"] == ctx and r["fits"]]
            best = min(cell, key=lambda r: r["step_ms"]) if cell else None
            winners.append({"batch": b, "context": ctx, "winner": best["layout"] if best else "none fits"})
    print(table(rows, ["layout", "batch", "context", "fits", "step_ms", "tokens_per_s", "capacity_tokens"]))
    print(table(winners, ["batch", "context", "winner"]))
    path = write_results("layouts", {"args": vars(args), "rows": rows, "winners": winners})
    plot(winners, batches, contexts, path.with_suffix(".png"))


def plot(winners, batches, contexts, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib missing: no plot")
        return
    names = list(LAYOUT_NAMES) + ["none fits"]
    grid = [[names.index(next(w["winner"] for w in winners if w["batch"] == b and w["context"] == c)) for b in batches] for c in contexts]
    fig, ax = plt.subplots(figsize=(1.2 * len(batches) + 2, 0.8 * len(contexts) + 1.5))
    ax.imshow(grid, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for i, c in enumerate(contexts):
        for j, b in enumerate(batches):
            ax.text(j, i, names[grid[i][j]], ha="center", va="center", color="white", fontsize=11)
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_yticks(range(len(contexts)), [str(c) for c in contexts])
    ax.set_xlabel("running requests")
    ax.set_ylabel("context tokens")
    ax.set_title(f"fastest layout that fits ({machine_tag()})")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
