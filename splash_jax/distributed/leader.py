"""Process 0's side of the command stream: proxies that record every device-launching call.

In multi-controller JAX every process must launch the same programs, in the same order, on
global arrays. Process 0 alone schedules, so the device-facing objects of its engine are wrapped
from outside (no hook inside the executor or the switch controller): each call that launches a
device program is sent to the followers first (so they never make process 0 wait), then run here.
  executor.run / sample / reset_device_state / apply_to_pool / copy_pages / swap
    -> step, sample, reset, move/drop_extra, copy_pages, swap
  switch controller: page movers, weight resharder, extra-segment allocator -> move, reshard, make_extra
A swap names its arrays by where they came from (a current leaf, or the output of a recorded
program since the last swap), so followers assemble the same state from their own shards.
Anything else that reaches the device raises MirrorError here instead of silently diverging.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from splash_jax.distributed.wire import Command
from splash_jax.engine.sampler import FULL_MODE, SamplerMode
from splash_jax.engine.step_packer import step_buffer
from splash_jax.switch.migration import drop_extra_segment


class MirrorError(RuntimeError):
    """A device call that the followers cannot mirror: the multi-process wrapper needs a hook for it."""


def global_mask(ex, mask):
    """A grammar mask (host array) as a global replicated array (see global_step_inputs)."""
    return None if mask is None else jax.make_array_from_callback(mask.shape, ex.replicated, lambda i: mask[i])


def global_step_inputs(ex, rep, dev, move, full=False):
    # full: the step program returns its logits to a sampler program (executor.returns_logits)
    """A step's host buffers as global arrays, each process filling its own shards from its copy.

    jax.device_put of a numpy array onto a multi-process sharding first checks that every process
    passed the same value: a blocking cross-process all-gather per input (7 ms per step on 2 x 4 CPU
    devices, vs 0.06 ms this way). The executor's own device_put returns these arrays unchanged.
    """

    def put(x, sharding):
        return None if x is None else jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    return put(step_buffer(rep, dev), ex.input_sharding(full)), None, put(move, ex.per_device)


def spec_to_json(spec) -> list:
    return [list(d) if isinstance(d, tuple) else d for d in spec]


class _Outputs:
    """Arrays produced by recorded programs since the last swap, numbered in production order."""

    def __init__(self):
        self.arrays: list[jax.Array] = []

    def add(self, arrays) -> None:
        self.arrays.extend(arrays)

    def ref(self, x, current: list, kind: str) -> list:
        for i, y in enumerate(current):
            if y is x:
                return [kind, i]
        for k, y in enumerate(self.arrays):
            if y is x:
                return ["out", k]
        raise MirrorError(f"swap received an array ({x.shape}) that no recorded program produced")

    def clear(self) -> None:
        self.arrays = []


class LeaderExecutor:
    """The StepExecutor with every device-launching method streamed to the followers."""

    def __init__(self, inner, channel):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_outputs", _Outputs())
        object.__setattr__(self, "_pool_calls", None)  # recorded pool programs inside apply_to_pool

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    def run(self, bucket, rep: np.ndarray, dev: np.ndarray, move: np.ndarray | None = None, full: bool = False,
            expanded: bool = False, mode: SamplerMode = FULL_MODE, defer: bool = False, drafted: bool | None = None,
            inline=None):
        if inline is not None:  # (attach_leader turns MTP drafts inside step programs off)
            raise ValueError("a step program with MTP drafts inside is not mirrored to follower processes")
        self._channel.send(Command(
            "step", {"bucket": dataclasses.asdict(bucket), "full": bool(full), "expanded": bool(expanded),
                     "mode": dataclasses.asdict(mode), "defer": bool(defer), "t": time.time()},
            {"rep": rep, "dev": dev, "move": move},
        ))
        return self._inner.run(bucket, *global_step_inputs(self._inner, rep, dev, move, self._inner.returns_logits(bucket, full, move is not None, expanded, defer)), full, expanded, mode, defer, drafted)

    def sample(self, step, mode: SamplerMode = FULL_MODE, mask: np.ndarray | None = None):
        self._channel.send(Command("sample", {"mode": dataclasses.asdict(mode)}, {"mask": mask}))
        return self._inner.sample(step, mode, global_mask(self._inner, mask))

    def reset_device_state(self) -> None:
        self._channel.send(Command("reset"))
        self._outputs.clear()
        self._inner.reset_device_state()

    def apply_to_pool(self, fn) -> None:
        if fn is drop_extra_segment:  # deletes buffers, launches nothing; followers must delete too
            self._channel.send(Command("drop_extra"))
            return self._inner.apply_to_pool(fn)
        object.__setattr__(self, "_pool_calls", [])
        try:
            self._inner.apply_to_pool(fn)
            calls = self._pool_calls
        finally:
            object.__setattr__(self, "_pool_calls", None)
        if len(calls) != 1 or calls[0] is not self._inner.pool:
            raise MirrorError("apply_to_pool ran a function that is not exactly one recorded pool program")

    def copy_pages(self, buf: np.ndarray) -> None:
        self._channel.send(Command("copy_pages", {}, {"buf": buf}))
        self._inner.copy_pages(jax.make_array_from_callback(buf.shape, self._inner.per_device, lambda i: buf[i]))

    def swap(self, layout, params, kv) -> None:
        pool = jax.tree.leaves(self._inner.pool)
        fields = {
            "layout": layout.name,
            "params": [self._outputs.ref(x, self._inner.params, "param") for x in params],
            "kv": [self._outputs.ref(x, pool, "pool") for x in jax.tree.leaves(kv)],
        }
        self._channel.send(Command("swap", fields))
        self._outputs.clear()
        self._inner.swap(layout, params, kv)

    # --- used by the recorded switch programs -----------------------------------------------
    def record_pool_program(self, kv, cmd: Command, run):
        if self._pool_calls is None or kv is not self._inner.pool:
            raise MirrorError(f"{cmd.op} ran outside executor.apply_to_pool; followers cannot mirror it")
        self._channel.send(cmd)
        out = run()
        self._pool_calls.append(out)
        return out

    def leaf_index(self, x) -> int:
        for i, y in enumerate(self._inner.params):
            if y is x:
                return i
        raise MirrorError("a weight reshard got an array that is not a current parameter leaf")


class RecordedMover:
    """A PageMover whose calls (always on the executor's pool) are streamed as `move`."""

    def __init__(self, inner, key, executor: LeaderExecutor):
        self._inner, self._key, self._ex = inner, key, executor

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, kv, chunk):
        fields = {f.name: getattr(chunk, f.name) for f in dataclasses.fields(chunk)}
        arrays = {k: v for k, v in fields.items() if isinstance(v, np.ndarray)}
        scalars = {k: v for k, v in fields.items() if k not in arrays}
        cmd = Command("move", {"key": self._key, "chunk": scalars}, arrays)
        return self._ex.record_pool_program(kv, cmd, lambda: self._inner(kv, chunk))


class RecordedResharder:
    """The WeightResharder with each call (all the leaves a handoff changes) streamed as `reshard`."""

    def __init__(self, inner, executor: LeaderExecutor):
        self._inner, self._ex = inner, executor

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, xs, dst_specs, delete_sources: bool = True):
        leaves = [self._ex.leaf_index(x) for x in xs]
        specs = [spec_to_json(s) for s in dst_specs]
        self._ex._channel.send(Command("reshard", {"leaves": leaves, "specs": specs, "delete_sources": delete_sources}))
        outs = self._inner(xs, dst_specs, delete_sources)
        self._ex._outputs.add(outs)
        return outs


class RecordedProgram:
    """An argument-free program (the extra-segment allocator) streamed as `op`."""

    def __init__(self, inner, op: str, executor: LeaderExecutor):
        self._inner, self._op, self._ex = inner, op, executor

    def __call__(self):
        self._ex._channel.send(Command(self._op))
        out = self._inner()
        self._ex._outputs.add(jax.tree.leaves(out))
        return out


def attach_leader(engine, channel) -> None:
    """Wrap the engine's device-facing objects so every device call reaches the followers."""
    if isinstance(engine.executor, LeaderExecutor):
        return
    ex = LeaderExecutor(engine.executor, channel)
    engine.executor = ex
    if engine.mtp is not None:  # followers mirror step commands, not a step program with drafts inside
        engine.mtp.in_step_max_tokens = 0
    sw = engine.switcher
    if sw is not None:
        sw.movers = {k: RecordedMover(m, k, ex) for k, m in sw.movers.items()}
        sw.resharder = RecordedResharder(sw.resharder, ex)
        if sw._make_extra is not None:
            sw._make_extra = RecordedProgram(sw._make_extra, "make_extra", ex)
