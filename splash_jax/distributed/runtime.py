"""Joining the multi-process runtime: jax.distributed, then the command channel.

Call `initialize` before anything touches a device: it fixes the CPU collectives (gloo), starts
jax.distributed (every process then sees every process's devices in one global order, which the
mesh uses as is), and connects the command channel (process 0 listens on `command_port`, publishes
the port in the coordination service's key-value store; the others connect to it).
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from splash_jax.distributed.channel import FollowerChannel, LeaderChannel, exit_on_failure
from splash_jax.distributed.config import DistributedConfig
from splash_jax.distributed.wire import Command

log = logging.getLogger(__name__)

PORT_KEY = "splash_jax/command_port"
_RUNTIME: "Runtime | None" = None


@dataclasses.dataclass
class Runtime:
    config: DistributedConfig
    process_id: int
    num_processes: int
    channel: LeaderChannel | FollowerChannel

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def share_config(self, engine_config):
        """Process 0's EngineConfig wins everywhere: followers build exactly the engine it built
        (same shapes, same programs, same order). Returns the config this process must use."""
        from splash_jax.engine.config import EngineConfig

        if self.is_leader:
            self.channel.send(Command("config", {"engine": dataclasses.asdict(engine_config)}))
            return engine_config
        cmd = self.channel.recv()
        if cmd.op != "config":
            raise RuntimeError(f"expected the engine config from process 0, got {cmd.op!r}")
        leader = engine_config_from_dict(EngineConfig, cmd.fields["engine"])
        if engine_config is not None:
            mine = dataclasses.asdict(engine_config)
            differ = sorted(k for k, v in cmd.fields["engine"].items() if mine.get(k) != v)
            if differ:
                log.info("using process 0's engine settings for %s", ", ".join(differ))
        return leader

    def shutdown(self) -> None:
        """Process 0: stop the followers. Every process: leave jax.distributed."""
        global _RUNTIME
        self.channel.close()  # process 0: sends `stop` first
        jax.distributed.shutdown()
        _RUNTIME = None


def engine_config_from_dict(cls, values: dict):
    from splash_jax.policy import PolicyConfig

    values = dict(values)
    values["policy"] = PolicyConfig(**values["policy"])
    return cls(**values)


def current() -> Runtime | None:
    """The runtime of this process, or None in a single-process engine."""
    return _RUNTIME


def initialize(config: DistributedConfig, on_failure=exit_on_failure) -> Runtime | None:
    """Join the multi-process engine described by `config` (None and no-op when it is off)."""
    global _RUNTIME
    config.validate()
    if not config.enabled:
        return None
    if _RUNTIME is not None:
        raise RuntimeError("splash_jax.distributed.initialize was already called")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        config.coordinator_address, config.num_processes, config.process_id,
        initialization_timeout=config.init_timeout_s,
        heartbeat_timeout_seconds=max(10, int(3 * config.peer_timeout_s)),
    )
    client = jax._src.distributed.global_state.client
    followers = config.num_processes - 1
    if config.process_id == 0:
        channel = LeaderChannel(followers, config.command_port, config.peer_timeout_s, on_failure)
        client.key_value_set(PORT_KEY, str(channel.port))
        channel.accept(config.init_timeout_s)
        port = channel.port
    else:
        port = int(client.blocking_key_value_get(PORT_KEY, config.init_timeout_s * 1000))
        host = config.coordinator_address.rsplit(":", 1)[0].strip("[]")
        channel = FollowerChannel(host, port, config.process_id, config.peer_timeout_s, config.init_timeout_s)
    _RUNTIME = Runtime(config, config.process_id, config.num_processes, channel)
    log.info(
        "process %d of %d joined: %d local / %d global devices, command channel on port %d",
        config.process_id, config.num_processes, jax.local_device_count(), jax.device_count(), port,
    )
    return _RUNTIME


def agree_min(name: str, value: int) -> int:
    """The smallest `value` over all processes (e.g. KV pages that fit on every host's devices)."""
    if _RUNTIME is None:
        return value
    client = jax._src.distributed.global_state.client
    client.key_value_set(f"splash_jax/agree/{name}/{_RUNTIME.process_id}", str(int(value)))
    timeout_ms = _RUNTIME.config.init_timeout_s * 1000
    values = [int(client.blocking_key_value_get(f"splash_jax/agree/{name}/{p}", timeout_ms)) for p in range(_RUNTIME.num_processes)]
    return min(values)
