"""Checkpoint loading: sharded placement, Orbax round trip, dummy weights, and clear errors."""

import json
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from splash_jax.layer_groups import is_stacked
from splash_jax.model import RuntimeOptions
from splash_jax.model_config import ConfigError, ModelConfig
from splash_jax.weights.loader import load_model
from splash_jax.weights.safetensors_reader import CheckpointError
from splash_jax.weights.snapshot import save_snapshot

FIXTURE = Path(__file__).parent / "fixtures" / "v2lite_tiny"
OPTS = RuntimeOptions(dtype="float32")


def _params(model):
    return {tuple(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _head_sharded(mesh):
    """Shard every array with a head/expert-sized axis over the mesh, replicate the rest."""

    def rule(path, shape):
        name = path[-1]
        lead = (None,) if is_stacked(path) else ()  # stacked layer groups: a leading layer axis
        if name in ("q_proj", "q_b", "w_uk", "w_uv"):
            return NamedSharding(mesh, P(*lead, None, "x", None))
        if name == "o_proj" or name.startswith("experts_"):
            return NamedSharding(mesh, P(*lead, "x"))
        return NamedSharding(mesh, P())

    return rule


def test_load_places_each_tensor_on_its_sharding():
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
    sharded = load_model(FIXTURE, OPTS, sharding_for=_head_sharded(mesh))
    single = load_model(FIXTURE, OPTS)
    experts = sharded.layer(1).mlp.experts_gate[...]
    assert experts.sharding.spec == P("x")
    # Each device holds only its 2 of the 8 experts.
    assert {s.data.shape for s in experts.addressable_shards} == {(2, 32, 64)}  # [E, I, D]
    a, b = _params(sharded), _params(single)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_orbax_round_trip_into_a_different_sharding(tmp_path):
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[4:], axis_types=(jax.sharding.AxisType.Auto,))
    original = load_model(FIXTURE, OPTS)  # device 0, unsharded
    save_snapshot(original, tmp_path / "snap")
    restored = load_model(tmp_path / "snap", OPTS, sharding_for=_head_sharded(mesh))
    w_uk = restored.dense_layers.attn.w_uk[...]  # [layers, L, H, Dn]
    assert w_uk.sharding.spec == P(None, None, "x", None)
    assert w_uk.sharding.device_set == set(jax.devices()[4:])
    assert {s.data.shape for s in w_uk.addressable_shards} == {(1, 128, 1, 32)}
    a, b = _params(original), _params(restored)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_dummy_weights_have_checkpoint_shapes():
    real = load_model(FIXTURE, OPTS)
    dummy = load_model(FIXTURE, OPTS, load_format="dummy")
    a, b = _params(real), _params(dummy)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert np.std(b[("moe_layers", "attn", "w_uk")][0]) > 0


def test_large_dummy_leaves_are_generated_per_layer_with_the_same_statistics(monkeypatch):
    """Stacks over the threshold are made one layer at a time (bounded temporaries): same shapes,
    every layer different, std 0.02 like the whole-array path."""
    from splash_jax.weights import loader

    monkeypatch.setattr(loader, "CHUNKED_INIT_ELEMENTS", 1000)
    loader._leaf_program.cache_clear()
    try:
        dummy = _params(load_model(FIXTURE, OPTS, load_format="dummy"))
    finally:
        loader._leaf_program.cache_clear()
    gate = dummy[("moe_layers", "mlp", "experts_gate")]
    assert gate.ndim == 4 and gate.size > 1000
    assert not np.array_equal(gate[0], gate[1])
    np.testing.assert_allclose(np.std(gate), 0.02, rtol=0.05)


def _copy_fixture(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, dst)
    return dst


def _rewrite_header(path: Path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    edit(header)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_missing_tensor_is_named(tmp_path):
    dst = _copy_fixture(tmp_path)
    _rewrite_header(dst / "model.safetensors", lambda h: h.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.self_attn\.kv_b_proj\.weight'"):
        load_model(dst, OPTS)


def test_wrong_shape_is_named(tmp_path):
    dst = _copy_fixture(tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_attention_heads"] = cfg["num_key_value_heads"] = 8
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.(q_proj|o_proj)\.weight' has shape .*expected"):
        load_model(dst, OPTS)


def test_unknown_dtype_is_named(tmp_path):
    dst = _copy_fixture(tmp_path)

    # Same shape, an FP8 tensor in a checkpoint without quantization_config: caught at validation, by name.
    _rewrite_header(dst / "model.safetensors", lambda h: h["model.norm.weight"].update(dtype="F8_E4M3"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' is FP8 but config.json has no quantization_config"):
        load_model(dst, OPTS)


def test_unsupported_dtype_named_on_read(tmp_path):
    dst = _copy_fixture(tmp_path)
    _rewrite_header(dst / "model.safetensors", lambda h: h["model.norm.weight"].update(dtype="I32"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' has unsupported dtype I32"):
        load_model(dst, OPTS)


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "unsupported architecture"),
        ({"scoring_func": "relu"}, "unsupported scoring_func 'relu'"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "unsupported rope_scaling type 'longrope'"),
        ({"kv_lora_rank": None}, "missing required field 'kv_lora_rank'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"mlp_bias": True}, "unsupported field mlp_bias=true"),
        ({"moe_layer_freq": 2}, "unsupported moe_layer_freq=2"),
        ({"scoring_func": "sigmoid"}, "unsupported scoring_func 'sigmoid' for DeepseekV2ForCausalLM"),
        ({"topk_method": "noaux_tc"}, "unsupported topk_method 'noaux_tc' for DeepseekV2ForCausalLM"),
        ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 3}, "topk_group=3 must be in"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, n_routed_experts=8\]"),
        ({"n_group": 3}, "not divisible by n_group=3"),
    ],
)
def test_unsupported_config_fields_are_named(tmp_path, edit, message):
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_json(tmp_path)


def test_v2_lite_config_fields():
    cfg = ModelConfig.from_json(FIXTURE)
    assert cfg.q_lora_rank is None and cfg.scoring_func == "softmax" and cfg.rope.type == "yarn"
    ref = np.load(FIXTURE / "reference.npz")
    assert abs(cfg.softmax_scale - float(ref["softmax_scale"])) < 1e-7
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"scoring_func": "softmax"}, "unsupported scoring_func 'softmax' for DeepseekV3ForCausalLM"),
        ({"topk_method": "greedy"}, "unsupported topk_method 'greedy' for DeepseekV3ForCausalLM"),
        ({"n_routed_experts": 4, "n_group": 4, "topk_group": 2}, "needs >= 2 experts per group"),
    ],
)
def test_v3_routing_other_than_transformers_is_refused(tmp_path, edit, message):
    cfg = json.loads((FIXTURE.parent / "v3_tiny" / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_json(tmp_path)
