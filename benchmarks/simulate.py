"""Replay the dynamic workloads on N devices from calibrated costs, with the engine's own
scheduler and policy code and no device program.

    python -m benchmarks.simulate --calibration CAL.json --validate benchmarks/results/dynamic_....json
    python -m benchmarks.simulate --calibration CAL.json --devices 8 --scale 15.25 \\
        --pages-per-device P --extra-pages-per-device E ...   (projection, see docs/policy.md)

What is real: `Scheduler` (admission, chunked prefill, page allocation, preemption), the
`PageAllocator` with its extra segment, the placements, and `TransitionAwarePolicy` (deciding on
this simulated engine exactly as on a real one, from the same calibration). What is modelled:
  a step's time  = the calibration's decode time for its decoding requests at their mean context
                   (grid, or the measured fit) + its prefill tokens x the measured s/token;
  a switch       = its calibrated cost (fixed + bytes over the measured copy rate), charged at the
                   handoff boundary; pages are re-placed there (free, then allocate as the new
                   placement says, in admission order);
  arrivals       by the simulated clock, the dynamic benchmark's rule;
  token read-back at the end of the step that sampled it (the real engine's overlap shows it one
                   step later: TTFT here is shorter by about one step).
`--validate RESULT.json` replays a measured benchmarks/dynamic.py run (its arrivals, pool and
limits, its policy settings) and prints simulated / measured for every metric.
On other device counts the step fit is evaluated at N devices (the busiest device's KV reads
follow the placement at N); collective time is what the fit measured on the calibration devices:
the projection does not model how all-to-all and all-reduce costs grow with N.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import numpy as np

from benchmarks import workloads as W
from benchmarks.common import read_json, table, write_results
from benchmarks.dynamic import COLUMNS, RequestRecord, Sample, plot, rows_of, summarize
from splash_jax.calibration import Calibration, StepTable, attended_keys
from splash_jax.engine.config import add_dataclass_args
from splash_jax.engine.request import Request, SamplingParams
from splash_jax.engine.scheduler import Scheduler
from splash_jax.kv.allocator import PageAllocator, pages_for_tokens
from splash_jax.kv.capacity import layout_token_capacity
from splash_jax.mesh.layouts import LAYOUTS, get_layout
from splash_jax.policy import PolicyConfig, TransitionAwarePolicy

log = logging.getLogger("benchmarks.simulate")


@dataclasses.dataclass
class SimConfig:
    calibration: str = ""  # a calibration file (benchmarks/calibrate.py); required
    validate: str = ""  # a benchmarks/dynamic.py result to replay and compare with
    devices: int = 0  # 0 = the calibration's
    scale: float = 1.0  # multiplies every calibrated time (target layers / calibrated layers)
    page_size: int = 16
    pages_per_device: int = 48
    extra_pages_per_device: int = 32  # pages the head-sharded layouts gain per device
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 64
    max_model_len: int = 768
    enable_chunked_prefill: bool = True
    workloads: str = ",".join(W.WORKLOADS)
    runs: str = "tp,dp,dop,cp,auto"
    auto_start: str = "dp"
    plot: bool = True


@dataclasses.dataclass
class _EngineLimits:
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


class SimEngine:
    """The attributes TransitionAwarePolicy reads, over a real Scheduler and PageAllocator."""

    def __init__(self, c: SimConfig, n: int, layout: str):
        self.n = n
        self.layout = get_layout(layout)
        self.config = _EngineLimits(c.page_size, c.max_num_seqs, c.max_num_batched_tokens)
        self.extra_pages = c.extra_pages_per_device
        extra = self.extra_pages if self.layout.heads_sharded else 0
        self.allocator = PageAllocator(n, c.pages_per_device, c.page_size, extra)
        self.scheduler = Scheduler(
            self.allocator, c.max_num_seqs, c.max_num_batched_tokens, self.layout.kv_placement, c.max_model_len,
            pages_for_tokens(c.max_model_len, c.page_size), set(), c.enable_chunked_prefill,
        )

    def kv_capacity_tokens(self, name: str | None = None) -> int:
        layout = get_layout(name) if name else self.layout
        extra = self.extra_pages if layout.heads_sharded else 0
        return layout_token_capacity(layout.kv_placement, self.n, self.allocator.pages_per_device, extra, self.config.page_size)

    def switch(self, dst: str) -> None:
        """Hand off to `dst`: re-place every running request's pages (preempting any that no longer fit)."""
        new, s, alloc = get_layout(dst), self.scheduler, self.allocator
        running = sorted(s.running, key=lambda r: r.order)
        for r in running:
            for pages in r.device_pages:
                alloc.free(pages)
            r.device_pages = [[] for _ in range(self.n)]
            s.tables.clear(r.slot)
        if new.heads_sharded and not self.layout.heads_sharded:
            alloc.add_extra_segment(self.extra_pages)
        elif self.layout.heads_sharded and not new.heads_sharded:
            alloc.remove_extra_segment()
        s.set_placement(new.kv_placement)
        self.layout = new
        for r in running:
            r.owner = s.least_loaded_device()
            if not s.allocate(r, r.num_computed):
                s.preempt(r)


def simulate(arrivals: list[W.Arrival], mode: str, c: SimConfig, table_: StepTable, cal: Calibration,
             policy_config: PolicyConfig, n: int) -> dict:
    eng = SimEngine(c, n, c.auto_start if mode == "auto" else mode)
    policy = TransitionAwarePolicy(eng, policy_config, cal, table_) if mode == "auto" else None
    records = [RequestRecord(a.t, a.prompt_len, a.output_len) for a in arrivals]
    samples, switches = [], []
    clock, nxt, step, s = 0.0, 0, 0, eng.scheduler
    while nxt < len(arrivals) or s.has_work():
        while nxt < len(arrivals) and arrivals[nxt].t <= clock:
            a = arrivals[nxt]
            s.add(Request(str(nxt), [2] * a.prompt_len, SamplingParams(max_tokens=a.output_len, ignore_eos=True)))
            nxt += 1
        if not s.has_work():
            clock = arrivals[nxt].t
            continue
        if policy is not None and policy.due(step):
            dst = policy.decide(step)
            if dst is not None:
                load_tokens = sum(r.num_tokens for r in s.running)
                cost = policy.model.costs.switch_seconds(eng.layout, LAYOUTS[dst], load_tokens)
                switches.append({"t": clock, "from": eng.layout.name, "to": dst, "state": "done", "cost_s": cost})
                clock += cost
                eng.switch(dst)
        chunks = s.schedule().chunks
        if not chunks:
            if not s.running:
                raise RuntimeError(f"{mode}: a waiting request can never be admitted (pool or limits too small)")
            continue
        decode = [ch for ch in chunks if ch.num_tokens == 1 and ch.start >= len(ch.request.prompt_ids)]
        prompt = [ch for ch in chunks if not (ch.num_tokens == 1 and ch.start >= len(ch.request.prompt_ids))]
        prefill = sum(ch.num_tokens for ch in prompt)
        keys = sum(attended_keys(ch.start, ch.num_tokens) for ch in prompt)
        ctx = float(np.mean([ch.end for ch in decode])) if decode else 0.0
        clock += table_.step(eng.layout.name, len(decode), ctx, prefill, keys)
        step += 1
        sampling = [ch for ch in chunks if ch.samples]
        for u in s.update(chunks, list(range(len(sampling))), np.full(len(sampling), 5)):
            r = records[int(u.request.request_id)]
            r.first_token = clock if r.first_token is None else r.first_token
            r.tokens += 1
            if u.finish_reason is not None:
                r.finished = clock
        used = sum(x.used_pages for x in eng.allocator.usage())
        samples.append(Sample(clock, eng.layout.name, len(s.running), len(s.waiting),
                              used / sum(x.total_pages for x in eng.allocator.usage())))
    out = summarize(records, samples, s.num_preemptions, switches)
    out |= {"complete": True, "timeline": [dataclasses.asdict(x) for x in samples]}
    if policy is not None:
        out["decisions"] = policy.decisions
    return out


def compare(measured: dict, simulated: dict) -> list[dict]:
    """simulated / measured for each (workload, run) and metric."""
    rows = []
    for wl, runs in simulated.items():
        for mode, sim in runs.items():
            m = measured.get(wl, {}).get(mode)
            if m is None:
                continue

            def ratio(a, b):
                return a / b if a is not None and b else None

            rows.append({
                "workload": wl, "run": mode, "tok_s_meas": m["tokens_per_s"], "tok_s_sim": sim["tokens_per_s"],
                "tok_s_ratio": ratio(sim["tokens_per_s"], m["tokens_per_s"]),
                "ttft_p50_ratio": ratio(sim["ttft_s"]["p50"], m["ttft_s"]["p50"]),
                "tpot_p50_ratio": ratio(sim["tpot_s"]["p50"], m["tpot_s"]["p50"]),
                "steps_meas": m["steps"], "steps_sim": sim["steps"],
                "preempt_meas": m["preemptions"], "preempt_sim": sim["preemptions"],
                "switches_meas": " ".join(f"{x['from']}>{x['to']}" for x in m["switches"]) or "-",
                "switches_sim": " ".join(f"{x['from']}>{x['to']}" for x in sim["switches"]) or "-",
            })
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p.add_argument_group("simulation"), SimConfig)
    add_dataclass_args(p.add_argument_group("workloads"), W.WorkloadConfig)
    add_dataclass_args(p.add_argument_group("layout policy"), PolicyConfig, prefix="policy_")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    c = SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})
    wc = W.WorkloadConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(W.WorkloadConfig)})
    pc = PolicyConfig(**{f.name: getattr(args, "policy_" + f.name) for f in dataclasses.fields(PolicyConfig)})
    if not c.calibration:
        raise SystemExit("--calibration is required (python -m benchmarks.calibrate writes one)")
    cal = Calibration.load(c.calibration)
    measured, arrivals = None, None
    if c.validate:
        res = read_json(c.validate)
        e = res["engine"]
        for k in ("page_size", "pages_per_device", "extra_pages_per_device", "max_num_seqs", "max_num_batched_tokens",
                  "max_model_len", "enable_chunked_prefill"):
            setattr(c, k, e[k])
        c.devices = e["num_devices"]
        c.auto_start = res["args"]["auto_start"]
        pc = PolicyConfig(**{k: v for k, v in res["policy"].items() if k in {f.name for f in dataclasses.fields(PolicyConfig)}})
        measured = res["runs"]
        arrivals = {wl: [W.Arrival(**a) for a in v] for wl, v in res["arrivals"].items()}
        c.workloads, c.runs = ",".join(measured), ",".join(next(iter(measured.values())))
    n = c.devices or cal.devices
    cal.model["kv_bytes_per_token"] *= c.scale
    table_ = StepTable(cal, n, c.scale)
    results = {}
    for wl in c.workloads.split(","):
        arr = arrivals[wl] if arrivals else W.make(wl, wc)
        results[wl] = {mode: simulate(arr, mode, c, table_, cal, pc, n) for mode in c.runs.split(",")}
    print(table(rows_of(results), COLUMNS))
    payload = {"args": vars(args), "devices": n, "calibration": c.calibration, "rows": rows_of(results), "runs": results}
    if measured is not None:
        cmp_rows = compare(measured, results)
        print(table(cmp_rows, list(cmp_rows[0])))
        errs = [abs(r["tok_s_ratio"] - 1) for r in cmp_rows if r["tok_s_ratio"] is not None]
        print(f"throughput |sim/measured - 1|: median {np.median(errs):.1%}, max {max(errs):.1%} over {len(errs)} runs")
        payload["validation"] = cmp_rows
    path = write_results(f"simulate_{n}dev", payload)
    if c.plot:
        for wl, runs in results.items():
            plot(wl, runs, path.with_name(path.stem + f"_{wl}.png"))
    return path


if __name__ == "__main__":
    main()
