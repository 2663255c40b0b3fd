"""`python -m serve.main`: the OpenAI-compatible HTTP server on a splash-jax engine.

    python -m serve.main                                   # the bundled model on 127.0.0.1:8000
    python -m serve.main --model /path/to/deepseek --port 8080 --served-model-name deepseek

Every EngineConfig field is a flag too (--page-size, --max-num-seqs, ...). The engine core runs in
its own process (engine/core_server.py): it loads the model and compiles every step bucket before
the port opens, so /health answers once it can serve. This process serves HTTP, tokenizes and
detokenizes (serve/frontend.py); --api-server-count N adds front-end processes on the same port.
Over several hosts, run the same command on each with --coordinator-address, --num-processes and
--process-id (docs/multihost.md): process 0 serves HTTP, the others follow its command stream.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing.connection
import tempfile
import threading

import jax

from serve.app import build_app
from serve.config import ServerConfig
from serve.frontend import ExitOnCoreDeath, listen_socket, load_tokenizer, start_front_ends, stop_front_ends, uvicorn_server
from serve.metrics import share_between_processes
from serve.reasoning import ReasoningMarkers
from splash_jax import distributed
from splash_jax.distributed.config import DistributedConfig
from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.engine.config import EngineConfig
from splash_jax.engine.core_client import CoreProcess, CoreStartError, EngineClient
from splash_jax.engine.engine import Engine
from splash_jax.kv.capacity import StartupMemoryError
from splash_jax.paths import DEFAULT_MODEL

log = logging.getLogger("serve")


def parse_args(argv: list[str] | None = None) -> tuple[ServerConfig, EngineConfig]:
    server, engine, _ = parse_all_args(argv)
    return server, engine


def parse_all_args(argv: list[str] | None = None) -> tuple[ServerConfig, EngineConfig, DistributedConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m serve.main", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ServerConfig.add_cli_args(parser)
    EngineConfig.add_cli_args(parser)
    DistributedConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    return ServerConfig.from_cli_args(args), EngineConfig.from_cli_args(args), DistributedConfig.from_cli_args(args)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    server_config, engine_config, dist_config = parse_all_args(argv)
    setup_logging(server_config.log_level)
    if server_config.api_server_count < 1:
        raise SystemExit("--api-server-count must be >= 1")
    if server_config.api_server_count > 1 and not server_config.engine_process:
        raise SystemExit("--api-server-count > 1 needs the engine core in its own process (--engine-process)")
    check_reasoning_parser(server_config, engine_config)
    if not server_config.engine_process or (dist_config.enabled and dist_config.process_id != 0):
        return serve_in_process(server_config, engine_config, dist_config)  # followers: replay process 0
    serve_with_core_process(server_config, engine_config, dist_config if dist_config.enabled else None)


def check_reasoning_parser(server_config: ServerConfig, engine_config: EngineConfig) -> None:
    """Refuse a --reasoning-parser the model's tokenizer cannot serve before anything starts."""
    if server_config.reasoning_parser == "none":
        return
    try:
        ReasoningMarkers.of(load_tokenizer(engine_config.model or str(DEFAULT_MODEL)), server_config.reasoning_parser)
    except ValueError as e:
        log.error("cannot start: %s", e)
        raise SystemExit(1) from None


def serve_with_core_process(server_config: ServerConfig, engine_config: EngineConfig,
                            dist_config: DistributedConfig | None = None) -> None:
    """The default: the engine core in its own process, HTTP front ends beside it (serve/frontend.py).
    With several hosts this is process 0: its core process is the leader (docs/multihost.md)."""
    if dist_config is not None:
        try:
            dist_config.validate()  # a bad flag is reported here, not from inside the core
        except ValueError as e:
            log.error("cannot start: %s", e)
            raise SystemExit(1) from None
    try:
        core = CoreProcess.start(engine_config, server_config.log_level, dist_config=dist_config)
    except CoreStartError as e:  # a StartupMemoryError's message names the numbers and the flag to change
        log.error("cannot start: %s", e)
        raise SystemExit(1) from None
    jax.config.update("jax_platforms", "cpu")  # this process never needs an accelerator: the core has them
    on_death = ExitOnCoreDeath()
    client = EngineClient(core.address, core.facts, load_tokenizer(core.facts.model), index=0, core=core,
                          on_core_death=on_death)
    count = server_config.api_server_count
    shared_metrics = tempfile.TemporaryDirectory(prefix="splash-metrics-") if count > 1 else None
    if shared_metrics is not None:  # /metrics sums every front end's request metrics
        share_between_processes(shared_metrics.name)
    sock = listen_socket(server_config.host, server_config.port, reuse_port=count > 1)
    others = start_front_ends(server_config, core.address, core.facts, core.pid)
    app = build_app(client, server_config)
    names = ", ".join(app.state.ctx.served_model_names)
    log.info("serving %s on http://%s:%d/v1 (max_model_len %d; engine core pid %d, %d front end%s)", names,
             server_config.host, server_config.port, client.max_model_len, core.pid, count, "s" if count > 1 else "")
    server = on_death.server = uvicorn_server(app, server_config)
    watch = FrontEndWatch(others, client)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        watch.stop()
        stop_front_ends(others, server_config.graceful_shutdown_s + 5)
        client.shutdown()  # stops the core too (already done by the app's lifespan unless start-up failed)
        if shared_metrics is not None:
            shared_metrics.cleanup()
    log.info("server stopped")
    if on_death.code:
        raise SystemExit(on_death.code)


class FrontEndWatch:
    """Tells the core when another front end process dies, so it aborts that one's requests."""

    def __init__(self, procs: list, client: EngineClient):
        self.procs, self.client = list(procs), client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splash-frontend-watch", daemon=True)
        if self.procs:
            self._thread.start()

    def _run(self) -> None:
        alive = {p.sentinel: (i + 1, p) for i, p in enumerate(self.procs)}
        while alive and not self._stop.is_set():
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.2):
                index, p = alive.pop(sentinel)
                if not self._stop.is_set():
                    log.error("front end %d (pid %d) exited with code %s; its requests are aborted", index, p.pid,
                              p.exitcode)
                    self.client.report_gone(index)

    def stop(self) -> None:
        self._stop.set()


def serve_in_process(server_config: ServerConfig, engine_config: EngineConfig, dist_config: DistributedConfig) -> None:
    """The engine on a thread of the server's process (--no-engine-process), or a follower of a
    multi-process engine (it serves nothing)."""
    runtime = distributed.initialize(dist_config)  # before anything touches a device
    if runtime is not None:
        engine_config = runtime.share_config(engine_config)
        if not runtime.is_leader:  # a follower serves nothing: it runs process 0's programs until stopped
            distributed.follow(Engine(engine_config), runtime)
            return
    try:
        engine = AsyncEngine(Engine(engine_config))
    except StartupMemoryError as e:  # the message names the numbers and the flag to change
        log.error("cannot start: %s", e)
        raise SystemExit(1) from None
    app = build_app(engine, server_config)
    names = ", ".join(app.state.ctx.served_model_names)
    log.info("serving %s on http://%s:%d/v1 (max_model_len %d)", names, server_config.host, server_config.port, engine.max_model_len)
    server = uvicorn_server(app, server_config)
    try:
        server.run()  # returns after a graceful shutdown; on SIGINT uvicorn then re-raises KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()  # already done by the app's lifespan unless start-up failed
        if runtime is not None:
            runtime.shutdown()  # stops the followers
    log.info("server stopped")


if __name__ == "__main__":
    main()
