"""Copies of pages within each device: copy-on-write of a shared, cached page.

A request whose whole prompt is cached reuses every page, but the page holding its last prompt
token is written again (that token is computed, to get its logits) and its next tokens land on
it when the prompt does not end a page. A page several requests reference is never written, so
the request takes a private page and this program copies the cached page's latents into it (all
layers, latent and rope) before the step that computes the token: one decode-sized step instead
of recomputing the page. Source and destination are on the same device (a page's placement
never changes for copy-on-write), so the program is a gather and a scatter per device, no
collective. One program per pool structure (with or without the extra segment), compiled with the
step programs, K copies per device per call (more run as several calls).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from splash_jax.kv.cache import KVCache
from splash_jax.mesh.host_put import put
from splash_jax.mesh.layouts import AXIS, POOL_SPEC

COPY_FIELDS = 4  # per copy slot: source local id, source segment, destination local id, destination segment
COPIES_PER_CALL = 16  # K: copies per device in one call (a step admits few fully cached prompts per device)


def pack_copies(pairs, allocator, k: int = COPIES_PER_CALL) -> list[np.ndarray]:
    """(source, destination) global page ids on the same device -> per-call int32 buffers
    [N, 4*K]: for each device K slots of (source id, segment, destination id, segment), unused
    slots dropped (destination past both segments)."""
    if not len(pairs):  # nearly every step: nothing to copy, no array work
        return []
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    sd, ss, sl = allocator.locate(pairs[:, 0])
    dd, ds, dl = allocator.locate(pairs[:, 1])
    if (sd != dd).any():
        raise ValueError("copy-on-write pages must stay on their device")
    n = allocator.num_devices
    rank = np.zeros(len(pairs), np.int64)
    seen = np.zeros(n, np.int64)
    for i, d in enumerate(sd):  # a handful per step
        rank[i], seen[d] = seen[d], seen[d] + 1
    calls = int(rank.max()) // k + 1
    out = np.stack([no_copies(allocator, k).reshape(n, COPY_FIELDS, k)] * calls)
    call, slot = rank // k, rank % k
    out[call, sd, 0, slot], out[call, sd, 1, slot] = sl, ss
    out[call, sd, 2, slot], out[call, sd, 3, slot] = dl, ds
    return [buf.reshape(n, -1) for buf in out]


def no_copies(allocator, k: int = COPIES_PER_CALL) -> np.ndarray:
    """A buffer that copies nothing (start-up runs the program once: a program's first call takes
    jax's slow dispatch path, ~2 ms on the H200 host, which would land on a request's first token)."""
    out = np.zeros((allocator.num_devices, COPY_FIELDS, k), np.int32)
    out[:, 2, :] = allocator.pages_per_device + allocator.extra_per_device + 1
    return out.reshape(allocator.num_devices, -1)


def _gather(pools, ids, seg):
    """Pages `ids` (of segment `seg`) of every layer: [L, K, S, D]."""
    data = pools[0][:, jnp.clip(ids, 0, pools[0].shape[1] - 1)]
    if len(pools) > 1:
        extra = pools[1][:, jnp.clip(ids, 0, pools[1].shape[1] - 1)]
        data = jnp.where((seg == 0)[None, :, None, None], data, extra)
    return data


def _scatter(pools, data, dst, dst_seg):
    """data [L, K, S, D] over pages `dst` of segment `dst_seg` (out-of-range ids are dropped)."""
    out = [pools[0].at[:, jnp.where(dst_seg == 0, dst, pools[0].shape[1] + 1)].set(data, mode="drop")]
    if len(pools) > 1:
        out.append(pools[1].at[:, jnp.where(dst_seg == 1, dst, pools[1].shape[1] + 1)].set(data, mode="drop"))
    return out


def copy_local_pages(kv: KVCache, ids, seg, dst, dst_seg) -> KVCache:
    """Per device (inside shard_map): pages `ids` of every layer written over pages `dst`. The
    optimization barrier orders the gathers before the in-place scatters, so XLA updates the
    pool in place instead of keeping a copy of it for the gathers (DESIGN.md section 3)."""
    segments = kv.segments()
    data = [_gather([s[part] for s in segments], ids, seg) for part in range(2)]
    data, segments = jax.lax.optimization_barrier((data, segments))
    out = [_scatter([s[part] for s in segments], data[part], dst, dst_seg) for part in range(2)]
    return KVCache.from_segments(tuple(zip(out[0], out[1])))


class PageCopier:
    """The precompiled in-device page copy for one pool structure and K."""

    def __init__(self, mesh, kv_abstract: KVCache, k: int = COPIES_PER_CALL):
        self.k = k
        self.index_sharding = NamedSharding(mesh, P(AXIS))
        self.compiled = self.lower(mesh, kv_abstract, k).compile()

    @staticmethod
    def lower(mesh, kv_abstract: KVCache, k: int):
        n = mesh.shape[AXIS]

        def per_device(kv: KVCache, buf):
            ids, seg, dst, dst_seg = buf[0].reshape(COPY_FIELDS, k)
            return copy_local_pages(kv, ids, seg, dst, dst_seg)

        specs = jax.tree.map(lambda _: POOL_SPEC, kv_abstract)
        mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=specs, check_vma=False)
        idx = jax.ShapeDtypeStruct((n, COPY_FIELDS * k), jnp.int32, sharding=NamedSharding(mesh, P(AXIS)))
        return jax.jit(mapped, donate_argnums=(0,)).lower(kv_abstract, idx)

    def __call__(self, kv: KVCache, buf) -> KVCache:
        if isinstance(buf, np.ndarray):
            buf = put(buf, self.index_sharding)
        return self.compiled(kv, buf)
