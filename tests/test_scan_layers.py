"""Scanned decoder layers: same logits as the unrolled model, a compiled step whose size does not
grow with depth, and a stacked KV pool that is neither copied per layer nor un-aliased."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from random_models import tiny_config, write_random_checkpoint
from splash_jax.engine import Engine, EngineConfig
from splash_jax.model import DeepseekForCausalLM, RuntimeOptions
from splash_jax.simple_generate import SingleRequestRunner


def _model(cfg, scan):
    return DeepseekForCausalLM(cfg, RuntimeOptions(dtype="float32", attention_impl="xla", scan_layers=scan), nnx.Rngs(0))


@pytest.mark.slow  # 45 s on a 2-core host; the unrolled form is kept for comparisons only
def test_scanned_and_unrolled_models_give_the_same_logits():
    cfg = tiny_config(num_layers=4)  # 1 dense + 3 MoE layers
    got = {}
    for scan in (True, False):
        runner = SingleRequestRunner(_model(cfg, scan), page_size=8, max_len=64)
        prefill, kv = runner.run(runner.new_cache(), list(range(1, 20)), 0, want="all")
        decode, kv = runner.run(kv, [5], 19)
        got[scan] = prefill, decode, np.asarray(kv.latent), np.asarray(kv.rope)
    for a, b in zip(got[True], got[False]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _engine(tmp_path, layers, scan=True, layout="dop"):
    folder = write_random_checkpoint(tmp_path / f"m{layers}", tiny_config(num_layers=layers))
    return Engine(EngineConfig(
        model=str(folder), layout=layout, num_devices=2, warmup=False, max_pages=8, max_model_len=128,
        max_num_seqs=4, max_num_batched_tokens=16, compile_cache_dir=None, page_size=16, scan_layers=scan,
    ))


def _step_hlo(engine):
    ex = engine.executor
    return ex.lower(ex.layout, ex.buckets(ex.layout)[0]).compile().as_text()


def _instructions(hlo):
    return [line for line in hlo.splitlines() if " = " in line and not line.lstrip().startswith("ROOT ")]


def test_compiled_step_does_not_grow_with_depth(tmp_path):
    sizes = {layers: len(_instructions(_step_hlo(_engine(tmp_path, layers)))) for layers in (3, 7)}
    assert sizes[7] == sizes[3], sizes  # the MoE group is one loop whatever its length
    unrolled = {layers: len(_instructions(_step_hlo(_engine(tmp_path, layers, scan=False)))) for layers in (3, 7)}
    assert unrolled[7] > unrolled[3] + 100, unrolled  # (the check can tell)


@pytest.mark.parametrize("layout", ["dop", "tp"])
def test_stacked_pool_is_not_copied_per_layer_and_stays_donated(tmp_path, layout):
    engine = _engine(tmp_path, 4, layout=layout)
    hlo = _step_hlo(engine)
    kv = engine.executor.kv_abstract(engine.layout)
    local = [(x.shape[0], x.shape[1] // engine.n) + x.shape[2:] for x in jax.tree.leaves(kv)]
    pool_types = {f"f32[{','.join(map(str, s))}]" for s in local}  # per-device [L, P, S, D]
    pool_types |= {f"f32[{s[0] * s[1]},{s[2]},{s[3]}]" for s in local}  # its flat [L * P, S, D] view
    assert "while(" in hlo
    for line in _instructions(hlo):
        result, rhs = line.split(" = ", 1)[1].split(" ", 1)
        opcode = rhs.split("(", 1)[0]
        if result.split("{")[0] in pool_types:
            assert opcode not in ("copy", "copy-start", "copy-done"), line.strip()
    # Every pool array is an input aliased to an output (donated, updated in place).
    header = hlo.splitlines()[0]
    aliased = set(re.findall(r"\((\d+), \{\}, may-alias\)", header))
    params = re.search(r"entry_computation_layout=\{\((.*?)\)->", header).group(1)
    param_types = [t.split("{")[0] for t in re.findall(r"[a-z0-9]+\[[0-9,]*\]\{?[0-9,]*\}?", params)]
    pool_params = [str(i) for i, t in enumerate(param_types) if t in pool_types]
    assert len(pool_params) == len(local) and set(pool_params) <= aliased, (pool_params, aliased)
