"""The two expert paths (gathered for few tokens, dense for many) compute the same function."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from splash_jax.model import RuntimeOptions
from splash_jax.moe import route
from splash_jax.weights.loader import load_model

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["v3_tiny", "v2lite_tiny"])
def test_gathered_and_dense_expert_paths_agree(name):
    model = load_model(FIXTURES / name, RuntimeOptions(dtype="float32"))
    moe = model.layers[1].mlp
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, model.cfg.hidden_size)).astype(np.float32))
    logits = jnp.dot(x, moe.router[...])
    bias = moe.router_bias[...] if model.cfg.topk_method == "noaux_tc" else None
    ids, w = route(model.cfg, logits, bias)
    a, b = moe._gathered(x, ids, w), moe._dense(x, ids, w)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # The public call picks the gathered path here (4 * 1 token * top-2 <= 8 experts).
    x = x[:1]
    ids, w = ids[:1], w[:1]
    b = moe._dense(x, ids, w)
    assert 4 * model.cfg.num_experts_per_tok <= model.cfg.n_routed_experts
    np.testing.assert_allclose(np.asarray(moe(x)), np.asarray(b + moe.shared(x)), rtol=1e-5, atol=1e-6)


def test_v3_routing_respects_groups():
    model = load_model(FIXTURES / "v3_tiny", RuntimeOptions(dtype="float32"))
    cfg = model.cfg
    logits = jax.random.normal(jax.random.key(0), (64, cfg.n_routed_experts))
    ids, w = route(cfg, logits, jnp.zeros(cfg.n_routed_experts))
    groups = np.asarray(ids) // (cfg.n_routed_experts // cfg.n_group)
    assert max(len(set(g)) for g in groups) <= cfg.topk_group
    np.testing.assert_allclose(np.asarray(w).sum(-1), cfg.routed_scaling_factor, rtol=1e-5)


def _cfg(name, **changes):
    import dataclasses

    from splash_jax.model_config import ModelConfig

    return dataclasses.replace(ModelConfig.from_json(FIXTURES / name), **changes)


def test_v3_masks_other_groups_with_minus_inf_like_transformers():
    """Kept groups whose choice scores (sigmoid + bias) are negative: transformers >= 5 still picks
    from the kept groups (-inf mask); a 0.0 mask would pick the masked experts instead."""
    cfg = _cfg("v3_groupmask_tiny")  # 16 experts, 4 groups of 4, keep 2, top-4
    logits = np.full((1, 16), -4.0, np.float32)
    logits[0, [0, 1, 4, 5]] = 3.0  # groups 0 and 1 win on their top-2 sums
    bias = np.full(16, -0.9, np.float32)  # every choice score negative
    ids, w = route(cfg, jnp.asarray(logits), jnp.asarray(bias))
    chosen = sorted(np.asarray(ids)[0].tolist())
    assert chosen == [0, 1, 4, 5]
    s = 1 / (1 + np.exp(-3.0))
    np.testing.assert_allclose(np.asarray(w)[0], cfg.routed_scaling_factor * np.full(4, s) / (4 * s), rtol=1e-6)
    # Two weak experts in kept groups: -inf still prefers them over every masked expert.
    logits[0, [1, 5]] = -4.0
    ids, _ = route(cfg, jnp.asarray(logits), jnp.asarray(bias))
    assert set(np.asarray(ids)[0].tolist()) <= set(range(8))


def test_group_mask_fixture_exercises_the_mask_case():
    ref = np.load(FIXTURES / "v3_groupmask_tiny" / "reference.npz")
    assert int(ref["group_mask_cases"]) >= 8  # the logits parity in test_model_parity covers these tokens


def test_v2_group_limited_routing_reads_masked_scores_and_ignores_norm_topk_prob():
    cfg = _cfg("v2_group_tiny")  # config.json says norm_topk_prob: true
    assert cfg.topk_method == "group_limited_greedy" and not cfg.norm_topk_prob
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((32, 16)).astype(np.float32) * 3)
    ids, w = route(cfg, logits, None)
    p = np.asarray(jax.nn.softmax(logits, -1))
    groups = p.reshape(32, 4, 4).max(-1)
    kept = np.argsort(-groups, axis=-1)[:, :2]
    for t in range(32):
        allowed = np.concatenate([np.arange(4 * g, 4 * g + 4) for g in kept[t]])
        best = allowed[np.argsort(-p[t, allowed])[:3]]
        assert sorted(np.asarray(ids)[t].tolist()) == sorted(best.tolist())
        np.testing.assert_allclose(sorted(np.asarray(w)[t]), sorted(p[t, best] * cfg.routed_scaling_factor), rtol=1e-5)
