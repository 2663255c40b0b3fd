"""Block-quantized FP8 checkpoints (DeepSeek-V3's release format) load dequantized.

The fixture `v3_fp8_tiny` was quantized with the block recipe (checked bit for bit against
transformers' FineGrainedFP8 by scripts/make_reference_fixtures.py); its reference logits are
transformers on the dequantized weights. f32 logits parity is in test_model_parity.py.
"""

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from splash_jax.model import RuntimeOptions
from splash_jax.model_config import ConfigError, ModelConfig
from splash_jax.simple_generate import SingleRequestRunner
from splash_jax.weights.fp8 import BlockFp8, dequantize, quantize
from splash_jax.weights.loader import load_model
from splash_jax.weights.safetensors_reader import CheckpointError, SafetensorsCheckpoint

FIXTURE = Path(__file__).parent / "fixtures" / "v3_fp8_tiny"


def test_fixture_is_stored_like_deepseek_v3():
    ckpt = SafetensorsCheckpoint(FIXTURE)
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert ckpt.dtype_name(kv_a) == "F8_E4M3"
    assert ckpt.shape(kv_a) == (576, 256) and ckpt.shape(kv_a + "_scale_inv") == (5, 2)  # partial edge block
    assert ckpt.dtype_name("model.layers.1.mlp.gate.weight") != "F8_E4M3"  # the router stays float
    assert ModelConfig.from_json(FIXTURE).weight_quant == BlockFp8(block=(128, 128))


def test_dequantize_applies_each_blocks_scale_including_partial_blocks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 130)).astype(np.float32)
    w[:128, :128] *= 100  # blocks with very different ranges
    q, scale_inv = quantize(w, (128, 128))
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale_inv.shape == (2, 2)
    back = dequantize(q, scale_inv, (128, 128))
    for (r0, r1), (c0, c1) in [((0, 128), (0, 128)), ((128, 200), (128, 130)), ((0, 128), (128, 130))]:
        block = w[r0:r1, c0:c1]
        # e4m3 has 3 mantissa bits: <= 1/16 relative per element, and the block max is kept exactly.
        assert np.abs(back[r0:r1, c0:c1] - block).max() <= np.abs(block).max() / 16
        assert np.abs(back[r0:r1, c0:c1]).max() == pytest.approx(np.abs(block).max(), rel=1e-6)
    with pytest.raises(CheckpointError, match="scale grid"):
        dequantize(q, scale_inv[:1], (128, 128))


def test_bf16_load_is_within_bf16_tolerance_of_the_dequantized_reference():
    ref = np.load(FIXTURE / "reference.npz")
    model = load_model(FIXTURE, RuntimeOptions(dtype="bfloat16", attention_impl="xla"))
    assert str(model.layer(1).mlp.experts_gate[...].dtype) == "bfloat16"
    runner = SingleRequestRunner(model, page_size=8, max_len=64)
    logits, _ = runner.run(runner.new_cache(), ref["prompt_ids"], 0, want="all")
    err = np.abs(logits - ref["prefill_logits"]).max() / np.abs(ref["prefill_logits"]).max()
    assert err < 5e-2, err  # bf16 weights and activations over 3 layers (measured 2.5e-2)
    assert (logits.argmax(-1) == ref["prefill_logits"].argmax(-1)).mean() > 0.9


def _edited_copy(tmp_path, edit):
    dst = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "quant,message",
    [
        ({"quant_method": "awq", "bits": 4}, "unsupported quantization_config.quant_method 'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "unsupported quantization_config.fmt 'e5m2'"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "needs weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ],
)
def test_unsupported_quantization_is_refused_by_name(tmp_path, quant, message):
    dst = _edited_copy(tmp_path, lambda c: c.update(quantization_config=quant))
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_json(dst)


def test_fp8_without_quantization_config_is_refused(tmp_path):
    dst = _edited_copy(tmp_path, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="is FP8 but config.json has no quantization_config"):
        load_model(dst, RuntimeOptions(dtype="float32"))


def _prefill_logits(model, prompt):
    runner = SingleRequestRunner(model, page_size=8, max_len=64)
    logits, _ = runner.run(runner.new_cache(), prompt, 0, want="all")
    return logits


@pytest.mark.parametrize("scan", [True, False])
def test_fp8_experts_kept_in_hbm_give_the_dequantized_models_logits(scan):
    """--expert-weights fp8: the routed experts stay e4m3 (1 byte each) with their checkpoint scales,
    every other weight is dequantized as before; f32 logits equal the fully dequantized load and
    transformers' reference (the XLA path dequantizes per layer; the Pallas kernel is checked
    against the same dequantized weights in test_moe.py)."""
    ref = np.load(FIXTURE / "reference.npz")
    opts = dict(dtype="float32", attention_impl="xla", scan_layers=scan)
    fp8 = load_model(FIXTURE, RuntimeOptions(expert_format="fp8", **opts))
    plain = load_model(FIXTURE, RuntimeOptions(**opts))
    mlp = fp8.layer(1).mlp
    assert mlp.experts_gate[...].dtype == ml_dtypes.float8_e4m3fn and mlp.scale_block == 128
    e, i, d = mlp.experts_down[...].shape
    assert mlp.experts_down_scale[...].shape == (e, -(-i // 128), -(-d // 128))
    ckpt = SafetensorsCheckpoint(FIXTURE)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # stored [D, I]; kept [I, D]
    np.testing.assert_array_equal(np.asarray(mlp.experts_down[...][3]).view(np.uint8), ckpt.read_raw(name).T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(mlp.experts_down_scale[...][3]), ckpt.read(name + "_scale_inv").T)
    got = _prefill_logits(fp8, ref["prompt_ids"])
    np.testing.assert_allclose(got, _prefill_logits(plain, ref["prompt_ids"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ref["prefill_logits"], rtol=1e-4, atol=1e-4)


def test_fp8_experts_from_a_bf16_checkpoint_are_quantized_on_load(tmp_path):
    """A float checkpoint with --expert-weights fp8: experts quantized by DeepSeek's recipe on load;
    the model equals one loaded from the float checkpoint whose experts were round-tripped through
    that quantization on the host."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from random_models import tiny_config, write_random_checkpoint

    folder = write_random_checkpoint(tmp_path / "float", tiny_config(num_layers=2))
    fp8 = load_model(folder, RuntimeOptions(dtype="float32", attention_impl="xla", expert_format="fp8"))
    ckpt = SafetensorsCheckpoint(folder)
    name = "model.layers.1.mlp.experts.5.gate_proj.weight"
    q, s = quantize(ckpt.read(name).astype(np.float32), (128, 128))
    mlp = fp8.layer(1).mlp
    np.testing.assert_array_equal(np.asarray(mlp.experts_gate[...][5]).view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(mlp.experts_gate_scale[...][5]), s)
    x = np.random.default_rng(0).standard_normal((3, fp8.cfg.hidden_size)).astype(np.float32)
    from splash_jax.moe import dequantize_blocks

    dense = dequantize_blocks(mlp.experts_gate[...], mlp.experts_gate_scale[...], 128, np.float32)
    np.testing.assert_allclose(np.asarray(dense[5]), dequantize(q, s, (128, 128)), rtol=0, atol=0)
    assert np.isfinite(np.asarray(mlp(x))).all()


def test_expert_weights_flag_is_checked_and_auto_keeps_fp8_checkpoints_in_fp8_on_gpus_only():
    from splash_jax.engine import EngineConfig

    auto = EngineConfig()
    assert auto.resolved_expert_weights(fp8_checkpoint=True, backend="gpu") == "fp8"  # the Pallas kernel applies scales
    assert auto.resolved_expert_weights(fp8_checkpoint=True, backend="cpu") == "model"  # XLA would dequantize per step
    assert auto.resolved_expert_weights(fp8_checkpoint=False, backend="gpu") == "model"  # never quantize unasked
    assert EngineConfig(expert_weights="fp8").resolved_expert_weights(False, "cpu") == "fp8"
    assert EngineConfig(expert_weights="model").resolved_expert_weights(True, "gpu") == "model"
    with pytest.raises(ValueError, match="--expert-weights"):
        EngineConfig(expert_weights="int4").resolved_expert_weights(False, "cpu")



def test_engine_with_fp8_experts_gives_the_same_tokens_sharded_as_on_one_device():
    """Block scales are sharded with their experts: a 4-device DOP engine (experts 2 per device,
    scales alongside) generates exactly what one device does, both keeping the experts in FP8."""
    from splash_jax.engine import Engine, EngineConfig, SamplingParams

    prompts = [[5, 9, 17, 33, 2, 8], [100, 3], [7] * 11]
    kw = dict(model=str(FIXTURE), expert_weights="fp8", page_size=8, max_num_seqs=4, max_num_batched_tokens=16,
              max_pages=32, max_model_len=64, compile_cache_dir=None, warmup=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    one = Engine(EngineConfig(**kw))
    assert str(one.model.layer(1).mlp.experts_up[...].dtype) == "float8_e4m3fn"
    want = [o.token_ids for o in one.generate(prompts, params)]
    sharded = Engine(EngineConfig(layout="dop", num_devices=4, **kw))
    leaf = sharded.model.layer(1).mlp.experts_up_scale[...]
    assert {s.data.shape[0] for s in leaf.addressable_shards} == {2}
    assert [o.token_ids for o in sharded.generate(prompts, params)] == want


def test_dummy_weights_with_fp8_experts():
    model = load_model(FIXTURE, RuntimeOptions(dtype="float32", expert_format="fp8"), load_format="dummy")
    mlp = model.layer(1).mlp
    values = np.asarray(mlp.experts_gate[...]).astype(np.float32)
    assert mlp.experts_gate[...].dtype == ml_dtypes.float8_e4m3fn and np.isfinite(values).all()
    assert 0.01 < values.std() < 0.03  # e4m3 values carry the std, the scales are 1
    assert np.all(np.asarray(mlp.experts_gate_scale[...]) == 1.0)


def test_orbax_snapshot_keeps_fp8_experts_bit_exact(tmp_path):
    from splash_jax.weights.snapshot import save_snapshot

    opts = RuntimeOptions(dtype="float32", expert_format="fp8")
    model = load_model(FIXTURE, opts)
    save_snapshot(model, tmp_path / "snap")
    back = load_model(tmp_path / "snap", opts)
    for name in ("experts_down", "experts_down_scale"):
        a, b = (np.asarray(getattr(m.layer(2).mlp, name)[...]) for m in (model, back))
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
