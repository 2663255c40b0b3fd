"""Reasoning models on the chat route (--reasoning-parser): the parser splits on the marker
tokens wherever a stream's deltas fall (streamed == whole), a missing <think> and a cut inside the
block are handled, the markers never reach `content`; through the app (a reasoning variant of the
bundled model, tests/reasoning_model.py): reasoning_tokens exact, streamed == not streamed, a JSON
schema or tool calls applied after the reasoning, thinking on and off by chat_template_kwargs, and
400s naming the field."""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import openai
import pytest
from app_client import run_client
from reasoning_model import END_THINK, THINK, make_reasoning_model

from serve.answer import AnswerParser
from serve.app import build_app
from serve.config import ServerConfig
from serve.reasoning import (
    ReasoningMarkers,
    ReasoningParser,
    starts_in_reasoning,
)
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.tokenizer import Tokenizer

BUNDLED = "models/splash-tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_reasoning_model(tmp_path_factory.mktemp("reasoning") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def markers(tokenizer):
    return ReasoningMarkers.of(tokenizer, "deepseek_r1")


# --- the parser ---------------------------------------------------------------------------
def _pieces(tokenizer, text: str) -> list[tuple[str, int]]:
    """(token text, id) per token, as the engine's deltas carry them."""
    ids = tokenizer.encode(text)
    return [(tokenizer.decode([i]), i) for i in ids]


def _stream(markers, pieces, rng) -> tuple[str, str, int]:
    parser, reasoning, content, i = ReasoningParser(markers), "", "", 0
    while i < len(pieces):
        n = rng.randint(1, 4)
        chunk = pieces[i:i + n]
        out = parser.feed("".join(t for t, _ in chunk), [t for _, t in chunk])
        reasoning, content, i = reasoning + out.reasoning, content + out.content, i + n
    return reasoning, content, parser.reasoning_tokens


@pytest.mark.parametrize("text, reasoning, content", [
    (f"{THINK}\nfirst I think{END_THINK}\n\nThe answer.", "\nfirst I think", "\n\nThe answer."),
    (f"the template opened it{END_THINK}answer", "the template opened it", "answer"),  # R1: no <think> in the output
    (f"cut inside the block {THINK} and more", f"cut inside the block {THINK} and more", ""),
    (f"{END_THINK}only an answer with {END_THINK} in it", "", f"only an answer with {END_THINK} in it"),
])
def test_split_is_the_same_streamed_anywhere_or_whole(tokenizer, markers, text, reasoning, content):
    pieces = _pieces(tokenizer, text)
    ids = [i for _, i in pieces]
    parser = ReasoningParser(markers)
    whole = parser.feed(text, ids)  # a whole output is one feed
    whole.reasoning_tokens = parser.reasoning_tokens
    assert (whole.reasoning, whole.content) == (reasoning, content)
    inside = ids[1:] if ids[0] == markers.start_id else ids
    inside = inside[:inside.index(markers.end_id)] if markers.end_id in inside else inside
    assert whole.reasoning_tokens == len(inside)
    rng = random.Random(0)
    for _ in range(20):
        assert _stream(markers, pieces, rng) == (reasoning, content, len(inside))


def test_markers_need_single_tokens_and_thinking_follows_the_template_switch(tokenizer):
    with pytest.raises(ValueError, match="<think>"):
        ReasoningMarkers.of(Tokenizer(BUNDLED), "deepseek_r1")
    with pytest.raises(ValueError, match="reasoning-parser"):
        ReasoningMarkers.of(tokenizer, "qwen3")
    assert ReasoningMarkers.of(tokenizer, "none") is None
    assert starts_in_reasoning("deepseek_r1", None)
    assert not starts_in_reasoning("deepseek_v3", None) and not starts_in_reasoning("deepseek_v3", {"thinking": False})
    assert starts_in_reasoning("deepseek_v3", {"thinking": True}) and starts_in_reasoning("deepseek_v3", {"enable_thinking": True})
    assert not starts_in_reasoning("none", {"thinking": True})


def test_tool_calls_are_parsed_from_the_answer_only(tokenizer, markers):
    call = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    text = f"thinking about {call}{END_THINK}{call}"
    ids = tokenizer.encode(text)
    parser = AnswerParser(markers, parse_tools=True)
    out = parser.feed(text, ids, finished=True)
    assert out.reasoning == f"thinking about {call}" and out.content == "" and [c.name for c in parser.calls] == ["f"]


# --- through the app ------------------------------------------------------------------------
ENGINE_ARGS = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "page_size": 16, "max_pages": 512, "max_model_len": 1024}
ASK = [{"role": "user", "content": "What is two plus two?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
BUDGET = 6


@pytest.fixture(scope="module")
def apps(model_dir):
    """One engine, served by three apps: --reasoning-parser deepseek_r1, deepseek_v3 and none."""
    engine = AsyncEngine(Engine(EngineConfig(model=str(model_dir), **ENGINE_ARGS, warmup=False, compile_cache_dir=None)))
    yield {name: build_app(engine, ServerConfig(served_model_name=["m"], reasoning_parser=name), shutdown_engine=False)
           for name in ("deepseek_r1", "deepseek_v3", "none")}
    engine.shutdown()


def run(app, fn):
    """fn(openai client) run against the app in-process."""
    return run_client(app, fn)


def _kw(**extra):
    body = {"return_token_ids": True, "ignore_eos": True}
    body.update(extra.pop("extra_body", {}))
    return {"model": "m", "messages": ASK, "temperature": 0, "max_tokens": 16, "extra_body": body, **extra}


async def _streamed(client, **kw):
    reasoning, content, ids, usage, calls = "", "", [], None, {}
    async for chunk in await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning_content") or ""
            content += c.delta.content or ""
            ids += (c.model_extra or {}).get("token_ids") or []
            for tc in c.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] = tc.function.name or entry[0]
                entry[1] += tc.function.arguments or ""
    return reasoning, content, ids, usage, calls


@pytest.fixture(scope="module")
def answers(apps):
    """Every generation the tests below judge, sent at once (one engine batch)."""
    budget = {"thinking_token_budget": BUDGET}
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}

    async def ask(client):
        jobs = {
            "plain": client.chat.completions.create(**_kw(extra_body=budget)),
            "streamed": _streamed(client, **_kw(extra_body=budget)),
            "schema": client.chat.completions.create(**_kw(max_tokens=40, response_format=schema, extra_body=budget)),
            "schema_streamed": _streamed(client, **_kw(max_tokens=40, response_format=schema, extra_body=budget)),
            "tools": client.chat.completions.create(**_kw(max_tokens=200, tools=TOOLS, tool_choice="required", extra_body=budget)),
            "hidden": client.chat.completions.create(**_kw(extra_body={**budget, "include_reasoning": False})),
            "cut": client.chat.completions.create(**_kw(max_tokens=4, extra_body={"thinking_token_budget": 10})),
        }
        results = await asyncio.gather(*jobs.values())
        return dict(zip(jobs, results))

    return run(apps["deepseek_r1"], ask)


def _reasoning_of(message) -> str | None:
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning_content")


def test_reasoning_is_split_on_the_end_token_with_exact_counts(answers, tokenizer, markers):
    r = answers["plain"]
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert ids[BUDGET] == markers.end_id and markers.end_id not in ids[:BUDGET]  # the budget closed the block
    assert _reasoning_of(choice.message) == tokenizer.decode(ids[:BUDGET])
    assert choice.message.content == tokenizer.decode(ids[BUDGET + 1:])
    assert END_THINK not in choice.message.content and THINK not in choice.message.content
    assert r.usage.completion_tokens_details.reasoning_tokens == BUDGET
    assert r.usage.completion_tokens == len(ids) == 16


def test_streamed_equals_not_streamed(answers):
    whole, (reasoning, content, ids, usage, _) = answers["plain"], answers["streamed"]
    choice = whole.choices[0]
    assert (reasoning, content, ids) == (_reasoning_of(choice.message), choice.message.content, choice.model_extra["token_ids"])
    assert usage.completion_tokens_details.reasoning_tokens == BUDGET


def test_a_json_schema_applies_after_the_reasoning(answers, tokenizer):
    choice = answers["schema"].choices[0]
    reasoning, content = _reasoning_of(choice.message), choice.message.content
    assert reasoning and reasoning == tokenizer.decode(choice.model_extra["token_ids"][:BUDGET])
    jsonschema.validate(json.loads(content), SCHEMA)
    assert choice.finish_reason == "stop"
    s_reasoning, s_content, _, usage, _ = answers["schema_streamed"]
    assert (s_reasoning, s_content) == (reasoning, content) and usage.completion_tokens_details.reasoning_tokens == BUDGET


def test_tool_calls_after_the_reasoning(answers):
    choice = answers["tools"].choices[0]
    assert _reasoning_of(choice.message) and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_include_reasoning_false_and_a_cut_inside_the_block(answers):
    hidden = answers["hidden"].choices[0]
    assert _reasoning_of(hidden.message) is None and hidden.message.content == answers["plain"].choices[0].message.content
    cut = answers["cut"].choices[0]
    assert cut.message.content is None and _reasoning_of(cut.message) and cut.finish_reason == "length"
    assert answers["cut"].usage.completion_tokens_details.reasoning_tokens == 4


def test_deepseek_v3_thinks_only_when_the_template_is_asked(apps, markers):
    async def ask(client):
        on = await client.chat.completions.create(**_kw(extra_body={"chat_template_kwargs": {"thinking": True},
                                                                     "thinking_token_budget": 3}))
        off = await client.chat.completions.create(**_kw(extra_body={"chat_template_kwargs": {"thinking": False}}))
        return on, off

    on, off = run(apps["deepseek_v3"], ask)
    assert _reasoning_of(on.choices[0].message) and on.choices[0].model_extra["token_ids"][3] == markers.end_id
    assert _reasoning_of(off.choices[0].message) is None and off.usage.completion_tokens_details.reasoning_tokens == 0
    assert off.choices[0].message.content  # the template closed the block: all answer


def test_without_a_parser_nothing_changes(apps):
    r = run(apps["none"], lambda client: client.chat.completions.create(**_kw()))
    assert _reasoning_of(r.choices[0].message) is None and r.usage.completion_tokens_details is None


@pytest.mark.parametrize("app, extra, param", [
    ("none", {"thinking_token_budget": 4}, "thinking_token_budget"),
    ("deepseek_v3", {"thinking_token_budget": 4}, "thinking_token_budget"),  # thinking not asked for
    ("deepseek_r1", {"thinking_token_budget": -1}, "thinking_token_budget"),
    ("deepseek_r1", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("deepseek_r1", {"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
])
def test_bad_reasoning_fields_are_400_naming_the_field(apps, app, extra, param):
    async def ask(client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(**_kw(extra_body=extra))
        return e.value.body

    assert run(apps[app], ask)["param"] == param


def test_the_responses_api_gives_a_reasoning_item_first(apps, answers):
    """/v1/responses on the same generation as the chat answer `plain`: a reasoning item, then the
    message; streamed reasoning and text deltas add up to the same."""
    kw = dict(model="m", input=ASK[0]["content"], temperature=0, max_output_tokens=16,
              extra_body={"thinking_token_budget": BUDGET, "ignore_eos": True})

    async def ask(client):
        whole = await client.responses.create(**kw)
        events = [e async for e in await client.responses.create(**kw, stream=True)]
        return whole, events

    whole, events = run(apps["deepseek_r1"], ask)
    chat = answers["plain"].choices[0].message
    reasoning, message = whole.output[0], whole.output[1]
    assert reasoning.type == "reasoning" and reasoning.content[0].text == _reasoning_of(chat)
    assert message.type == "message" and whole.output_text == chat.content
    assert whole.usage.output_tokens_details.reasoning_tokens == BUDGET and whole.usage.output_tokens == 16
    streamed_reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (streamed_reasoning, streamed_text) == (_reasoning_of(chat), chat.content)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text
