"""The XLA paged MLA attention against a dense numpy softmax over the same tokens."""

import numpy as np
import pytest

import jax.numpy as jnp

from splash_jax.attention.paged_reference import merge_partial_attention, paged_mla_attention


def _dense_reference(q_lat, q_rope, latent, rope, page_table, kv_lens, scale):
    T, H, _ = q_lat.shape
    S = latent.shape[1]
    out = np.zeros(q_lat.shape, np.float64)
    lse = np.full((T, H), -np.inf)
    for t in range(T):
        n = kv_lens[t]
        if n == 0:
            continue
        slots = [(page_table[t, i // S], i % S) for i in range(n)]
        kl = np.stack([latent[p, o] for p, o in slots]).astype(np.float64)
        kr = np.stack([rope[p, o] for p, o in slots]).astype(np.float64)
        s = (q_lat[t] @ kl.T + q_rope[t] @ kr.T) * scale
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        out[t] = (e / e.sum(-1, keepdims=True)) @ kl
        lse[t] = (m[:, 0] + np.log(e.sum(-1)))
    return out, lse


@pytest.mark.parametrize("page_size,block_tokens", [(4, 8), (8, 64), (16, 16)])
def test_paged_attention_matches_dense(page_size, block_tokens):
    rng = np.random.default_rng(0)
    T, H, L, R, P, M = 6, 3, 32, 8, 24, 7
    kv_lens = np.array([1, 5, page_size, page_size * 3 + 1, 0, M * page_size], np.int32)
    q_lat = rng.standard_normal((T, H, L)).astype(np.float32)
    q_rope = rng.standard_normal((T, H, R)).astype(np.float32)
    latent = rng.standard_normal((P, page_size, L)).astype(np.float32)
    rope = rng.standard_normal((P, page_size, R)).astype(np.float32)
    page_table = np.stack([rng.permutation(P)[:M] for _ in range(T)]).astype(np.int32)
    out, lse = paged_mla_attention(
        jnp.asarray(q_lat), jnp.asarray(q_rope), jnp.asarray(latent), jnp.asarray(rope),
        jnp.asarray(page_table), jnp.asarray(kv_lens), 0.3, block_tokens=block_tokens,
    )
    ref_out, ref_lse = _dense_reference(q_lat, q_rope, latent, rope, page_table, kv_lens, 0.3)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[kv_lens == 0] == 0)


def test_merge_of_split_kv_equals_whole():
    rng = np.random.default_rng(1)
    T, H, L, R, S = 3, 2, 16, 4, 4
    latent = jnp.asarray(rng.standard_normal((8, S, L)).astype(np.float32))
    rope = jnp.asarray(rng.standard_normal((8, S, R)).astype(np.float32))
    q_lat = jnp.asarray(rng.standard_normal((T, H, L)).astype(np.float32))
    q_rope = jnp.asarray(rng.standard_normal((T, H, R)).astype(np.float32))
    table = jnp.asarray(np.tile(np.arange(8, dtype=np.int32), (T, 1)))
    lens = jnp.asarray(np.array([32, 20, 9], np.int32))
    whole = paged_mla_attention(q_lat, q_rope, latent, rope, table, lens, 0.5)
    # Split the context: first 4 pages vs the rest (expressed as two tables with shifted lengths).
    first = paged_mla_attention(q_lat, q_rope, latent, rope, table[:, :4], jnp.minimum(lens, 16), 0.5)
    rest = paged_mla_attention(q_lat, q_rope, latent, rope, table[:, 4:], jnp.maximum(lens - 16, 0), 0.5)
    out, lse = merge_partial_attention(jnp.stack([first[0], rest[0]]), jnp.stack([first[1], rest[1]]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(whole[1]), rtol=1e-5, atol=1e-5)
