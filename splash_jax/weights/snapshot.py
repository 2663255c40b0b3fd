"""Orbax snapshots of loaded parameters, restorable into any sharding (fast restarts).

A snapshot folder holds the model's config.json next to an `orbax/` checkpoint, so
`load_model(folder)` finds it like a HF folder. Restoring reads each array directly into the
target sharding given by `sharding_for`, which may differ from the one it was saved from.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx


def save_snapshot(model, folder: str | Path) -> Path:
    """Write config.json and the parameters of `model` under `folder`."""
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2))
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(folder / "orbax", state.to_pure_dict(), force=True)
    return folder


def restore_state(orbax_dir: str | Path, abstract, sharding_for):
    """Read a snapshot into the abstract param state, each leaf on `sharding_for(path, shape)`."""
    flat = nnx.to_flat_state(abstract)
    targets = [
        (path, jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding_for(tuple(path), var.shape)))
        for path, var in flat
    ]
    target_state = nnx.from_flat_state([(p, var.replace(t)) for (p, var), (_, t) in zip(flat, targets)])
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(Path(orbax_dir).absolute(), target_state.to_pure_dict())
    nnx.replace_by_pure_dict(target_state, restored)
    return target_state
