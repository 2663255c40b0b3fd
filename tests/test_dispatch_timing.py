"""Late dispatch behind long prefill steps (engine/dispatch_timing.py): on a simulated device the
next step goes out before the step in flight ends (the device never idles), later than it would
without (arrivals meanwhile join it), idle time never lengthens the predictions; and on the CPU
engine, replaying arrivals with it on gives the outputs of a replay with it off."""

import dataclasses
import types

import numpy as np
import pytest

from splash_jax.engine.dispatch_timing import DispatchTiming, DispatchTimingConfig, resolved


@dataclasses.dataclass
class Step:
    tokens: int
    device_s: float
    dispatch_end: float | None = None
    prefill_tokens: int = 0
    features: tuple = ()
    sent: float = 0.0  # when the simulated dispatch returned
    start: float = 0.0
    end: float = 0.0
    depth: int = 0  # where its chunk starts in its prompt

    @property
    def chunks(self):  # one prompt chunk of `tokens` tokens, as step_timeline.classify reads it
        request = types.SimpleNamespace(prompt_ids=range(self.depth + self.tokens + 1))
        return [types.SimpleNamespace(request=request, start=self.depth, end=self.depth + self.tokens)]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def simulate(late: bool, n: int = 40, host_s: float = 0.004, seed: int = 0, steps=None, config=None):
    """A driver loop as the engine's: dispatch (host_s of host time), then read back the step
    before. Device time per token varies by up to 1.6x between steps, at random (default `steps`).
    -> (steps, idle gaps between consecutive steps on the device, timing)."""
    rng = np.random.default_rng(seed)
    clock = Clock()
    timing = DispatchTiming(late, config, clock=clock)
    steps = steps or [Step(8192, 8192 * 12e-6 * rng.uniform(1.0, 1.6)) for _ in range(n)]
    device_free, inflight = 0.0, None
    for s in steps:
        if inflight is not None:
            delay = timing.delay_s(inflight)
            assert delay >= 0.0
            clock.t += delay  # the loop waits for arrivals
        clock.t += host_s  # schedule + dispatch
        timing.dispatched(s, host_s)
        s.sent = clock.t
        s.start = max(clock.t, device_free)
        s.end = device_free = s.start + s.device_s
        if inflight is not None:  # read back the step before: block until it ends
            waited = max(0.0, inflight.end - clock.t)
            clock.t += waited
            timing.completed(inflight, waited)
        inflight = s
    gaps = [b.start - a.end for a, b in zip(steps, steps[1:])]
    return steps, gaps, timing


def test_the_next_step_goes_out_late_but_before_the_device_runs_dry():
    steps, gaps, timing = simulate(late=True)
    early_steps, early_gaps, _ = simulate(late=False)
    assert max(early_gaps) == 0.0 and max(gaps) < 1e-12  # never an idle device, late or not
    # without: each step is dispatched right after the one before it, a whole step ahead;
    # with: once 4 long steps are timed, within lead + (device time - predicted) of the end before
    ahead = [a.end - b.sent for a, b in zip(steps[5:], steps[6:])]
    ahead_early = [a.end - b.sent for a, b in zip(early_steps[5:], early_steps[6:])]
    assert min(ahead_early) > 0.09  # the next step waited ~a whole 100-160 ms step ahead
    # (the prediction is at least the step's device time / 1.6: the cheapest rate seen)
    assert all(0.0 <= a <= timing.lead_s(s.device_s) + 0.375 * s.device_s + 1e-9 for a, s in zip(ahead, steps[5:]))
    assert np.mean(ahead) < 0.5 * np.mean(ahead_early)
    assert timing.waits > 0 and timing.waited_s > 1.0
    s = timing.summary()
    assert s["enabled"] and 12.0 <= s["min_ms_per_1k_prefill_tokens"] <= 12.0 * 1.6


def test_the_fit_to_depth_and_size_dispatches_closer_to_the_end_than_the_cheapest_rate():
    """Steps of 2K-8K prefill tokens at depths 0-24K, device time = 10 ms + 10 us per token + 1 ns
    per query-key pair (+-1%): the cheapest rate predicts a deep chunk far short (and a shallow one
    after deep ones too long), the fit does neither."""
    rng = np.random.default_rng(1)

    def steps():
        out = []
        for _ in range(80):
            tokens, depth = int(rng.integers(2048, 8193)), int(rng.integers(0, 24_577))
            pairs = tokens * depth + tokens * (tokens + 1) / 2
            out.append(Step(tokens, (0.01 + 10e-6 * tokens + 1e-9 * pairs) * rng.uniform(0.99, 1.01), depth=depth))
        return out

    fitted, gaps, timing = simulate(True, steps=steps())
    floor, floor_gaps, _ = simulate(True, steps=steps(), config=DispatchTimingConfig(fit_samples=10**9))  # fit off
    assert max(gaps[20:]) < 1e-12  # with the fit the device never idles (the cheapest rate idled it here:
    assert max(floor_gaps) > 1e-3  # a small shallow step after deep big ones is predicted too long)

    def ahead(run):  # how long before the step in flight ended the next one went out, once warmed up
        return np.array([a.end - b.sent for a, b in zip(run[20:], run[21:])])

    assert np.all(ahead(fitted) <= [timing.lead_s(s.device_s) + 0.05 * s.device_s for s in fitted[20:-1]])
    assert np.median(ahead(fitted)) < 0.5 * np.median(ahead(floor))
    fit = timing.summary()["fit"]
    assert fit["ms"][1] == pytest.approx(10e-3, rel=0.1) and fit["ms"][2] == pytest.approx(1.0, rel=0.1)  # per token, per 1M pairs


def test_idle_time_before_a_step_never_counts_as_its_device_time():
    clock = Clock()
    timing = DispatchTiming(True, clock=clock)
    for _ in range(6):  # each step dispatched onto an idle device, 1 s after the last one ended
        s = Step(4096, 0.05)
        clock.t += 1.0
        timing.dispatched(s, 0.003)
        clock.t += s.device_s
        timing.completed(s, waited_s=s.device_s)
    assert timing.summary()["min_ms_per_1k_prefill_tokens"] == pytest.approx(0.05 / 4096 * 1e6, abs=1e-3)


def test_short_steps_and_cold_starts_are_never_waited_on():
    clock = Clock()
    timing = DispatchTiming(True, DispatchTimingConfig(min_samples=2), clock=clock)
    long = Step(8192, 0.1)
    timing.dispatched(long, 0.002)
    assert timing.delay_s(long) == 0.0  # nothing timed yet
    for _ in range(2):
        s = Step(8192, 0.1)
        timing.dispatched(s, 0.002)
        clock.t += 0.1
        timing.completed(s, 0.1)
    decode = Step(64, 0.01)
    timing.dispatched(decode, 0.002)
    assert timing.delay_s(decode) == 0.0  # too few prefill tokens
    small = Step(1024, 0.0125)
    timing.dispatched(small, 0.002)
    assert timing.delay_s(small) == 0.0  # predicted under min_step_s
    big = Step(8192, 0.1)
    timing.dispatched(big, 0.002)
    assert timing.delay_s(big) == pytest.approx(0.1 - timing.lead_s(0.1))  # lead: 1.5 x 2 ms + 2 ms + 10 ms
    assert DispatchTiming(False, clock=clock).delay_s(big) == 0.0
    assert resolved("auto", "cpu") is False and resolved("auto", "gpu") is True and resolved("on", "cpu") is True
    with pytest.raises(ValueError, match="--late-dispatch"):
        resolved("sometimes", "gpu")


@pytest.mark.slow  # the replay runs twice on the CPU engine (about a minute)
def test_a_replay_with_late_dispatch_gives_the_same_outputs():
    from benchmarks import workloads as W
    from benchmarks.dynamic import serve
    from splash_jax.engine import Engine, EngineConfig
    from splash_jax.model import RuntimeOptions
    from splash_jax.paths import DEFAULT_MODEL
    from splash_jax.weights.loader import load_model

    model = load_model(DEFAULT_MODEL, RuntimeOptions(dtype="float32", attention_impl="xla"))
    engine = Engine(EngineConfig(page_size=8, max_num_seqs=8, max_num_batched_tokens=128, max_pages=256,
                                 compile_cache_dir=None, late_dispatch="on"), model=model)
    arrivals = [W.Arrival(t=0.05 * i, prompt_len=60 + 37 * i, output_len=6) for i in range(10)]
    # steps of 64+ prefill tokens are timed and waited on (the default is 1024, GPU-sized)
    engine.dispatch_timing = DispatchTiming(True, DispatchTimingConfig(min_prefill_tokens=64, min_step_s=0.0,
                                                                       min_samples=2))
    late = serve(engine, arrivals, seed=0, caching="off", label="late")
    waits = engine.dispatch_timing.waits
    engine.dispatch_timing = DispatchTiming(False)
    plain = serve(engine, arrivals, seed=0, caching="off", label="plain")
    assert [r.tokens for r in late.records] == [6] * 10
    assert late.outputs == plain.outputs
    assert waits > 0  # it did hold steps back
