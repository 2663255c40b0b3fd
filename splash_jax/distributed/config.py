"""How this process joins a multi-process engine: one dataclass, each field a CLI flag.

Defaults come from the environment variables JAX's own launchers use, so the same command line
works under SLURM/Kubernetes templates that export them per process.
"""

from __future__ import annotations

import dataclasses
import os


def _env_str(name: str):
    return lambda: os.environ.get(name) or None


def _env_int(name: str):
    return lambda: int(os.environ[name]) if os.environ.get(name) else None


@dataclasses.dataclass
class DistributedConfig:
    """One engine over several processes (hosts) with jax.distributed; off when num_processes <= 1."""

    coordinator_address: str | None = dataclasses.field(default_factory=_env_str("JAX_COORDINATOR_ADDRESS"))  # host:port of process 0
    num_processes: int | None = dataclasses.field(default_factory=_env_int("JAX_NUM_PROCESSES"))  # processes (hosts) in the engine; <= 1: one process
    process_id: int | None = dataclasses.field(default_factory=_env_int("JAX_PROCESS_ID"))  # 0 serves HTTP
    command_port: int = 0  # TCP port on process 0 for the step-command channel (0: any free port)
    peer_timeout_s: float = 10.0  # a peer silent this long (no heartbeat) stops the engine
    init_timeout_s: int = 300  # how long processes wait for each other at start-up

    @property
    def enabled(self) -> bool:
        return (self.num_processes or 1) > 1

    def validate(self) -> None:
        if not self.enabled:
            return
        if self.coordinator_address is None or self.process_id is None:
            raise ValueError(
                "a multi-process engine needs --coordinator-address and --process-id "
                "(or JAX_COORDINATOR_ADDRESS / JAX_PROCESS_ID) on every process"
            )
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.peer_timeout_s <= 0:
            raise ValueError("--peer-timeout-s must be positive")

    @classmethod
    def add_cli_args(cls, parser) -> None:
        from splash_jax.engine.config import add_dataclass_args

        add_dataclass_args(parser.add_argument_group("multi-process (jax.distributed)"), cls)

    @classmethod
    def from_cli_args(cls, args) -> "DistributedConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
