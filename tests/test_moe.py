"""Every routed-expert path (XLA gathered/dense, Pallas grouped in interpret mode, ragged dot)
computes the same function, also with experts sharded over devices; the routers match transformers."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from splash_jax.model_config import ModelConfig
from splash_jax.moe import MOE_IMPLS, MoE, resolve_moe_impl, route

FIXTURES = Path(__file__).parent / "fixtures"


def _moe(name):
    """One MoE layer of a fixture's config with random weights (router bias too: no near-ties)."""
    cfg = ModelConfig.from_json(FIXTURES / name / "config.json")
    moe = MoE(cfg, jnp.float32, nnx.Rngs(0))
    if cfg.topk_method == "noaux_tc":
        moe.router_bias[...] = jax.random.normal(jax.random.key(1), moe.router_bias.shape) * 0.1
    return cfg, moe


@pytest.mark.parametrize("name", ["v3_tiny", "v2lite_tiny"])
def test_gathered_and_dense_expert_paths_agree(name):
    cfg, moe = _moe(name)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, cfg.hidden_size)).astype(np.float32))
    logits = jnp.dot(x, moe.router[...])
    bias = moe.router_bias[...] if cfg.topk_method == "noaux_tc" else None
    ids, w = route(cfg, logits, bias)
    a, b = moe._gathered(x, ids, w), moe._dense(x, ids, w)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # The public call picks the gathered path here (4 * 1 token * top-2 <= 8 experts).
    x = x[:1]
    ids, w = ids[:1], w[:1]
    b = moe._dense(x, ids, w)
    assert 4 * cfg.num_experts_per_tok <= cfg.n_routed_experts
    np.testing.assert_allclose(np.asarray(moe(x)), np.asarray(b + moe.shared(x)), rtol=1e-5, atol=1e-6)


def test_v3_routing_respects_groups():
    cfg, _ = _moe("v3_tiny")
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


def _numpy_routed(x, ids, w, gate, up, down):
    """Independent reference: a float64 loop over (token, k) pairs; ids outside [0, E) skipped."""
    out = np.zeros(x.shape, np.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if 0 <= e < gate.shape[0]:
                a, b = gate[e] @ x[t], up[e] @ x[t]
                out[t] += (a / (1 + np.exp(-a)) * b * w[t, j]) @ down[e]
    return out


@pytest.mark.parametrize("tokens,top_k,pair_tiles", [(1, 2, None), (5, 3, None), (5, 3, False), (16, 4, None),
                                                     (16, 4, False), (40, 3, None)])
def test_pallas_grouped_kernel_matches_numpy_loop(tokens, top_k, pair_tiles):
    """Non-local ids (< 0, >= E) contribute nothing; duplicates and >16 rows per expert tile. Steps
    of <= 16 tokens run pair tiles by default; False: the planned tiles, on the same input."""
    from pallas_kernels.moe_grouped import routed_experts

    rng = np.random.default_rng(tokens)
    e, i, d = 8, 32, 64
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    ids = rng.integers(-3, e + 2, (tokens, top_k)).astype(np.int32)
    w = rng.random((tokens, top_k)).astype(np.float32)
    gate, up, down = [(rng.standard_normal((e, i, d)) * 0.1).astype(np.float32) for _ in range(3)]
    out = routed_experts(*map(jnp.asarray, (x, ids, w, gate, up, down)), interpret=True, pair_tiles=pair_tiles)
    np.testing.assert_allclose(np.asarray(out), _numpy_routed(x, ids, w, gate, up, down), rtol=1e-5, atol=1e-5)


def test_prefill_sized_steps_use_128_row_tiles_and_match_the_loop():
    """>= 128 pairs per expert picks the prefill config (128-row tiles, several per expert, the
    last partly filled); the kernel with it == the float64 loop."""
    from pallas_kernels.moe_grouped import PREFILL_CONFIG, pick_config, routed_experts

    assert pick_config(8192 * 6, 64, 2048, 1408).block_m == 128
    assert pick_config(512 * 6, 64, 2048, 1408).block_m == 64  # decode sizes keep their tiles
    rng = np.random.default_rng(7)
    tokens, top_k, e, i, d = 150, 2, 2, 128, 128  # 300 pairs over 2 experts: 3 tiles of 128 rows each at most
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    ids = rng.integers(0, e, (tokens, top_k)).astype(np.int32)
    w = rng.random((tokens, top_k)).astype(np.float32)
    gate, up, down = [(rng.standard_normal((e, i, d)) * 0.1).astype(np.float32) for _ in range(3)]
    assert pick_config(tokens * top_k, e, d, i) == PREFILL_CONFIG
    out = routed_experts(*map(jnp.asarray, (x, ids, w, gate, up, down)), interpret=True)
    np.testing.assert_allclose(np.asarray(out), _numpy_routed(x, ids, w, gate, up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_padding_rows_are_routed_to_no_expert(impl):
    """valid=False rows get no routed output (no expert is read for them); real rows are unchanged."""
    cfg, moe = _moe("v2lite_tiny")
    x = jax.random.normal(jax.random.key(1), (6, cfg.hidden_size), jnp.float32)
    valid = np.array([True, False, True, True, False, False])
    full = np.asarray(moe(x, impl=impl))
    masked = np.asarray(moe(x, impl=impl, valid=jnp.asarray(valid)))
    np.testing.assert_allclose(masked[valid], full[valid], rtol=1e-5, atol=1e-6)
    shared = np.asarray(moe.shared(x)) if cfg.n_shared_experts else np.zeros_like(full)
    np.testing.assert_allclose(masked[~valid], shared[~valid], rtol=1e-5, atol=1e-6)  # routed part: 0


def test_router_logits_equal_the_float32_product_at_every_size():
    from splash_jax.moe import SMALL_ROUTER_TOKENS, router_logits

    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    for t in (1, 8, SMALL_ROUTER_TOKENS, SMALL_ROUTER_TOKENS + 1):
        x = rng.standard_normal((t, 64)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(router_logits(jnp.asarray(x), jnp.asarray(w))), x.astype(np.float64) @ w,
                                   rtol=1e-5, atol=1e-5)


def test_pallas_kernel_reads_one_layer_of_a_stack():
    """Stacked [L,E,I,D] weights + a traced layer index (the scanned model's call) == that layer alone."""
    from pallas_kernels.moe_grouped import routed_experts

    rng = np.random.default_rng(11)
    layers, e, i, d = 3, 8, 32, 64
    x = rng.standard_normal((6, d)).astype(np.float32)
    ids = rng.integers(-1, e + 1, (6, 2)).astype(np.int32)
    w = rng.random((6, 2)).astype(np.float32)
    stack = [(rng.standard_normal((layers, e, i, d)) * 0.1).astype(np.float32) for _ in range(3)]
    run = jax.jit(lambda layer: routed_experts(*map(jnp.asarray, (x, ids, w, *stack)), layer, interpret=True))
    for layer in range(layers):
        want = _numpy_routed(x, ids, w, *(s[layer] for s in stack))
        np.testing.assert_allclose(np.asarray(run(jnp.int32(layer))), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="need the layer index"):
        routed_experts(*map(jnp.asarray, (x, ids, w, *stack)), interpret=True)


def _fp8_experts(rng, shape, block):
    """[.., E, I, D] float weights -> (e4m3 values, float32 block scales, the dequantized float64
    weights) with DeepSeek's recipe applied per expert matrix (splash_jax.weights.fp8.quantize)."""
    from splash_jax.weights.fp8 import dequantize, quantize

    w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    flat = w.reshape(-1, *shape[-2:])
    parts = [quantize(m, (block, block)) for m in flat]
    q = np.stack([p[0] for p in parts]).reshape(shape)
    sc = np.stack([p[1] for p in parts]).reshape(shape[:-2] + parts[0][1].shape)
    deq = np.stack([dequantize(p[0], p[1], (block, block)) for p in parts]).reshape(shape)
    return q, sc, deq.astype(np.float64)


@pytest.mark.parametrize("stacked", [False, True])
def test_pallas_kernel_with_fp8_block_scaled_weights_matches_the_dequantized_loop(stacked):
    """FP8 values + 32x32 block scales (tiles capped inside one scale block; 2 x 4 scale blocks per
    expert) == the float64 loop over the dequantized weights; stacked [L,E,I,D] with a layer too."""
    from pallas_kernels.moe_grouped import routed_experts

    rng = np.random.default_rng(5)
    layers, e, i, d, block = 2, 8, 64, 128, 32
    lead = (layers, e) if stacked else (e,)
    x = rng.standard_normal((9, d)).astype(np.float32)
    ids = rng.integers(-1, e + 1, (9, 3)).astype(np.int32)
    w = rng.random((9, 3)).astype(np.float32)
    q, sc, deq = zip(*(_fp8_experts(rng, lead + (i, d), block) for _ in range(3)))
    args = (*map(jnp.asarray, (x, ids, w)), *map(jnp.asarray, q))
    layer = jnp.int32(1) if stacked else None
    out = routed_experts(*args, layer, tuple(map(jnp.asarray, sc)), scale_block=block, interpret=True)
    want = _numpy_routed(x, ids, w, *(m[1] if stacked else m for m in deq))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    assert q[0].dtype == jnp.float8_e4m3fn and q[0].nbytes == q[0].size  # one byte per weight


@pytest.mark.parametrize("small_pairs,tiny_pairs", [(512, 0), (0, 0), (512, 128)])  # compare; sort; no scatter
def test_tile_plan_puts_each_local_pair_in_one_tile_of_its_expert(small_pairs, tiny_pairs, monkeypatch):
    from pallas_kernels import moe_grouped
    from pallas_kernels.moe_grouped import num_tiles, plan_tiles

    monkeypatch.setattr(moe_grouped, "SMALL_PAIRS", small_pairs)
    monkeypatch.setattr(moe_grouped, "TINY_PAIRS", tiny_pairs)
    rng = np.random.default_rng(3)
    ids = rng.integers(-2, 10, (24, 3)).astype(np.int32)
    plan = plan_tiles(jnp.asarray(ids), jnp.ones(ids.shape), 8, 16)
    nt, slot = num_tiles(72, 8, 16), np.asarray(plan.pair_slot)
    local = (ids >= 0) & (ids < 8)
    assert np.all(slot[~local] == nt * 16) and len(set(slot[local].tolist())) == local.sum()
    assert np.all(np.asarray(plan.tile_expert)[slot[local] // 16] == ids[local])
    assert np.asarray(plan.tile_live).sum() == sum(-(-np.sum(ids == e) // 16) for e in range(8))
    np.testing.assert_array_equal(np.asarray(plan.slot_token)[slot[local]], np.nonzero(local)[0])
    slot_pair = np.asarray(plan.slot_pair)  # each local pair's row names it; every other row names none
    np.testing.assert_array_equal(slot_pair[slot[local]], np.flatnonzero(local))
    assert np.sum(slot_pair < 72) == local.sum() and np.all(slot_pair[slot_pair >= 72] == 72)


def test_tile_plan_forms_agree(monkeypatch):
    """The scatter-free plan of small steps equals the scatter plan, field by field (weights too)."""
    from pallas_kernels import moe_grouped
    from pallas_kernels.moe_grouped import plan_tiles

    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(-2, 12, (8, 6)).astype(np.int32))
    w = jnp.asarray(rng.random((8, 6)), jnp.float32)
    monkeypatch.setattr(moe_grouped, "TINY_PAIRS", 0)
    want = plan_tiles(ids, w, 10, 16)
    monkeypatch.setattr(moe_grouped, "TINY_PAIRS", 64)
    got = plan_tiles(ids, w, 10, 16)
    for name, a, b in zip(want._fields, got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_kernel_blocks_that_do_not_divide_are_shrunk():
    """I = 1408 is not a multiple of 256: a config asking for 256 must not drop rows of I."""
    from pallas_kernels.moe_grouped import Config, fit_config

    cfg = fit_config(Config(gu_block_d=256, dn_block_i=256), 2048, 1408)
    assert 1408 % cfg.dn_block_i == 0 and 2048 % cfg.gu_block_d == 0 and cfg.gu_block_d == 256


@pytest.mark.parametrize("name", ["v3_tiny", "v2lite_tiny"])
@pytest.mark.parametrize("tokens", [1, 6])
def test_all_routed_paths_agree_with_an_expert_offset(name, tokens):
    """Every impl on this backend == the numpy loop, for ids shifted as on a device owning experts 2..9."""
    cfg, moe = _moe(name)
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)).astype(np.float32))
    ids, w = route(cfg, jnp.dot(x, moe.router[...]), moe.router_bias[...] if name == "v3_tiny" else None)
    local = ids - 2
    ref = _numpy_routed(*(np.asarray(a, np.float64) if a.dtype != jnp.int32 else np.asarray(a) for a in
                          (x, local, w, moe.experts_gate[...], moe.experts_up[...], moe.experts_down[...])))
    for impl in ("xla", "gathered", "dense", "pallas", "ragged"):
        out = moe.routed(x, local, w, impl)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6, err_msg=impl)


def test_pallas_path_under_expert_sharded_shard_map():
    """The model's contract: experts sharded over 8 devices (one each), each device's partial from
    `moe(x, expert_offset)`, psum over devices == the unsharded XLA MoE."""
    from functools import partial

    from flax import nnx
    from jax.sharding import PartitionSpec as P

    cfg, moe = _moe("v3_tiny")
    x = jnp.asarray(np.random.default_rng(7).standard_normal((5, cfg.hidden_size)).astype(np.float32))
    want = moe(x, impl="xla")
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    graph, state = nnx.split(moe)
    experts = {"experts_gate", "experts_up", "experts_down"}
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: P("d") if any(getattr(k, "key", None) in experts for k in path) else P(), state)

    @partial(jax.shard_map, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
    def step(state, x):
        local = nnx.merge(graph, state)
        offset = lambda n: jax.lax.axis_index("d") * n  # noqa: E731
        part = local(x, offset, impl="pallas") - local.shared(x)  # the shared MLP once, below
        return jax.lax.psum(part, "d") + local.shared(x)

    place = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    state = jax.device_put(state, jax.tree_util.tree_map(place, specs))
    got = jax.jit(step)(state, jax.device_put(x, place(P())))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_resolve_moe_impl():
    assert resolve_moe_impl("auto", "cpu", 1, 8, 256, 7168, 2048) == "gathered"
    assert resolve_moe_impl("auto", "cpu", 128, 8, 256, 7168, 2048) == "dense"
    assert resolve_moe_impl("auto", "tpu", 1, 6, 64, 2048, 1408) == "gathered"
    assert resolve_moe_impl("auto", "gpu", 1, 6, 64, 2048, 1408) in MOE_IMPLS
    assert resolve_moe_impl("auto", "gpu", 1, 6, 64, 2048, 1400) == "gathered"  # I not a multiple of 16
    assert resolve_moe_impl("ragged", "cpu", 1, 6, 64, 2048, 1408) == "ragged"
    with pytest.raises(ValueError):
        resolve_moe_impl("fused", "gpu", 1, 6, 64, 2048, 1408)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_fp8_kernel_matches_the_dequantized_weights(tokens):
    """The compiled kernel with e4m3 weights + 128-block scales (bf16 activations) == the float64
    loop over the dequantized weights, to bf16 accuracy; stacked layer 1 of 2."""
    from pallas_kernels.moe_grouped import routed_experts

    rng = np.random.default_rng(tokens)
    layers, e, i, d, block = 2, 16, 512, 1024, 128
    x = (rng.standard_normal((tokens, d)) * 0.5).astype(np.float32)
    ids = rng.integers(0, e, (tokens, 4)).astype(np.int32)
    w = rng.random((tokens, 4)).astype(np.float32)
    q, sc, deq = zip(*(_fp8_experts(rng, (layers, e, i, d), block) for _ in range(3)))
    out = routed_experts(jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(w), *map(jnp.asarray, q),
                         jnp.int32(1), tuple(map(jnp.asarray, sc)), scale_block=block)
    want = _numpy_routed(x.astype(np.float64), ids, w, *(m[1] for m in deq))
    got = np.asarray(out, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


@pytest.mark.parametrize("name", ["v3_tiny", "v2lite_tiny", "v2_group_tiny", "v3_groupmask_tiny"])
@pytest.mark.parametrize("tokens", [1, 8, 21])
def test_route_kernel_equals_route_with_offset_and_padding_rows(name, tokens):
    """The Pallas router (interpret mode) == `route`, then `ids - offset` and -1 on padding rows:
    same experts in the same order (lax.top_k's), same weights; softmax/sigmoid, V2 group-limited
    and V3 noaux_tc with bias; 21 tokens: two programs, the second partly filled."""
    from pallas_kernels.moe_route import route_local_for

    cfg = _cfg(name)
    rng = np.random.default_rng(tokens)
    e = cfg.n_routed_experts
    logits = jnp.asarray(rng.standard_normal((tokens, e)).astype(np.float32) * 2)
    bias = jnp.asarray(rng.standard_normal(e).astype(np.float32) * 0.1) if cfg.topk_method == "noaux_tc" else None
    valid = rng.random(tokens) < 0.8
    valid[0] = True
    want_ids, want_w = route(cfg, logits, bias)
    ids, w = route_local_for(cfg, logits, bias, jnp.asarray(valid), 3, interpret=True)
    np.testing.assert_array_equal(np.asarray(ids)[valid], np.asarray(want_ids)[valid] - 3)
    assert np.all(np.asarray(ids)[~valid] == -1)
    np.testing.assert_allclose(np.asarray(w)[valid], np.asarray(want_w)[valid], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("name", ["v3_tiny", "v2lite_tiny", "v2_group_tiny"])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_gpu_route_kernel_equals_route(name, tokens):
    """The compiled (Triton) router == `route` on the GPU (lowering, not just interpret mode)."""
    from pallas_kernels.moe_route import route_local_for

    cfg = _cfg(name)
    rng = np.random.default_rng(tokens)
    logits = jnp.asarray(rng.standard_normal((tokens, cfg.n_routed_experts)).astype(np.float32) * 2)
    bias = jnp.asarray(rng.standard_normal(cfg.n_routed_experts).astype(np.float32) * 0.1)
    bias = bias if cfg.topk_method == "noaux_tc" else None
    want_ids, want_w = route(cfg, logits, bias)
    ids, w = route_local_for(cfg, logits, bias, None, 0)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=2e-6, atol=1e-7)
