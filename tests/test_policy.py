"""The transition-aware policy: its cost model ranks layouts as DESIGN.md §2 says (roofline) or as a
measured calibration table says, it respects capacity, it waits out its cooldown, a switch must
repay its measured cost over the horizon, and switching it drives keeps outputs identical."""

import itertools
import math

import pytest

from benchmarks.simulate import SimConfig, SimEngine
from splash_jax.calibration import Calibration, StepTable, SwitchCost
from splash_jax.engine.request import Request, accumulate
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.mesh.layouts import LAYOUTS
from splash_jax.policy import CostModel, Load, PolicyConfig, TransitionAwarePolicy

# A 128-token step budget: 104 step programs on the 8-device mesh. Each XLA:CPU executable maps
# ~3 memory regions per kernel (~450 per step program); with the default 512 (136 programs) and what
# earlier tests leave mapped, the suite crossed the kernel's 65,530-mapping limit (LLVM: "Unable to
# allocate section memory").
KW = dict(num_devices=8, page_size=16, kv_memory_gb=0.01, compile_cache_dir=None, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(warmup=False, **KW))


def best(engine, load):
    policy = TransitionAwarePolicy(engine)
    costs = {n: CostModel(engine, PolicyConfig()).step_seconds(LAYOUTS[n], load) for n in policy.feasible(load)}
    return min(costs, key=costs.get), sorted(costs)


def test_one_short_request_prefers_tensor_parallel(engine):
    # Owner layouts put the whole request on one device; TP spreads its heads over all eight.
    assert best(engine, Load(1, 100, 100))[0] == "tp"


def test_a_context_longer_than_one_device_leaves_only_context_parallel(engine):
    too_long = engine.allocator.pages_per_device * 16 + 100
    assert best(engine, Load(1, too_long, too_long)) == ("cp", ["cp"])


def test_many_short_requests_prefer_data_parallel_attention(engine):
    # Sixteen short requests: replicating this model's attention weights (DP) costs less than
    # exchanging queries and outputs every layer (DOP, CP) or replicating every cache (TP).
    assert best(engine, Load(16, 1600, 100))[0] == "dp"


def test_memory_pressure_excludes_layouts_that_cannot_hold_the_load(engine):
    load = Load(64, 64 * 200, 200)  # above TP's and DP's pools, within DOP's and CP's
    assert engine.kv_capacity_tokens("dp") < load.cached_tokens < engine.kv_capacity_tokens("dop")
    assert TransitionAwarePolicy(engine).feasible(load) == ["dop", "cp"]


def test_switch_cost_counts_what_moves(engine):
    m, load = CostModel(engine, PolicyConfig()), Load(8, 800, 100)
    assert m.switch_seconds(LAYOUTS["tp"], LAYOUTS["dop"], load) == 0  # drop replicas, slice nothing
    assert m.switch_seconds(LAYOUTS["dop"], LAYOUTS["tp"], load) > m.switch_seconds(LAYOUTS["dop"], LAYOUTS["cp"], load) > 0
    assert m.switch_seconds(LAYOUTS["dop"], LAYOUTS["dp"], load) > 0  # weights gathered


def test_auto_policy_follows_the_load_and_keeps_outputs_identical():
    acc = {}
    prompts = ["Latent attention keeps one vector per token."]
    prompts += [f"request {i} arrives later with a longer prompt: " + "latent pages move " * 25 for i in range(7)]
    params = SamplingParams(max_tokens=24)
    fixed = Engine(EngineConfig(layout="dop", warmup=False, **KW))
    want = [o.token_ids for o in fixed.generate(prompts, params)]
    policy = PolicyConfig(interval_steps=2, cooldown_steps=4)
    # warmup=False: programs compile on first use (this test checks decisions and outputs; that a
    # switch compiles nothing is test_switching.py::test_random_switch_schedules_keep_outputs_identical's).
    engine = Engine(EngineConfig(layout="dp", enable_switching=True, layout_policy="auto", policy=policy, warmup=False, **KW))
    ids = {engine.add_request(prompts[0], params): 0}
    done, step = {}, 0
    while engine.has_work() or len(ids) < len(prompts):
        if step == 8:  # load rises: seven more requests
            for i in range(1, len(prompts)):
                ids[engine.add_request(prompts[i], params)] = i
        for out in accumulate(acc, engine.step()):
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        step += 1
    moves = [(d["from"], d["to"]) for d in engine.policy.decisions]
    # One short request: TP spreads it over every device. Eight ~100-token requests: TP would read
    # every cache on every device, so back to DP.
    assert moves[:2] == [("dp", "tp"), ("tp", "dp")], engine.policy.decisions
    assert engine.stats()["switches"] >= 2
    assert [done[i] for i in range(len(prompts))] == want


# --- calibrated cost model ------------------------------------------------------------------
# A synthetic calibration table drives the real policy on the simulator's engine stand-in
# (the real Scheduler and PageAllocator; no device programs), so these run in milliseconds.


N, RS, CS = 8, [1, 4, 16], [32, 128, 384]


def synthetic(base: dict[str, float], per_token: float = 2e-6, switch_fixed: float = 0.01) -> Calibration:
    """Step time = base[layout] + 1e-4 x requests + per_token x tokens the busiest device reads."""

    def t(lay, r, c):
        busy = {"tp": r * c, "dp": math.ceil(r / N) * c, "dop": math.ceil(r / N) * c, "cp": r * c / N}[lay]
        return base[lay] + 1e-4 * r + per_token * busy

    return Calibration(
        "synthetic", N, {"name": "t", "layers": 3, "heads": 8, "hidden": 128, "kv_bytes_per_token": 6912}, 16, RS, CS,
        {lay: [[t(lay, r, c) for c in CS] for r in RS] for lay in LAYOUTS}, {lay: [0.01, 1e-5] for lay in LAYOUTS}, 1e9,
        {f"{a}->{b}": SwitchCost(switch_fixed, 1e9) for a, b in itertools.permutations(LAYOUTS, 2)},
    )


def sim(layout: str, running: int, context: int, waiting: int = 0, wait_len: int = 0, pages: int = 48) -> SimEngine:
    eng = SimEngine(SimConfig(pages_per_device=pages, extra_pages_per_device=32), N, layout)
    for i in range(running + waiting):
        n = context if i < running else wait_len
        r = Request(f"r{i}", [2] * n, SamplingParams(max_tokens=8, ignore_eos=True))
        eng.scheduler.add(r)
        if i < running:
            assert eng.scheduler.admit_cached(r, n - 1)
    return eng


FAST = {"tp": 0.02, "dp": 0.02, "dop": 0.02, "cp": 0.02}


@pytest.mark.parametrize("fastest", list(LAYOUTS))
def test_calibrated_policy_picks_the_layout_the_table_says_is_fastest(fastest):
    cal = synthetic(FAST | {fastest: 0.005})
    start = "dp" if fastest != "dp" else "tp"
    for running, ctx in [(1, 40), (4, 100), (12, 60)]:
        eng = sim(start, running, ctx)
        policy = TransitionAwarePolicy(eng, PolicyConfig(cooldown_steps=0), cal)
        est = policy.estimates(Load.of(eng))
        assert min(est, key=lambda k: est[k].step_s) == fastest
        assert policy.decide(0) == fastest
        assert policy.decisions[-1]["estimates"][fastest]["source"] == "grid"  # inside the measured grid


def test_calibrated_policy_never_picks_a_layout_that_cannot_hold_the_load():
    cal = synthetic(FAST | {"tp": 0.001, "dp": 0.004})  # TP fastest, then DP, by far
    for running, ctx in [(2, 100), (6, 300), (12, 300), (16, 380)]:
        eng = sim("dop", running, ctx)
        policy = TransitionAwarePolicy(eng, PolicyConfig(cooldown_steps=0), cal)
        load = Load.of(eng)
        dst = policy.decide(0) or "dop"
        assert load.cached_tokens <= eng.kv_capacity_tokens(dst) * 0.9, (running, ctx, dst)
        if load.cached_tokens > eng.kv_capacity_tokens("tp") * 0.9:
            assert dst != "tp" and "tp" in policy.recent[-1]["infeasible"]
    assert dst in ("dop", "cp") and "dp" in policy.recent[-1]["infeasible"]  # 16 x 380: beyond DP too


def test_calibrated_policy_waits_out_its_cooldown():
    cal = synthetic(FAST | {"tp": 0.005})
    eng = sim("dp", 4, 100)
    policy = TransitionAwarePolicy(eng, PolicyConfig(cooldown_steps=32), cal)
    assert policy.decide(0) == "tp"
    # The engine did not switch: the policy still sees DP, but will not ask again within 32 steps.
    assert [policy.decide(s) for s in (1, 16, 31)] == [None] * 3
    assert policy.decide(32) == "tp"


def test_switch_only_when_the_horizon_repays_the_measured_switch_cost():
    # TP saves 2 ms per step over DP; the measured switch costs 1 s.
    cal = synthetic(FAST | {"tp": 0.018}, switch_fixed=1.0)
    eng = sim("dp", 4, 100)
    short = TransitionAwarePolicy(eng, PolicyConfig(horizon_steps=256, cooldown_steps=0, min_step_gain=0), cal)
    assert short.decide(0) is None  # 0.5 s saved < 1.2 s
    assert "does not repay" in short.recent[-1]["reason"]
    long = TransitionAwarePolicy(eng, PolicyConfig(horizon_steps=1024, cooldown_steps=0, min_step_gain=0), cal)
    assert long.decide(0) == "tp"  # 2.05 s saved > 1.2 s
    # The fixed part plus the cache it copies (7 new replicas of 4 x 100 tokens) at the measured rate.
    assert long.decisions[-1]["switch_s"] == pytest.approx(1.0 + 400 * 7 * 6912 / 1e9)


def test_waiting_requests_favour_the_layout_that_admits_them():
    # Same step time everywhere; DOP's extra segment admits waiting requests DP's pool cannot.
    cal = synthetic(FAST | {"dp": 0.019})
    eng = sim("dp", 10, 150, waiting=16, wait_len=150, pages=24)
    policy = TransitionAwarePolicy(eng, PolicyConfig(cooldown_steps=0), cal)
    est = policy.estimates(Load.of(eng))
    assert est["dop"].batch > est["dp"].batch
    assert policy.decide(0) in ("dop", "cp")  # the two layouts with the largest pool


def test_step_table_interpolates_the_grid_and_fits_outside_it():
    cal = synthetic(FAST)
    table = StepTable(cal)
    assert table.seconds("dp", 4, 128) == (pytest.approx(cal.step_s["dp"][1][1]), "grid")
    mid = table.seconds("tp", 4, 80)[0]  # linear in context between two cells
    assert mid == pytest.approx((cal.step_s["tp"][1][0] + cal.step_s["tp"][1][1]) / 2)
    t, source = table.seconds("tp", 32, 1000)  # outside: the fit, exact for this linear table
    assert source == "fit" and t == pytest.approx(0.02 + 1e-4 * 32 + 2e-6 * 32 * 1000, rel=1e-6)
    eight = StepTable(cal, devices=2, scale=2.0)  # projection: the fit at 2 devices, times doubled
    assert eight.seconds("dp", 4, 100)[0] == pytest.approx(2 * (0.02 + 4e-4 + 2e-6 * 2 * 100), rel=1e-6)


def test_prefill_steps_cost_more_deep_in_a_prompt():
    """intercept + s/token prices a chunk from position 0; the per-key term adds what its tokens
    read of the cached prefix. A two-term (older) file prices every chunk like a first one."""
    from splash_jax.calibration import attended_keys

    cal = synthetic(FAST)
    cal.prefill_s = {lay: [0.01, 1e-5, 1e-8] for lay in LAYOUTS}
    table = StepTable(cal)
    first = table.step("tp", 0, 0, 64, attended_keys(0, 64))
    deep = table.step("tp", 0, 0, 64, attended_keys(1024, 64))
    assert first == pytest.approx(0.01 + 64e-5)
    assert deep - first == pytest.approx(1e-8 * 64 * 1024)
    cal.prefill_s = {lay: [0.01, 1e-5] for lay in LAYOUTS}
    assert StepTable(cal).step("tp", 0, 0, 64, attended_keys(1024, 64)) == pytest.approx(first)


def test_calibration_file_round_trip_and_engine_loading(engine, tmp_path):
    cal = synthetic(FAST | {"cp": 0.001})
    path = cal.save(tmp_path / "cal.json")
    assert Calibration.load(path) == cal
    model = CostModel(engine, PolicyConfig(calibration=str(path)))
    assert model.kind.startswith("calibrated")
    assert model.step_seconds(LAYOUTS["cp"], Load(4, 400, 100)) < model.step_seconds(LAYOUTS["tp"], Load(4, 400, 100))


def test_gains_inside_the_cost_models_error_are_not_taken():
    # TP is 6.8% cheaper per token than DP (a free switch): under the default 10% it stays.
    cal = synthetic(FAST | {"tp": 0.018}, switch_fixed=0.0)
    eng = sim("dp", 4, 100)
    policy = TransitionAwarePolicy(eng, PolicyConfig(cooldown_steps=0), cal)
    assert policy.decide(0) is None and "under 10%" in policy.recent[-1]["reason"]
    assert TransitionAwarePolicy(eng, PolicyConfig(cooldown_steps=0, min_step_gain=0.05), cal).decide(0) == "tp"


def test_a_queue_of_prompts_favours_the_layout_that_prefills_faster():
    # Equal decode steps everywhere; CP computes prompt tokens at a quarter of the others' cost.
    cal = synthetic(FAST)
    cal.prefill_s = {lay: [0.01, 4e-3] for lay in LAYOUTS} | {"cp": [0.01, 1e-3]}
    eng = sim("dp", 2, 40, waiting=4, wait_len=300)
    policy = TransitionAwarePolicy(eng, PolicyConfig(cooldown_steps=0), cal)
    load = Load.of(eng)
    assert sum(t for _, t in load.prompts) == 4 * 300  # waiting prompts; the running two are decoding
    est = policy.estimates(load)
    assert est["cp"].prefill_s == pytest.approx(19 * 0.01 + 1200 * 1e-3)  # 1200 tokens in steps of 64
    assert est["cp"].prefill_s < est["dp"].prefill_s
    assert policy.decide(0) == "cp"
    # Without the queue the same table gives no reason to move.
    assert TransitionAwarePolicy(sim("dp", 2, 40), PolicyConfig(cooldown_steps=0), cal).decide(0) is None


def test_the_policy_looks_again_when_requests_arrive():
    eng = sim("dp", 2, 40)
    policy = TransitionAwarePolicy(eng, PolicyConfig(interval_steps=16), synthetic(FAST))
    assert policy.due(3)  # first look
    assert not policy.due(4) and not policy.due(5)
    eng.scheduler.add(Request("new", [2] * 30, SamplingParams(max_tokens=4)))
    assert policy.due(6) and not policy.due(7)
    assert policy.due(16)  # the interval still applies
    quiet = TransitionAwarePolicy(eng, PolicyConfig(interval_steps=16, evaluate_on_arrival=False), synthetic(FAST))
    eng.scheduler.add(Request("new2", [2] * 30, SamplingParams(max_tokens=4)))
    assert not quiet.due(6) and quiet.due(32)


def test_a_switch_fitted_below_zero_still_costs_nothing_less_than_zero():
    cal = synthetic(FAST, switch_fixed=-0.5)
    eng = sim("dp", 4, 100)
    cost = CostModel(eng, PolicyConfig(), cal).switch_seconds(LAYOUTS["dp"], LAYOUTS["tp"], Load.of(eng))
    assert cost == pytest.approx(400 * 7 * 6912 / 1e9)  # only the copy, at the measured rate
