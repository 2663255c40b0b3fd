"""Token history on the device, and the logit processors that read it (vLLM v1 semantics).

`PenaltyState` keeps, per request slot (S = max_num_seqs), which tokens occur in the prompt
and how often each token was generated. It lives on the device and is donated through the
step, so penalties never copy histories between host and device: every token the step feeds to
the model updates its slot before sampling (`update_history`). A decode step feeds the token
sampled last, so at sampling time the counts hold exactly the outputs so far; a request that
recomputes after preemption re-feeds prompt + outputs from position 0, which rebuilds its row.

Processors, in vLLM v1's order (all exact; penalties only in the `full` sampler program, which
the host picks when some row of the step needs it):
  suppress (min_tokens: EOS and stop_token_ids -> -inf) -> logit_bias (added) ->
  repetition (prompt + output tokens: positive logits / p, negative x p) ->
  frequency (- f x count in the output) -> presence (- p if in the output).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyState:
    prompt_mask: jax.Array  # [S, V] bool: the token occurs in the slot's prompt
    output_counts: jax.Array  # [S, V] int32: times the slot's request generated the token

    @classmethod
    def zeros(cls, num_slots: int, vocab: int, sharding=None) -> "PenaltyState":
        state = cls(jnp.zeros((num_slots, vocab), jnp.bool_), jnp.zeros((num_slots, vocab), jnp.int32))
        return jax.device_put(state, sharding) if sharding is not None else state

    @property
    def num_slots(self) -> int:
        return self.output_counts.shape[0]


def update_history(
    state: PenaltyState, tokens: jax.Array, positions: jax.Array, token_slot: jax.Array, prompt_len: jax.Array
) -> PenaltyState:
    """Add the step's fed tokens (all [T]; token_slot -1 = padding) to their slots' histories.

    A slot fed a token at position 0 is cleared first (a new request, or a recompute after
    preemption); then prompt positions (< prompt_len) mark the prompt mask and the others count
    as outputs. Duplicates within one step accumulate (scatter-add)."""
    num_slots = state.num_slots
    valid = token_slot >= 0
    slot = jnp.where(valid, token_slot, num_slots)  # out of range: dropped by the scatters
    starts = jnp.zeros(num_slots, jnp.bool_).at[jnp.where(positions == 0, slot, num_slots)].set(True, mode="drop")

    # No lax.cond: on GPUs a conditional makes the host wait for its predicate mid-step.
    state = PenaltyState(state.prompt_mask & ~starts[:, None], jnp.where(starts[:, None], 0, state.output_counts))
    in_prompt = positions < prompt_len
    prompt_mask = state.prompt_mask.at[jnp.where(in_prompt, slot, num_slots), tokens].set(True, mode="drop")
    counts = state.output_counts.at[jnp.where(in_prompt, num_slots, slot), tokens].add(1, mode="drop")
    return PenaltyState(prompt_mask, counts)


def _row_ids(ids: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Scatter indices for [R, K] token ids where -1 = none (negative indices would wrap)."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    return rows, jnp.where(ids >= 0, ids, vocab)


def suppress(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Mask each row's ids ([R, K], -1 = none) to -inf."""
    rows, cols = _row_ids(ids, logits.shape[-1])
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


def add_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    rows, cols = _row_ids(ids, logits.shape[-1])
    return logits.at[rows, cols].add(values, mode="drop")


def penalize(
    logits: jax.Array, state: PenaltyState, slot: jax.Array, presence: jax.Array, frequency: jax.Array,
    repetition: jax.Array,
) -> jax.Array:
    """Repetition, frequency and presence penalties for rows [R] reading their slots' histories.
    Neutral rows (0, 0, 1) come out bit-identical."""
    slot = jnp.clip(slot, 0, state.num_slots - 1)
    counts = state.output_counts[slot]
    generated = counts > 0
    seen = state.prompt_mask[slot] | generated
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts.astype(logits.dtype) - presence[:, None] * generated.astype(logits.dtype)


def process_logits(logits: jax.Array, s, state: PenaltyState | None) -> jax.Array:
    """Everything that changes which token wins before temperature, in vLLM v1's order.
    `s` is a SamplingInputs; fields it lacks (None) and a missing state are skipped. Runs
    unconditionally (no lax.cond: the host picks a program without penalties when no row uses
    them, see sampler.sample)."""
    if s.suppress_ids is not None:
        logits = suppress(logits, s.suppress_ids)
    if s.bias_ids is not None:
        logits = add_bias(logits, s.bias_ids, s.bias_values)
    if state is not None and s.slot is not None:
        logits = penalize(logits, state, s.slot, s.presence, s.frequency, s.repetition)
    return logits
