"""KV capacity per layout: the extra pages of head-sharded layouts are real device memory."""

import jax
import pytest

from splash_jax.engine import Engine, EngineConfig
from splash_jax.mesh.layouts import LAYOUT_NAMES


def _device0_bytes(tree, device):
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


@pytest.fixture(scope="module")
def engines():
    kw = dict(num_devices=8, page_size=16, kv_memory_gb=0.01, warmup=False, compile_cache_dir=None, dtype="float32")
    return {name: Engine(EngineConfig(layout=name, **kw)) for name in LAYOUT_NAMES}


def test_capacity_order_and_gain_equal_freed_weight_memory(engines):
    cap = {name: e.kv_capacity_tokens() for name, e in engines.items()}
    assert cap["dop"] > cap["dp"] > cap["tp"]
    assert cap["cp"] == cap["dop"]
    dp, dop = engines["dp"], engines["dop"]
    dev = dp.mesh.devices.flat[0]
    w_dp, w_dop = _device0_bytes(dp.executor.state, dev), _device0_bytes(dop.executor.state, dev)
    kv_dp, kv_dop = _device0_bytes(dp.executor.kv, dev), _device0_bytes(dop.executor.kv, dev)
    freed = w_dp - w_dop
    assert freed == dp.head_sharded_bytes * 7 // 8  # measured from the live buffers
    # The extra KV memory DOP holds is the weight memory it freed, rounded down to whole pages.
    assert 0 <= freed - (kv_dop - kv_dp) < dop.page_bytes
    assert (cap["dop"] - cap["dp"]) == 8 * dop.extra_pages * 16
    # Every engine knows every layout's capacity before switching, and agrees with the others.
    for e in engines.values():
        assert {k: v["tokens"] for k, v in e.capacities().items()} == cap
