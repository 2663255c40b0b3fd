"""The transition-aware policy: its cost model ranks layouts as DESIGN.md §2 says, it respects
capacity, it waits out its cooldown, and switching it drives keeps outputs identical."""

import pytest

from splash_jax.engine.request import accumulate
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.mesh.layouts import LAYOUTS
from splash_jax.policy import CostModel, Load, PolicyConfig, TransitionAwarePolicy

KW = dict(num_devices=8, page_size=16, kv_memory_gb=0.01, compile_cache_dir=None)


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
    # With this model's tiny attention weights, replicating them costs less than any exchange.
    assert best(engine, Load(8, 800, 100))[0] == "dp"


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
    engine = Engine(EngineConfig(layout="dp", enable_switching=True, layout_policy="auto", policy=policy, **KW))
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
