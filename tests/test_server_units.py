"""The server's parts without a model: AsyncEngine's threading contract on a fake engine,
request validation and limits (400s naming the request's field), error shapes, the API key."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types

import httpx
import pytest

from serve.app import build_app
from serve.config import ServerConfig, ServerLimits
from serve.errors import describe_validation_errors
from splash_jax.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from splash_jax.engine.request_factory import EngineFacts
from splash_jax.engine.request import Request, RequestError, RequestOutput, SamplingParams


VOCAB = 1000


class FakeSwitch:
    """A layout switch that migrates for three engine steps (or is refused at once)."""

    def __init__(self, src: str, dst: str, refused: str | None = None):
        self.src, self.dst, self.reason, self.steps = src, dst, refused, 0
        self.state = "refused" if refused else "migrating"

    @property
    def done(self) -> bool:
        return self.state != "migrating"

    def as_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "state": self.state, "reason": self.reason, "progress": self.steps / 3}


class FakeEngine:
    """Engine's contract without a model: every step gives each request one token (its count).

    Records the thread of every call that must stay on the engine thread.
    """

    def __init__(self, step_s: float = 0.001):
        self.step_s = step_s
        self.requests: dict[str, Request] = {}
        self.aborted: list[str] = []
        self.finished: list[Request] = []
        self.threads: set[int] = set()
        self.fail_next_step = False
        self.scheduler = types.SimpleNamespace(waiting=[])
        self.config = types.SimpleNamespace(model="", enable_switching=True)
        self.layout, self.switch, self.switches = "tp", None, 0
        self.tokenizer = None
        self.max_model_len = 1000
        self.model_config = types.SimpleNamespace(vocab_size=VOCAB)
        self.eos_ids = {2}
        self.tokenize_s = 0.0  # simulated tokenization time (blocks the calling thread)
        self.ids = 0
        self.num_steps = 0
        # a prefix cache in miniature: a prompt seen before under the same salt has all but its last token cached
        self.salts: dict[str, str | None] = {}  # request id -> the cache_salt it was made with
        self.cached: dict[str, int] = {}  # request id -> its cached prompt tokens (from its first step)
        self.seen_prompts: set[tuple] = set()
        self.prefix_cache_stats: dict | None = None  # stats()["prefix_cache"] when set
        self.facts = EngineFacts(vocab_size=VOCAB, max_model_len=self.max_model_len, max_stop_token_ids=16,
                                 max_logit_bias=64, eos_ids=[2], model="", enable_switching=True)
        self.last: FakeSwitch | None = None

    def make_request(self, prompt, params=None, request_id=None, cache_salt=None) -> Request:
        params = params or SamplingParams()
        params.validate(VOCAB)
        if not prompt:
            raise RequestError("the prompt is empty")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError("cache_salt must be a string", "cache_salt")
        time.sleep(self.tokenize_s)
        ids = [ord(c) % VOCAB for c in prompt] if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= t < VOCAB for t in ids):
            raise RequestError("prompt token id outside the vocabulary")
        self.ids += 1
        rid = request_id or f"fake-{self.ids}"
        self.salts[rid] = cache_salt
        return Request(rid, ids, params)

    def add_request(self, request: Request) -> str:
        self.threads.add(threading.get_ident())
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        return request.request_id

    def abort(self, request_id: str) -> bool:
        self.threads.add(threading.get_ident())
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.requests) or self.switch is not None

    def switch_layout(self, dst: str, preempt: bool = False) -> FakeSwitch:
        self.threads.add(threading.get_ident())
        if dst not in ("tp", "dp", "dop", "cp"):
            raise ValueError(f"unknown layout {dst!r}")
        if dst == "cp" and not preempt:
            return FakeSwitch(self.layout, dst, refused="the running requests do not fit")
        self.switch = self.last = FakeSwitch(self.layout, dst)
        return self.switch

    def switch_done(self) -> bool:
        return self.switch is None

    def last_switch(self) -> dict | None:
        return self.last.as_dict() if self.last is not None else None

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.get_ident())
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        self.num_steps += 1
        if self.switch is not None:  # migrate between steps, hand off at the boundary
            self.switch.steps += 1
            if self.switch.steps == 3:
                self.switch.state, self.layout, self.switch, self.switches = "done", self.switch.dst, None, self.switches + 1
        outputs = []
        for r in list(self.requests.values()):
            if r.request_id not in self.cached:  # its first step: look the prompt up, then cache it
                key = (self.salts.get(r.request_id), tuple(r.prompt_ids))
                self.cached[r.request_id] = len(r.prompt_ids) - 1 if key in self.seen_prompts else 0
                self.seen_prompts.add(key)
            r.output_ids.append(len(r.output_ids))
            done = len(r.output_ids) >= r.params.max_tokens
            if done:
                del self.requests[r.request_id]
                self.finished.append(r)
            outputs.append(RequestOutput(
                request_id=r.request_id, prompt_ids=r.prompt_ids, token_ids=list(r.output_ids), text="",
                delta_text=f"<{r.output_ids[-1]}>", delta_token_ids=r.output_ids[-1:], finished=done,
                finish_reason="length" if done else None, num_cached_tokens=self.cached[r.request_id],
            ))
        return outputs

    def stats(self) -> dict:
        stats = {
            "running": len(self.requests), "waiting": 0, "pages_used": 0, "pages_total": 1, "layout": self.layout,
            "switches": self.switches, "switch": self.switch.as_dict() if self.switch else None,
        }
        if self.prefix_cache_stats is not None:
            stats["prefix_cache"] = dict(self.prefix_cache_stats)
        return stats


@pytest.fixture
def fake():
    engine = FakeEngine()
    aengine = AsyncEngine(engine)
    yield engine, aengine
    aengine.shutdown()


def _ids(outs) -> list[int]:
    return [t for o in outs for t in o.delta_token_ids]


async def _collect(aengine, prompt, max_tokens, request_id=None):
    return [o async for o in aengine.generate(prompt, SamplingParams(max_tokens=max_tokens), request_id)]


def test_concurrent_requests_complete_and_steps_stay_on_the_engine_thread(fake):
    engine, aengine = fake

    async def main():
        return await asyncio.gather(*(_collect(aengine, [1, 2], 3 + i % 5) for i in range(50)))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert [o.delta_token_ids for o in outs] == [[k] for k in range(3 + i % 5)]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert engine.threads == {aengine._thread.ident}
    # A second event loop (a notebook cell after another) is served the same way.
    assert _ids(asyncio.run(_collect(aengine, [1], 2))) == [0, 1]


def test_closing_the_stream_aborts_the_request(fake):
    engine, aengine = fake

    async def main():
        stream = aengine.generate([1], SamplingParams(max_tokens=10_000), "leaver")
        seen = 0
        async for out in stream:
            seen += len(out.delta_token_ids)
            if seen == 3:
                break
        await stream.aclose()
        for _ in range(200):
            if "leaver" in engine.aborted:
                break
            await asyncio.sleep(0.005)

    asyncio.run(main())
    assert "leaver" in engine.aborted and "leaver" not in engine.requests


def test_cancelled_task_aborts_its_request(fake):
    engine, aengine = fake

    async def main():
        task = asyncio.ensure_future(_collect(aengine, [1], 10_000, "cancelled"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert "cancelled" in engine.aborted and not engine.requests


def test_a_failed_step_fails_its_requests_and_the_loop_keeps_serving(fake):
    engine, aengine = fake

    async def main():
        victim = asyncio.ensure_future(_collect(aengine, [1], 10_000, "victim"))
        await asyncio.sleep(0.02)
        engine.fail_next_step = True
        with pytest.raises(EngineStepError, match="injected step failure"):
            await victim
        return await _collect(aengine, [1], 4)

    after = asyncio.run(main())
    assert _ids(after) == [0, 1, 2, 3]
    assert aengine.num_step_errors == 1 and aengine.stats()["step_errors"] == 1
    assert "victim" in engine.aborted


def test_a_rejected_request_fails_alone(fake):
    engine, aengine = fake

    async def main():
        first = asyncio.ensure_future(_collect(aengine, [1], 200, "dup"))
        await asyncio.sleep(0.02)
        with pytest.raises(RequestError, match="already in use"):
            await _collect(aengine, [1], 2, "dup")
        return await first

    assert _ids(asyncio.run(main())) == list(range(200))


def test_abort_from_outside_ends_the_stream_with_abort(fake):
    engine, aengine = fake

    async def main():
        outs = []
        async for out in aengine.generate([1], SamplingParams(max_tokens=10_000), "ext"):
            outs.append(out)
            if len(outs) == 2:
                aengine.abort("ext")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert _ids(outs)[:2] == [0, 1]


def test_call_runs_on_the_engine_thread(fake):
    engine, aengine = fake
    ident = asyncio.run(aengine.run_on_engine(lambda e: threading.get_ident()))
    assert ident == aengine._thread.ident != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        aengine.call(lambda e: 1 / 0).result(timeout=5)


def test_shutdown_ends_running_streams_and_refuses_new_ones():
    engine = FakeEngine()
    aengine = AsyncEngine(engine)

    async def main():
        task = asyncio.ensure_future(_collect(aengine, [1], 10_000))
        await asyncio.sleep(0.02)
        await asyncio.to_thread(aengine.shutdown)
        return await task

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "abort"
    assert not aengine.is_running and not aengine.stats()["engine_alive"]
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(aengine, [1], 2))


def test_validation_errors_name_the_field_once():
    errors = [
        {"loc": ("body", "prompt", "str"), "msg": "Input should be a valid string"},
        {"loc": ("body", "prompt", "list[int]"), "msg": "Input should be a valid list"},
    ]
    message, param = describe_validation_errors(errors)
    assert message == "malformed request body: prompt: expected one of str, list[int]" and param == "prompt"


# --- the app without a model ---------------------------------------------------------------
def _ascii_json(kw: dict) -> dict:
    """JSON bodies with ASCII escapes, as clients send them (httpx cannot encode a lone surrogate)."""
    if "json" not in kw:
        return kw
    kw = dict(kw)
    return {**kw, "content": json.dumps(kw.pop("json")).encode(), "headers": {"content-type": "application/json"}}


def _ask(app, *calls):
    """Run (method, path, kwargs) calls against the app in-process; their responses."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.request(method, path, **_ascii_json(kw)) for method, path, kw in calls]

    return asyncio.run(main())


def test_api_key_guards_v1_routes_only(fake):
    engine, aengine = fake
    app = build_app(aengine, ServerConfig(api_key="sekrit", served_model_name=["fake"]))
    denied, allowed, health = _ask(
        app, ("GET", "/v1/models", {}), ("GET", "/v1/models", {"headers": {"Authorization": "Bearer sekrit"}}),
        ("GET", "/health", {}),
    )
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert allowed.status_code == 200 and allowed.json()["data"][0]["id"] == "fake"
    assert health.status_code == 200


def test_layout_switch_routes(fake):
    engine, aengine = fake
    app = build_app(aengine, ServerConfig(served_model_name=["fake"]))
    before, switched, after, refused, unknown, metrics = _ask(
        app,
        ("GET", "/v1/layout", {}),
        ("POST", "/v1/layout", {"json": {"layout": "dp", "wait": True}}),
        ("GET", "/v1/layout", {}),
        ("POST", "/v1/layout", {"json": {"layout": "cp"}}),
        ("POST", "/v1/layout", {"json": {"layout": "zz"}}),
        ("GET", "/metrics", {}),
    )
    assert before.json() == {"layout": "tp", "num_switches": 0, "switching_available": True, "switch": None}
    assert switched.status_code == 200 and switched.json()["result"]["state"] == "done"
    assert switched.json()["layout"] == "dp" and after.json()["num_switches"] == 1
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "layout_switch_refused"
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "layout"
    assert "splash_layout_switches_total 1.0" in metrics.text and 'splash_layout_info{layout="dp"} 1.0' in metrics.text
    assert engine.threads == {aengine._thread.ident}  # switch_layout ran on the engine thread


# --- admission: every field bounded, 400s naming the request's own field ---------------------
def _completion(**fields) -> tuple[str, str, dict]:
    return ("POST", "/v1/completions", {"json": {"prompt": [1, 2, 3], "max_tokens": 3, **fields}})


def _chat(**fields) -> tuple[str, str, dict]:
    return ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}], **fields}})


BAD_REQUESTS = [
    (_completion(top_k=1099511627776), "top_k"),  # the case: overflowed an int32 in the step
    (_completion(top_k=VOCAB + 1), "top_k"),
    (_completion(top_k=-2), "top_k"),
    (_completion(seed=2**64), "seed"),
    (_completion(n=0), "n"),
    (_completion(n=129), "n"),
    (_completion(n=100, prompt=[[1], [2], [3]]), "prompt"),  # 300 choices > max_choices
    (_completion(best_of=3), "best_of"),
    (_completion(max_tokens=0), "max_tokens"),
    (_completion(max_tokens=10**30), "max_tokens"),  # context_length_exceeded
    (_completion(temperature=-1), "temperature"),
    (_completion(temperature=1e300), "temperature"),
    (_completion(top_p=0), "top_p"),
    (_completion(logprobs=21), "logprobs"),
    (_completion(stop=["x"] * 33), "stop"),
    (_completion(stop="x" * 1025), "stop"),
    (_completion(stop=[""]), "stop"),
    (_completion(stop=["ok\ud800"]), "stop"),
    (_completion(stop_token_ids=list(range(17))), "stop_token_ids"),
    (_completion(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (_completion(prompt="abc\ud800def"), "prompt"),  # a lone surrogate: was a 500
    (_completion(prompt=["fine", "x" * 1_000_001]), "prompt"),
    (_completion(prompt=[[1, 2], [VOCAB + 5]]), "prompt"),
    (_completion(prompt=list(range(1000))), "prompt"),  # >= max_model_len tokens
    (_completion(prompt=[[]]), "prompt"),
    (_completion(prompt=[]), "prompt"),
    (_completion(prompt=[["a"]]), "prompt"),  # wrong type
    (_completion(max_tokens="many"), "max_tokens"),
    (_completion(stream_options={"include_usage": True}), "stream_options"),
    (_completion(presence_penalty=2.5), "presence_penalty"),
    (_completion(frequency_penalty=-3), "frequency_penalty"),
    (_completion(repetition_penalty=0), "repetition_penalty"),
    (_completion(min_p=1.5), "min_p"),
    (_completion(min_tokens=5, max_tokens=3), "min_tokens"),
    (_completion(logit_bias={"abc": 1}), "logit_bias"),
    (_completion(logit_bias={"5": 101}), "logit_bias"),
    (_completion(logit_bias={"5": 1, "05": 2}), "logit_bias"),
    (_completion(logit_bias={str(i): 1 for i in range(65)}), "logit_bias"),
    (_completion(logit_bias={str(VOCAB): 1}), "logit_bias"),
    (_completion(model="gpt-\ud800"), "model"),  # 404, the name escaped in the message
    (_chat(max_completion_tokens=0), "max_completion_tokens"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(logprobs=True, top_logprobs=30), "top_logprobs"),
    (_chat(messages=[{"role": "user", "content": "bad \udfff"}]), "messages"),
    (_chat(messages=[{"role": "user", "content": "hi"}] * 1025), "messages"),
    (_chat(messages=[]), "messages"),
    (_chat(messages=[{"content": "no role"}]), "messages"),
    (_completion(cache_salt=5), "cache_salt"),  # not a string
    (_completion(cache_salt=["a"]), "cache_salt"),
    (_completion(cache_salt=""), "cache_salt"),
    (_completion(cache_salt="s" * 1025), "cache_salt"),
    (_completion(cache_salt="salt\ud800"), "cache_salt"),
    (_chat(cache_salt={"a": 1}), "cache_salt"),
    (_chat(cache_salt=""), "cache_salt"),
]


@pytest.mark.parametrize("call, param", BAD_REQUESTS, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_REQUESTS)])
def test_bad_fields_answer_400_naming_the_field(fake, call, param):
    engine, aengine = fake
    app = build_app(aengine, ServerConfig(served_model_name=["fake"]))
    (response,) = _ask(app, call)
    body = response.json()
    assert response.status_code == (404 if param == "model" else 400), body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"], body
    assert not engine.requests and not engine.aborted  # nothing reached the engine


def test_malformed_bodies_405_and_413(fake):
    engine, aengine = fake
    app = build_app(aengine, ServerConfig(served_model_name=["fake"], limits=ServerLimits(max_body_bytes=1000)))

    async def chunked():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    not_json, not_object, wrong_method, too_big, too_big_chunked, ok = _ask(
        app,
        ("POST", "/v1/completions", {"content": b'{"prompt": [1, 2', "headers": {"content-type": "application/json"}}),
        ("POST", "/v1/completions", {"json": [1, 2]}),
        ("GET", "/v1/completions", {}),
        ("POST", "/v1/completions", {"json": {"prompt": "x" * 2000}}),
        ("POST", "/v1/completions", {"content": chunked(), "headers": {"content-type": "application/json"}}),
        ("POST", "/v1/completions", {"json": {"prompt": [1], "max_tokens": 2}}),
    )
    assert not_json.status_code == 400 and not_json.json()["error"]["param"] is None
    assert "not valid JSON" in not_json.json()["error"]["message"]
    assert not_object.status_code == 400
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    for r in (too_big, too_big_chunked):
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_penalties_reach_the_engine(fake):
    engine, aengine = fake
    app = build_app(aengine, ServerConfig(served_model_name=["fake"]))
    (response,) = _ask(app, _completion(
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_p=0.1, min_tokens=2, logit_bias={"5": -100}
    ))
    assert response.status_code == 200, response.json()
    (request,) = engine.finished
    p = request.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (0.5, -0.5, 1.2, 0.1, 2)
    assert p.logit_bias == {5: -100.0}


# --- prefix caching: cache_salt, usage.prompt_tokens_details.cached_tokens, metrics --------------
class FakeChatTokenizer:
    """Just enough tokenizer for /v1/chat/completions on the fake engine."""

    vocab_size = VOCAB

    @staticmethod
    def apply_chat_template(messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    @staticmethod
    def encode(text, add_bos=True):
        return [ord(c) % VOCAB for c in text]


def _usage(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: {")]
        assert events[-1]["choices"] == [] and all(e.get("usage") is None for e in events[:-1])
        return events[-1]["usage"]
    return response.json()["usage"]


def test_usage_reports_the_cached_prompt_tokens(fake):
    engine, aengine = fake
    engine.tokenizer = FakeChatTokenizer()
    app = build_app(aengine, ServerConfig(served_model_name=["fake"]))
    prompt = list(range(10, 50))
    chat = {"messages": [{"role": "user", "content": "a long question"}], "max_tokens": 2}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    first, again, streamed, two_prompts, chat_first, chat_again, chat_streamed, chat_n = map(_usage, _ask(
        app,
        _completion(prompt=prompt),
        _completion(prompt=prompt),
        _completion(prompt=prompt, **stream),
        _completion(prompt=[prompt, list(range(60, 70))], n=3),
        ("POST", "/v1/chat/completions", {"json": chat}),
        ("POST", "/v1/chat/completions", {"json": chat}),
        ("POST", "/v1/chat/completions", {"json": {**chat, **stream}}),
        ("POST", "/v1/chat/completions", {"json": {**chat, "n": 2}}),
    ))
    assert first == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43, "prompt_tokens_details": {"cached_tokens": 0}}
    assert again["prompt_tokens_details"] == streamed["prompt_tokens_details"] == {"cached_tokens": 39}
    # n choices: each prompt counted once, in prompt_tokens and in cached_tokens (its first choice's;
    # the fake caches the other choices of the new prompt on their shared first step, so they would say 9)
    assert two_prompts["prompt_tokens"] == 40 + 10 and two_prompts["completion_tokens"] == 2 * 3 * 3
    assert two_prompts["prompt_tokens_details"] == {"cached_tokens": 39 + 0}
    chat_len = len(FakeChatTokenizer.encode(FakeChatTokenizer.apply_chat_template(chat["messages"])))
    assert chat_first["prompt_tokens"] == chat_len and chat_first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert chat_again["prompt_tokens_details"] == chat_streamed["prompt_tokens_details"] == {"cached_tokens": chat_len - 1}
    assert chat_n["prompt_tokens"] == chat_len and chat_n["prompt_tokens_details"] == {"cached_tokens": chat_len - 1}
    assert set(engine.salts.values()) == {None}  # unsalted requests carry no salt


def test_cache_salt_reaches_every_choice_and_separates_the_cache(fake):
    engine, aengine = fake
    engine.tokenizer = FakeChatTokenizer()
    app = build_app(aengine, ServerConfig(served_model_name=["fake"]))
    prompt = list(range(10, 30))
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    plain, salted, salted_again, other, chat_salted, chat_salted_again = map(_usage, _ask(
        app,
        _completion(prompt=prompt),
        _completion(prompt=prompt, cache_salt="tenant-a", n=2),
        _completion(prompt=prompt, cache_salt="tenant-a"),
        _completion(prompt=prompt, cache_salt="tenant-b", stream=True, stream_options={"include_usage": True}),
        ("POST", "/v1/chat/completions", {"json": {**chat, "cache_salt": "tenant-a"}}),
        ("POST", "/v1/chat/completions", {"json": {**chat, "cache_salt": "tenant-a"}}),
    ))
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in (plain, salted, salted_again, other)]
    assert cached == [0, 0, 19, 0]  # the unsalted prompt is not shared with tenant-a, nor tenant-a's with tenant-b
    assert chat_salted["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat_salted_again["prompt_tokens_details"]["cached_tokens"] == chat_salted["prompt_tokens"] - 1
    assert sorted(engine.salts.values(), key=str) == [None] + ["tenant-a"] * 5 + ["tenant-b"]


def _metric_values(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def test_prefix_cache_metrics_come_from_the_engine_stats_and_never_go_backwards():
    from serve.metrics import ServerMetrics

    stats: dict = {}  # what the engine reports: nothing about a prefix cache at first
    metrics = ServerMetrics(lambda: stats)
    names = ("splash_prefix_cache_queries_total", "splash_prefix_cache_hits_total", "splash_prefix_cache_evictions_total",
             "splash_prefix_cache_pages")

    def scrape() -> tuple[float, ...]:
        values = _metric_values(metrics.render().decode())
        return tuple(values[n] for n in names)

    assert scrape() == (0, 0, 0, 0)  # an engine without stats()["prefix_cache"]: zeros, same series
    cache = {"enabled": True, "queries": 640, "hits": 384, "hit_rate": 0.6, "cached_pages": 12, "evictions": 2}
    stats = {"prefix_cache": cache, "num_steps": 7}
    assert scrape() == (640, 384, 2, 12)
    stats = {"num_steps": 7}  # a snapshot without the key (not yet refreshed): the counters stay
    assert scrape() == (640, 384, 2, 0)
    stats = {"prefix_cache": {**cache, "queries": 100, "hits": 50, "cached_pages": 3, "evictions": 0}, "num_steps": 3}
    assert scrape() == (740, 434, 2, 3)  # the engine's counts restarted: ours continue from where they were
    assert _metric_values(metrics.render().decode())["splash_engine_steps_total"] == 10
    stats = {"prefix_cache": {**cache, "queries": 164, "hits": 60, "cached_pages": 4, "evictions": 1}, "num_steps": 4}
    assert scrape() == (804, 444, 3, 4)


def test_speculative_decoding_metrics_come_from_the_engine_stats():
    from serve.metrics import ServerMetrics

    stats: dict = {}
    metrics = ServerMetrics(lambda: stats)
    values = _metric_values(metrics.render().decode())
    assert values["splash_spec_decode_draft_tokens_total"] == 0  # speculation off: zeros, same series
    stats = {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "verify_chunks": 10, "draft_tokens": 27,
                             "accepted_tokens": 15, "accepted_histogram": [2, 3, 4, 1]}}
    text = metrics.render().decode()
    values = _metric_values(text)
    assert values["splash_spec_decode_verify_chunks_total"] == 10
    assert values["splash_spec_decode_draft_tokens_total"] == 27 and values["splash_spec_decode_accepted_tokens_total"] == 15
    assert 'splash_spec_decode_accepted_per_step_total{accepted="2"} 4.0' in text
    stats["speculative"]["adaptive"] = {"mean_k": 1.25, "by_batch": {
        1: {"level": 3, "tokens_per_s_by_level": {0: 900.5, 3: 2400.0}}, 64: {"level": 0, "tokens_per_s_by_level": {}}}}
    text = metrics.render().decode()
    assert _metric_values(text)["splash_spec_decode_mean_drafts"] == 1.25
    assert 'splash_spec_decode_draft_level{batch="1"} 3.0' in text and 'splash_spec_decode_draft_level{batch="64"} 0.0' in text
    assert 'splash_spec_decode_level_tokens_per_second{batch="1",level="0"} 900.5' in text
    assert 'splash_spec_decode_level_tokens_per_second{batch="1",level="3"} 2400.0' in text


def test_late_dispatch_metrics():
    """The late dispatch's holds and idle launches (engine stats' late_dispatch) as counters, its
    lead as a gauge, and the steps the step-time bound cut; zeros when the engine reports none."""
    from serve.metrics import ServerMetrics

    stats: dict = {}
    metrics = ServerMetrics(lambda: stats)
    values = _metric_values(metrics.render().decode())
    assert values["splash_engine_late_dispatch_waits_total"] == 0 and values["splash_engine_late_dispatch_lead_seconds"] == 0
    stats = {"late_dispatch": {"enabled": True, "waits": 12, "waited_s": 0.5, "idle_launches": 3, "idle_after_wait": 1,
                               "ended_in_launch": 4, "host_lead_ms": 14.5}}
    values = _metric_values(metrics.render().decode())
    assert values["splash_engine_late_dispatch_waits_total"] == 12
    assert values["splash_engine_late_dispatch_wait_seconds_total"] == 0.5
    assert values["splash_engine_late_dispatch_idle_launches_total"] == 3
    assert values["splash_engine_late_dispatch_idle_after_wait_total"] == 1
    assert values["splash_engine_late_dispatch_ended_in_launch_total"] == 4
    assert values["splash_engine_late_dispatch_lead_seconds"] == 0.0145
    assert values["splash_engine_step_time_cap_steps_total"] == 0  # (engine/step_time_cap.py: none reported)
    stats["step_time_cap"] = {"max_step_ms": 35.0, "capped_steps": 7}
    assert _metric_values(metrics.render().decode())["splash_engine_step_time_cap_steps_total"] == 7


def test_prefix_cache_metrics_on_the_server():
    engine = FakeEngine()
    engine.prefix_cache_stats = {"enabled": True, "queries": 96, "hits": 64, "hit_rate": 2 / 3, "cached_pages": 5, "evictions": 1}
    aengine = AsyncEngine(engine)  # its first stats snapshot has them
    try:
        (metrics,) = _ask(build_app(aengine, ServerConfig(served_model_name=["fake"])), ("GET", "/metrics", {}))
    finally:
        aengine.shutdown()
    values = _metric_values(metrics.text)
    assert values["splash_prefix_cache_queries_total"] == 96 and values["splash_prefix_cache_hits_total"] == 64
    assert values["splash_prefix_cache_pages"] == 5 and values["splash_prefix_cache_evictions_total"] == 1


def test_tokenization_runs_off_the_event_loop(fake):
    """A request whose tokenization takes 0.6 s does not delay /health (same event loop)."""
    engine, aengine = fake
    engine.tokenize_s = 0.6
    app = build_app(aengine, ServerConfig(served_model_name=["fake"]))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            slow = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 2}))
            await asyncio.sleep(0.05)
            latencies = []
            while not slow.done():
                t0 = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)
            return (await slow).status_code, latencies

    status, latencies = asyncio.run(main())
    assert status == 200 and len(latencies) >= 5 and max(latencies) < 0.1, latencies


def test_every_config_field_is_documented_and_its_comment_is_the_flags_help(capsys):
    import dataclasses

    from serve.main import parse_all_args
    from splash_jax.engine.config import EngineConfig, field_docs
    from splash_jax.policy import PolicyConfig

    from splash_jax.distributed.config import DistributedConfig

    for cls in (EngineConfig, PolicyConfig, ServerConfig, ServerLimits, DistributedConfig):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in ("policy", "limits") and not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a comment (their --help): {missing}"
    with pytest.raises(SystemExit):
        parse_all_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--moe-impl MOE_IMPL Routed experts: auto (the Pallas grouped kernel on GPUs" in out
    assert "9% median" in out  # a literal % in a comment survives argparse's formatting
    assert "(default: 64)" in out
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in out
    assert "--max-cache-salt-chars MAX_CACHE_SALT_CHARS" in out
