"""Time from process start to the first token, cold and warm compilation cache, and what compiling costs.

    python -m benchmarks.startup                                     # bundled model, CPU
    python -m benchmarks.startup --shape v2-lite --load-format dummy --layers 4,8,27 --switching both

Every measurement is a fresh Python process (imports, device start-up, weight loading, ahead-of-time
compilation, then one greedy token of a short prompt), timed from just before the process is
spawned to the moment the token is on the host. `cold` gives the child an empty temporary
persistent-cache folder; `warm` runs the same configuration again on the folder the cold run filled.
Rows per (layers, scan or unrolled, switching on or off, cold or warm):
  first_token_s   process start -> first token on the host
  import_s        process start -> splash_jax and jax imported
  load_s          Engine(): model and pool ready (weights loaded)
  compile_s       wall time of the start-up compiles (step programs + migration programs)
  programs        programs compiled at start-up; per_program_s = compile_s / programs
  cache_hits      of those, served by the persistent compilation cache
The per-program compile time against the layer count is the check that scanned layers keep a
program's size independent of depth (unrolled: it grows with the layers).
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

log = logging.getLogger("benchmarks.startup")
ROOT = Path(__file__).resolve().parents[1]


# --- the child: one start-up, reported as JSON on the last stdout line ---------------------------
def child(args) -> None:
    t_spawn = float(os.environ["SPLASH_STARTUP_T0"])
    from benchmarks.shapes import shape_folder
    from splash_jax.engine import Engine, EngineConfig, SamplingParams

    t_import = time.time()
    if args.shape:
        overrides = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
        overrides |= json.loads(args.config_overrides or "{}")
        model = str(shape_folder(args.shape, **overrides))
    else:
        model = ""  # the bundled model
    config = EngineConfig(
        model=model, load_format=args.load_format, layout=args.layout, num_devices=args.devices,
        enable_switching=args.switching, scan_layers=args.scan_layers, compile_cache_dir=args.cache_dir,
        compile_threads=args.compile_threads, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        kv_memory_gb=args.kv_memory_gb, dtype=args.dtype,
    )
    t0 = time.time()
    engine = Engine(config)
    t_engine = time.time()
    out = engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=1, temperature=0.0))
    assert out[0].token_ids, out[0]
    t_token = time.time()
    compile_stats = engine.stats()["compile"]
    print(json.dumps({
        "import_s": t_import - t_spawn, "engine_s": t_engine - t0, "first_token_s": t_token - t_spawn,
        "after_engine_s": t_token - t_engine, "compile": compile_stats, "num_layers": engine.model_config.num_layers,
        "load_s": (t_engine - t0) - compile_stats["seconds"],
    }))


def run_child(argv: list[str], cache_dir: str, devices: int) -> dict:
    env = dict(os.environ, SPLASH_STARTUP_T0=repr(time.time()))
    if devices > 1 and env.get("JAX_PLATFORMS", "") == "cpu":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", "--cache-dir", cache_dir] + argv
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"child failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _bool_flag(name: str, value: bool) -> str:
    return f"--{name}" if value else f"--no-{name}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="v2-lite | v3 (dummy weights); default: the bundled model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--layers", default="", help="comma-separated layer counts (needs --shape); default: the model's")
    parser.add_argument("--config-overrides", default="", help='JSON merged into the shape\'s config.json, e.g. \'{"n_routed_experts": 8}\'')
    parser.add_argument("--scan", default="both", choices=["scan", "unrolled", "both"])
    parser.add_argument("--switching", default="both", choices=["on", "off", "both"])
    parser.add_argument("--cache", default="both", choices=["cold", "warm", "both"])
    parser.add_argument("--layout", default="tp")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--compile-threads", type=int, default=None, help="default: the engine's")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-memory-gb", type=float, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tag", default="", help="label stored with the results")
    # child-only
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--num-layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    parser.add_argument("--enable-switching", dest="switching_flag", action=argparse.BooleanOptionalAction,
                        default=False, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_threads is None:
        from splash_jax.engine.config import EngineConfig

        args.compile_threads = EngineConfig.compile_threads
    if args.child:
        args.switching = args.switching_flag
        logging.basicConfig(level=logging.WARNING)
        return child(args)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from benchmarks.common import table, write_results

    layer_counts = [int(x) for x in args.layers.split(",") if x] or [None]
    scans = {"scan": [True], "unrolled": [False], "both": [True, False]}[args.scan]
    switchings = {"on": [True], "off": [False], "both": [False, True]}[args.switching]
    caches = {"cold": ["cold"], "warm": ["cold", "warm"], "both": ["cold", "warm"]}[args.cache]
    keep = {"cold": {"cold"}, "warm": {"warm"}, "both": {"cold", "warm"}}[args.cache]
    common = ["--layout", args.layout, "--devices", str(args.devices), "--compile-threads", str(args.compile_threads),
              "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-model-len", str(args.max_model_len), "--load-format", args.load_format, "--dtype", args.dtype]
    if args.shape:
        common += ["--shape", args.shape]
    if args.config_overrides:
        common += ["--config-overrides", args.config_overrides]
    if args.kv_memory_gb is not None:
        common += ["--kv-memory-gb", str(args.kv_memory_gb)]
    rows = []
    for layers in layer_counts:
        for scan in scans:
            for switching in switchings:
                argv_child = common + [_bool_flag("scan-layers", scan), _bool_flag("enable-switching", switching)]
                if layers:
                    argv_child += ["--num-layers", str(layers)]
                with tempfile.TemporaryDirectory(prefix="splash-startup-cache-") as cache_dir:
                    for cache in caches:
                        r = run_child(argv_child, cache_dir, args.devices)
                        c = r["compile"]
                        row = {
                            "layers": r["num_layers"], "scan": scan, "switching": switching, "cache": cache,
                            "first_token_s": r["first_token_s"], "import_s": r["import_s"], "load_s": r["load_s"],
                            "compile_s": c["seconds"], "programs": c["programs"], "cache_hits": c["cache_hits"],
                            "per_program_s": c["seconds"] / c["programs"] if c["programs"] else None,
                            "by_kind": c["by_kind"],
                        }
                        if cache in keep:  # (--cache warm runs cold first only to fill the cache)
                            rows.append(row)
                        log.info("%s", row)
    cols = ["layers", "scan", "switching", "cache", "first_token_s", "import_s", "load_s", "compile_s", "programs",
            "cache_hits", "per_program_s"]
    print(table(rows, cols))
    write_results("startup", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
