"""The step-time bound beside decodes (engine/step_time_cap.py, --max-step-ms-with-decodes): the
chunk length it allows against a brute-force search, every step with decodes within the bound on
the scheduler's fake step with the outputs of an unbounded run, nothing cut before a fit exists,
and the fit it reads (DispatchTiming.step_cost) recovering a known linear step time."""

import pytest

from splash_jax.calibration import attended_keys
from splash_jax.engine.prefill_order import PrefillOrder
from splash_jax.engine.step_time_cap import StepCost, StepTimeCap
from tests.test_prefill_order import ARRIVALS, drive

COST = StepCost(const_s=1.0, per_token_s=1.0, per_pair_s=0.05, per_decode_s=0.5)  # arbitrary units


def test_a_chunk_takes_the_most_tokens_that_fit_and_fewer_the_deeper_it_starts():
    for start in (0, 1, 7, 40, 300):
        for seconds in (0.0, 0.5, 1.0, 3.3, 10.0, 57.0, 400.0):
            for n in (1, 5, 64):
                brute = max((m for m in range(n + 1) if COST.chunk_s(start, m) <= seconds), default=0)
                assert COST.tokens_within(start, n, seconds) == brute, (start, seconds, n)
    assert COST.chunk_s(10, 4) == 4 * 1.0 + 0.05 * attended_keys(10, 4)
    deeper = [COST.tokens_within(start, 10_000, 200.0) for start in (0, 100, 1000, 10_000)]
    assert deeper == sorted(deeper, reverse=True) and deeper[0] > deeper[-1]
    assert StepCost(1.0, 1.0, 0.0, 0.0).tokens_within(0, 100, 7.9) == 7  # no depth term: a straight line
    assert not StepCost(1.0, -1e-6, 0.0, 0.0).usable() and not StepCost(1.0, 1.0, -1.0, 0.0).usable()


def predicted(prefill_chunks, decodes):
    return COST.const_s + COST.per_decode_s * decodes + sum(COST.chunk_s(s, n) for s, n in prefill_chunks)


@pytest.mark.parametrize("policy", ["fcfs", "srpf"])
def test_steps_beside_decodes_stay_within_the_bound_with_the_same_outputs(policy):
    order = PrefillOrder(policy, 1e9, buckets=(1, 2, 4, 8, 16))
    plain_chunks, chunks = [], []
    plain, _, plain_steps = drive(order, ARRIVALS, chunks_out=plain_chunks)
    cap = StepTimeCap(9.0, lambda: COST, min_tokens=1)
    out, _, steps = drive(order, ARRIVALS, step_time_cap=cap, chunks_out=chunks)
    assert out == plain and all(len(v) for v in out.values())
    times = [predicted(c, d) for c, (_, d) in zip(chunks, steps)]
    plain_times = [predicted(c, d) for c, (_, d) in zip(plain_chunks, plain_steps)]
    # with decodes: within 9 units, unless one token of prefill (min_tokens) already passes it
    over = [(t, c, s) for t, c, s in zip(times, chunks, steps) if s[1] and t > 9.0 + 1e-9]
    assert all(sum(n for _, n in c) == 1 for _, c, _ in over), over
    assert any(t > 9.0 for t, (_, d) in zip(plain_times, plain_steps) if d)  # unbounded, such steps ran longer
    assert cap.capped_steps > 0 and len(steps) > len(plain_steps)  # so prefill took more steps
    assert any(t > 9.0 for t, (_, d) in zip(times, steps) if not d)  # no decodes: the whole budget


def test_nothing_is_cut_before_the_step_times_are_fitted():
    order = PrefillOrder("srpf", 1e9, buckets=(1, 2, 4, 8, 16))
    plain = drive(order, ARRIVALS)
    cap = StepTimeCap(2.0, lambda: None, min_tokens=1)
    assert drive(order, ARRIVALS, step_time_cap=cap) == plain and cap.capped_steps == 0
    with pytest.raises(ValueError, match="--max-step-ms-with-decodes"):
        StepTimeCap(-1.0, lambda: None)


def test_a_bound_below_the_decodes_own_time_still_makes_prefill_progress():
    order = PrefillOrder("fcfs", 1e9, buckets=(1, 2, 4, 8, 16))
    cap = StepTimeCap(0.5, lambda: COST, min_tokens=2)  # less than the constant: no prefill would fit
    out, _, steps = drive(order, ARRIVALS, step_time_cap=cap)
    assert out == drive(order, ARRIVALS)[0]
    assert any(p for p, d in steps if d) and all(p <= 2 for p, d in steps if d)  # slowed, never stopped


def test_the_dispatch_timing_fit_is_read_as_a_step_cost():
    """Long steps of 2K-8K prompt tokens at depths 0-24K on the simulated device of
    tests/test_dispatch_timing.py, device time 10 ms + 10 us per token + 1 ns per pair (exact): the
    fit gives those back; timing without holds never delays a step."""
    import numpy as np

    from splash_jax.engine.dispatch_timing import DispatchTiming
    from tests.test_dispatch_timing import Step, simulate

    rng = np.random.default_rng(2)
    steps = []
    for _ in range(60):
        tokens, depth = int(rng.integers(2048, 8193)), int(rng.integers(0, 24_577))
        steps.append(Step(tokens, 0.01 + 10e-6 * tokens + 1e-9 * attended_keys(depth, tokens), depth=depth))
    _, _, timing = simulate(True, steps=steps)
    cost = timing.step_cost()
    assert (cost.const_s, cost.per_token_s, cost.per_pair_s) == pytest.approx((0.01, 10e-6, 1e-9), rel=1e-6)
    assert DispatchTiming(False).step_cost() is None
    quiet = DispatchTiming(True, holds=False)
    assert quiet.enabled and not quiet.holds and quiet.delay_s(steps[-1]) == 0.0
