"""The engine core process: a busy loop that steps the engine and talks to front ends over ZMQ.

    python -m serve.main            # starts this process (CoreProcess) and serves HTTP beside it

Its loop does only what must happen between two device steps: take new requests and aborts,
step, send each front end one message with its requests' new tokens. Tokenization, text, stop
strings and HTTP live in the front ends (engine/core_client.py, serve/), so their cost never adds
to a step. Grammars of structured requests compile on a worker thread before the request is
queued. The process exits when its parent dies, so a killed server leaves no orphan on the GPU.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import signal
import threading
import time

import zmq

from splash_jax.compile_guard import count_compiles
from splash_jax.engine import core_wire as wire
from splash_jax.engine.core_output import CoreOutput
from splash_jax.engine.request import Request, RequestError

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often front ends get the stats snapshot (/metrics, /health)
PARENT_CHECK_S = 0.5


class CoreServer:
    """Owns an EngineCore and its sockets; run() until STOP or the parent's death."""

    def __init__(self, engine, input_address: str, parent_pid: int | None = None):
        self.engine = engine
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.bind(input_address)
        self.clients: dict[int, zmq.Socket] = {}  # front end index -> PUSH to its output address
        self.owner: dict[str, int] = {}  # request id -> front end index
        self.parent_pid = parent_pid
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="splash-core-grammar")
        self.compiled: collections.deque = collections.deque()  # (client, request | error output) from the grammar thread
        self.compiling = 0
        self.stopping = False
        self.num_step_errors = 0
        self._stats_time = 0.0
        self._parent_time = 0.0
        self.compiles = None

    # --- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        log.info("engine core loop started (pid %d)", os.getpid())
        with count_compiles() as self.compiles:  # stats()["compiles_after_ready"]: 0 unless something compiles late
            path = os.environ.get("SPLASH_CORE_PROFILE")
            if not path:
                self._loop()
                return
            import cProfile  # the loop under cProfile, its stats written when it stops

            prof = cProfile.Profile()
            try:
                prof.runcall(self._loop)
            finally:
                prof.dump_stats(path)

    def _loop(self) -> None:
        try:
            stalled = False  # the last step found work but nothing it could schedule: don't spin
            while not self.stopping:
                self._drain(self._wait_ms(stalled))
                self._admit_compiled()
                stalled = False
                if self.engine.has_work() and self.engine.dispatch_delay_s() <= 0.0:  # else: wait for arrivals
                    steps = self.engine.num_steps
                    self._step()
                    stalled = self.engine.num_steps == steps and not self.engine.has_inflight()
                now = time.monotonic()
                if now - self._stats_time >= STATS_INTERVAL_S:
                    self._send_stats(now)
                if self.parent_pid is not None and now - self._parent_time >= PARENT_CHECK_S:
                    self._parent_time = now
                    if os.getppid() != self.parent_pid:
                        log.error("the server process %d is gone; the engine core exits", self.parent_pid)
                        break
        finally:
            for request_id in list(self.owner):
                self.engine.abort(request_id)
            self._send_stats(time.monotonic())
            self.grammar_pool.shutdown(wait=False, cancel_futures=True)
            log.info("engine loop stopped (engine core process)")
            self.ctx.destroy(linger=200)

    def _wait_ms(self, stalled: bool) -> int:
        """How long to wait for messages before the next step: not at all while steps run, but
        while a long step runs until shortly before it ends (engine/dispatch_timing.py)."""
        if self.engine.has_work() and not stalled:
            return math.ceil(self.engine.dispatch_delay_s() * 1000)
        if self.compiling:
            return 1  # a grammar is compiling: queue its request soon
        return 5 if stalled else int(STATS_INTERVAL_S * 1000)

    def _drain(self, timeout_ms: int) -> None:
        """Every message waiting (blocking up to timeout_ms for the first)."""
        if timeout_ms and not self.input.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._handle(frames[0], frames[1] if len(frames) > 1 else b"")

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == wire.ADD:
            client, new = wire.decode_new(payload)
            for n in new:
                self._add(client, n)
        elif kind == wire.ABORT:
            for request_id, reason in wire.decode_any(payload):
                self.owner.pop(request_id, None)
                self.engine.abort(request_id, reason)
        elif kind == wire.CALL:
            self._call(wire.decode_call(payload))
        elif kind == wire.HELLO:
            client, address, pid = wire.decode_any(payload)
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # a live front end's queue never fills: sends never block
            sock.connect(address)
            self.clients[client] = sock
            log.info("front end %d (pid %d) connected", client, pid)
            self._send_stats(time.monotonic())
        elif kind == wire.GONE:
            self._client_gone(wire.decode_any(payload))
        elif kind == wire.STOP:
            self.stopping = True

    def _add(self, client: int, new: wire.NewRequest) -> None:
        request = new.to_request()
        self.owner[request.request_id] = client
        if request.params.structured_outputs is not None:  # compile off the loop; queued once it is ready
            self.compiling += 1
            self.grammar_pool.submit(self._compile, client, request)
            return
        self._queue(client, request)

    def _compile(self, client: int, request: Request) -> None:
        try:
            request.grammar = self.engine.grammars.matcher(request.params.structured_outputs)
            self.compiled.append((client, request))
        except Exception as e:  # noqa: BLE001 - the request fails, nothing else
            self.compiled.append((client, CoreOutput(request.request_id, [], "error", error=str(e))))

    def _admit_compiled(self) -> None:
        while self.compiled:
            client, item = self.compiled.popleft()
            self.compiling -= 1
            if isinstance(item, CoreOutput):
                self.owner.pop(item.request_id, None)
                self._send(client, [item])
            elif item.request_id in self.owner:  # not aborted while it compiled
                self._queue(client, item)

    def _queue(self, client: int, request: Request) -> None:
        try:
            self.engine.add_request(request)
        except (RequestError, ValueError) as e:
            self.owner.pop(request.request_id, None)
            self._send(client, [CoreOutput(request.request_id, [], "error", error=str(e))])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in the step, keep serving
            self.num_step_errors += 1
            log.exception("engine step failed; failing the requests in it")
            waiting = {r.request_id for r in self.engine.scheduler.waiting}
            outputs = []
            for request_id in list(self.owner):
                if request_id not in waiting:
                    self.engine.abort(request_id, "error")
                    outputs.append(CoreOutput(request_id, [], "error", error=f"the engine step failed: {type(e).__name__}: {e}",
                                              step_failed=True))
        self._route(outputs)

    def _route(self, outputs: list[CoreOutput]) -> None:
        by_client: dict[int, list[CoreOutput]] = {}
        owner = self.owner
        for out in outputs:
            client = owner.get(out.request_id)
            if client is None:
                continue
            if out.finish_reason is not None:
                del owner[out.request_id]
            by_client.setdefault(client, []).append(out)
        for client, outs in by_client.items():
            self._send(client, outs)

    def _send(self, client: int, outputs: list[CoreOutput]) -> None:
        sock = self.clients.get(client)
        if sock is not None:
            _send(sock, wire.OUTPUTS, wire.encode(outputs))

    def _send_stats(self, now: float) -> None:
        self._stats_time = now
        if not self.clients:
            return
        stats = {**self.engine.stats(), **self._own_stats()}
        payload = wire.encode(stats)
        for sock in self.clients.values():
            _send(sock, wire.STATS, payload)

    def _own_stats(self) -> dict:
        return {"step_errors": self.num_step_errors, "engine_alive": not self.stopping, "engine_pid": os.getpid(),
                "compiles_after_ready": self.compiles.count if self.compiles is not None else 0,
                "front_ends": len(self.clients),
                "core_loop_cpu_s": time.thread_time(),  # the loop thread's CPU: what each step costs the host
                "core_process_cpu_s": time.process_time()}

    def _client_gone(self, client: int) -> None:
        ids = [rid for rid, c in self.owner.items() if c == client]
        for request_id in ids:
            del self.owner[request_id]
            self.engine.abort(request_id)
        sock = self.clients.pop(client, None)
        if sock is not None:
            sock.close(linger=0)
        log.warning("front end %d is gone: aborted its %d requests", client, len(ids))

    # --- utility calls (named, with plain-data results) -----------------------------------
    def _call(self, call: wire.Call) -> None:
        try:
            if call.name in ("set_speculative", "set_overlap"):  # they flush the step in flight: route its outputs
                self._route(getattr(self.engine, call.name)(*call.args))
                value = None
            elif call.name == "stats":
                value = {**wire.CALLS["stats"](self.engine), **self._own_stats()}
            elif call.name in wire.CALLS:
                value = wire.CALLS[call.name](self.engine, *call.args)
            else:
                raise ValueError(f"the engine core has no call {call.name!r}")
            result = wire.CallResult(call.call_id, True, value)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            result = wire.CallResult(call.call_id, False, error=str(e), error_type=type(e).__name__)
        payload = wire.encode(result)
        for sock in self.clients.values():  # every front end sees it; only the caller has the call id
            _send(sock, wire.RESULT, payload)


def _send(sock, kind: bytes, payload: bytes) -> None:
    """Never blocks the loop: a front end that died has no peer left (zmq.Again), so its message
    is dropped; the launcher reports it gone and its requests are aborted."""
    try:
        sock.send_multipart((kind, payload), flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        pass


def run_core_process(engine_config, input_address: str, ready, parent_pid: int, log_level: str = "info",
                     dist_config=None) -> None:
    """The core process's entry point (multiprocessing, spawn): build the engine core, report
    ready (its EngineFacts) or the start-up error through `ready`, then loop. dist_config (several
    hosts, docs/multihost.md): this process joins jax.distributed as process 0, the leader whose
    device calls the followers replay, and stops them when it stops."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s core %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us with STOP
    threading.current_thread().name = "splash-core"
    try:
        from splash_jax.engine.engine_core import EngineCore
        from splash_jax.engine.request_factory import EngineFacts

        if dist_config is not None:
            from splash_jax import distributed

            runtime = distributed.initialize(dist_config)  # before anything touches a device
            engine_config = runtime.share_config(engine_config)
        engine = EngineCore(engine_config)
        facts = EngineFacts.of(engine)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which exits with it
        log.exception("the engine core failed to start")
        ready.send(("error", type(e).__name__, str(e)))
        ready.close()
        raise SystemExit(1) from None
    server = CoreServer(engine, input_address, parent_pid)
    ready.send(("ready", facts.__dict__))
    ready.close()
    try:
        server.run()
    finally:
        if dist_config is not None:
            from splash_jax import distributed

            distributed.current().shutdown()  # stops the followers
