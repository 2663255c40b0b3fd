"""Small building blocks shared by the attention and MoE modules: params, RMSNorm, SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


LATENT_NORM_EPS = 1e-6  # q_a / kv_a norms use DeepSeek's default eps, not config.rms_norm_eps


def init_param(rngs: nnx.Rngs | None, shape, dtype, std=0.02, ones=False) -> nnx.Param:
    if ones:
        return nnx.Param(jnp.ones(shape, dtype))
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs=None):
        self.weight = init_param(rngs, (dim,), dtype, ones=True)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    """SwiGLU feed-forward: dense layers and DeepSeek's shared experts."""

    def __init__(self, hidden: int, inter: int, dtype, rngs):
        self.gate = init_param(rngs, (hidden, inter), dtype)
        self.up = init_param(rngs, (hidden, inter), dtype)
        self.down = init_param(rngs, (inter, hidden), dtype)

    def __call__(self, x):
        h = jax.nn.silu(x @ self.gate[...]) * (x @ self.up[...])
        return h @ self.down[...]


LOGITS_MIN_ROWS = 8


def logits_dot(h: jax.Array, head: jax.Array) -> jax.Array:
    """h [M, D] @ head [D, V] -> float32 logits. Fewer than LOGITS_MIN_ROWS rows are padded to it:
    on GPUs XLA turns a one-row product with bf16 inputs and a float32 result into converting the
    whole head to float32, a transpose and a float32 GEMV (0.68 ms per step for V2-Lite's 2048 x
    102400 head on an H200, 12% of a batch-1 step), where a GEMM reads the head once in bf16."""
    m = h.shape[0]
    if m < LOGITS_MIN_ROWS:
        h = jnp.pad(h, ((0, LOGITS_MIN_ROWS - m), (0, 0)))
    return jnp.dot(h, head, preferred_element_type=jnp.float32)[:m]
