"""The set-acceptance drafter (engine/set_acceptance.py): drafts right with the set probability,
the same at a position however they are asked for, and, in an engine, greedy outputs equal to
decoding without speculation with an acceptance that follows p."""

import numpy as np
import pytest

from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.request import Request
from splash_jax.engine.set_acceptance import SetAcceptanceDrafter, expected_accepted
from splash_jax.engine.speculative import accepted
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.weights.loader import load_model

VOCAB = 1000


def _recorded(num_prompts=40, length=250, seed=1):
    rng = np.random.default_rng(seed)
    return {tuple(rng.integers(0, VOCAB, 12).tolist()): rng.integers(0, VOCAB, length).tolist()
            for _ in range(num_prompts)}


def _request(prompt, output=()):
    return Request("r", list(prompt), SamplingParams(max_tokens=1000), output_ids=list(output))


@pytest.mark.parametrize("p", [0.3, 0.8])
def test_drafts_are_right_with_probability_p_and_never_right_by_accident(p):
    recorded = _recorded()
    drafter = SetAcceptanceDrafter(recorded, p, seed=7, vocab_size=VOCAB)
    right = total = 0
    for prompt, truth in recorded.items():
        drafts = drafter.propose(_request(prompt), len(truth) + 5)
        assert len(drafts) == len(truth)  # they stop where the recording ends
        hits = [d == t for d, t in zip(drafts, truth)]
        assert all(0 <= d < VOCAB for d in drafts)
        right, total = right + sum(hits), total + len(hits)
    # within 4.5 standard deviations of the binomial count (10,000 positions)
    assert abs(right - p * total) < 4.5 * np.sqrt(total * p * (1 - p)), (right, total)
    # another seed decides differently; the same seed the same
    again = SetAcceptanceDrafter(recorded, p, seed=7, vocab_size=VOCAB)
    other = SetAcceptanceDrafter(recorded, p, seed=8, vocab_size=VOCAB)
    prompt = next(iter(recorded))
    assert again.propose(_request(prompt), 250) == drafter.propose(_request(prompt), 250)
    assert other.propose(_request(prompt), 250) != drafter.propose(_request(prompt), 250)


def test_the_same_position_gets_the_same_draft_from_propose_and_propose_after():
    recorded = _recorded(num_prompts=3, length=60)
    drafter = SetAcceptanceDrafter(recorded, 0.5, seed=3, vocab_size=VOCAB)
    for prompt, truth in recorded.items():
        full = drafter.propose(_request(prompt), 60)
        for q in (0, 1, 17, 55):
            request = _request(prompt, truth[:q])
            assert drafter.propose(request, 4) == full[q : q + 4]
            assert drafter.propose(request, 4) == full[q : q + 4]  # asked twice
            for n in (0, 2):  # known tokens, `n` more in flight, one not known yet
                want = full[q + n + 1 : q + n + 5]
                assert drafter.propose_after(_request(prompt, truth[:q]), 4, tuple(truth[q : q + n])) == want
        assert drafter.propose(_request(prompt, truth), 3) == []  # the recording has ended
    assert drafter.propose(_request((5, 6, 7)), 3) == []  # a prompt not recorded
    assert drafter.propose(_request(prompt), 0) == []


def test_a_request_that_left_the_recording_gets_no_more_drafts():
    recorded = _recorded(num_prompts=1, length=30)
    (prompt, truth), = recorded.items()
    drafter = SetAcceptanceDrafter(recorded, 1.0, vocab_size=VOCAB)
    request = _request(prompt, truth[:5])
    assert drafter.propose(request, 3) == truth[5:8]
    assert drafter.propose_after(request, 3, ((truth[5] + 1) % VOCAB,)) == []  # a prefix off the recording
    request.output_ids += [truth[5], (truth[6] + 1) % VOCAB]
    assert drafter.propose(request, 3) == [] and drafter.num_diverged == 1
    request.output_ids[-1] = truth[6]
    assert drafter.propose(request, 3) == []  # it stays off


@pytest.mark.parametrize("p,k", [(0.8, 3), (0.3, 3), (0.8, 1)])
def test_verify_steps_accept_the_truncated_geometric_mean(p, k):
    """Replaying verify steps against the recording: accepted drafts per step average
    p + ... + p^K (each drafted position is kept independently with probability p)."""
    recorded = _recorded(num_prompts=60, length=400, seed=2)
    drafter = SetAcceptanceDrafter(recorded, p, seed=0, vocab_size=VOCAB)
    counts = []
    for prompt, truth in recorded.items():
        request = _request(prompt)
        while len(request.output_ids) + k + 1 <= len(truth):
            q = len(request.output_ids)
            drafts = drafter.propose(request, k)
            out = accepted(drafts, truth[q : q + k + 1])  # the target's greedy tokens are the recording
            counts.append(len(out) - 1)
            request.output_ids += out
    counts = np.asarray(counts)
    assert abs(counts.mean() - expected_accepted(p, k)) < 4.5 * counts.std() / np.sqrt(len(counts))


@pytest.fixture(scope="module")
def engine():
    model = load_model(DEFAULT_MODEL, RuntimeOptions(dtype="float32", attention_impl="xla"))
    # the smallest engine with room for K = 3 (two requests x 4 rows): its start-up is most of the file's time
    cfg = EngineConfig(page_size=8, max_num_seqs=2, max_num_batched_tokens=8, max_pages=96, compile_cache_dir=None,
                       speculative_method="ngram", speculative_tokens=3)
    return Engine(cfg, model=model)


def test_engine_outputs_equal_decoding_without_speculation(engine):
    prompts = ["def add(a, b):\n", "The quick brown fox", "import os\n", "for i in range(10):\n"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.set_speculative("off")
    want = engine.generate(prompts, params)
    recorded = {tuple(o.prompt_ids): o.token_ids for o in want}
    rates = {}
    for p in (0.8, 0.0):
        drafter = SetAcceptanceDrafter(recorded, p, seed=0, vocab_size=engine.model_config.vocab_size)
        engine.set_speculative("custom", 3, drafter=drafter)
        got = engine.generate(prompts, params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        spec = engine.stats()["speculative"]
        assert spec["verify_chunks"] > 0 and drafter.num_diverged == 0
        rates[p] = spec["acceptance_rate"]
    engine.set_speculative("off")
    assert rates[0.0] == 0.0
    # K = 3 at p = 0.8: (0.8 + 0.64 + 0.512) / 3 = 0.65 expected per drafted token
    assert rates[0.8] > 0.4, rates
