"""Probe: what XLA thinks each start-up program needs, compiled against an abstract pool.

    python -m benchmarks.probes.compile_memory --shape v2-lite --dtype bfloat16 --kv-memory-gb 40 \\
        --max-num-seqs 128 --max-num-batched-tokens 8192 --max-model-len 36864 --min-bucket 2048 [--fill-gb 70]

Builds the model and the pool as shapes only (splash_jax/aot.AotBuild on this process's mesh), lowers
the step programs of the buckets of at least --min-bucket tokens and compiles them with the
engine's XLA options, one at a time, each under a watchdog (--timeout-s: a compile that runs
longer is reported and the probe exits). --fill-gb first takes that much device memory (as
weights and a pool would) to see whether what is allocated changes XLA's compile. Prints, per
program: compile seconds and memory_analysis() (arguments, outputs, aliased, temporaries).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp

from benchmarks.common import parse_engine_and_bench, table, write_results
from benchmarks.shapes import shape_folder
from splash_jax.aot import AotBuild
from splash_jax.mesh.layouts import make_mesh

log = logging.getLogger("benchmarks.probes.compile_memory")
GiB = 2**30


@dataclasses.dataclass
class ProbeConfig:
    shape: str = "v2-lite"
    num_layers: int = 0  # 0 = the shape's
    min_bucket: int = 2048  # compile the step programs of buckets of at least this many tokens
    max_bucket: int = 1 << 30  # ... and at most this many
    fill_gb: float = 0.0  # device memory taken before compiling
    timeout_s: float = 180.0
    variants: str = ""  # comma list of variant names to keep (greedy, full, full+expanded, ...); empty = all
    extra_options: str = ""  # JSON of XLA options added to the engine's for every compile
    tag: str = ""


def main(argv=None):
    bench, config = parse_engine_and_bench(__doc__, ProbeConfig, argv)
    overrides = {"num_hidden_layers": bench.num_layers} if bench.num_layers else {}
    config.model = str(shape_folder(bench.shape, **overrides))
    config.load_format = "dummy"
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    log.info("device %s: bytes_limit %.2f GiB, in use %.2f GiB", dev, stats.get("bytes_limit", 0) / GiB,
             stats.get("bytes_in_use", 0) / GiB)
    filler = None
    if bench.fill_gb:
        filler = jnp.zeros((int(bench.fill_gb * GiB) // 2,), jnp.bfloat16).block_until_ready()
        stats = dev.memory_stats() or {}
        log.info("filled %.1f GiB: in use %.2f GiB", bench.fill_gb, stats.get("bytes_in_use", 0) / GiB)
    hbm = (stats.get("bytes_limit") or 140 * GiB) / GiB
    build = AotBuild(config, "v5e:1x1", hbm_gib=hbm, mesh=make_mesh(config.num_devices))
    ex = build.executor
    if bench.extra_options:
        extra = json.loads(bench.extra_options)
        ex.compiler_options = {k: {**v, **extra} for k, v in ex.compiler_options.items()}
    wanted = set(filter(None, bench.variants.split(",")))
    log.info("%d programs at start-up: %s", len(build.programs()), [p.name for p in build.programs()])
    rows = []
    for program in build.programs():
        if program.kind != "step" or not bench.min_bucket <= (program.tokens or 0) <= bench.max_bucket:
            continue
        if wanted and program.variant not in wanted:
            continue
        expanded, unrolled = "expanded" in program.variant, (program.tokens or 0) <= ex.unroll_max_tokens
        t0 = time.perf_counter()
        lowered = build.lower(program)
        lower_s = time.perf_counter() - t0
        box = {}

        def work():
            try:
                box["compiled"] = ex._compile(lowered, expanded, unrolled)
            except Exception as e:  # noqa: BLE001
                box["error"] = f"{type(e).__name__}: {str(e)[:300]}"

        t1 = time.perf_counter()
        th = threading.Thread(target=work, daemon=True)
        th.start()
        th.join(bench.timeout_s)
        row = {"program": program.name, "lower_s": round(lower_s, 2), "compile_s": round(time.perf_counter() - t1, 2)}
        if th.is_alive():
            row["error"] = f"still compiling after {bench.timeout_s:.0f} s"
            rows.append(row)
            log.error("%s: %s", program.name, row["error"])
            break
        if "error" in box:
            row["error"] = box["error"]
        else:
            mem = box["compiled"].memory_analysis()
            row.update(arg_gib=mem.argument_size_in_bytes / GiB, out_gib=mem.output_size_in_bytes / GiB,
                       alias_gib=mem.alias_size_in_bytes / GiB, temp_gib=mem.temp_size_in_bytes / GiB)
        rows.append(row)
        log.info("%s", row)
    print(table(rows, ["program", "lower_s", "compile_s", "arg_gib", "out_gib", "alias_gib", "temp_gib", "error"]))
    write_results("compile_memory", {"config": dataclasses.asdict(config), "probe": dataclasses.asdict(bench),
                                     "bytes_limit": stats.get("bytes_limit"), "rows": rows,
                                     "command": " ".join(sys.argv)})
    del filler
    sys.stdout.flush()
    os._exit(0)  # a compile thread may still run


if __name__ == "__main__":
    main()
