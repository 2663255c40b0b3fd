"""Structured outputs on the engine: every sampled output matches its constraint (JSON schemas
checked with `jsonschema`, regexes with `re`), constrained rows leave the other rows of their
steps unchanged, overlapped and plain scheduling agree, nothing compiles after warm-up, and a
constraint that does not compile fails only its request."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from engine_runs import generate_plain
from splash_jax.compile_guard import count_compiles
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.request import RequestError
from splash_jax.structured import StructuredOutputs

ARGS = dict(model="", num_devices=1, max_num_seqs=64, max_num_batched_tokens=64, min_token_bucket=64, page_size=16, max_pages=2048,
            max_model_len=512, compile_cache_dir=None)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(**ARGS))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of the kinds clients send: objects with required and optional fields, arrays,
    enums, bounded numbers and strings, nesting."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":  # multipleOf bounds the digits: at temperature 1 a tiny model never ends a fraction
        lo = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(0.5, 100), 2),
                "multipleOf": rng.choice([0.5, 0.25, 0.125])}  # binary fractions: jsonschema checks in floats
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    names = rng.sample(["id", "name", "age", "tags", "score", "ok", "meta", "kind", "count", "city"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_200_random_schemas_sampled_at_temperature_1_always_validate(engine):
    rng = random.Random(0)
    schemas = [random_schema(rng) if i % 4 else {"type": "object", "properties": {"x": random_schema(rng)}, "required": ["x"],
                                                "additionalProperties": False}
               for i in range(200)]
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured_outputs=StructuredOutputs(json=s))
              for i, s in enumerate(schemas)]
    outs = engine.generate(["Answer in JSON:"] * len(schemas), params)
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.text, out.finish_reason)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_and_choice_outputs_match(engine):
    regexes = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)!?", r"[A-Z][a-z]{1,8} [0-9]{1,3}", r"\d+\.\d\d"]
    choices = ["alpha", "beta", "gamma delta"]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=StructuredOutputs(regex=r))
              for r in regexes for s in range(5)]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=StructuredOutputs(choice=choices))
               for s in range(10)]
    outs = engine.generate(["Say:"] * len(params), params)
    for p, out in zip(params, outs):
        spec = p.structured_outputs
        assert out.finish_reason == "stop", (spec, out.text)
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, out.text), (spec.regex, out.text)
        else:
            assert out.text in choices


def _mixed(seed: int) -> tuple[list[str], list[SamplingParams]]:
    plain = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.8, seed=seed, ignore_eos=True, logprobs=2)]
    return ["Latent attention is", "The cache holds"], plain


def test_constrained_rows_leave_their_neighbours_unchanged(engine):
    prompts, plain = _mixed(7)
    alone = engine.generate(prompts, plain)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
              "required": ["a", "b"]}
    constrained = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs=StructuredOutputs(json=schema))
                   for s in range(3)]
    together = engine.generate(prompts + ["JSON:"] * 3, plain + constrained)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    for out in together[2:]:
        jsonschema.validate(json.loads(out.text), schema)


def test_overlapped_and_plain_scheduling_give_the_same_constrained_outputs(engine):
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=StructuredOutputs(
        json={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 6}))
        for s in range(4)] + _mixed(3)[1]
    prompts = ["List:"] * 4 + _mixed(3)[0]
    overlapped = engine.generate(prompts, params)
    plain = generate_plain(engine, prompts, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]


def test_nothing_compiles_after_warmup_with_constrained_requests(engine):
    engine.generate(["warm"], [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="[a-z]+"))])
    params = [SamplingParams(max_tokens=30, temperature=t, seed=i, logprobs=1 if i % 2 else None,
                             structured_outputs=StructuredOutputs(json={"type": "object"}) if i % 3 else None)
              for i, t in enumerate([0.0, 1.0, 0.7, 1.0, 0.0, 0.5])]
    with count_compiles() as compiles:
        engine.generate(["a", "bb", "ccc", "dddd", "e", "ff"], params)
    assert compiles.count == 0, compiles.events


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json={"type": "nope"}), "does not compile"),
    (StructuredOutputs(json='{"type": '), "not valid JSON"),
    (StructuredOutputs(regex="[a-"), "does not compile"),
    (StructuredOutputs(grammar="start: undefined_rule"), "does not compile"),
    (StructuredOutputs(choice=()), "non-empty"),
    (StructuredOutputs(), "exactly one"),
])
def test_a_constraint_that_does_not_compile_fails_only_its_request(engine, spec, message):
    with pytest.raises(RequestError, match=message) as e:
        engine.make_request("x", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert e.value.field == "structured_outputs"
    outs = engine.generate(["x", "y"], [SamplingParams(max_tokens=4, structured_outputs=spec), SamplingParams(max_tokens=4)])
    assert outs[0].finish_reason == "error" and message in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4


def test_grammars_are_compiled_once_per_schema(engine):
    compiler = engine.grammars
    before = compiler.num_compiled
    schema = {"type": "object", "properties": {"unique_field_for_this_test": {"type": "boolean"}}}
    for _ in range(5):
        engine.make_request("x", SamplingParams(structured_outputs=StructuredOutputs(json=dict(schema))))
    assert compiler.num_compiled == before + 1


def test_a_grammar_dead_end_finishes_only_its_request_with_a_reason(engine):
    """The grammar allows one token and min_tokens suppresses it (it is a stop token): no token is
    allowed, the sampled one is rejected, and that request ends with an error that says so."""
    (only,) = engine.tokenizer.encode("y")
    stuck = SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[only],
                           structured_outputs=StructuredOutputs(choice=["y"]))
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = engine.generate(["fine"], [plain])[0]
    outs = engine.generate(["stuck", "fine"], [stuck, plain])
    assert outs[0].finish_reason == "error" and "grammar cannot continue" in outs[0].error, outs[0]
    assert outs[1].token_ids == alone.token_ids and outs[1].finish_reason == "length"
