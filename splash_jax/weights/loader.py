"""Build a model from a checkpoint folder, a dummy initializer, or an Orbax snapshot.

Weights go tensor by tensor straight onto their target sharding with
`jax.make_array_from_callback`: each device's callback reads only its slice (for experts, only
its experts), so the host holds at most one parameter leaf at a time, never the model. With
scanned layers a leaf stacks one tensor per layer of its group (the host then holds that stack
for non-expert leaves; expert leaves are read per device slice, layer by layer).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from splash_jax.layer_groups import is_stacked, layer_groups, unstack_path
from splash_jax.model import DeepseekForCausalLM, RuntimeOptions
from splash_jax.model_config import ModelConfig
from splash_jax.weights.fp8 import DequantizingReader
from splash_jax.weights.hf_names import ParamSource, mtp_layer_index, param_sources
from splash_jax.weights.padding import padding_report, zero_pad_to
from splash_jax.weights.safetensors_reader import CheckpointError, SafetensorsCheckpoint

log = logging.getLogger(__name__)

ShardingFn = Callable[[tuple, tuple[int, ...]], jax.sharding.Sharding]
LOAD_FORMATS = ("auto", "safetensors", "dummy", "orbax")


def replicated(device=None) -> ShardingFn:
    """Every parameter whole on one device (the default without a layout)."""
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    return lambda path, shape: sharding


def abstract_model(cfg: ModelConfig, options: RuntimeOptions):
    """(graphdef, abstract param state) without allocating anything."""
    model = nnx.eval_shape(lambda: DeepseekForCausalLM(cfg, options, nnx.Rngs(0)))
    return nnx.split(model)


def _path_key(path) -> tuple:
    return tuple(getattr(p, "key", p) for p in path)


def load_model(
    path: str | Path,
    options: RuntimeOptions = RuntimeOptions(),
    sharding_for: ShardingFn | None = None,
    load_format: str = "auto",
    config: ModelConfig | None = None,
    seed: int = 0,
    pad_multiple: int | None = None,
) -> DeepseekForCausalLM:
    """The model at `path` (a HF folder with config.json, or an Orbax snapshot with config.json).

    Device-sharded axes (heads, experts, FFN widths, vocabulary) are zero-padded to a multiple of
    `pad_multiple`, by default the `shard_multiple` that `sharding_for` declares (the mesh size for
    `mesh.layouts.param_sharding_fn`; 1, no padding, for a plain function). Padding is exact.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose from {LOAD_FORMATS}")
    path = Path(path) if path is not None else None
    cfg = config or ModelConfig.from_json(path)
    sharding_for = sharding_for or replicated()
    multiple = pad_multiple or getattr(sharding_for, "shard_multiple", 1)
    cfg = cfg.padded_to(multiple)
    if options.mtp and not cfg.num_mtp_layers:
        raise CheckpointError(
            f"MTP was asked for (RuntimeOptions.mtp) but {path or 'this config'} has no multi-token-prediction "
            "layers (config.json num_nextn_predict_layers is 0 or missing); load it without MTP"
        )
    for line in padding_report(cfg, multiple, jnp.dtype(options.dtype).itemsize):
        log.info("padding %s", line)
    if load_format == "auto":
        load_format = "orbax" if (path / "orbax").exists() else "safetensors"
    graphdef, abstract = abstract_model(cfg, options)
    if load_format == "dummy":
        state = _dummy_state(abstract, sharding_for, seed)
    elif load_format == "orbax":
        from splash_jax.weights.snapshot import restore_state

        state = restore_state(path / "orbax", abstract, sharding_for)
    else:
        # A float main model may carry a block-FP8 MTP layer (model_config.mtp_weight_quant).
        scheme = cfg.weight_quant or (cfg.mtp_weight_quant if options.mtp else None)
        ckpt = DequantizingReader(SafetensorsCheckpoint(path), scheme, fp8_block=_fp8_block(options, cfg))
        if options.expert_format == "fp8":
            log.info("routed experts kept in FP8 (e4m3, %d x %d block scales)%s; other weights in %s",
                     ckpt.fp8_block, ckpt.fp8_block, "" if cfg.weight_quant else ", quantized on load", options.dtype)
        elif cfg.weight_quant is not None:
            log.info("FP8 checkpoint (%dx%d blocks): dequantized to %s on load", *cfg.weight_quant.block, options.dtype)
        state = _safetensors_state(cfg, ckpt, abstract, sharding_for, options)
    return nnx.merge(graphdef, state)


def _fp8_block(options, cfg) -> int:
    if options.expert_format != "fp8":
        return 0
    from splash_jax.moe import fp8_scale_block

    return fp8_scale_block(cfg)


def leaf_sources(cfg: ModelConfig, abstract) -> list[tuple[tuple, list[ParamSource] | ParamSource]]:
    """Per parameter leaf: its checkpoint source, or for a stacked layer group one source per layer."""
    sources = param_sources(cfg, fp8_experts=any(_path_key(k)[-1] == "experts_gate_scale" for k, _ in nnx.to_flat_state(abstract)))
    groups = layer_groups(cfg) if any(is_stacked(_path_key(k)) for k, _ in nnx.to_flat_state(abstract)) else {}
    out = []
    for key, _ in nnx.to_flat_state(abstract):
        path = _path_key(key)
        per_layer = [(l, (p[0], l) + p[2:]) for l, p in unstack_path(path, groups)] if is_stacked(path) else [(None, path)]
        found = [sources.get(p) for _, p in per_layer]
        if any(src is None for src in found):
            raise CheckpointError(f"no checkpoint mapping for parameter {'.'.join(map(str, path))}")
        out.append((path, found if is_stacked(path) else found[0]))
    return out


def _safetensors_state(cfg, ckpt: DequantizingReader, abstract, sharding_for, options):
    flat = list(nnx.to_flat_state(abstract))
    leaf_srcs = leaf_sources(cfg, abstract)
    if options.mtp:
        _check_mtp_tensors(cfg, ckpt)
    # Validate every tensor up front: one clear error before any device memory is used.
    for _, src in leaf_srcs:
        for one in src if isinstance(src, list) else [src]:
            for name, shape in zip(one.names, one.shapes):
                got = ckpt.shape(name)
                if got != shape:
                    raise CheckpointError(f"tensor {name!r} has shape {got}, expected {shape} from config.json")
                ckpt.check_dtype(name)
    used = {n for _, src in leaf_srcs for one in (src if isinstance(src, list) else [src]) for n in one.names}
    used |= {c for n in list(used) for c in ckpt.companions(n)}
    unused = [n for n in ckpt.names() if n not in used]
    if unused:
        log.info("ignoring %d checkpoint tensors not used by this model (e.g. %s)", len(unused), unused[0])

    leaves = []
    for (key, var), (path, src) in tqdm(list(zip(flat, leaf_srcs)), desc="loading weights", unit="tensor", leave=False):
        shape, target = var.shape, var.dtype
        sharding = sharding_for(path, shape)
        if isinstance(src, list):  # stacked: each device's slice is built layer by layer
            readers = [_slice_reader(ckpt, one, shape[1:], target) for one in src]

            def callback(index, readers=readers, n=shape[0]):
                layers = range(n)[index[0]] if index else range(n)
                return np.stack([readers[l](tuple(index[1:])) for l in layers])
        else:
            callback = _slice_reader(ckpt, src, shape, target)
        leaves.append(jax.make_array_from_callback(shape, sharding, callback))
    return _replace_leaves(abstract, leaves)


def _check_mtp_tensors(cfg, ckpt) -> None:
    """config.json promising MTP layers whose tensors were stripped (some re-packed checkpoints drop
    layer 61): one error naming what is missing, not the first missing tensor deep in the layer."""
    for j in range(cfg.num_mtp_layers):
        name = f"model.layers.{mtp_layer_index(cfg, j)}.eh_proj.weight"
        if name not in ckpt.ckpt:
            raise CheckpointError(
                f"config.json says num_nextn_predict_layers={cfg.num_mtp_layers} but the checkpoint has no "
                f"{name!r} (its MTP layer tensors are missing); load it without MTP"
            )


def _slice_reader(ckpt, src: ParamSource, shape, target):
    """index -> the parameter's slice (zero-padded): experts read only the asked-for experts; any
    other tensor is read once and kept for the other devices' slices."""
    cache: dict = {}
    read_fn = ckpt.read
    if src.fp8_part is not None:  # FP8 experts: the stored e4m3 values or their block scales
        part_index = 0 if src.fp8_part == "values" else 1
        read_fn = lambda name: ckpt.read_fp8(name)[part_index]  # noqa: E731

    def read(index):
        if src.per_expert:
            # Only this device's experts are read; ids past the real count are padding (zeros).
            start, stop, _ = (index[0] if index else slice(None)).indices(shape[0])
            real_stop = max(start, min(stop, len(src.names)))
            part = src.build(read_fn, slice(start, real_stop))
            part = zero_pad_to(part, (stop - start,) + tuple(shape[1:]))
            rest = (slice(None),) + tuple(index[1:])
            return np.ascontiguousarray(part[rest]).astype(target)
        if "full" not in cache:
            full = zero_pad_to(src.build(read_fn, slice(None)), shape)
            cache["full"] = np.ascontiguousarray(full).astype(target)
        return cache["full"][tuple(index)]

    return read


def _dummy_state(abstract, sharding_for, seed: int):
    """Random weights made on the devices (no host copy): for benchmarks of large shapes."""
    flat = list(nnx.to_flat_state(abstract))
    key = jax.random.key(seed)
    leaves = []

    for i, (path, var) in enumerate(flat):
        names = _path_key(path)
        shape, dtype = var.shape, var.dtype
        sharding = sharding_for(names, shape)
        is_norm = names[-1] in ("weight", "q_a_norm", "kv_a_norm") or names[-1].endswith("_scale")  # FP8 scales: 1
        std = 0.0 if names[-1] == "router_bias" else (1.0 if names[-1] == "embed" else 0.02)
        leaves.append(_random_leaf(shape, jnp.dtype(dtype), sharding, is_norm, std, jax.random.fold_in(key, i)))
    return _replace_leaves(abstract, leaves)


CHUNKED_INIT_ELEMENTS = 1 << 28  # dummy leaves above this are generated one leading-axis slice at a time


def _random_leaf(shape, dtype, sharding, ones: bool, std: float, key):
    return _leaf_program(shape, dtype, sharding, ones, std)(key)


@functools.lru_cache(maxsize=None)
def _leaf_program(shape, dtype, sharding, ones: bool, std: float):
    """One compiled initializer per distinct (shape, dtype, sharding, kind): layers share them."""

    def normal(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)

    def make(k):
        if ones:
            return jnp.ones(shape, dtype)
        if len(shape) >= 3 and math.prod(shape) > CHUNKED_INIT_ELEMENTS:
            # A stacked layer group (V2-Lite's routed experts: 26 x 1.1 GB): one slice of the leading
            # axis at a time, so the float32 temporaries are a slice's, not the stack's. Whole-stack
            # temporaries fragmented the allocator enough that a 40 GiB KV pool no longer fit.
            return jax.lax.map(lambda kk: normal(kk, shape[1:]), jax.random.split(k, shape[0]))
        return normal(k, shape)

    return jax.jit(make, out_shardings=sharding)


def _replace_leaves(abstract, leaves):
    flat = nnx.to_flat_state(abstract)
    assert len(leaves) == len(list(flat))
    new = [(path, var.replace(leaf)) for (path, var), leaf in zip(flat, leaves)]
    return nnx.from_flat_state(new)
