"""The paged latent KV cache as a pytree, and the step inputs that address it.

One physical structure for every layout (DESIGN.md §4 rule 1): a latent pool
[num_layers, num_pages, page_size, kv_lora_rank] and a rope-key pool [num_layers, num_pages,
page_size, rope_dim], sharded over devices on the page axis (mesh/layouts.POOL_SPEC).
Latent and rope parts are separate arrays so kernels read them as 512 + 64 without slicing.

Layers are stacked (one array, not one per layer) so a scan over layers can carry the whole pool.
A layer never takes a slice of it: a per-layer dynamic slice passed to a kernel (a custom call)
would be materialized, copying the layer's pool every layer of every step. Instead each device
views its [L, P, S, D] shard as [L * P, S, D] (a free reshape) and the layer's page ids are offset
by `layer * P` (`layer_batch`), for the writes (a scatter into the carried buffer, in place) and
for the reads (the page table), so attention kernels see one flat pool and keep their interface.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    latent: jax.Array  # [L, P, S, kv_lora_rank]   base segment
    rope: jax.Array  # [L, P, S, rope_dim]
    extra_latent: jax.Array | None = None  # [L, Pe, S, kv_lora_rank]: extra segment (see kv/allocator.py)
    extra_rope: jax.Array | None = None

    @property
    def num_layers(self) -> int:
        return self.latent.shape[0]

    @property
    def num_segments(self) -> int:
        return 1 if self.extra_latent is None else 2

    def segments(self) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """(latent, rope) per segment, each [L, P, S, D]."""
        base = ((self.latent, self.rope),)
        return base if self.extra_latent is None else base + ((self.extra_latent, self.extra_rope),)

    @classmethod
    def from_segments(cls, segments) -> "KVCache":
        (latent, rope), *extra = segments
        return cls(latent, rope, *(extra[0] if extra else (None, None)))

    def flat(self) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """Per segment, (latent, rope) viewed as [L * P, S, D]: what every layer reads and writes."""
        return tuple(tuple(x.reshape((-1,) + x.shape[2:]) for x in seg) for seg in self.segments())

    def unflat(self, flat) -> "KVCache":
        """The inverse of `flat` (shapes from this cache)."""
        return KVCache.from_segments(
            tuple(tuple(f.reshape(x.shape) for f, x in zip(fs, seg)) for fs, seg in zip(flat, self.segments()))
        )

    def pages_per_segment(self) -> tuple[int, ...]:
        return tuple(seg[0].shape[1] for seg in self.segments())

    @staticmethod
    def zeros_segment(num_layers, num_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding=None):
        def make(dim):
            shape = (num_layers, num_pages, page_size, dim)
            if sharding is None:
                return jnp.zeros(shape, dtype)
            return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

        return make(kv_lora_rank), make(rope_dim)

    @classmethod
    def zeros(cls, num_layers, num_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding=None, extra_pages=0):
        """sharding: of the whole [L, P, S, D] array (mesh/layouts.POOL_SPEC shards the page axis)."""
        latent, rope = cls.zeros_segment(num_layers, num_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding)
        extra = (None, None)
        if extra_pages:
            extra = cls.zeros_segment(num_layers, extra_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding)
        return cls(latent, rope, *extra)

    @classmethod
    def abstract(cls, num_layers, num_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding=None, extra_pages=0):
        """The pool's shapes only (ShapeDtypeStructs): what a program is lowered and compiled
        against before (or without) the pool existing."""
        def segment(pages):
            return tuple(jax.ShapeDtypeStruct((num_layers, pages, page_size, d), jnp.dtype(dtype), sharding=sharding)
                         for d in (kv_lora_rank, rope_dim))

        return cls(*segment(num_pages), *(segment(extra_pages) if extra_pages else (None, None)))

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInput:
    """Fixed-shape inputs of one forward step (T token slots, R request slots, M pages per request).

    Padding token slots have kv_len 0 and a write page beyond the pool (dropped). Shapes below
    are the single-device model's; a layout step (kv/placement.py) gives the page fields a
    leading [N devices] axis and a [G segments] axis: token_request/write_offset [N, Tq],
    write_page/kv_lens [N, G, Tq], page_table [N, G, R, M].
    """

    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    token_request: jax.Array  # [T] int32, row of page_table the token belongs to
    write_page: jax.Array  # [T] int32, page that receives this token's latent (num_pages = drop)
    write_offset: jax.Array  # [T] int32, slot inside that page
    kv_lens: jax.Array  # [T] int32, positions the token attends to (its position + 1; 0 = padding)
    page_table: jax.Array  # [R, M] int32
    logits_index: jax.Array  # [N] int32, token slots whose logits are wanted
    # [S, 2] int32 per device (first token slot, length; longest first, unused rows of length 0):
    # up to S prefill chunks whose attention runs in the expanded form (attention/expanded.py);
    # None in programs without that path.
    prefill_span: jax.Array | None = None
    # [T] bool, replicated: real tokens (False: padding slots). The MoE routes no padding row, so
    # padding never makes a step read another expert. None: every row counts.
    valid: jax.Array | None = None


def layer_batch(batch: StepInput, layer, pages: tuple[int, ...], num_layers: int) -> StepInput:
    """The step's page ids for `layer` (an int or a traced scan index) in the flat [L * P] pool views.

    Write pages outside [0, P) (padding, dropped writes) stay outside the flat pool, so they are
    still dropped; page-table entries past a request's length may be garbage: they are clamped
    into the layer's own pages (never read: kv_lens masks them). `pages` holds P per segment;
    the fields carry a [G] segment axis when there are per-device segments (write_page [G, Tq]).
    """
    segmented = batch.write_page.ndim == 2
    p = jnp.asarray(pages, jnp.int32)
    if segmented:
        p_write, p_table = p[:, None], p[:, None, None]
    else:
        (single,) = pages
        p_write = p_table = jnp.int32(single)
    start = layer * p_write
    w = batch.write_page
    write = jnp.where((w >= 0) & (w < p_write), w + start, num_layers * p_write)
    table = jnp.clip(batch.page_table, 0, p_table - 1) + layer * p_table
    return dataclasses.replace(batch, write_page=write, page_table=table)


def write_kv(pool: jax.Array, values: jax.Array, pages: jax.Array, offsets: jax.Array) -> jax.Array:
    """Scatter one value row per token into its (page, offset) slot; out-of-range pages are dropped."""
    return pool.at[pages, offsets].set(values.astype(pool.dtype), mode="drop")


def store_latent(pools, latent: jax.Array, rope_key: jax.Array, pages: jax.Array, offsets: jax.Array):
    """Scatter latents [T, L] and roped keys [T, R] into one segment's (latent, rope) pools."""
    latent_pool, rope_pool = pools
    return write_kv(latent_pool, latent, pages, offsets), write_kv(rope_pool, rope_key, pages, offsets)
