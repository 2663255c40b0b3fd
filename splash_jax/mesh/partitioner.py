"""Which SPMD partitioner (Shardy or GSPMD) compiles the engine's programs.

jax's default is Shardy. With jax 0.11.2 on 2 H200s, Shardy's GPU compile segfaulted (inside
`backend_compile_and_load`) on every owner-layout step program of 64 tokens per device (dp and dop,
with or without the MoE layers, with or without autotuning or command buffers), while GSPMD
compiled the same program in 2.4 s; 32 tokens per device compiled under both. The engine's
programs are shard_maps with explicit collectives, so the partitioner only propagates the
boundary shardings: the choice does not change what runs. It is a process-wide jax setting
(`jax_use_shardy_partitioner`), read when a program is lowered and again when it is compiled
(possibly in another thread), so it is set globally rather than in a thread-local context.
"""

from __future__ import annotations

import logging

import jax

log = logging.getLogger(__name__)


def use_partitioner(name: str) -> None:
    """Make `name` ("shardy" | "gspmd") the partitioner of every program compiled from now on."""
    if name not in ("shardy", "gspmd"):
        raise ValueError(f"unknown partitioner {name!r}; choose shardy or gspmd")
    want = name == "shardy"
    if jax.config.jax_use_shardy_partitioner != want:
        jax.config.update("jax_use_shardy_partitioner", want)
        log.info("SPMD partitioner for this process: %s (--partitioner)", name)
