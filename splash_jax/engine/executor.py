"""The step executor: one forward + sample program per (layout, bucket), compiled ahead of time.

Each program is the whole model step inside one `jax.shard_map` over the mesh, with the
layout's explicit collectives (splash_jax/attention/layouts.py), the KV pool donated so it is
updated in place. After `compile_all()` nothing compiles: `run` picks the smallest bucket that
fits, moves the small int/float step inputs to the devices, and dispatches.

Bucket sizes are per query-device: for tp/cp the step's whole token/request count, for dp/dop
each device's own share (the step holds N segments of that size).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from splash_jax.attention.layouts import ShardedContext
from splash_jax.engine.sampler import SampleOutput, SamplingInputs, sample
from splash_jax.kv.cache import KVCache, StepInput
from splash_jax.mesh.layouts import AXIS, Layout

log = logging.getLogger(__name__)

PER_DEVICE_FIELDS = ("token_request", "write_page", "write_offset", "kv_lens", "page_table")


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


def param_specs(state, layout: Layout):
    """PartitionSpec pytree matching the param state, from the layout's rule table."""

    def spec(path, _leaf):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        names = [n for n in names if n not in (None, "value")]
        return layout.param_spec(tuple(names))

    return jax.tree_util.tree_map_with_path(spec, state)


def batch_specs() -> StepInput:
    per_device = P(AXIS)
    return StepInput(P(), P(), per_device, per_device, per_device, per_device, per_device, P())


def _local(batch: StepInput) -> StepInput:
    """Inside shard_map the per-device fields arrive as [1, ...]: drop that axis."""
    return dataclasses.replace(batch, **{f: getattr(batch, f)[0] for f in PER_DEVICE_FIELDS})


def layout_step(graphdef, state, kv, mesh, layout: Layout, impl: str, sampled: bool = True):
    """The model step for `layout` as one shard_map over the mesh (not yet jitted)."""
    ctx = ShardedContext(layout, mesh.shape[AXIS], impl)

    def per_device(state, kv, batch, *sampling):
        logits, kv = nnx.merge(graphdef, state)(kv, _local(batch), ctx=ctx)
        return (sample(logits, sampling[0]) if sampled else logits), kv

    kv_specs = jax.tree.map(lambda _: P(AXIS), kv)
    in_specs = (param_specs(state, layout), kv_specs, batch_specs()) + ((P(),) if sampled else ())
    return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=(P(), kv_specs), check_vma=False)


class StepExecutor:
    def __init__(
        self, model, kv: KVCache, mesh, layout: Layout, ladder: tuple[int, int, int], pages_per_request: int,
        impl: str, extra_pages_total: int = 0,
    ):
        self.graphdef, self.state = nnx.split(model)
        self.kv = kv
        self.mesh = mesh
        self.n = mesh.shape[AXIS]
        self.ladder = ladder  # (max tokens, max requests, min tokens) per step
        self.pages_per_request = pages_per_request
        self.impl = impl
        self.replicated = NamedSharding(mesh, P())
        self._programs: dict[str, object] = {}
        self._compiled: dict[tuple[str, Bucket], object] = {}
        self._input_shardings: dict[tuple[str, Bucket], object] = {}
        self.layout = layout
        self.extra_pages_total = extra_pages_total  # size of the extra segment when it exists

    # --- per-layout abstract state ---------------------------------------------------------
    def state_abstract(self, layout: Layout):
        """The param state as the layout places it (shapes and shardings only)."""
        specs = param_specs(self.state, layout)
        return jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec)),
            self.state, specs,
        )

    def kv_abstract(self, layout: Layout) -> KVCache:
        """The pool as the layout has it: the extra segment exists only under head-sharded layouts."""
        sharding = NamedSharding(self.mesh, P(AXIS))

        def spec(x, pages=None):
            return jax.ShapeDtypeStruct((pages or x.shape[0],) + x.shape[1:], x.dtype, sharding=sharding)

        base_l, base_r = tuple(spec(x) for x in self.kv.latent), tuple(spec(x) for x in self.kv.rope)
        if layout.heads_sharded and self.extra_pages_total:
            e = self.extra_pages_total
            return KVCache(base_l, base_r, tuple(spec(x, e) for x in self.kv.latent), tuple(spec(x, e) for x in self.kv.rope))
        return KVCache(base_l, base_r)

    def program(self, layout: Layout, sampled: bool = True):
        """The jitted shard_map step for a layout: (state, kv, batch, sampling) -> (SampleOutput, kv),
        or with sampled=False (state, kv, batch) -> (float32 logits, kv) for checks and benchmarks."""
        key = (layout.name, sampled)
        if key not in self._programs:
            self._programs[key] = jax.jit(
                layout_step(
                    self.graphdef, self.state, self.kv_abstract(layout), self.mesh, layout, self.impl, sampled
                ),
                donate_argnums=(1,),
            )
        return self._programs[key]

    # --- compilation ----------------------------------------------------------------------
    def abstract_inputs(self, layout: Layout, bucket: Bucket):
        n, m = self.n, self.pages_per_request
        t_total = n * bucket.tokens if layout.owner_rows else bucket.tokens
        rows = n * bucket.requests if layout.owner_rows else bucket.requests
        per_device = NamedSharding(self.mesh, P(AXIS))

        def arr(shape, dtype=jnp.int32, sharding=self.replicated):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        t, g = bucket.tokens, self.kv_abstract(layout).num_segments
        batch = StepInput(
            arr((t_total,)), arr((t_total,)), arr((n, t), sharding=per_device), arr((n, g, t), sharding=per_device),
            arr((n, t), sharding=per_device), arr((n, g, t), sharding=per_device),
            arr((n, g, bucket.requests, m), sharding=per_device), arr((rows,)),
        )
        sampling = SamplingInputs(
            arr((rows,), jnp.float32), arr((rows,)), arr((rows,), jnp.float32), arr((rows,), jnp.uint32), arr((rows,))
        )
        return batch, sampling

    def lower(self, layout: Layout, bucket: Bucket):
        batch, sampling = self.abstract_inputs(layout, bucket)
        return self.program(layout).lower(self.state_abstract(layout), self.kv_abstract(layout), batch, sampling)

    def buckets(self, layout: Layout) -> list[Bucket]:
        """Owner layouts size buckets per device (a step holds N segments), so they start smaller."""
        max_tokens, max_requests, min_tokens = self.ladder
        if layout.owner_rows:
            min_tokens = max(1, min_tokens // self.n)
        return bucket_ladder(max_tokens, max_requests, min_tokens)

    def compile_all(self, layouts: list[Layout] | None = None, show_progress: bool = True) -> float:
        layouts = layouts or [self.layout]
        todo = [(lay, b) for lay in layouts for b in self.buckets(lay) if (lay.name, b) not in self._compiled]
        t0 = time.perf_counter()
        for lay, bucket in tqdm(todo, desc="compiling steps", unit="program", disable=not show_progress, leave=False):
            self._compiled[(lay.name, bucket)] = self.lower(lay, bucket).compile()
        elapsed = time.perf_counter() - t0
        log.info("compiled %d step programs (%s) in %.1fs", len(todo), ",".join(l.name for l in layouts), elapsed)
        return elapsed

    def pick(self, num_tokens: int, num_requests: int) -> Bucket:
        for b in self.buckets(self.layout):
            if b.tokens >= num_tokens and b.requests >= num_requests:
                return b
        raise ValueError(f"no bucket holds {num_tokens} tokens / {num_requests} requests per device")

    # --- running --------------------------------------------------------------------------
    def run(self, bucket: Bucket, batch: StepInput, sampling: SamplingInputs) -> SampleOutput:
        """Dispatch one step (asynchronously); the cache is replaced by the updated one."""
        key = (self.layout.name, bucket)
        compiled = self._compiled.get(key)
        if compiled is None:  # only without warm-up; compiles once per bucket
            compiled = self._compiled[key] = self.lower(self.layout, bucket).compile()
        shardings = self._input_shardings.get(key)
        if shardings is None:
            abstract = self.abstract_inputs(self.layout, bucket)
            shardings = self._input_shardings[key] = jax.tree.map(lambda s: s.sharding, abstract)
        batch, sampling = jax.device_put((batch, sampling), shardings)
        out, self.kv = compiled(self.state, self.kv, batch, sampling)
        return out
