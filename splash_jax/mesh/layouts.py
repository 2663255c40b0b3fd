"""The four attention layouts as rule tables over ONE device mesh (one axis, one device order).

A layout says (1) how each weight role is partitioned, (2) where a request's latent pages
live, and (3) which token rows a device attends as queries. Only attention weights change
between layouts; the FFN, embeddings and LM head keep one fixed placement. The KV pool is
always sharded by page over the same axis (DESIGN.md §4 rule 1).

| layout | attention weights | a request's pages      | queries a device attends |
|--------|-------------------|------------------------|--------------------------|
| tp     | head-sharded      | every device (replica) | all tokens               |
| dp     | replicated        | its owner device       | its owned requests' rows |
| dop    | head-sharded      | its owner device       | its owned requests' rows |
| cp     | head-sharded      | striped, page j on j%N | all tokens               |
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from splash_jax.kv.placement import OWNER, REPLICATED, STRIPED, Placement
from splash_jax.layer_groups import is_stacked

AXIS = "dev"
POOL_SPEC = P(None, AXIS)  # KV pool arrays [layers, pages, page_size, dim]: sharded by page
LAYOUT_NAMES = ("tp", "dp", "dop", "cp")

# Attention weights that carry a head axis, and where it is.
HEAD_SHARDED = {
    "q_proj": P(None, AXIS, None),  # [D, H, Dqk]
    "q_b": P(None, AXIS, None),  # [q_lora, H, Dqk]
    "w_uk": P(None, AXIS, None),  # [L, H, Dn]
    "w_uv": P(None, AXIS, None),  # [L, H, Dv]
    "o_proj": P(AXIS, None, None),  # [H, Dv, D]
}
# One placement in every layout: experts by expert, dense/shared MLP tensor-parallel, vocab-sharded ends.
FIXED = {
    "experts_gate": P(AXIS, None, None),
    "experts_up": P(AXIS, None, None),
    "experts_down": P(AXIS, None, None),
    # FP8 experts' block scales [E, I/b, D/b] live with their experts.
    "experts_gate_scale": P(AXIS, None, None),
    "experts_up_scale": P(AXIS, None, None),
    "experts_down_scale": P(AXIS, None, None),
    "gate": P(None, AXIS),
    "up": P(None, AXIS),
    "down": P(AXIS, None),
    "embed": P(AXIS, None),
    "lm_head": P(None, AXIS),
}
# Everything else (q_a, kv_a, norms, router) is replicated in every layout.


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    heads_sharded: bool
    kv_placement: Placement  # where a request's pages live (kv/placement.py)
    owner_rows: bool  # queries: owner's rows (True) or all tokens (False)

    @property
    def keeps_owner(self) -> bool:
        """A request of this layout has one owner device worth keeping across a switch."""
        return self.kv_placement is OWNER

    @property
    def expanded_prefill(self) -> bool:
        """A device holds every head it computes for its query rows and every page of their
        requests (tp: local heads, replicated pages; dp: all heads, own requests), so a prefill
        chunk can expand its cached latents per head on the device (attention/expanded.py)."""
        return self.kv_placement is REPLICATED or (self.kv_placement is OWNER and not self.heads_sharded)

    def param_spec(self, path: tuple) -> P:
        """The leaf's spec from the one rule table; stacked layer groups add a leading (unsharded) layer axis."""
        role = str(path[-1])
        if role in HEAD_SHARDED:
            spec = HEAD_SHARDED[role] if self.heads_sharded else P()
        else:
            spec = FIXED.get(role, P())
        return P(None, *spec) if spec and is_stacked(path) else spec


LAYOUTS = {
    "tp": Layout("tp", heads_sharded=True, kv_placement=REPLICATED, owner_rows=False),
    "dp": Layout("dp", heads_sharded=False, kv_placement=OWNER, owner_rows=True),
    "dop": Layout("dop", heads_sharded=True, kv_placement=OWNER, owner_rows=True),
    "cp": Layout("cp", heads_sharded=True, kv_placement=STRIPED, owner_rows=False),
}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; choose from {', '.join(LAYOUT_NAMES)}") from None


def make_mesh(num_devices: int | None = None) -> Mesh:
    """The one mesh every layout uses: the first `num_devices` devices in jax.devices() order.

    Auto axes: layouts are written with shard_map and explicit collectives, so sharding never
    has to be inferred inside a step.
    """
    devices = jax.devices()
    n = num_devices or len(devices)
    if n > len(devices):
        raise ValueError(f"asked for {n} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[:n]), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def param_sharding_fn(layout: Layout, mesh: Mesh):
    """`sharding_for(path, shape)` for the weight loader, checking divisibility up front."""

    def sharding_for(path, shape):
        spec = layout.param_spec(path)
        n = mesh.shape[AXIS]
        for dim, axis in zip(shape, spec):
            if axis == AXIS and dim % n:
                raise ValueError(
                    f"parameter {'.'.join(map(str, path))} dimension {dim} is not divisible by {n} devices"
                )
        return NamedSharding(mesh, spec)

    # The loader zero-pads head / expert / FFN / vocab axes to a multiple of this (weights/padding.py).
    sharding_for.shard_multiple = mesh.shape[AXIS]
    return sharding_for
