"""Offline throughput (like vLLM's benchmark_throughput / SGLang's bench_offline_throughput).

    .venv/bin/python -m benchmarks.offline --num-prompts 64 --input-len 128 --output-len 64

All requests are queued at once; the engine runs them to completion. Reports requests/s,
input+output tokens/s, output tokens/s, and TTFT / TPOT percentiles; writes JSON to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import percentiles, table, write_results
from splash_jax.engine import Engine, EngineConfig, SamplingParams

log = logging.getLogger("benchmarks.offline")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn uniformly in [len*(1-r), len*(1+r)]; 0 = fixed")
    parser.add_argument("--bench-seed", type=int, default=0)
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)

    config = EngineConfig.from_cli_args(args)
    t0 = time.perf_counter()
    engine = Engine(config)
    startup = time.perf_counter() - t0
    rng = np.random.default_rng(args.bench_seed)

    def lengths(mean):
        lo, hi = max(1, int(mean * (1 - args.random_range_ratio))), max(1, int(mean * (1 + args.random_range_ratio)))
        return rng.integers(lo, hi + 1, args.num_prompts)

    in_lens, out_lens = lengths(args.input_len), lengths(args.output_len)
    vocab = engine.model_config.vocab_size
    ids = {}
    start = time.perf_counter()
    for i in range(args.num_prompts):
        prompt = rng.integers(0, vocab, int(in_lens[i])).tolist()
        rid = engine.add_request(prompt, SamplingParams(max_tokens=int(out_lens[i]), ignore_eos=True))
        ids[rid] = i
    done = {}
    with tqdm(total=args.num_prompts, desc="requests", unit="req") as bar:
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
    elapsed = time.perf_counter() - start
    outs = list(done.values())
    n_in, n_out = int(in_lens.sum()), sum(o.num_output_tokens for o in outs)
    summary = {
        "requests_per_s": len(outs) / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "elapsed_s": elapsed,
        "startup_s": startup,
        "steps": engine.num_steps,
        "preemptions": engine.scheduler.num_preemptions,
        "ttft_s": percentiles([o.ttft for o in outs]),
        "tpot_s": percentiles([o.tpot for o in outs if o.tpot is not None]),
    }
    rows = [{"metric": k, "value": v} for k, v in summary.items() if not isinstance(v, dict)]
    rows += [{"metric": f"{k} {p}", "value": v} for k in ("ttft_s", "tpot_s") for p, v in summary[k].items()]
    print(table(rows, ["metric", "value"]))
    write_results("offline", {"args": vars(args), "engine": dataclasses.asdict(config), "summary": summary})
    return summary


if __name__ == "__main__":
    main()
