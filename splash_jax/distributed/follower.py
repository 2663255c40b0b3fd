"""A follower process: builds the same engine as process 0, then replays its command stream.

A follower schedules nothing and reads nothing back: it launches exactly the programs process 0
launches, in the same order, on its own shards of the same global arrays (see leader.py for the
commands). It ends on `stop`, and exits with an error if process 0 disappears or a command
cannot be mirrored (process 0 then sees the closed connection and stops too).
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from splash_jax.distributed.channel import PeerLost, exit_on_failure
from splash_jax.distributed.leader import MirrorError, global_mask, global_step_inputs
from splash_jax.distributed.wire import Command
from splash_jax.engine.executor import Bucket
from splash_jax.engine.sampler import SamplerMode
from splash_jax.mesh.layouts import get_layout
from splash_jax.switch.migration import PageChunk, drop_extra_segment

log = logging.getLogger(__name__)


def spec_from_json(spec: list) -> P:
    return P(*[tuple(d) if isinstance(d, list) else d for d in spec])


class Follower:
    def __init__(self, engine, channel):
        self.engine, self.channel = engine, channel
        self.ex = engine.executor
        self.outputs: list[jax.Array] = []  # recorded-program outputs since the last swap
        self.lag_s: list[float] = []  # process 0 sent a step -> taken up here (includes work on earlier commands; same clock only)
        self.num_commands = 0
        self.deferred = None  # a step's logits whose sampling process 0 sends next (`sample`)

    def run(self) -> None:
        """Replay commands until process 0 says stop."""
        log.info("process %d following process 0's command stream", jax.process_index())
        while True:
            cmd = self.channel.recv()
            if cmd.op == "stop":
                break
            self.num_commands += 1
            handler = getattr(self, "_" + cmd.op, None)
            if handler is None:
                raise MirrorError(f"unknown command {cmd.op!r} (process 0 runs a different splash-jax version?)")
            handler(cmd)
        log.info("process %d stopping after %d commands; %s", jax.process_index(), self.num_commands, self.lag_summary())

    def lag_summary(self) -> str:
        if not self.lag_s:
            return "no steps"
        ms = np.asarray(self.lag_s) * 1e3
        return f"step command lag (sent -> taken up here) p50 {np.percentile(ms, 50):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms over {len(ms)} steps"

    # --- commands (leader.py sends them) -----------------------------------------------------
    def _step(self, cmd: Command) -> None:
        self.lag_s.append(time.time() - cmd.fields["t"])
        a = cmd.arrays
        try:
            bucket, full, expanded, defer = (Bucket(**cmd.fields["bucket"]), cmd.fields["full"],
                                             cmd.fields.get("expanded", False), cmd.fields.get("defer", False))
            apart = self.ex.returns_logits(bucket, full, a["move"] is not None, expanded, defer)
            inputs = global_step_inputs(self.ex, a["rep"], a["dev"], a["move"], apart)
            out = self.ex.run(bucket, *inputs, full, expanded, SamplerMode(**cmd.fields.get("mode", {})), defer)
            self.deferred = out if cmd.fields.get("defer", False) else None
        except Exception as e:  # noqa: BLE001 - process 0 sees the same failure and sends `reset`
            log.warning("mirrored step failed (%s: %s); waiting for process 0's recovery", type(e).__name__, e)

    def _sample(self, cmd: Command) -> None:
        """The deferred sampler of the last step (a step with grammar masks)."""
        step, self.deferred = self.deferred, None
        if step is None:
            log.warning("a sample command without a deferred step (the step failed here); waiting for recovery")
            return
        try:
            self.ex.sample(step, SamplerMode(**cmd.fields["mode"]), global_mask(self.ex, cmd.arrays.get("mask")))
        except Exception as e:  # noqa: BLE001 - process 0 sees the same failure and sends `reset`
            log.warning("mirrored sampling failed (%s: %s); waiting for process 0's recovery", type(e).__name__, e)

    def _reset(self, cmd: Command) -> None:
        self.outputs = []
        self.ex.reset_device_state()

    def _drop_extra(self, cmd: Command) -> None:
        self.ex.apply_to_pool(drop_extra_segment)

    def _move(self, cmd: Command) -> None:
        mover = self.engine.switcher.movers[cmd.fields["key"]]
        chunk = PageChunk(**cmd.arrays, **cmd.fields["chunk"])
        self.ex.apply_to_pool(lambda kv: mover(kv, chunk))

    def _copy_pages(self, cmd: Command) -> None:
        buf = cmd.arrays["buf"]
        self.ex.copy_pages(jax.make_array_from_callback(buf.shape, self.ex.per_device, lambda i: buf[i]))

    def _reshard(self, cmd: Command) -> None:
        xs = [self.ex.params[i] for i in cmd.fields["leaves"]]
        specs = [spec_from_json(s) for s in cmd.fields["specs"]]
        self.outputs.extend(self.engine.switcher.resharder(xs, specs, cmd.fields.get("delete_sources", True)))

    def _make_extra(self, cmd: Command) -> None:
        self.outputs.extend(jax.tree.leaves(self.engine.switcher._make_extra()))

    def _swap(self, cmd: Command) -> None:
        layout = get_layout(cmd.fields["layout"])
        pool = jax.tree.leaves(self.ex.pool)

        def resolve(ref, current):
            kind, i = ref
            return self.outputs[i] if kind == "out" else current[i]

        params = [resolve(r, self.ex.params) for r in cmd.fields["params"]]
        for old, new in zip(self.ex.params, params):
            if old is not new and not old.is_deleted():
                old.delete()  # kept by a reshard at the switch's start for the source layout's steps
        leaves = [resolve(r, pool) for r in cmd.fields["kv"]]
        structure = jax.tree.structure(self.ex.kv_abstract(layout))
        if structure.num_leaves != len(leaves):
            raise MirrorError(f"swap to {layout.name}: {len(leaves)} pool arrays for a structure of {structure.num_leaves}")
        self.ex.swap(layout, params, jax.tree.unflatten(structure, leaves))
        self.engine.layout = layout
        self.outputs = []


def follow(engine, runtime) -> None:
    """Run a follower until process 0 stops it; a lost process 0 ends this process with an error."""
    try:
        Follower(engine, runtime.channel).run()
    except PeerLost as e:
        exit_on_failure(f"process {runtime.process_id}: {e}")
    except Exception as e:  # noqa: BLE001 - a diverged follower must not keep running
        log.exception("follower failed")
        exit_on_failure(f"process {runtime.process_id} cannot follow process 0: {type(e).__name__}: {e}")
    runtime.shutdown()
