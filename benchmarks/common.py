"""Shared benchmark plumbing: machine description, result files, percentiles, tables."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import sys
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    import jax

    devices = jax.devices()
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "cpu_count": __import__("os").cpu_count(),
    }


def machine_tag() -> str:
    import jax

    kind = jax.devices()[0].device_kind.lower().replace(" ", "-")
    return f"{jax.default_backend()}-{kind}"


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"{name}_{machine_tag()}_{stamp}.json"
    env = {k: os.environ[k] for k in ("XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES") if k in os.environ}
    payload = {"machine": machine_info(), "command": " ".join(sys.argv), "env": env, "time": stamp, **payload}
    path.write_text(json.dumps(payload, indent=2, default=float))
    logging.getLogger(name).info("wrote %s", path)
    return path


def read_json(path) -> dict:
    """A results file, plain or gzipped (large runs are stored as .json.gz)."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def percentiles(values, ps=(50, 90, 99)) -> dict:
    if not len(values):
        return {f"p{p}": None for p in ps} | {"mean": None}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{p}": float(np.percentile(arr, p)) for p in ps} | {"mean": float(arr.mean())}


def table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def parse_engine_and_bench(doc: str, bench_cls, argv=None, group: str = "benchmark", defaults: dict | None = None):
    """-> (bench config, EngineConfig) from one command line: every engine flag plus the fields of
    `bench_cls` (a dataclass), engine flags defaulting to `defaults` where given; also sets up
    logging as the benchmarks log."""
    import argparse
    import dataclasses

    from splash_jax.engine import EngineConfig
    from splash_jax.engine.config import add_dataclass_args

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    add_dataclass_args(p.add_argument_group(group), bench_cls)
    p.set_defaults(**(defaults or {}))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bench = bench_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(bench_cls)})
    return bench, EngineConfig.from_cli_args(args)


def build_engine(config, shape: str = "", num_layers: int = 0):
    """The benchmark's engine: `config` as given, or a --shape (v2-lite, v3) model of dummy weights
    with its first `num_layers` layers (0: all); logs how long it took to be ready."""
    import time

    from benchmarks.shapes import shape_folder
    from splash_jax.engine import Engine

    if shape:
        config.model = str(shape_folder(shape, **({"num_hidden_layers": num_layers} if num_layers else {})))
        config.load_format = "dummy"
    t0 = time.perf_counter()
    engine = Engine(config)
    logging.getLogger("benchmarks").info(
        "engine ready in %.1fs (%d programs, %s, %d tokens of KV, max_model_len %d)", time.perf_counter() - t0,
        engine.executor.num_compiled, engine.layout.name, engine.kv_capacity_tokens(), engine.max_model_len)
    return engine
