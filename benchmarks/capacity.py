"""KV capacity per layout: real shapes on 8 x 141 GB (accounting only, nothing allocated) and the
bundled model on the CPU mesh (allocated, measured from the live device buffers).

    python -m benchmarks.capacity

Per device, a layout's memory is weights + KV pool. DP replicates the head-shardable attention
weights (q_b / q_proj, W_UK, W_UV, o_proj); TP, DOP and CP hold 1/N of them and turn the rest
into an extra pool segment. Token capacity counts distinct tokens (TP holds N replicas).
"""

from __future__ import annotations

import argparse
import logging
import os

import numpy as np
from flax import nnx

from benchmarks.common import table, write_results
from benchmarks.shapes import SHAPES
from splash_jax.kv.capacity import bytes_per_page, head_sharded_weight_bytes, layout_capacities
from splash_jax.mesh.layouts import AXIS, LAYOUTS
from splash_jax.model import RuntimeOptions
from splash_jax.model_config import ModelConfig
from splash_jax.weights.loader import abstract_model

log = logging.getLogger("benchmarks.capacity")
GB = 1e9


def per_device_weight_bytes(state, layout, n: int) -> float:
    """Bytes per device of the params as the engine holds them (each leaf's own dtype: bf16, or
    e4m3 + f32 block scales for FP8 routed experts), sharded by the layout's rule table."""
    total = 0.0
    for path, var in nnx.to_flat_state(state):
        spec = layout.param_spec(tuple(str(p) for p in path))
        nbytes = float(np.prod(var.shape)) * np.dtype(var.dtype).itemsize
        total += nbytes / (n if AXIS in tuple(spec) else 1)
    return total


def shape_table(name: str, n: int, hbm_gb: float, expert_format: str, reserve_gb: float, page_size: int,
                label: str | None = None) -> list[dict]:
    """Rows per layout from the abstract params the engine would build (`--expert-weights
    expert_format`, everything else bf16); a layout whose weights alone exceed the device memory
    gets 0 tokens."""
    cfg = ModelConfig.from_hf_dict(SHAPES[name]).padded_to(n)  # the padded arrays the loader builds
    _, state = abstract_model(cfg, RuntimeOptions(dtype="bfloat16", expert_format=expert_format))
    page = bytes_per_page(cfg, page_size, "bfloat16")
    dp_weights = per_device_weight_bytes(state, LAYOUTS["dp"], n)
    base_pages = max(0, int((hbm_gb * GB - reserve_gb * GB - dp_weights) // page))
    caps = layout_capacities(cfg, n, page_size, "bfloat16", base_pages, head_sharded_weight_bytes(state))
    rows = []
    for lay, cap in caps.items():
        w = per_device_weight_bytes(state, LAYOUTS[lay], n)
        fits = w + reserve_gb * GB < hbm_gb * GB
        kv = (cap["base_pages_per_device"] + cap["extra_pages_per_device"]) * page if fits else 0
        tokens = cap["tokens"] if fits else 0
        rows.append({
            "model": label or name, "layout": lay, "weights_GB_per_dev": w / GB, "kv_GB_per_dev": kv / GB,
            "total_GB_per_dev": (w + kv) / GB, "tokens": tokens, "fits": fits,
            "vs_dp": tokens / caps["dp"]["tokens"] if caps["dp"]["tokens"] and fits else 0.0,
        })
    return rows


def measured_table(n: int) -> list[dict]:
    """Engines on the CPU mesh: bytes of the live weight and KV buffers on device 0."""
    from splash_jax.engine import Engine, EngineConfig

    rows = []
    for lay in LAYOUTS:
        engine = Engine(EngineConfig(layout=lay, num_devices=n, page_size=16, kv_memory_gb=0.01, warmup=False,
                                     compile_cache_dir=None, dtype="float32"))
        dev = engine.mesh.devices.flat[0]

        def on_dev0(tree):
            import jax

            return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)

        w, kv = on_dev0(engine.executor.state), on_dev0(engine.executor.kv)
        rows.append({"model": "splash-tiny (CPU mesh)", "layout": lay, "weights_MB_dev0": w / 1e6, "kv_MB_dev0": kv / 1e6,
                     "total_MB_dev0": (w + kv) / 1e6, "tokens": engine.kv_capacity_tokens()})
        del engine
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--hbm-gb", type=float, default=141.0)
    parser.add_argument("--reserve-gb", type=float, default=14.0, help="activations, workspace, fragmentation")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    # What the engine holds: bf16 everywhere (--expert-weights model), or the routed experts as
    # e4m3 + f32 128x128 block scales (--expert-weights fp8, the GPU default for FP8 checkpoints)
    # with attention, shared experts, dense layers, embeddings and head in bf16. KV in bf16.
    rows = shape_table("v3", args.devices, args.hbm_gb, "model", args.reserve_gb, args.page_size, "v3 (bf16 experts)")
    rows += shape_table("v3", args.devices, args.hbm_gb, "fp8", args.reserve_gb, args.page_size, "v3 (FP8 routed experts)")
    rows += shape_table("v2-lite", args.devices, args.hbm_gb, "model", args.reserve_gb, args.page_size)
    print(table(rows, ["model", "layout", "weights_GB_per_dev", "kv_GB_per_dev", "total_GB_per_dev", "tokens", "fits", "vs_dp"]))
    measured = []
    if not args.skip_measured:
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            log.info("set XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu for the CPU mesh rows")
        import jax

        if jax.device_count() >= args.devices:
            measured = measured_table(args.devices)
            print(table(measured, ["model", "layout", "weights_MB_dev0", "kv_MB_dev0", "total_MB_dev0", "tokens"]))
    write_results("capacity", {"args": vars(args), "shapes": rows, "measured": measured})


if __name__ == "__main__":
    main()
