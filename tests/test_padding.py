"""Models whose head / expert / FFN / vocab counts do not divide the device count are zero-padded
at load time and must compute the unpadded model: on one device (to f32 rounding: only the
matmul blocking changes) and in every layout on 8 devices (f32, 1e-4), through the public Engine."""

from __future__ import annotations

import numpy as np
import pytest

from random_models import tiny_config, write_random_checkpoint
from splash_jax.mesh.layouts import LAYOUT_NAMES
from splash_jax.model import RuntimeOptions
from splash_jax.simple_generate import SingleRequestRunner
from splash_jax.weights.loader import load_model
from splash_jax.weights.padding import padding_costs, zero_pad_to

N = 8
OPTS = RuntimeOptions(dtype="float32", attention_impl="xla")
PROMPTS = [np.random.default_rng(i).integers(2, 200, n).tolist() for i, n in enumerate((13, 5, 21))]
# min_token_bucket=32: one token bucket for one device, tp and cp (the engines compile 1 program
# instead of 3; owner layouts 3 as before): the padding under test is the model's, not the batch's.
ENGINE = dict(page_size=8, max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32, max_pages=24,
              compile_cache_dir=None, warmup=False, dtype="float32", attention_impl="xla")

# (heads, routed experts): 5, 6 and 12 heads; 12 and 20 experts (groups of 4 / 5, group-limited).
SHAPES = [(5, 12), (6, 20), (12, 12)]
# Every layout on 8 devices: (6, 20) pads heads (6 -> 8) and experts (20 -> 24) in the default suite;
# the other shapes run with -m slow (each engine set costs 20-35 s on a 2-core CI host).
LAYOUT_SHAPES = [(6, 20)]
SLOW_SHAPES = [(5, 12), (12, 12), (6, 12), (12, 20), (5, 20)]


def _checkpoint(tmp_path_factory, heads: int, experts: int):
    cfg = tiny_config(num_heads=heads, n_routed_experts=experts, n_group=4, topk_group=2,
                      vocab_size=250, intermediate_size=90, max_position_embeddings=128)
    return write_random_checkpoint(tmp_path_factory.mktemp(f"h{heads}e{experts}"), cfg, seed=heads * 100 + experts)


def _outputs(folder, **kw):
    from splash_jax.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=str(folder), **ENGINE, **kw))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True))
    return [(o.token_ids, np.asarray(o.logprobs), o.top_logprobs) for o in outs], engine


def _assert_same(got, want, what):
    for (ids_g, lp_g, top_g), (ids_w, lp_w, top_w) in zip(got, want):
        assert ids_g == ids_w, what
        np.testing.assert_allclose(lp_g, lp_w, atol=1e-4, err_msg=what)
        for a, b in zip(top_g, top_w):
            assert a.keys() == b.keys(), what
            np.testing.assert_allclose(list(a.values()), [b[k] for k in a], atol=1e-4, err_msg=what)


def test_zero_pad_to_appends_zeros_only():
    a = np.arange(6.0).reshape(2, 3)
    b = zero_pad_to(a, (3, 5))
    np.testing.assert_array_equal(b[:2, :3], a)
    assert b.shape == (3, 5) and not b[2:].any() and not b[:, 3:].any()
    with pytest.raises(ValueError, match="cannot pad"):
        zero_pad_to(a, (1, 3))


def test_padded_config_keeps_real_counts_and_reports_cost():
    cfg = tiny_config(num_heads=5, n_routed_experts=12, n_group=4, topk_group=2, vocab_size=250)
    padded = cfg.padded_to(8)
    assert (padded.num_heads, padded.n_routed_experts, padded.vocab_size) == (5, 12, 250)
    assert (padded.arrays.num_heads, padded.arrays.n_routed_experts, padded.arrays.vocab_size) == (8, 16, 256)
    assert padded.to_hf_dict() == cfg.to_hf_dict()  # snapshots and exports describe the real model
    assert cfg.padded_to(1) == cfg and tiny_config().padded_to(4).padding is None
    costs = {c.axis: c for c in padding_costs(padded)}
    assert set(costs) == {"num_heads", "n_routed_experts", "vocab_size"}
    assert costs["num_heads"].compute_share == pytest.approx(3 / 5)
    per_head = 32 * 32 + 64 * 32 + 16 * 64  # q_b + kv_b (W_UK, W_UV) + o_proj of one head
    assert costs["num_heads"].added_params == 3 * per_head * cfg.num_layers


@pytest.mark.parametrize("heads,experts", SHAPES)
def test_padded_model_on_one_device_equals_the_unpadded_model(tmp_path_factory, heads, experts):
    folder = _checkpoint(tmp_path_factory, heads, experts)
    plain, padded = load_model(folder, OPTS), load_model(folder, OPTS, pad_multiple=N)
    assert padded.cfg.padding is not None
    tokens = PROMPTS[2]
    logits = []
    for model in (plain, padded):
        runner = SingleRequestRunner(model, page_size=8, max_len=64)
        logits.append(runner.run(runner.new_cache(), tokens, 0, want="all")[0])
    assert logits[0].shape == (len(tokens), 250)
    assert np.abs(logits[0] - logits[1]).max() / np.abs(logits[0]).max() < 1e-5


def _every_layout_matches_single_device(tmp_path_factory, heads, experts):
    folder = _checkpoint(tmp_path_factory, heads, experts)
    want, single = _outputs(folder)
    assert single.model.cfg.padding is None
    for name in LAYOUT_NAMES:
        got, engine = _outputs(folder, layout=name, num_devices=N)
        arrays = engine.model.cfg.arrays
        assert arrays.num_heads % N == 0 and arrays.n_routed_experts % N == 0
        assert engine.model.layer(0).attn.o_proj[...].shape[0] == arrays.num_heads
        _assert_same(got, want, f"{name}: {heads} heads, {experts} experts")


@pytest.mark.parametrize("heads,experts", LAYOUT_SHAPES)
def test_padded_model_in_every_layout_matches_unpadded_single_device(tmp_path_factory, heads, experts):
    _every_layout_matches_single_device(tmp_path_factory, heads, experts)


@pytest.mark.slow
@pytest.mark.parametrize("heads,experts", SLOW_SHAPES)
def test_more_padded_shapes_in_every_layout(tmp_path_factory, heads, experts):
    _every_layout_matches_single_device(tmp_path_factory, heads, experts)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_logits_of_few_rows_are_the_plain_product(rows):
    """logits_dot pads fewer than 8 rows to 8 (a GEMM instead of a GPU GEMV that converts the whole
    head to float32); the rows it returns are the plain product's."""
    import jax.numpy as jnp

    from splash_jax.layers import logits_dot

    rng = np.random.default_rng(rows)
    h = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((64, 300)), jnp.float32)
    out = logits_dot(h, head)
    assert out.shape == (rows, 300) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(h) @ np.asarray(head), rtol=1e-5, atol=1e-5)
