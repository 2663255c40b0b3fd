"""The server's parts without a model: AsyncEngine's threading contract on a fake engine,
stop-string hold-back in streamed text, error shapes, the API key."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import httpx
import pytest

from serve.app import build_app
from serve.config import ServerConfig
from serve.errors import describe_validation_errors
from serve.outputs import ChoiceState, stop_prefix_len
from splash_jax.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from splash_jax.engine.request import Request, RequestError, RequestOutput, SamplingParams


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
        self.threads: set[int] = set()
        self.fail_next_step = False
        self.scheduler = types.SimpleNamespace(waiting=[])
        self.config = types.SimpleNamespace(model="", enable_switching=True)
        self.layout, self.switch, self.switches = "tp", None, 0
        self.tokenizer = None
        self.max_model_len = 1000
        self.ids = 0
        self.num_steps = 0

    def make_request(self, prompt, params=None, request_id=None) -> Request:
        if not prompt:
            raise RequestError("the prompt is empty")
        self.ids += 1
        return Request(request_id or f"fake-{self.ids}", list(prompt), params or SamplingParams())

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
        self.switch = FakeSwitch(self.layout, dst)
        return self.switch

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
            r.output_ids.append(len(r.output_ids))
            done = len(r.output_ids) >= r.params.max_tokens
            if done:
                del self.requests[r.request_id]
            outputs.append(RequestOutput(
                r.request_id, r.prompt_ids, list(r.output_ids), "", "", r.output_ids[-1:], done, "length" if done else None
            ))
        return outputs

    def stats(self) -> dict:
        return {
            "running": len(self.requests), "waiting": 0, "pages_used": 0, "pages_total": 1, "layout": self.layout,
            "switches": self.switches, "switch": self.switch.as_dict() if self.switch else None,
        }


@pytest.fixture
def fake():
    engine = FakeEngine()
    aengine = AsyncEngine(engine)
    yield engine, aengine
    aengine.shutdown()


async def _collect(aengine, prompt, max_tokens, request_id=None):
    return [o async for o in aengine.generate(prompt, SamplingParams(max_tokens=max_tokens), request_id)]


def test_concurrent_requests_complete_and_steps_stay_on_the_engine_thread(fake):
    engine, aengine = fake

    async def main():
        return await asyncio.gather(*(_collect(aengine, [1, 2], 3 + i % 5) for i in range(50)))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert [o.token_ids for o in outs] == [list(range(k)) for k in range(1, 4 + i % 5)]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert engine.threads == {aengine._thread.ident}
    # A second event loop (a notebook cell after another) is served the same way.
    assert asyncio.run(_collect(aengine, [1], 2))[-1].token_ids == [0, 1]


def test_closing_the_stream_aborts_the_request(fake):
    engine, aengine = fake

    async def main():
        stream = aengine.generate([1], SamplingParams(max_tokens=10_000), "leaver")
        async for out in stream:
            if len(out.token_ids) == 3:
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
    assert after[-1].token_ids == [0, 1, 2, 3]
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

    assert asyncio.run(main())[-1].token_ids == list(range(200))


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
    assert outs[-1].token_ids[:2] == [0, 1]


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


# --- streamed text never shows a stop string the engine will cut -------------------------
def test_stop_prefix_len():
    assert stop_prefix_len("hello wor", ("world",)) == 3
    assert stop_prefix_len("hello", ("xy",)) == 0
    assert stop_prefix_len("abcab", ("abc", "b")) == 2  # "ab" could still become "abc"


def _out(text: str, n: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", [], list(range(n)), text, "", [], finished, reason)


def test_choice_state_holds_back_a_possible_stop_string():
    state = ChoiceState(0, ("STOP",))
    sent = [state.advance(_out("Hello S", 2)).text, state.advance(_out("Hello ST", 3)).text]
    # The engine found "STOP" and cut it: the client must end with exactly the final text.
    final = state.advance(_out("Hello ", 4, True, "stop"))
    assert "".join(sent) + final.text == "Hello "
    assert final.finish_reason == "stop" and final.token_ids == [3]
    state = ChoiceState(0, ("STOP",))
    sent = [state.advance(_out("Hello S", 2)).text, state.advance(_out("Hello Sun", 3, True, "length")).text]
    assert "".join(sent) == "Hello Sun"


def test_validation_errors_name_the_field_once():
    errors = [
        {"loc": ("body", "prompt", "str"), "msg": "Input should be a valid string"},
        {"loc": ("body", "prompt", "list[int]"), "msg": "Input should be a valid list"},
    ]
    message, param = describe_validation_errors(errors)
    assert message == "prompt: expected one of str, list[int]" and param == "prompt"


# --- the app without a model ---------------------------------------------------------------
def _ask(app, *calls):
    """Run (method, path, kwargs) calls against the app in-process; their responses."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.request(method, path, **kw) for method, path, kw in calls]

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
