"""Full steps of small buckets sample inside the step program (the fused variant, executor.fuses;
on by default on GPUs only). The reference is the same engine with fusion off, where every full
step hands its logits to a sampler program: tokens and logprobs must be the same."""

import re

import numpy as np
import pytest

from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.executor import Bucket
from splash_jax.structured import StructuredOutputs

KW = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=48, compile_cache_dir=None)
PROMPTS = ["Latent attention", "One shared latent per token means the cache can live anywhere.", "ok", "The batch"]
PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.8, seed=3),  # plain draws: SamplerMode(False, False)
    SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=5, logprobs=2),  # filter + top logprobs
    SamplingParams(max_tokens=10, frequency_penalty=0.5, presence_penalty=0.3),  # greedy with penalties
    SamplingParams(max_tokens=10, temperature=0.7, top_k=5, repetition_penalty=1.2, seed=1),
]


def _generate(layout: str, fused_max_tokens: int, params, warmup: bool = False):
    engine = Engine(EngineConfig(layout=layout, num_devices=2, fused_sampler_max_tokens=fused_max_tokens,
                                 warmup=warmup, **KW))
    compiled = engine.executor.num_compiled
    outs = engine.generate(PROMPTS[: len(params)], params)
    fused_keys = {key for key in engine.executor._compiled if key[5] is not None}  # (…, expanded, mode)
    return engine, compiled, [(o.token_ids, o.logprobs, o.top_logprobs, o.text) for o in outs], fused_keys


def _same(a, b):
    for (ta, la, topa, xa), (tb, lb, topb, xb) in zip(a, b, strict=True):
        assert ta == tb and xa == xb
        assert (la is None) == (lb is None) and (topa is None) == (topb is None)
        if la is not None:  # the chosen tokens' logprobs: the same numbers from either program
            np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-6)
        for ea, eb in zip(topa or [], topb or [], strict=True):  # and the top-n
            assert ea.keys() == eb.keys()
            np.testing.assert_allclose([ea[k] for k in ea], [eb[k] for k in ea], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["dp"])  # per-device buckets; tp runs fused in the grammar test below
def test_fused_full_steps_sample_what_the_sampler_program_does(layout):
    _, _, reference, none = _generate(layout, 0, PARAMS)
    assert not none  # fusion off: no fused program
    engine, _, fused, keys = _generate(layout, 8, PARAMS)
    assert keys and all(key[1].tokens <= 8 for key in keys), "decode steps (4 tokens) ran fused programs"
    assert any(key[3] and key[5] is None for key in engine.executor._compiled), "prefill steps (> 8 tokens) did not"
    _same(fused, reference)


def test_grammar_steps_keep_the_sampler_program_and_warm_up_compiles_every_fused_program():
    # a constrained request's steps defer their sampling (its mask is filled while the step runs):
    # they run the step that returns logits even in a bucket that fuses, next to fused steps
    params = [PARAMS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=7,
                                        structured_outputs=StructuredOutputs(regex=r"[a-z]{3,8}")), PARAMS[1]]
    _, _, reference, _ = _generate("tp", 0, params)
    engine, compiled, fused, keys = _generate("tp", 8, params, warmup=True)
    assert engine.executor.num_compiled == compiled, "nothing compiled after warm-up"
    small = [b for b in engine.executor.buckets(engine.layout) if b.tokens <= 8]
    assert {(k[1], k[5]) for k in keys} == {(b, m) for b in small for m in {k[5] for k in keys}} and len(keys) == 4 * len(small)
    assert re.fullmatch(r"[a-z]{3,8}", fused[1][3])
    _same(fused, reference)


def test_fusion_is_checked_and_auto_fuses_on_gpus_only():
    assert EngineConfig().resolved_fused_sampler_max_tokens("gpu") == 8
    assert EngineConfig().resolved_fused_sampler_max_tokens("cpu") == EngineConfig().resolved_fused_sampler_max_tokens("tpu") == 0
    assert EngineConfig(fused_sampler_max_tokens=16).resolved_fused_sampler_max_tokens("cpu") == 16
    with pytest.raises(ValueError, match="fused-sampler-max-tokens"):
        EngineConfig(fused_sampler_max_tokens=-1).validate()
    engine = Engine(EngineConfig(layout="tp", num_devices=2, fused_sampler_max_tokens=8, warmup=False, **KW))
    ex = engine.executor
    assert ex.fuses(Bucket(8, 8)) and not ex.fuses(Bucket(16, 8))
    assert not ex.fuses(Bucket(8, 8), moving=True) and not ex.fuses(Bucket(8, 8), expanded=True)
    assert ex.returns_logits(Bucket(8, 8), full=True, defer=True) and not ex.returns_logits(Bucket(8, 8), full=True)
    with pytest.raises(ValueError, match="no fused program"):
        ex.lower(engine.layout, Bucket(16, 8), full=True, mode=next(iter(k[5] for k in ex.program_keys([engine.layout]) if k[5])))
