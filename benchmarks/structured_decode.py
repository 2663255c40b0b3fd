"""Decode with structured outputs: the step time at batch B when a fraction of the rows is
constrained by a JSON schema, against the same batch unconstrained, and the grammar's host time.

    python -m benchmarks.structured_decode --shape v2-lite --tokenizer .bench_tokenizer \\
        --dtype bfloat16 --kv-memory-gb 40 --max-num-seqs 64 --max-num-batched-tokens 512

Every row samples at temperature 1 (constrained rows need the full sampler; so do the others, so
the ratio is the grammar's cost alone). Requests start decoding at `context` tokens (their pages
admitted as cached, benchmarks/harness.py) with dummy weights; the schema ends in a free-text
string field (most tokens of real JSON outputs are string tokens). A constrained row whose JSON is
complete is replaced by a new constrained request between steps (outside the timed step() calls),
so the batch stays full and holds grammars in every state. Per fraction: the duration of each
step() call (overlapped scheduling: the step cadence), GPU busy time per step from a profiler
trace, the host time spent filling masks per step and the engine's host phases. At the end each constrained row's tokens are replayed through a fresh
matcher: a token the grammar rejects would mean a mask was not applied. `--tokenizer`: a folder with
a real tokenizer.json (the grammar's work scales with the vocabulary); its vocabulary size replaces
the shape's when larger. Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import llguidance
import numpy as np

from benchmarks.common import parse_engine_and_bench, percentiles, table, write_results
from benchmarks.harness import clear
from benchmarks.profiling import device_busy
from benchmarks.shapes import shape_with_tokenizer
from splash_jax.engine import Engine, SamplingParams
from splash_jax.structured import StructuredOutputs

log = logging.getLogger("benchmarks.structured_decode")

SCHEMA = {  # an agent-style answer: a few typed fields, then free text
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "answer": {"type": "string"},
    },
    "required": ["name", "score", "tags", "ok", "answer"],
    "additionalProperties": False,
}


@dataclasses.dataclass
class BenchConfig:
    shape: str = "v2-lite"  # v2-lite | v3 (dummy weights); empty = the bundled model
    num_layers: int = 0  # with --shape: layers of the slice (0 = the full model)
    tokenizer: str = ""  # folder with tokenizer.json (+ tokenizer_config.json) for the shape
    batch: int = 64  # decoding rows
    context: int = 1024  # tokens each row starts from
    fractions: str = "0,0.1,1"  # constrained fractions of the batch to time
    warm_steps: int = 24  # steps before timing (prefill-free: the rows start decoding)
    steps: int = 64  # timed steps per fraction
    profile_steps: int = 16  # steps under the profiler per fraction (0: none)


def model_folder(c: BenchConfig) -> Path:
    if not c.shape:
        return Path("")
    overrides = {"num_hidden_layers": c.num_layers} if c.num_layers else {}
    return shape_with_tokenizer(c.shape, c.tokenizer or None, **overrides)


def start_row(engine: Engine, c: BenchConfig, constrained: bool, rid: str, seed: int, rng):
    spec = StructuredOutputs(json=SCHEMA) if constrained else None
    params = SamplingParams(max_tokens=1_000_000, temperature=1.0, seed=seed, ignore_eos=True, structured_outputs=spec)
    r = engine.make_request(rng.integers(2, engine.model_config.vocab_size, c.context + 1).tolist(), params, rid)
    engine.add_request(r)
    if not engine.scheduler.admit_cached(r, c.context, reserve=64):
        raise MemoryError(f"{c.batch} x {c.context} tokens do not fit the pool")
    return r


def start_rows(engine: Engine, c: BenchConfig, constrained: int, tag: str):
    rng = np.random.default_rng(0)
    return [start_row(engine, c, i < constrained, f"{tag}-{i}", i, rng) for i in range(c.batch)]


def refill(engine: Engine, c: BenchConfig, reqs: list, done: list, tag: str, rng) -> None:
    """Replace each finished constrained row (its JSON complete) by a new constrained request."""
    for i, r in enumerate(reqs):
        if r.is_finished and r.params.structured_outputs is not None:
            done.append(r)
            reqs[i] = start_row(engine, c, True, f"{tag}-r{len(done)}", 1000 + len(done), rng)


def measure(engine: Engine, c: BenchConfig, fraction: float) -> dict:
    k = round(fraction * c.batch)
    tag, rng, done = f"f{fraction}", np.random.default_rng(1), []
    reqs = start_rows(engine, c, k, tag)
    for _ in range(c.warm_steps):
        engine.step()
        refill(engine, c, reqs, done, tag, rng)
    masks = engine.masks
    s0, f0, replaced = masks.seconds, masks.num_fills, len(done)
    walls, phases = [], []
    for _ in range(c.steps):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
        phases.append(dict(engine.last_step_ms))
        refill(engine, c, reqs, done, tag, rng)
    mask_ms = (masks.seconds - s0) * 1e3 / c.steps
    fills, replaced = masks.num_fills - f0, len(done) - replaced

    def profiled():
        engine.step()
        refill(engine, c, reqs, done, tag, rng)

    busy = device_busy(profiled, c.profile_steps) if c.profile_steps else None
    running = sum(not r.is_finished for r in reqs)
    rejected = 0
    for r in done + [r for r in reqs[:k] if r.params.structured_outputs is not None]:
        # replay: every sampled token must be one the grammar allowed, and a finished row's JSON parses
        m = llguidance.LLMatcher(engine.grammars.tokenizer, engine.grammars.grammar(r.params.structured_outputs), log_level=0)
        ok = m.try_consume_tokens(r.output_ids) == len(r.output_ids)
        if ok and r.is_finished and r.finish_reason == "stop":
            try:
                json.loads(engine.tokenizer.decode(r.output_ids))
            except ValueError:
                ok = False
        rejected += not ok
    clear(engine, reqs)
    while engine.has_work():
        engine.step()
    return {
        "fraction": fraction, "constrained": k, "running_at_end": running, "rejected_rows": rejected,
        "rows_replaced": replaced, "phases_ms_p50": {key: float(np.median([p[key] for p in phases])) for key in phases[0]},
        "step_ms": percentiles(walls, (50, 90, 99)), "mask_ms_per_step": mask_ms, "mask_fills": fills,
        "wait_ms_p50": float(np.median([p["wait"] for p in phases])),
        "complete_ms_p50": float(np.median([p["complete"] for p in phases])),
        "busy_ms": busy.busy_ms if busy else None,
    }


def main(argv=None):
    c, config = parse_engine_and_bench(__doc__, BenchConfig, argv, "benchmark")
    if c.shape:
        config.model, config.load_format = str(model_folder(c)), "dummy"
    engine = Engine(config)
    t = time.perf_counter()
    engine.grammars.grammar(StructuredOutputs(json=SCHEMA))
    compile_ms = (time.perf_counter() - t) * 1e3
    rows = []
    for f in [float(x) for x in c.fractions.split(",")]:
        log.info("timing %d rows with %.0f%% constrained", c.batch, 100 * f)
        rows.append(measure(engine, c, f))
    base = rows[0]["step_ms"]["p50"]
    base_busy = rows[0]["busy_ms"]
    for r in rows:
        r["step_ratio"] = r["step_ms"]["p50"] / base
        r["busy_ratio"] = (r["busy_ms"] / base_busy) if base_busy and r["busy_ms"] else None
    print(table([{"constrained": f"{r['constrained']}/{c.batch}", "step_p50_ms": r["step_ms"]["p50"],
                  "step_p99_ms": r["step_ms"]["p99"], "ratio": r["step_ratio"], "gpu_busy_ms": r["busy_ms"],
                  "busy_ratio": r["busy_ratio"], "mask_ms/step": r["mask_ms_per_step"], "wait_p50": r["wait_ms_p50"],
                  "replaced": r["rows_replaced"], "rejected": r["rejected_rows"]} for r in rows],
                ["constrained", "step_p50_ms", "step_p99_ms", "ratio", "gpu_busy_ms", "busy_ratio", "mask_ms/step",
                 "wait_p50", "replaced", "rejected"]))
    for r in rows:
        print(f"{r['constrained']:>3} constrained: host phases p50 (ms) " +
              ", ".join(f"{k} {v:.2f}" for k, v in r["phases_ms_p50"].items()))
    print(f"schema compile: {compile_ms:.1f} ms; vocabulary {engine.model_config.vocab_size}")
    write_results("structured_decode", {"config": dataclasses.asdict(c), "engine": dataclasses.asdict(config),
                                        "schema": SCHEMA, "schema_compile_ms": compile_ms, "rows": rows})


if __name__ == "__main__":
    main()
