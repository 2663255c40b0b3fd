"""Every start-up program of the engine compiled for a TPU topology on this host (no TPU needed).

    python -m benchmarks.tpu_aot --topology v5e:2x4 --shape v3 --num-layers 4 --enable-switching

libtpu compiles the engine's programs (splash_jax/aot.py: each layout x bucket x variant, the
sampler programs, the switch's migration programs) from abstract inputs for the topology's chips,
with the weights, KV pool and extra segment sized as Engine would size them on that chip. Per
program: compile time, HBM per chip from memory_analysis() (arguments, outputs not aliased to
donated inputs, temporaries, generated code), FLOPs and bytes accessed from cost_analysis(), the
collectives in the HLO, and the roofline time on the chip, max(FLOPs / peak bf16 FLOP/s, bytes /
HBM bandwidth) with the published peaks in splash_jax/mesh/topology.py (docs/tpu.md).

Per layout: weights and KV pool per chip, the largest program's HBM and whether it fits, KV
tokens held, the decode step (smallest bucket, greedy) roofline from cost_analysis(), and the
floor of reading the weights once (weights per chip / HBM bandwidth), at the compiled depth and
at the shape's full depth (the full-depth weights are exact, from the abstract model's shardings,
without compiling). XLA counts every operand of the Mosaic attention kernel as read (the whole
pool of a layer) and the in-place KV writes, so cost_analysis() bytes and the roofline from them
are an upper bound for paged decode; the weights floor is a lower bound.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time

from benchmarks.common import parse_engine_and_bench, table, write_results
from benchmarks.shapes import SHAPES, shape_folder
from splash_jax.engine.config import EngineConfig

log = logging.getLogger("benchmarks.tpu_aot")
GiB = 2**30


@dataclasses.dataclass
class TpuAotBench:
    topology: str = "v5e:2x4"  # a libtpu topology name: v5e:2x4, v6e:2x4, v5p:2x2x2, ...
    shape: str = "v3"  # benchmarks/shapes.py: v3 | v2-lite
    num_layers: int = 0  # layers compiled (0 = the shape's own); the report extrapolates to the full depth
    hbm_gib: float = 0.0  # HBM per chip (0 = the chip's published size)
    kinds: str = "step,sampler,migration"  # which programs to compile
    threads: int = 1  # parallel compiles (lowering stays on one thread)
    match: str = ""  # regex: compile only the programs whose name it finds (e.g. 'greedy$|migration/')


def _roofline(rep, chip) -> float:
    return max(rep.flops / chip.bf16_flops, rep.bytes_accessed / chip.hbm_bytes_per_s)


def _build(bench: TpuAotBench, config: EngineConfig, layers: int):
    from splash_jax.aot import AotBuild

    folder = shape_folder(bench.shape, num_hidden_layers=layers)
    return AotBuild(dataclasses.replace(config, model=str(folder), load_format="dummy"), bench.topology,
                    hbm_gib=bench.hbm_gib or None)


def _full_depth_weights(bench: TpuAotBench, build) -> dict[str, int]:
    """Weights per chip at the shape's full depth, per layout (the abstract model's leaves, each
    leaf's shard under the layout's rule table: no compile)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    from splash_jax.engine.executor import param_path
    from splash_jax.mesh.layouts import LAYOUT_NAMES
    from splash_jax.model import DeepseekForCausalLM
    from splash_jax.model_config import ModelConfig

    folder = shape_folder(bench.shape, num_hidden_layers=SHAPES[bench.shape]["num_hidden_layers"])
    cfg = ModelConfig.from_json(folder).padded_to(build.n)
    model = nnx.eval_shape(lambda: DeepseekForCausalLM(cfg, build.options, nnx.Rngs(0)))
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    out = {}
    for name in LAYOUT_NAMES:
        layout = _layout(name)
        out[name] = 0
        for path, leaf in leaves:
            shard = NamedSharding(build.mesh, layout.param_spec(param_path(path))).shard_shape(tuple(leaf.shape))
            out[name] += math.prod(shard) * leaf.dtype.itemsize
    return out


def run(bench: TpuAotBench, config: EngineConfig) -> dict:
    full_layers = SHAPES[bench.shape]["num_hidden_layers"]
    layers = bench.num_layers or full_layers
    t0 = time.perf_counter()
    build = _build(bench, config, layers)
    chip = build.chip
    kinds = set(bench.kinds.split(","))
    programs = [p for p in build.programs() if p.kind in kinds and re.search(bench.match, p.name)]
    log.info("%d programs for %s (%d layers of %s)", len(programs), bench.topology, layers, bench.shape)
    reports = []
    for rep, _ in build.compile_all(programs, threads=bench.threads):
        reports.append(rep)
        log.info("%s: %.1fs, %.2f GiB per chip%s", rep.name, rep.compile_s, rep.hbm_bytes / GiB,
                 f" FAILED {rep.error}" if rep.error else "")
    order = {p.name: i for i, p in enumerate(programs)}
    reports.sort(key=lambda r: order[r.name])

    full_weights = _full_depth_weights(bench, build)
    layouts = []
    for name in dict.fromkeys(r.layout for r in reports if r.layout):
        oom = [r.name for r in reports if r.layout == name and r.error and "HbmOom" in r.error]
        steps = [r for r in reports if r.layout == name and r.kind == "step" and not r.error]
        if not steps:
            continue
        decode = min(steps, key=lambda r: (r.tokens, r.variant != "greedy"))
        peak = max(steps, key=lambda r: r.hbm_bytes)
        row = dict(
            layout=name, weights_gib=build.weight_bytes[name] / GiB, pool_gib=_pool_bytes(build, name) / GiB,
            peak_program=peak.name, peak_hbm_gib=peak.hbm_bytes / GiB,
            fits=peak.hbm_bytes <= build.hbm_bytes and not oom, hbm_oom=oom,
            kv_tokens=build.kv_capacity_tokens(_layout(name)),
            decode_program=decode.name, decode_ms=1e3 * _roofline(decode, chip),
            weights_floor_ms=1e3 * build.weight_bytes[name] / chip.hbm_bytes_per_s,
            full_depth_weights_gib=full_weights[name] / GiB,
            full_depth_fits=full_weights[name] < build.hbm_bytes,
            full_depth_weights_floor_ms=1e3 * full_weights[name] / chip.hbm_bytes_per_s,
        )
        layouts.append(row)

    return dict(
        topology=bench.topology, chip=dataclasses.asdict(chip), chips=build.n, shape=bench.shape, layers=layers,
        full_layers=full_layers, bench=dataclasses.asdict(bench), config=dataclasses.asdict(config),
        pages_per_device=build.pages_per_device, extra_pages_per_device=build.extra_pages,
        page_bytes=build.page_bytes, hbm_bytes=build.hbm_bytes, pool_fits=build.pool_fits,
        plan=dataclasses.asdict(build.plan) if build.plan else None,
        wall_s=time.perf_counter() - t0, failures=[r.name for r in reports if r.error],
        programs=[r.as_dict() | {"roofline_ms": 1e3 * _roofline(r, chip)} for r in reports], layouts=layouts,
    )


def _layout(name: str):
    from splash_jax.mesh.layouts import get_layout

    return get_layout(name)


def _pool_bytes(build, name: str) -> int:
    extra = build.extra_pages if _layout(name).heads_sharded else 0
    return (build.pages_per_device + extra) * build.page_bytes


def main(argv=None) -> None:
    bench, config = parse_engine_and_bench(__doc__, TpuAotBench, argv)
    out = run(bench, config)
    print(table(out["programs"], ["name", "compile_s", "hbm_bytes", "temp_bytes", "code_bytes", "flops",
                                  "bytes_accessed", "roofline_ms", "collectives", "error"]))
    print()
    print(table(out["layouts"], ["layout", "weights_gib", "pool_gib", "kv_tokens", "peak_hbm_gib", "fits", "hbm_oom",
                                 "decode_program", "decode_ms", "weights_floor_ms", "full_depth_weights_gib",
                                 "full_depth_fits", "full_depth_weights_floor_ms"]))
    print(f"\n{len(out['programs'])} programs, {len(out['failures'])} failed, {out['wall_s']:.0f}s")
    write_results(f"tpu_aot_{bench.topology.replace(':', '-')}", out)


if __name__ == "__main__":
    main()
