"""host_put.put places a step's numpy buffer exactly as jax.device_put does (the reference): same
sharding and memory kind, the same data in every device's shard, and a working program input."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from splash_jax.mesh import host_put


def _mesh(n: int):
    return jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("spec", [P("x"), P()])
@pytest.mark.parametrize("memory", [None, "pinned_host"])
@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_put_places_a_buffer_as_device_put_does(n, spec, memory, dtype):
    sharding = NamedSharding(_mesh(n), spec)
    if memory:
        sharding = sharding.with_memory_kind(memory)
    buf = (np.arange(n * 37, dtype=np.int64) * 7 - 100).astype(dtype).reshape(n, 37)
    got, want = host_put.put(buf, sharding), jax.device_put(buf, sharding)
    assert got.sharding == want.sharding and got.sharding.memory_kind == want.sharding.memory_kind
    assert got.shape == want.shape and got.dtype == want.dtype and got.committed
    np.testing.assert_array_equal(np.asarray(got), buf)
    for a, b in zip(sorted(got.addressable_shards, key=lambda s: s.device.id),
                    sorted(want.addressable_shards, key=lambda s: s.device.id)):
        assert a.device == b.device and a.index == b.index
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    if memory is None:  # a program takes it as it takes device_put's
        f = jax.jit(lambda x: x * 2)
        np.testing.assert_array_equal(np.asarray(f(got)), np.asarray(f(want)))


def test_put_after_the_buffer_changes_copies_the_new_values():
    sharding = NamedSharding(_mesh(8), P("x"))
    buf = np.zeros((8, 5), np.int32)
    first = host_put.put(buf, sharding)
    buf += 3  # the put array is a copy (jax.device_put may alias a CPU buffer: not the engine's reference here)
    np.testing.assert_array_equal(np.asarray(first), 0)
    np.testing.assert_array_equal(np.asarray(host_put.put(buf, sharding)), 3)


@pytest.mark.parametrize("value", [np.zeros((8, 3), np.int64), np.zeros((8, 3), bool), np.int32(4), np.zeros((3, 8), np.int32).T])
def test_other_inputs_take_jax_device_put(value, monkeypatch):
    calls = []
    monkeypatch.setattr(host_put, "_batched_device_put", lambda *a: calls.append(a))
    sharding = NamedSharding(_mesh(8), P())
    got, want = host_put.put(value, sharding), jax.device_put(value, sharding)
    assert not calls and got.dtype == want.dtype and got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), value)


def test_a_refused_internal_call_falls_back_to_device_put_for_good(monkeypatch, caplog):
    def refuse(*a):
        raise TypeError("signature changed")

    monkeypatch.setattr(host_put, "_batched_device_put", refuse)
    sharding = NamedSharding(_mesh(8), P("x"))
    buf = np.arange(16, dtype=np.int32).reshape(8, 2)
    np.testing.assert_array_equal(np.asarray(host_put.put(buf, sharding)), buf)
    assert host_put._batched_device_put is None and "using jax.device_put" in caplog.text
    np.testing.assert_array_equal(np.asarray(host_put.put(buf, sharding)), buf)
