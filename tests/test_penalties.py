"""Penalties, logit_bias, min_tokens suppression and min_p on the device, against a plain numpy
implementation of the same rules (vLLM v1 / OpenAI semantics), on random logits; the token
history through a sequence of steps: prefill chunks, decodes, a reused slot, a recompute."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from splash_jax.engine.penalties import PenaltyState, process_logits, update_history
from splash_jax.engine.request import SamplingParams
from splash_jax.engine.sampler import FULL_MODE, SamplerMode, SamplerWidths, SamplingInputs, filter_logits, sample

V, S = 64, 4
WIDTHS = SamplerWidths(num_suppress=4, num_bias=5)
EOS = (3,)


# --- the numpy reference -----------------------------------------------------------------
def ref_process(logits: np.ndarray, params: SamplingParams, prompt: list[int], outputs: list[int]) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    if len(outputs) < params.min_tokens:
        for t in list(params.stop_token_ids) + ([] if params.ignore_eos else list(EOS)):
            x[t] = -np.inf
    for t, b in params.logit_bias.items():
        x[t] += b
    counts = collections.Counter(outputs)
    for t in range(len(x)):
        if t in counts or t in prompt:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * counts[t] + params.presence_penalty * (counts[t] > 0)
    return x


def ref_filter(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    x = x / max(params.temperature, 1e-6)
    if params.min_p > 0:
        p = np.exp(x - x.max())
        p /= p.sum()
        x = np.where(p >= params.min_p * p.max(), x, -np.inf)
    order = np.argsort(-x, kind="stable")
    keep = np.ones(len(x), bool)
    if params.top_k > 0:
        keep[order[params.top_k :]] = False
    if params.top_p < 1:
        p = np.exp(x[order] - x[order][0])
        p /= p.sum()
        before = np.cumsum(p) - p
        keep[order[before >= params.top_p]] = False
    threshold = x[keep].min()  # ties with the last kept value stay (as on the device)
    return np.where(x >= threshold, x, -np.inf)


def random_params(rng: np.random.Generator) -> SamplingParams:
    def maybe(value, default):
        return value if rng.random() < 0.6 else default

    bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.choice(V, rng.integers(0, WIDTHS.num_bias + 1), replace=False)}
    return SamplingParams(
        max_tokens=50,
        temperature=float(maybe(rng.uniform(0.3, 2.0), 0.0)),
        top_k=int(maybe(rng.integers(1, V), 0)),
        top_p=float(maybe(rng.uniform(0.3, 1.0), 1.0)),
        min_p=float(maybe(rng.uniform(0.0, 0.3), 0.0)),
        presence_penalty=float(maybe(rng.uniform(-2, 2), 0.0)),
        frequency_penalty=float(maybe(rng.uniform(-2, 2), 0.0)),
        repetition_penalty=float(maybe(rng.uniform(0.5, 2.0), 1.0)),
        min_tokens=int(maybe(rng.integers(0, 8), 0)),
        stop_token_ids=[int(t) for t in rng.choice(V, rng.integers(0, 3), replace=False)],
        ignore_eos=bool(rng.random() < 0.3),
        logit_bias=maybe(bias, {}),
    )


def state_of(histories: dict[int, tuple[list[int], list[int]]]) -> PenaltyState:
    prompt_mask, counts = np.zeros((S, V), bool), np.zeros((S, V), np.int32)
    for slot, (prompt, outputs) in histories.items():
        prompt_mask[slot, prompt] = True
        np.add.at(counts[slot], outputs, 1)
    return PenaltyState(jnp.asarray(prompt_mask), jnp.asarray(counts))


# --- processors -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_processed_and_filtered_logits_match_numpy(seed):
    rng = np.random.default_rng(seed)
    rows = 6
    logits = rng.normal(0, 3, (rows, V)).astype(np.float32)
    params = [random_params(rng) for _ in range(rows)]
    slots = rng.integers(0, S, rows)
    histories = {int(s): ([int(t) for t in rng.integers(0, V, 10)], [int(t) for t in rng.integers(0, V, rng.integers(0, 12))])
                 for s in range(S)}
    s = SamplingInputs.host(rows, WIDTHS)
    for i, p in enumerate(params):
        s.set_row(i, p, seed=i, num_generated=len(histories[int(slots[i])][1]), slot=int(slots[i]), eos_ids=EOS)
    processed = np.asarray(jax.jit(process_logits)(jnp.asarray(logits), s, state_of(histories)))
    filtered = np.asarray(jax.jit(filter_logits)(jnp.asarray(processed), s))
    for i, p in enumerate(params):
        prompt, outputs = histories[int(slots[i])]
        want = ref_process(logits[i], p, prompt, outputs)
        np.testing.assert_allclose(processed[i], want, rtol=1e-6, atol=1e-4)
        want_filtered = ref_filter(want, p)
        assert (np.isinf(filtered[i]) == np.isinf(want_filtered)).all(), (i, p)
        finite = np.isfinite(want_filtered)
        np.testing.assert_allclose(filtered[i][finite], want_filtered[finite], rtol=1e-5, atol=1e-4)


def test_sample_draws_from_the_processed_distribution():
    """Greedy rows take the reference argmax; sampled rows equal a draw with the row's own key from
    the reference-filtered logits; logprobs are those of the raw logits."""
    rng = np.random.default_rng(7)
    rows = 16
    logits = rng.normal(0, 3, (rows, V)).astype(np.float32)
    params = [random_params(rng) for _ in range(rows)]
    histories = {s: ([int(t) for t in rng.integers(0, V, 6)], [int(t) for t in rng.integers(0, V, 5)]) for s in range(S)}
    s = SamplingInputs.host(rows, WIDTHS)
    for i, p in enumerate(params):
        s.set_row(i, p, seed=1000 + i, num_generated=5, slot=i % S, eos_ids=EOS)
    out = jax.jit(sample)(jnp.asarray(logits), s, state_of(histories))
    tokens = np.asarray(out.tokens)
    for i, p in enumerate(params):
        x = ref_process(logits[i], p, *histories[i % S])
        if p.temperature == 0:
            assert tokens[i] == np.argmax(x)
        else:
            allowed = ref_filter(x, p)
            key = jax.random.fold_in(jax.random.key(1000 + i), 5)
            assert np.isfinite(allowed[tokens[i]])
            assert tokens[i] == int(jax.random.categorical(key, jnp.asarray(allowed, jnp.float32)))
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(np.asarray(out.logprob), raw[np.arange(rows), tokens], rtol=1e-6)


def test_neutral_rows_and_no_state_are_unchanged():
    """Without penalty state, or with every row neutral, sampling is bit-identical to plain sampling."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(0, 3, (5, V)).astype(np.float32))
    plain = SamplingInputs.host(5)
    extended = SamplingInputs.host(5, WIDTHS)
    for i in range(5):
        p = SamplingParams(temperature=0.7 * (i % 2), top_p=0.9, seed=i)
        plain.set_row(i, p, seed=i, num_generated=2)
        extended.set_row(i, p, seed=i, num_generated=2, slot=i % S, eos_ids=EOS)
    state = state_of({0: ([1, 2, 3], [4, 4])})
    a, b = jax.jit(sample)(logits, plain), jax.jit(sample)(logits, extended, state)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.array_equal(np.asarray(process_logits(logits, extended, state)), np.asarray(logits))


def test_serving_mode_is_the_least_that_serves_every_row():
    off = SamplerMode(filter=False, top_logprobs=False)
    assert SamplerMode.serving([]) == off
    assert SamplerMode.serving([SamplingParams(temperature=1.0), SamplingParams(logprobs=0)]) == off
    assert SamplerMode.serving([SamplingParams(top_p=0.5)]) == off  # greedy rows never draw
    for p in (SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=1.0, min_p=0.1)):
        assert SamplerMode.serving([SamplingParams(), p]) == SamplerMode(filter=True, top_logprobs=False)
    assert SamplerMode.serving([SamplingParams(logprobs=2)]) == SamplerMode(filter=False, top_logprobs=True)


@pytest.mark.parametrize("mode", [SamplerMode(False, False), SamplerMode(False, True), SamplerMode(True, False)])
def test_a_lighter_sampler_mode_gives_the_full_modes_results_for_the_rows_it_serves(mode):
    """Rows that need neither a filter nor top-n (the rows a lighter mode is picked for) get the
    full sampler's tokens and logprobs bit for bit; top-n comes back as zeros when not computed."""
    rng = np.random.default_rng(5)
    rows = 12
    logits = jnp.asarray(rng.normal(0, 3, (rows, V)).astype(np.float32))
    s = SamplingInputs.host(rows, WIDTHS)
    params = [random_params(rng) for _ in range(rows)]
    for i, p in enumerate(params):
        p.top_k, p.top_p, p.min_p = 0, 1.0, 0.0  # what a step in a non-filtering mode holds
        s.set_row(i, p, seed=50 + i, num_generated=3, slot=i % S, eos_ids=EOS)
    state = state_of({k: ([1, 2], [3, 5, 5]) for k in range(S)})
    full = jax.jit(lambda x: sample(x, s, state, mode=FULL_MODE))(logits)
    light = jax.jit(lambda x: sample(x, s, state, mode=mode))(logits)
    assert any(p.temperature > 0 for p in params) and any(p.temperature == 0 for p in params)
    np.testing.assert_array_equal(np.asarray(light.tokens), np.asarray(full.tokens))
    np.testing.assert_array_equal(np.asarray(light.logprob), np.asarray(full.logprob))
    if mode.top_logprobs:
        np.testing.assert_array_equal(np.asarray(light.top_ids), np.asarray(full.top_ids))
    else:
        assert not np.asarray(light.top_ids).any() and not np.asarray(light.top_logprobs).any()


def test_min_tokens_suppresses_until_reached():
    logits = np.zeros((1, V), np.float32)
    logits[0, EOS[0]], logits[0, 9] = 10.0, 5.0
    p = SamplingParams(min_tokens=3, stop_token_ids=[9])
    for generated, expected in ((0, 0), (2, 0), (3, EOS[0])):  # token 0: the next best once 3 and 9 are gone
        s = SamplingInputs.host(1, WIDTHS)
        s.set_row(0, p, seed=0, num_generated=generated, eos_ids=EOS)
        assert int(sample(jnp.asarray(logits), s).tokens[0]) == expected


# --- the history through steps ----------------------------------------------------------------
class ReferenceHistory:
    """Per slot: the prompt tokens and the output tokens fed since its last position 0."""

    def __init__(self):
        self.prompt = {s: set() for s in range(S)}
        self.outputs = {s: collections.Counter() for s in range(S)}

    def feed(self, slot: int, token: int, position: int, prompt_len: int):
        if position == 0:
            self.prompt[slot], self.outputs[slot] = set(), collections.Counter()
        if position < prompt_len:
            self.prompt[slot].add(token)
        else:
            self.outputs[slot][token] += 1

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        mask, counts = np.zeros((S, V), bool), np.zeros((S, V), np.int32)
        for s in range(S):
            mask[s, list(self.prompt[s])] = True
            for t, c in self.outputs[s].items():
                counts[s, t] = c
        return mask, counts


def test_history_through_prefill_chunks_decodes_slot_reuse_and_recompute():
    rng = np.random.default_rng(11)
    T = 12
    # Requests: slot, prompt, outputs generated over time.
    prompt_a, prompt_b, prompt_c = (list(map(int, rng.integers(0, V, n))) for n in (9, 4, 6))
    outs_a, outs_b = list(map(int, rng.integers(0, V, 6))), list(map(int, rng.integers(0, V, 3)))
    # Each step: (slot, tokens, first position, prompt_len) chunks.
    steps = [
        [(0, prompt_a[:6], 0, 9), (1, prompt_b, 0, 4)],  # A's first prefill chunk; B's whole prompt
        [(0, prompt_a[6:], 6, 9), (1, outs_b[:1], 4, 4)],  # A's last chunk; B decodes
        [(0, outs_a[:1], 9, 9), (1, outs_b[1:2], 5, 4)],
        [(0, outs_a[1:2], 10, 9), (1, outs_b[2:3], 6, 4)],  # duplicates possible: counts accumulate
        [(0, outs_a[2:3], 11, 9), (1, prompt_c[:5], 0, 6)],  # B finished; C reuses slot 1
        [(0, (prompt_a + outs_a[:3])[:8], 0, 9), (1, prompt_c[5:], 5, 6)],  # A preempted: recompute
        [(0, (prompt_a + outs_a[:3])[8:], 8, 9), (1, outs_a[3:4], 6, 6)],
        [(0, outs_a[3:5] + outs_a[3:5], 12, 9)],  # two copies of the same tokens in one step
    ]
    state = PenaltyState.zeros(S, V)
    reference = ReferenceHistory()
    update = jax.jit(update_history)
    for step in steps:
        tokens, positions, slots, prompt_lens = (np.full(T, -1 if k == 2 else 0, np.int32) for k in range(4))
        i = 0
        for slot, toks, start, plen in step:
            for j, tok in enumerate(toks):
                position = start + j if step is not steps[-1] else start + j % 2
                tokens[i], positions[i], slots[i], prompt_lens[i] = tok, position, slot, plen
                reference.feed(slot, tok, position, plen)
                i += 1
        tokens[i:] = rng.integers(0, V, T - i)  # padding rows carry junk: must be ignored
        positions[i:] = 0
        state = update(state, *map(jnp.asarray, (tokens, positions, slots, prompt_lens)))
        mask, counts = reference.state()
        np.testing.assert_array_equal(np.asarray(state.prompt_mask), mask)
        np.testing.assert_array_equal(np.asarray(state.output_counts), counts)
    assert np.asarray(state.output_counts)[0].sum() == 3 + 4  # recomputed outputs, then two decodes twice
