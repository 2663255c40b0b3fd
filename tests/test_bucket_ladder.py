"""The step-bucket ladder (engine/step_programs.bucket_ladder): what a step of n tokens pads to."""

from __future__ import annotations

import pytest

from splash_jax.engine.step_programs import bucket_ladder


def _pick(sizes: list[int], n: int) -> int:
    return next(b for b in sizes if b >= n)


@pytest.mark.parametrize("max_tokens,min_tokens,gap", [(8192, 16, 0), (8192, 16, 1024), (8192, 16, 1536),
                                                      (8000, 8, 2048), (64, 8, 16), (32, 16, 8), (100, 4, 30)])
def test_padding_is_bounded_by_doubling_below_the_gap_and_by_the_gap_above_it(max_tokens, min_tokens, gap):
    sizes = [b.tokens for b in bucket_ladder(max_tokens, 4, min_tokens, gap)]
    assert sizes == sorted(set(sizes)) and sizes[0] == min(min_tokens, max_tokens) and sizes[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        pad = _pick(sizes, n) - n
        assert pad < max(n, min_tokens), (n, sizes)  # never worse than doubling
        if gap and n > gap:
            assert pad < gap, (n, sizes)  # above the gap: less than one gap of padding


def test_a_power_of_two_gap_keeps_every_doubling_bucket():
    """So the engine's programs without a gap are a subset of those with one (benchmarks/ttft_trace.py
    serves both ladders from one engine)."""
    plain = [b.tokens for b in bucket_ladder(8192, 128, 16)]
    assert plain == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    gapped = [b.tokens for b in bucket_ladder(8192, 128, 16, 1024)]
    assert gapped == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]
    assert [b.requests for b in bucket_ladder(8192, 128, 16, 1024)][-6:] == [128] * 6


def test_the_gap_is_a_flag_checked_at_start_up():
    from splash_jax.engine.config import EngineConfig
    from splash_jax.engine.prefill_order import ladder_sizes

    config = EngineConfig(max_num_batched_tokens=8192, min_token_bucket=16, token_bucket_gap=2048)
    assert ladder_sizes(config, config.resolved_token_bucket_gap("cpu")) == (
        16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6144, 8192)
    auto = EngineConfig()
    assert (auto.resolved_token_bucket_gap("gpu"), auto.resolved_token_bucket_gap("cpu")) == (1024, 0)
    with pytest.raises(ValueError, match="--token-bucket-gap"):
        EngineConfig(token_bucket_gap=-1).validate()
