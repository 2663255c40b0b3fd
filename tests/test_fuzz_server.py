"""Fuzzing the OpenAI surface: random requests mixing valid and invalid fields (hypothesis),
sent in concurrent batches to the app on a real engine while witness streams run beside them.

What must hold: no answer >= 500 (every bad value is a 400 naming a field, or 404/405/413);
every 200 is well formed (a stream ends with [DONE] and carries no error event); the witness
streams get exactly the output they get alone; at the end the engine is idle with every KV
page free. The fast profile (default suite) sends >= 400 requests; the slow one 25x more.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.app import build_app
from serve.config import ServerConfig
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.async_engine import AsyncEngine

ENGINE_ARGS = {"max_num_seqs": 32, "max_num_batched_tokens": 64, "page_size": 16, "max_pages": 512, "max_model_len": 256}
VOCAB = 1024  # ids below the bundled model's vocabulary; the strategies also send ids far above it
SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def app():
    aengine = AsyncEngine(Engine(EngineConfig(**ENGINE_ARGS, warmup=False, compile_cache_dir=None)))
    yield build_app(aengine, ServerConfig(served_model_name=["splash-tiny"]), shutdown_engine=False)
    aengine.shutdown()


# --- strategies: each field valid or not --------------------------------------------------------
def chance(p: float) -> st.SearchStrategy[bool]:
    """True with about probability p (hypothesis' own draws favour edge values)."""
    k = round(1 / p)
    return st.sampled_from([True] + [False] * (k - 1))


def either(valid, invalid, p_invalid=0.06):
    """A field's value: usually valid, sometimes invalid."""
    return chance(p_invalid).flatmap(lambda bad: invalid if bad else valid)


text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
BAD_TEXT = st.sampled_from(["", "a" + SURROGATE, SURROGATE * 3, "x" * 1_000_001])
FIELDS = {
    "max_tokens": either(st.integers(1, 4), st.sampled_from([0, -1, 10**20, "x", 2.5, None, True])),
    "temperature": either(st.sampled_from([0, 0.0, 0.5, 1.0]), st.sampled_from([-1, 1e9, "hot", float("nan"), float("inf")])),
    "top_p": either(st.floats(0.3, 1.0), st.sampled_from([0, 1.5, -1, "p"])),
    "top_k": either(st.sampled_from([-1, 0, 1, 5, 50]), st.sampled_from([2**40, -5, VOCAB * 1000, 1.5, "k"])),
    "n": either(st.integers(1, 2), st.sampled_from([0, -1, 10**6, 129, "2"])),
    "seed": either(st.one_of(st.none(), st.integers(0, 2**31)), st.sampled_from([2**70, -(2**70), "s", 1.5])),
    "stop": either(st.one_of(text, st.lists(text, max_size=3)), st.sampled_from([[""], ["x" * 2000], ["y"] * 100, 5, [1], [SURROGATE]])),
    "stop_token_ids": either(st.lists(st.integers(0, VOCAB - 1), max_size=2), st.sampled_from([[10**9], [-1], list(range(50)), ["a"], 7])),
    "ignore_eos": either(st.booleans(), st.sampled_from(["maybe", 3])),
    "stream": either(st.booleans(), st.sampled_from(["yes", 2])),
    "stream_options": either(st.sampled_from([None, {"include_usage": True}]), st.sampled_from([{"include_usage": "x"}, 3])),
    "presence_penalty": either(st.sampled_from([0, 0, 0, 0.5, -2]), st.sampled_from([5, "p"])),
    "frequency_penalty": either(st.sampled_from([0, 0, 0, 1.0]), st.just(-3)),
    "repetition_penalty": either(st.sampled_from([1, 1, 1, 1.2]), st.sampled_from([0, -1])),
    "min_p": either(st.sampled_from([0, 0, 0, 0.1]), st.just(2)),
    "min_tokens": either(st.sampled_from([0, 0, 0, 1]), st.sampled_from([-1, 10**9])),
    "logit_bias": either(st.sampled_from([{}, {}, {}, {"5": 10}]), st.sampled_from([{"abc": 1}, {"5": 1000}, {str(i): 1 for i in range(500)}, []])),
    "model": either(st.sampled_from(["splash-tiny", "", None]), st.sampled_from(["nope", 7, "m" + SURROGATE])),
    "user": st.one_of(text, st.just(SURROGATE)),
    "cache_salt": either(st.one_of(st.none(), text), st.sampled_from(["", 5, SURROGATE, "s" * 5000])),
    "unknown_field": st.one_of(st.none(), text, st.integers()),
    "return_token_ids": st.booleans(),
}
COMPLETION_FIELDS = {
    "prompt": either(
        st.one_of(text, ids, st.lists(text, min_size=1, max_size=3), st.lists(ids, min_size=1, max_size=2)),
        st.one_of(BAD_TEXT, st.sampled_from([[], [[]], [10**12], [[1], "a"], None, 5, ["p"] * 300, list(range(300))])),
    ),
    "logprobs": either(st.one_of(st.none(), st.integers(0, 5)), st.sampled_from([21, -1, 10**9, "l"])),
    "echo": st.booleans(),
    "best_of": either(st.sampled_from([None, 1]), st.sampled_from([3, "b"])),
    "suffix": either(st.sampled_from([None, ""]), st.just("tail")),
}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": text})
CHAT_FIELDS = {
    "messages": either(
        st.lists(message, min_size=1, max_size=3),
        st.sampled_from([[], [{"content": "no role"}], [{"role": "user", "content": "bad" + SURROGATE}], 5,
                         [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "user", "content": "x"}] * 2000]),
    ),
    "max_completion_tokens": either(st.sampled_from([None, 1, 3]), st.sampled_from([0, 10**9])),
    "logprobs": either(st.booleans(), st.sampled_from(["l", 3])),
    "top_logprobs": either(st.one_of(st.none(), st.integers(0, 5)), st.sampled_from([30, -1])),
    "tools": either(st.sampled_from([None, []]), st.just([{"type": "function"}])),
}

item = st.one_of(message, st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text, "output": text}),
                 st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "input_image", "function_call"])}))
RESPONSES_FIELDS = {  # /v1/responses: max_output_tokens is set below, so runs stay short
    "input": either(st.one_of(text, st.lists(message, min_size=1, max_size=3)),
                    st.one_of(BAD_TEXT, st.lists(item, min_size=1, max_size=3), st.sampled_from([[], 5, None]))),
    "instructions": either(st.one_of(st.none(), text), st.sampled_from([5, SURROGATE])),
    "text": either(st.sampled_from([None, {"format": {"type": "text"}}]),
                   st.sampled_from([{"format": {"type": "xml"}}, {"format": {"type": "json_schema"}}, "t"])),
    "tools": either(st.sampled_from([None, []]), st.sampled_from([[{"type": "web_search"}], [{"type": "function"}]])),
    "previous_response_id": either(st.none(), st.just("resp_1")),
    "store": st.booleans(),
}


@st.composite
def requests(draw):
    """(method, path, body bytes, content type): mostly JSON with a random subset of fields."""
    kind = draw(st.sampled_from(["completions"] * 12 + ["chat"] * 7 + ["responses"] * 3 + ["raw"]))
    if kind == "raw":
        body = draw(st.sampled_from([b"{", b"[]", b"null", b'{"prompt": "x"', b"\xff\xfe", b"", b'{"prompt": 1e999}']))
        return draw(st.sampled_from(["POST", "GET", "PUT"])), "/v1/completions", body, "application/json"
    own = {"completions": COMPLETION_FIELDS, "chat": CHAT_FIELDS, "responses": RESPONSES_FIELDS}[kind]
    fields = {**FIELDS, **own}
    required = {"completions": "prompt", "chat": "messages", "responses": "input"}[kind]
    chosen = draw(st.sets(st.sampled_from(sorted(fields)), max_size=8))
    body = {name: draw(fields[name]) for name in sorted(chosen | {required, "max_tokens"})}
    if kind == "responses":
        max_tokens = body.pop("max_tokens")
        body["max_output_tokens"] = 2 if max_tokens is None else max_tokens
    if kind == "chat" and body.get("max_completion_tokens") is None and body["max_tokens"] is None:
        body["max_tokens"] = 2  # chat's default (the rest of the context) is too long for a fuzz run
    if draw(chance(1 / 20)):
        body.pop(required)  # a missing required field now and then
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}[kind]
    return "POST", path, json.dumps(body).encode(), draw(either(st.just("application/json"), st.just("text/plain"), 0.02))


# --- checks ---------------------------------------------------------------------------------
def check_response(method: str, response: httpx.Response) -> None:
    status = response.status_code
    assert status < 500, response.text
    assert status in (200, 400, 404, 405, 413), (status, response.text)
    if status != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        if status == 405:
            assert response.headers["allow"] == "POST"
        return
    if str(response.request.url).endswith("/v1/responses"):
        return check_responses_answer(response)
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-300:]
        finished: dict[int, int] = {}
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                if choice.get("finish_reason"):
                    assert choice["finish_reason"] in ("stop", "length"), choice
                    finished[choice["index"]] = finished.get(choice["index"], 0) + 1
        assert finished and set(finished.values()) == {1}, finished
    else:
        body = response.json()
        assert body["choices"] and all(c["finish_reason"] in ("stop", "length") for c in body["choices"]), body
        assert sorted(c["index"] for c in body["choices"]) == list(range(len(body["choices"])))


def check_responses_answer(response: httpx.Response) -> None:
    """A 200 from /v1/responses: a whole response, or typed events ending with the whole response."""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: ")]
        assert events and all(e["type"] != "error" for e in events), response.text[-300:]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        body = events[-1]["response"]
    else:
        body = response.json()
    assert body["object"] == "response" and body["status"] in ("completed", "incomplete") and body["output"], body


async def _send(app, batch) -> list[tuple[str, httpx.Response]]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=120) as client:
        calls = [client.request(m, p, content=b, headers={"content-type": ct}) for m, p, b, ct in batch]
        return list(zip((m for m, *_ in batch), await asyncio.gather(*calls)))


WITNESSES = [
    {"prompt": "Latent attention caches", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    {"prompt": [11, 12, 13, 14, 15], "max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 5, "stream": True},
    {"messages": [{"role": "user", "content": "What is MLA?"}], "max_tokens": 20, "temperature": 0, "stream": True},
]


async def _witness(app, body: dict) -> tuple[list[int], str]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://witness", timeout=120) as client:
        response = await client.post(path, json={**body, "return_token_ids": True})
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice.get("text", choice.get("message", {}).get("content"))
    tokens, text = [], ""
    for line in response.text.split("\n"):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                tokens += choice.get("token_ids") or []
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return tokens, text


class Witnesses:
    """Streams that run beside the fuzz in their own thread and event loop, each compared with
    what it got alone."""

    def __init__(self, app):
        self.app = app
        self.alone = [asyncio.run(_witness(app, w)) for w in WITNESSES]
        self.runs, self.mismatches, self.errors = 0, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        async def main():
            while not self._stop.is_set():
                got = await asyncio.gather(*(_witness(self.app, w) for w in WITNESSES), return_exceptions=True)
                for w, want, have in zip(WITNESSES, self.alone, got):
                    if isinstance(have, BaseException):
                        self.errors.append(repr(have))
                    elif have != want:
                        self.mismatches.append((w, want, have))
                self.runs += 1

        asyncio.run(main())

    def __enter__(self) -> "Witnesses":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)


def _wait_idle(app, timeout: float = 30.0) -> dict:
    engine = app.state.ctx.engine
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.call(lambda e: e.stats()).result(timeout=30)
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["pages_used"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def run_fuzz(app, examples: int, derandomize: bool) -> None:
    sent: list[int] = []
    statuses: collections.Counter = collections.Counter()

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(requests(), min_size=8, max_size=10))
    def fuzz(batch):
        for method, response in asyncio.run(_send(app, batch)):
            check_response(method, response)
            statuses[response.status_code] += 1
        sent.append(len(batch))

    with Witnesses(app) as witnesses:
        fuzz()
    assert sum(sent) >= 8 * examples
    assert statuses[200] >= sum(sent) // 5 and statuses[400] >= sum(sent) // 5, statuses  # both kinds, many
    assert not witnesses.errors and not witnesses.mismatches, (witnesses.errors[:2], witnesses.mismatches[:2])
    assert witnesses.runs >= 1
    stats = _wait_idle(app)
    assert stats["running"] == stats["waiting"] == stats["pages_used"] == 0, stats
    print(f"\n{sum(sent)} fuzz requests {dict(statuses)}, {witnesses.runs} witness rounds unchanged")


def test_fuzz_requests_fast(app):
    run_fuzz(app, examples=50, derandomize=True)  # -m slow runs 1,250


@pytest.mark.slow
def test_fuzz_requests_long(app):
    run_fuzz(app, examples=1250, derandomize=False)
