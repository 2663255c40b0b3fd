"""The Pallas Mosaic TPU paged MLA decode kernel (pallas_kernels/mla_decode_tpu.py).

CPU: Pallas's TPU interpret mode against the XLA reference (splash_jax/attention/paged_reference.py)
over the per-device shapes each layout hands the kernel (recorded while each layout's attention
block is traced inside shard_map on 8 CPU devices), with ragged lengths, partial pages, padded rows
(length 0), garbage page ids past each length, NaN in never-written slots, and split-K on and off.
TPU without a TPU: the kernel lowered and compiled by libtpu for a v5e chip at DeepSeek-V3's
per-device shapes. Inputs are fresh random draws; the seed is in the failure message.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.mla_decode_tpu import paged_mla_decode_tpu, split_pages
from random_models import tiny_config
from attention_checks import assert_attention_matches
from splash_jax.attention import dispatch
from splash_jax.attention.paged_reference import paged_mla_attention
from splash_jax.mesh.layouts import LAYOUT_NAMES, get_layout, make_mesh

N, S, PAGES, MAX_PAGES, TOKENS = 8, 16, 12, 6, 4
# The DeepSeek latent (512 + 64) with 16 heads: 2 per device in tp, 16 in the owner layouts and cp.
CFG = tiny_config(kv_lora_rank=512, qk_rope_head_dim=64, num_heads=16)


def _seed():
    return int(np.random.SeedSequence().generate_state(1)[0])


def _layout_shapes(name: str) -> list[tuple]:
    """(q_latent, q_rope, latent, rope, page_table, kv_lens) shapes of every kernel call one device
    makes in `name`'s attention block (8 devices), recorded while it is traced."""
    from splash_jax.aot import attention_block_lowered

    calls = []
    real = dispatch.paged_attention

    def record(*args, **kw):
        calls.append(tuple(tuple(a.shape) for a in args[:6]))
        return real(*args, **kw)

    dispatch.paged_attention = record
    try:
        attention_block_lowered(CFG, make_mesh(N), get_layout(name), tokens=TOKENS, pages=PAGES, page_size=S,
                                max_pages=MAX_PAGES)
    finally:
        dispatch.paged_attention = real
    return calls


def _problem(rng, shapes, dtype):
    """Random inputs of these shapes: ragged lengths (0 = a padded row, partial last pages, full
    tables), page ids past each length garbage, never-written slots NaN. Returns (kernel inputs,
    the reference's inputs: NaN slots zeroed and garbage clamped, as the reference would read)."""
    (T, H, L), (_, _, R), (P, _, _), _, (_, M), _ = shapes
    choices = [0, 1, S - 1, S + 3, 2 * S, M * S - 5, M * S]
    lens = rng.choice(choices, T).astype(np.int32)
    lens[rng.integers(T)] = 0  # at least one padded row
    table = np.stack([rng.permutation(P)[:M] for _ in range(T)]).astype(np.int32)
    live = np.zeros((P, S), bool)
    for t, n in enumerate(lens):
        used = -(-int(n) // S)
        table[t, used:] = rng.choice([-(2**30), -1, P, P + 7, 2**30], M - used)
        for i in range(n):
            live[table[t, i // S], i % S] = True
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q_lat, q_rope, latent, rope = f(T, H, L), f(T, H, R), f(P, S, L), f(P, S, R)
    clean = [jnp.asarray(np.array(x), dtype).astype(jnp.float32) for x in (q_lat, q_rope, latent, rope)]  # copies
    latent[~live], rope[~live] = np.nan, np.nan
    kernel = [jnp.asarray(x, dtype) for x in (q_lat, q_rope, latent, rope)]
    ref = (*clean, jnp.clip(jnp.asarray(table), 0, P - 1), jnp.asarray(lens))
    return (*kernel, jnp.asarray(table), jnp.asarray(lens)), ref


def test_layouts_hand_the_kernel_their_per_device_shapes():
    """The recorded calls are the per-device shapes DESIGN.md §2 gives each layout (so the next
    test covers them): tp H/N heads of every token, dp/dop every head of the owner rows, cp every
    head of every token; each device's own pool pages, the L = 512 + R = 64 latent."""
    H, per = CFG.num_heads, {name: _layout_shapes(name) for name in LAYOUT_NAMES}
    want = {"tp": (TOKENS, H // N), "dp": (TOKENS, H), "dop": (TOKENS, H), "cp": (TOKENS, H)}
    for name, calls in per.items():
        assert len(calls) == 1, (name, calls)
        q_lat, q_rope, latent, rope, table, lens = calls[0]
        assert q_lat == (*want[name], 512) and q_rope == (*want[name], 64), (name, calls)
        assert latent == (PAGES, S, 512) and rope == (PAGES, S, 64), (name, calls)
        assert table == (TOKENS, MAX_PAGES) and lens == (TOKENS,), (name, calls)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_interpret_matches_reference_on_each_layouts_shapes(name):
    """Every kernel call of the layout, float32 (split-K off and forced on) and bfloat16 inputs."""
    for shapes in _layout_shapes(name):
        for dtype, kw, tol in ((jnp.float32, {}, 2e-5), (jnp.float32, dict(splits=3, pages_per_block=1), 2e-5),
                               (jnp.bfloat16, dict(pages_per_block=2), 2e-2)):
            seed = _seed()
            args, ref = _problem(np.random.default_rng(seed), shapes, dtype)
            got = paged_mla_decode_tpu(*args, CFG.softmax_scale, interpret=True, **kw)
            assert got[0].dtype == dtype and got[0].shape == shapes[0] and got[1].shape == shapes[0][:2]
            want = paged_mla_attention(*ref, CFG.softmax_scale)
            assert_attention_matches(got, want, f"{seed} ({name}, {jnp.dtype(dtype).name}, {kw})", tol)
            assert np.all(np.asarray(got[0], np.float32)[np.asarray(args[5]) == 0] == 0)


def test_splits_deal_each_tokens_pages_in_disjoint_ranges():
    """split_pages cuts [0, pages) of every length into ordered disjoint ranges, a multiple of
    pages_per_block long, whose union is the token's pages."""
    for splits in (1, 2, 3, 8):
        for multiple in (1, 2, 4):
            lens = jnp.arange(0, 40 * S + 1, dtype=jnp.int32)
            pages = np.asarray(-(-lens // S))
            ranges = [split_pages(lens, k, splits, S, multiple) for k in range(splits)]
            starts = np.stack([np.asarray(a) for a, _ in ranges], 1)
            ends = np.stack([np.asarray(b) for _, b in ranges], 1)
            sizes = np.maximum(ends - starts, 0)
            np.testing.assert_array_equal(sizes.sum(1), pages)
            assert np.all(starts % multiple == 0)
            for k in range(1, splits):
                assert np.all(starts[:, k] >= np.minimum(ends[:, k - 1], pages))


@pytest.fixture(scope="module")
def tpu_device():
    from splash_jax.mesh.topology import topology_mesh

    return topology_mesh("v5e:2x4").devices.flat[0]


@pytest.mark.parametrize("heads,tokens,splits", [(16, 64, None), (128, 8, None), (128, 1, 4)])
def test_kernel_compiles_for_a_v5e_chip_at_deepseek_v3_shapes(tpu_device, heads, tokens, splits):
    """bf16, pages of 64 tokens, a 64-page table: 16 heads per chip is V3's tp on 8 chips, 128 its
    dp/dop/cp; one token with 4 splits is batch-1 decode split over the KV length."""
    sharding = jax.sharding.SingleDeviceSharding(tpu_device)
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    P, M = 4096, 64
    args = (sds((tokens, heads, 512), jnp.bfloat16), sds((tokens, heads, 64), jnp.bfloat16),
            sds((P, 64, 512), jnp.bfloat16), sds((P, 64, 64), jnp.bfloat16),
            sds((tokens, M), jnp.int32), sds((tokens,), jnp.int32))
    fn = jax.jit(lambda *a: paged_mla_decode_tpu(*a, 0.1, splits=splits))
    with dispatch.compiling_for("tpu"):
        compiled = fn.trace(*args).lower().compile()
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo and "mla_decode_tpu" in hlo  # the Mosaic kernel, not an XLA fallback
    assert compiled.memory_analysis().argument_size_in_bytes >= 2 * P * 64 * 576


def test_auto_picks_the_tpu_kernel_when_compiling_for_tpu():
    q, qr, lat = (jnp.zeros(s, jnp.bfloat16) for s in ((4, 16, 512), (4, 16, 64), (8, 64, 512)))
    assert dispatch.resolve_impl("auto", q, qr, lat) == "xla"  # this CPU process
    with dispatch.compiling_for("tpu"):
        assert dispatch.target_platform() == "tpu"
        assert dispatch.resolve_impl("auto", q, qr, lat) == "pallas_tpu"
        odd = jnp.zeros((4, 16, 96), jnp.bfloat16)  # a latent the compiled kernel does not take
        assert dispatch.resolve_impl("auto", odd, qr, jnp.zeros((8, 64, 96))) == "xla"
        with pytest.raises(ValueError, match="unknown attention implementation"):
            dispatch.resolve_impl("mosaic_tpu")
    assert dispatch.target_platform() == "cpu"
