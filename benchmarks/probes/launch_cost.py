"""Host time to launch one decode step program, by whether its inputs keep their device addresses.

XLA records a step's kernels in CUDA graphs (command buffers); a graph whose buffers moved must be
updated before it runs. The engine gives every step fresh input buffers (the packed step, the
previous step's tokens). Each case calls the same compiled greedy step program on an all-padding
step and times the call itself (the launch, before the device finishes; the device is waited for
after each call so no queue builds up):
  fresh     host buffers put on the device per call (what executor.run does)
  reused    the same device buffers every call for the packed step and prev_tokens
  tokens    the same packed buffers, prev_tokens fed from the last call's output (the engine's chain)

  PYTHONPATH=. python benchmarks/probes/launch_cost.py [--shape v2-lite] [--calls 200]
"""
import argparse
import logging
import time

import jax
import numpy as np

from benchmarks.common import table, write_results
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.step_packer import pack_step

log = logging.getLogger("probe.launch_cost")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = shape_folder(args.shape, **({"num_hidden_layers": args.num_layers} if args.num_layers else {}))
    engine = Engine(EngineConfig(model=str(folder), load_format="dummy", page_size=64, kv_memory_gb=8,
                                 max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=8, warmup=False,
                                 scan_layers=args.scan_layers))
    ex = engine.executor
    bucket = ex.buckets(engine.layout)[0]
    packed = pack_step(ex.shape(engine.layout, bucket), [], engine.scheduler.tables, engine.slot_sampling,
                       engine.config.page_size)
    program = ex.compiled(engine.layout, bucket)
    rep_d, dev_d = jax.device_put(packed.rep, ex.replicated), jax.device_put(packed.dev, ex.per_device)
    prev_fixed = ex.prev_tokens

    def call(case):
        if case == "fresh":
            rep, dev, prev = jax.device_put(packed.rep, ex.replicated), jax.device_put(packed.dev, ex.per_device), ex.prev_tokens
        else:
            rep, dev, prev = rep_d, dev_d, (prev_fixed if case == "reused" else ex.prev_tokens)
        t = time.perf_counter()
        out, ex.kv, ex.penalties = program(tuple(ex.params), ex.kv, ex.penalties, prev, rep, dev)
        launch = time.perf_counter() - t
        ex.prev_tokens = out.tokens
        jax.block_until_ready(out.tokens)
        return launch

    rows = []
    for case in ("fresh", "reused", "tokens", "fresh"):
        for _ in range(10):
            call(case)
        t = [call(case) for _ in range(args.calls)]
        rows.append({"case": case, "launch_ms_p50": float(np.median(t)) * 1e3, "launch_ms_p90": float(np.percentile(t, 90)) * 1e3})
        log.info("%s", rows[-1])
    print(table(rows, ["case", "launch_ms_p50", "launch_ms_p90"]))
    write_results("launch_cost", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
