"""Step intervals by kind: prefill-carrying steps are told from decode-only ones, idle waits are
not counted as intervals, and the engine's stats expose the split."""

from types import SimpleNamespace

from splash_jax.engine.step_timeline import StepTimeline, classify


def _chunk(prompt_len, start, num_tokens):
    return SimpleNamespace(request=SimpleNamespace(prompt_ids=[0] * prompt_len), start=start, num_tokens=num_tokens,
                           end=start + num_tokens)


def test_classify_counts_prompt_tokens_and_decode_rows():
    chunks = [_chunk(10, 10, 1), _chunk(10, 12, 1), _chunk(100, 0, 64), _chunk(5, 3, 2)]
    assert classify(chunks) == (64 + 2, 2)


def test_intervals_split_by_kind_and_idle_waits_are_gaps():
    t = StepTimeline()
    decode, mixed = [_chunk(4, 8, 1)] * 3, [_chunk(4, 8, 1), _chunk(50, 0, 32)]
    t.completed(0.000, decode, back_to_back=False)  # first: nothing to measure against
    t.completed(0.010, decode, back_to_back=True)
    t.completed(0.030, mixed, back_to_back=True)
    t.completed(0.040, decode, back_to_back=True)
    t.host_time(0.004)
    t.completed(5.000, decode, back_to_back=False)  # after an idle wait: a gap, not a 4.96 s step
    s = t.summary()
    assert s["decode_only"]["steps"] == 2 and s["decode_only"]["p50_ms"] == 10.0
    assert s["with_prefill"]["steps"] == 1 and s["with_prefill"]["mean_ms"] == 20.0
    assert s["with_prefill"]["mean_prefill_tokens"] == 32 and s["decode_only"]["mean_decode_rows"] == 3
    assert s["decode_only"]["host_cpu_p50_ms"] == 2.0  # p50 of (0, 4) ms: only the last call reported
    assert s["prefill_share"] == round(1 / 3, 4) and s["time_share_with_prefill"] == 0.5 and s["gaps"] == 1


def test_engine_stats_report_step_intervals():
    from splash_jax.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(page_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_pages=32,
                                 max_model_len=64, compile_cache_dir=None, warmup=False))
    engine.generate([[1, 2, 3] * 8, [4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))
    s = engine.stats()["step_intervals"]
    assert s["with_prefill"]["steps"] >= 1 and s["decode_only"]["steps"] >= 3
    assert s["decode_only"]["p50_ms"] > 0 and s["decode_only"]["host_cpu_p50_ms"] > 0
