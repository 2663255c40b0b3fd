"""The step executor: one forward + sample program per (layout, bucket), compiled ahead of time,
and the one owner of the device state those programs update (params, KV pool, penalty state).
A step whose rows draw, want logprobs or use penalties (the `full` variant) leaves its logits to
a small sampler program per (rows, SamplerMode), so only the rows' wishes decide the
vocabulary-wide work (a filter sort, top-n logprobs) and no step program is compiled per wish.
Buckets of at most `fused_max_tokens` tokens (GPUs: where the launch, not the device, sets a
step's time) also get a `fused` variant per SamplerMode that samples inside the step: one launch,
and no sampler program between two steps to move the step's CUDA-graph buffers (which made the
host update the whole graph every step: docs/kernels.md).

Each program is the whole model step inside one `jax.shard_map` over the mesh, with the
layout's explicit collectives (splash_jax/attention/layouts.py). It takes
  params (a flat tuple of leaves; flattening an nnx State every step costs host time),
  the KV pool and the penalty state (both donated: updated in place),
  the previous step's sampled tokens (so a step can be dispatched before they reach the host),
  two packed int32 buffers (engine/step_packer.py: one transfer each),
and, in the `moving` variant used during a layout switch, one chunk of page copies: the source
pages are gathered from the pool before the forward pass writes it, exchanged with one
all_to_all that XLA runs beside the forward pass, and scattered into their reserved pages at the
end. Background copies only touch full pages (never written again) and reserved pages (in no
page table), so they commute with the step's own reads and writes.

Which programs a warm-up compiles, and compiling them, is engine/step_compile.py.

Bucket sizes are per query-device: for tp/cp the step's whole token/request count, for dp/dop
each device's own share (the step holds N segments of that size).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from splash_jax.attention import expanded
from splash_jax.attention.layouts import ShardedContext
from splash_jax.compile_stats import CompileStats
from splash_jax.engine.compile_options import (  # noqa: F401  (re-exported: tests, probes)
    CONCURRENT_GRAPH_OPTIONS, EXPANDED_GPU_OPTIONS, GRAPH_SCHEDULING, OPTIONAL_OPTIONS, SCANNED_GPU_OPTIONS,
    UNROLLED_GPU_OPTIONS, step_compiler_options,
)
from splash_jax.engine.mtp_pass import slot_next_tokens
from splash_jax.engine.program_memory import ProgramMemory
from splash_jax.engine.sampler_programs import SamplerPrograms
from splash_jax.engine.step_compile import StepCompilation
from splash_jax.engine.step_programs import (  # noqa: F401  (re-exported: the engine, AOT, tests)
    Bucket, StepLogits, StepResult, auto_compile_threads, bucket_ladder, layout_step, logits_key, param_path, param_specs, program_name,
    sampler_name, step_executor_args, token_vector,
)
from splash_jax.engine.penalties import PenaltyState, update_history
from splash_jax.engine.sampler import FULL_MODE, SamplerMode, SamplerWidths, sample
from splash_jax.engine.step_packer import StepShape, split_step_buffer, step_buffer, unpack_step
from splash_jax.kv.cache import KVCache
from splash_jax.kv.page_copy import PageCopier
from splash_jax.mesh.host_put import put
from splash_jax.mesh.layouts import AXIS, LAYOUTS, POOL_SPEC, Layout
from splash_jax.mtp import mtp_latents
from splash_jax.switch.migration import MOVE_FIELDS, move_pages_finish, move_pages_start

log = logging.getLogger(__name__)


class StepExecutor(StepCompilation, SamplerPrograms):
    # MTP drafts (engine/mtp_draft.py): step programs also return the final hidden state of every
    # token slot (the LM head's input), kept as `step_hidden` with the step's device inputs
    # (`step_inputs`) for the draft program the engine dispatches right after the step.
    mtp_hidden = False
    step_hidden = None
    step_inputs = None
    step_prev_tokens = None  # the token vector the last step read (its draft program moves ahead chunks as it did)

    def __init__(
        self, model, kv: KVCache, mesh, layout: Layout, ladder: tuple[int, int, int, int], pages_per_request: int,
        impl: str, widths: SamplerWidths, num_slots: int, extra_pages_total: int = 0, move_pages: int = 0,
        expanded_min_tokens: int = 0, graph_scheduling: str = "concurrent", unroll_max_tokens: int = 0,
        step_input_memory: str = "device", fused_max_tokens: int = 0, expanded_spans: int = expanded.DEFAULT_SPANS,
        spec_variants: int = 0, mtp_drafts: int = 0, graph_update: str = "always",
    ):
        self.graphdef, state = nnx.split(model)
        leaves_with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.paths = [param_path(p) for p, _ in leaves_with_paths]
        self.params: list[jax.Array] = [x for _, x in leaves_with_paths]
        self.kv = kv
        self.mesh = mesh
        self.n = mesh.shape[AXIS]
        self.layout = layout
        self.ladder = ladder  # (max tokens, max requests, min tokens, gap) per step (step_programs.bucket_ladder)
        self.compiled_ladder = ladder  # the one the programs are compiled for (use_bucket_gap may narrow `ladder`)
        self.pages_per_request = pages_per_request
        self.impl = impl
        self.widths = widths
        self.max_rows = self.n * ladder[1]  # rows of the padded sampled-token vector (token_vector), every layout
        # Drafts per chain row the MTP draft programs write into that vector (rows 2..), where the
        # next step reads them (overlapped MTP speculation: engine/mtp_draft.py); 0 without MTP.
        self.mtp_drafts = mtp_drafts
        self.extra_pages_total = extra_pages_total  # size of the extra segment when it exists
        # Draft variants per ahead verify chunk (StepShape.variants; 0: steps take none)
        self.spec_variants = spec_variants if spec_variants and spec_variants <= kv.latent.shape[2] else 0
        self.move_pages = move_pages  # pages per device pair in a `moving` program (0: none)
        # Chunks worth expanding by this size (attention/expanded.worth_expanding) run in the
        # expanded form; buckets that can hold one get an `expanded` variant in layouts that can
        # run it, with up to expanded_spans such chunks per device; 0: none.
        self.expanded_min_tokens, self.expanded_spans = expanded_min_tokens, expanded_spans
        self._refused_expanded: set[tuple[str, Bucket]] = set()  # (layout, bucket) whose expanded program failed to build
        self._shapes: dict[tuple, StepShape] = {}  # shape()'s answers
        self.replicated = NamedSharding(mesh, P())
        self.per_device = NamedSharding(mesh, P(AXIS))
        # The step's one packed input (step_input): in pinned host memory the program moves it to
        # the device itself (EngineConfig.step_input_memory says why; input_sharding where).
        if step_input_memory not in ("pinned_host", "device"):
            raise ValueError(f"step_input_memory must be pinned_host or device, got {step_input_memory!r}")
        self.pinned_input = step_input_memory == "pinned_host"
        self.pool_sharding = NamedSharding(mesh, POOL_SPEC)
        # the mesh's devices, part of an executable_cache key (a program is compiled for them)
        self.device_key = tuple((d.platform, d.id) for d in mesh.devices.flat)
        vocab = model.cfg.vocab_size
        # An abstract pool (ShapeDtypeStructs: splash_jax/aot.py, a TPU topology with no devices)
        # makes an executor that only lowers and compiles: its device state is shapes, never arrays.
        self.abstract = isinstance(kv.latent, jax.ShapeDtypeStruct)
        if self.abstract:
            self.penalties = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated),
                jax.eval_shape(lambda: PenaltyState.zeros(num_slots, vocab)))
            self.prev_tokens = jax.ShapeDtypeStruct(self.token_vector_shape, jnp.int32, sharding=self.replicated)
        else:
            self.penalties = PenaltyState.zeros(num_slots, vocab, self.replicated)
            self.prev_tokens = self._zero_tokens()
        self._compiled: dict[tuple[str, Bucket, bool, bool, bool, SamplerMode | None], object] = {}
        self._samplers: dict[tuple[int, SamplerMode], object] = {}  # (logits rows, mode) -> compiled
        self._open_masks: dict[int, jax.Array] = {}  # logits rows -> all-ones token mask on the device
        self._page_copiers: dict[int, PageCopier] = {}  # pool segments -> copy-on-write page copy
        self.num_compiled = 0
        self.compile_seconds = 0.0
        self.compile_stats = CompileStats()  # start-up compiles by kind (steps here; migration: switch/controller.py)
        self.program_memory = ProgramMemory()  # step and sampler programs -> XLA's temporary bytes (memory_summary)
        backend = mesh.devices.flat[0].platform
        scanned = getattr(model.options, "scan_layers", False)
        # Buckets of at most this many tokens get XLA's unrolled layer loop (scanned GPU steps only).
        self.unroll_max_tokens = unroll_max_tokens if backend == "gpu" and scanned else 0
        self.fused_max_tokens = fused_max_tokens  # buckets up to this size sample inside the step (`fuses`)
        self.compiler_options = {(e, u): step_compiler_options(backend, scanned, e, graph_scheduling, u, graph_update)
                                 for e in (False, True) for u in (False, True)}

    # --- the device state this class owns -----------------------------------------------------
    @property
    def state(self):
        """The params as an nnx State (for inspection and reshards; the hot path uses leaves)."""
        return jax.tree_util.tree_unflatten(self.treedef, self.params)

    def param_items(self) -> list[tuple[tuple[str, ...], jax.Array]]:
        return list(zip(self.paths, self.params))

    @property
    def pool(self) -> KVCache:
        """The KV pool as it is now (read it; change it only through apply_to_pool or swap)."""
        return self.kv

    def apply_to_pool(self, fn) -> None:
        """Replace the pool by fn(pool): a precompiled program that donates it (page moves at
        handoff, dropping the extra segment)."""
        self.kv = fn(self.kv)

    def copy_pages(self, buf) -> None:
        """Copy pages within each device (copy-on-write; a kv/page_copy.pack_copies buffer)."""
        if self.kv.num_segments not in self._page_copiers:  # only without warm-up
            self.compile_page_copies([self.layout])
        self.kv = self._page_copiers[self.kv.num_segments](self.kv, buf)

    def compile_page_copies(self, layouts: list[Layout]) -> int:
        """The page copy of every pool structure these layouts use (one or two segments)."""
        todo = {self.kv_abstract(lay).num_segments: lay for lay in layouts}
        todo = {k: lay for k, lay in todo.items() if k not in self._page_copiers}
        for k, lay in todo.items():
            self._page_copiers[k] = PageCopier(self.mesh, self.kv_abstract(lay))
        self.num_compiled += len(todo)
        return len(todo)

    def swap(self, layout: Layout, params: list[jax.Array], kv: KVCache) -> None:
        """Hand off to a new layout: its params and pool replace the old ones together."""
        self.layout, self.params, self.kv = layout, params, kv

    # --- per-layout abstract state ---------------------------------------------------------
    def param_abstract(self, layout: Layout) -> tuple:
        return tuple(
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, layout.param_spec(path)))
            for path, x in zip(self.paths, self.params)
        )

    def kv_abstract(self, layout: Layout) -> KVCache:
        """The pool as the layout has it: the extra segment exists only under head-sharded layouts."""

        def spec(x, pages=None):
            shape = (x.shape[0], pages or x.shape[1]) + x.shape[2:]  # [L, P, S, D]
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=self.pool_sharding)

        base = (spec(self.kv.latent), spec(self.kv.rope))
        if layout.heads_sharded and self.extra_pages_total:
            e = self.extra_pages_total
            return KVCache(*base, spec(self.kv.latent, e), spec(self.kv.rope, e))
        return KVCache(*base)

    def program_layout(self, layout: Layout) -> Layout:
        """The layout whose programs run `layout`: on one device every layout places weights, pages
        and queries on that device, so TP's programs serve all four (compiled once, not four times)."""
        return LAYOUTS["tp"] if self.n == 1 else layout

    def shape(self, layout: Layout, bucket: Bucket, expanded: bool = False) -> StepShape:
        """The StepShape of (layout, bucket), remembered: packing asks every step, and building one
        (the pool's abstract shapes included) cost the host ~15 us of a batch-1 step."""
        layout = self.program_layout(layout)
        key = (layout.name, bucket, expanded, self.n, self.pages_per_request, self.widths, self.expanded_spans,
               self.spec_variants, self.mtp_hidden, self.extra_pages_total, self.kv.latent.shape[2])
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = StepShape(
                bucket.tokens, bucket.requests, self.n, self.kv_abstract(layout).num_segments, self.pages_per_request,
                layout.owner_rows, self.widths, expanded, self.expanded_spans, self.spec_variants,
                self.kv.latent.shape[2], self.mtp_hidden,
            )
        return shape

    def expands(self, layout: Layout, bucket: Bucket) -> bool:
        """Whether (layout, bucket) has an `expanded` program (a long prefill chunk's attention in
        the expanded form)."""
        layout = self.program_layout(layout)
        return (
            self.expanded_min_tokens > 0 and bucket.tokens >= expanded.min_chunk_tokens(self.expanded_min_tokens)
            and layout.expanded_prefill and (layout.name, bucket) not in self._refused_expanded
        )

    # --- programs -------------------------------------------------------------------------------
    def fuses(self, bucket: Bucket, moving: bool = False, expanded: bool = False) -> bool:
        """Whether this bucket's full steps (not moving pages, not expanded) sample inside the step
        program (the `fused` variant, one per SamplerMode) unless their sampling is deferred."""
        return bucket.tokens <= self.fused_max_tokens and not moving and not expanded

    def returns_logits(self, bucket: Bucket, full: bool, moving: bool = False, expanded: bool = False,
                       defer: bool = False) -> bool:
        """Whether `run` with these arguments dispatches a step program that returns its logits to a
        sampler program (a full step that does not fuse): what input_sharding's `full` asks."""
        return full and (defer or not self.fuses(bucket, moving, expanded))

    def _program(self, layout: Layout, bucket: Bucket, moving: bool, full: bool, expanded: bool,
                 mode: SamplerMode | None = None, draft=None):
        """The step program; with `mode` (full only) the fused variant, which samples in `mode`
        with the step's grammar mask (an input after the packed buffer) instead of returning logits.
        draft (a greedy step, not moving, not expanded: MtpDraftRunner.inline_draft): the MTP draft
        pass runs inside, after sampling, on inputs `draft.in_specs` after the packed buffer, and
        the returned token vector carries the drafts (one launch a step instead of two)."""
        if mode is not None and not (full and self.fuses(bucket, moving, expanded)):
            raise ValueError(f"no fused program for {bucket} (moving={moving}, expanded={expanded}, full={full})")
        if draft is not None and (full or moving or expanded):
            raise ValueError("drafts inside the step program only for greedy steps that move no pages and expand nothing")
        fused = mode is not None
        shape = self.shape(layout, bucket, expanded)
        ctx = ShardedContext(layout, self.n, self.impl)
        graphdef, treedef, max_rows, draft_rows = self.graphdef, self.treedef, self.max_rows, self.mtp_drafts
        hidden_out = self.mtp_hidden and draft is None  # (the draft pass inside reads them)
        spec = bool(self.spec_variants)  # accepted counts only where ahead chunks read them

        def per_device(params, kv, penalties, prev_tokens, buf, *rest):
            mask = rest[0] if fused else None
            move = rest[1:] if fused else rest
            if moving:
                outgoing, kv = move_pages_start(kv, move[0][0])
            rep, dev = split_step_buffer(shape, buf[0])
            batch, sampling, token_slot, prompt_len = unpack_step(shape, rep, dev, prev_tokens)
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, list(params)))
            if hidden_out or draft is not None:
                logits, hidden, kv = model(kv, batch, ctx=ctx, return_hidden="all")
                extra = (hidden,) if hidden_out else ()
            else:
                logits, kv = model(kv, batch, ctx=ctx)
                extra = ()
            if moving:
                kv = move_pages_finish(kv, outgoing, move[0][0])
            if full:  # the host picks `full` whenever a request of the step needs penalties; the
                # step's sampler program (sampler_program) draws from these logits, or (fused) this one
                penalties = update_history(penalties, batch.tokens, batch.positions, token_slot, prompt_len)
                if not fused:
                    return (StepLogits(logits.astype(jnp.float32), sampling), kv, penalties) + extra
                out = sample(logits, sampling, penalties, full=True, mode=mode, mask=mask)
            else:
                out = sample(logits, sampling, None, full=False)
            if shape.mtp_next and draft is None:  # this step's MTP latents, now that its tokens exist
                # (mtp_draft: steps whose drafts nobody reads then launch no draft program)
                nxt = slot_next_tokens(shape, rep, out.tokens)
                kv = mtp_latents(model, kv, dataclasses.replace(batch, tokens=nxt, prefill_span=None), extra[0], ctx)
            tokens = token_vector(out.tokens, sampling.draft if spec else None, max_rows, draft_rows)
            if draft is not None:  # the MTP pass and the draft chain (mtp_pass.draft_pass) on this step's tokens
                tokens, kv = draft(model, kv, ctx, batch, sampling, rep, prev_tokens, tokens, hidden, *move)
            return (StepResult(tokens, out.logprob, out.top_ids, out.top_logprobs), kv, penalties) + extra

        param_specs_ = tuple(layout.param_spec(p) for p in self.paths)
        kv_specs = jax.tree.map(lambda _: POOL_SPEC, self.kv_abstract(layout))
        pen_specs = jax.tree.map(lambda _: P(), self.penalties)
        in_specs = (param_specs_, kv_specs, pen_specs, P(), P(AXIS)) + ((P(),) if fused else ()) + ((P(AXIS),) if moving else ())
        in_specs += tuple(draft.in_specs) if draft is not None else ()
        mapped = jax.shard_map(
            per_device, mesh=self.mesh, in_specs=in_specs,
            out_specs=(P(), kv_specs, pen_specs) + ((P(),) if hidden_out else ()), check_vma=False,
        )
        to_device = functools.partial(self.device_step_buffer, full=full and not fused)

        def program(params, kv, penalties, prev_tokens, buf, *rest):
            return mapped(params, kv, penalties, prev_tokens, to_device(buf), *rest)

        return jax.jit(program, donate_argnums=(1, 2)), shape

    def input_sharding(self, full: bool = False) -> NamedSharding:
        """Where a step program's packed input lives. Pinned host memory (when asked) for the
        sampled-on-device steps only (greedy and fused; `full` here means a step that hands its
        logits to a sampler program): such a step ran slower from it at batch 1 on an H200 (6.5 vs
        4.2 ms per step, docs/kernels.md), so it reads device memory."""
        return self.per_device.with_memory_kind("pinned_host") if self.pinned_input and not full else self.per_device

    def step_input_abstract(self, shape: StepShape, full: bool = False) -> jax.ShapeDtypeStruct:
        """The step program's packed input: [N, R + D] int32 (step_packer.step_buffer)."""
        size = shape.replicated_spec().size + shape.device_spec().size
        return jax.ShapeDtypeStruct((self.n, size), jnp.int32, sharding=self.input_sharding(full))

    def device_step_buffer(self, buf: jax.Array, full: bool = False) -> jax.Array:
        """Inside a program (outside its shard_map): the packed input in device memory."""
        return jax.device_put(buf, self.per_device) if self.input_sharding(full).memory_kind == "pinned_host" else buf

    def step_input(self, rep: np.ndarray, dev: np.ndarray | None, full: bool = False,
                   place: bool = True) -> jax.Array | np.ndarray:
        """A step's packed buffers as its program's input, put where input_sharding says. A
        jax.Array is taken as that input already (a multi-process global array,
        distributed/leader.global_step_inputs; dev is None then). place=False, for an input in
        device memory: the host buffer itself, which the program's call moves to the device in C++
        (jax.device_put's Python path cost 0.25 ms of the 0.57 ms a batch-1 step's call took on the
        2-core CPU host). Not for pinned host memory: a host buffer handed to the call went to device
        memory, and the program refused it (H100, E0102 RuntimeProgramInputMismatch)."""
        if isinstance(rep, jax.Array):
            return rep
        buf = step_buffer(rep, dev)
        sharding = self.input_sharding(full)
        return buf if not place and sharding.memory_kind != "pinned_host" else put(buf, sharding)

    def draft_step_input(self) -> jax.Array:
        """The last step's packed input where a draft program (mtp_draft, one per bucket whether
        the step was full or not) reads it: input_sharding(full=False)."""
        buf = self.step_inputs[0]
        target = self.input_sharding()
        return buf if buf.sharding.memory_kind == target.memory_kind else jax.device_put(buf, target)

    def lower(self, layout: Layout, bucket: Bucket, moving: bool = False, full: bool = False, expanded: bool = False,
              mode: SamplerMode | None = None, draft=None):
        """draft: see _program; its `abstract_args` follow the packed buffer."""
        fn, shape = self._program(layout, bucket, moving, full, expanded, mode, draft)
        prev = jax.ShapeDtypeStruct(self.token_vector_shape, jnp.int32, sharding=self.replicated)
        pen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), self.penalties)
        args = [self.param_abstract(layout), self.kv_abstract(layout), pen, prev,
                self.step_input_abstract(shape, full and mode is None)]
        if mode is not None:
            args.append(jax.ShapeDtypeStruct((shape.rows, self.mask_words), jnp.int32, sharding=self.replicated))
        if moving:
            args.append(jax.ShapeDtypeStruct((self.n, len(MOVE_FIELDS) * self.n * self.move_pages), jnp.int32, sharding=self.per_device))
        if draft is not None:
            args += list(draft.abstract_args)
        return fn.lower(*args)

    def unrolled(self, bucket: Bucket, logits: bool = False) -> bool:
        """Whether this bucket's step programs have their layer loop unrolled by XLA. logits: the
        program hands its logits to a sampler program (full, not fused); such programs keep the
        loop above the fused buckets: with a sampler program between two unrolled steps XLA
        re-recorded the step's whole CUDA graph on the host every call (V2-Lite, one H200, 64
        streams with 25% JSON-schema requests: the core's CPU 9.4 ms per 9.5 ms step, TPOT 1.14x
        the bare step), where the scanned loop's graphs are per layer (docs/performance.md)."""
        limit = min(self.unroll_max_tokens, self.fused_max_tokens) if logits else self.unroll_max_tokens
        return bucket.tokens <= limit

    def buckets(self, layout: Layout) -> list[Bucket]:
        """Owner layouts size buckets per device (a step holds N segments), so they start smaller."""
        layout = self.program_layout(layout)
        max_tokens, max_requests, min_tokens, gap = self.ladder
        if layout.owner_rows:
            min_tokens = max(1, min_tokens // self.n)
        return bucket_ladder(max_tokens, max_requests, min_tokens, gap)

    def use_bucket_gap(self, gap: int) -> None:
        """Steps pick their buckets from the ladder of another --token-bucket-gap from now on (a
        benchmark compares ladders on one engine): only a subset of the compiled ladder (doubling
        under a power-of-two gap is one), so nothing compiles."""
        max_tokens, max_requests, min_tokens, compiled = self.compiled_ladder
        have = {b.tokens for b in bucket_ladder(max_tokens, max_requests, min_tokens, compiled)}
        want = {b.tokens for b in bucket_ladder(max_tokens, max_requests, min_tokens, gap)}
        if not want <= have:
            raise ValueError(f"a bucket gap of {gap} needs buckets {sorted(want - have)} that the compiled ladder "
                             f"(gap {compiled}) lacks")
        self.ladder = (max_tokens, max_requests, min_tokens, gap)

    def program_layouts(self, layouts: list[Layout] | None = None) -> list[Layout]:
        """The distinct layouts whose programs serve `layouts` (default: the current one)."""
        return list(dict.fromkeys(self.program_layout(l) for l in (layouts or [self.layout])))

    def pick(self, num_tokens: int, num_requests: int) -> Bucket:
        for b in self.buckets(self.layout):
            if b.tokens >= num_tokens and b.requests >= num_requests:
                return b
        raise ValueError(f"no bucket holds {num_tokens} tokens / {num_requests} requests per device")

    # --- running --------------------------------------------------------------------------
    def run(
        self, bucket: Bucket, rep: np.ndarray, dev: np.ndarray, move: np.ndarray | None = None, full: bool = False,
        expanded: bool = False, mode: SamplerMode = FULL_MODE, defer: bool = False, drafted: bool | None = None,
        inline=None,
    ) -> StepResult | StepLogits:
        """Dispatch one step (asynchronously); pool, penalty state and prev_tokens are replaced.
        full: the sampler with random draws, logprobs, penalties and grammar masks
        (sampler.needs_full), then a sampler program for `mode` (what the step's rows ask for
        beyond that) after the step's, with every token allowed; in a bucket that fuses, the fused
        program samples in `mode` itself (same tokens, one launch). defer (full only): dispatch the
        forward pass alone and return its StepLogits; `sample()` runs the sampler later, with the
        grammar masks the host fills meanwhile, before the next step. expanded: the program with a prefill_span (packed with `shape(..., expanded=True)`).
        drafted (an MTP engine): whether a draft program reads this step's input, hidden states
        and tokens (MtpDraftRunner.arm; default yes); when none does (the draft budget at level 0
        on a step that samples its own tokens), the input goes to the call as a host buffer, as
        with speculation off. inline (program, inputs): a greedy step whose program drafts too
        (MtpDraftRunner.inline_draft): that program, its draft inputs after the packed buffer; its
        token vector carries the drafts."""
        if inline is not None and (full or move is not None or expanded):
            raise ValueError("a step with drafts inside is greedy, moves no pages and expands nothing")
        if expanded and move is not None:
            raise ValueError("a step that moves pages has no expanded-prefill program")
        if defer and not full:
            raise ValueError("only a full step defers its sampling")
        apart = self.returns_logits(bucket, full, move is not None, expanded, defer)
        fused = full and not apart
        if inline is not None:
            program, more = inline
            drafted = False  # no draft program after it
        else:
            program, more = self.compiled(self.layout, bucket, move is not None, full, expanded, mode if fused else None), []
            drafted = self.mtp_hidden and (drafted is None or drafted)
        inputs = [self.step_input(rep, dev, apart, place=drafted)]
        if fused:
            inputs.append(self.open_mask(self.shape(self.layout, bucket, expanded).rows))
        if move is not None:
            inputs.append(put(move, self.per_device))
        inputs += more
        prev = self.prev_tokens
        out, self.kv, self.penalties, *hidden = program(tuple(self.params), self.kv, self.penalties, prev, *inputs)
        if self.mtp_hidden:  # (None when no draft program reads them: draft_step_input refuses)
            self.step_hidden, self.step_inputs, self.step_prev_tokens = (hidden[0], inputs, prev) if drafted else (None,) * 3
        if defer:
            return out
        return self.sample(out, mode) if apart else self._sampled(out)

    def sample(self, step: StepLogits, mode: SamplerMode = FULL_MODE, mask: np.ndarray | None = None) -> StepResult:
        """The sampler program on a full step's logits (deferred by `run(defer=True)`); its tokens
        feed the next step. mask: [rows, ceil(V/32)] int32 token masks (None: every token allowed)."""
        rows = step.logits.shape[0]
        mask = self.open_mask(rows) if mask is None else put(mask, self.replicated)
        return self._sampled(self.sampler_program(rows, mode)(step, self.penalties, mask))

    @property
    def token_vector_shape(self) -> tuple[int, int]:
        """prev_tokens: [2 + mtp_drafts, max_rows] (step_programs.token_vector)."""
        return (2 + self.mtp_drafts, self.max_rows)

    def _zero_tokens(self) -> jax.Array:
        return jax.device_put(np.zeros(self.token_vector_shape, np.int32), self.replicated)

    def _sampled(self, out: StepResult) -> StepResult:
        self.prev_tokens = out.tokens
        return out

    def reset_sampling_state(self) -> None:
        """Zero the penalty history and the previous step's tokens (the pool is left as it is)."""
        self.penalties = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), self.replicated), self.penalties)
        self.prev_tokens = self._zero_tokens()

    def reset_device_state(self) -> None:
        """After a failed step the donated pool may be gone: start from an empty pool (callers recompute).
        A step that failed before it ran (an input refused, out of memory at its start) left the old
        pool alive: it is freed first, or a pool sized to most of the device's memory would be
        allocated twice, and every step after it would run out of memory (seen on one H100)."""
        for x in jax.tree.leaves((self.kv, self.penalties, self.prev_tokens)):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        self.kv = jax.tree.map(
            lambda s: jax.jit(lambda: jnp.zeros(s.shape, s.dtype), out_shardings=s.sharding)(), self.kv_abstract(self.layout)
        )
        self.penalties = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), self.replicated), self.penalties)
        self.prev_tokens = self._zero_tokens()
