"""Replay the Mooncake-shaped TTFT trace through the engine's own Scheduler with modelled step
times, to compare prefill orders before spending device time on them (issue 46).

    .venv/bin/python -m benchmarks.probes.ttft_sim --policies fcfs:0:1:off,srpf:0:1:on
    .venv/bin/python -m benchmarks.probes.ttft_sim --validate benchmarks/results/ttft_trace_....json

What is real: `Scheduler` (admission, chunked prefill, prefix caching, `PrefillOrder`), the step
ladder (`bucket_ladder`), the trace (benchmarks/ttft_trace.py's). What is modelled:
  a step's time  = w(B) + kv * (decode rows' context) + pair * (prefill query-key pairs), B the
                   step's bucket: w interpolates a measured decode step at 1 / 8 / 64 / 128 tokens
                   and grows by `per_token` past 128 (the defaults: one H100, V2-Lite 27 layers,
                   fitted to benchmarks/results/ttft_trace_gpu-nvidia-h100-80gb-hbm3_20261205-180512
                   (unloaded 6,142 and 32,407-token prompts) and decode_roofline's 3.25 / 7.49 / 12.86 ms);
  the overlapped loop: step m is scheduled when step m-2 has ended (the engine's step() schedules
                   while the previous step runs, then waits for it), so a request arriving while a
                   step runs joins the step after the next; with late dispatch, shortly (`lead`)
                   before the step in flight ends (an oracle: the real prediction errs short);
  the first token: at the end of the step that samples it.
`--step-model h200` swaps the step times for an estimate of one H200's (STEP_MODELS: measured decode steps
and unloaded prefills, not a fitted trace run). A policy's 8th field, STEPMS, bounds the steps beside
decodes (--max-step-ms-with-decodes, engine/step_time_cap.py) on this model's own step times.
`--validate` reads a measured ttft_trace result and prints the model's step means and TTFT beside
the measured ones for the same policies (each under its run's ladder; the model's late dispatch is
the oracle's, while the engine predicts, so measured late-dispatch runs read slower). The model ranks
policies; only the device run counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
import types
from unittest import mock

import numpy as np

from benchmarks import workloads as W
from benchmarks.common import percentiles, read_json, table, write_results
from benchmarks.ttft_trace import LATE_RULES, parse_policies
from splash_jax.engine import scheduler as scheduler_module
from splash_jax.engine.config import EngineConfig
from splash_jax.engine.dispatch_timing import prefill_pairs
from splash_jax.engine.prefill_order import PrefillOrder
from splash_jax.engine.request import Request, SamplingParams
from splash_jax.engine.scheduler import Scheduler
from splash_jax.engine.step_programs import bucket_ladder
from splash_jax.engine.step_time_cap import StepCost, StepTimeCap
from splash_jax.kv.allocator import PageAllocator, pages_for_tokens
from splash_jax.mesh.layouts import get_layout

log = logging.getLogger("benchmarks.probes.ttft_sim")


@dataclasses.dataclass
class StepModel:
    """A step's device time in seconds (module docstring); defaults: one H100, V2-Lite 27 layers."""
    small: tuple = ((1, 3.25e-3), (8, 7.49e-3), (64, 12.86e-3), (128, 14.35e-3))  # (bucket tokens, s)
    per_token: float = 12.1e-6  # s per bucket token past the last small point
    kv: float = 2.4e-8  # s per context token a decode row reads (fitted: the trace run's decode-only steps, 14.8 ms at 22.5 rows)
    pair: float = 5.5e-10  # s per prefill query-key pair (expanded attention)
    host_s: float = 3.0e-3  # schedule + dispatch
    lead_s: float = 14.0e-3  # late dispatch: the next step is scheduled this long before the step in flight ends

    def step_cost(self, mean_context: float = 8000.0) -> StepCost:
        """This model as the engine's step-time bound reads its fit (engine/step_time_cap.py): the
        line through the largest small step at `per_token`, a decode token at `mean_context`."""
        tokens, seconds = self.small[-1]
        return StepCost(seconds - tokens * self.per_token, self.per_token, self.pair, self.per_token + self.kv * mean_context)

    def seconds(self, bucket: int, decode_context: float, pairs: float) -> float:
        xs, ys = zip(*self.small)
        w = float(np.interp(bucket, xs, ys)) if bucket <= xs[-1] else ys[-1] + (bucket - xs[-1]) * self.per_token
        return w + self.kv * decode_context + self.pair * pairs


# --step-model: "h100" is the default above (fitted to a trace run); "h200" is estimated, not fitted:
# decode steps of one H200 (V2-Lite 27 layers, 2026-12-03: 2.96 / 5.78 / 9.80 ms at 1 / 8 / 64, ~11.5 ms
# at 128, docs/performance.md), prefill 0.9x the H100's (the unloaded 6,142 / 32,407-token prompts took
# 0.102 / 0.69 s on an H200 against 0.113 / 0.74 s on an H100 under the same ladder, 2026-12-04/05), a
# decode row's context read at the HBM ratio (3.35 / 4.8 TB/s)
STEP_MODELS = {"h100": {}, "h200": {"small": ((1, 2.96e-3), (8, 5.78e-3), (64, 9.8e-3), (128, 11.5e-3)),
                                    "per_token": 0.9 * 12.1e-6, "pair": 0.9 * 5.5e-10, "kv": 1.7e-8}}


@dataclasses.dataclass
class Sim:
    policy: str
    order: PrefillOrder
    late: str  # on | off | long (benchmarks/ttft_trace.py's LATE_RULES)
    step_ms: float = 0.0  # --max-step-ms-with-decodes, its step times from the model (StepModel.step_cost)


def parse(spec: str, budget: int, gap: int, config: EngineConfig) -> list[Sim]:
    """benchmarks/ttft_trace.py's --policies items (GAP is the probe's --gap; LATE defaults to off)."""
    ladder = tuple(b.tokens for b in bucket_ladder(budget, 1, 8, gap))
    return [Sim(p.name, dataclasses.replace(p.order, buckets=ladder), p.late or "off", p.step_ms)
            for p in parse_policies(spec, config, 1.0)]


def replay(arrivals: list[W.Arrival], sim: Sim, model: StepModel, a: argparse.Namespace) -> dict:
    clock = [0.0]
    with mock.patch.object(scheduler_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0])):
        return _replay(arrivals, sim, model, a, clock)  # PrefillOrder's ages run on the simulated clock


def _replay(arrivals: list[W.Arrival], sim: Sim, model: StepModel, a: argparse.Namespace, clock: list) -> dict:
    ladder = [b.tokens for b in bucket_ladder(a.budget, 1, 8, a.gap)]
    alloc = PageAllocator(1, a.pages, a.page_size)
    s = Scheduler(alloc, a.max_num_seqs, a.budget, get_layout("tp").kv_placement, a.max_model_len,
                  pages_for_tokens(a.max_model_len, a.page_size), set(), True, enable_prefix_caching=True,
                  prefill_order=sim.order)
    if sim.step_ms:
        s.step_time_cap = StepTimeCap(sim.step_ms / 1e3, model.step_cost)
    n = len(arrivals)
    first, done, arrive = [None] * n, [None] * n, [a_.t for a_ in arrivals]
    begun = [None] * n  # when the first step holding part of its prompt started on the device
    intervals = {"decode_only": [], "with_prefill": []}
    ctx = []  # decode-only steps: (rows, summed context)
    nxt, now, inflight, end_prev = 0, 0.0, None, 0.0  # inflight: (chunks, end time)
    while nxt < n or s.has_work() or inflight:
        if sim.late != "off" and inflight is not None and inflight[2] >= LATE_RULES[sim.late].min_step_s and (
                sim.late == "on" or inflight[3]):  # long: only long prefill steps were held
            now = max(now, inflight[1] - model.lead_s)
        if not s.has_work() and inflight is None and nxt < n:
            now = max(now, arrivals[nxt].t)
        while nxt < n and arrivals[nxt].t <= now:
            x = arrivals[nxt]
            r = Request(str(nxt), W.build_prompt(x, nxt, 100_000, 0), SamplingParams(max_tokens=x.output_len, ignore_eos=True))
            r.metrics.arrival = x.t
            s.add(r)
            nxt += 1
        clock[0] = now
        chunks = s.schedule().chunks if s.has_work() else []
        step = None
        if chunks:
            s.dispatched(chunks)  # the pages these chunks complete may be cached now
            decode = [c for c in chunks if c.num_tokens == 1 and c.start >= len(c.request.prompt_ids)]
            prompt = [c for c in chunks if c not in decode]
            tokens = sum(c.num_tokens for c in chunks)
            bucket = next(b for b in ladder if b >= tokens)
            t = model.seconds(bucket, sum(c.end for c in decode), prefill_pairs(prompt))
            start = max(now + model.host_s, end_prev)
            end_prev = start + t
            intervals["with_prefill" if prompt else "decode_only"].append(t)
            if not prompt:
                ctx.append((len(decode), sum(c.end for c in decode)))
            step = (chunks, end_prev, t, sum(c.num_tokens for c in prompt) >= LATE_RULES["long"].min_prefill_tokens)
            for c in prompt:
                i = int(c.request.request_id)
                begun[i] = start if begun[i] is None else begun[i]
        if inflight is not None:
            chunks_done, end = inflight[:2]
            now = max(now, end)
            sampling = [c for c in chunks_done if c.samples]
            for u in s.update(chunks_done, list(range(len(sampling))), np.full(len(sampling), 5)):
                i = int(u.request.request_id)
                first[i] = end if first[i] is None else first[i]
                if u.finish_reason is not None:
                    done[i] = end
        elif step is None:
            now = max(now, arrivals[nxt].t) if nxt < n else now
        inflight = step
    ttft = np.array([f - t for f, t in zip(first, arrive)])
    tpot = [(d - f) / (x.output_len - 1) for d, f, x in zip(done, first, arrivals) if x.output_len > 1]
    lens = np.array([x.prompt_len for x in arrivals])
    order = np.argsort(lens, kind="stable")
    quart = [float(np.median(ttft[q])) for q in np.array_split(order, 4)]
    waited = np.array([b - t for b, t in zip(begun, arrive)])
    return {"policy": sim.policy, "ttft": percentiles(list(ttft), (50, 99)),
            "before_first_chunk_p50": float(np.median(waited)), "first_chunk_to_token_p50": float(np.median(ttft - waited)), "tpot": percentiles(tpot, (50, 99)), "ttft_by_length_quartile_p50": quart,
            "decode_only_ms": 1e3 * float(np.mean(intervals["decode_only"])), "decode_only_steps": len(intervals["decode_only"]),
            "with_prefill_ms": 1e3 * float(np.mean(intervals["with_prefill"])), "with_prefill_steps": len(intervals["with_prefill"]),
            "decode_only_rows_ctx": np.mean(ctx, axis=0).tolist() if ctx else None,
            "makespan_s": max(d for d in done if d is not None), "busy_s": sum(map(sum, intervals.values())),
            "hit_rate": s.cache_stats.as_dict()["hit_rate"]}


def late_rule(key: str, measured: dict) -> str:
    """A measured run's LATE: "on" in a run from before the short steps (no idle_launches) meant "long"."""
    parts = key.split(":")
    late = parts[3] if len(parts) > 3 else ""
    return "long" if late == "on" and "idle_launches" not in measured.get("late_dispatch", {}) else late


def unloaded(x: W.Arrival, model: StepModel, a: argparse.Namespace) -> float:
    alone = dataclasses.replace(x, t=0.0, output_len=1)
    r = replay([alone], Sim("alone", PrefillOrder(buckets=tuple(b.tokens for b in bucket_ladder(a.budget, 1, 8, a.gap))), "off"), model, a)
    return r["ttft"]["p50"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="fcfs:0:1:off,srpf:0:1:on,srpf:0:100:on::7400:on",
                   help="benchmarks/ttft_trace.py's --policies (LATE off unless on)")
    p.add_argument("--validate", default="", help="a ttft_trace result: its policies, beside the model")
    p.add_argument("--trace", default=str(W.TRACES / "mooncake_ttft.jsonl"))
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--gap", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=10_000)  # 20 GB of V2-Lite pages (64 tokens x 576 x 2 B x 27 layers)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=34_000)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--lead-ms", type=float, default=14.0,
                   help="late dispatch: schedule this long before the step in flight ends (14: the engine's lead on one H100)")
    p.add_argument("--step-model", choices=sorted(STEP_MODELS), default="h100",
                   help="step times: h100 (fitted to a trace run on one H100) or h200 (estimated, STEP_MODELS)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    arrivals = W.read_mooncake(a.trace, 512, 0, a.time_scale)
    model = StepModel(lead_s=a.lead_ms / 1e3, **STEP_MODELS[a.step_model])
    by_len = sorted(arrivals, key=lambda x: x.prompt_len)
    measured = read_json(a.validate) if a.validate else None
    if measured:  # each measured run under its own ladder, its GAP field dropped from the policy
        runs = []
        for k, m in measured["runs"].items():
            if len(k.split(":")) > 7:
                log.warning("%s: a policy field this code no longer has, not modelled", k)
                continue
            runs.append((k, m.get("token_bucket_gap", 0),  # (runs before the gap existed: powers of two)
                         ":".join(k.split(":")[:3] + [late_rule(k, m), ""] + k.split(":")[5:]).rstrip(":")))
    else:
        runs = [(None, a.gap, item) for item in a.policies.split(",")]
    rows, bases = [], {}
    for key, gap, spec in runs:
        g = argparse.Namespace(**{**vars(a), "gap": gap})
        if gap not in bases:
            bases[gap] = base = {"median": unloaded(by_len[(len(by_len) - 1) // 2], model, g), "longest": unloaded(by_len[-1], model, g)}
            log.info("unloaded TTFT (model), gap %d: median %.4f s, longest %.4f s", gap, base["median"], base["longest"])
        base = bases[gap]
        sim = parse(spec, a.budget, gap, EngineConfig())[0]
        t0 = time.perf_counter()
        r = replay(arrivals, sim, model, g)
        rows.append({"policy": sim.policy, "gap": gap, "ttft_p50": r["ttft"]["p50"], "ttft_p99": r["ttft"]["p99"],
                     "p50_over_unloaded": r["ttft"]["p50"] / base["median"], "p99_over_longest": r["ttft"]["p99"] / base["longest"],
                     "tpot_p99_over_p50": r["tpot"]["p99"] / r["tpot"]["p50"], "tpot_p50_ms": 1e3 * r["tpot"]["p50"],
                     "q_p50": " ".join(f"{q:.3f}" for q in r["ttft_by_length_quartile_p50"]),
                     "wait_p50": r["before_first_chunk_p50"], "prefill_p50": r["first_chunk_to_token_p50"],
                     "decode_ms": r["decode_only_ms"], "prefill_step_ms": r["with_prefill_ms"],
                     "steps": f"{r['decode_only_steps']}+{r['with_prefill_steps']}", "busy_s": r["busy_s"], "hit": r["hit_rate"],
                     "sim_s": time.perf_counter() - t0})
        log.info("%s: decode-only steps' mean rows and summed context %s", sim.policy, r["decode_only_rows_ctx"])
        if key is not None:
            m, st = measured["runs"][key], measured["runs"][key]["step_intervals"]
            rows.append({"policy": "  measured " + key, "gap": gap, "ttft_p50": m["ttft_s"]["p50"], "ttft_p99": m["ttft_s"]["p99"],
                         "q_p50": " ".join(f"{q['ttft_s']['p50']:.3f}" for q in m["ttft_by_length_quartile"]),
                         "tpot_p50_ms": 1e3 * m["tpot_s"]["p50"], "tpot_p99_over_p50": m["tpot_s"]["p99"] / m["tpot_s"]["p50"],
                         "decode_ms": st["decode_only"]["mean_ms"], "prefill_step_ms": st["with_prefill"]["mean_ms"],
                         "steps": f"{st['decode_only']['steps']}+{st['with_prefill']['steps']}"})
    print(table(rows, ["policy", "gap", "ttft_p50", "ttft_p99", "p50_over_unloaded", "p99_over_longest", "wait_p50", "prefill_p50",
                       "tpot_p50_ms", "tpot_p99_over_p50", "q_p50", "decode_ms", "prefill_step_ms", "steps", "busy_s", "hit", "sim_s"]))
    write_results("ttft_sim", {"step_model_name": a.step_model, "unloaded_by_gap": bases, "model": dataclasses.asdict(model), "rows": rows, "args": vars(a)})


if __name__ == "__main__":
    main()
