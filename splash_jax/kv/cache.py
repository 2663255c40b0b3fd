"""The paged latent KV cache as a pytree, and the step inputs that address it.

One physical structure for every layout (DESIGN.md §4 rule 1): per layer, a latent pool
[num_pages, page_size, kv_lora_rank] and a rope-key pool [num_pages, page_size, rope_dim].
Latent and rope parts are separate arrays so kernels read them as 512 + 64 without slicing.
Per-layer arrays (not one [L, ...] array) let each layer's buffer be updated in place when the
cache is donated and be passed to a kernel without a slicing copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    latent: tuple[jax.Array, ...]  # L x [P, S, kv_lora_rank]   base segment
    rope: tuple[jax.Array, ...]  # L x [P, S, rope_dim]
    extra_latent: tuple[jax.Array, ...] = ()  # L x [Pe, S, kv_lora_rank]: extra segment (see kv/allocator.py)
    extra_rope: tuple[jax.Array, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.latent)

    @property
    def num_segments(self) -> int:
        return 2 if self.extra_latent else 1

    def layer(self, i: int) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """Layer i's pools, one (latent, rope) pair per segment."""
        base = ((self.latent[i], self.rope[i]),)
        return base + (((self.extra_latent[i], self.extra_rope[i]),) if self.extra_latent else ())

    @classmethod
    def from_layers(cls, layers: list[tuple[tuple[jax.Array, jax.Array], ...]]) -> "KVCache":
        extra = len(layers[0]) > 1
        return cls(
            latent=tuple(p[0][0] for p in layers), rope=tuple(p[0][1] for p in layers),
            extra_latent=tuple(p[1][0] for p in layers) if extra else (),
            extra_rope=tuple(p[1][1] for p in layers) if extra else (),
        )

    @staticmethod
    def zeros_segment(num_layers, num_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding=None):
        def make(dim):
            shape = (num_pages, page_size, dim)
            if sharding is None:
                return jnp.zeros(shape, dtype)
            return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

        return tuple(make(kv_lora_rank) for _ in range(num_layers)), tuple(make(rope_dim) for _ in range(num_layers))

    @classmethod
    def zeros(cls, num_layers, num_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding=None, extra_pages=0):
        latent, rope = cls.zeros_segment(num_layers, num_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding)
        extra = ((), ())
        if extra_pages:
            extra = cls.zeros_segment(num_layers, extra_pages, page_size, kv_lora_rank, rope_dim, dtype, sharding)
        return cls(latent, rope, *extra)

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


def write_kv(pool: jax.Array, values: jax.Array, pages: jax.Array, offsets: jax.Array) -> jax.Array:
    """Scatter one value row per token into its (page, offset) slot; out-of-range pages are dropped."""
    return pool.at[pages, offsets].set(values.astype(pool.dtype), mode="drop")
