"""Probe: does late dispatch cost steady serving anything? The server with each --late-dispatch
mode (off, prefill, on), one after the other, at each --streams concurrency (closed loop: a stream
sends its next request when one ends), each cell benchmarks/server_overhead.py's `serve_cell`.

    python -m benchmarks.probes.late_dispatch_serving --shape v2-lite --num-layers 27
    python -m benchmarks.probes.late_dispatch_serving --shape bundled --streams 1,8 --output-len 16 --kv-memory-gb 0.5 \
        --modes off,on   # CPU smoke

Late dispatch holds the next step back until shortly before the step in flight is predicted to end
(engine/dispatch_timing.py); `on` holds decode steps too, where a host that overruns the lead
leaves the device waiting. Closed-loop streams are where that costs and nothing gains much (each
request arrives as another ends): on one H100 at 64 streams `on` cost TPOT 2-5% (docs/performance.md),
which is why auto holds prefill steps only. Each row has the server's held steps and the held steps
whose launch found the device idle (/metrics over the cell). Prints a table and writes JSON to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging

from benchmarks import serving
from benchmarks.common import table, write_results
from benchmarks.server_overhead import add_cell_args, serve_cell
from benchmarks.shapes import shape_with_tokenizer
from splash_jax.paths import DEFAULT_MODEL

log = logging.getLogger("benchmarks.probes.late_dispatch_serving")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_args(p, kv_memory_gb=20)  # --shape also takes "bundled": the bundled model, its own weights
    p.add_argument("--modes", default="off,prefill,on", help="--late-dispatch values, in order (auto is prefill on GPUs)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    streams = [int(s) for s in a.streams.split(",")]
    if a.shape == "bundled":
        model = f"--model {DEFAULT_MODEL}"
    else:
        overrides = {"num_hidden_layers": a.num_layers} if a.num_layers else {}
        model = f"--model {shape_with_tokenizer(a.shape, a.tokenizer, **overrides)} --load-format dummy"
    base_args = (f"{model} --max-num-seqs {max(streams)} --max-num-batched-tokens "
                 f"{a.max_num_batched_tokens} --kv-memory-gb {a.kv_memory_gb} --max-model-len {a.max_model_len} {a.server_args}")
    rows = []
    for mode in a.modes.split(","):
        with serving.launched_server(f"{base_args} --late-dispatch {mode}", 1800) as base:
            for n in streams:
                rows.append({"late_dispatch": mode, **serve_cell(base, a, n, 1, mix=False)})
                log.info("late dispatch %s, %d streams: TPOT p50 %.3f ms, %.1f tok/s", mode, n, rows[-1]["tpot_p50_ms"],
                         rows[-1]["output_tok_s"])
    first = {r["streams"]: r for r in rows if r["late_dispatch"] == rows[0]["late_dispatch"]}
    for r in rows:
        r["tpot_over_first"] = r["tpot_p50_ms"] / first[r["streams"]]["tpot_p50_ms"]
        r["tok_s_over_first"] = r["output_tok_s"] / first[r["streams"]]["output_tok_s"]
        counts = r.get("late_dispatch_counts") or {}  # the server's /metrics over the cell
        r["held_steps"], r["idle_after_hold"] = counts.get("waits"), counts.get("idle_after_wait")
        r["ended_in_launch"] = counts.get("ended_in_launch")
    print(table(rows, ["late_dispatch", "streams", "output_len", "completed", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms",
                       "output_tok_s", "tpot_over_first", "tok_s_over_first", "engine_steps", "held_steps", "idle_after_hold", "ended_in_launch",
                       "core_cpu_ms_per_step"]))
    write_results("late_dispatch_serving", {"args": vars(a), "server_args": base_args, "rows": rows})


if __name__ == "__main__":
    main()
