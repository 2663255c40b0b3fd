"""Token sampling on the device, with per-row parameters inside one batch.

Each row's randomness comes from its own key, fold_in(key(seed), number of tokens generated
so far), so a seeded request reproduces its output whatever else shares the batch.
Logprobs are of the model's raw distribution (as vLLM returns by default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from splash_jax.engine.penalties import PenaltyState, process_logits
from splash_jax.engine.request import MAX_LOGPROBS, SamplingLimits, SamplingParams


@dataclasses.dataclass(frozen=True)
class SamplerWidths:
    """Columns of the per-row id arrays, fixed per engine so no request changes a program's shapes."""

    num_suppress: int  # EOS ids + SamplingLimits.max_stop_token_ids
    num_bias: int  # SamplingLimits.max_logit_bias

    @classmethod
    def of(cls, limits: SamplingLimits, num_eos_ids: int) -> "SamplerWidths":
        return cls(limits.max_stop_token_ids + num_eos_ids, limits.max_logit_bias)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    """Per-row sampling controls. The fields after `step` are None only while an engine build
    does not pass them yet (then suppress, logit_bias, penalties and min_p are off)."""

    temperature: jax.Array  # [R] float32, 0 = greedy
    top_k: jax.Array  # [R] int32, 0 = off
    top_p: jax.Array  # [R] float32
    seed: jax.Array  # [R] uint32 (low 32 bits of the seed)
    step: jax.Array  # [R] int32, tokens generated so far by the row's request
    slot: jax.Array | None = None  # [R] int32, the request's PenaltyState row
    presence: jax.Array | None = None  # [R] float32, 0 = off
    frequency: jax.Array | None = None  # [R] float32, 0 = off
    repetition: jax.Array | None = None  # [R] float32, 1 = off
    min_p: jax.Array | None = None  # [R] float32, 0 = off
    suppress_ids: jax.Array | None = None  # [R, K] int32, -1 = none: masked to -inf this step (min_tokens)
    bias_ids: jax.Array | None = None  # [R, B] int32, -1 = none
    bias_values: jax.Array | None = None  # [R, B] float32
    target: jax.Array | None = None  # [R] int32: the token whose logprob the row returns (-1 = the sampled one; prompt logprobs)
    draft: jax.Array | None = None  # [R] int32: a speculative draft the row verifies (-1 = none)

    @classmethod
    def host(cls, n: int, widths: SamplerWidths | None = None) -> "SamplingInputs":
        """Neutral numpy inputs for n rows (fill rows with `set_row`)."""
        base = (np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.uint32), np.zeros(n, np.int32))
        if widths is None:
            return cls(*base)
        return cls(
            *base, np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.float32), np.ones(n, np.float32),
            np.zeros(n, np.float32), np.full((n, widths.num_suppress), -1, np.int32),
            np.full((n, widths.num_bias), -1, np.int32), np.zeros((n, widths.num_bias), np.float32),
            np.full(n, -1, np.int32), np.full(n, -1, np.int32),
        )

    @classmethod
    def abstract(cls, n: int, widths: SamplerWidths | None, sharding=None) -> "SamplingInputs":
        """Shapes and dtypes (for ahead-of-time lowering)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), cls.host(n, widths))

    def set_row(
        self, i: int, params: SamplingParams, seed: int, num_generated: int, slot: int = 0,
        eos_ids: Collection[int] = (),
    ) -> None:
        """Fill row i (host arrays) from a request's parameters at this step."""
        self.temperature[i] = params.temperature
        self.top_k[i] = max(params.top_k, 0)
        self.top_p[i] = params.top_p
        self.seed[i] = seed & 0xFFFFFFFF
        self.step[i] = num_generated
        if self.slot is None:
            return
        self.slot[i] = slot
        self.presence[i] = params.presence_penalty
        self.frequency[i] = params.frequency_penalty
        self.repetition[i] = params.repetition_penalty
        self.min_p[i] = params.min_p
        self.suppress_ids[i] = -1
        if num_generated < params.min_tokens:
            ids = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(eos_ids))
            self.suppress_ids[i, : len(ids)] = ids
        self.bias_ids[i] = -1
        if params.logit_bias:
            k = len(params.logit_bias)
            self.bias_ids[i, :k] = np.fromiter(params.logit_bias.keys(), np.int32, k)
            self.bias_values[i, :k] = np.fromiter(params.logit_bias.values(), np.float32, k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: jax.Array  # [N] int32
    logprob: jax.Array  # [N] float32, of the chosen token
    top_ids: jax.Array  # [N, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [N, MAX_LOGPROBS] float32


def _min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens whose probability is below min_p x the row's highest (after temperature)."""
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(keep, scaled, -jnp.inf)


def _top_k_top_p(scaled: jax.Array, s: SamplingInputs) -> jax.Array:
    """Mask everything outside each row's top-k and top-p set (one sort of the vocabulary; only in
    steps whose rows filter, see SamplerMode)."""
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    # top-k: drop everything below the k-th largest value.
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    # top-p: the smallest prefix of the sorted distribution whose mass reaches top_p.
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (mass_before < s.top_p[:, None]) | (s.top_p[:, None] >= 1.0)  # float32 mass can reach 1 early
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= jnp.maximum(kth, cutoff), scaled, -jnp.inf)


def _tempered(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    return logits / jnp.maximum(s.temperature, 1e-6)[:, None]


def filter_logits(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """Temperature, then min_p, then top-k and top-p (vLLM v1's order). Neutral rows pass through."""
    scaled = _tempered(logits, s)
    if s.min_p is not None:
        scaled = _min_p(scaled, s.min_p)
    return _top_k_top_p(scaled, s)


def _draw(logits: jax.Array, s: SamplingInputs, filtered: bool = True) -> jax.Array:
    """One token per row from its own key. filtered=False: temperature only (every row of the step
    has min_p, top_k and top_p off, so the filter would keep everything).

    A row verifying a draft d (s.draft >= 0; engine/speculative.py) keeps d with probability p(d)
    under the row's final distribution p, else draws from p with d removed: speculative sampling's
    rejection rule for a draft distribution that is all on d, so the token still follows p. A row
    without a draft draws exactly as it would without speculation (same key, same result)."""
    def draw(seed, step, row, d):
        key = jax.random.fold_in(jax.random.key(seed), step)
        p_d = jnp.exp(row[jnp.maximum(d, 0)] - jax.nn.logsumexp(row))
        keep = (d >= 0) & (jax.random.uniform(jax.random.fold_in(key, 1)) < p_d)
        token = jax.random.categorical(key, jnp.where(jnp.arange(row.shape[0]) == d, -jnp.inf, row))
        return jnp.where(keep, d, token)

    scaled = filter_logits(logits, s) if filtered else _tempered(logits, s)
    draft = s.draft if s.draft is not None else jnp.full(scaled.shape[0], -1, jnp.int32)
    return jax.vmap(draw)(s.seed, s.step, scaled, draft).astype(jnp.int32)


def needs_full(params: SamplingParams) -> bool:
    """Whether a request needs the full sampler: a random draw, top-n logprobs, penalties or a
    grammar's token mask."""
    return (params.temperature > 0 or bool(params.logprobs) or params.uses_penalties
            or params.structured_outputs is not None)


def apply_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear in the row's packed int32 mask ([R, ceil(V/32)]) go to -inf."""
    vocab = logits.shape[-1]
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    keep = bits.reshape(mask.shape[0], -1)[:, :vocab].astype(bool)
    return jnp.where(keep, logits, -jnp.inf)


@dataclasses.dataclass(frozen=True, order=True)
class SamplerMode:
    """The vocabulary-wide work a full sampler program does beyond penalties and the draw. Each
    costs a sort-like pass over every row (an H200, batch 128, 102K vocabulary: ~1 ms each, 7% of
    a decode step), so the host picks the least mode that serves every row of the step."""

    filter: bool = True  # min_p / top-k / top-p masks before the draw (a sort of every row)
    top_logprobs: bool = True  # the MAX_LOGPROBS best logprobs of every row (a top-k of every row)

    @classmethod
    def serving(cls, params: Iterable[SamplingParams]) -> "SamplerMode":
        """The least mode that gives every request of a step what it asked for."""
        filt = top = False
        for p in params:
            filt = filt or (p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0))
            top = top or bool(p.logprobs)
        return cls(filt, top)


SAMPLER_MODES = tuple(SamplerMode(f, t) for f in (False, True) for t in (False, True))
FULL_MODE = SamplerMode()


def sample(logits: jax.Array, s: SamplingInputs, penalties: PenaltyState | None = None, full: bool = True,
           mode: SamplerMode = FULL_MODE, mask: jax.Array | None = None) -> SampleOutput:
    """Suppress and logit_bias always; with `full` also penalties, the random draw (rows with
    temperature > 0), and what `mode` asks for: the draw's min_p/top-k/top-p filter and top-n
    logprobs (without them a draw samples the whole tempered distribution and top-n comes back
    as zeros). `full` and `mode` are static: the host knows every row's parameters and picks the
    program, so the step has no lax.cond (on GPUs a conditional stops the host until its predicate
    is known, which serializes host and device). Logprobs stay those of the raw model
    distribution. penalties=None: no penalties. mask: [R, ceil(V/32)] int32 token bitmask (grammars),
    applied after penalties and bias, before the draw; rows without a grammar pass all ones.
    A row with `target` >= 0 returns that token's logprob instead of the sampled one's."""
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = process_logits(logits, s, penalties if full else None)
    if mask is not None:
        logits = apply_mask(logits, mask)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    rows, k = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])
    top_lp, top_ids = jnp.zeros((rows, k), jnp.float32), jnp.zeros((rows, k), jnp.int32)
    if full:
        tokens = jnp.where(s.temperature > 0, _draw(logits, s, mode.filter), tokens)
        if mode.top_logprobs:
            top_lp, top_ids = jax.lax.top_k(logprobs, k)
    scored = tokens if s.target is None else jnp.where(s.target >= 0, s.target, tokens)
    chosen = jnp.take_along_axis(logprobs, scored[:, None], axis=-1)[:, 0]
    return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_lp)
