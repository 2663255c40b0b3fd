"""Comparing an attention kernel's (out, lse) with the XLA reference's, shared by the kernel tests."""

import numpy as np


def assert_attention_matches(got, want, seed, tol=2e-5):
    """out within tol and finite; lse -inf exactly where the reference's is (tokens with no KV), else within tol."""
    out, lse = (np.asarray(x, np.float32) for x in got)
    ref_out, ref_lse = (np.asarray(x, np.float32) for x in want)
    assert np.isfinite(out).all(), f"seed {seed}: non-finite output"
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg=f"seed {seed}")
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol, err_msg=f"seed {seed}")
