"""Pallas API names that moved between jax releases (0.11.2 on the GPU machines, 0.12 here).

Kept in one place so the kernels import stable names and a future rename is a one-line fix.
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# `TritonCompilerParams` (<= 0.6) became `triton.CompilerParams`; pallas_call picks the Triton
# backend by this type, so the name must resolve on every supported version.
TritonCompilerParams = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")

# Masked loads: `pallas.triton.load(ref.at[idx], mask=...)` in new jax, `pl.load(ref, idx, ...)` before.
if hasattr(pltriton, "load"):
    def masked_load(ref, idx, *, mask, other):
        return pltriton.load(ref.at[idx], mask=mask, other=other)
else:  # pragma: no cover - older jax
    def masked_load(ref, idx, *, mask, other):
        return pl.load(ref, idx, mask=mask, other=other)


# Masked stores likewise: `pallas.triton.store(ref.at[idx], val, mask=...)` or `pl.store(ref, idx, val, mask=...)`.
if hasattr(pltriton, "store"):
    def masked_store(ref, idx, val, *, mask):
        pltriton.store(ref.at[idx], val, mask=mask)
else:  # pragma: no cover - older jax
    def masked_store(ref, idx, val, *, mask):
        pl.store(ref, idx, val, mask=mask)


def triton_params(num_warps: int, num_stages: int):
    return TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


def out_struct(shape, dtype, like):
    """A pallas_call out_shape varying over the same manual mesh axes as `like`.

    Under `jax.shard_map(check_vma=True)` pallas_call needs that annotation; its name moved
    (`vma` in older jax, `manual_axis_type` in 0.12). Outside shard_map it is empty and harmless.
    """
    import jax

    aval = jax.typeof(like)
    for field in ("manual_axis_type", "vma"):
        value = getattr(aval, field, None)
        if value is not None:
            try:
                return jax.ShapeDtypeStruct(shape, dtype, **{field: value})
            except TypeError:  # this jax spells it the other way
                continue
    return jax.ShapeDtypeStruct(shape, dtype)
