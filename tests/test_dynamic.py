"""Dynamic workloads and the simulator: seeded workloads have the shapes their names promise, the
sample trace parses, arrivals survive a JSON round trip (tests/test_prefix_workloads.py covers the
shared-prefix workloads), and the simulator (real scheduler, allocator and policy; calibrated step
times; no device program) completes every request with its exact length in every layout, queues
where a layout's pool is too small, and lets the policy switch."""

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from benchmarks import workloads as W
from benchmarks.simulate import SimConfig, compare, simulate
from splash_jax.calibration import Calibration, StepTable, SwitchCost
from splash_jax.mesh.layouts import LAYOUTS
from splash_jax.policy import PolicyConfig

N = 8


def calibration(base: dict[str, float]) -> Calibration:
    rs, cs = [1, 4, 16], [32, 128, 384]

    def t(lay, r, c):
        busy = {"tp": r * c, "dp": math.ceil(r / N) * c, "dop": math.ceil(r / N) * c, "cp": r * c / N}[lay]
        return base[lay] + 1e-4 * r + 2e-6 * busy

    return Calibration("synthetic", N, {"name": "t", "layers": 3, "heads": 8, "hidden": 128, "kv_bytes_per_token": 6912},
                       16, rs, cs, {lay: [[t(lay, r, c) for c in cs] for r in rs] for lay in LAYOUTS},
                       {lay: [0.01, 1e-5] for lay in LAYOUTS}, 1e9,
                       {f"{a}->{b}": SwitchCost(0.01, 1e9) for a, b in itertools.permutations(LAYOUTS, 2)})


def test_workloads_are_seeded_and_shaped_as_named():
    c = W.WorkloadConfig()
    assert W.make("rollout", c) == W.make("rollout", c)
    assert W.make("rollout", c) != W.make("rollout", dataclasses.replace(c, workload_seed=1))
    outs = [a.output_len for a in W.make("rollout", c)]
    assert all(a.t == 0 for a in W.make("rollout", c))
    assert np.median(outs) < np.mean(outs) and max(outs) > 4 * np.median(outs)  # long tail: a few long ones
    agentic = W.make("agentic", c)
    assert [a.t for a in agentic] == sorted(a.t for a in agentic)
    bursts = [a for a in agentic if a.prompt_len == c.burst_prompt]
    assert len(bursts) == c.burst_size * len(np.arange(c.burst_every_s / 2, c.agentic_duration_s, c.burst_every_s))
    scaled = W.make("agentic", dataclasses.replace(c, time_scale=3.0))
    assert [a.t for a in scaled] == pytest.approx([3 * a.t for a in agentic])
    trace = W.make("trace", c)
    assert len(trace) == 40 and trace[0].t > 0 and all(a.prompt_len >= 1 and a.output_len >= 1 for a in trace)


def test_arrivals_round_trip_through_json_and_old_workloads_name_no_blocks():
    # benchmarks/simulate.py --validate rebuilds arrivals from a dynamic result's JSON
    c = W.WorkloadConfig()
    for name in W.ALL_WORKLOADS:
        arr = W.make(name, c)
        assert [W.Arrival(**a) for a in json.loads(json.dumps([dataclasses.asdict(a) for a in arr]))] == arr, name
        if name in W.WORKLOADS:  # open loop, random prompts: unchanged
            assert all(not a.blocks and a.follows < 0 and a.temperature == 0 for a in arr)
            assert W.build_prompt(arr[0], 0, 4096, 0) == W.prompt_ids(0, arr[0].prompt_len, 4096, 0)


def test_trace_rejects_bad_rows(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("arrival_s,prompt_len,output_len\n0.5,0,3\n")
    with pytest.raises(ValueError, match="lengths >= 1"):
        W.read_trace(bad)


def run_all(workload: str, cal: Calibration, policy: PolicyConfig, c: SimConfig | None = None) -> dict:
    c = c or SimConfig()
    arrivals = W.make(workload, W.WorkloadConfig())
    return {m: simulate(arrivals, m, c, StepTable(cal), cal, policy, N) for m in ("tp", "dp", "dop", "cp", "auto")}


def test_simulator_completes_every_request_with_its_length_in_every_layout():
    cal = calibration({"tp": 0.01, "dp": 0.012, "dop": 0.014, "cp": 0.013})
    for wl in ("rollout", "trace", "mooncake"):
        arrivals = W.make(wl, W.WorkloadConfig())
        for mode, r in run_all(wl, cal, PolicyConfig(interval_steps=4, cooldown_steps=8)).items():
            assert r["completed"] == r["requests"] == len(arrivals), (wl, mode)
            assert r["output_tokens"] == sum(a.output_len for a in arrivals)
            assert r["ttft_s"]["p50"] > 0 and r["tokens_per_s"] > 0


def test_simulated_pressure_queues_in_tp_and_the_policy_leaves_it():
    # TP is the fastest per step, but its replicated pool holds ~4 of the 20 long requests at once.
    cal = calibration({"tp": 0.005, "dp": 0.02, "dop": 0.02, "cp": 0.02})
    wide = SimConfig(max_num_batched_tokens=1024)  # admission limited by the pool, not the token budget
    runs = run_all("pressure", cal, PolicyConfig(interval_steps=4, cooldown_steps=8), wide)
    peak = {m: max(s["running"] for s in r["timeline"]) for m, r in runs.items()}
    assert peak["tp"] < peak["dop"] == 20
    assert runs["tp"]["makespan_s"] > runs["dop"]["makespan_s"]
    # auto starts in DP, where everything fits: it must not move to TP while the load exceeds TP's pool.
    crowded = [s for s in runs["auto"]["timeline"] if s["running"] > peak["tp"]]
    assert crowded and all(s["layout"] != "tp" for s in crowded)


def test_simulated_auto_follows_the_shrinking_rollout_batch():
    # DP is cheapest for a full batch, TP for a few requests (the table says so): auto moves DP -> TP
    # as the long-tailed batch drains, and is at least as fast as either fixed layout.
    cal = calibration({"tp": 0.010, "dp": 0.004, "dop": 0.02, "cp": 0.02})
    cal.step_s["dp"] = [[0.006 + 1e-4 * r + 2e-6 * math.ceil(r / N) * c for c in cal.contexts] for r in cal.requests]
    cal.step_s["tp"] = [[0.002 + 1e-3 * r for c in cal.contexts] for r in cal.requests]
    runs = run_all("rollout", cal, PolicyConfig(interval_steps=4, cooldown_steps=8, horizon_steps=64))
    assert [(s["from"], s["to"]) for s in runs["auto"]["switches"]][:1] == [("dp", "tp")]
    assert runs["auto"]["tokens_per_s"] >= 0.98 * max(runs["dp"]["tokens_per_s"], runs["tp"]["tokens_per_s"])


def test_validation_compares_simulated_with_measured():
    cal = calibration({"tp": 0.01, "dp": 0.012, "dop": 0.014, "cp": 0.013})
    sim = {"rollout": run_all("rollout", cal, PolicyConfig())}
    measured = json.loads(json.dumps(sim))  # a "measurement" 20% slower everywhere
    for r in measured["rollout"].values():
        r["tokens_per_s"] *= 0.8
    rows = compare(measured, sim)
    assert len(rows) == 5 and all(r["tok_s_ratio"] == pytest.approx(1.25) for r in rows)
