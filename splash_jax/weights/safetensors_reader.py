"""Lazy, torch-free reader of (possibly sharded) safetensors checkpoints.

Parses each file's JSON header and memory-maps the data, so a tensor (or a slice of one, e.g.
the experts one device owns) is read only when asked for and the whole model never sits in
host memory. bf16 comes back as `ml_dtypes.bfloat16`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # block-quantized weights; weights/fp8.py dequantizes them
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class CheckpointError(ValueError):
    """A checkpoint this engine cannot load; the message names the tensor or file."""


class SafetensorsCheckpoint:
    """All tensors of a checkpoint folder (one `model.safetensors` or an index of shards)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.folder}")
        self._entries: dict[str, tuple[Path, dict]] = {}
        self._maps: dict[Path, np.memmap] = {}
        for name in files:
            path = self.folder / name
            if not path.exists():
                raise CheckpointError(f"checkpoint shard {path} listed in the index is missing")
            header, data_start = _read_header(path)
            for tensor, meta in header.items():
                if tensor == "__metadata__":
                    continue
                self._entries[tensor] = (path, dict(meta, data_start=data_start))

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta(name)["shape"])

    def dtype_name(self, name: str) -> str:
        return self._meta(name)["dtype"]

    def check_dtype(self, name: str) -> str:
        dtype_name = self._meta(name)["dtype"]
        if dtype_name not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} has unsupported dtype {dtype_name}; supported: {', '.join(FLOAT_DTYPES)}"
            )
        return dtype_name

    def read(self, name: str) -> np.ndarray:
        """The tensor as a (memory-mapped, read-only) numpy array; float dtypes only."""
        self.check_dtype(name)
        return self.read_raw(name)

    def read_raw(self, name: str) -> np.ndarray:
        """Any stored dtype this reader knows (FP8 included), memory-mapped and read-only."""
        meta = self._meta(name)
        path = self._entries[name][0]
        dtype_name = meta["dtype"]
        if dtype_name not in DTYPES:
            raise CheckpointError(f"tensor {name!r} has unknown dtype {dtype_name}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        start, end = meta["data_offsets"]
        raw = self._maps[path][meta["data_start"] + start : meta["data_start"] + end]
        shape = tuple(meta["shape"])
        dtype = np.dtype(DTYPES[dtype_name])
        if raw.size != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(f"tensor {name!r} in {path.name}: byte size does not match shape {shape}")
        return raw.view(dtype).reshape(shape)

    def _meta(self, name: str) -> dict:
        try:
            return self._entries[name][1]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.folder} is missing tensor {name!r}") from None


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    return header, 8 + n
