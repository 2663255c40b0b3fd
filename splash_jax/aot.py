"""Every program an engine compiles at start-up, built for a TPU topology on a host without TPUs.

    build = AotBuild(EngineConfig(enable_switching=True), "v5e:2x4")
    for program in build.programs():          # steps x buckets x variants, samplers, migration
        report = build.compile(program)       # compile time, HBM per chip, FLOPs, collectives

The model is built abstractly (`nnx.eval_shape`: shapes and dtypes, no arrays), the executor's
device state is ShapeDtypeStructs on a mesh of libtpu's compile-only devices (mesh/topology.py),
and the programs are lowered from those abstract inputs while `dispatch.compiling_for("tpu")`
makes kernels lower for TPU (the Mosaic MLA decode kernel), as MaxText's train_compile does for
training steps. The pool and the extra segment are sized as `Engine.__init__` sizes them on that
chip (weights per chip from the layout's shardings, then `kv_memory_fraction` of what is left, or
`kv_memory_gb`), so memory_analysis() is what the chip would hold. The enumeration is the
engine's own: StepExecutor.program_keys / sampler_keys and switch/programs.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from splash_jax.attention import dispatch
from splash_jax.engine.config import EngineConfig
from splash_jax.engine.executor import StepExecutor
from splash_jax.engine.step_compile import COMPILE_THREAD_STACK
from splash_jax.engine.step_programs import mode_name, program_name, sampler_name, step_executor_args
from splash_jax.engine.request import SamplingLimits
from splash_jax.engine.sampler import SamplerWidths
from splash_jax.kv.allocator import pages_for_tokens
from splash_jax.kv.cache import KVCache
from splash_jax.engine.pool_sizing import measure_and_plan
from splash_jax.kv.capacity import (
    PoolPlan, StartupMemoryError, bytes_per_page, extra_pages_per_device, head_sharded_weight_bytes,
)
from splash_jax.mesh.collectives import collective_counts
from splash_jax.mesh.layouts import AXIS, LAYOUT_NAMES, POOL_SPEC, Layout, get_layout
from splash_jax.mesh.partitioner import use_partitioner
from splash_jax.mesh.topology import ChipSpec, chip_of, topology_mesh
from splash_jax.model import DeepseekForCausalLM, RuntimeOptions
from splash_jax.model_config import ModelConfig
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.switch.migration import in_step_chunk_pages
from splash_jax.switch.programs import handoff_chunk_pages, migration_programs

log = logging.getLogger(__name__)
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Program:
    """One start-up program: its name, what it is, and how to lower it."""

    name: str
    kind: str  # step | sampler | migration
    lower: Callable[[], object]
    layout: str | None = None
    tokens: int | None = None  # step bucket (per query-device)
    requests: int | None = None
    variant: str | None = None  # step: greedy | full, + moving / expanded


@dataclasses.dataclass
class ProgramReport:
    """What compiling one program for the topology gave (per chip)."""

    name: str
    kind: str
    layout: str | None
    tokens: int | None
    requests: int | None
    variant: str | None
    compile_s: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    xla_optimal_s: float | None = None  # the TPU compiler's own estimate (cost_analysis "optimal_seconds")
    collectives: dict = dataclasses.field(default_factory=dict)
    error: str | None = None

    @property
    def hbm_bytes(self) -> int:
        """Peak HBM the program needs on a chip: its arguments, outputs not aliased to donated
        arguments, temporaries and generated code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"hbm_bytes": self.hbm_bytes}


def _model_config(config: EngineConfig, n: int, model_config: ModelConfig | None) -> ModelConfig:
    cfg = model_config or ModelConfig.from_json(Path(config.model) if config.model else DEFAULT_MODEL)
    return cfg.padded_to(n)  # as load_model pads for the mesh


def _eos_count(config: EngineConfig, cfg: ModelConfig) -> int:
    eos = set(cfg.eos_token_ids)
    path = Path(config.model) if config.model else DEFAULT_MODEL
    if (path / "tokenizer.json").exists():
        from splash_jax.tokenizer import Tokenizer

        tok = Tokenizer(path)
        if tok.eos_id is not None:
            eos.add(tok.eos_id)
    return len(eos)


def weight_bytes_per_chip(executor: StepExecutor, layout: Layout) -> int:
    """Bytes of the params on one chip under `layout` (each leaf's shard)."""
    total = 0
    for x in executor.param_abstract(layout):
        total += int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
    return total


class AotBuild:
    """The programs an engine with `config` compiles at start-up, for `topology` (see module doc).

    `hbm_gib`: HBM per chip (default: the chip's). `mesh`: any mesh of the same size instead of
    the topology's (the tests build the CPU twin of a TPU build with it)."""

    def __init__(self, config: EngineConfig, topology: str, hbm_gib: float | None = None,
                 model_config: ModelConfig | None = None, mesh=None):
        self.config, self.topology = config, topology
        self.chip: ChipSpec = chip_of(topology)
        self.mesh = mesh if mesh is not None else topology_mesh(topology)
        self.platform = self.mesh.devices.flat[0].platform
        self.n = self.mesh.shape[AXIS]
        self.hbm_bytes = int((hbm_gib or self.chip.hbm_gib) * GiB)
        use_partitioner(config.resolved_partitioner(self.platform))
        self.layout = get_layout(config.layout)
        dtype = config.resolved_dtype(self.platform)
        expert_format = config.resolved_expert_weights(False, self.platform)
        self.options = RuntimeOptions(dtype=dtype, attention_impl=config.attention_impl, scan_layers=config.scan_layers,
                                      expert_format=expert_format, moe_impl=config.moe_impl)
        cfg = self.cfg = _model_config(config, self.n, model_config)
        model = nnx.eval_shape(lambda: DeepseekForCausalLM(cfg, self.options, nnx.Rngs(0)))
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings

        # Pool sizing, as Engine.__init__ does it on a chip with hbm_bytes and these weights.
        self.page_bytes = bytes_per_page(cfg, config.page_size, dtype)
        self.extra_pages = extra_pages_per_device(head_sharded_weight_bytes(model), self.n, self.page_bytes)
        self.max_logits_rows = config.max_logits_rows
        widths = SamplerWidths.of(SamplingLimits(config.max_stop_token_ids, config.max_logit_bias), _eos_count(config, cfg))
        self.switch_chunk_pages = in_step_chunk_pages(config.switch_chunk_pages, self.n, self.page_bytes)
        self.layouts = [get_layout(name) for name in LAYOUT_NAMES] if config.enable_switching else [self.layout]
        executor_args = step_executor_args(config, self.platform, self.n,
                                           pages_for_tokens(self.max_model_len, config.page_size), widths,
                                           self.n * self.extra_pages, self.switch_chunk_pages)
        # The memory plan of Engine.__init__ (engine/pool_sizing.py) on a chip with hbm_bytes: the
        # largest programs measured on a one-page pool (on TPU once more at the planned size, as
        # their temporaries grow with the pool), then the pool from what remains.
        def probe(pages):
            return StepExecutor(model, self._pool(pages, 0), self.mesh, self.layout, **executor_args)

        self.weight_bytes = {name: weight_bytes_per_chip(probe(1), get_layout(name)) for name in LAYOUT_NAMES}
        extra = self.extra_pages if self.layout.heads_sharded else 0
        self.plan: PoolPlan | None = None
        try:
            with dispatch.compiling_for(self.platform):
                self.plan = measure_and_plan(probe, self.layouts, 1, self.hbm_bytes, self.weight_bytes[self.layout.name],
                                             self.page_bytes, config, extra, self.platform)
        except StartupMemoryError as e:
            log.warning("%s chip: %s. Compiling with a 1-page pool", self.chip.name, e)
        self.pool_fits = self.plan is not None
        self.pages_per_device = self.plan.pages if self.plan else 1
        self.max_model_len = min(self.max_model_len, self.pages_per_device * config.page_size)
        self.pages_per_request = executor_args["pages_per_request"] = pages_for_tokens(self.max_model_len, config.page_size)
        self.executor = StepExecutor(model, self._pool(self.pages_per_device, extra), self.mesh, self.layout, **executor_args)
        self.handoff_chunk_pages = handoff_chunk_pages(self.switch_chunk_pages, config.max_num_seqs, self.n, self.page_bytes)
        log.info("AOT build for %s (%d chips, %.1f GiB HBM each): %d base + %d extra pages of %d tokens per chip, "
                 "weights %s GiB per chip", topology, self.n, self.hbm_bytes / GiB, self.pages_per_device,
                 self.extra_pages, config.page_size,
                 ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.weight_bytes.items()))

    def _pool(self, per_device: int, extra_per_device: int) -> KVCache:
        cfg = self.cfg
        return KVCache.abstract(cfg.num_layers, self.n * per_device, self.config.page_size, cfg.kv_lora_rank,
                                cfg.qk_rope_head_dim, self.options.dtype, NamedSharding(self.mesh, POOL_SPEC),
                                self.n * extra_per_device)

    def kv_capacity_tokens(self, layout: Layout) -> int:
        """Tokens of distinct requests the pool holds under `layout` (replicas count once)."""
        extra = self.extra_pages if layout.heads_sharded else 0
        copies = layout.kv_placement.distinct_copies(self.n)
        return self.n * (self.pages_per_device + extra) * self.config.page_size // copies

    # --- the programs ----------------------------------------------------------------------------
    def programs(self) -> list[Program]:
        """Every program the engine would compile at start-up with this config: the steps of each
        layout x bucket x variant, the sampler programs, and (switching) the migration programs."""
        ex, out = self.executor, []
        for key in ex.program_keys(self.layouts, moving=self.config.enable_switching):
            name = program_name(*key)
            lay, bucket = key[0], key[1]
            out.append(Program(f"step/{name}", "step", lambda k=key: ex.lower(*k), lay.name,
                               bucket.tokens, bucket.requests, name.rsplit("/", 1)[1]))
        for rows, mode in ex.sampler_keys(ex.program_layouts(self.layouts)):
            out.append(Program(sampler_name(rows, mode), "sampler",
                               lambda k=(rows, mode): ex.lower_sampler(*k), requests=rows, variant=mode_name(mode)))
        if self.config.enable_switching and self.n > 1:
            for mig in migration_programs(self.mesh, ex, self.handoff_chunk_pages):
                out.append(Program(f"migration/{mig.name}", "migration", mig.lower))
        return out

    def lower(self, program: Program):
        with dispatch.compiling_for(self.platform):
            return program.lower()

    def compile(self, program: Program, keep_hlo: bool = False) -> tuple[ProgramReport, str | None]:
        """Lower and compile one program; (report, the compiled HLO text if keep_hlo). A failure
        is reported, not raised (the report's `error`)."""
        t0 = time.perf_counter()
        try:
            lowered = self.lower(program)
        except Exception as e:  # noqa: BLE001 - a program that does not lower is a finding
            return self._failed(program, e, time.perf_counter() - t0), None
        return self._compile_lowered(program, lowered, time.perf_counter() - t0, keep_hlo)

    def compile_all(self, programs: list[Program], threads: int = 1, keep_hlo: bool = False):
        """Yield (report, hlo) for every program, as compiles finish. threads > 1: lowering stays in
        this thread (tracing holds the GIL), the compiles run in a pool of that many threads."""
        if threads <= 1:
            for program in programs:
                yield self.compile(program, keep_hlo)
            return
        previous = threading.stack_size(COMPILE_THREAD_STACK)  # XLA's compilers recurse deeply
        try:
            pool = concurrent.futures.ThreadPoolExecutor(threads)
            futures = []
            for program in programs:
                t0 = time.perf_counter()
                try:
                    lowered = self.lower(program)
                except Exception as e:  # noqa: BLE001
                    yield self._failed(program, e, time.perf_counter() - t0), None
                    continue
                futures.append(pool.submit(self._compile_lowered, program, lowered, time.perf_counter() - t0, keep_hlo))
        finally:
            threading.stack_size(previous)
        with pool:
            for future in concurrent.futures.as_completed(futures):
                yield future.result()

    @staticmethod
    def _failed(program: Program, error: Exception, seconds: float) -> ProgramReport:
        rep = ProgramReport(program.name, program.kind, program.layout, program.tokens, program.requests, program.variant)
        rep.compile_s = seconds
        text = str(error)
        rep.error = f"{type(error).__name__}: {' '.join(text.split())[:600]}"
        log.warning("%s did not compile: %s", program.name, rep.error)
        return rep

    def _compile_lowered(self, program: Program, lowered, lower_s: float, keep_hlo: bool):
        rep = ProgramReport(program.name, program.kind, program.layout, program.tokens, program.requests, program.variant)
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile()
        except Exception as e:  # noqa: BLE001 - a program that does not compile is a finding
            return self._failed(program, e, lower_s + time.perf_counter() - t0), None
        rep.compile_s = lower_s + time.perf_counter() - t0
        mem = compiled.memory_analysis()
        if mem is not None:
            rep.argument_bytes, rep.output_bytes = mem.argument_size_in_bytes, mem.output_size_in_bytes
            rep.alias_bytes, rep.temp_bytes = mem.alias_size_in_bytes, mem.temp_size_in_bytes
            rep.code_bytes = mem.generated_code_size_in_bytes
        cost = compiled.cost_analysis() or {}
        if isinstance(cost, list):  # older jax: one dict per computation
            cost = cost[0] if cost else {}
        rep.flops, rep.bytes_accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
        rep.xla_optimal_s = cost.get("optimal_seconds")
        hlo = compiled.as_text()
        rep.collectives = collective_counts(hlo)
        return rep, hlo if keep_hlo else None


def attention_block_lowered(cfg: ModelConfig, mesh, layout: Layout, dtype: str = "float32", impl: str = "xla",
                            tokens: int = 16, pages: int = 16, page_size: int = 8, max_pages: int = 8):
    """One layer's attention block of `layout` inside shard_map over `mesh`, lowered from abstract
    inputs (tests/test_layouts.py's `_attention_hlo`, for any mesh): its HLO carries exactly the
    collectives the layout's attention emits (mesh/collectives.attention_collective_problems)."""
    from jax.sharding import PartitionSpec as P

    from splash_jax.attention.layouts import ShardedContext
    from splash_jax.engine.executor import param_specs
    from splash_jax.model import MLAttention

    n = mesh.shape[AXIS]
    attn = nnx.eval_shape(lambda: MLAttention(cfg, jnp.dtype(dtype), nnx.Rngs(0)))
    graphdef, state = nnx.split(attn)
    ctx = ShardedContext(layout, n, impl)
    t = tokens * n if layout.owner_rows else tokens

    def block(state, x, cos_sin, latent, rope, batch):
        local = {k: v[0] for k, v in batch.items()}
        local = type("B", (), {"prefill_span": None, **local})  # a StepInput without the expanded path
        out, pools = ctx.attention(nnx.merge(graphdef, state), x, cos_sin, ((latent, rope),), local)
        return out, pools[0]

    sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
    batch = {k: sds((n, tokens), jnp.int32, P(AXIS)) for k in ("token_request", "write_offset")}
    batch |= {k: sds((n, 1, tokens), jnp.int32, P(AXIS)) for k in ("write_page", "kv_lens")}
    batch["page_table"] = sds((n, 1, 4, max_pages), jnp.int32, P(AXIS))
    specs = param_specs(state, layout)
    state_abs = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), state, specs)
    fn = jax.jit(jax.shard_map(
        block, mesh=mesh, in_specs=(specs, P(), P(), P(AXIS), P(AXIS), {k: P(AXIS) for k in batch}),
        out_specs=(P(), (P(AXIS), P(AXIS))), check_vma=False,
    ))
    dt = jnp.dtype(dtype)
    args = (state_abs, sds((t, cfg.hidden_size), dt, P()), sds((t, cfg.qk_rope_head_dim), jnp.float32, P()),
            sds((n * pages, page_size, cfg.kv_lora_rank), dt, P(AXIS)),
            sds((n * pages, page_size, cfg.qk_rope_head_dim), dt, P(AXIS)), batch)
    with dispatch.compiling_for(mesh.devices.flat[0].platform):
        return fn.lower(*args)
