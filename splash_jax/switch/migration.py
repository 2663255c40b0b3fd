"""Migration programs, compiled ahead of time: page copies between devices and weight reshards.

Page copies run in bounded chunks: a chunk moves up to K pages from every device to every
device (all layers, latent and rope, either pool segment) with one all_to_all inside
shard_map, so the transfer is a device collective, never a host round trip (DESIGN.md §3).
Weights are resharded leaf by leaf with a jitted identity whose out_shardings is the target
and whose input is donated, so each source buffer is freed as its replacement appears.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.cache import KVCache
from splash_jax.mesh.layouts import AXIS

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PageChunk:
    """Per-device index arrays of one copy chunk; row j of device d's arrays pairs it with device j."""

    send_ids: np.ndarray  # [N, N, K] local ids device d sends to device j
    send_seg: np.ndarray  # [N, N, K] their segments
    recv_ids: np.ndarray  # [N, N, K] local ids on device d receiving from device j (sentinel = drop)
    recv_seg: np.ndarray  # [N, N, K]
    count: int  # pages in this chunk


def pack_chunks(copies: list[tuple[int, int]], allocator: PageAllocator, k: int) -> list[PageChunk]:
    """Split (source page, destination page) copies into chunks of <= k pages per device pair."""
    n = allocator.num_devices
    sentinel = allocator.pages_per_device + allocator.extra_per_device + 1
    if not copies:
        return []
    src, dst = np.array([c[0] for c in copies]), np.array([c[1] for c in copies])
    sd, ss, sl = allocator.locate(src)
    dd, ds, dl = allocator.locate(dst)
    slots: dict[tuple[int, int], int] = {}
    chunk_of = np.zeros(len(copies), np.int64)
    slot_of = np.zeros(len(copies), np.int64)
    for i, pair in enumerate(zip(sd.tolist(), dd.tolist())):
        c = slots.get(pair, 0)
        slots[pair] = c + 1
        chunk_of[i], slot_of[i] = c // k, c % k
    chunks = []
    for c in range(int(chunk_of.max()) + 1):
        send_ids = np.zeros((n, n, k), np.int32)
        send_seg = np.zeros((n, n, k), np.int32)
        recv_ids = np.full((n, n, k), sentinel, np.int32)
        recv_seg = np.zeros((n, n, k), np.int32)
        sel = np.nonzero(chunk_of == c)[0]
        for i in sel:
            a, b, s = sd[i], dd[i], slot_of[i]
            send_ids[a, b, s], send_seg[a, b, s] = sl[i], ss[i]
            recv_ids[b, a, s], recv_seg[b, a, s] = dl[i], ds[i]
        chunks.append(PageChunk(send_ids, send_seg, recv_ids, recv_seg, len(sel)))
    return chunks


def _gather_pages(pools, ids, seg):
    """Rows `ids` from the pool segment `seg` names: [N, K] -> [N, K, S, D]."""
    base = pools[0][jnp.clip(ids, 0, pools[0].shape[0] - 1)]
    if len(pools) == 1:
        return base
    extra = pools[1][jnp.clip(ids, 0, pools[1].shape[0] - 1)]
    return jnp.where((seg == 0)[..., None, None], base, extra)


def _scatter_pages(pools, data, ids, seg):
    out = [pools[0].at[jnp.where(seg == 0, ids, pools[0].shape[0] + 1)].set(data, mode="drop")]
    if len(pools) > 1:
        out.append(pools[1].at[jnp.where(seg == 1, ids, pools[1].shape[0] + 1)].set(data, mode="drop"))
    return out


class PageMover:
    """The precompiled page-copy program for one KV structure (with or without the extra segment)."""

    def __init__(self, mesh, kv_abstract: KVCache, k: int):
        self.mesh, self.k = mesh, k
        n = mesh.shape[AXIS]
        per_device = NamedSharding(mesh, P(AXIS))

        def per_device_fn(kv: KVCache, send_ids, send_seg, recv_ids, recv_seg):
            send_ids, send_seg, recv_ids, recv_seg = send_ids[0], send_seg[0], recv_ids[0], recv_seg[0]
            layers = []
            for i in range(kv.num_layers):
                segments = kv.layer(i)
                moved = []
                for part in range(2):  # latent, rope
                    pools = [seg[part] for seg in segments]
                    data = _gather_pages(pools, send_ids, send_seg)
                    data = jax.lax.all_to_all(data, AXIS, split_axis=0, concat_axis=0, tiled=True)
                    moved.append(_scatter_pages(pools, data, recv_ids, recv_seg))
                layers.append(tuple(zip(moved[0], moved[1])))
            return KVCache.from_layers(layers)

        kv_specs = jax.tree.map(lambda _: P(AXIS), kv_abstract)
        mapped = jax.shard_map(
            per_device_fn, mesh=mesh, in_specs=(kv_specs,) + (P(AXIS),) * 4, out_specs=kv_specs, check_vma=False
        )
        idx = jax.ShapeDtypeStruct((n, n, k), jnp.int32, sharding=per_device)
        self.compiled = jax.jit(mapped, donate_argnums=(0,)).lower(kv_abstract, idx, idx, idx, idx).compile()
        self.index_sharding = per_device

    def __call__(self, kv: KVCache, chunk: PageChunk) -> KVCache:
        arrays = jax.device_put((chunk.send_ids, chunk.send_seg, chunk.recv_ids, chunk.recv_seg), self.index_sharding)
        return self.compiled(kv, *arrays)


class WeightResharder:
    """Per (shape, dtype, source spec, target spec): a compiled identity placing a leaf on its target
    sharding; the source is deleted right after, so at most one leaf exists twice at a time.
    (Donation cannot alias buffers whose per-device shape changes, so the delete is explicit.)"""

    def __init__(self, mesh):
        self.mesh = mesh
        self._programs: dict = {}

    def program(self, abstract: jax.ShapeDtypeStruct, src_spec: P, dst_spec: P):
        key = (abstract.shape, abstract.dtype, src_spec, dst_spec)
        if key not in self._programs:
            src = jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=NamedSharding(self.mesh, src_spec))
            fn = jax.jit(lambda x: x, out_shardings=NamedSharding(self.mesh, dst_spec))
            self._programs[key] = fn.lower(src).compile()
        return self._programs[key]

    def __call__(self, x: jax.Array, dst_spec: P) -> jax.Array:
        out = self.program(jax.ShapeDtypeStruct(x.shape, x.dtype), x.sharding.spec, dst_spec)(x)
        x.delete()
        return out


def new_extra_segment(kv: KVCache, extra_pages_total: int, sharding) -> KVCache:
    """Allocate the extra segment (zeros) next to an existing base segment."""
    layers, page_size = kv.num_layers, kv.latent[0].shape[1]
    latent, rope = KVCache.zeros_segment(
        layers, extra_pages_total, page_size, kv.latent[0].shape[2], kv.rope[0].shape[2], kv.latent[0].dtype, sharding
    )
    return dataclasses.replace(kv, extra_latent=latent, extra_rope=rope)


def drop_extra_segment(kv: KVCache) -> KVCache:
    for x in kv.extra_latent + kv.extra_rope:
        x.delete()
    return dataclasses.replace(kv, extra_latent=(), extra_rope=())
