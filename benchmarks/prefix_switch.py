"""Pages a live switch moves when requests share cached prefixes: caching on vs off, per pair.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.prefix_switch --num-devices 8 --pairs dp:tp,cp:tp,tp:dp --caching on,off

Agent conversations on one engine (switching enabled, bundled model unless --shape): every
conversation starts with the same `--system`-token system prompt. Per (pair, caching, balance
fraction), starting idle in the source layout with an empty cache:
  1. history: turn 0 of `--conversations` + `--finished` conversations (system prompt + a
     `--tool`-token tool result, `--answer0` tokens answered), run to completion;
  2. in flight: turn 1 of the first `--conversations` (turn 0's prompt + answer + a new tool
     result, `--answer` tokens to answer), stepped until every one has its first token; then
     `engine.switch_layout(dst)`, stepped until the handoff; then run to completion.
The `--finished` conversations' pages are cached pages no request holds at the switch.
Reported per run, from `handle.plan` and the handle: pages copied (each request's own pages plus
shared copies), pages reused (already on a device that needs them), shared copies (a page several
requests reference, copied once per destination device) and the requests that referenced one
instead of copying again, cached pages kept / evicted (the extra segment's, when dp removes it),
bytes moved, steps the copies rode; the system prompt's copies per page before and after the
switch (benchmarks/cache_census.py); the owner devices of the in-flight requests (dp/dop); whether
the greedy outputs equal the caching-off run's of the same pair. A refused switch (the destination
cannot stage the running requests' pages) is reported with its reason. `--balance-fractions` reruns
owner-layout sources with the scheduler's balance set to each fraction of a device's pages
(`--prefix-balance-fraction` for the engine: cache-aware owners against load).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

from benchmarks import workloads as W
from benchmarks.cache_census import page_copies
from benchmarks.common import table, write_results
from benchmarks.dynamic import BenchConfig, build_engine, set_caching, switch_idle
from splash_jax.engine import EngineConfig, SamplingParams
from splash_jax.mesh.layouts import get_layout

log = logging.getLogger("benchmarks.prefix_switch")
_KEYS = 5 << 40  # content keys of this benchmark's blocks (benchmarks/workloads.py's ranges are below)


@dataclasses.dataclass
class SwitchBench:
    pairs: str = "dp:tp,cp:tp,tp:dp"  # src:dst, comma-separated
    caching: str = "on,off"  # prefix caching per run: on and/or off
    balance_fractions: str = ""  # owner-layout sources: also run at these balance fractions (comma-separated)
    conversations: int = 4  # conversations in flight at the switch
    finished: int = 2  # conversations that end after turn 0 (their pages cached, held by no request)
    system: int = 256  # system-prompt tokens (shared by every conversation)
    tool: int = 8  # tool-result tokens per turn
    answer0: int = 8  # turn 0's answer tokens
    answer: int = 48  # turn 1's answer tokens (long enough to be in flight through the switch)
    workload_seed: int = 0  # seeds the prompt tokens
    shape: str = ""  # v2-lite | v3 (dummy weights); empty = the bundled model
    num_layers: int = 0


def drain(engine, outputs: dict) -> None:
    while engine.has_work():
        for o in engine.step():
            outputs[o.request_id] = outputs.get(o.request_id, []) + list(o.delta_token_ids)


def submit(engine, rid: str, ids: list[int], max_tokens: int) -> None:
    engine.add_request(engine.make_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid))


def system_copies(engine, ids: list[int]) -> float | None:
    cache = engine.scheduler.cache
    if cache is None:
        return None
    copies = page_copies(cache, ids)
    return sum(copies) / len(copies) if copies else None


def one(engine, src: str, dst: str, caching: str, fraction: float | None, b: SwitchBench) -> dict:
    engine.policy = None
    switch_idle(engine, src)
    set_caching(engine, caching)
    sched = engine.scheduler
    default_balance = sched.balance_pages
    if fraction is not None:
        sched.balance_pages = int(fraction * engine.allocator.pages_per_device)  # as Engine sets it
    try:
        vocab = engine.model_config.vocab_size
        system = W.block_ids(_KEYS, b.system, vocab, b.workload_seed)
        tool = lambda c, k: W.block_ids(_KEYS + 1 + 2 * c + k, b.tool, vocab, b.workload_seed)  # noqa: E731
        outputs: dict[str, list[int]] = {}
        prompts = {}
        for c in range(b.conversations + b.finished):  # 1. history
            prompts[f"{c}-0"] = system + tool(c, 0)
            submit(engine, f"{c}-0", prompts[f"{c}-0"], b.answer0)
        drain(engine, outputs)
        live = [f"{c}-1" for c in range(b.conversations)]  # 2. in flight
        for c in range(b.conversations):
            prompts[f"{c}-1"] = prompts[f"{c}-0"] + outputs[f"{c}-0"] + tool(c, 1)
            submit(engine, f"{c}-1", prompts[f"{c}-1"], b.answer)
        while not all(outputs.get(r) for r in live):
            for o in engine.step():
                outputs[o.request_id] = outputs.get(o.request_id, []) + list(o.delta_token_ids)
        running = {r.request_id: r for r in sched.running}
        owners = ({rid: running[rid].owner for rid in live if rid in running}
                  if engine.layout.kv_placement.owner_bound else None)
        cached_tokens = {rid: running[rid].num_cached_tokens for rid in live if rid in running}
        before = system_copies(engine, system)
        t0 = time.perf_counter()
        h = engine.switch_layout(dst)
        steps = 0
        while not h.done:  # refused: done at once (the row says why)
            for o in engine.step():
                outputs[o.request_id] = outputs.get(o.request_id, []) + list(o.delta_token_ids)
            steps += 1
        wall = time.perf_counter() - t0
        after = system_copies(engine, system)
        in_flight = sum(not r.is_finished for r in sched.running if r.request_id in live)
        drain(engine, outputs)
        if h.state.value != "done":
            log.warning("%s->%s caching %s: %s (%s)", src, dst, caching, h.state.value, h.reason)
        if engine.layout.name != src:
            switch_idle(engine, src)  # the next run of this pair starts in src again (a no-op if refused)
    finally:
        sched.balance_pages = default_balance
    plan = h.plan
    return {
        "pair": f"{src}->{dst}", "caching": caching, "state": h.state.value, "reason": h.reason,
        "balance_fraction": fraction, "running_at_switch": len(running),
        "in_flight_at_handoff": in_flight, "owners": owners, "cached_tokens_turn1": cached_tokens,
        "system_copies_before": before, "system_copies_after": after, "switch_steps": steps, "switch_wall_s": wall,
        "handle": h.as_dict(), "outputs": {k: outputs[k] for k in sorted(outputs)},
        **{k: plan.get(k) for k in ("pages_copied", "pages_reused", "pages_shared_copies", "pages_copy_shared_by",
                                    "cached_pages_kept", "cached_pages_evicted", "pages_freed")},
        "bytes_moved": h.bytes_moved, "steps_overlapped": h.steps_overlapped,
    }


COLUMNS = ["pair", "caching", "balance", "state", "owners", "sys_copies_before", "sys_copies_after", "pages_copied",
           "pages_reused", "shared_copies", "copy_shared_by", "cached_kept", "cached_evicted", "MB_moved",
           "steps_overlapped", "same_as_off"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    from splash_jax.engine.config import add_dataclass_args

    add_dataclass_args(p.add_argument_group("benchmark"), SwitchBench)
    p.set_defaults(page_size=8, kv_memory_gb=0.01, max_num_seqs=32, max_num_batched_tokens=64, min_token_bucket=16)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("splash_jax.switch.controller").setLevel(logging.WARNING)
    config = EngineConfig.from_cli_args(args)
    b = SwitchBench(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SwitchBench)})
    engine = build_engine(config, BenchConfig(shape=b.shape, num_layers=b.num_layers))
    fractions = [float(x) for x in b.balance_fractions.split(",") if x]
    runs = []
    for pair in b.pairs.split(","):
        src, dst = pair.split(":")
        owner = get_layout(src).kv_placement.owner_bound
        for caching in b.caching.split(","):
            for fraction in [None] + (fractions if owner and caching == "on" else []):
                t0 = time.perf_counter()
                runs.append(r := one(engine, src, dst, caching, fraction, b))
                log.info("%s caching %s balance %s: %s copied, %s shared copies, %.1fs", r["pair"], caching,
                         fraction, r["pages_copied"], r["pages_shared_copies"], time.perf_counter() - t0)
    rows = []
    for r in runs:
        off = next((x for x in runs if x["pair"] == r["pair"] and x["caching"] == "off" and x["state"] == "done"), None)
        owners = r["owners"]
        rows.append({
            "pair": r["pair"], "caching": r["caching"],
            "balance": r["balance_fraction"] if r["balance_fraction"] is not None else config.prefix_balance_fraction,
            "state": r["state"],
            "owners": ",".join(str(owners[k]) for k in sorted(owners)) if owners else None,
            "sys_copies_before": r["system_copies_before"], "sys_copies_after": r["system_copies_after"],
            "pages_copied": r["pages_copied"], "pages_reused": r["pages_reused"],
            "shared_copies": r["pages_shared_copies"], "copy_shared_by": r["pages_copy_shared_by"],
            "cached_kept": r["cached_pages_kept"], "cached_evicted": r["cached_pages_evicted"],
            "MB_moved": r["bytes_moved"] / 2**20 if r["bytes_moved"] is not None else None,
            "steps_overlapped": r["steps_overlapped"],
            "same_as_off": (r["outputs"] == off["outputs"]) if off is not None and r["state"] == "done" else None,
        })
    print(table(rows, COLUMNS))
    return write_results("prefix_switch", {
        "args": vars(args), "bench": dataclasses.asdict(b),
        "engine": {"num_devices": engine.n, "page_size": config.page_size,
                   "pages_per_device": engine.allocator.pages_per_device, "extra_pages_per_device": engine.extra_pages,
                   "balance_pages_default": engine.scheduler.balance_pages},
        "rows": rows, "runs": runs,
    })


if __name__ == "__main__":
    main()
