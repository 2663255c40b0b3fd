"""The step executor: one forward + sample program per (token bucket, request bucket), compiled
ahead of time at start-up, with the KV cache donated so it is updated in place.

After `compile_all()` nothing compiles: `run` only picks the smallest bucket that fits, moves
the small int/float step inputs to the device, and dispatches the precompiled executable.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from splash_jax.engine.sampler import SampleOutput, SamplingInputs, sample
from splash_jax.kv.cache import KVCache, StepInput

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    tokens: int
    requests: int


def bucket_ladder(max_tokens: int, max_requests: int, min_tokens: int = 8) -> list[Bucket]:
    """Token buckets in powers of two up to max_tokens, each with min(tokens, max_requests) request rows.

    One request size per token size keeps the ladder short (log2 of the budget); the extra
    request rows of a prefill-heavy step only cost their LM-head rows and sampling.
    """
    sizes, t = [], min(min_tokens, max_tokens)
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    sizes.append(max_tokens)
    return [Bucket(t, min(t, max_requests)) for t in sizes]


class StepExecutor:
    def __init__(self, model, kv: KVCache, buckets: list[Bucket], pages_per_request: int, data_sharding=None):
        self.graphdef, self.state = nnx.split(model)
        self.kv = kv
        self.buckets = sorted(buckets)
        self.pages_per_request = pages_per_request
        self.data_sharding = data_sharding
        self.vocab_size = model.cfg.vocab_size
        self._compiled: dict[Bucket, object] = {}
        graphdef = self.graphdef

        def step(state, kv, batch: StepInput, sampling: SamplingInputs):
            logits, kv = nnx.merge(graphdef, state)(kv, batch)
            return sample(logits, sampling), kv

        self._jitted = jax.jit(step, donate_argnums=(1,))

    # --- compilation ----------------------------------------------------------------------
    def abstract_inputs(self, bucket: Bucket):
        t, r, m = bucket.tokens, bucket.requests, self.pages_per_request

        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.data_sharding)

        batch = StepInput(i32(t), i32(t), i32(t), i32(t), i32(t), i32(t), i32(r, m), i32(r))
        f32 = jax.ShapeDtypeStruct((r,), jnp.float32, sharding=self.data_sharding)
        sampling = SamplingInputs(f32, i32(r), f32, jax.ShapeDtypeStruct((r,), jnp.uint32, sharding=self.data_sharding), i32(r))
        return batch, sampling

    def lower(self, bucket: Bucket):
        batch, sampling = self.abstract_inputs(bucket)
        return self._jitted.lower(self.state, self.kv, batch, sampling)

    def compile_all(self, show_progress: bool = True) -> float:
        t0 = time.perf_counter()
        for bucket in tqdm(self.buckets, desc="compiling steps", unit="bucket", disable=not show_progress, leave=False):
            if bucket not in self._compiled:
                self._compiled[bucket] = self.lower(bucket).compile()
        elapsed = time.perf_counter() - t0
        log.info("compiled %d step buckets in %.1fs", len(self.buckets), elapsed)
        return elapsed

    def pick(self, num_tokens: int, num_requests: int) -> Bucket:
        for b in self.buckets:
            if b.tokens >= num_tokens and b.requests >= num_requests:
                return b
        raise ValueError(f"no bucket holds {num_tokens} tokens / {num_requests} requests")

    # --- running --------------------------------------------------------------------------
    def run(self, bucket: Bucket, batch: StepInput, sampling: SamplingInputs) -> SampleOutput:
        """Dispatch one step (asynchronously); the cache is replaced by the updated one."""
        compiled = self._compiled.get(bucket)
        if compiled is None:  # only without warm-up; compiles once per bucket
            compiled = self._compiled[bucket] = self.lower(bucket).compile()
        batch, sampling = jax.device_put((batch, sampling), self.data_sharding)
        out, self.kv = compiled(self.state, self.kv, batch, sampling)
        return out
