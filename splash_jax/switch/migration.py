"""Migration programs, compiled ahead of time: page copies between devices and weight reshards.

Page copies run in bounded chunks: a chunk moves up to K pages from every device to every
device (all layers, latent and rope, either pool segment) with one all_to_all inside
shard_map, so the transfer is a device collective, never a host round trip (DESIGN.md §3).
With the stacked pool ([L, P, S, D] per segment) a chunk is one gather and one scatter over
[all layers, page ids].
Weights are resharded by one jitted identity over every leaf that changes, whose out_shardings
are the targets; the sources are deleted after it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.cache import KVCache
from splash_jax.mesh.layouts import AXIS, POOL_SPEC

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PageChunk:
    """Per-device index arrays of one copy chunk; row j of device d's arrays pairs it with device j."""

    send_ids: np.ndarray  # [N, N, K] local ids device d sends to device j
    send_seg: np.ndarray  # [N, N, K] their segments
    recv_ids: np.ndarray  # [N, N, K] local ids on device d receiving from device j (sentinel = drop)
    recv_seg: np.ndarray  # [N, N, K]
    count: int  # pages in this chunk


def locate_copies(copies, allocator: PageAllocator) -> np.ndarray:
    """(source page, destination page) copies -> [6, M] int64 rows: source device, segment, local
    id, then destination device, segment, local id (the allocator's locate of both ends)."""
    ids = np.fromiter(itertools.chain.from_iterable(copies), np.int64, count=2 * len(copies)).reshape(-1, 2)
    return np.concatenate([np.stack(allocator.locate(ids[:, 0])), np.stack(allocator.locate(ids[:, 1]))])


def rank_within_groups(keys: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements have the same key (0, 1, 2, ... per key)."""
    m = len(keys)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    positions = np.arange(m)
    group_start = np.zeros(m, np.int64)  # position in sorted order where each element's key starts
    if m > 1:
        starts = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
        group_start[starts] = starts
        np.maximum.accumulate(group_start, out=group_start)
    rank = np.empty(m, np.int64)
    rank[order] = positions - group_start
    return rank


def pack_located(located: np.ndarray, num_devices: int, k: int, sentinel: int) -> list[PageChunk]:
    """Located copies ([6, M], see locate_copies) -> chunks of <= k pages per device pair, in
    order: the i-th copy of a pair goes to chunk i // k, slot i % k. Vectorized (no per-copy
    Python: at 8 devices and 64 pages per pair the per-copy loop took ~5 ms per step)."""
    if located.shape[1] == 0:
        return []
    n = num_devices
    sd, ss, sl, dd, ds, dl = located
    rank = rank_within_groups(sd * n + dd)
    chunk, slot = rank // k, rank % k
    c = int(chunk.max()) + 1
    send_ids = np.zeros((c, n, n, k), np.int32)
    send_seg = np.zeros((c, n, n, k), np.int32)
    recv_ids = np.full((c, n, n, k), sentinel, np.int32)
    recv_seg = np.zeros((c, n, n, k), np.int32)
    send_ids[chunk, sd, dd, slot], send_seg[chunk, sd, dd, slot] = sl, ss
    recv_ids[chunk, dd, sd, slot], recv_seg[chunk, dd, sd, slot] = dl, ds
    counts = np.bincount(chunk, minlength=c)
    return [PageChunk(send_ids[i], send_seg[i], recv_ids[i], recv_seg[i], int(counts[i])) for i in range(c)]


def move_sentinel(allocator: PageAllocator) -> int:
    """A receive id past both pool segments: the scatter drops it."""
    return allocator.pages_per_device + allocator.extra_per_device + 1


MOVE_FIELDS = ("send_ids", "send_seg", "recv_ids", "recv_seg")


def in_step_chunk_pages(requested: int, num_devices: int, page_bytes: int, budget_bytes: int = 256 * 2**20) -> int:
    """Pages per device pair a step carries: `requested`, capped so the N x K pages a device sends
    (all layers; the step holds them beside its own buffers) stay under `budget_bytes`."""
    return max(1, min(requested, budget_bytes // max(1, num_devices * page_bytes)))


def chunk_buffer(chunk: PageChunk) -> np.ndarray:
    """A chunk's index arrays as one per-device int32 buffer [N, 4*N*K] (one transfer)."""
    n = chunk.send_ids.shape[0]
    return np.concatenate([getattr(chunk, f).reshape(n, -1) for f in MOVE_FIELDS], axis=1)


def _split(buf: jax.Array, n: int):
    k = buf.shape[0] // (len(MOVE_FIELDS) * n)
    return [buf[i * n * k : (i + 1) * n * k].reshape(n, k) for i in range(len(MOVE_FIELDS))]


def _gather_pages(pools, ids, seg):
    """Pages `ids` of every layer from the pool segment `seg` names: [N, K] -> [L, N, K, S, D]."""
    base = pools[0][:, jnp.clip(ids, 0, pools[0].shape[1] - 1)]
    if len(pools) == 1:
        return base
    extra = pools[1][:, jnp.clip(ids, 0, pools[1].shape[1] - 1)]
    return jnp.where((seg == 0)[None, ..., None, None], base, extra)


def _scatter_pages(pools, data, ids, seg):
    """data [L, N, K, S, D] into pages `ids` of every layer (ids of the other segment are dropped)."""
    out = [pools[0].at[:, jnp.where(seg == 0, ids, pools[0].shape[1] + 1)].set(data, mode="drop")]
    if len(pools) > 1:
        out.append(pools[1].at[:, jnp.where(seg == 1, ids, pools[1].shape[1] + 1)].set(data, mode="drop"))
    return out


def move_pages_start(kv: KVCache, buf: jax.Array) -> tuple[jax.Array, KVCache]:
    """Per device, inside shard_map: gather the pages this device sends (every layer at once, latent
    and rope side by side) and start exchanging them with one all_to_all. Returns the pages in
    flight and the pool to go on with.

    The gather reads the pool before the step's forward pass writes new tokens into it (in place).
    Without an order between the two, XLA keeps the old pool alive for the gather by copying all of
    it: measured on 2 H200s with a 30 GB pool, each moving step took ~10x a plain one. The
    optimization barrier makes the forward pass use the pool only after the gather has read it, so
    the pool stays in place; the all_to_all comes after the barrier and overlaps the forward pass."""
    n = jax.lax.axis_size(AXIS)
    send_ids, send_seg, _, _ = _split(buf, n)
    segments = kv.segments()
    parts = [_gather_pages([seg[p] for seg in segments], send_ids, send_seg) for p in range(2)]
    data = jnp.concatenate(parts, axis=-1)  # [L, N, K, S, latent + rope]
    data, kv = jax.lax.optimization_barrier((data, kv))
    return jax.lax.all_to_all(data, AXIS, split_axis=1, concat_axis=1, tiled=True), kv


def move_pages_finish(kv: KVCache, received: jax.Array, buf: jax.Array) -> KVCache:
    """Scatter received pages into their reserved destination pages (sentinel ids are dropped)."""
    n = jax.lax.axis_size(AXIS)
    _, _, recv_ids, recv_seg = _split(buf, n)
    latent_dim = kv.latent.shape[-1]
    segments = kv.segments()
    latent = _scatter_pages([seg[0] for seg in segments], received[..., :latent_dim], recv_ids, recv_seg)
    rope = _scatter_pages([seg[1] for seg in segments], received[..., latent_dim:], recv_ids, recv_seg)
    return KVCache.from_segments(tuple(zip(latent, rope)))


class PageMover:
    """The precompiled standalone page-copy program for one KV structure (with or without the
    extra segment): for the few copies a handoff must finish at once (partial last pages)."""

    def __init__(self, mesh, kv_abstract: KVCache, k: int):
        self.mesh, self.k = mesh, k
        self.compiled = self.lower(mesh, kv_abstract, k).compile()
        self.index_sharding = NamedSharding(mesh, P(AXIS))

    @staticmethod
    def lower(mesh, kv_abstract: KVCache, k: int):
        """The mover for this pool structure and K, lowered from abstract inputs (no devices needed)."""
        n = mesh.shape[AXIS]
        per_device = NamedSharding(mesh, P(AXIS))

        def per_device_fn(kv: KVCache, buf):
            received, kv = move_pages_start(kv, buf[0])
            return move_pages_finish(kv, received, buf[0])

        kv_specs = jax.tree.map(lambda _: POOL_SPEC, kv_abstract)
        mapped = jax.shard_map(per_device_fn, mesh=mesh, in_specs=(kv_specs, P(AXIS)), out_specs=kv_specs, check_vma=False)
        idx = jax.ShapeDtypeStruct((n, len(MOVE_FIELDS) * n * k), jnp.int32, sharding=per_device)
        return jax.jit(mapped, donate_argnums=(0,)).lower(kv_abstract, idx)

    def __call__(self, kv: KVCache, chunk: PageChunk) -> KVCache:
        return self.compiled(kv, jax.device_put(chunk_buffer(chunk), self.index_sharding))


class WeightResharder:
    """Places the attention weight leaves a switch changes on their target shardings: one compiled
    identity per (leaves' shapes and dtypes, source specs, target specs), all leaves in one call
    (one launch at a handoff instead of one per leaf: 0.2-0.35 ms each on the H200 host). The
    sources are deleted right after (freed once the queued programs that read them are done).
    (Donation cannot alias buffers whose per-device shape changes, so the delete is explicit.)"""

    def __init__(self, mesh):
        self.mesh = mesh
        self._programs: dict = {}

    def program(self, abstracts: list[jax.ShapeDtypeStruct], src_specs: list[P], dst_specs: list[P]):
        key = (tuple((a.shape, a.dtype) for a in abstracts), tuple(src_specs), tuple(dst_specs))
        if key not in self._programs:
            self._programs[key] = self.lower(abstracts, src_specs, dst_specs).compile()
        return self._programs[key]

    def lower(self, abstracts: list[jax.ShapeDtypeStruct], src_specs: list[P], dst_specs: list[P]):
        """The reshard identity for these leaves, lowered from abstract inputs."""
        srcs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, s))
                for a, s in zip(abstracts, src_specs)]
        fn = jax.jit(lambda *xs: xs, out_shardings=tuple(NamedSharding(self.mesh, s) for s in dst_specs))
        return fn.lower(*srcs)

    def __call__(self, xs: list[jax.Array], dst_specs: list[P], delete_sources: bool = True) -> list[jax.Array]:
        abstracts = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]
        outs = self.program(abstracts, [x.sharding.spec for x in xs], list(dst_specs))(*xs)
        if delete_sources:
            for x in xs:
                x.delete()
        return list(outs)


def new_extra_segment(kv: KVCache, extra_pages_total: int, sharding) -> KVCache:
    """Allocate the extra segment (zeros) next to an existing base segment."""
    layers, _, page_size, latent_dim = kv.latent.shape
    latent, rope = KVCache.zeros_segment(
        layers, extra_pages_total, page_size, latent_dim, kv.rope.shape[-1], kv.latent.dtype, sharding
    )
    return dataclasses.replace(kv, extra_latent=latent, extra_rope=rope)


def drop_extra_segment(kv: KVCache) -> KVCache:
    for x in (kv.extra_latent, kv.extra_rope):
        if x is not None:
            x.delete()
    return dataclasses.replace(kv, extra_latent=None, extra_rope=None)
