"""The front end's side of the engine core process: start it, talk to it, stream its outputs.

    core = CoreProcess.start(EngineConfig())            # spawns the core; waits until it is ready
    engine = EngineClient(core.address, core.facts, tokenizer, core=core)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16)): ...

`EngineClient` has the interface of `AsyncEngine` (what serve/ uses: make_request,
generate_many, abort, stats, utility calls, facts), but its core runs in another process: a
receiver thread turns each step's CoreOutputs into RequestOutput deltas (OutputProcessor: text,
stop strings) and hands them to the asyncio loops of their callers. A stop string found here
aborts the request in the core; tokens it produced meanwhile are dropped. If the core process
dies, every open stream fails with EngineDeadError at once and `on_core_death` is called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from splash_jax.engine import core_wire as wire
from splash_jax.engine.output_streams import (
    EngineDeadError, EngineStepError, OutputStreams, _aborted_output, _Failure, _put_all, _Stream,
)
from splash_jax.engine.output_processor import OutputProcessor
from splash_jax.engine.request import Request, SamplingParams
from splash_jax.engine.request_factory import EngineFacts, RequestFactory

log = logging.getLogger(__name__)

LIVENESS_CHECK_S = 0.1  # how often the receiver checks that the core process is alive


def pid_alive(pid: int) -> bool:
    """Is the process running (a zombie, dead but not yet reaped, is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


class CoreStartError(RuntimeError):
    """The engine core process failed to start; the message is its error."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


class CoreProcess:
    """The engine core's process, started by the server (its parent)."""

    def __init__(self, process, address: str, facts: EngineFacts, folder: str):
        self.process = process
        self.address = address
        self.facts = facts
        self.folder = folder

    @classmethod
    def start(cls, engine_config, log_level: str = "info", progress_s: float = 15.0, dist_config=None) -> "CoreProcess":
        """Spawn the core and wait until it has loaded the model and compiled its programs,
        logging progress; CoreStartError with the core's own error if it fails. dist_config: the
        core is process 0 of a multi-process engine (core_server.run_core_process)."""
        from splash_jax.engine.core_server import run_core_process

        folder = tempfile.mkdtemp(prefix="splash-core-")
        address = f"ipc://{folder}/input"
        mp = multiprocessing.get_context("spawn")
        receiver, sender = mp.Pipe(duplex=False)
        process = mp.Process(target=run_core_process, name="splash-engine-core",
                             args=(engine_config, address, sender, os.getpid(), log_level, dist_config), daemon=False)
        t0 = time.monotonic()
        process.start()
        sender.close()
        log.info("engine core starting (pid %d): loading the model and compiling its programs", process.pid)
        while not receiver.poll(progress_s):
            if not process.is_alive():
                break
            log.info("waiting for the engine core (%.0f s)", time.monotonic() - t0)
        try:
            message = receiver.recv()
        except EOFError:
            process.join(5)
            raise CoreStartError("ProcessExit", f"the engine core process exited with code {process.exitcode} "
                                 "before it was ready (see its log above)") from None
        if message[0] == "error":
            process.join(30)
            raise CoreStartError(message[1], message[2])
        facts = EngineFacts(**message[1])
        log.info("engine core ready in %.1f s (pid %d)", time.monotonic() - t0, process.pid)
        return cls(process, address, facts, folder)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 30.0) -> int | None:
        """Ask the core to stop (STOP), wait, then terminate it; its exit code."""
        if self.process.is_alive():
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.PUSH)
            sock.connect(self.address)
            with contextlib.suppress(zmq.Again):
                sock.send_multipart((wire.STOP, b""), flags=zmq.NOBLOCK)
            sock.close(linger=1000)
            self.process.join(timeout)
            if self.process.is_alive():
                log.warning("the engine core did not stop within %.0f s; terminating it", timeout)
                self.process.terminate()
                self.process.join(10)
        return self.process.exitcode


class EngineClient(OutputStreams):
    """An AsyncEngine whose core runs in another process (one per API server process)."""

    def __init__(self, address: str, facts: EngineFacts, tokenizer, index: int = 0, core_pid: int | None = None,
                 core: CoreProcess | None = None, on_core_death: Callable[[], None] | None = None):
        self.facts = facts
        self.tokenizer = tokenizer
        self.index = index
        self.core = core  # the launcher owns the core process; other front ends only talk to it
        self.core_pid = core.pid if core is not None else core_pid
        self.on_core_death = on_core_death
        self.requests_in = RequestFactory(facts, tokenizer, stream=index)
        self.outputs = OutputProcessor(tokenizer)
        self._lock = threading.Lock()  # the output processor, the streams, the push socket
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._stats: dict = {}
        self._dead: str | None = None  # why the core is unreachable
        self._closing = False
        self.ctx = zmq.Context()
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never blocks while the core lives (NOBLOCK sends: a dead one raises)
        self._push.connect(address)
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._folder = tempfile.mkdtemp(prefix="splash-frontend-")
        out_address = f"ipc://{self._folder}/outputs"
        self._pull.bind(out_address)
        self._send(wire.HELLO, wire.encode((index, out_address, os.getpid())))
        self._thread = threading.Thread(target=self._receive, name=f"splash-frontend-{index}", daemon=True)
        self._thread.start()

    # --- what the HTTP side reads --------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._closing and self._thread.is_alive()

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
                     cache_salt: str | None = None) -> Request:
        return self.requests_in.make(prompt, params, request_id, cache_salt, with_matcher=False)

    def stats(self) -> dict:
        """The core's stats as of its last report (a few times a second)."""
        return {**self._stats, "engine_alive": self.is_running}

    # --- requests (generate, generate_many: OutputStreams) ------------------------------
    def _dead_reason(self) -> str:
        return self._dead or "the engine is not running"

    def _open(self, requests: list[Request], stream: _Stream) -> None:
        with self._lock:
            for r in requests:
                self._streams[r.request_id] = stream
                self.outputs.add(r)
            self._push_locked(wire.ADD, wire.encode((self.index, [wire.NewRequest.of(r) for r in requests])))

    def _close(self, request_ids: list[str]) -> None:
        self._abort(request_ids, deliver=False)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends with finish_reason 'abort'."""
        self._abort([request_id], deliver=True)

    def _abort(self, request_ids: list[str], deliver: bool, reason: str = "abort") -> None:
        with self._lock:
            for request_id in request_ids:
                self.outputs.remove(request_id)
                stream = self._streams.pop(request_id, None)
                if deliver and stream is not None:
                    self._post(stream.loop, [(stream, _aborted_output(request_id, stream.last.get(request_id)))])
            if self._dead is None and not self._closing:
                with contextlib.suppress(EngineDeadError):  # a dead core has nothing left to abort
                    self._push_locked(wire.ABORT, wire.encode([(r, reason) for r in request_ids]))

    def call(self, name: str, *args) -> concurrent.futures.Future:
        """Run a named core call (core_wire.CALLS) between steps; a future of its plain-data result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None or self._closing:
            future.set_exception(EngineDeadError(self._dead or "the engine is not running"))
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(wire.CALL, wire.encode(wire.Call(call_id, name, list(args))))
        except EngineDeadError as e:
            self._calls.pop(call_id, None)
            future.set_exception(e)
        return future

    def report_gone(self, index: int) -> None:
        """Tell the core that front end `index` died (the launcher watches them): it aborts that
        front end's requests and frees their pages."""
        if self._dead is None and not self._closing:
            self._send(wire.GONE, wire.encode(index))

    async def utility(self, name: str, *args):
        return await asyncio.wrap_future(self.call(name, *args))

    def _send(self, kind: bytes, payload: bytes) -> None:
        with self._lock:
            self._push_locked(kind, payload)

    def _push_locked(self, kind: bytes, payload: bytes) -> None:
        try:
            self._push.send_multipart((kind, payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no core at the other end any more
            raise EngineDeadError(self._dead or "the engine core is not reachable") from None

    # --- lifecycle -----------------------------------------------------------------------
    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop receiving; the launcher's client also stops the core process."""
        if self._closing:
            return
        self._closing = True
        self._thread.join(timeout)
        with self._lock:
            failed = self._take_streams()
        for stream, ids in failed.items():
            self._deliver(stream, _Failure(EngineDeadError("the server is shutting down"), ids))
        if self.core is not None:
            code = self.core.stop()
            log.info("engine core stopped (exit code %s)", code)
        self.ctx.destroy(linger=0)

    # --- the receiver thread -------------------------------------------------------------
    def _receive(self) -> None:
        last_check = 0.0
        try:
            while not self._closing:
                if self._pull.poll(int(LIVENESS_CHECK_S * 1000)):
                    while True:
                        try:
                            kind, payload = self._pull.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(kind, payload)
                now = time.monotonic()
                if now - last_check >= LIVENESS_CHECK_S and self.core_pid is not None:
                    last_check = now
                    if not pid_alive(self.core_pid):
                        self._core_died(f"the engine core process (pid {self.core_pid}) died")
                        return
        except Exception as e:  # noqa: BLE001 - a bug here must not leave streams hanging
            log.exception("the front end's receiver crashed")
            self._core_died(f"the front end's receiver crashed: {type(e).__name__}: {e}")

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == wire.OUTPUTS:
            outs = wire.decode_outputs(payload)
            failed = {o.request_id for o in outs if o.step_failed}  # raised in their streams, as in one process
            with self._lock:
                deltas, stopped = self.outputs.process_all(outs)
                by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                for out in deltas:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    stream.last[out.request_id] = out
                    if out.finished:
                        del self._streams[out.request_id]
                    item = _Failure(EngineStepError(out.error), [out.request_id]) if out.request_id in failed else out
                    by_loop.setdefault(stream.loop, []).append((stream, item))
                if stopped:
                    with contextlib.suppress(EngineDeadError):
                        self._push_locked(wire.ABORT, wire.encode([(r, "stop") for r in stopped]))
            for loop, items in by_loop.items():
                self._post(loop, items)
        elif kind == wire.STATS:
            self._stats = wire.decode_any(payload)
        elif kind == wire.RESULT:
            result = wire.decode_result(payload)
            future = self._calls.pop(result.call_id, None)
            if future is not None and future.set_running_or_notify_cancel():
                if result.ok:
                    future.set_result(result.value)
                else:
                    error = {"ValueError": ValueError, "RuntimeError": RuntimeError}.get(result.error_type, RuntimeError)
                    future.set_exception(error(result.error))

    def _core_died(self, why: str) -> None:
        log.error("%s: failing every open request", why)
        self._dead = why
        with self._lock:
            failed = self._take_streams()
        for stream, ids in failed.items():
            self._deliver(stream, _Failure(EngineDeadError(why), ids))
        for future in list(self._calls.values()):
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(why))
        self._calls.clear()
        if self.on_core_death is not None:
            self.on_core_death()

    def _take_streams(self) -> dict[_Stream, list[str]]:
        failed: dict[_Stream, list[str]] = {}
        for request_id, stream in self._streams.items():
            failed.setdefault(stream, []).append(request_id)
        self._streams.clear()
        return failed

    def _deliver(self, stream: _Stream, item) -> None:
        self._post(stream.loop, [(stream, item)])

    def _post(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop is closed: nobody listens
            pass

