"""Prefill order (engine/prefill_order.py): the ranking itself (aging included), the scheduler under
srpf, the prefill cap beside decodes and short finishing steps on a fake step, and the engine: the
same greedy outputs as fcfs, with no compile after warm-up."""

import collections

import numpy as np
import pytest

from splash_jax.engine.prefill_order import ALL, PrefillOrder
from splash_jax.engine.request import Request, SamplingParams
from splash_jax.engine.scheduler import Scheduler
from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.placement import REPLICATED


def req(rid, prompt_len, arrival, computed=0, preempted=0, max_tokens=4):
    r = Request(rid, list(range(2, 2 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    r.metrics.arrival, r.num_computed, r.metrics.num_preemptions = arrival, computed, preempted
    return r


def ids(items):
    return [x.request_id if isinstance(x, Request) else x for x in items]


def test_srpf_ranks_preempted_then_aged_oldest_first_then_fewest_tokens_left_ties_by_arrival():
    order = PrefillOrder("srpf", max_wait_s=10.0)
    long_old = req("long_old", 100, arrival=0.0)
    short_a, short_b = req("short_a", 10, arrival=2.0), req("short_b", 10, arrival=1.0)  # tie: earlier first
    mid = req("mid", 50, arrival=0.5, computed=42)  # part-way: 8 tokens left
    back = req("back", 300, arrival=5.0, preempted=1)
    waiting = collections.deque([long_old, short_a, short_b, back])
    assert ids(order.plan([], waiting, now=9.0)) == [ALL]
    assert ids(waiting) == ["back", "short_b", "short_a", "long_old"]  # sorted in place
    # running and waiting merged: `mid` (8 left) before the waiting 10-token ones
    waiting = collections.deque([long_old, short_a, short_b])
    assert ids(order.plan([mid], waiting, now=9.0)) == ["mid", ALL]
    assert ids(waiting) == ["short_b", "short_a", "long_old"]
    # past the age bound the oldest goes first: long_old (age 11), then mid (age 10.5), then the rest
    waiting = collections.deque([short_a, long_old, short_b])
    assert ids(order.plan([mid], waiting, now=11.0)) == [1, "mid", ALL]
    assert ids(waiting) == ["long_old", "short_b", "short_a"]
    # a running prefill ranked after waiting ones: admit those first, then continue it
    big = req("big", 200, arrival=0.2, computed=100)  # 100 left, as long_old, which arrived earlier
    waiting = collections.deque([long_old, short_a])
    assert ids(order.plan([big, mid], waiting, now=9.0)) == ["mid", 2, "big", ALL]
    assert ids(waiting) == ["short_a", "long_old"]


def test_aging_lets_a_long_prompt_climb_past_newer_shorter_ones():
    order = PrefillOrder("srpf", max_wait_s=1e9, aging_tokens_per_s=10.0)
    long_old, short_new = req("long_old", 100, arrival=0.0), req("short_new", 40, arrival=5.0)
    waiting = collections.deque([short_new, long_old])
    order.plan([], waiting, now=5.0)  # long_old: 100 - 50 = 50 > short_new's 40
    assert ids(waiting) == ["short_new", "long_old"]
    order.plan([], waiting, now=7.0)  # 100 - 70 = 30 < 40 - 20 = 20? no: 30 > 20, still behind
    assert ids(waiting) == ["short_new", "long_old"]
    late = req("late", 40, arrival=9.0)
    waiting.append(late)
    order.plan([], waiting, now=9.0)  # long_old 10, short_new 0, late 40
    assert ids(waiting) == ["short_new", "long_old", "late"]
    assert PrefillOrder("srpf", max_wait_s=1e9).key(long_old, 9.0) == (2, 100, 0.0)  # no aging: tokens left


def test_a_step_where_prompts_finish_is_cut_to_the_bucket_holding_them():
    order = PrefillOrder("srpf", 1e9, 0, (1, 2, 4, 8, 16), finish_early=True)
    running = req("r", 10, 0.0, computed=8)  # 2 left
    short, long_ = req("w1", 3, 1.0), req("w2", 20, 2.0)
    waiting = collections.deque([long_, short])
    plan = order.plan([running], waiting, now=3.0)
    assert ids(plan) == ["r", ALL] and ids(waiting) == ["w1", "w2"]
    # 3 decodes + r's 2 + w1's 3 = 8: the 8-token bucket; w2 (20) cannot finish in this step
    assert order.finishing_budget(16, 3, plan, waiting) == 8
    assert order.finishing_budget(16, 9, plan, waiting) == 16  # 9 + 5 = 14: the 16 bucket is the budget
    assert order.finishing_budget(6, 3, plan, waiting) == 6  # only r finishes: 5 -> the 8 bucket, past the budget
    nothing = collections.deque([long_])
    assert order.finishing_budget(16, 3, order.plan([], nothing, 3.0), nothing) == 16  # none finishes: all of it
    assert PrefillOrder("srpf", 1e9, 0, (1, 2, 4, 8, 16)).finishing_budget(16, 3, plan, waiting) == 16  # off
    # fcfs plans finish early too: the running prefill first, then the queue in arrival order
    fcfs = PrefillOrder("fcfs", 1.0, 0, (1, 2, 4, 8, 16), finish_early=True)
    queue = collections.deque([short, long_])
    assert fcfs.finishing_budget(16, 1, fcfs.plan([running], queue, 3.0), queue) == 8  # 1 + 2 + 3 = 6 -> 8


@pytest.mark.parametrize("policy", ["fcfs", "srpf"])
def test_finishing_steps_give_the_same_outputs_and_fill_a_bucket(policy):
    ladder = (1, 2, 4, 8, 16)
    arrivals = {0: [("s0", 5, 6), ("long", 60, 12)], 2: [("s1", 6, 12)], 4: [("s2", 3, 6), ("long2", 40, 6)],
                7: [("s3", 9, 4)]}
    plain, first_plain, full = drive(PrefillOrder(policy, 1e9, 0, ladder), arrivals)
    finishing = []
    out, first, steps = drive(PrefillOrder(policy, 1e9, 0, ladder, finish_early=True), arrivals, finishing=finishing)
    assert out == plain and all(len(v) for v in out.values())
    assert full[0] == (16, 0) and steps[0] == (8, 0)  # s0's 5 tokens and 3 of the long prompt's: the 8 bucket
    assert first["s0"] == first_plain["s0"] == 0
    # a step with prefill left over is cut only to a bucket, and only when a prompt finishes in it.
    # What the fake step cannot show is time (a cut step is shorter; the prompts behind may then
    # finish a step later): benchmarks/probes/ttft_sim.py and benchmarks/ttft_trace.py measure that.
    prefill_left = [sum(p for p, _ in steps[i + 1:]) > 0 for i in range(len(steps))]
    cut = [i for i, (p, d) in enumerate(steps) if p and p + d < 16 and prefill_left[i]]
    assert cut and all(finishing[i] and sum(steps[i]) in ladder for i in cut), (steps, finishing)


def test_auto_is_the_measured_ttft_order_on_gpus_and_fcfs_elsewhere():
    from splash_jax.engine.config import EngineConfig
    from splash_jax.engine.prefill_order import ladder_sizes

    c = EngineConfig(max_num_batched_tokens=8192)
    gpu, cpu = PrefillOrder.of(c, 1024, "gpu"), PrefillOrder.of(c, 0, "cpu")
    assert (gpu.policy, gpu.aging_tokens_per_s, gpu.finish_early) == ("srpf", 7400.0, True)
    assert gpu.buckets == ladder_sizes(c, 1024) and 6144 in gpu.buckets
    assert (cpu.policy, cpu.aging_tokens_per_s, cpu.finish_early) == ("fcfs", 0.0, False)
    chosen = EngineConfig(scheduling_policy="fcfs", prefill_aging_tokens_per_s=0.0, prefill_finish_early="off")
    assert PrefillOrder.of(chosen, 0, "gpu") == PrefillOrder("fcfs", 1.0, 0, ladder_sizes(chosen, 0))
    assert PrefillOrder.of(EngineConfig(scheduling_policy="srpf"), 0, "cpu").aging_tokens_per_s == 0.0
    with pytest.raises(ValueError, match="--prefill-finish-early"):
        EngineConfig(prefill_finish_early="yes").validate()
    with pytest.raises(ValueError, match="--scheduling-policy"):
        EngineConfig(scheduling_policy="lifo").validate()


def test_fcfs_keeps_admission_and_queue_order():
    order = PrefillOrder()
    running = [req("b", 90, 1.0, computed=10), req("a", 20, 0.0, computed=10)]
    waiting = collections.deque([req("c", 500, 2.0), req("d", 3, 3.0)])
    assert ids(order.plan(running, waiting, now=100.0)) == ["b", "a", ALL]
    assert ids(waiting) == ["c", "d"]


def test_bad_settings_are_refused():
    for kw in ({"policy": "lifo"}, {"max_wait_s": -1.0}, {"max_prefill_tokens_with_decodes": -1},
               {"aging_tokens_per_s": -1.0}):
        with pytest.raises(ValueError):
            PrefillOrder(**kw)


def fake_token(r):
    return (sum(r.token_slice(max(0, r.num_known - 3), r.num_known)) * 31 + r.num_known) % 48 + 2


def drive(order, arrivals, budget=16, finishing=None, step_time_cap=None, chunks_out=None):
    """A scheduler on a fake step (tokens depend only on the sequence); arrivals: step -> requests.
    Returns (outputs by id, first-token step by id, [(prefill tokens, decode rows) per step]);
    `finishing` (a list) gets per step whether some prompt finished its prefill in it;
    `chunks_out` (a list) gets per step its prompt chunks as (start, tokens)."""
    sched = Scheduler(PageAllocator(1, 400, 4), max_num_seqs=8, max_num_batched_tokens=budget, placement=REPLICATED,
                      max_model_len=256, pages_per_request=64, prefill_order=order)
    sched.step_time_cap = step_time_cap
    first, steps, reqs, t = {}, [], {}, 0
    while t < 1000 and (sched.has_work() or any(k >= t for k in arrivals)):
        for rid, n, out in arrivals.get(t, []):
            reqs[rid] = r = req(rid, n, arrival=float(t), max_tokens=out)
            sched.add(r)
        chunks = sched.schedule().chunks
        # a decode: a request with one token left (a sampled one, or the last of its prompt)
        decodes = [c for c in chunks if c.num_tokens == 1 and c.start >= len(c.request.prompt_ids) - 1]
        steps.append((sum(c.num_tokens for c in chunks) - len(decodes), len(decodes)))
        if chunks_out is not None:
            chunks_out.append([(c.start, c.num_tokens) for c in chunks if c not in decodes])
        sched.dispatched(chunks)
        sampling = [c for c in chunks if c.samples]
        if finishing is not None:
            finishing.append(any(c.start < len(c.request.prompt_ids) for c in sampling))
        for c in sampling:
            first.setdefault(c.request.request_id, t)
        sched.update(chunks, list(range(len(sampling))), np.array([fake_token(c.request) for c in sampling]))
        t += 1
    return {k: r.output_ids for k, r in reqs.items()}, first, steps


ARRIVALS = {0: [("long", 60, 12)], 1: [("s1", 6, 12), ("s2", 9, 12)], 3: [("s3", 5, 6), ("long2", 40, 6)]}


def test_srpf_lets_short_prompts_pass_a_long_one_with_the_same_outputs():
    plain, first_fcfs, _ = drive(PrefillOrder(), ARRIVALS)
    out, first, _ = drive(PrefillOrder("srpf", max_wait_s=1e9), ARRIVALS)
    assert out == plain and all(len(v) for v in out.values())
    assert first["s1"] < first_fcfs["s1"] and first["s2"] < first_fcfs["s2"] and first["s3"] < first_fcfs["s3"]
    assert first["long"] > first_fcfs["long"]
    # an age bound of 0 is arrival order: the long prompt, first to arrive, first to finish
    _, first0, _ = drive(PrefillOrder("srpf", max_wait_s=0.0), ARRIVALS)
    assert first0["long"] == first_fcfs["long"]


@pytest.mark.parametrize("policy", ["fcfs", "srpf"])
def test_the_prefill_cap_holds_while_requests_decode(policy):
    cap = 5
    plain, _, uncapped = drive(PrefillOrder(policy, 1e9), ARRIVALS)
    out, _, steps = drive(PrefillOrder(policy, 1e9, max_prefill_tokens_with_decodes=cap), ARRIVALS)
    assert out == plain
    assert all(prefill <= cap for prefill, decodes in steps if decodes)
    assert any(prefill == cap for prefill, decodes in steps if decodes)  # the cap was what limited them
    assert any(prefill > cap for prefill, decodes in uncapped if decodes)  # ...and without it steps were longer
    assert any(prefill > cap for prefill, decodes in steps if not decodes)  # no decodes: the whole budget


def test_the_cap_fills_a_compiled_bucket_instead_of_spilling_into_the_next():
    """Steps run padded to the next bucket, so a capped step's tokens (decodes included) stop at a
    bucket: 4096 prefill tokens beside 21 decodes would otherwise run as an 8192-token step."""
    from splash_jax.engine.config import EngineConfig
    from splash_jax.engine.prefill_order import ladder_sizes

    sizes = ladder_sizes(EngineConfig(max_num_batched_tokens=8192, min_token_bucket=16), 0)
    assert sizes == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    order = PrefillOrder("fcfs", 1.0, 4096, sizes)
    assert order.prefill_budget(8192, 21) == 4096  # 4075 prefill tokens: the 4096 program, no padding
    assert order.prefill_budget(8192, 0) == 8192  # no decodes: the whole budget
    assert PrefillOrder("fcfs", 1.0, 4096).prefill_budget(8192, 21) == 4117  # without the ladder: cap + decodes
    assert PrefillOrder("fcfs", 1.0, 9000, sizes).prefill_budget(8192, 21) == 8192  # never past the budget
    assert PrefillOrder("fcfs", 1.0, 16, sizes).prefill_budget(8192, 40) == 56  # no bucket between: cap + decodes
    # on the fake step: every capped step with decodes and prefill left over fills its bucket exactly
    order = PrefillOrder("fcfs", 1e9, 5, (1, 2, 4, 8, 16))
    out, _, steps = drive(order, ARRIVALS)
    assert out == drive(PrefillOrder(), ARRIVALS)[0]
    capped = [(p, d) for p, d in steps if d and p]
    assert all(order.prefill_budget(16, d) in (4, 8) for _, d in capped)  # a bucket at every decode count seen
    assert all(p + d <= order.prefill_budget(16, d) for p, d in capped), steps
    assert sum(p + d == order.prefill_budget(16, d) for p, d in capped) >= 3, steps  # filled, not padded


@pytest.mark.slow  # the same outputs at the scheduler: test_srpf_keeps_every_page_consistent_under_random_interleavings
def test_engine_srpf_with_a_cap_gives_fcfs_outputs_and_compiles_nothing():
    from splash_jax.compile_guard import count_compiles
    from splash_jax.engine.step_time_cap import StepCost
    from splash_jax.engine import Engine, EngineConfig
    from splash_jax.engine.request import accumulate
    from splash_jax.model import RuntimeOptions
    from splash_jax.paths import DEFAULT_MODEL
    from splash_jax.weights.loader import load_model

    model = load_model(DEFAULT_MODEL, RuntimeOptions(dtype="float32", attention_impl="xla"))
    engine = Engine(EngineConfig(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=96,
                                 compile_cache_dir=None, scheduling_policy="srpf", max_prefill_wait_s=1e9,
                                 max_prefill_tokens_with_decodes=8, prefill_finish_early="on"), model=model)
    long = "Serving engines batch requests continuously; each step mixes prefill chunks with decode tokens. " * 3
    prompts = [long, "MLA", "Hi there", "x = 1", long[:120], "The quick brown fox"]
    arrivals = [0, 1, 1, 2, 2, 6]

    def run():
        engine.set_prefix_caching(False)  # each run starts with an empty cache
        engine.set_prefix_caching(True)
        acc, rid, first, pending, step = {}, {}, {}, sorted(zip(arrivals, range(len(prompts)))), 0
        while pending or engine.has_work():
            while pending and pending[0][0] <= step:
                i = pending.pop(0)[1]
                rid[engine.add_request(prompts[i], SamplingParams(max_tokens=10))] = i
            for o in accumulate(acc, engine.step()):
                first.setdefault(rid[o.request_id], step)
            step += 1
        return {rid[k]: o.token_ids for k, o in acc.items()}, first

    with count_compiles() as compiles:
        srpf, first_srpf = run()
        engine.scheduler.prefill_order = PrefillOrder()  # fcfs, no cap: the order before this module
        fcfs, first_fcfs = run()
        engine.set_max_step_ms_with_decodes(1.0)  # and a step-time bound (engine/step_time_cap.py) on a made-up
        bound = engine.scheduler.step_time_cap  # device: 0.1 ms per token or decode, 1 us per query-key pair
        bound.cost, bound.min_tokens = (lambda: StepCost(0.0, 1e-4, 1e-6, 1e-4)), 1
        timed, _ = run()
        engine.set_max_step_ms_with_decodes(0.0)
    assert compiles.count == 0, compiles.events
    assert srpf == fcfs == timed and all(len(v) == 10 for v in srpf.values())
    assert bound.capped_steps > 0 and engine.scheduler.step_time_cap is None
    assert first_srpf[1] < first_fcfs[1] and first_srpf[0] > first_fcfs[0]  # the short ones passed the long one


def test_the_ttft_trace_is_reproducible_and_has_the_issues_statistics():
    import json

    from benchmarks import workloads as W
    from benchmarks.traces import make_mooncake
    from benchmarks.ttft_trace import TRACE

    rows = [json.loads(line) for line in (W.TRACES / "mooncake_ttft.jsonl").read_text().splitlines()]
    assert rows == make_mooncake.generate(**TRACE)
    lengths = np.array([r["input_length"] for r in rows])
    assert len(rows) == 379 and rows[-1]["timestamp"] <= 120_000
    assert 8_500 < lengths.mean() < 10_000 and lengths.min() < 512 and 30_000 < lengths.max() <= 32 * 1024
    assert 0.11 < make_mooncake.reuse(rows) < 0.15


@pytest.mark.parametrize("cap,aging,finish", [(0, 0.0, False), (3, 0.0, False), (0, 2.0, True)])
def test_srpf_keeps_every_page_consistent_under_random_interleavings(cap, aging, finish):
    """tests/test_prefix_cache.py's random adds, steps, aborts and preemptions (prefix caching on,
    pages checked against a shadow of their contents), with srpf: the same outputs as fcfs."""
    from unittest import mock

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from splash_jax.engine import scheduler as scheduler_module
    from tests.test_prefix_cache import OP
    from tests.test_prefix_cache import drive as drive_ops

    srpf = PrefillOrder("srpf", max_wait_s=1e9, max_prefill_tokens_with_decodes=cap, buckets=(1, 2, 4, 8, 16),
                        aging_tokens_per_s=aging, finish_early=finish)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=st.lists(OP, min_size=1, max_size=30), pages=st.integers(5, 14))
    def check(ops, pages):
        plain, _ = drive_ops(ops, REPLICATED, 2, True, pages)
        with mock.patch.object(scheduler_module, "PrefillOrder", lambda: srpf):
            ordered, sched = drive_ops(ops, REPLICATED, 2, True, pages)
        assert sched.prefill_order is srpf
        if not any(op[0] in ("abort", "preempt") for op in ops):  # those pick requests by position
            assert ordered == plain

    check()


def test_the_trace_benchmark_reads_policy_items_with_empty_fields_as_their_defaults():
    from benchmarks.ttft_trace import parse_policies
    from splash_jax.engine.config import EngineConfig

    old, new, fcfs, long = parse_policies("srpf:0:1:on,srpf:0:100:on::7400:on,fcfs:4096:::0,srpf:0:1:long", EngineConfig(), 2.0)
    assert old.order == PrefillOrder("srpf", 2.0) and old.late == "on" and old.gap is None  # as before AGING/FINISH
    assert new.order == PrefillOrder("srpf", 200.0, 0, (), 3700.0, True)  # ages per trace second: / time scale
    assert fcfs.order == PrefillOrder("fcfs", 2.0, 4096) and fcfs.late is None and fcfs.gap == 0
    assert long.late == "long"  # late dispatch by the rules of 2026-12-06
    for bad in ("srpf:0:1:on::10:maybe", "srpf:0:1:early"):
        with pytest.raises(SystemExit):
            parse_policies(bad, EngineConfig(), 1.0)
