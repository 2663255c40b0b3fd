"""The draft budget (engine/draft_budget.py): draft caps chosen by measured tokens per second per
level, with neighbours explored; in the engine: greedy outputs unchanged, a request whose drafts
are always rejected ends with none, one whose drafts are always kept runs K."""

import pytest

from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.draft_budget import (
    EXPLORE_EVERY, EXPLORE_STEPS, FOLLOW_STEPS, LEARN_EVERY, MAX_PROBE_GAP, MIN_ALPHA, PROBE_GAP, Acceptance, DraftBudget,
    step_yields)
from splash_jax.engine.set_acceptance import SetAcceptanceDrafter
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.weights.loader import load_model


def observe(b: DraftBudget, tokens, seconds) -> None:
    """The step b chose last made tokens[l] at each level l <= its level (what a step at that level
    tells: engine step_yields) in seconds[its level] (or `seconds` for every level)."""
    level = b.level
    b.observe(b.take_key(), tuple(tokens[: level + 1]), seconds if isinstance(seconds, (int, float)) else seconds[level])


def test_step_yields_are_what_each_lower_cap_would_have_kept_of_the_same_drafts():
    # three requests kept 3, 0 and 1 drafts: capped at l, each keeps min(kept, l)
    assert step_yields([4, 1, 2], 3) == (3, 5, 6, 7)
    assert step_yields([4, 1, 2], 1) == (3, 5)
    assert step_yields([1, 1], 0) == (2,)


def test_each_level_is_measured_then_the_fastest_runs_with_the_others_tried_now_and_then():
    b = DraftBudget(3)
    tokens, seconds = (10, 18, 24, 28), (1.0, 1.0, 1.0, 28 / 21)  # tokens per second 10, 18, 24, 21
    seen = []
    for _ in range(4 * LEARN_EVERY + 4 * (EXPLORE_STEPS + 1)):  # K first, then off, then the others
        seen.append(b.choose([0.9], [3])[0])
        observe(b, tokens, seconds)
    assert list(dict.fromkeys(seen)) == [3, 0, 1, 2]
    assert all(seen.count(lv) >= EXPLORE_STEPS + 1 for lv in range(4))  # (the first step at a level is not counted)
    assert seen[-1] == 2
    levels = []
    for _ in range(5 * EXPLORE_EVERY):
        levels.append(b.choose([0.9], [3])[0])
        observe(b, tokens, seconds)
    assert levels.count(2) > 0.8 * len(levels)  # the fastest level
    every = seen + levels
    runs = [c for a, c in zip(every, every[1:]) if a != c and a == 2]  # the levels tried after the best
    assert runs == [0, 3, 1]  # level 0 and the neighbours in turn: after 48, 96 and 192 steps (doubling)
    assert b.summary()["level"] == 2


def test_drafts_stay_off_when_steps_without_them_make_more_tokens():
    b = DraftBudget(3)
    for _ in range(4 * LEARN_EVERY + 2 * EXPLORE_EVERY):
        b.choose([0.5, 0.5], [3, 3])
        observe(b, (2, 2, 2, 2), 1.0 + 0.2 * b.level)  # drafts add cost and no tokens
    assert b.summary()["level"] == 0


def test_level_0_is_measured_again_so_a_low_first_reading_of_it_does_not_stick():
    """Level 0 read low at first (the first steps of a run, say) and a drafting level looked best:
    level 0 is among the levels explored, its rate is its recent steps', so the budget turns
    drafts off once it is measured again; and then it explores less often."""
    b = DraftBudget(3)
    seen = []
    for _ in range(1000):
        level = b.choose([0.5], [3])[0]
        seen.append(level)
        first_reading = b.buckets[1].samples.get(0, 0) < EXPLORE_STEPS
        # tokens per second 6 (then 10), 8, 9 and 8.5: the drafts' tokens cost more time than they save
        observe(b, (10, 12, 13, 13.5), (10 / 6 if first_reading else 1.0, 12 / 8, 13 / 9, 13.5 / 8.5))
    assert b.summary()["level"] == 0
    assert seen[-300:].count(0) > 0.95 * 300  # explorations of the others have backed off


def test_while_drafts_win_by_little_level_0_is_read_again_each_period_and_one_low_reading_does_not_stick():
    """Level 3 beats level 0's readings by 1.2x (thin: below THIN_MARGIN) until level 0's steps run at
    their real speed, 1.1x level 3's: every exploration reads level 0 again and the period does not
    grow, so the first exploration after the fix turns drafts off. With a clear margin (2x) the
    neighbours are tried in turn and the period doubles."""
    def run(level0_seconds, steps):
        b, seen, explored = DraftBudget(3), [], []
        for i in range(steps):
            seen.append(b.choose([0.5], [3])[0])
            if len(seen) > 1 and seen[-1] != seen[-2] and seen[-2] == b.buckets[1].best:
                explored.append((i, seen[-1]))
            # level 3: 12 tokens/s; levels 1-2 lose
            observe(b, (10, 10.5, 11, 12), (level0_seconds(i), 1.2, 1.2, 1.0))
        return b, seen, explored

    start = 4 * LEARN_EVERY + 4 * (EXPLORE_STEPS + 1)  # learning is over; level 0 read 10 tok/s
    b, seen, explored = run(lambda i: 1.0 if i < start else 10 / 13.2, start + 4 * EXPLORE_EVERY)
    assert b.summary()["level"] == 0, b.summary()
    after = [lv for i, lv in explored if i >= start]
    assert after and after[0] == 0  # level 0 again at the first exploration after the learning ...
    assert seen[-EXPLORE_EVERY:].count(0) > 0.8 * EXPLORE_EVERY  # ... which turned drafts off
    # thin throughout (level 0 stays at 10 tok/s): only level 0 is explored, once per EXPLORE_EVERY
    b, seen, explored = run(lambda i: 1.0, start + 6 * EXPLORE_EVERY)
    assert b.summary()["level"] == 3
    late = [(i, lv) for i, lv in explored if i >= start]
    assert [lv for _, lv in late] == [0] * len(late) and len(late) >= 5
    assert all(b2 - a2 <= EXPLORE_EVERY + EXPLORE_STEPS + 1 for (a2, _), (b2, _) in zip(late, late[1:]))
    # a clear margin (level 0 at 5 tok/s): neighbours in turn, at doubling periods
    b, seen, explored = run(lambda i: 2.0, start + 8 * EXPLORE_EVERY)
    late = [(i, lv) for i, lv in explored if i >= start]
    assert {lv for _, lv in late} == {0, 2}
    gaps = [b2 - a2 for (a2, _), (b2, _) in zip(late, late[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 2 * EXPLORE_EVERY


def test_each_batch_size_bucket_learns_its_own_level():
    """Drafts pay at a small batch and lose at a large one (the step's cost grows with its tokens
    there): each bucket of batch sizes ends at its own best level, and the two interleaved never
    mix their rates (a key change leaves the next step out)."""
    b = DraftBudget(3)

    for i in range(3000):
        batch = 2 if (i // 7) % 2 else 16  # runs of 7 steps at each size
        b.choose([0.9] * batch, [3] * batch)
        # tokens: 1 + 0.6 + 0.36 + ... per request; cost by batch
        observe(b, [batch * sum(0.6 ** i for i in range(lv + 1)) for lv in range(4)], 1.0 if batch < 4 else 1.0 + 0.8 * b.level)
    by = b.summary()["by_batch"]
    assert by[2]["level"] == 3 and by[16]["level"] == 0, by
    assert by[16]["tokens_per_s_by_level"][0] == pytest.approx(16.0)
    assert by[2]["tokens_per_s_by_level"][3] == pytest.approx(2 * (1 + 0.6 + 0.36 + 0.216), abs=0.05)  # (rounded)
    assert b.take_key() is None  # taken once


def test_a_new_batch_size_starts_at_the_level_of_the_nearest_one_measured():
    b = DraftBudget(3)
    for _ in range(4 * LEARN_EVERY + 4 * (EXPLORE_STEPS + 1)):  # 16 requests: drafts lose
        b.choose([0.9] * 16, [3] * 16)
        observe(b, (16, 16, 16, 16), 1.0 + 0.8 * b.level)
    assert b.summary()["by_batch"][16]["level"] == 0
    assert b.choose([0.9] * 40, [3] * 40) == [0] * 40  # 32-63 requests: not measured, starts at 0
    assert b.choose([0.9], [3]) == [0]  # and so does 1 (the nearest measured bucket is still 16-31)


def test_a_batch_passing_through_runs_the_learned_level_and_a_batch_that_stays_learns_its_own():
    """The drain of a batch (every step fewer requests) visits each smaller bucket for a few steps:
    it runs the best level of the nearest learned bucket there, trying nothing; a batch size that
    stays learns its own levels."""
    b = DraftBudget(3)
    for _ in range(4 * LEARN_EVERY + 4 * (EXPLORE_STEPS + 1)):  # 64 requests: level 2 is best
        b.choose([0.9] * 64, [3] * 64)
        observe(b, (64, 96, 115.2, 121.6), (1.0, 1.0, 1.0, 1.9 / 1.7))  # 64 x (1, 1.5, 1.8, 1.7) tokens per second
    assert b.summary()["by_batch"][64]["level"] == 2
    drain = [b.choose([0.9] * n, [3] * n)[0] for n in range(63, 0, -1)]
    assert drain == [2] * len(drain)  # no level tried in the drain, whatever the nearest bucket's start was
    stays = []
    for _ in range(FOLLOW_STEPS + 4 * LEARN_EVERY + 4 * (EXPLORE_STEPS + 1)):  # 4 requests, drafts lose
        stays.append(b.choose([0.9] * 4, [3] * 4)[0])
        observe(b, (4, 4, 4, 4), 1.0 + b.level)
    assert stays[: FOLLOW_STEPS - 4] == [2] * (FOLLOW_STEPS - 4)  # (4 of the drain's steps were at 4-7 requests)
    assert b.summary()["by_batch"][4]["level"] == 0 and stays[-1] == 0


def test_levels_are_compared_on_the_same_steps_not_on_text_read_at_different_places():
    """One request (batch 1), steps as long at every drafting level. Levels 0-2 are measured
    where the text repeats (every draft kept), level 3 where it repeats every other step: its own
    steps make 2.5 tokens, fewer than level 2's 3 there. Compared on its own steps level 2 would
    win; on the same steps level 3 makes 1.25x what level 2 would have, so level 3 runs."""
    b = DraftBudget(3)
    levels = []
    for i in range(4 * LEARN_EVERY + 4 * (EXPLORE_STEPS + 1) + 3 * EXPLORE_EVERY):
        levels.append(b.choose([0.9], [3])[0])
        made = [(1, 2, 3, (4, 1)[i % 2])[b.level]]  # at level 3: all three drafts kept, then none
        b.observe(b.take_key(), step_yields(made, b.level), 0.9 if b.level == 0 else 1.0)
    rate = b.buckets[1].rate
    assert rate[3] / rate[2] == pytest.approx((4 + 1) / (3 + 1)), rate  # level 3's steps, kept at 3 and at 2 drafts
    assert b.summary()["level"] == 3
    assert levels[-EXPLORE_EVERY:].count(3) > 0.8 * EXPLORE_EVERY


def test_a_request_whose_drafts_are_rarely_kept_gets_none_at_any_level():
    b = DraftBudget(3)
    assert b.choose([0.9, MIN_ALPHA / 2, 0.5], [3, 3, 1]) == [3, 0, 1]


def test_a_request_cut_off_probes_again_at_doubling_gaps_and_resumes_when_a_probe_is_kept():
    """Cut off (alpha below MIN_ALPHA), a request drafts nothing for PROBE_GAP of its tokens, then
    once (a probe); a probe that keeps nothing doubles the gap, up to MAX_PROBE_GAP; one that keeps
    a draft lets it draft at every step again."""
    a = Acceptance()
    while a.alpha >= MIN_ALPHA:  # misses until it is cut off (7)
        a.record(3, 0)
    generated, probes = 8, []
    while generated < 2000:
        if a.alpha_for_drafting(generated) >= MIN_ALPHA:
            probes.append(generated)
            a.record(3, 0)
        generated += 1
    gaps = [b - a_ for a_, b in zip([8] + probes, probes)]
    assert gaps[:5] == [PROBE_GAP, 2 * PROBE_GAP + 1, 4 * PROBE_GAP + 1, 8 * PROBE_GAP + 1, 16 * PROBE_GAP + 1]
    assert set(gaps[5:]) == {MAX_PROBE_GAP + 1}  # (+1: the probe's own token; the gap counts from the next)
    assert a.alpha_for_drafting(generated) < MIN_ALPHA
    while a.alpha_for_drafting(generated) < MIN_ALPHA:
        generated += 1
    a.record(3, 1)  # the probe keeps one draft
    assert a.alpha >= MIN_ALPHA and all(a.alpha_for_drafting(generated + i) >= MIN_ALPHA for i in range(3))
    assert (a.probe_at, a.probe_gap) == (None, PROBE_GAP)  # cut off again later, it starts from the first gap


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
    want = engine.generate([prompt], SamplingParams(max_tokens=120))[0]
    drafter = SetAcceptanceDrafter({tuple(engine.tokenizer.encode(prompt, add_bos=True)): want.token_ids}, p, seed=1,
                                   vocab_size=engine.model_config.vocab_size)
    engine.set_speculative("custom", 3, drafter=drafter)
    try:
        got = engine.generate([prompt], SamplingParams(max_tokens=120))[0]
        spec = engine.stats()["speculative"]
    finally:
        engine.set_speculative("ngram")
    assert got.token_ids == want.token_ids
    if p == 0.0:  # after a few misses its alpha is below MIN_ALPHA: no drafts at any level but
        # probes, 16, 32, 64, ... tokens apart (at most 4 in 120 tokens, two verify chunks each
        # while one is in flight)
        assert spec["accepted_tokens"] == 0 and 0 < spec["verify_chunks"] <= 10 + 8, spec
    else:  # every level measured, then K = 3 (4 tokens a step) for the rest
        assert spec["adaptive"]["mean_k"] > 1.8 and spec["mean_accepted_per_step"] > 2.0, spec
        assert spec["adaptive"]["level"] == 3, spec


def test_at_level_0_a_step_does_no_drafting_work(engine, monkeypatch):
    """Level 0 is speculation off on the host too: with no verify chunk on the device the scheduler
    asks no request for its draft limit and no drafter for drafts, and outputs are those of off."""
    from splash_jax.engine import draft_budget, spec_scheduling

    prompt = "def add(a, b):\n    return a + b\n"
    engine.set_speculative("off")
    want = engine.generate([prompt, prompt + "#"], SamplingParams(max_tokens=24))
    calls = []
    limit = spec_scheduling.SpeculativeScheduling._draft_limit
    monkeypatch.setattr(spec_scheduling.SpeculativeScheduling, "_draft_limit",
                        lambda self, r: calls.append(r) or limit(self, r))
    monkeypatch.setattr(draft_budget._Levels, "pick", lambda self: 0)
    engine.set_speculative("ngram")
    try:
        got = engine.generate([prompt, prompt + "#"], SamplingParams(max_tokens=24))
        spec = engine.stats()["speculative"]
    finally:
        monkeypatch.undo()
        engine.set_speculative("ngram")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert calls == [] and spec["verify_chunks"] == 0 and spec["adaptive"]["steps_without_drafts"] > 20, spec
