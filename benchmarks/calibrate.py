"""Measure, on this machine, the costs the layout policy ranks layouts by; write a calibration file.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.calibrate --num-devices 8
    python -m benchmarks.calibrate --shape v3 --num-layers 4 --num-devices 2 --dtype bfloat16 \\
        --page-size 64 --kv-memory-gb 40 --max-num-seqs 128 --max-num-batched-tokens 2048 \\
        --requests 1,4,16,64,128 --contexts 512,2048,8192,32768 --switch-loads 16x2048,64x2048

It takes every engine and workload flag of benchmarks/dynamic.py, so the table describes the
same engine the dynamic run serves with (pass the same flags to both). Measured:
  decode step  per layout over --requests x --contexts: requests injected as already cached
               (benchmarks/harness.py), median of --steps steps after --settle; a cell that does
               not fit the layout's pool is null;
  held-out     cells between grid points (geometric mean of neighbouring request counts, mean of
               neighbouring contexts), measured the same way and compared with the table's
               prediction: the table is never fitted to them;
  prefill      per layout, a step holding one prompt chunk at two sizes: intercept + s/token, and
               a chunk after --prefill-prefix cached tokens: + s per attended key;
  link         all_to_all bytes/s per device (benchmarks/switching.py);
  switches     per ordered pair at each --switch-loads (requests x context): the time the switch
               steps took beyond as many baseline steps, against the bytes moved; two loads give
               a fixed part and a copy rate, one load gives the fixed part at the measured link.
The file is a benchmark result (benchmarks/results/calibration_*.json); pass it to the engine as
`--policy-calibration PATH`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time

import numpy as np

from benchmarks.common import table, write_results
from benchmarks.dynamic import build_engine, parser as dynamic_parser, pick, switch_idle, BenchConfig
from benchmarks.harness import clear, inject_decoding
from benchmarks.switching import link_bandwidth
from splash_jax.calibration import Calibration, StepTable, SwitchCost, attended_keys
from splash_jax.engine import EngineConfig, SamplingParams
from splash_jax.engine.config import add_dataclass_args
from splash_jax.mesh.layouts import LAYOUT_NAMES

log = logging.getLogger("benchmarks.calibrate")


@dataclasses.dataclass
class CalibrateConfig:
    requests: str = "1,4,16"  # grid: running requests
    contexts: str = "32,128,384"  # grid: cached tokens per request
    steps: int = 5  # timed steps per cell (median)
    settle: int = 2  # untimed steps first
    holdout: bool = True  # also measure cells between grid points, to check the table
    switch_loads: str = "4x64,4x256"  # requests x context per switch measurement ('' = skip switches)
    link_mb: int = 64  # all_to_all size for the link bandwidth
    prefill_prefix: int = 256  # cached tokens before the deep prefill chunk (0: skip; rounded to the token budget)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def timed_steps(engine, settle: int, steps: int) -> float:
    for _ in range(settle):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def decode_cell(engine, layout: str, r: int, c: int, cfg: CalibrateConfig) -> float | None:
    switch_idle(engine, layout)
    try:
        reqs = inject_decoding(engine, r, c, tag=f"cal-{layout}")
    except MemoryError:
        return None
    try:
        return timed_steps(engine, cfg.settle, cfg.steps)
    finally:
        clear(engine, reqs)
        engine.flush()


def prefill_line(engine, layout: str, cfg: CalibrateConfig) -> list[float]:
    """[intercept, s per prompt token, s per attended key] of a step holding one prompt chunk.

    Chunks of T/4 and T tokens from position 0 give the first two; a T-token chunk after a cached
    prefix of --prefill-prefix tokens (the prompt's last chunk, timed alone) gives the third: each
    of its tokens attends to the prefix too (`attended_keys`). Without it the simulator priced a
    chunk deep in a long prompt like the first one (measured ~5x off on the CPU mesh)."""
    switch_idle(engine, layout)
    budget = engine.config.max_num_batched_tokens
    sizes = [max(1, budget // 4), budget]
    times = [prefill_step(engine, 0, size, cfg) for size in sizes]
    slope = (times[1] - times[0]) / (sizes[1] - sizes[0])
    intercept = times[0] - slope * sizes[0]
    prefix = (cfg.prefill_prefix // budget) * budget
    if prefix <= 0 or prefix + budget > engine.max_model_len:  # the engine's limit (the config's may be None: derived)
        return [intercept, slope, 0.0]
    deep = prefill_step(engine, prefix, budget, cfg)
    extra_keys = attended_keys(prefix, budget) - attended_keys(0, budget)
    per_key = max(0.0, (deep - times[1]) / extra_keys)
    return [intercept, slope, per_key]


def prefill_step(engine, prefix: int, size: int, cfg: CalibrateConfig) -> float:
    """Median seconds of the step computing prompt tokens [prefix, prefix + size) of a request
    whose earlier chunks ran untimed (prefix: a multiple of the token budget)."""
    ts = []
    for k in range(cfg.steps):
        rid = engine.add_request(list(range(2, prefix + size + 3)), SamplingParams(max_tokens=1, ignore_eos=True),
                                 f"cal-pf-{prefix}-{size}-{k}")
        for _ in range(prefix // engine.config.max_num_batched_tokens):  # the earlier chunks
            engine.step()
        engine.flush()
        t = time.perf_counter()
        engine.step()  # the chunk being timed (size <= budget)
        engine.flush()
        ts.append(time.perf_counter() - t)
        engine.abort(rid)
        while engine.has_work():
            engine.step()
    return float(np.median(ts[cfg.settle:] or ts))


def switch_costs(engine, link: float | None, cfg: CalibrateConfig) -> tuple[dict, list[dict]]:
    loads = [tuple(int(v) for v in x.split("x")) for x in cfg.switch_loads.split(",") if x]
    rows, costs = [], {}
    for src, dst in itertools.permutations(LAYOUT_NAMES, 2):
        points = []
        for r, c in loads:
            switch_idle(engine, src)
            try:
                reqs = inject_decoding(engine, r, c, tag=f"sw-{src}{dst}")
            except MemoryError:
                continue
            base = timed_steps(engine, cfg.settle, cfg.steps)
            h = engine.switch_layout(dst)
            t, steps = time.perf_counter(), 0
            while not h.done:
                engine.step()
                steps += 1
            extra = time.perf_counter() - t - steps * base
            ok = h.state.value == "done"
            rows.append({"pair": f"{src}->{dst}", "requests": r, "context": c, "state": h.state.value, "steps": steps,
                         "bytes": h.bytes_moved, "extra_s": extra, "base_step_s": base})
            if ok:
                points.append((h.bytes_moved, extra))
            clear(engine, reqs)
            engine.flush()
        costs[f"{src}->{dst}"] = fit_switch(points, link)
    return costs, rows


def fit_switch(points: list[tuple[int, float]], link: float | None) -> SwitchCost | None:
    """extra_s = fixed + bytes / rate through the measured points (a line through two distinct byte
    counts; with one, the rate is the measured link)."""
    if not points:
        return None
    distinct = sorted(set(b for b, _ in points))
    if len(distinct) >= 2:
        b = np.asarray([p[0] for p in points], float)
        y = np.asarray([p[1] for p in points], float)
        slope, fixed = np.polyfit(b, y, 1)
        return SwitchCost(float(fixed), float(1 / slope) if slope > 0 else None)
    bytes_, extra = points[0][0], float(np.mean([p[1] for p in points]))
    if bytes_ and link:
        return SwitchCost(extra - bytes_ / link, link)
    return SwitchCost(extra, None)


def holdout_cells(rs: list[int], cs: list[int]) -> list[tuple[int, int]]:
    mids_r = [round(math.sqrt(a * b)) for a, b in zip(rs, rs[1:])]
    mids_c = [(a + b) // 2 for a, b in zip(cs, cs[1:])]
    return [(r, c) for r in mids_r for c in mids_c if r not in rs]


def main(argv=None):
    p = dynamic_parser()
    add_dataclass_args(p.add_argument_group("calibration"), CalibrateConfig)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("splash_jax.switch.controller").setLevel(logging.WARNING)
    config, bench, cfg = EngineConfig.from_cli_args(args), pick(args, BenchConfig), pick(args, CalibrateConfig)
    engine = build_engine(config, bench)
    rs, cs = ints(cfg.requests), ints(cfg.contexts)
    if max(rs) > config.max_num_seqs:
        raise SystemExit(f"--requests up to {max(rs)} needs --max-num-seqs >= {max(rs)}")
    step_s = {lay: [[decode_cell(engine, lay, r, c, cfg) for c in cs] for r in rs] for lay in LAYOUT_NAMES}
    prefill = {lay: prefill_line(engine, lay, cfg) for lay in LAYOUT_NAMES}
    link = link_bandwidth(engine.mesh, cfg.link_mb)
    switch, switch_rows = switch_costs(engine, link, cfg) if cfg.switch_loads and engine.n > 1 else ({}, [])
    mc = engine.model_config
    cal = Calibration(
        machine=f"{engine.mesh.devices.flat[0].device_kind} x{engine.n}", devices=engine.n,
        model={"name": bench.shape or "bundled", "layers": mc.num_layers, "heads": mc.num_heads, "hidden": mc.hidden_size,
               "kv_bytes_per_token": engine.page_bytes // config.page_size},
        page_size=config.page_size, requests=rs, contexts=cs, step_s=step_s, prefill_s=prefill, link_bytes_per_s=link,
        switch={k: v for k, v in switch.items() if v is not None},
    )
    grid_rows = [{"layout": lay, "requests": r, "context": c, "step_ms": None if t is None else t * 1e3}
                 for lay in LAYOUT_NAMES for r, row in zip(rs, step_s[lay]) for c, t in zip(cs, row)]
    print(table(grid_rows, ["layout", "requests", "context", "step_ms"]))
    holdout = []
    if cfg.holdout:
        model = StepTable(cal)
        for lay in LAYOUT_NAMES:
            for r, c in holdout_cells(rs, cs):
                measured = decode_cell(engine, lay, r, c, cfg)
                if measured is None:
                    continue
                predicted, source = model.seconds(lay, r, c)
                holdout.append({"layout": lay, "requests": r, "context": c, "measured_ms": measured * 1e3,
                                "predicted_ms": predicted * 1e3, "source": source, "error": predicted / measured - 1})
        print(table(holdout, ["layout", "requests", "context", "measured_ms", "predicted_ms", "source", "error"]))
        errs = [abs(h["error"]) for h in holdout]
        if errs:
            print(f"held-out cells: {len(errs)}, |error| median {np.median(errs):.1%}, max {max(errs):.1%}")
    if switch_rows:
        print(table(switch_rows, ["pair", "requests", "context", "state", "steps", "bytes", "extra_s", "base_step_s"]))
    path = write_results("calibration", {"args": vars(args), "calibration": cal.to_dict(), "holdout": holdout,
                                         "switch_measurements": switch_rows})
    print(f"calibration: {path}  (use --policy-calibration {path})")
    return path


if __name__ == "__main__":
    main()
