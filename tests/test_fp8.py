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
