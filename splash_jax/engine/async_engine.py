"""The engine loop on its own thread, streamed to asyncio callers.

`Engine.step()` blocks for a whole device step and is not thread-safe, so one dedicated thread
owns the Engine: it drains a command queue (add, abort, call), steps while there is work and
sleeps on an event otherwise. Each caller's outputs go to an asyncio.Queue on the caller's
event loop, handed over with `loop.call_soon_threadsafe` once per step and loop, so the HTTP
side never waits for a step and the engine never waits for a slow client.

    aengine = AsyncEngine(Engine(EngineConfig()))
    async for out in aengine.generate("Hello", SamplingParams(max_tokens=16)):
        print(out.delta_text, end="")
    aengine.shutdown()

Closing a generator early (a client that went away, `break`, cancellation) aborts its
requests, which frees their pages. A step that raises fails the requests that were in it
(they get `EngineStepError`); waiting requests and later ones carry on.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from splash_jax.engine.engine import Engine
from splash_jax.engine.output_streams import (  # noqa: F401  (EngineDeadError, EngineStepError: re-exported)
    EngineDeadError, EngineStepError, OutputStreams, _aborted_output, _Failure, _put_all, _Stream,
)
from splash_jax.engine.request import Request, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Add:
    requests: list[Request]
    stream: _Stream


@dataclasses.dataclass
class _Abort:
    request_ids: list[str]


@dataclasses.dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


class AsyncEngine(OutputStreams):
    """Owns an Engine and runs its step loop on a dedicated thread."""

    def __init__(self, engine: Engine, *, start: bool = True, stats_interval_s: float = 0.25):
        self.engine = engine
        self.stats_interval_s = stats_interval_s
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()  # orders submissions against the loop's final drain
        self._closed = False  # the loop has drained for the last time: submissions are refused
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stats: dict = engine.stats()
        self._stats_time = 0.0
        self.num_step_errors = 0
        self._thread = threading.Thread(target=self._run, name="splash-engine", daemon=True)
        if start:
            self.start()

    @classmethod
    def from_config(cls, config=None, **overrides) -> "AsyncEngine":
        return cls(Engine(config, **overrides))

    # --- what the HTTP side may read from any thread -------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def facts(self):
        """What the front end knows of the core (EngineFacts)."""
        return self.engine.facts

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
                     cache_salt: str | None = None) -> Request:
        """Validate and tokenize in the caller's thread (raises RequestError); submit with generate()."""
        return self.engine.make_request(prompt, params, request_id, cache_salt)

    def stats(self) -> dict:
        """The engine's stats as of its last step (refreshed at most every stats_interval_s)."""
        return {**self._stats, "step_errors": self.num_step_errors, "engine_alive": self.is_running}

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after the current step; unfinished requests end with finish_reason 'abort'."""
        if not self._thread.is_alive():
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.0fs", timeout)

    # --- requests (generate, generate_many: OutputStreams) ------------------------------
    def _open(self, requests: list[Request], stream: _Stream) -> None:
        self._submit(_Add(requests, stream))

    def _close(self, request_ids: list[str]) -> None:
        self._submit(_Abort(request_ids))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends with finish_reason 'abort'."""
        self._submit(_Abort([request_id]))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (e.g. a layout switch)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, future))
        return future

    async def run_on_engine(self, fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    async def utility(self, name: str, *args) -> Any:
        """A named core call (core_wire.CALLS), as EngineClient makes it across processes."""
        from splash_jax.engine.core_wire import CALLS

        if name not in CALLS:
            raise ValueError(f"the engine core has no call {name!r}")
        if name == "stats":
            return await self.run_on_engine(lambda engine: {**engine.stats(), "step_errors": self.num_step_errors,
                                                            "engine_alive": self.is_running})
        return await self.run_on_engine(lambda engine: CALLS[name](engine, *args))

    def _submit(self, command) -> None:
        with self._lock:
            if self._closed or not self._thread.is_alive():
                if isinstance(command, _Abort):
                    return  # nothing runs any more, so nothing to abort
                raise EngineDeadError("the engine is not running")
            self._commands.append(command)
        self._wake.set()

    # --- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        log.info("engine loop started")
        try:
            while not self._stopping:
                self._drain_commands()
                delay = getattr(self.engine, "dispatch_delay_s", float)()  # a long prefill step runs: take arrivals
                if self.engine.has_work() and delay > 0.0:
                    self._wake.wait(delay)
                    self._wake.clear()
                elif self.engine.has_work():
                    self._step()
                else:
                    self._refresh_stats(force=True)
                    self._wake.wait(self.stats_interval_s)
                    self._wake.clear()
        except BaseException:  # a bug in the loop itself: fail everyone rather than hang them
            log.exception("engine loop crashed")
            self._fail_all(EngineDeadError("the engine loop crashed; see the server log"))
            raise
        finally:
            self._stopping = True
            with self._lock:
                self._closed = True
            self._drain_commands()
            for request_id in list(self._streams):
                self._abort(request_id)
            self._refresh_stats(force=True)
            log.info("engine loop stopped")

    def _drain_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                for request_id in command.request_ids:
                    self._abort(request_id)
            elif isinstance(command, _Call):
                if command.future.set_running_or_notify_cancel():
                    try:
                        command.future.set_result(command.fn(self.engine))
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        command.future.set_exception(e)

    def _add(self, command: _Add) -> None:
        ids = [r.request_id for r in command.requests]
        if self._stopping:
            self._deliver(command.stream, _Failure(EngineDeadError("the engine is shutting down"), ids))
            return
        added = []
        for request in command.requests:
            try:
                self.engine.add_request(request)
            except Exception as e:  # noqa: BLE001 - RequestError (a duplicate id) or worse: this caller fails
                for request_id in added:  # all or nothing: one caller, one answer
                    self.engine.abort(request_id)
                    self._streams.pop(request_id, None)
                self._deliver(command.stream, _Failure(e, ids))
                return
            self._streams[request.request_id] = command.stream
            added.append(request.request_id)
        self._wake.set()

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._deliver(stream, _aborted_output(request_id, stream.last.get(request_id)))

    def _step(self) -> None:
        steps_before = self.engine.num_steps
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            self.num_step_errors += 1
            log.exception("engine step failed; failing the requests in it")
            waiting = {r.request_id for r in getattr(getattr(self.engine, "scheduler", None), "waiting", ())}
            error = EngineStepError(f"the engine step failed: {type(e).__name__}: {e}")
            failed: dict[_Stream, list[str]] = {}
            for request_id, stream in list(self._streams.items()):
                if request_id not in waiting:
                    self.engine.abort(request_id)
                    del self._streams[request_id]
                    failed.setdefault(stream, []).append(request_id)
            for stream, ids in failed.items():
                self._deliver(stream, _Failure(error, ids))
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # added directly on the Engine, not through us
            stream.last[out.request_id] = out
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            self._post(loop, items)
        self._refresh_stats()
        inflight = getattr(self.engine, "has_inflight", lambda: False)()
        if self.engine.num_steps == steps_before and not inflight:  # work, but none schedulable now: don't spin
            self._wake.wait(0.005)
            self._wake.clear()

    def _deliver(self, stream: _Stream, item) -> None:
        self._post(stream.loop, [(stream, item)])

    def _post(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            for stream, _ in items:
                for request_id, s in list(self._streams.items()):
                    if s is stream:
                        self.engine.abort(request_id)
                        del self._streams[request_id]

    def _fail_all(self, error: BaseException) -> None:
        failed: dict[_Stream, list[str]] = {}
        for request_id, stream in list(self._streams.items()):
            del self._streams[request_id]
            failed.setdefault(stream, []).append(request_id)
        for stream, ids in failed.items():
            self._deliver(stream, _Failure(error, ids))

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= self.stats_interval_s:
            self._stats = self.engine.stats()
            self._stats_time = now
