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
