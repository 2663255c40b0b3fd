"""The engine against the model alone: continuous batching, chunked prefill, preemption,
bad requests, sampling controls, and no compilation after warm-up."""

import jax
import numpy as np
import pytest

from splash_jax.compile_guard import count_compiles
from splash_jax.engine.request import accumulate
from splash_jax.engine.sampler import SamplerMode
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.simple_generate import SingleRequestRunner
from splash_jax.weights.loader import load_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "MLA",
    "Latent attention caches one compressed vector per token, shared by all heads.",
    "Hi there",
    "Serving engines batch requests continuously; each step mixes prefill chunks with decode tokens.",
    "x = 1",
]


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL, RuntimeOptions(dtype="float32", attention_impl="xla"))


def make_engine(model, **kw):
    cfg = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=96, compile_cache_dir=None)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), model=model)


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(model)


@pytest.fixture(scope="module")
def small_engine(model):
    """12 pages of 8 tokens: too few for the six prompts at once, so requests are preempted. Shared
    (each test checks the preemptions its own run caused, and every run leaves the pool empty)."""
    return make_engine(model, max_pages=12)


@pytest.fixture(scope="module")
def reference(model, engine):
    """Greedy continuation of each prompt by the model alone, token by token."""
    runner = SingleRequestRunner(model, page_size=16, max_len=128)
    out = {}
    for p in PROMPTS:
        ids = engine.tokenizer.encode(p, add_bos=True)
        out[p] = runner.greedy(ids, 12)
    return out


def run_staggered(engine, prompts, params, arrivals):
    """Add prompt i before step arrivals[i]; step until all finish. Returns {prompt: token ids}."""
    acc = {}
    pending = sorted(zip(arrivals, range(len(prompts))))
    ids, done, step = {}, {}, 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            ids[engine.add_request(prompts[i], params)] = prompts[i]
        for out in accumulate(acc, engine.step()):
            if out.finished:
                done[ids[out.request_id]] = out
        step += 1
    return done


def test_staggered_arrivals_with_chunked_prefill_match_model_alone(engine, reference):
    # 32-token budget: the long prompts are split into chunks and share steps with decodes.
    done = run_staggered(engine, PROMPTS, SamplingParams(max_tokens=12), arrivals=[0, 0, 1, 3, 4, 9])
    for p in PROMPTS:
        assert done[p].token_ids == reference[p], p
        assert done[p].finish_reason == "length"
        assert done[p].ttft is not None and done[p].tpot is not None


def test_steps_padded_to_a_gap_bucket_match_model_alone(model, reference):
    """--token-bucket-gap 8 adds a 24-token bucket between 16 and 32: the steps that use it (a prompt
    arriving beside a few decodes) give the model alone's tokens."""
    engine = make_engine(model, token_bucket_gap=8, max_pages=64)
    assert [b.tokens for b in engine.executor.buckets(engine.executor.layout)] == [8, 16, 24, 32]
    picked, pick = [], engine.executor.pick
    engine.executor.pick = lambda t, r: picked.append(pick(t, r).tokens) or pick(t, r)
    done = run_staggered(engine, PROMPTS, SamplingParams(max_tokens=12), arrivals=[0, 3, 6, 9, 12, 15])
    for p in PROMPTS:
        assert done[p].token_ids == reference[p], p
    assert 24 in picked, picked
    # the doubling ladder is a subset of the compiled one (benchmarks/ttft_trace.py serves both)
    engine.executor.use_bucket_gap(0)
    assert [b.tokens for b in engine.executor.buckets(engine.executor.layout)] == [8, 16, 32]
    with pytest.raises(ValueError, match="12"):
        engine.executor.use_bucket_gap(4)  # 12, 20, 28 were never compiled


def test_small_pool_preempts_and_still_matches(small_engine, reference):
    # 12 pages of 8 tokens cannot hold six requests of ~20-30 tokens at once.
    engine, before = small_engine, small_engine.scheduler.num_preemptions
    assert engine.stats()["pages_used"] == 0 and not engine.has_work()
    done = run_staggered(engine, PROMPTS, SamplingParams(max_tokens=12), arrivals=[0] * len(PROMPTS))
    assert engine.scheduler.num_preemptions > before
    for p in PROMPTS:
        assert done[p].token_ids == reference[p], p
    assert engine.stats()["pages_used"] == 0


def test_prefix_caching_under_preemption_and_eviction_matches_model_alone(small_engine, reference):
    """A pool too small for the prompts at once: requests are preempted (they find their own prefix
    cached again), cached pages are evicted for room, identical prompts (n > 1) share pages, and
    every output is still the model's own greedy continuation."""
    engine = small_engine
    assert engine.scheduler.cache is not None and engine.stats()["pages_used"] == 0
    before, evicted = engine.scheduler.num_preemptions, engine.allocator.num_evictions
    hits = engine.stats()["prefix_cache"]["hits"]
    twins = [PROMPTS[0]] * 3 + [PROMPTS[4]] * 2
    for run in range(2):
        done = {}
        acc, ids = {}, {}
        for i, p in enumerate(PROMPTS + twins):
            ids[engine.add_request(p, SamplingParams(max_tokens=12))] = p
        while engine.has_work():
            for out in accumulate(acc, engine.step()):
                if out.finished:
                    assert out.token_ids == reference[ids[out.request_id]], ids[out.request_id]
                    done[out.request_id] = out
        assert len(done) == len(PROMPTS) + len(twins)
    assert engine.scheduler.num_preemptions > before
    assert engine.allocator.num_evictions > evicted
    assert engine.stats()["prefix_cache"]["hits"] > hits
    assert engine.stats()["pages_used"] == 0
    engine.allocator.check_invariants()


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ("", SamplingParams(), "prompt is empty"),
        ("word " * 400, SamplingParams(), "maximum model length"),
        ("ok", SamplingParams(max_tokens=0), "max_tokens"),
        ("ok", SamplingParams(temperature=-1.0), "temperature"),
        ("ok", SamplingParams(top_p=0.0), "top_p"),
        ("ok", SamplingParams(top_k=-5), "top_k"),
        ([99999], SamplingParams(), "outside the vocabulary"),
        ([5, -3], SamplingParams(), "prompt token id -3 is outside the vocabulary"),
        ([5, "x"], SamplingParams(), "prompt token ids must be integers"),
        ([5, 1.5], SamplingParams(), "prompt token ids must be integers, got float 1.5"),  # never truncated to 1
        ([5, "3"], SamplingParams(), "prompt token ids must be integers, got str '3'"),
        ([5, 2**70], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_bad_request_fails_alone(engine, reference, prompt, params, message):
    good = PROMPTS[:2]
    outs = engine.generate([good[0], prompt, good[1]], [SamplingParams(max_tokens=12), params, SamplingParams(max_tokens=12)])
    assert outs[1].error is not None and message in outs[1].error
    assert outs[0].token_ids == reference[good[0]] and outs[2].token_ids == reference[good[1]]


def test_no_compile_after_warmup_across_mixed_workload(engine):
    params = [
        SamplingParams(max_tokens=9),
        SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=1),
        SamplingParams(max_tokens=7, temperature=1.0, top_p=0.9, logprobs=3),
        SamplingParams(max_tokens=3, stop=["e"]),
    ]
    with count_compiles() as compiles:
        run_staggered(engine, PROMPTS[:4], params[0], arrivals=[0, 2, 2, 5])
        engine.generate(PROMPTS, [params[i % 4] for i in range(len(PROMPTS))])
        engine.generate([PROMPTS[4] * 3], SamplingParams(max_tokens=2))  # several prefill chunks
    assert compiles.count == 0, compiles.events


def test_seeded_sampling_reproduces_across_batches(engine):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234)
    alone = engine.generate([PROMPTS[0]], p)[0].token_ids
    crowd = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [SamplingParams(max_tokens=4), p, p])
    assert crowd[1].token_ids == alone
    assert crowd[2].token_ids != alone  # another prompt, another stream
    other_seed = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=1.0, seed=99))[0]
    assert other_seed.token_ids != alone


def test_a_seeded_stream_does_not_depend_on_the_sampler_mode_of_its_steps(engine, monkeypatch):
    """Alone, a plain temperature request runs the sampler without a filter or top-n; beside a
    top-p + logprobs request every step runs the full mode: the same tokens and logprobs."""
    used, program = [], engine.executor.sampler_program
    monkeypatch.setattr(engine.executor, "sampler_program", lambda rows, mode: used.append(mode) or program(rows, mode))
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=77, logprobs=0)
    alone = engine.generate([PROMPTS[0]], p)[0]
    assert set(used) == {SamplerMode(filter=False, top_logprobs=False)}
    used.clear()
    crowd = engine.generate([PROMPTS[0], PROMPTS[2]],
                            [p, SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, logprobs=3, seed=5)])
    assert set(used) == {SamplerMode(filter=True, top_logprobs=True)}
    assert crowd[0].token_ids == alone.token_ids
    np.testing.assert_allclose(crowd[0].logprobs, alone.logprobs, rtol=1e-5)
    assert len(crowd[1].top_logprobs[0]) == 3


def test_top_k_one_is_greedy_and_logprobs_are_the_model_distribution(engine, model, reference):
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=2.0, top_k=1, logprobs=4))[0]
    assert out.token_ids == reference[PROMPTS[0]]
    runner = SingleRequestRunner(model, page_size=16, max_len=128)
    ids = engine.tokenizer.encode(PROMPTS[0], add_bos=True)
    logits, _ = runner.run(runner.new_cache(), ids, 0)
    logp = logits[-1] - np.log(np.exp(logits[-1] - logits[-1].max()).sum()) - logits[-1].max()
    assert abs(out.logprobs[0] - logp[out.token_ids[0]]) < 1e-4
    top = sorted(out.top_logprobs[0].items(), key=lambda kv: -kv[1])
    assert [t for t, _ in top] == list(np.argsort(-logp)[:4])
    assert len(out.logprobs) == len(out.token_ids) == 12


def first_new_token(ids: list[int]) -> int:
    """Index of the first token past the start that did not appear before it (a stop id that
    ends the output exactly there; the trained bundled model repeats tokens)."""
    return next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])


def test_stop_strings_eos_and_abort(engine, reference):
    full = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12))[0]
    stop = full.text[3:5]
    out = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12, stop=[stop]))[0]
    assert out.finish_reason == "stop" and stop not in out.text and full.text.startswith(out.text)
    assert out.text == full.text[: full.text.find(stop)]
    ref = reference[PROMPTS[2]]
    i = first_new_token(ref)
    out = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12, stop_token_ids=[ref[i]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: i + 1]
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.abort(rid) and not engine.has_work() and engine.stats()["pages_used"] == 0


def test_stream_deltas_concatenate_to_text_and_never_show_a_stop_prefix(engine):
    acc = {}
    full = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=12))[0].text
    stop = full[5:8]
    rid = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=12, stop=[stop]))
    deltas, final = [], None
    while engine.has_work():
        for out in accumulate(acc, engine.step()):
            if out.request_id == rid:
                deltas.append(out.delta_text)
                final = out
    assert "".join(deltas) == final.text == full[: full.find(stop)]
    # What a client has shown at any moment is a prefix of the final text: nothing is taken back.
    shown = ""
    for d in deltas:
        shown += d
        assert final.text.startswith(shown)


def test_a_request_that_breaks_step_packing_fails_alone(engine, reference):
    """A request that passed validation but breaks the host side of a step (here: its sampling
    row raises) is found and failed with a clear error; the others' outputs are unchanged."""
    assign = engine.slot_sampling.assign

    def fragile(slot, params, seed):
        if params.seed == 4242:
            raise OverflowError("value out of int32 range")
        return assign(slot, params, seed)

    engine.slot_sampling.assign = fragile
    try:
        params = [SamplingParams(max_tokens=12)] * 3 + [SamplingParams(max_tokens=12, seed=4242)]
        outs = engine.generate(PROMPTS[:3] + [PROMPTS[3]], params)
    finally:
        engine.slot_sampling.assign = assign
    assert [o.token_ids for o in outs[:3]] == [reference[p] for p in PROMPTS[:3]]
    assert outs[3].finish_reason == "error" and "OverflowError" in outs[3].error
    assert not engine.has_work() and engine.stats()["pages_used"] == 0


def test_a_failed_device_step_recomputes_and_outputs_are_unchanged(engine, reference):
    """A step that fails on the device loses the donated pool: every running request is recomputed
    from an empty pool (none is lost or changed); a request in two failed steps is failed."""
    run, calls, pool = engine.executor.run, [0], []

    def flaky(*args, **kw):
        calls[0] += 1
        if calls[0] == 4:  # fails before it runs: the pool was not donated
            pool.extend(jax.tree.leaves(engine.executor.kv))
            raise RuntimeError("simulated device failure")
        return run(*args, **kw)

    engine.executor.run = flaky
    try:
        outs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=12))
    finally:
        engine.executor.run = run
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS[:3]]
    assert engine.stats()["step_failures"] == 1 and engine.stats()["pages_used"] == 0
    assert pool and all(x.is_deleted() for x in pool), "the old pool is freed before the new one is allocated"


def _mixed_workload(engine, overlap: bool, reference):
    """Staggered arrivals with chunked prefill, stop strings and ids, logprobs, sampling, penalties
    and an abort, run with overlapped scheduling on or off. Returns every request's outcome."""
    engine.set_overlap(overlap)
    tok = reference[PROMPTS[2]][4]
    params = [
        SamplingParams(max_tokens=12, logprobs=3),
        SamplingParams(max_tokens=12, stop_token_ids=[tok]),
        SamplingParams(max_tokens=12, stop_token_ids=[tok]),
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5),
        SamplingParams(max_tokens=40),  # aborted after a few steps
        SamplingParams(max_tokens=12, stop=["e"], logprobs=0),
    ]
    arrivals = [0, 0, 1, 3, 4, 6]
    acc, ids, step, aborted = {}, {}, 0, None
    pending = sorted(zip(arrivals, range(len(PROMPTS))))
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            ids[engine.add_request(PROMPTS[i], params[i])] = i
        accumulate(acc, engine.step())
        if step == 9:
            aborted = next(r for r, i in ids.items() if i == 4)
            engine.abort(aborted)
        step += 1
    engine.set_overlap(True)
    out = {}
    for rid, i in ids.items():
        o = acc.get(rid)
        out[i] = None if rid == aborted else (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs)
    assert engine.stats()["pages_used"] == 0
    return out


def _same(a: dict, b: dict) -> None:
    """Tokens, text, finish and stop reasons equal; logprobs to 1e-4 (a position recomputed after a
    preemption may run in another batch shape, since preemption timing differs between the modes:
    float rounding changes, tokens do not)."""
    assert a.keys() == b.keys()
    for i in a:
        assert (a[i] is None) == (b[i] is None), i
        if a[i] is not None:
            assert a[i][:4] == b[i][:4], i
            if a[i][4] is not None:
                np.testing.assert_allclose(a[i][4], b[i][4], atol=1e-4)


def test_overlapped_and_synchronous_scheduling_give_identical_outputs(engine, small_engine, reference):
    _same(_mixed_workload(engine, True, reference), _mixed_workload(engine, False, reference))
    # ...and with a pool so small that requests are preempted and recomputed.
    small, before = small_engine, small_engine.scheduler.num_preemptions
    assert small.stats()["pages_used"] == 0 and not small.has_work()
    a, b = _mixed_workload(small, True, reference), _mixed_workload(small, False, reference)
    assert small.scheduler.num_preemptions > before
    _same(a, b)


def test_no_output_has_a_token_after_its_stop(engine, reference):
    """With overlapped scheduling a token is sampled past the stop; it is dropped, never shown."""
    ref = reference[PROMPTS[0]]
    i = first_new_token(ref)
    tok = ref[i]
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, stop_token_ids=[tok]))[0]
    assert out.token_ids == ref[: i + 1] and out.token_ids[-1] == tok and out.stop_reason == tok


def test_start_up_objects_are_frozen_out_of_the_garbage_collector(model):
    """A full gc.collect() walks every tracked object; after start-up those are the model, the
    compiled programs and jax's caches, hundreds of thousands of objects a collection would stall a
    step on. With gc_freeze (default on GPUs and TPUs) start-up moves them to the permanent generation."""
    import gc

    before = gc.get_freeze_count()
    try:
        make_engine(model, warmup=False)  # auto: off on CPU
        assert gc.get_freeze_count() == before
        make_engine(model, warmup=False, gc_freeze="on")
        frozen = gc.get_freeze_count() - before
        assert frozen > 0 and gc.get_count()[0] < 700  # a fresh young generation: everything older is frozen
    finally:
        gc.unfreeze()  # leave the test process as it was


def test_last_step_phases_partition_the_step(engine):
    """engine.last_step_ms splits a step() call's wall time into its host phases (switch, schedule,
    dispatch, handoff, complete) and the wait for the device; together they are the call, no more."""
    import time

    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), "phases")
    seen_wait = False
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        wall = (time.perf_counter() - t) * 1e3
        phases = engine.last_step_ms
        assert set(phases) == {"switch", "schedule", "dispatch", "handoff", "wait", "complete"}
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) <= wall
        seen_wait |= phases["wait"] > 0
    assert seen_wait  # some step read a completed step's tokens back
