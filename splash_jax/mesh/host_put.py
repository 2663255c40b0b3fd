"""Putting a step's small host buffers on the mesh, every step, at the cost of the copy alone.

`jax.device_put` of a numpy array spends most of its time in Python (argument checks, dtype
canonicalization, its dispatch and sharding bookkeeping): 42 us for a 2.4 KB int32 buffer on the
2-core CPU host, where the copy itself, `batched_device_put` of the per-device shards, takes 5 us.
At batch 1 the engine puts one packed input per step (pinned host memory on GPUs, which the
program call cannot take as a host buffer: executor.StepExecutor.step_input) and its core loop is
host-bound, so `put` does only the copy: per (sharding, shape) it remembers which devices get
which slice, and hands the shards to the same C++ routine jax.device_put ends in.

That routine is JAX-internal (jax._src.lib.xla_client.batched_device_put); `put` asks it to copy
during the call, so the caller's buffer is free again when it returns. If it is missing or its signature
changed, `put` falls back to jax.device_put for good (logged once), so a JAX upgrade costs speed,
never correctness. Only C-contiguous 4-byte numpy arrays take the short path (int32, uint32,
float32: nothing for x64 canonicalization to change); anything else goes through jax.device_put.
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np

log = logging.getLogger(__name__)

try:  # the routine jax.device_put of a numpy array ends in
    from jax._src import core as _core
    from jax._src.lib import xla_client as _xc

    _batched_device_put = _xc.batched_device_put
    # copy during the call: the caller may reuse its buffer at once (jax.device_put may alias a
    # CPU buffer instead: 8 CPU devices, an [8, 5] int32 array)
    _SEMANTICS = _xc.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
except (ImportError, AttributeError):  # pragma: no cover - a JAX without it: always the public path
    _batched_device_put = None

_SHORT_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32))


@functools.lru_cache(maxsize=256)
def _placement(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[list, tuple]:
    """(devices, index of each device's shard) of an array of `shape` under `sharding`."""
    devices = list(sharding._addressable_device_assignment)
    if sharding.is_fully_replicated:
        return devices, (None,) * len(devices)
    index = sharding.addressable_devices_indices_map(shape)
    return devices, tuple(index[d] for d in devices)


def put(x, sharding: jax.sharding.Sharding) -> jax.Array:
    """jax.device_put(x, sharding) for a step's numpy buffer, without its Python overhead."""
    global _batched_device_put
    if (_batched_device_put is None or not isinstance(x, np.ndarray) or x.dtype not in _SHORT_DTYPES
            or not x.flags.c_contiguous):
        return jax.device_put(x, sharding)
    try:
        devices, index = _placement(sharding, x.shape)
        shards = [x if i is None else x[i] for i in index]
        return _batched_device_put(_core.ShapedArray(x.shape, x.dtype), sharding, shards, devices, True, False, _SEMANTICS)
    except TypeError as e:  # the internal routine's signature changed: the public path from now on
        log.warning("host_put: JAX's batched_device_put refused its arguments (%s); using jax.device_put", e)
        _batched_device_put = None
        return jax.device_put(x, sharding)
