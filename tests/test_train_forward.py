"""The training script's causal forward (no paged cache) computes what the engine serves: same
logits as the single-request runner on the same weights, so a model trained with it is served
unchanged. Also a CPU smoke run of the script end to end (tiny scale)."""

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from random_models import tiny_config, write_random_checkpoint
from splash_jax.model import RuntimeOptions
from splash_jax.simple_generate import SingleRequestRunner
from splash_jax.weights.loader import load_model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_bundled_model.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_bundled_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_training_forward_equals_the_served_forward(tmp_path):
    train = _script()
    folder = write_random_checkpoint(tmp_path / "m", tiny_config(n_group=4, topk_group=2), seed=3)
    model = load_model(folder, RuntimeOptions(dtype="float32", attention_impl="xla"))
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 19))
    logits, aux = train.forward(model, jnp.asarray(tokens))
    for row in range(2):
        runner = SingleRequestRunner(model, page_size=8, max_len=64)
        served, _ = runner.run(runner.new_cache(), tokens[row], 0, want="all")
        err = np.abs(np.asarray(logits[row]) - served).max() / np.abs(served).max()
        assert err < 1e-5, err
    assert float(aux) > 0


@pytest.mark.slow  # 30 s on a 2-core host; the served-forward equality above runs by default
def test_training_script_smoke_run_writes_a_loadable_model(tmp_path):
    train = _script()
    out = tmp_path / "trained"
    train.main(["--out", str(out), "--steps", "2", "--batch", "2", "--seq", "32", "--files", "30",
                "--vocab", "512", "--warmup", "1", "--eval-batches", "1"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    model = load_model(out, RuntimeOptions(dtype="float32", attention_impl="xla"))
    assert model.cfg.vocab_size == 512 and model.cfg.kv_lora_rank == 512
    assert "perplexity" in (out / "README.md").read_text()
