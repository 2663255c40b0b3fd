"""The draft budget (engine/draft_budget.py): drafts per request from measured acceptance and
step costs, against the expected-yield arithmetic, and in the engine: greedy outputs unchanged,
a request whose drafts are always rejected ends with none, one whose drafts are always kept
keeps K."""

import pytest

from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.draft_budget import Acceptance, DraftBudget
from splash_jax.engine.set_acceptance import SetAcceptanceDrafter
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.weights.loader import load_model


def _budget(cost_per_token: float, fixed: float = 1.0, tokens=range(1, 33)) -> DraftBudget:
    b = DraftBudget()
    for t in tokens:
        b.observe(t, fixed + cost_per_token * t)
    return b


def test_drafts_are_taken_while_their_expected_tokens_pay_for_the_larger_step():
    flat = _budget(0.0)
    assert flat.choose([0.9, 0.1], [3, 3], 2) == [3, 3]  # a free step: every draft
    steep = _budget(1.0, fixed=0.0)
    # cost proportional to tokens: 2 tokens in 2 s beat 2.9 expected tokens in 3 s
    assert steep.choose([0.9, 0.1], [3, 3], 2) == [0, 0]
    # cost 1 + T: a draft of 0.9 pays (2.9 / 4 s > 2 / 3 s), and a second (3.71 / 5 s); a third does not
    assert _budget(1.0).choose([0.9, 0.1], [3, 3], 2) == [2, 0]
    mid = _budget(0.1)
    got = mid.choose([0.9, 0.1], [3, 3], 2)
    assert got[0] == 3 and got[1] == 0, got  # gains 0.9, 0.81, 0.73 pay for 0.1 s each; 0.1 does not
    rates = [(2 + sum(0.9 ** i for i in range(1, n + 1))) / (1 + 0.1 * (2 + n)) for n in range(4)]
    assert max(range(4), key=rates.__getitem__) == 3


def test_a_step_smaller_than_any_measured_runs_without_drafts_first():
    b = DraftBudget()
    assert b.choose([0.9], [3], 1) == [0]  # nothing measured
    b.observe(1, 1.0)
    assert b.choose([0.9], [3], 1) == [3]  # larger steps assumed to cost the same until measured
    b.observe(4, 1.5)
    assert b.choose([0.1], [3], 1) == [0]  # measured: 1.1 tokens / 1.17 s < 1 token / 1 s


def test_acceptance_follows_kept_and_missed_drafts():
    a = Acceptance()
    assert a.alpha == 0.5
    for _ in range(30):
        a.record(3, 0)
    assert a.alpha < 0.06
    b = Acceptance()
    for _ in range(30):
        b.record(3, 3)
    assert b.alpha > 0.95


@pytest.fixture(scope="module")
def engine():
    model = load_model(DEFAULT_MODEL, RuntimeOptions(dtype="float32", attention_impl="xla"))
    cfg = EngineConfig(page_size=8, max_num_seqs=2, max_num_batched_tokens=16, max_pages=64, compile_cache_dir=None,
                       speculative_method="ngram", speculative_tokens=3)
    return Engine(cfg, model=model)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_the_engine_turns_drafts_off_when_they_are_always_rejected(engine, p):
    prompt = "def add(a, b):\n    return a + b\n"
    engine.set_speculative("off")
    want = engine.generate([prompt], SamplingParams(max_tokens=48))[0]
    drafter = SetAcceptanceDrafter({tuple(engine.tokenizer.encode(prompt, add_bos=True)): want.token_ids}, p, seed=1,
                                   vocab_size=engine.model_config.vocab_size)
    engine.set_speculative("custom", 3, drafter=drafter)
    budget = engine.draft_budget
    # step costs as a GPU's decode step grows with its tokens (CPU timings are noise at this size)
    budget.observe = lambda tokens, seconds: DraftBudget.observe(budget, tokens, 1e-3 * (10 + tokens))
    try:
        got = engine.generate([prompt], SamplingParams(max_tokens=48))[0]
        spec = engine.stats()["speculative"]
    finally:
        engine.set_speculative("ngram")
    assert got.token_ids == want.token_ids
    if p == 0.0:
        assert spec["accepted_tokens"] == 0 and 0 < spec["verify_chunks"] <= 12, spec
        assert spec["adaptive"]["steps_without_drafts"] > 30, spec
    else:
        assert spec["adaptive"]["mean_k"] > 2.0 and spec["mean_accepted_per_step"] > 2.5, spec
