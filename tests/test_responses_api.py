"""POST /v1/responses (the OpenAI Responses API) with the official openai client against the app
in-process (bundled model): the text equals the chat route's for the same messages at temperature
0, usage counts are exact, a stream's events come in the documented order and add up to the final
response (which equals the non-streamed one), function tools round-trip, text.format constrains the
output (`responses.parse`), a max_output_tokens cut is "incomplete", and bad fields are 400s naming
the field."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pydantic
import pytest
from app_client import run_client

from serve.app import build_app
from serve.config import ServerConfig
from serve.responses_input import input_messages
from serve.responses_protocol import ResponsesRequest
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.async_engine import AsyncEngine

ENGINE_ARGS = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "page_size": 16, "max_pages": 256, "max_model_len": 1024}
MODEL = "splash-tiny"
PROMPT = "Write one sentence about the sea."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER, "strict": True}
ASK = "Weather in Paris?"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    rain: bool


@pytest.fixture(scope="module")
def app():
    aengine = AsyncEngine(Engine(EngineConfig(**ENGINE_ARGS, warmup=False, compile_cache_dir=None)))
    yield build_app(aengine, ServerConfig(served_model_name=[MODEL]), shutdown_engine=False)
    aengine.shutdown()


def run(app, fn):
    """fn(openai client, raw httpx client) run against the app in-process."""
    return run_client(app, fn, raw=True)


async def _streamed(client, **kw) -> list:
    return [e async for e in await client.responses.create(**kw, stream=True)]


@pytest.fixture(scope="module")
def generated(app):
    """Every generation the tests below judge, sent at once (one batch: the engine steps once for all)."""

    async def ask(client, _):
        plain = dict(model=MODEL, input=PROMPT, max_output_tokens=8, temperature=0)
        named = dict(model=MODEL, input=ASK, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                     temperature=0, max_output_tokens=200)
        out = await asyncio.gather(
            client.responses.create(**plain),
            _streamed(client, **plain),
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0,
                                           max_completion_tokens=8, extra_body={"return_token_ids": True}),
            client.responses.create(model=MODEL, input=ASK, tools=[TOOL], tool_choice="required", temperature=1,
                                    max_output_tokens=200, parallel_tool_calls=False, extra_body={"seed": 3}),
            client.responses.create(**named),
            _streamed(client, **named),
            *[client.responses.parse(model=MODEL, input="A city and whether it rains, as JSON.", text_format=City,
                                     temperature=1, max_output_tokens=120,
                                     extra_body={"seed": s}) for s in range(2)],
            client.responses.create(model=MODEL, input=[{"role": "developer", "content": "Be brief."},
                                                        {"type": "message", "role": "user",
                                                         "content": [{"type": "input_text", "text": PROMPT}]}],
                                    instructions="You are terse.", max_output_tokens=3, extra_body={"ignore_eos": True}),
        )
        keys = ("plain", "stream", "chat", "required", "named", "named_stream", "parsed0", "parsed1", "cut")
        return dict(zip(keys, out))

    return run(app, ask)


def _check_event_order(events) -> None:
    """created, in_progress, then per output item: added, its parts and deltas, their done events,
    output_item.done; finally completed or incomplete. sequence_number counts from 0."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    per_item: dict[int, list[str]] = {}
    for e in events[2:-1]:
        per_item.setdefault(e.output_index, []).append(e.type)
    assert sorted(per_item) == list(range(len(events[-1].response.output)))
    for index, kinds in per_item.items():
        item = events[-1].response.output[index]
        assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
        middle = kinds[1:-1]
        if item.type == "message":
            assert middle[0] == "response.content_part.added" and middle[-2:] == [
                "response.output_text.done", "response.content_part.done"]
            assert set(middle[1:-2]) <= {"response.output_text.delta"}
        elif item.type == "function_call":
            assert middle[-1] == "response.function_call_arguments.done"
            assert set(middle[:-1]) <= {"response.function_call_arguments.delta"}
        else:
            assert item.type == "reasoning" and middle[-1] == "response.reasoning_text.done"
            assert set(middle[:-1]) <= {"response.reasoning_text.delta"}


def _same_output(a, b) -> None:
    """Two responses' output items, ids aside (item ids and call ids are made per response)."""
    def strip(r):
        return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in r.output]

    assert strip(a) == strip(b)


def test_text_and_usage_match_the_chat_route(generated):
    response, chat = generated["plain"], generated["chat"]
    choice = chat.choices[0]
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == choice.message.content and response.output_text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    token_ids = choice.model_extra["token_ids"]
    usage = response.usage
    assert usage.output_tokens == len(token_ids) == chat.usage.completion_tokens
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    finished = "incomplete" if choice.finish_reason == "length" else "completed"
    assert response.status == message.status == finished
    assert response.temperature == 0 and response.max_output_tokens == 8 and response.store is False
    assert response.error is None and response.tools == [] and response.tool_choice == "auto"


def test_stream_adds_up_to_the_final_response_and_equals_the_non_streamed(generated):
    events, whole = generated["stream"], generated["plain"]
    _check_event_order(events)
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == deltas
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    _same_output(final, whole)
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [item.id for item in final.output] and final.id == events[0].response.id


def test_function_tools_give_calls_that_match_the_schema(generated):
    for response in (generated["required"], generated["named"]):
        assert response.status == "completed", response
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and all(item.type == "function_call" for item in response.output)
        for call in calls:
            assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
            jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert response.tools[0].name == "get_weather"
    assert generated["named"].tool_choice.name == "get_weather"


def test_streamed_call_arguments_add_up(generated):
    events, whole = generated["named_stream"], generated["named"]
    _check_event_order(events)
    final = events[-1].response
    _same_output(final, whole)
    [call] = final.output
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.name == "get_weather" and done.item_id == call.id
    [added] = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.call_id == call.call_id and added.item.name == "get_weather"


def test_round_trip_sends_the_calls_and_their_output_back(app, generated):
    """The earlier output items go back as they came (an assistant message, then its call: one
    assistant turn), and the prompt is the one the chat route renders for the same conversation."""
    [said], [call] = generated["plain"].output, generated["named"].output
    text = generated["plain"].output_text

    async def ask(client, _):
        follow = [{"role": "user", "content": ASK}, said.model_dump(exclude_none=True), call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}]
        return await asyncio.gather(
            client.responses.create(model=MODEL, input=follow, tools=[TOOL], max_output_tokens=4, temperature=0),
            client.chat.completions.create(
                model=MODEL, max_completion_tokens=4, temperature=0, tools=[{"type": "function", "function": {
                    k: TOOL[k] for k in ("name", "description", "parameters", "strict")}}],
                messages=[{"role": "user", "content": ASK},
                          {"role": "assistant", "content": text, "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]))

    response, chat = run(app, ask)
    assert response.status in ("completed", "incomplete") and response.output
    assert response.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt as the chat route renders


def test_parse_returns_the_pydantic_object(generated):
    for response in (generated["parsed0"], generated["parsed1"]):
        assert response.status == "completed", response.output_text
        assert isinstance(response.output_parsed, City), response.output_text
        assert City.model_validate_json(response.output_text) == response.output_parsed
        assert response.text.format.type == "json_schema"


def test_max_output_tokens_cut_is_incomplete(generated):
    response = generated["cut"]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    assert response.instructions == "You are terse."


def test_input_items_become_chat_messages():
    body = ResponsesRequest(instructions="sys", input=[
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ])
    assert input_messages(body) == [
        {"role": "system", "content": "sys"},
        {"role": "system", "content": "dev"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me see", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
    ]


@pytest.mark.parametrize("change, param", [
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "two words"}]}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": "many"}, "top_k"),
    ({"background": True}, "background"),
    ({"model": "other"}, "model"),
])
def test_bad_fields_are_400_naming_the_field(app, change, param):
    async def ask(client, http):
        raw = await http.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 4, **change})
        with pytest.raises(openai.APIStatusError) as e:
            await client.responses.create(model=MODEL, input="x", max_output_tokens=4, extra_body=change)
        return raw, e.value

    raw, error = run(app, ask)
    expected = 404 if param == "model" else 400
    assert raw.status_code == error.status_code == expected, raw.text
    assert error.body["param"] == param and raw.json()["error"]["param"] == param, raw.text


def test_a_normal_request_works_after_the_400s(app):
    async def ask(client, http):
        for bad in ({"previous_response_id": "x"}, {"input": [{"type": "nope"}]}):
            assert (await http.post("/v1/responses", json={"model": MODEL, "input": "x", **bad})).status_code == 400
        return await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)

    response = run(app, ask)
    assert response.usage.output_tokens >= 1 and response.status in ("completed", "incomplete")


def test_accepted_and_ignored_fields(app):
    async def ask(client, _):
        return await client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=2, store=True, reasoning={"effort": "low"}, metadata={"k": "v"},
            include=["reasoning.encrypted_content"], truncation="auto", user="u", tool_choice="auto",
            text={"format": {"type": "text"}})

    response = run(app, ask)
    assert response.store is False and response.metadata == {"k": "v"} and response.user == "u"


def test_an_error_after_the_stream_started_is_one_error_event(app, monkeypatch):
    from splash_jax.engine.async_engine import EngineDeadError

    async def broken(requests):
        raise EngineDeadError("the engine stopped")
        yield  # an async generator, as ServerContext.outputs is

    monkeypatch.setattr(app.state.ctx, "outputs", broken)

    async def ask(client, http):
        events = await _streamed(client, model=MODEL, input="Hi", max_output_tokens=2)
        raw = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True})
        return events, raw

    events, raw = run(app, ask)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert [e.sequence_number for e in events] == [0, 1, 2]
    assert events[-1].message == "the engine stopped" and events[-1].code == "service_unavailable_error"
    assert raw.status_code == 200 and raw.text.count("event: ") == 3 and "[DONE]" not in raw.text
    assert raw.text.rstrip().split("\n")[-2] == "event: error"
