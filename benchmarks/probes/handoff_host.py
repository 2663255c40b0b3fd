"""Host time of a switch's handoff, per phase, on the CPU mesh (issue 13: on 2 H200s the handoff's
host work, 5-16 ms, ran while only one ~5 ms step was queued on the GPU).

Builds a switching engine with the tests' tiny random model, admits `--requests` decoding
requests of about `--pages` pages each (the last one partly filled), then tours every ordered
layout pair `--rounds` times (fresh requests each round) and reports, per pair, the fastest
handoff (`handle.handoff_s`) and the fastest of each of its phases (`handoff_phases_ms`).

    python -m benchmarks.probes.handoff_host --devices 2 --pages 64
    python -m benchmarks.probes.handoff_host --devices 8 --pages 16

Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from pathlib import Path  # noqa: E402

from benchmarks.common import table, write_results  # noqa: E402
from splash_jax.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

log = logging.getLogger("handoff_host")

MODEL = str(Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "splash_tiny_random")
# Consecutive pairs cover all 12 ordered pairs of the four layouts (as tests/test_switching.py).
TOUR = ["tp", "dp", "dop", "cp", "tp", "dop", "dp", "cp", "dop", "tp", "cp", "dp", "tp"]
PHASES = ["wait_for_device", "extend_plans", "copy_last_pages", "free_pages", "pool_and_weights", "page_tables"]


def build(args) -> Engine:
    tokens_per_request = (args.pages + 16) * args.page_size
    per_device = args.requests * (args.pages + 16) + 64  # TP holds every page on every device
    return Engine(EngineConfig(
        model=MODEL, page_size=args.page_size, max_num_seqs=args.requests, max_num_batched_tokens=args.requests,
        min_token_bucket=args.requests, max_pages=per_device, kv_memory_gb=64.0, max_model_len=tokens_per_request,
        num_devices=args.devices, enable_switching=True, switch_chunk_pages=args.chunk_pages, layout="tp",
        warmup=False, compile_cache_dir=args.compile_cache_dir, gc_freeze="on",  # as serving on a GPU host runs
    ))


def admit(engine: Engine, args, round_: int) -> list[str]:
    """`--requests` requests whose first pages*page_size - page_size/2 tokens count as cached."""
    context = args.pages * args.page_size - args.page_size // 2
    ids = []
    for i in range(args.requests):
        r = engine.make_request([2 + (i + j) % 500 for j in range(context + 1)],
                                SamplingParams(max_tokens=1_000_000, ignore_eos=True), f"r{round_}-{i}")
        engine.add_request(r)
        if not engine.scheduler.admit_cached(r, context, reserve=1):
            raise MemoryError(f"request {i} does not fit")
        ids.append(r.request_id)
    return ids


def switch(engine: Engine, dst: str, max_steps: int = 500):
    handle = engine.switch_layout(dst)
    for _ in range(max_steps):
        if handle.done:
            break
        engine.step()
    if handle.state.value != "done":
        raise RuntimeError(f"switch to {dst}: {handle.state.value} ({handle.reason})")
    return handle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--pages", type=int, default=64, help="pages per request when a round starts")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--chunk-pages", type=int, default=1024, help="page copies per device pair per step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-cache-dir", default="/tmp/splash_handoff_probe_xla")
    parser.add_argument("--tag", default="", help="a label stored with the results (e.g. before / after)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("splash_jax").setLevel(logging.WARNING)
    engine = build(args)
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        ids = admit(engine, args, round_)
        engine.step()
        for dst in TOUR[1:]:
            src = engine.layout.name
            h = switch(engine, dst)
            runs.setdefault(f"{src}->{dst}", []).append(
                {"handoff_ms": h.handoff_s * 1e3, "pages_at_handoff": h.pages_at_handoff, **h.handoff_phases_ms})
            log.info("round %d %s->%s: handoff %.2f ms %s", round_, src, dst, h.handoff_s * 1e3,
                     {k: round(v, 3) for k, v in h.handoff_phases_ms.items()})
        for rid in ids:
            engine.abort(rid)
        engine.flush()
    rows = [{"pair": pair, **{k: min(r[k] for r in rs) for k in ["handoff_ms", "pages_at_handoff"] + PHASES}}
            for pair, rs in runs.items()]
    print(table(rows, ["pair", "pages_at_handoff", "handoff_ms"] + PHASES))
    write_results("handoff_host", {"args": vars(args), "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
