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
    decode_ctx: tuple = ()  # a decode step: each row's context (tokens before its new one)
    held: bool = False  # the loop waited on delay_s before scheduling it
    launch_at: float = 0.0  # when its launch began (the step before was checked then)
    read_at: float = 0.0  # when, after its launch, the host came to read the step before

    @property
    def chunks(self):  # one prompt chunk of `tokens` tokens, or decode rows, as dispatch_timing.tally reads them
        if self.decode_ctx:
            request = types.SimpleNamespace(prompt_ids=range(1))
            return [types.SimpleNamespace(request=request, start=c, end=c + 1) for c in self.decode_ctx]
        request = types.SimpleNamespace(prompt_ids=range(self.depth + self.tokens + 1))
        return [types.SimpleNamespace(request=request, start=self.depth, end=self.depth + self.tokens)]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Done:
    """What `DispatchTiming.launching` reads of the step in flight: result.tokens.is_ready()."""

    def __init__(self, ready: bool):
        self.result = types.SimpleNamespace(tokens=types.SimpleNamespace(is_ready=lambda: ready))


def simulate(late: bool, n: int = 40, host_s: float = 0.004, seed: int = 0, steps=None, config=None, launch_s: float = 0.0,
             read_s: float = 0.0):
    """A driver loop as the engine's: schedule and pack (host_s), launch (launch_s more of host
    time, while the device already runs the step's first kernels), then read back the step before
    (read_s: host time to read its tokens, blocked or not).
    Device time per token varies by up to 1.6x between steps, at random (default `steps`).
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
            s.held = delay > 0.0
            clock.t += delay  # the loop waits for arrivals
        clock.t += host_s  # schedule + pack
        if inflight is not None:
            inflight.result = Done(inflight.end <= clock.t).result
        timing.launching(inflight)
        s.launch_at = clock.t
        s.start = max(clock.t, device_free)  # the device starts on its first kernels
        clock.t += launch_s  # the rest of the launch
        timing.dispatched(s, host_s + launch_s)
        s.sent = clock.t
        s.end = device_free = s.start + s.device_s
        if inflight is not None:  # read back the step before: block until it ends, then read its tokens
            inflight.result = Done(inflight.end <= clock.t).result
            s.read_at = clock.t
            timing.reading(inflight)
            waited = max(0.0, inflight.end - clock.t) + read_s
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


def test_steps_predicted_short_and_cold_starts_are_never_waited_on():
    clock = Clock()
    timing = DispatchTiming(True, DispatchTimingConfig(min_samples=2, min_step_s=0.02), clock=clock)
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
    assert timing.delay_s(decode) == 0.0  # a short step, its own fit not there yet
    small = Step(1024, 0.0125)
    timing.dispatched(small, 0.002)
    assert timing.delay_s(small) == 0.0  # predicted under min_step_s
    big = Step(8192, 0.1)
    timing.dispatched(big, 0.002)
    assert timing.delay_s(big) == pytest.approx(0.1 - timing.lead_s(0.1))  # lead: 1.5 x 2 ms + 2 ms + 10 ms
    assert DispatchTiming(False, clock=clock).delay_s(big) == 0.0
    assert resolved("auto", "cpu")[0] is False and resolved("off", "gpu")[0] is False
    on, prefill, auto = resolved("on", "cpu"), resolved("prefill", "cpu"), resolved("auto", "gpu")
    assert on[0] and prefill[0] and auto == prefill  # accelerators: prefill steps held...
    assert on[1].short_steps and not prefill[1].short_steps  # ...decode steps only with on
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


def test_the_lead_counts_host_time_up_to_the_launch_only():
    """A step's launch takes 10 ms of host time after its 2 ms of packing, while the device already
    runs its first kernels: a lead from the launch dispatches ~15 ms closer to the end than a lead
    from the whole dispatch, and the device still never idles."""
    launch, whole = (simulate(True, host_s=0.002, launch_s=0.010, config=DispatchTimingConfig(lead_from_launch=f))
                     for f in (True, False))
    for steps, gaps, timing in (launch, whole):
        assert max(gaps) < 1e-12 and timing.idle_launches == 0
    assert launch[2].lead_s() == pytest.approx(1.5 * 0.002 + 0.002)
    assert whole[2].lead_s() == pytest.approx(1.5 * 0.012 + 0.002)

    def sent_before_end(steps):
        return np.median([a.end - b.sent for a, b in zip(steps[20:], steps[21:])])

    assert 0.012 < sent_before_end(whole[0]) - sent_before_end(launch[0]) < 0.02  # the leads differ by 15 ms


def test_a_held_step_that_finds_the_device_idle_lengthens_the_lead():
    """Steps get 2x faster after 30 steps (predictions far too long): held steps find the device
    idle at their launch and are not timed, the backoff outgrows the error within a few steps, the
    fit learns the fast steps, and the backoff shrinks again once launches find the device busy."""
    rng = np.random.default_rng(2)
    steps = [Step(8192, 0.2 * rng.uniform(0.99, 1.01) * (1.0 if i < 30 else 0.5)) for i in range(200)]
    _, gaps, timing = simulate(True, steps=steps, config=DispatchTimingConfig(history=8, fit_samples=6, refit_every=4), read_s=2e-4)
    assert max(gaps[:30]) < 1e-12  # idle only after the change
    idle = [i for i, g in enumerate(gaps) if g > 1e-9]
    assert idle and min(idle) >= 30 and len(idle) <= 12 and timing.idle_after_wait == timing.idle_launches == len(idle)
    assert max(gaps[60:]) < 1e-12
    assert timing.backoff_s < 0.005  # shrunk back
    assert timing.summary()["kinds"]["long"]["fit_ms"][1] * 8192 < 110  # ms: the fast steps' time


def test_a_step_done_before_the_host_reads_it_is_not_timed():
    """Decode steps of 10-20 ms whose time the features do not explain, a lead of only the host
    time, a 3 ms launch and 3 ms to read a step's tokens: the shorter steps end before the next
    launch or during it. Timed from their start to the read they would count idle time and the
    launch (what fed the 1 s holds on one H100); every sample stays within its step's device time
    plus the read."""
    rng = np.random.default_rng(5)
    steps = [Step(0, float(rng.uniform(0.010, 0.020)), decode_ctx=(4096 + i,)) for i in range(300)]
    true = {s.decode_ctx[0]: s.device_s for s in steps}
    config = DispatchTimingConfig(lead_margin=1.0, lead_floor_s=0.0, lead_fraction=0.0)
    _, gaps, timing = simulate(True, steps=steps, host_s=0.0005, launch_s=0.003, read_s=0.003, config=config)
    assert timing.idle_launches > 10  # the situation arises
    samples = timing._kinds["short"].samples
    assert len(samples) > 16
    over = [d - true[round(f[2] * 1e6) - 1] for f, d in samples]  # (feature 2: context / 1e6, each row reads c + 1)
    assert max(over) <= 0.003 + 1e-9


def test_held_steps_whose_predecessor_ends_during_their_launch_are_counted():
    """A 3 ms launch and a lead of only the host time: some held steps find the step before still
    running when their launch begins and done when the host reads it after the launch. On a GPU
    whose step program starts only when its launch call returns (a CUDA graph), the device idled
    for part of that launch; `launching` cannot see it. Each such held step is counted once, and
    no other step is."""
    rng = np.random.default_rng(5)
    steps = [Step(0, float(rng.uniform(0.010, 0.020)), decode_ctx=(4096 + i,)) for i in range(300)]
    config = DispatchTimingConfig(lead_margin=1.0, lead_floor_s=0.0, lead_fraction=0.0)
    _, _, timing = simulate(True, steps=steps, host_s=0.0005, launch_s=0.003, read_s=0.003, config=config)
    expected = sum(b.held and b.launch_at < a.end <= b.read_at for a, b in zip(steps, steps[1:]))
    assert expected > 5  # the situation arises
    assert timing.ended_in_launch == expected
    assert timing.summary()["ended_in_launch"] == expected
    _, _, early = simulate(False, steps=[dataclasses.replace(s) for s in steps], host_s=0.0005, launch_s=0.003, read_s=0.003)
    assert early.ended_in_launch == 0  # nothing held: nothing counted
    # counted as idle launches are (backoff_on_ended_in_launch), they lengthen the lead until they stop
    _, _, backed = simulate(True, steps=[dataclasses.replace(s) for s in steps], host_s=0.0005, launch_s=0.003, read_s=0.003,
                            config=dataclasses.replace(config, backoff_on_ended_in_launch=True))
    assert backed.ended_in_launch < expected / 2 and backed.backoff_s > 0.0


def test_short_steps_are_fitted_and_held_on_their_own():
    """Decode steps of 8-40 rows at 2K-16K tokens of context (device time 5 ms + 0.2 ms per row +
    0.5 us per context token, 9-30 ms) between long prefill steps: once 16 are timed each is held
    until shortly before the step in flight ends, and the device never idles."""
    rng = np.random.default_rng(3)

    def steps():
        out = []
        for i in range(120):
            ctx = tuple(int(c) for c in rng.integers(2048, 16_384, int(rng.integers(8, 41))))
            out.append(Step(8192, 0.1) if i % 10 == 0 else Step(0, 0.005 + 2e-4 * len(ctx) + 5e-7 * (sum(ctx) + len(ctx)), decode_ctx=ctx))
        return out

    held, gaps, timing = simulate(True, steps=steps(), host_s=0.001)
    off, _, _ = simulate(True, steps=steps(), host_s=0.001, config=DispatchTimingConfig(short_steps=False))
    assert max(gaps) < 1e-12 and timing.idle_launches == 0
    short = timing.summary()["kinds"]["short"]
    assert short["timed"] >= 16 and short["fit_ms"][1] == pytest.approx(0.2, rel=0.02)  # ms per decode token
    assert short["fit_ms"][2] == pytest.approx(500.0, rel=0.02)  # ms per 1M context tokens

    def ahead(run):  # how long before the step in flight (a decode step) ended the next one went out
        return np.array([a.end - b.sent for a, b in zip(run[40:], run[41:]) if a.decode_ctx])

    assert np.all(ahead(held) <= [timing.lead_s(a.device_s) + 1e-3 for a in held[40:-1] if a.decode_ctx])
    assert np.median(ahead(held)) < 0.5 * np.median(ahead(off))


def test_a_fit_of_narrow_steps_never_holds_longer_than_any_step_timed():
    """The trace's start: single-row decode steps (3-5 ms, the context growing), then 40-row ones
    (15 ms). A fit of the single-row steps alone extrapolates the context's cost to the 40 rows'
    far past anything timed (on one H100 it held decode steps for ~1 s, and those steps, idling the
    device, were never timed to correct it): predictions are capped at the longest step timed."""
    rng = np.random.default_rng(4)
    steps = [Step(0, 0.003 + 4e-7 * (1000 + 8 * i) + rng.normal(0, 1e-4), decode_ctx=(1000 + 8 * i,)) for i in range(40)]
    steps += [Step(0, 0.015, decode_ctx=tuple(int(c) for c in rng.integers(4000, 12000, 40))) for _ in range(100)]
    _, gaps, timing = simulate(True, steps=steps, host_s=0.001, config=DispatchTimingConfig(min_step_s=0.004))
    assert sum(gaps) < 0.1  # s, against 1.5 s of device time
    assert max(gaps[60:]) < 1e-12


def test_a_kind_whose_steps_never_run_min_step_s_is_not_fitted_or_held():
    """Batch-1 decode steps (3 ms, under min_step_s): no fit is computed for them (host time) and
    none is held."""
    steps = [Step(0, 0.003, decode_ctx=(1000 + i,)) for i in range(60)]
    _, gaps, timing = simulate(True, steps=steps, host_s=0.0005)
    short = timing.summary()["kinds"]["short"]
    assert short["timed"] > 16 and short["fit_ms"] is None and timing.waits == 0
    assert timing.predicted_s(steps[-1]) is None and max(gaps) < 1e-12
