"""Structured outputs and prompt logprobs through the OpenAI API (the app in-process, bundled
model): the `openai` client's `chat.completions.parse` returns the parsed object, response_format
and structured_outputs constrain both endpoints, a constraint that does not compile is a 400
naming its field, and echo + logprobs returns the engine's prompt logprobs in lm-eval's shape."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pydantic
import pytest

from serve.app import build_app
from serve.config import ServerConfig
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.async_engine import AsyncEngine

ENGINE_ARGS = {"max_num_seqs": 16, "max_num_batched_tokens": 64, "page_size": 16, "max_pages": 256, "max_model_len": 256}
PROMPT_IDS = [1, 50, 300, 12, 999, 77, 2000, 8, 64, 3000, 5, 42, 420, 1234]  # lm-eval sends token ids


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    celsius: int = pydantic.Field(ge=-50, le=60)
    rain: bool


@pytest.fixture(scope="module")
def served():
    engine = Engine(EngineConfig(**ENGINE_ARGS, warmup=False, compile_cache_dir=None))
    # The reference, on the same engine before the server takes it: prompt logprobs with top-1.
    ref = engine.generate([PROMPT_IDS], [SamplingParams(max_tokens=1, prompt_logprobs=1)])[0]
    aengine = AsyncEngine(engine)
    app = build_app(aengine, ServerConfig(served_model_name=["splash-tiny"]), shutdown_engine=False)
    yield app, ref
    aengine.shutdown()


def run(app, fn):
    """fn(AsyncOpenAI client, raw httpx client) against the app in-process."""

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            return await fn(client, http)

    return asyncio.run(main())


def test_openai_parse_returns_the_pydantic_object(served):
    app, _ = served

    async def fn(client, _):
        return await asyncio.gather(*[client.chat.completions.parse(
            model="splash-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], response_format=Weather,
            temperature=1.0, seed=s, max_tokens=120) for s in range(4)])

    for completion in run(app, fn):
        message = completion.choices[0].message
        assert isinstance(message.parsed, Weather), message.content
        assert Weather.model_validate_json(message.content) == message.parsed


def test_json_object_regex_and_choice_on_both_endpoints(served):
    app, _ = served

    async def fn(client, _):
        obj = await client.chat.completions.create(model="splash-tiny", messages=[{"role": "user", "content": "JSON"}],
                                                   response_format={"type": "json_object"}, max_tokens=150, seed=1)
        rx = await client.completions.create(model="splash-tiny", prompt="Code:", max_tokens=20, temperature=1.0, seed=2,
                                             extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}})
        choice = await client.completions.create(model="splash-tiny", prompt="Pick:", max_tokens=20, temperature=1.0, seed=3,
                                                 extra_body={"guided_choice": ["left", "right"]})
        stream = await client.chat.completions.create(
            model="splash-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=20, temperature=1.0, seed=4,
            stream=True, extra_body={"structured_outputs": {"choice": ["up", "down"]}})
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return obj, rx, choice, text

    obj, rx, choice, streamed = run(app, fn)

    async def metrics(_, http):
        for _ in range(50):  # the engine's stats snapshot refreshes every 0.25 s
            text = (await http.get("/metrics")).text
            if re.search(r"^splash_grammar_mask_fills_total [1-9]", text, re.M):
                return text
            await asyncio.sleep(0.1)
        return text

    text = run(app, metrics)
    for name in ("splash_grammar_mask_fills_total", "splash_grammar_constrained_rows_total", "splash_grammar_mask_seconds_total"):
        assert re.search(rf"^{name} [0-9.e+-]+$", text, re.M), name
    assert re.search(r"^splash_grammar_mask_fills_total [1-9]", text, re.M), text[-2000:]
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", rx.choices[0].text) and rx.choices[0].finish_reason == "stop"
    assert choice.choices[0].text in ("left", "right")
    assert streamed in ("up", "down")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(served, body, param):
    app, _ = served

    async def fn(_, http):
        chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body})
        completion = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})
        fine = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        return chat, completion, fine

    for response in run(app, fn)[:2]:
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert run(app, fn)[2].status_code == 200


def test_echo_with_logprobs_returns_the_prompt_logprobs_as_lm_eval_reads_them(served):
    app, ref = served
    body = {"model": "splash-tiny", "prompt": PROMPT_IDS, "echo": True, "logprobs": 1, "temperature": 0}

    async def fn(_, http):
        one = await http.post("/v1/completions", json={**body, "max_tokens": 1})
        zero = await http.post("/v1/completions", json={**body, "max_tokens": 0})
        extra = await http.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 2})
        async with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 3, "stream": True}) as r:
            events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
        return one.json(), zero.json(), extra.json(), events

    one, zero, extra, events = run(app, fn)
    lp = one["choices"][0]["logprobs"]
    n = len(PROMPT_IDS)
    assert len(lp["token_logprobs"]) == n + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-5)
    for top, want in zip(lp["top_logprobs"][1:n], ref.prompt_top_logprobs[1:]):
        assert list(top.values()) == pytest.approx(list(want.values()), abs=1e-5)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # lm-eval's loglikelihood: sum(token_logprobs[ctxlen:-1]); max_tokens 0 gives the prompt alone.
    zlp = zero["choices"][0]["logprobs"]
    assert zlp["token_logprobs"] == lp["token_logprobs"][:n] and zero["usage"]["completion_tokens"] == 0
    assert zero["choices"][0]["text"] == one["choices"][0]["text"][: len(zero["choices"][0]["text"])]
    entries = extra["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == n and extra["choices"][0]["prompt_token_ids"] == PROMPT_IDS
    for p, entry in enumerate(entries[1:], start=1):
        assert entry[str(PROMPT_IDS[p])]["logprob"] == pytest.approx(ref.prompt_logprobs[p], abs=1e-5)
    streamed = [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[:n] == lp["token_logprobs"][:n] and len(streamed) == n + 3
