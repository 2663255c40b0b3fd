"""Chooses the paged MLA attention implementation: the Pallas kernel on GPU, XLA elsewhere.

Every caller (model, layouts) goes through `paged_attention`, so swapping the kernel in or out
is one flag (`impl`, the model's `--attention-impl`) and never touches model code. All
implementations share the contract of `paged_reference.paged_mla_attention` (same arguments,
same (out, lse) result).

  "auto"   -> "pallas" on GPU when the shapes suit the kernel (power-of-two L, R >= 16 and page
              size), else "xla" (CPU, TPU, odd test shapes).
  "xla"    -> the XLA reference, on any backend.
  "pallas" -> the Pallas Triton kernel on GPU; on CPU it runs in interpret mode (slow; for tests).
              Not available on TPU (the kernel is written for the Triton backend).
  "pallas_grouped" -> the Pallas kernel that groups a chunk's queries so each cached page is read
              once per block of query tokens (`pallas_kernels/mla_grouped.py`; chunked prefill).
              Opt-in: exact in interpret mode, not yet compiled on a GPU.

The choice is made in Python from static shapes and `jax.default_backend()`, so it works under
`jit` and inside `jax.shard_map` (per-device shapes). The compiled GPU kernel declares how its
outputs vary, so it runs under `shard_map(check_vma=True)`; interpret mode (CPU) inside
`shard_map` needs `check_vma=False`: the interpreter's internal slicing carries no
varying-axes annotation and fails the check.
"""

from __future__ import annotations

import jax

from splash_jax.attention.paged_reference import paged_mla_attention

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_grouped")


def _pallas_supports(q_latent, q_rope, latent) -> bool:
    from pallas_kernels.mla_decode import supports

    return supports(q_latent.shape, q_rope.shape, latent.shape)


def resolve_impl(impl: str, q_latent=None, q_rope=None, latent=None) -> str:
    """'auto' -> 'pallas' on GPU (for shapes the kernel takes), else 'xla'. Unknown names fail."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose from {IMPLEMENTATIONS}")
    if impl != "auto":
        return impl
    if jax.default_backend() != "gpu":
        return "xla"
    if q_latent is not None and not _pallas_supports(q_latent, q_rope, latent):
        return "xla"
    return "pallas"


def paged_attention(q_latent, q_rope, latent, rope, page_table, kv_lens, scale, impl: str = "auto"):
    """Paged MLA attention (absorbed form) by the chosen implementation; see the module doc."""
    impl = resolve_impl(impl, q_latent, q_rope, latent)
    if impl == "xla":
        return paged_mla_attention(q_latent, q_rope, latent, rope, page_table, kv_lens, scale)
    backend = jax.default_backend()
    if backend not in ("gpu", "cpu"):
        raise NotImplementedError(f"attention implementation {impl!r} is not available on {backend}")
    if impl == "pallas_grouped":
        from pallas_kernels.mla_grouped import paged_mla_grouped

        return paged_mla_grouped(q_latent, q_rope, latent, rope, page_table, kv_lens, scale, interpret=backend == "cpu")
    from pallas_kernels.mla_decode import paged_mla_decode

    return paged_mla_decode(
        q_latent, q_rope, latent, rope, page_table, kv_lens, scale, interpret=backend == "cpu"
    )
