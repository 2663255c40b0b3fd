"""Rotary embedding of MLA's decoupled rope key/query (default RoPE and DeepSeek YaRN).

Frequencies are computed once on the host in float64 numpy (they depend only on the config);
inside the step only a gather of cos/sin rows by position happens.

Output order: DeepSeek rotates interleaved pairs (x0,x1),(x2,x3)...; like transformers'
DeepseekV3 we emit the rotated pairs as [first elements..., second elements...] ("split" order).
Dot products are identical to the interleaved order, so only the cached rope key's column
order is a convention; everything in this engine (kernels included) uses split order.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from splash_jax.model_config import RopeConfig, yarn_mscale


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] and the cos/sin multiplier ("attention factor")."""
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if rope.type == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1.0 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    if rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)
    return inv_freq.astype(np.float32), float(factor)


def rope_table(rope: RopeConfig, dim: int, max_positions: int) -> np.ndarray:
    """[max_positions, dim] table: cos in the first dim/2 columns, sin in the rest."""
    inv_freq, factor = inverse_frequencies(rope, dim)
    freqs = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(freqs) * factor, np.sin(freqs) * factor], axis=-1).astype(np.float32)


def apply_rope(x: jnp.ndarray, cos_sin: jnp.ndarray, interleaved: bool) -> jnp.ndarray:
    """Rotate x [..., T, (heads,) dim] by cos_sin rows [T, dim] gathered for its positions.

    `x` has its token axis at position 0 and an optional head axis at 1.
    """
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    if x.ndim == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
