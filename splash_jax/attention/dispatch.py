"""Chooses the paged MLA attention implementation: a Pallas kernel on GPU and TPU, XLA elsewhere.

Every caller (model, layouts) goes through `paged_attention`, so swapping the kernel in or out
is one flag (`impl`, the model's `--attention-impl`) and never touches model code. All
implementations share the contract of `paged_reference.paged_mla_attention` (same arguments,
same (out, lse) result).

  "auto"   -> on a Hopper GPU with >= 64 heads per device and the DeepSeek latent (512 + 64,
              bf16, pages of a multiple of 64 tokens): "mosaic"; on other GPUs/shapes "pallas"
              when the shapes suit it (power-of-two L, R >= 16 and page size); else "xla" (CPU,
              odd test shapes); on TPU "pallas_tpu" for the shapes it takes, else "xla".
  "xla"    -> the XLA reference, on any backend.
  "pallas" -> the Pallas Triton kernel on GPU; on CPU it runs in interpret mode (slow; for tests).
              Not available on TPU (the kernel is written for the Triton backend).
  "mosaic" -> the Pallas Mosaic GPU kernel (wgmma + TMA; Hopper only,
              `pallas_kernels/mla_decode_mgpu.py`): 64 heads per program, 1.5-1.9x the Triton
              kernel at 64-128 heads on an H200 (~410-470 TFLOP/s at 128); under 64 heads the
              Triton kernel stays (memory-bound there, and the head padding would cost).
  "pallas_tpu" -> the Pallas Mosaic TPU kernel (`pallas_kernels/mla_decode_tpu.py`: pages DMA'd
              from HBM by the page table, split over the KV length, log-sum-exp merge); on CPU
              it runs in Pallas's TPU interpret mode (tests).
  "pallas_grouped" -> the Pallas kernel that groups a chunk's queries so each cached page is read
              once per block of query tokens (`pallas_kernels/mla_grouped.py`; chunked prefill).
              Opt-in: exact in interpret mode, not yet compiled on a GPU.

The choice is made in Python from static shapes and the target platform (`target_platform()`:
`jax.default_backend()`, or the platform `compiling_for` names while a program is lowered for
devices this process does not have, as splash_jax/aot.py lowers for a TPU topology on a CPU
host), so it works under `jit` and inside `jax.shard_map` (per-device shapes). The compiled GPU kernel declares how its
outputs vary, so it runs under `shard_map(check_vma=True)`; interpret mode (CPU) inside
`shard_map` needs `check_vma=False`: the interpreter's internal slicing carries no
varying-axes annotation and fails the check.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from splash_jax.attention.paged_reference import paged_mla_attention

IMPLEMENTATIONS = ("auto", "xla", "pallas", "mosaic", "pallas_grouped", "pallas_tpu")
MOSAIC_MIN_HEADS = 64  # below this the Triton kernel is as fast (benchmarks/mla_decode.py, H200)
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("splash_target_platform", default=None)


def target_platform() -> str:
    """The platform the programs being traced will run on ("cpu", "gpu", "tpu")."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str):
    """Trace for `platform` instead of this process's backend (ahead-of-time compiles for a
    topology without its devices: kernels lower for it, not in interpret mode)."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def _pallas_supports(q_latent, q_rope, latent) -> bool:
    from pallas_kernels.mla_decode import supports

    return supports(q_latent.shape, q_rope.shape, latent.shape)


def _mosaic_suits(q_latent, q_rope, latent) -> bool:
    from pallas_kernels.mla_decode_mgpu import supports

    return (q_latent.shape[1] >= MOSAIC_MIN_HEADS and _is_hopper()
            and supports(q_latent.shape, q_rope.shape, latent.shape, q_latent.dtype))


def _is_hopper() -> bool:
    """wgmma is sm_90 only (Blackwell has tcgen05 instead)."""
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def _tpu_supports(q_latent, q_rope, latent) -> bool:
    from pallas_kernels.mla_decode_tpu import supports

    return supports(q_latent.shape, q_rope.shape, latent.shape)


def resolve_impl(impl: str, q_latent=None, q_rope=None, latent=None) -> str:
    """'auto' -> 'mosaic' or 'pallas' on GPU, 'pallas_tpu' on TPU (for shapes the kernels take),
    else 'xla'. Unknown names fail."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose from {IMPLEMENTATIONS}")
    if impl != "auto":
        return impl
    platform = target_platform()
    if platform == "tpu":
        return "pallas_tpu" if q_latent is None or _tpu_supports(q_latent, q_rope, latent) else "xla"
    if platform != "gpu":
        return "xla"
    if q_latent is None:
        return "pallas"
    if _mosaic_suits(q_latent, q_rope, latent):
        return "mosaic"
    return "pallas" if _pallas_supports(q_latent, q_rope, latent) else "xla"


def paged_attention(q_latent, q_rope, latent, rope, page_table, kv_lens, scale, impl: str = "auto"):
    """Paged MLA attention (absorbed form) by the chosen implementation; see the module doc."""
    impl = resolve_impl(impl, q_latent, q_rope, latent)
    if impl == "xla":
        return paged_mla_attention(q_latent, q_rope, latent, rope, page_table, kv_lens, scale)
    backend = target_platform()
    if impl == "pallas_tpu":
        if backend not in ("tpu", "cpu"):
            raise NotImplementedError(f"attention implementation 'pallas_tpu' is not available on {backend}")
        from pallas_kernels.mla_decode_tpu import paged_mla_decode_tpu

        return paged_mla_decode_tpu(q_latent, q_rope, latent, rope, page_table, kv_lens, scale,
                                    interpret=backend == "cpu")
    if backend not in ("gpu", "cpu"):
        raise NotImplementedError(f"attention implementation {impl!r} is not available on {backend}")
    if impl == "mosaic":
        if backend != "gpu":
            raise NotImplementedError("attention implementation 'mosaic' needs a Hopper GPU")
        from pallas_kernels.mla_decode_mgpu import paged_mla_decode_mgpu

        return paged_mla_decode_mgpu(q_latent, q_rope, latent, rope, page_table, kv_lens, scale)
    if impl == "pallas_grouped":
        from pallas_kernels.mla_grouped import paged_mla_grouped

        return paged_mla_grouped(q_latent, q_rope, latent, rope, page_table, kv_lens, scale, interpret=backend == "cpu")
    from pallas_kernels.mla_decode import paged_mla_decode

    return paged_mla_decode(
        q_latent, q_rope, latent, rope, page_table, kv_lens, scale, interpret=backend == "cpu"
    )
