"""What names, sizes and shapes the step programs, apart from the executor that compiles and runs
them (engine/executor.py): the bucket ladder, program names, the executor's arguments from an
EngineConfig, the model step of a layout as one shard_map, and the programs' output types."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from splash_jax.attention.layouts import ShardedContext
from splash_jax.engine.sampler import SamplerMode, SamplerWidths, SamplingInputs
from splash_jax.kv.cache import StepInput
from splash_jax.mesh.layouts import AXIS, POOL_SPEC, Layout

PER_DEVICE_FIELDS = ("token_request", "write_page", "write_offset", "kv_lens", "page_table")


def auto_compile_threads() -> int:
    """One compile thread per CPU on accelerators; 1 on the CPU backend, where XLA's compiler already
    uses the cores (benchmarks/startup.py: 2 threads were 12% slower on a 2-core host)."""
    return 1 if jax.default_backend() == "cpu" else (os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    tokens: int
    requests: int


def bucket_ladder(max_tokens: int, max_requests: int, min_tokens: int = 8, gap: int = 0) -> list[Bucket]:
    """Token buckets up to max_tokens, each with min(tokens, max_requests) request rows: powers of
    two from min_tokens and, with a gap, multiples of `gap` tokens once a bucket reaches it.

    One request size per token size keeps the ladder short (log2 of the budget); the extra
    request rows of a prefill-heavy step only cost their LM-head rows and sampling. Doubling pads a
    step up to 2x its tokens, which at the top of the ladder is whole prefill work thrown away (a
    6.1K-token prompt runs in the 8K program); a gap bounds that padding by `gap` tokens for a few
    more compiled programs (vLLM's TPU backend pads the same way above its padding gap).
    """
    sizes, t = [], min(min_tokens, max_tokens)
    while t < max_tokens:
        sizes.append(t)
        t = (t // gap + 1) * gap if gap and 2 * t > gap else 2 * t
    sizes.append(max_tokens)
    return [Bucket(t, min(t, max_requests)) for t in sizes]


def mode_name(mode: SamplerMode) -> str:
    """A SamplerMode as a short name (its true fields)."""
    fields = [f.name for f in dataclasses.fields(mode) if getattr(mode, f.name)]
    return "+".join(fields) or "plain"


def logits_key(key: tuple) -> bool:
    """Whether the program of a program key (layout, bucket, moving, full, expanded, mode) returns
    its logits to a sampler program: full and not a fused variant."""
    return bool(key[3]) and key[5] is None


def program_name(layout: Layout, bucket: Bucket, moving: bool = False, full: bool = False, expanded: bool = False,
                 mode: SamplerMode | None = None) -> str:
    """A step program's name from its key, e.g. "tp/t8r8/full+fused-filter" (logs, stats, AOT reports)."""
    variant = "+".join(["full" if full else "greedy"] + ["moving"] * moving + ["expanded"] * expanded
                       + ([f"fused-{mode_name(mode)}"] if mode is not None else []))
    return f"{layout.name}/t{bucket.tokens}r{bucket.requests}/{variant}"


def sampler_name(rows: int, mode: SamplerMode) -> str:
    """The sampler program's name in logs, memory reports and AOT reports."""
    return f"sampler/r{rows}/{mode_name(mode)}"


def step_executor_args(config, platform: str, n: int, pages_per_request: int, widths: SamplerWidths,
                       extra_pages_total: int, switch_chunk_pages: int) -> dict:
    """StepExecutor's arguments besides model, pool, mesh and layout, from an EngineConfig: the one
    recipe the engine, its start-up probe (engine/pool_sizing.py) and AotBuild (aot.py) share."""
    return dict(
        ladder=(config.max_num_batched_tokens, config.max_logits_rows, config.min_token_bucket,
                config.resolved_token_bucket_gap(platform)),
        pages_per_request=pages_per_request, impl=config.attention_impl, widths=widths, num_slots=config.max_num_seqs,
        extra_pages_total=extra_pages_total, move_pages=switch_chunk_pages if config.enable_switching and n > 1 else 0,
        expanded_min_tokens=config.resolved_expanded_min_tokens(platform), expanded_spans=config.expanded_prefill_spans,
        graph_scheduling=config.graph_scheduling, graph_update=config.graph_update,
        unroll_max_tokens=config.unroll_max_tokens, step_input_memory=config.resolved_step_input_memory(platform),
        fused_max_tokens=config.resolved_fused_sampler_max_tokens(platform),
        spec_variants=config.speculative_variants,
        mtp_drafts=config.speculative_tokens if config.speculative_method == "mtp" else 0,
    )


def param_specs(state, layout: Layout):
    """PartitionSpec pytree matching the param state, from the layout's rule table."""

    def spec(path, _leaf):
        return layout.param_spec(param_path(path))

    return jax.tree_util.tree_map_with_path(spec, state)


def param_path(path) -> tuple[str, ...]:
    names = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
    return tuple(str(n) for n in names if n not in (None, "value"))


def _local(batch: StepInput) -> StepInput:
    """Inside shard_map the per-device fields arrive as [1, ...]: drop that axis."""
    fields = PER_DEVICE_FIELDS + (("prefill_span",) if batch.prefill_span is not None else ())
    return dataclasses.replace(batch, **{f: getattr(batch, f)[0] for f in fields})


def layout_step(graphdef, state, kv, mesh, layout: Layout, impl: str):
    """The model forward for `layout` as one shard_map over the mesh, on an unpacked StepInput
    (per-device fields with a leading [N] axis): (state, kv, batch) -> (float32 logits, kv).
    For checks and benchmarks; the engine runs `StepExecutor` programs."""
    ctx = ShardedContext(layout, mesh.shape[AXIS], impl)

    def per_device(state, kv, batch):
        return nnx.merge(graphdef, state)(kv, _local(batch), ctx=ctx)

    kv_specs = jax.tree.map(lambda _: POOL_SPEC, kv)

    def mapped(state, kv, batch):
        span = None if batch.prefill_span is None else P(AXIS)
        valid = None if batch.valid is None else P()
        batch_specs = StepInput(P(), P(), P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(), span, valid)
        return jax.shard_map(
            per_device, mesh=mesh, in_specs=(param_specs(state, layout), kv_specs, batch_specs),
            out_specs=(P(), kv_specs), check_vma=False,
        )(state, kv, batch)

    return mapped


def accepted_counts(draft: jax.Array, tokens: jax.Array) -> jax.Array:
    """[R] per logits row: the drafts its verify chunk kept (speculative.accepted's rule, on the
    device), read at each chunk's last row; 0 for rows without a chunk of drafts. A verify chunk
    is a run of rows with drafts (draft >= 0) closed by its sampling row (draft -1), so a row's
    chunk starts after the last draft-less row before it, and its count is how many of those
    rows sampled their own draft before the first that did not."""
    r = draft.shape[0]
    idx = jnp.arange(r, dtype=jnp.int32)
    plain = draft < 0
    # first row of each row's chunk: one past the last draft-less row before it
    first = jax.lax.cummax(jnp.where(plain, idx, -1), axis=0)
    first = jnp.concatenate([jnp.zeros(1, jnp.int32), first[:-1] + 1])
    # the first row at or after q that ends the run of kept drafts (a miss, or the sampling row)
    stop = plain | (tokens != draft)
    next_stop = jax.lax.cummin(jnp.where(stop, idx, r), axis=0, reverse=True)
    return jnp.minimum(next_stop[first], idx) - first


def token_vector(tokens: jax.Array, draft: jax.Array | None, max_rows: int, draft_rows: int = 0) -> jax.Array:
    """A step's sampled tokens as the [2 + draft_rows, max_rows] array the next step reads
    (prev_tokens): row 0 the tokens by logits row, row 1 accepted_counts by row, so a step
    scheduled before this one's tokens reach the host can start where its verify chunks ended
    (step_packer.unpack_step); rows 2.. the MTP drafts by chain row, which the draft program run
    after the step fills (engine/mtp_draft.py; zero here). draft None (engines without ahead
    chunks): the counts stay 0, and the program computes none."""
    rows = tokens.shape[0]
    out = jnp.zeros((2 + draft_rows, max_rows), jnp.int32).at[0, :rows].set(tokens)
    if draft is not None:
        out = out.at[1, :rows].set(accepted_counts(draft, tokens))
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepResult:
    """A dispatched step's device outputs (nothing is read back until asked)."""

    tokens: jax.Array  # [2 + D, max_rows] int32: sampled tokens, accepted draft counts, MTP drafts (token_vector)
    logprob: jax.Array  # [rows]
    top_ids: jax.Array  # [rows, MAX_LOGPROBS]
    top_logprobs: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepLogits:
    """A full-sampler step's device outputs, the input of a sampler program (one per
    (rows, SamplerMode)): the step program stays one per bucket whatever its rows ask for."""

    logits: jax.Array  # [rows, V] float32, replicated
    sampling: SamplingInputs  # [rows], replicated
