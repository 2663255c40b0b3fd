"""Server settings: one dataclass, each field also a CLI flag of the same name (as EngineConfig).

The limits bound what one request may ask for, and are checked before any tokenization, so
no request can make the server (or the engine thread) do unbounded work for it.
"""

from __future__ import annotations

import argparse
import dataclasses

from serve.reasoning import PARSERS
from splash_jax.engine.config import add_dataclass_args, field_docs


@dataclasses.dataclass
class ServerLimits:
    max_body_bytes: int = 8 * 2**20  # HTTP request body (413 above it)
    max_prompt_chars: int = 1_000_000  # all prompt strings / message texts of a request together
    max_prompts: int = 128  # prompts in one /v1/completions request
    max_messages: int = 1024  # chat messages (and content parts per message)
    max_n: int = 128  # choices per prompt
    max_choices: int = 256  # prompts x n: engine requests one HTTP request may start
    max_stop_strings: int = 32  # entries in `stop`
    max_stop_string_chars: int = 1024  # characters per stop string
    max_cache_salt_chars: int = 1024  # characters in cache_salt (the prefix-cache namespace a request names)
    max_grammar_chars: int = 256 * 1024  # characters of a JSON schema, regex, grammar or choice list (structured outputs)
    tokenizer_threads: int = 2  # threads that tokenize, render chat templates and decode echoes


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # address to listen on (0.0.0.0: every interface)
    port: int = 8000  # HTTP port
    served_model_name: list[str] | None = None  # names clients may ask for; default: the model folder's name
    api_key: str | None = None  # if set, /v1 routes need "Authorization: Bearer <key>"
    log_level: str = "info"  # debug | info | warning | error
    access_log: bool = True  # one log line per HTTP request (uvicorn's access log)
    graceful_shutdown_s: int = 10  # on SIGINT/SIGTERM: how long open requests may finish
    engine_process: bool = True  # run the engine core in its own process (off: on a thread of the server's)
    api_server_count: int = 1  # HTTP front-end processes sharing the port, all on one engine core process
    reasoning_parser: str = "none"  # none | deepseek_r1 | deepseek_v3: split <think>...</think> into reasoning_content
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("server")
        doc = field_docs(cls)
        group.add_argument("--host", default=cls.host, help=doc["host"] + " (default: %(default)s)")
        group.add_argument("--port", type=int, default=cls.port, help=doc["port"] + " (default: %(default)s)")
        group.add_argument("--served-model-name", nargs="+", default=None, help="names clients may ask for (default: the model folder's name)")
        group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
        group.add_argument("--log-level", default=cls.log_level, choices=["debug", "info", "warning", "error"],
                           help=doc["log_level"] + " (default: %(default)s)")
        group.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=cls.access_log, help=doc["access_log"])
        group.add_argument("--graceful-shutdown-s", type=int, default=cls.graceful_shutdown_s,
                           help=doc["graceful_shutdown_s"] + " (default: %(default)s)")
        group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=cls.engine_process,
                           help=doc["engine_process"])
        group.add_argument("--api-server-count", type=int, default=cls.api_server_count,
                           help=doc["api_server_count"] + " (default: %(default)s)")
        group.add_argument("--reasoning-parser", default=cls.reasoning_parser, choices=PARSERS,
                           help=doc["reasoning_parser"] + " (default: %(default)s)")
        add_dataclass_args(parser.add_argument_group("request limits"), ServerLimits)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerConfig":
        limits = ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "limits"}, limits=limits)
