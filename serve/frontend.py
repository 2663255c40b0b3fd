"""An HTTP front end on an engine core process: the server's half of `python -m serve.main`.

The launcher (serve/main.py) starts the engine core (engine/core_client.CoreProcess), then serves
HTTP itself and, with --api-server-count N, in N - 1 more processes started here. Each front end
binds the same port with SO_REUSEPORT (the kernel spreads connections), has its own tokenizer
threads, output processor and SSE streams, and talks to the one core over ZMQ.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
from pathlib import Path

import uvicorn

from serve.config import ServerConfig
from splash_jax.engine.core_client import EngineClient
from splash_jax.engine.request_factory import EngineFacts

log = logging.getLogger("serve")


def load_tokenizer(model_folder: str):
    from splash_jax.tokenizer import Tokenizer

    path = Path(model_folder)
    return Tokenizer(path) if (path / "tokenizer.json").exists() else None


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The HTTP socket, bound before uvicorn starts (several processes share it with SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app, config: ServerConfig) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None, log_level=config.log_level,
        access_log=config.access_log, timeout_graceful_shutdown=config.graceful_shutdown_s,
    ))


class ExitOnCoreDeath:
    """on_core_death for a front end: stop serving and exit non-zero (never hang on a dead core)."""

    def __init__(self):
        self.server: uvicorn.Server | None = None
        self.code = 0

    def __call__(self) -> None:
        self.code = 1
        if self.server is not None:
            self.server.should_exit = True


def run_front_end(index: int, config: ServerConfig, address: str, facts: dict, core_pid: int) -> None:
    """Entry point of front end `index` >= 1 (a spawned process)."""
    from serve.app import build_app
    from serve.main import setup_logging

    setup_logging(config.log_level)
    facts_ = EngineFacts(**facts)
    on_death = ExitOnCoreDeath()
    client = EngineClient(address, facts_, load_tokenizer(facts_.model), index=index, core_pid=core_pid,
                          on_core_death=on_death)
    app = build_app(client, config)
    server = on_death.server = uvicorn_server(app, config)
    sock = listen_socket(config.host, config.port, reuse_port=True)
    log.info("front end %d serving on http://%s:%d/v1", index, config.host, config.port)
    server.run(sockets=[sock])
    client.shutdown()
    raise SystemExit(on_death.code)


def start_front_ends(config: ServerConfig, address: str, facts: EngineFacts, core_pid: int) -> list:
    """Front ends 1 .. api_server_count - 1 (the launcher is front end 0)."""
    mp = multiprocessing.get_context("spawn")
    procs = []
    for index in range(1, config.api_server_count):
        p = mp.Process(target=run_front_end, name=f"splash-api-server-{index}",
                       args=(index, config, address, facts.__dict__, core_pid), daemon=False)
        p.start()
        procs.append(p)
    return procs


def stop_front_ends(procs: list, timeout: float) -> None:
    for p in procs:
        if p.is_alive():
            p.send_signal(signal.SIGTERM) if hasattr(p, "send_signal") else p.terminate()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
