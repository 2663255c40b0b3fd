"""Where the engine core's time goes behind the server: `python -m serve.main` on V2-Lite (dummy
weights), benchmarks/serving.py at each --streams concurrency, and per engine step the core loop's
CPU, its time blocked on the device and its host time by phase (read from /metrics, as
benchmarks/server_overhead.py does). --profile FILE runs the core loop under cProfile
(SPLASH_CORE_PROFILE) and prints its top functions; cProfile slows Python 1.5-3x, so read shares.

  PYTHONPATH=. python benchmarks/probes/core_profile.py --streams 1,8 [--profile /tmp/core.prof]

The bare step to compare with: benchmarks/decode_roofline.py on the same flags (its host_cpu_ms and
phase_ms_p50). Writes benchmarks/results/core_profile_<machine>_<time>.json.
"""
import argparse
import logging
import os
import pstats

from benchmarks import serving
from benchmarks.common import table, write_results
from benchmarks.server_overhead import serve_cell
from benchmarks.shapes import shape_with_tokenizer
from splash_jax.paths import DEFAULT_MODEL

COLS = ["streams", "tpot_p50_ms", "output_tok_s", "core_cpu_ms_per_step", "core_wait_ms_per_step", "core_step_ms_by_phase"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model folder (default: V2-Lite's shape, dummy weights)")
    ap.add_argument("--tokenizer", default=str(DEFAULT_MODEL))
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--kv-memory-gb", type=float, default=20)
    ap.add_argument("--server-args", default="", help="more server flags")
    ap.add_argument("--profile", default="", help="write the core loop's cProfile statistics here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    folder = args.model or shape_with_tokenizer("v2-lite", args.tokenizer)
    server_args = (f"--model {folder} --load-format dummy --max-num-seqs 64 --max-num-batched-tokens 512 "
                   f"--kv-memory-gb {args.kv_memory_gb} --max-model-len 2048 {args.server_args}")
    if args.profile:
        os.environ["SPLASH_CORE_PROFILE"] = args.profile  # the server's core process inherits it
    cell = argparse.Namespace(tokenizer=args.tokenizer, output_len=512, output_len_64=128, input_len=128, client_processes=4)
    with serving.launched_server(server_args, 1800) as base:
        rows = [serve_cell(base, cell, int(s), 1, mix=False) for s in args.streams.split(",")]
    print(table(rows, COLS))
    if args.profile:  # written when the server stopped
        stats = pstats.Stats(args.profile)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumtime").print_stats("splash_jax", 45)
    write_results("core_profile", {"args": vars(args), "server_args": server_args, "rows": rows})


if __name__ == "__main__":
    main()
