"""TPU topologies without their devices: a mesh of compile-only TPU devices, and the chips'
published peaks, for ahead-of-time compiles on any host (splash_jax/aot.py).

libtpu is found as jax finds it (TPU_LIBRARY_PATH, else the `libtpu` package), else in
`.venv/libtpu/`, where scripts/setup.sh installs a compile-only copy on machines without TPUs: kept
off the import path there, so ordinary runs on CPU or GPU never load it (a libtpu that jax can
import is probed at every start-up and prints TPU-detection warnings when there is no TPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import numpy as np
from jax.sharding import AxisType, Mesh

from splash_jax.mesh.layouts import AXIS

REPO_LIBTPU = Path(__file__).resolve().parents[2] / ".venv" / "libtpu" / "libtpu" / "libtpu.so"


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Per chip, as Google Cloud's TPU pages publish them ("TPU v5e", "TPU v6e", ...)."""

    name: str
    hbm_gib: float  # HBM per chip (the pages' "16 GB" / "32 GB"; libtpu reports 2^30-based sizes)
    bf16_flops: float  # peak dense bf16 FLOP/s
    hbm_bytes_per_s: float  # HBM bandwidth
    fp8_native: bool  # an FP8 MXU path (v5e/v6e: none; int8 only)


CHIPS = {
    "v5e": ChipSpec("v5e", 16, 197e12, 819e9, False),
    "v6e": ChipSpec("v6e", 32, 918e12, 1638e9, False),
    "v5p": ChipSpec("v5p", 95, 459e12, 2765e9, False),
    "v4": ChipSpec("v4", 32, 275e12, 1228e9, False),
}


def chip_of(topology: str) -> ChipSpec:
    """The chip of a topology name such as "v5e:2x4" (the part before the colon)."""
    name = topology.split(":")[0].split("=")[0].strip().lower()
    name = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "trillium": "v6e"}.get(name, name)
    if name not in CHIPS:
        raise ValueError(f"unknown TPU chip in topology {topology!r}; known: {', '.join(CHIPS)}")
    return CHIPS[name]


def libtpu_path() -> str | None:
    """The libtpu jax would load, else the compile-only copy scripts/setup.sh installs."""
    env = os.environ.get("TPU_LIBRARY_PATH")
    if env and Path(env).exists():
        return env
    if importlib.util.find_spec("libtpu") is not None:
        return None  # jax finds the package itself
    return str(REPO_LIBTPU) if REPO_LIBTPU.exists() else None


def have_libtpu() -> bool:
    return libtpu_path() is not None or importlib.util.find_spec("libtpu") is not None


def topology_mesh(topology: str) -> Mesh:
    """One mesh axis over the topology's chips in the order libtpu lists them (the order the
    engine's make_mesh takes jax.devices() in on that slice). Compile-only devices: programs
    lower and compile for them, nothing runs."""
    path = libtpu_path()
    if path is not None:
        os.environ["TPU_LIBRARY_PATH"] = path
    elif not have_libtpu():
        raise RuntimeError("no libtpu: run ./scripts/setup.sh (it installs a compile-only copy in .venv/libtpu)")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server off Cloud TPU VMs
    if path is not None:  # the compile-only copy opens no chip: several processes may load it at once
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # (else libtpu's /tmp lockfile refuses)
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    return Mesh(np.asarray(devices), (AXIS,), axis_types=(AxisType.Auto,))
