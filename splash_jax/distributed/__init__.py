"""One engine over several processes (hosts) with jax.distributed (docs/multihost.md).

    runtime = initialize(DistributedConfig(...))       # before anything touches a device
    config = runtime.share_config(config) if runtime else config
    engine = Engine(config)                             # on every process, same programs
    if runtime and not runtime.is_leader:
        follow(engine, runtime)                         # replay process 0's commands until stop
"""

from splash_jax.distributed.config import DistributedConfig
from splash_jax.distributed.runtime import Runtime, agree_min, current, initialize

__all__ = ["DistributedConfig", "Runtime", "agree_min", "attach", "current", "follow", "initialize"]


def attach(engine) -> None:
    """Called at the end of Engine.__init__: on process 0 of a multi-process engine, stream its
    device calls to the followers; otherwise nothing."""
    rt = current()
    if rt is not None and rt.is_leader:
        from splash_jax.distributed.leader import attach_leader

        attach_leader(engine, rt.channel)


def follow(engine, runtime) -> None:
    from splash_jax.distributed.follower import follow as _follow

    _follow(engine, runtime)
