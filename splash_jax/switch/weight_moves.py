"""The weights and memory side of a switch: which param leaves the destination places differently,
their bytes, whether they fit beside their sources, and resharding them. `WeightMoves` is a part
of SwitchController (switch/controller.py), which owns the caches and the resharder."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from splash_jax.mesh.layouts import Layout
from splash_jax.switch.planner import TransitionPlan


class WeightMoves:
    """Weight placement and device-memory checks of SwitchController (see the module docstring)."""

    def _must_wait_for_memory(self, plan: TransitionPlan, margin_bytes: int = 256 * 2**20) -> bool:
        """True when the buffers the handoff allocates (resharded weight leaves, the extra
        segment) might not fit next to those it frees (which stay allocated until the queued
        steps finish): the least free device memory is below what they need plus a margin.
        Backends without memory statistics (CPU) never wait."""
        engine = self.engine
        needed = 0 if self._prepared is not None else self._weight_bytes_needed(plan)
        if plan.extra_segment == "add":
            needed += engine.extra_pages * engine.page_bytes
        if not needed:
            return False
        free = _least_free_device_bytes(engine.mesh)
        return free is not None and free < needed + margin_bytes

    def _room_for_both_weights(self, plan: TransitionPlan, margin_bytes: int = 1 << 30) -> bool:
        """Whether the changed weight leaves can be resharded at the switch's start, living beside
        their sources until the handoff: every device has room for them plus a margin (a gather
        for DP needs the memory the dropped extra segment frees otherwise). Backends without
        memory statistics (CPU) always have room."""
        needed = self._weight_bytes_needed(plan)
        if not needed:
            return False
        free = _least_free_device_bytes(self.engine.mesh)
        return free is None or free >= needed + margin_bytes

    def _weight_bytes_needed(self, plan: TransitionPlan) -> int:
        """Bytes per device of the weight leaves the destination places differently."""
        return sum(self._leaf_bytes(plan.dst, i) for i, _ in self._changed_leaves(plan.dst))

    def _leaf_bytes(self, layout: Layout, i: int) -> int:
        """Bytes per device of param leaf i as `layout` places it (cached: shapes never change)."""
        key = (layout.name, i)
        if key not in self._leaf_bytes_cache:
            x = self.engine.executor.params[i]
            self._leaf_bytes_cache[key] = _bytes_per_device(x, NamedSharding(self.engine.mesh, self._specs(layout)[i]))
        return self._leaf_bytes_cache[key]

    def _specs(self, layout: Layout) -> list:
        """Every param leaf's spec under `layout` (cached: the paths never change; the rule lookups
        took ~0.4 ms per handoff on the CPU mesh's host)."""
        if layout.name not in self._spec_cache:
            self._spec_cache[layout.name] = [layout.param_spec(path) for path, _ in self.engine.executor.param_items()]
        return self._spec_cache[layout.name]

    def _changed_leaves(self, dst: Layout) -> list:
        """(index, spec under dst) of the param leaves `dst` places differently than they are now."""
        params = self.engine.executor.params
        return [(i, spec) for i, (x, spec) in enumerate(zip(params, self._specs(dst))) if x.sharding.spec != spec]

    def _resharded_weights(self, dst: Layout, keep_sources: bool = False) -> list:
        """The params as `dst` places them (one program for every leaf that changes, dispatched and
        not waited for: the next step consumes them). The sources are deleted unless kept (a
        reshard at the switch's start: the source layout's steps still read them)."""
        out = list(self.engine.executor.params)
        changed = self._changed_leaves(dst)
        if changed:
            new = self.resharder([out[i] for i, _ in changed], [spec for _, spec in changed], delete_sources=not keep_sources)
            for (i, _), y in zip(changed, new):
                out[i] = y
        return out


def _delete_replaced(arrays: list[jax.Array], others: list[jax.Array]) -> None:
    """Delete each of `arrays` that is not the same array as its counterpart in `others` (the
    leaves a reshard replaced; unchanged leaves are shared by both lists)."""
    for x, y in zip(arrays, others):
        if x is not y:
            x.delete()


def _bytes_per_device(x: jax.Array, sharding: NamedSharding) -> int:
    return int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize


def _least_free_device_bytes(mesh) -> int | None:
    """min over the mesh's devices of (memory limit - in use), or None without statistics."""
    free = []
    for d in mesh.devices.flat:
        if d.process_index != jax.process_index():
            continue  # another host's device: that process decides for its own
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free)
