"""Probe: does late dispatch cost steady serving anything? The server with --late-dispatch off and
on, one after the other, at each --streams concurrency (closed loop: a stream sends its next
request when one ends).

    python -m benchmarks.probes.late_dispatch_serving --shape v2-lite --num-layers 27
    python -m benchmarks.probes.late_dispatch_serving --shape bundled --streams 1,8 --output-len 16   # CPU smoke

Late dispatch holds the next step back until shortly before the step in flight is predicted to end
(engine/dispatch_timing.py); since it holds decode steps too, a wrong prediction would idle the
device between decode steps. Closed-loop streams are where that costs and nothing gains (each
request arrives as another ends), so TPOT and output tok/s should match. Each cell sends
--prompts-per-stream requests per stream, as benchmarks/server_overhead.py's cells do (its
`serve_cell`). Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging

from benchmarks import serving
from benchmarks.common import table, write_results
from benchmarks.server_overhead import counters
from benchmarks.shapes import shape_with_tokenizer
from splash_jax.paths import DEFAULT_MODEL

log = logging.getLogger("benchmarks.probes.late_dispatch_serving")


def cell(base: str, a: argparse.Namespace, streams: int) -> dict:
    output_len = a.output_len if streams < 64 else a.output_len_64
    argv = ["--base-url", base, "--tokenizer", str(a.tokenizer), "--num-prompts", str(max(a.prompts_per_stream * streams, 4)),
            "--max-concurrency", str(streams), "--input-len", str(a.input_len), "--output-len", str(output_len), "--no-save",
            "--client-processes", str(a.client_processes if streams >= 32 else 1)]
    c0 = counters(base)
    s = serving.main(argv)["summary"]
    c1 = counters(base)
    steps = c1["splash_engine_steps_total"] - c0["splash_engine_steps_total"]
    return {"streams": streams, "output_len": output_len, "completed": s["completed"], "failed": s["failed"],
            "tpot_p50_ms": s["tpot_ms"]["median"], "tpot_p99_ms": s["tpot_ms"]["p99"], "ttft_p50_ms": s["ttft_ms"]["median"],
            "output_tok_s": s["output_throughput"], "engine_steps": steps}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="v2-lite", help="benchmarks/shapes.py's (dummy weights), or bundled: the bundled model")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--tokenizer", default=str(DEFAULT_MODEL))
    p.add_argument("--streams", default="1,8,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512, help="below 64 streams")
    p.add_argument("--output-len-64", type=int, default=128, help="at 64 streams and more")
    p.add_argument("--prompts-per-stream", type=int, default=3)
    p.add_argument("--kv-memory-gb", type=float, default=20)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--modes", default="off,on", help="--late-dispatch values, in order")
    p.add_argument("--server-args", default="", help="more flags for every server")
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
                rows.append({"late_dispatch": mode, **cell(base, a, n)})
                log.info("late dispatch %s, %d streams: TPOT p50 %.3f ms, %.1f tok/s", mode, n, rows[-1]["tpot_p50_ms"],
                         rows[-1]["output_tok_s"])
    first = {r["streams"]: r for r in rows if r["late_dispatch"] == rows[0]["late_dispatch"]}
    for r in rows:
        r["tpot_over_first"] = r["tpot_p50_ms"] / first[r["streams"]]["tpot_p50_ms"]
        r["tok_s_over_first"] = r["output_tok_s"] / first[r["streams"]]["output_tok_s"]
    print(table(rows, ["late_dispatch", "streams", "output_len", "completed", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms",
                       "output_tok_s", "tpot_over_first", "tok_s_over_first", "engine_steps"]))
    write_results("late_dispatch_serving", {"args": vars(a), "server_args": base_args, "rows": rows})


if __name__ == "__main__":
    main()
