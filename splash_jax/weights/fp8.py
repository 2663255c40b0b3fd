"""Block-quantized FP8 checkpoints (DeepSeek-V3/V3.1/R1 format), dequantized on load.

Such a checkpoint stores each quantized linear `X.weight` as float8_e4m3fn [out, in] with an
`X.weight_scale_inv` float32 [ceil(out/bm), ceil(in/bn)]: element (i, j) is the stored value times
`scale_inv[i // bm, j // bn]`, blocks (bm, bn) from `quantization_config.weight_block_size`
(128 x 128 in every DeepSeek release; edge blocks are partial, e.g. the 576-row kv_a_proj).
Embeddings, norms, the router and the LM head stay in bf16.

`DequantizingReader` wraps a checkpoint so the loader sees plain float tensors: the model then
holds bf16 (or f32) weights, as it would from a bf16 checkpoint. With `--expert-weights fp8` the
routed experts are read as they are stored instead (`read_fp8`: e4m3 values and their scales,
or, from a bf16 checkpoint, quantized on load with the same recipe).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from splash_jax.weights.safetensors_reader import CheckpointError, SafetensorsCheckpoint

FP8_DTYPES = ("F8_E4M3",)
SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@dataclasses.dataclass(frozen=True)
class BlockFp8:
    """`quantization_config` of a block-quantized FP8 checkpoint."""

    block: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"


def parse_quantization_config(raw: dict[str, Any] | None) -> BlockFp8 | None:
    """The checkpoint's FP8 scheme, or None; any other quantization is refused by name."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "fp8":
        raise ValueError(f"unsupported quantization_config.quant_method {method!r}; supported: 'fp8' (block-quantized e4m3)")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"unsupported quantization_config.fmt {fmt!r}; supported: 'e4m3'")
    if raw.get("scale_fmt") not in (None, "float32", "fp32"):
        raise ValueError(f"unsupported quantization_config.scale_fmt {raw['scale_fmt']!r}; supported: float32 scales")
    block = raw.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError("quantization_config needs weight_block_size [rows, cols] (per-tensor FP8 is not supported)")
    return BlockFp8(block=(int(block[0]), int(block[1])), fmt=fmt)


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 weight from FP8 values and their per-block inverse scales (partial edge blocks too)."""
    rows, cols = weight.shape
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    if scale_inv.shape != grid:
        raise CheckpointError(f"scale grid {scale_inv.shape} does not match weight {weight.shape} in {bm}x{bn} blocks")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=0), bn, axis=1)[:rows, :cols]
    return weight.astype(np.float32) * scale


def quantize(weight: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """The block recipe (DeepSeek-V3's and transformers' FineGrainedFP8): per block, scale_inv =
    amax / 448 (1 for an all-zero block) and value = clamp(w / scale_inv) in e4m3. For tests and
    synthetic checkpoints; serving never quantizes."""
    rows, cols = weight.shape
    bm, bn = block
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = np.zeros((gr * bm, gc * bn), np.float32)
    padded[:rows, :cols] = weight
    tiles = padded.reshape(gr, bm, gc, bn)
    amax = np.abs(tiles).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    q = np.clip(tiles / scale_inv[:, None, :, None], -E4M3_MAX, E4M3_MAX).reshape(padded.shape)[:rows, :cols]
    return q.astype(ml_dtypes.float8_e4m3fn), scale_inv


class DequantizingReader:
    """A checkpoint whose FP8 tensors read back as float32 (the loader's `read`, `shape`, `check_dtype`)."""

    def __init__(self, ckpt: SafetensorsCheckpoint, scheme: BlockFp8 | None, fp8_block: int = 0):
        self.ckpt = ckpt
        self.scheme = scheme
        self.fp8_block = fp8_block  # square block of the FP8 experts the model keeps (0: none)

    def names(self) -> list[str]:
        return self.ckpt.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.ckpt.shape(name)

    def companions(self, name: str) -> list[str]:
        """Tensors read together with `name` (its scale when it is FP8)."""
        return [name + SCALE_SUFFIX] if self._is_fp8(name) else []

    def check_dtype(self, name: str) -> str:
        if self._is_fp8(name):
            if self.scheme is None:
                raise CheckpointError(
                    f"tensor {name!r} is FP8 but config.json has no quantization_config (block sizes unknown)"
                )
            if name + SCALE_SUFFIX not in self.ckpt:
                raise CheckpointError(f"FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r} in the checkpoint")
            return "F8_E4M3"
        return self.ckpt.check_dtype(name)

    def read(self, name: str) -> np.ndarray:
        if not self._is_fp8(name):
            return self.ckpt.read(name)
        self.check_dtype(name)
        return dequantize(self.ckpt.read_raw(name), self.ckpt.read(name + SCALE_SUFFIX), self.scheme.block)

    def read_fp8(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(e4m3 values, float32 scale_inv [ceil(out/b), ceil(in/b)]) of an [out, in] weight: as stored
        when the tensor is FP8 with the model's block, else quantized here (DeepSeek's recipe)."""
        block = (self.fp8_block, self.fp8_block)
        if self._is_fp8(name):
            self.check_dtype(name)
            if tuple(self.scheme.block) != block:
                raise CheckpointError(f"{name!r} is stored in {self.scheme.block} blocks, the model keeps {block}")
            return self.ckpt.read_raw(name), self.ckpt.read(name + SCALE_SUFFIX).astype(np.float32)
        return quantize(self.ckpt.read(name).astype(np.float32), block)

    def _is_fp8(self, name: str) -> bool:
        return self.ckpt.dtype_name(name) in FP8_DTYPES


def is_block_fp8_linear(name: str) -> bool:
    """Tensors DeepSeek-V3's release stores in block FP8: every linear weight inside the decoder and
    MTP layers (eh_proj included) except the router (`mlp.gate.weight`); embeddings, norms and heads stay float."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def quantize_checkpoint(tensors: dict[str, np.ndarray], select=is_block_fp8_linear,
                        block: tuple[int, int] = (128, 128)) -> dict[str, np.ndarray]:
    """HF tensors with the selected ones stored as DeepSeek's release stores them: e4m3 values plus a
    float32 `_scale_inv` per block (`quantize`); the rest unchanged. For exports and test fixtures."""
    out = {}
    for name, t in tensors.items():
        if select(name):
            out[name], out[name + SCALE_SUFFIX] = quantize(np.asarray(t, np.float32), block)
        else:
            out[name] = t
    return out


def quantization_config(block: tuple[int, int] = (128, 128), modules_to_not_convert: list[str] | None = None) -> dict:
    """config.json's `quantization_config` for `quantize_checkpoint` output (DeepSeek-V3's, plus
    transformers' modules_to_not_convert when only some layers are FP8)."""
    out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return out | ({"modules_to_not_convert": modules_to_not_convert} if modules_to_not_convert else {})
