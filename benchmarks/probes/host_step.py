"""Where the host's time goes in one decode step at small batch (where the engine step is longer
than the GPU's work): the engine's own phase timers (schedule, dispatch, wait, complete) as
medians, then a cProfile of the same steps, top functions by own time.

  PYTHONPATH=. python benchmarks/probes/host_step.py [--shape v2-lite] [--batch 1] [--context 1024]
"""
import argparse
import cProfile
import io
import logging
import pstats
import time

import numpy as np

from benchmarks.common import write_results
from benchmarks.harness import SAMPLING, inject_decoding
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig

log = logging.getLogger("probe.host_step")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sampling", default="greedy", choices=list(SAMPLING))
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = shape_folder(args.shape, **({"num_hidden_layers": args.num_layers} if args.num_layers else {}))
    engine = Engine(EngineConfig(model=str(folder), load_format="dummy", page_size=64, kv_memory_gb=8,
                                 max_model_len=args.context + 512, max_num_seqs=max(args.batch, 8),
                                 max_num_batched_tokens=max(args.batch, 8), warmup=False))
    inject_decoding(engine, args.batch, args.context, sampling=args.sampling)
    for _ in range(20):
        engine.step()
    phases, walls = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
        phases.append(dict(engine.last_step_ms))
    median = {k: float(np.median([p[k] for p in phases])) for k in phases[0]}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"engine.step median {np.median(walls):.3f} ms; phases (median ms): " + ", ".join(f"{k} {v:.3f}" for k, v in median.items()))
    print(out.getvalue())
    write_results("host_step", {"args": vars(args), "step_ms_median": float(np.median(walls)), "phases_ms_median": median,
                                "profile_top": out.getvalue()})


if __name__ == "__main__":
    main()
