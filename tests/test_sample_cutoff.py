"""The sampler's sort-free top-k / top-p cut-off (pallas_kernels/sample_cutoff.py) against the
sort's definition in float64 numpy: interpret mode on CPU, the Triton kernel on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sample_cutoff


def reference_keep(x: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Sort each row (float64): keep the k largest and the shortest prefix reaching top_p,
    every entry tied with the last kept one too."""
    x = x.astype(np.float64)
    order = np.argsort(-x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, axis=-1)
    vocab = x.shape[-1]
    k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    kth = xs[np.arange(len(x)), k - 1]
    p = np.exp(xs - xs[:, :1])
    p /= p.sum(-1, keepdims=True)
    before = np.cumsum(p, -1) - p
    keep = (before < top_p[:, None]) | (top_p[:, None] >= 1)
    cutoff = np.where(keep, xs, np.inf).min(-1)
    return x >= np.maximum(kth, cutoff)[:, None]


def cases(rows: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    x = (rng.normal(0, 3, (rows, vocab)) * 8).round() / 8  # many exact ties
    x = x.astype(np.float32)
    x[1, : vocab // 2] = -np.inf  # half the vocabulary suppressed
    x[2] = 0.0
    x[2, :7] = -0.0  # -0.0 and +0.0 are one value
    x[3] = -np.inf
    x[3, 5] = 2.0  # one live entry
    top_k = rng.integers(1, vocab + 1, rows).astype(np.int32)
    top_k[::3] = 0  # off
    top_k[4] = vocab + 0  # all
    top_p = rng.uniform(0.05, 0.99, rows).astype(np.float32)
    top_p[::4] = 1.0  # off
    return x, top_k, top_p


def check(x, top_k, top_p, interpret):
    cut = jax.jit(lambda a, b, c: sample_cutoff.top_k_top_p_cutoff(a, b, c, interpret=interpret))(
        jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p))
    got = x >= np.asarray(cut)[:, None]
    want = reference_keep(x, top_k, top_p)
    for r in np.where((got != want).any(-1))[0]:
        # only a float32 rounding of the mass at the top-p boundary may keep one tie group more or less
        mass = np.exp(x[r].astype(np.float64) - x[r].max())
        mass /= mass.sum()
        above = lambda keep: mass[keep & (x[r] > x[r][keep].min())].sum()
        assert min(abs(above(got[r]) - top_p[r]), abs(above(want[r]) - top_p[r])) < 1e-5, r
    return got, want


@pytest.mark.parametrize("seed", range(3))
def test_cutoff_keeps_what_a_sort_keeps(seed):
    x, top_k, top_p = cases(rows=12, vocab=5000, seed=seed)  # 5000: padded to two 4096-entry chunks
    got, want = check(x, top_k, top_p, interpret=True)
    assert (got == want).mean() > 0.999


def test_order_keys_sort_like_the_floats():
    x = np.array([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.inf], np.float32)
    keys = np.asarray(sample_cutoff.order_keys(jnp.asarray(x)))
    assert (np.diff(keys.astype(np.int64)) >= 0).all() and keys[3] == keys[4] and (np.diff(keys)[[0, 1, 2, 4, 5, 6]] > 0).all()
    np.testing.assert_array_equal(np.asarray(sample_cutoff.key_values(jnp.asarray(keys))), np.where(x == 0, 0, x))


@pytest.mark.gpu
def test_cutoff_kernel_on_gpu_at_serving_sizes():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    x, top_k, top_p = cases(rows=64, vocab=102400, seed=7)
    x = x + np.random.default_rng(1).normal(0, 1e-3, x.shape).astype(np.float32)  # few ties at this size
    got, want = check(x, top_k, top_p, interpret=False)
    assert (got == want).mean() > 0.9999
