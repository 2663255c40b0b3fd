"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers: log-softmax of the
reference fixture's logits (scripts/make_reference_fixtures.py, float32) at each prompt token,
whether the prompt prefills in one chunk or many, beside other requests, with its prefix cached,
and under owner and striped layouts on 4 devices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from splash_jax.engine import Engine, EngineConfig, SamplingParams

FIXTURE = Path(__file__).parent / "fixtures" / "v2lite_tiny"
REF = dict(np.load(FIXTURE / "reference.npz"))
TOKENS = np.concatenate([REF["prompt_ids"], REF["greedy_ids"]]).tolist()  # 39 tokens: full_logits covers them all


def reference(ids: list[int], k: int) -> tuple[list[float], list[dict[int, float]]]:
    """Transformers' logprob of ids[p + 1] at position p, and its top-k, from full_logits."""
    logits = REF["full_logits"][: len(ids) - 1].astype(np.float64)
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    chosen = [float(lp[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    tops = [{int(t): float(lp[p, t]) for t in np.argsort(-lp[p])[:k]} for p in range(len(ids) - 1)]
    return chosen, tops


def engine(**kw) -> Engine:
    args = dict(model=str(FIXTURE), num_devices=1, max_num_seqs=16, max_num_batched_tokens=64, page_size=8,
                max_pages=256, max_model_len=64, warmup=False, attention_impl="xla", dtype="float32",
                compile_cache_dir=None)
    return Engine(EngineConfig(**{**args, **kw}))


def check(out, ids: list[int], k: int) -> None:
    chosen, tops = reference(ids, k)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    np.testing.assert_allclose(out.prompt_logprobs[1:], chosen, atol=1e-4)
    for got, want in zip(out.prompt_top_logprobs[1:], tops):
        assert set(got) == set(want) or np.allclose(sorted(got.values()), sorted(want.values()), atol=1e-4)
        for t in set(got) & set(want):
            assert got[t] == pytest.approx(want[t], abs=1e-4)


@pytest.fixture(scope="module")
def one_device():
    return engine()


@pytest.mark.parametrize("budget", [64, 16])  # one chunk; the 39-token prompt in chunks of <= 16 (and row limits)
def test_prompt_logprobs_equal_transformers(budget):
    e = engine(max_num_batched_tokens=budget, max_num_seqs=8)
    outs = e.generate([TOKENS, TOKENS[:9]], [SamplingParams(max_tokens=2, prompt_logprobs=3),
                                             SamplingParams(max_tokens=2, prompt_logprobs=0)])
    check(outs[0], TOKENS, 3)
    check(outs[1], TOKENS[:9], 0)
    assert all(t == {} for t in outs[1].prompt_top_logprobs[1:])


def test_prompt_logprobs_beside_decoding_requests_and_with_the_prefix_cached(one_device):
    e = one_device
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = e.generate([TOKENS[:20]], [plain])[0].token_ids
    # The same prompt again: its pages are cached, but prompt logprobs need its logits, so it
    # computes the whole prompt; the first request decodes in the same steps, unchanged.
    outs = e.generate([TOKENS[:20], TOKENS], [plain, SamplingParams(max_tokens=1, prompt_logprobs=2)])
    assert outs[0].token_ids == alone
    check(outs[1], TOKENS, 2)
    assert outs[1].num_cached_tokens == 0
    again = e.generate([TOKENS], [SamplingParams(max_tokens=1)])[0]  # without prompt logprobs it hits the cache
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


@pytest.mark.parametrize("layout", ["dop", "cp"])  # owner rows and striped pages (tp: the one-device tests)
def test_prompt_logprobs_in_every_layout(layout):
    e = engine(num_devices=4, layout=layout, max_num_seqs=8, max_num_batched_tokens=32)
    outs = e.generate([TOKENS, TOKENS[:30], TOKENS[:5]], [SamplingParams(max_tokens=2, prompt_logprobs=1)] * 3)
    for out, n in zip(outs, (39, 30, 5)):
        check(out, TOKENS[:n], 1)
