"""Speculative decoding against decoding one token per step: n-gram drafts, the acceptance rule,
the rejection sampler's distribution, and the engine's outputs with drafts (greedy equal token for
token, stops and max_tokens landing inside a verify chunk, logprobs, requests that do not
speculate). Layouts and live switches: tests/test_switching.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from splash_jax.compile_guard import count_compiles
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.sampler import SamplerMode, SamplerWidths, SamplingInputs, sample
from splash_jax.engine.speculative import accepted, ngram_draft
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.weights.loader import load_model

# Prompts whose continuations copy from themselves (code under edit, repeated lines), so n-gram
# drafts are accepted often, and one that does not repeat.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "import os\nimport sys\nimport os\nimport sys\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "The quick brown fox",
]


def test_ngram_draft_takes_the_latest_occurrence_of_the_longest_suffix():
    seq = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    # suffix [2, 3] occurs at 1 and 5 (and [4, 2, 3] nowhere before): the latest, at 5, continues 7, 8
    assert ngram_draft(seq, 2, 1, 3) == [7, 8]
    assert ngram_draft(seq, 5, 1, 3) == [7, 8, 4, 2, 3]
    assert ngram_draft(np.array([1, 2, 3]), 3, 1, 3) == []  # nothing repeats
    assert ngram_draft(np.array([4, 4]), 3, 1, 3) == [4]  # the continuation stops at the end
    assert ngram_draft(seq, 2, 3, 3) == []  # only 3-grams: [4, 2, 3] never occurred before


def test_acceptance_keeps_drafts_up_to_the_first_mismatch_and_one_more_token():
    assert accepted((7, 8, 9), [7, 8, 9, 4]) == [7, 8, 9, 4]  # all accepted: the bonus token too
    assert accepted((7, 8, 9), [7, 5, 9, 4]) == [7, 5]  # the correction replaces the rejected draft
    assert accepted((7,), [3, 4]) == [3]


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_follows_the_target_distribution(top_k):
    """Rows verifying a draft d keep d with p(d), else draw from p without d: over many seeds the
    tokens follow p (after temperature and top-k), whatever the draft (chi-square)."""
    vocab, rows = 6, 30000
    logits = jnp.asarray(np.log([0.05, 0.1, 0.15, 0.2, 0.25, 0.25]), jnp.float32)
    s = SamplingInputs.host(rows, SamplerWidths(1, 1))
    s.temperature[:] = 0.7
    s.top_k[:] = top_k
    s.seed[:] = np.arange(rows)
    s.draft[:] = np.arange(rows) % (vocab + 1) - 1  # -1 (no draft) and every token as a draft
    out = jax.jit(lambda x, s: sample(x, s, None, full=True, mode=SamplerMode(top_k > 0, False)))(
        jnp.broadcast_to(logits, (rows, vocab)), jax.tree.map(jnp.asarray, s))
    tokens = np.asarray(out.tokens)
    p = np.exp(np.asarray(logits) / 0.7)
    if top_k:
        p[np.argsort(p)[:-top_k]] = 0
    p /= p.sum()
    for d in range(-1, vocab):
        got = np.bincount(tokens[s.draft == d], minlength=vocab)
        keep = p > 0
        assert got[~keep].sum() == 0  # filtered tokens never appear, drafted or not
        chi2 = ((got[keep] - got.sum() * p[keep]) ** 2 / (got.sum() * p[keep])).sum()
        assert stats.chi2.sf(chi2, keep.sum() - 1) > 1e-3, (d, got, p)


@pytest.fixture(scope="module")
def engine():
    model = load_model(DEFAULT_MODEL, RuntimeOptions(dtype="float32", attention_impl="xla"))
    cfg = EngineConfig(page_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_pages=96, compile_cache_dir=None,
                       speculative_method="ngram", speculative_tokens=3)
    return Engine(cfg, model=model)


def _generate(engine, method, params, prompts=PROMPTS):
    engine.set_speculative(method)
    try:
        return engine.generate(prompts, params)
    finally:
        engine.set_speculative("ngram")


def test_greedy_outputs_equal_decoding_one_token_per_step(engine):
    params = [SamplingParams(max_tokens=m) for m in (40, 33, 27, 12)]
    want = _generate(engine, "off", params)
    engine.set_speculative("ngram")
    steps = engine.num_steps
    with count_compiles() as compiles:
        got = engine.generate(PROMPTS, params)
    spec = engine.stats()["speculative"]
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
    assert compiles.count == 0  # verify chunks run the warmed-up step programs
    assert spec["accepted_tokens"] > 0 and spec["verify_chunks"] > 0
    assert sum(spec["accepted_histogram"]) == spec["verify_chunks"]
    assert engine.num_steps - steps < max(len(w.token_ids) for w in want)  # fewer steps than tokens


@pytest.mark.parametrize("mode", ["late", "sync", "ahead"])
def test_ngram_drafts_late_bound_read_first_or_guessed_keep_outputs(engine, mode):
    """--speculative-ngram-drafts: sync reads the step in flight back first, so the steps
    that draft do not overlap; late packs a drafting step behind the step in flight and fills its
    drafts from that step's tokens before the launch, so every step overlaps; ahead drafts after a
    guess of its token. Greedy outputs equal decoding one token per step in every mode."""
    params = [SamplingParams(max_tokens=m) for m in (40, 33, 27, 12)]
    want = _generate(engine, "off", params)
    engine.set_speculative("ngram")
    engine.config.speculative_ngram_drafts = mode
    overlapped, step = [], engine.step

    def recording_step():
        out = step()
        overlapped.append(engine.overlapped)
        return out

    engine.step = recording_step
    try:
        got = engine.generate(PROMPTS, params)
    finally:
        del engine.step
        engine.config.speculative_ngram_drafts = EngineConfig.speculative_ngram_drafts
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    spec = engine.stats()["speculative"]
    assert spec["accepted_tokens"] > 0
    assert not all(overlapped) if mode == "sync" else all(overlapped)  # (level-0 steps overlap in every mode)
    assert (spec["late_bound_chunks"] > 0) == (mode == "late")


def test_late_bound_drafts_are_packed_as_a_step_packed_with_them(engine, monkeypatch):
    """The patched buffer of a late-bound step equals the buffer packed afresh from its chunks
    once they hold the late drafts (plain verify chunks: token slots and draft rows; ahead chunks:
    the variant of the count the step in flight kept), and the late drafts keep more per verify
    step than the guessed ones (fixed K = 3, no budget)."""
    from splash_jax.engine import device_steps, late_drafts

    checked, changed = [], []

    def binding_and_checking(shape, chunks, packed, tokens, drafter):
        before = packed.rep.copy()
        bound = late_drafts.bind_late_drafts(shape, chunks, packed, tokens, drafter)
        _, _, fresh = engine._pack(chunks)
        np.testing.assert_array_equal(packed.rep, fresh.rep)
        checked.append(bound)
        changed.append(int((before != packed.rep).sum()))
        return bound

    params = [SamplingParams(max_tokens=m) for m in (40, 33, 27, 12)]
    kept = {}
    engine.config.speculative_adaptive = False
    try:
        for mode in ("ahead", "late"):
            engine.set_speculative("ngram")
            engine.config.speculative_ngram_drafts = mode
            if mode == "late":
                monkeypatch.setattr(device_steps, "bind_late_drafts", binding_and_checking)
            engine.generate(PROMPTS, params)
            spec = engine.stats()["speculative"]
            kept[mode] = spec["accepted_tokens"] / spec["verify_chunks"]
    finally:
        engine.config.speculative_ngram_drafts = EngineConfig.speculative_ngram_drafts
        engine.config.speculative_adaptive = True
        engine.set_speculative("ngram")
    assert sum(checked) > 0 and sum(changed) > 0  # drafts were rewritten, and the patch matched a fresh pack
    assert kept["late"] > kept["ahead"], kept


def test_max_tokens_and_stops_landing_inside_a_verify_chunk(engine):
    base = _generate(engine, "off", SamplingParams(max_tokens=40))
    for i, w in enumerate(base[:3]):
        ids = w.token_ids
        # every max_tokens from 1 to 12: most end inside a chunk of several accepted tokens
        params = [SamplingParams(max_tokens=m) for m in range(1, 13)]
        got = engine.generate([PROMPTS[i]] * len(params), params)
        assert [g.token_ids for g in got] == [ids[:m] for m in range(1, 13)]
        # a stop token and a stop string from the middle of the output
        stop_id = ids[len(ids) // 2]
        got = engine.generate([PROMPTS[i]], SamplingParams(max_tokens=40, stop_token_ids=[stop_id]))[0]
        assert got.token_ids == ids[: ids.index(stop_id) + 1] and got.finish_reason == "stop"
        text = w.text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        got = engine.generate([PROMPTS[i]], SamplingParams(max_tokens=40, stop=[stop]))[0]
        assert got.text == text[: text.index(stop)] and got.finish_reason == "stop"
        assert engine.generate([PROMPTS[i]], SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True))[0].text == got.text


def test_logprobs_come_from_each_tokens_own_row(engine):
    params = SamplingParams(max_tokens=24, logprobs=3)
    want = _generate(engine, "off", params)
    before = engine.stats()["speculative"]["accepted_tokens"]
    got = engine.generate(PROMPTS, params)
    assert engine.stats()["speculative"]["accepted_tokens"] > before
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=2e-4)
        for a, b in zip(g.top_logprobs, w.top_logprobs):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=2e-4)


def test_penalties_and_min_tokens_run_as_without_speculation(engine):
    params = [SamplingParams(max_tokens=20, presence_penalty=0.5), SamplingParams(max_tokens=20, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, min_tokens=15), SamplingParams(max_tokens=20, logit_bias={204: 5.0})]
    want = _generate(engine, "off", params)
    before = engine.stats()["speculative"]
    got = engine.generate(PROMPTS, params)
    after = engine.stats()["speculative"]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert after["verify_chunks"] > before["verify_chunks"]  # min_tokens and logit_bias requests speculate


def test_sampled_outputs_are_reproducible_with_a_seed(engine):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=7)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS[::-1], params)[::-1]  # other batch order: the same tokens
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(len(x.token_ids) == 30 or x.finish_reason == "stop" for x in a)


def test_speculation_settings_are_checked(engine):
    with pytest.raises(ValueError, match="speculative-method"):
        engine.set_speculative("medusa")
    with pytest.raises(ValueError, match="speculative-tokens"):
        engine.set_speculative("ngram", 0)
    assert engine.config.speculative_method == "ngram" and engine.config.speculative_tokens == 3
    assert engine.speculates_ahead  # n-gram drafts may follow a token still on the device (ahead chunks)


def test_penalty_requests_give_the_same_tokens_when_their_prompt_is_cached(engine):
    """A slot's penalty history is built from the tokens its steps are fed, from position 0, so a
    request with penalties computes its whole prompt even when it is cached (a hit left the
    prompt out of the repetition penalty and kept the slot's previous counts)."""
    engine.set_speculative("off")
    try:
        params = SamplingParams(max_tokens=16, repetition_penalty=1.3, presence_penalty=0.4)
        first = engine.generate(PROMPTS, params)
        hits = engine.stats()["prefix_cache"]["hits"]
        again = engine.generate(PROMPTS[::-1], params)[::-1]
        assert [a.token_ids for a in again] == [f.token_ids for f in first]
        assert engine.stats()["prefix_cache"]["hits"] == hits  # none of them took a cached prefix
    finally:
        engine.set_speculative("ngram")


def test_the_ngram_index_proposes_what_a_scan_of_the_sequence_does():
    """NgramIndex (extended token by token, or by runs of tokens as a prompt or a verify step's
    kept drafts arrive; looked up with a prefix past the known tokens) against ngram_draft on the
    whole sequence, on random sequences over a small alphabet (many repeats)."""
    from types import SimpleNamespace

    from splash_jax.engine.speculative import NgramIndex

    rng = np.random.default_rng(3)
    for trial in range(80):
        seq = rng.integers(0, 4, int(rng.integers(2, 60))).tolist()
        min_n, max_n = (1, 3) if trial < 40 else sorted(int(x) for x in rng.integers(1, 5, 2))
        index = NgramIndex(min_n, max_n)
        known = 0
        while known < len(seq):
            known = min(len(seq), known + (1 if trial < 20 else int(rng.integers(1, 25))))
            index.extend(SimpleNamespace(num_known=known, token_slice=lambda a, b: seq[a:b]))
            for cut in range(0, min(3, len(seq) - known) + 1):
                prefix = tuple(seq[known : known + cut])
                for k in (1, 4, 9):  # answers inside the known tokens, across into the prefix, past its end
                    want = ngram_draft(np.array(seq[: known + cut]), k, min_n, max_n)
                    assert index.lookup(k, prefix) == want, (trial, known, cut, k)


def test_drafts_after_a_token_still_on_the_device_follow_the_guess_of_that_token():
    """propose_after (overlapped speculation): the drafts are what a scan proposes once the unknown
    token is the scan's own guess of it, not the guess's occurrence's continuation."""
    from splash_jax.engine.speculative import NgramDrafter

    class Request:  # what the drafter reads of a request (weakly referenced, as engine requests are)
        def __init__(self, seq, known):
            self.num_known, self.token_slice = known, lambda a, b: seq[a:b]

    rng = np.random.default_rng(11)
    differs = 0
    for trial in range(60):
        seq = rng.integers(0, 5, int(rng.integers(3, 50))).tolist()
        known = int(rng.integers(1, len(seq)))
        cut = int(rng.integers(0, min(3, len(seq) - known) + 1))
        drafter = NgramDrafter(1, 3)
        request = Request(seq, known)
        prefix = tuple(seq[known : known + cut])
        head = seq[: known + cut]
        guess = ngram_draft(np.array(head), 1, 1, 3)
        want = ngram_draft(np.array(head + guess), 3, 1, 3) if guess else []
        assert drafter.propose_after(request, 3, prefix) == want, trial
        differs += want != ngram_draft(np.array(head), 4, 1, 3)[1:]
    assert differs  # the old rule (the guess's occurrence's next 3 tokens) answers otherwise somewhere


def test_a_long_prompt_is_indexed_over_several_calls_and_drafts_nothing_until_then(monkeypatch):
    """A prompt longer than TOKENS_PER_EXTEND is indexed a run per call (one call per lookup, so no
    step waits for a whole 32K-token prompt); until the index has caught up it proposes nothing, then
    it equals an index built in one call and proposes what a scan does."""
    from types import SimpleNamespace

    from splash_jax.engine.speculative import NgramIndex

    cap = NgramIndex.TOKENS_PER_EXTEND
    seq = np.random.default_rng(5).integers(0, 6, 2 * cap + 37).tolist()
    request = SimpleNamespace(num_known=len(seq), token_slice=lambda a, b: seq[a:b])
    index, calls = NgramIndex(1, 3), 0
    while True:
        index.extend(request)
        calls += 1
        assert len(index.seq) == min(len(seq), calls * cap)
        if not index.behind:
            break
        assert index.lookup(4, ()) == [] and index.lookup(4, (1, 2)) == []
    assert calls == 3
    want = ngram_draft(np.array(seq), 4, 1, 3)
    assert want and index.lookup(4, ()) == want
    monkeypatch.setattr(NgramIndex, "TOKENS_PER_EXTEND", 10**9)
    whole = NgramIndex(1, 3)
    whole.extend(request)
    assert not whole.behind and whole.latest == index.latest
