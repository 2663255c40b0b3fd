"""Server settings: one dataclass, each field also a CLI flag of the same name (as EngineConfig)."""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] | None = None  # names clients may ask for; default: the model folder's name
    api_key: str | None = None  # if set, /v1 routes need "Authorization: Bearer <key>"
    log_level: str = "info"
    access_log: bool = True  # one log line per HTTP request (uvicorn's access log)
    graceful_shutdown_s: int = 10  # on SIGINT/SIGTERM: how long open requests may finish

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("server")
        group.add_argument("--host", default=cls.host)
        group.add_argument("--port", type=int, default=cls.port)
        group.add_argument("--served-model-name", nargs="+", default=None, help="names clients may ask for (default: the model folder's name)")
        group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
        group.add_argument("--log-level", default=cls.log_level, choices=["debug", "info", "warning", "error"])
        group.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=cls.access_log)
        group.add_argument("--graceful-shutdown-s", type=int, default=cls.graceful_shutdown_s)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
