"""A step's packed inputs travel as one buffer (step_packer.step_buffer), in pinned host memory on
GPUs (the program moves it to the device): the programs read the same fields either way."""

import numpy as np
import pytest

from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.step_packer import pack_step, split_step_buffer, step_buffer

KW = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=32, compile_cache_dir=None, warmup=False)
PROMPTS = ["Latent attention", "One shared latent per token means the cache can live anywhere.", "ok"]


def test_the_step_buffer_holds_the_replicated_part_and_each_devices_own():
    engine = Engine(EngineConfig(layout="dp", num_devices=2, **KW))
    ex = engine.executor
    bucket = ex.buckets(engine.layout)[0]
    shape = ex.shape(engine.layout, bucket)
    rng = np.random.default_rng(0)
    rep = rng.integers(-5, 1000, shape.replicated_spec().size, dtype=np.int32)
    dev = rng.integers(-5, 1000, (ex.n, shape.device_spec().size), dtype=np.int32)
    buf = step_buffer(rep, dev)
    assert buf.shape == ex.step_input_abstract(shape).shape and buf.dtype == np.int32
    for i in range(ex.n):
        r, d = split_step_buffer(shape, buf[i])
        np.testing.assert_array_equal(r, rep)
        np.testing.assert_array_equal(d, dev[i])
    packed = pack_step(shape, [], engine.scheduler.tables, engine.slot_sampling, engine.config.page_size)
    assert ex.step_input(packed.rep, packed.dev).sharding == ex.input_sharding()


@pytest.mark.parametrize("layout", ["dp"])  # per-device buffers (tp's are the same program shapes, N = 2)
def test_steps_from_pinned_host_memory_generate_what_steps_from_device_memory_do(layout):
    # greedy alone: steps sampled inside the step program (the ones that read pinned memory); then
    # with random draws and logprobs: full steps (device memory either way, input_sharding)
    greedy = [SamplingParams(max_tokens=8)] * len(PROMPTS)
    mixed = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.8, seed=3),
             SamplingParams(max_tokens=8, logprobs=2)]
    outs = {}
    for memory in ("device", "pinned_host"):
        engine = Engine(EngineConfig(layout=layout, num_devices=2, step_input_memory=memory, **KW))
        ex = engine.executor
        assert ex.input_sharding().memory_kind == (memory if memory == "pinned_host" else "device")
        assert ex.input_sharding(full=True).memory_kind == "device"
        outs[memory] = [(o.token_ids, o.logprobs) for params in (greedy, mixed) for o in engine.generate(PROMPTS, params)]
        fulls = {key[3] for key in ex._compiled}  # (layout, bucket, moving, full, expanded, mode)
        assert fulls == {False, True}, "both kinds of step program ran"
    assert outs["pinned_host"] == outs["device"]


def test_step_input_memory_is_checked_and_auto_picks_pinned_host_on_gpus():
    config = EngineConfig()
    assert config.resolved_step_input_memory("gpu") == "pinned_host"
    assert config.resolved_step_input_memory("cpu") == config.resolved_step_input_memory("tpu") == "device"
    assert EngineConfig(step_input_memory="device").resolved_step_input_memory("gpu") == "device"
    with pytest.raises(ValueError, match="step-input-memory"):
        EngineConfig(step_input_memory="host").validate()


def test_an_unplaced_step_input_is_the_host_buffer_only_for_device_memory():
    # StepExecutor.run hands a program whose input lives in device memory the host buffer (its call
    # moves it); an input in pinned host memory is put there first: a host buffer handed to the call
    # lands in device memory, which the program refuses on a GPU (E0102; on the CPU both kinds are
    # host memory, so only this rule guards it). An MTP engine always puts it (its draft program reads it again).
    for memory in ("device", "pinned_host"):
        engine = Engine(EngineConfig(layout="dp", num_devices=2, step_input_memory=memory, **KW))
        ex = engine.executor
        shape = ex.shape(engine.layout, ex.buckets(engine.layout)[0])
        packed = pack_step(shape, [], engine.scheduler.tables, engine.slot_sampling, engine.config.page_size)
        unplaced = ex.step_input(packed.rep, packed.dev, place=False)
        np.testing.assert_array_equal(np.asarray(unplaced), step_buffer(packed.rep, packed.dev))
        if memory == "device":
            assert isinstance(unplaced, np.ndarray)
        else:
            assert unplaced.sharding == ex.input_sharding() and unplaced.sharding.memory_kind == "pinned_host"
