"""Logit and cache parity with transformers (fixtures from scripts/make_reference_fixtures.py)."""

from pathlib import Path

import numpy as np
import pytest

from splash_jax.model import RuntimeOptions
from splash_jax.simple_generate import SingleRequestRunner
from splash_jax.weights.loader import load_model

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ["v3_tiny", "v2lite_tiny", "v3_groupmask_tiny", "v2_group_tiny", "v3_fp8_tiny"]


def max_rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    folder = FIXTURES / request.param
    ref = dict(np.load(folder / "reference.npz"))
    model = load_model(folder, RuntimeOptions(dtype="float32", attention_impl="xla"))
    return request.param, model, ref


def _to_split_order(rope, order):
    """HF V2 caches the rope key in interleaved pair order; ours (and HF V3's) is split order."""
    return np.concatenate([rope[..., 0::2], rope[..., 1::2]], -1) if order == "interleaved" else rope


def test_prefill_logits_match_transformers(case):
    _, model, ref = case
    runner = SingleRequestRunner(model, page_size=8, max_len=64)
    logits, _ = runner.run(runner.new_cache(), ref["prompt_ids"], 0, want="all")
    assert max_rel_err(logits, ref["prefill_logits"]) < 1e-4


def test_decode_through_paged_cache_matches_transformers(case):
    _, model, ref = case
    runner = SingleRequestRunner(model, page_size=8, max_len=64)
    kv = runner.new_cache()
    prompt, greedy = ref["prompt_ids"], ref["greedy_ids"]
    _, kv = runner.run(kv, prompt, 0)
    decode = []
    for i, tok in enumerate(greedy):
        logits, kv = runner.run(kv, [tok], len(prompt) + i)
        decode.append(logits[0])
    assert max_rel_err(np.stack(decode), ref["decode_logits"]) < 1e-4
    # The latent cache equals HF's cache, position by position, in every layer.
    n = len(prompt) + len(greedy)
    table = np.arange(runner.num_pages)
    for layer in range(model.cfg.num_layers):
        lat = np.asarray(kv.latent[layer])[table].reshape(-1, model.cfg.kv_lora_rank)[:n]
        rope = np.asarray(kv.rope[layer])[table].reshape(-1, model.cfg.qk_rope_head_dim)[:n]
        assert max_rel_err(lat, ref["cache_latent"][layer]) < 1e-5
        hf_rope = _to_split_order(ref["cache_rope"][layer], str(ref["cache_rope_order"]))
        assert max_rel_err(rope, hf_rope) < 1e-5


def test_greedy_continuation_identical(case):
    _, model, ref = case
    runner = SingleRequestRunner(model, page_size=16, max_len=64)
    assert runner.greedy(ref["prompt_ids"], 16) == ref["greedy_ids"].tolist()


def test_absorbed_and_naive_forms_agree(case):
    _, model, ref = case
    tokens = np.concatenate([ref["prompt_ids"], ref["greedy_ids"]])
    absorbed = SingleRequestRunner(model, page_size=8, max_len=64)
    a, _ = absorbed.run(absorbed.new_cache(), tokens, 0, want="all")
    naive_model = load_model(FIXTURES / case[0], RuntimeOptions(dtype="float32", attention_impl="naive"))
    naive = SingleRequestRunner(naive_model, page_size=8, max_len=64)
    b, _ = naive.run(naive.new_cache(), tokens, 0, want="all")
    assert max_rel_err(a, b) < 1e-5
    assert max_rel_err(b, ref["full_logits"]) < 1e-4
