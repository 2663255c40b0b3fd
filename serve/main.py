"""`python -m serve.main`: the OpenAI-compatible HTTP server on a splash-jax engine.

    python -m serve.main                                   # the bundled model on 127.0.0.1:8000
    python -m serve.main --model /path/to/deepseek --port 8080 --served-model-name deepseek

Every EngineConfig field is a flag too (--page-size, --max-num-seqs, ...). The engine loads the
model and compiles every step bucket before the port opens, so /health answers once it can serve.
Over several hosts, run the same command on each with --coordinator-address, --num-processes and
--process-id (docs/multihost.md): process 0 serves HTTP, the others follow its command stream.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from serve.app import build_app
from serve.config import ServerConfig
from splash_jax import distributed
from splash_jax.distributed.config import DistributedConfig
from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.engine.config import EngineConfig
from splash_jax.engine.engine import Engine
from splash_jax.kv.capacity import StartupMemoryError

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
    server = uvicorn.Server(uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_config=None, log_level=server_config.log_level,
        access_log=server_config.access_log, timeout_graceful_shutdown=server_config.graceful_shutdown_s,
    ))
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
