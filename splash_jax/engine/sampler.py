"""Token sampling on the device, with per-row parameters inside one batch.

Each row's randomness comes from its own key, fold_in(key(seed), number of tokens generated
so far), so a seeded request reproduces its output whatever else shares the batch.
Logprobs are of the model's raw distribution (as vLLM returns by default).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from splash_jax.engine.request import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    temperature: jax.Array  # [N] float32, 0 = greedy
    top_k: jax.Array  # [N] int32, 0 = off
    top_p: jax.Array  # [N] float32
    seed: jax.Array  # [N] uint32 (low 32 bits of the seed)
    step: jax.Array  # [N] int32, tokens generated so far by the row's request

    @classmethod
    def host(cls, n: int) -> "SamplingInputs":
        return cls(
            np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32),
            np.zeros(n, np.uint32), np.zeros(n, np.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: jax.Array  # [N] int32
    logprob: jax.Array  # [N] float32, of the chosen token
    top_ids: jax.Array  # [N, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [N, MAX_LOGPROBS] float32


def _filtered(scaled: jax.Array, s: SamplingInputs) -> jax.Array:
    """Mask everything outside each row's top-k and top-p set (one sort of the vocabulary)."""
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    # top-k: drop everything below the k-th largest value.
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    # top-p: the smallest prefix of the sorted distribution whose mass reaches top_p.
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < s.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= jnp.maximum(kth, cutoff), scaled, -jnp.inf)


def _draw(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    needs_filter = jnp.any((s.top_k > 0) | (s.top_p < 1.0))
    masked = jax.lax.cond(needs_filter, _filtered, lambda x, _: x, scaled, s)

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row)

    return jax.vmap(draw)(s.seed, s.step, masked).astype(jnp.int32)


def sample(logits: jax.Array, s: SamplingInputs) -> SampleOutput:
    """Greedy rows take the argmax; the vocabulary sort and the random draw run only when some row
    of the batch needs them (lax.cond executes one branch on the device)."""
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = jax.lax.cond(jnp.any(s.temperature > 0), _draw, lambda l, _: greedy, logits, s)
    tokens = jnp.where(s.temperature > 0, sampled, greedy)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_lp)
