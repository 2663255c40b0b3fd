"""Start-up across batch budgets and context lengths: does every configuration start (cold) and
serve, or fail fast with an error that names the flag? (docs/startup.md, "Memory at start-up")

    python -m benchmarks.startup_sweep --shape v2-lite --dtype bfloat16 \\
        --cells 512x4096,512x32768,8192x36864:40:128 --timeout-s 300

A cell is MAX_NUM_BATCHED_TOKENS x MAX_MODEL_LEN, optionally `:KV_MEMORY_GB` (`-`: the default
budget) and `:MAX_NUM_SEQS` (default 128). Each runs in a fresh process with an empty persistent
compile-cache folder and no XLA_* variables (the default environment). A cell that starts serves
a 1K-token prompt and the longest prompt its max_model_len allows (8 greedy tokens each). Rows:
  started / error   the engine came up, or the error it raised (StartupMemoryError names a flag)
  startup_s         process start -> Engine() returned (or -> the error)
  kv_tokens         KV capacity in tokens
  reserve_gib       what start-up set aside for the largest step program (measured before the pool)
  max_temp_gib      the largest temporaries any compiled program reported, and which
  served            {prompt tokens: [seconds, tokens generated]}
The parent never touches the accelerator until every cell ran (children need the whole device).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("benchmarks.startup_sweep")
ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def parse_cell(text: str) -> dict:
    size, *rest = text.split(":")
    mbt, mml = (int(x) for x in size.lower().split("x"))
    kv = None if not rest or rest[0] in ("", "-") else float(rest[0])
    seqs = int(rest[1]) if len(rest) > 1 else 128
    return {"mbt": mbt, "mml": mml, "kv": kv, "max_num_seqs": seqs}


# --- the child: one cell, one JSON line on stdout -----------------------------------------------
def child(args) -> None:
    t0 = float(os.environ["SPLASH_SWEEP_T0"])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import numpy as np

    from benchmarks.shapes import shape_folder
    from splash_jax.engine import Engine, EngineConfig, SamplingParams
    from splash_jax.kv.capacity import StartupMemoryError

    cell = parse_cell(args.cell)
    row = dict(cell, started=False, error=None)
    try:
        engine = Engine(EngineConfig(
            model=str(shape_folder(args.shape, **({"num_hidden_layers": args.layers} if args.layers else {}))), load_format="dummy", dtype=args.dtype,
            num_devices=args.num_devices, max_num_batched_tokens=cell["mbt"], max_model_len=cell["mml"],
            kv_memory_gb=cell["kv"], max_num_seqs=cell["max_num_seqs"], compile_cache_dir=args.cache_dir))
    except StartupMemoryError as e:
        row.update(error=f"StartupMemoryError: {e}", startup_s=round(time.time() - t0, 1))
        print("RESULT " + json.dumps(row), flush=True)
        return
    row.update(started=True, startup_s=round(time.time() - t0, 1), kv_tokens=engine.kv_capacity_tokens())
    rng = np.random.default_rng(0)
    served = {}
    for n in (1024, engine.max_model_len - 16):
        t = time.perf_counter()
        out = engine.generate([rng.integers(10, 10_000, n).tolist()], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        served[n] = [round(time.perf_counter() - t, 2), len(out.token_ids)]
    mem, plan = engine.stats()["program_memory"], engine.pool_plan
    row.update(served=served, programs=mem["programs"], max_temp_gib=round(mem["max_temp_bytes"] / GiB, 3),
               max_temp_program=mem["max_temp_program"], max_working_gib=round(mem["max_working_bytes"] / GiB, 3),
               reserve_gib=round(plan.reserve / GiB, 3) if plan else None, reserve_program=plan.reserve_program if plan else None,
               weights_gib=round(plan.in_use / GiB, 2) if plan else None, limit_gib=round(plan.limit / GiB, 2) if plan else None,
               headroom_gib=round(plan.headroom / GiB, 2) if plan else None)
    print("RESULT " + json.dumps(row), flush=True)


def run_cell(args, cell: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")} | {"SPLASH_SWEEP_T0": repr(time.time())}
    with tempfile.TemporaryDirectory() as cache:
        cmd = [sys.executable, "-m", "benchmarks.startup_sweep", "--child", "--cell", cell, "--cache-dir", cache,
               "--shape", args.shape, "--dtype", args.dtype, "--num-devices", str(args.num_devices)]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-2000:]
            return dict(parse_cell(cell), started=False, error=f"no start-up within {args.timeout_s} s",
                        startup_s=None, log_tail=tail.decode() if isinstance(tail, bytes) else tail)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return dict(parse_cell(cell), started=False, error=f"exit {proc.returncode}: {proc.stderr[-1500:]}", startup_s=None)
    row = json.loads(lines[-1][len("RESULT "):])
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line or "rematerialization" in line]
    row["warnings"] = warnings[-5:]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="512x4096,8192x32768,16384x131072")
    parser.add_argument("--shape", default="v2-lite")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-devices", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a cell still starting after this is a failure")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = []
    cells = [c for c in args.cells.split(",") if c]
    for i, cell in enumerate(cells):
        log.info("cell %d/%d: %s", i + 1, len(cells), cell)
        rows.append(run_cell(args, cell))
        log.info("  %s", json.dumps({k: v for k, v in rows[-1].items() if k != "log_tail"}))  # a run cut short keeps its rows
    from benchmarks.common import table, write_results  # the accelerator is touched only now

    cols = ["mbt", "mml", "kv", "max_num_seqs", "started", "startup_s", "kv_tokens", "reserve_gib", "max_temp_gib",
            "max_temp_program", "headroom_gib"]
    print(table(rows, cols))
    for row in rows:
        if row.get("error"):
            print(f"{row['mbt']}x{row['mml']}: {row['error'][:400]}")
    write_results("startup_sweep", {"config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
