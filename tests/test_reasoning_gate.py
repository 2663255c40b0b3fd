"""Grammars that start after a reasoning block, and thinking-token budgets (SamplingParams
reasoning_end_token_id / thinking_token_budget, structured/reasoning_gate.py).

References are independent runs: the unconstrained greedy output of the same prompt (what the
reasoning part must equal, the grammar not applied), `re` and `jsonschema` for the part after the
end token, and the other scheduling mode for mixed batches."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_runs import generate_plain
from engine_runs import overlap as overlap_set  # the test parameter is named overlap
from splash_jax.compile_guard import count_compiles
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.core_wire import NewRequest, decode_new, encode
from splash_jax.engine.request import Request, RequestError
from splash_jax.engine.speculative import can_speculate
from splash_jax.structured import StructuredOutputs

ARGS = dict(model="", num_devices=1, max_num_seqs=64, max_num_batched_tokens=64, min_token_bucket=64, page_size=16, max_pages=2048,
            max_model_len=512, compile_cache_dir=None)
PROMPT = "Think first:"
REGEX = r"[0-9]{3}-[a-z]{2,4}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(**ARGS))


@pytest.fixture(scope="module")
def reference(engine):
    """The prompt's unconstrained greedy output (no gate, no grammar)."""
    return engine.generate([PROMPT], [SamplingParams(max_tokens=40, ignore_eos=True)])[0].token_ids


def _absent(engine, ids) -> int:
    """A single-token id the reference never samples (so the model never ends reasoning itself)."""
    for text in ("#", "@", "~", "%", "^", "|", "$", "&"):
        (t,) = engine.tokenizer.encode(text)
        if t not in ids:
            return t
    raise AssertionError("no absent end token")


def _text(engine, ids) -> str:
    return engine.tokenizer.decode(ids)


@pytest.mark.parametrize("spec", [StructuredOutputs(regex=REGEX), StructuredOutputs(json=SCHEMA)], ids=["regex", "json"])
def test_budget_forces_the_end_token_then_the_grammar_applies(engine, reference, spec):
    k, end = 5, _absent(engine, reference)
    out = engine.generate([PROMPT], [SamplingParams(max_tokens=80, reasoning_end_token_id=end, thinking_token_budget=k,
                                                    structured_outputs=spec)])[0]
    ids = out.token_ids
    assert ids[:k] == reference[:k] and ids[k] == end, ids
    assert out.finish_reason == "stop", out
    answer = _text(engine, ids[k + 1:])
    if spec.regex is not None:
        assert re.fullmatch(REGEX, answer), answer
    else:
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_budget_zero_starts_with_the_end_token(engine, reference):
    end = _absent(engine, reference)
    out = engine.generate([PROMPT], [SamplingParams(max_tokens=40, reasoning_end_token_id=end, thinking_token_budget=0,
                                                    structured_outputs=StructuredOutputs(regex=REGEX))])[0]
    assert out.token_ids[0] == end and out.finish_reason == "stop"
    assert re.fullmatch(REGEX, _text(engine, out.token_ids[1:]))


def test_end_token_sampled_by_the_model_starts_the_grammar_after_it(engine, reference):
    """The model itself ends reasoning (no budget reached): reasoning equals the reference up to
    and including the end token; the end token is not fed to the grammar, which starts next."""
    end = reference[3]
    j = reference.index(end)
    out = engine.generate([PROMPT], [SamplingParams(max_tokens=60, reasoning_end_token_id=end, thinking_token_budget=30,
                                                    structured_outputs=StructuredOutputs(regex=REGEX))])[0]
    assert out.token_ids[:j + 1] == reference[:j + 1] and out.finish_reason == "stop"
    assert re.fullmatch(REGEX, _text(engine, out.token_ids[j + 1:]))


def test_gate_never_closed_never_applies_the_grammar(engine, reference):
    end = _absent(engine, reference)
    out = engine.generate([PROMPT], [SamplingParams(max_tokens=40, ignore_eos=True, reasoning_end_token_id=end,
                                                    structured_outputs=StructuredOutputs(regex=REGEX))])[0]
    assert out.token_ids == reference and out.finish_reason == "length"


def test_gate_alone_changes_nothing(engine, reference):
    for end in (_absent(engine, reference), reference[2]):
        out = engine.generate([PROMPT], [SamplingParams(max_tokens=40, ignore_eos=True, reasoning_end_token_id=end)])[0]
        assert out.token_ids == reference


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "plain"])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_budget_without_grammar_alone_in_its_steps(engine, reference, overlap, k):
    """No grammar row in the batch: the forced step must still take the masked path (its
    dispatch decides from a state a token behind under overlap)."""
    end = _absent(engine, reference)
    with overlap_set(engine, overlap):
        out = engine.generate([PROMPT], [SamplingParams(max_tokens=12, ignore_eos=True, reasoning_end_token_id=end,
                                                        thinking_token_budget=k)])[0]
    assert out.token_ids[:k + 1] == reference[:k] + [end], out.token_ids


def _mixed_batch(end: int) -> tuple[list[str], list[SamplingParams]]:
    """Gated + grammar (+ budget), gated + budget without grammar, plain, grammar without gate;
    greedy and sampled rows."""
    regex, js = StructuredOutputs(regex=REGEX), StructuredOutputs(json=SCHEMA)
    params = [
        SamplingParams(max_tokens=60, reasoning_end_token_id=end, thinking_token_budget=4, structured_outputs=js),
        SamplingParams(max_tokens=60, temperature=1.0, seed=3, reasoning_end_token_id=end, thinking_token_budget=7,
                       structured_outputs=regex),
        SamplingParams(max_tokens=30, reasoning_end_token_id=end, structured_outputs=regex, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, seed=5, reasoning_end_token_id=end, thinking_token_budget=6,
                       ignore_eos=True),
        SamplingParams(max_tokens=20, reasoning_end_token_id=end, thinking_token_budget=2, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, seed=9, structured_outputs=js),
    ]
    prompts = [PROMPT, "Reason:", "Hmm", "Why is", "Plan:", "Latent attention is", "The cache holds", "JSON:"]
    return prompts, params


def test_overlapped_and_plain_scheduling_agree_and_nothing_compiles(engine, reference):
    end = _absent(engine, reference)
    prompts, params = _mixed_batch(end)
    engine.generate(prompts, params)  # warm-up
    with count_compiles() as compiles:
        overlapped = engine.generate(prompts, params)
    assert compiles.count == 0, compiles.events
    plain = generate_plain(engine, prompts, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]
    for p, out in zip(params, overlapped):
        k = p.thinking_token_budget
        if k is not None:
            assert out.token_ids[k] == end and end not in out.token_ids[:k], (p, out.token_ids)
    budget_only = [(p, o) for p, o in zip(params, overlapped) if p.thinking_token_budget and p.structured_outputs is None]
    alone = engine.generate([prompts[params.index(p)] for p, _ in budget_only],
                            [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed, ignore_eos=True)
                             for p, _ in budget_only])
    for (p, out), ref in zip(budget_only, alone):  # the reasoning part is the ungated output's start
        assert out.token_ids[:p.thinking_token_budget] == ref.token_ids[:p.thinking_token_budget]
    jsonschema.validate(json.loads(_text(engine, overlapped[0].token_ids[5:])), SCHEMA)
    assert re.fullmatch(REGEX, _text(engine, overlapped[1].token_ids[8:]))


def test_speculation_skips_a_budget_while_reasoning_and_keeps_outputs(engine, reference):
    gated = SamplingParams(reasoning_end_token_id=7, thinking_token_budget=3)
    r = Request("s", [1, 2], gated)
    assert not can_speculate(r)  # a draft could cross the budget
    r.output_ids, r.reasoning_end = [5, 7], 1
    assert can_speculate(r)  # past the reasoning block, no grammar: no masks any more
    assert can_speculate(Request("t", [1], SamplingParams(reasoning_end_token_id=7)))  # a gate alone masks nothing
    end = _absent(engine, reference)
    prompts = ["import os\nimport sys\nimport os\nimport sys\n"] * 3
    params = [SamplingParams(max_tokens=24, ignore_eos=True, reasoning_end_token_id=end, thinking_token_budget=k)
              for k in (0, 4)] + [SamplingParams(max_tokens=24, ignore_eos=True, reasoning_end_token_id=end)]
    want = engine.generate(prompts, params)
    engine.set_speculative("ngram", 3)
    try:
        got = engine.generate(prompts, params)
        assert engine.stats()["speculative"]["verify_chunks"] > 0
    finally:
        engine.set_speculative("off")
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert want[0].token_ids[0] == end and want[1].token_ids[4] == end


@pytest.mark.parametrize("kwargs, field", [
    (dict(reasoning_end_token_id=-1), "reasoning_end_token_id"),
    (dict(reasoning_end_token_id=10**9), "reasoning_end_token_id"),
    (dict(reasoning_end_token_id="7"), "reasoning_end_token_id"),
    (dict(reasoning_end_token_id=True), "reasoning_end_token_id"),
    (dict(reasoning_end_token_id=5, thinking_token_budget=-1), "thinking_token_budget"),
    (dict(reasoning_end_token_id=5, thinking_token_budget=2.5), "thinking_token_budget"),
    (dict(thinking_token_budget=3), "thinking_token_budget"),
])
def test_bad_values_name_their_field(engine, kwargs, field):
    with pytest.raises(RequestError) as e:
        engine.make_request("x", SamplingParams(max_tokens=4, **kwargs))
    assert e.value.field == field


def test_new_fields_cross_the_process_boundary():
    params = SamplingParams(max_tokens=9, reasoning_end_token_id=123, thinking_token_budget=0,
                            structured_outputs=StructuredOutputs(regex=REGEX))
    client, (new,) = decode_new(encode((0, [NewRequest.of(Request("r", [1, 2], params))])))
    back = new.to_request().params
    assert back == params and back.reasoning_end_token_id == 123 and back.thinking_token_budget == 0
