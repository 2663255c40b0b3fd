"""MTP drafts (`--speculative-method mtp`): the checkpoint's multi-token-prediction layer
(splash_jax/mtp.py) drafts K tokens per decoding request, DeepSeek-V3/SGLang style (one MTP
layer chained K times), on the device right after each step.

One draft program per (layout, bucket) of the step programs, compiled ahead of time with them,
dispatched right after the step (after its sampler program for a `full` step) on device arrays
only: the step's final hidden states (the step program returns them when the engine runs MTP:
StepExecutor.mtp_hidden), the token vector it read and the one it returned (its sampled tokens),
the two packed buffers it already took, and two small buffers of its own (`pack_mtp`). It
donates the pool (the MTP layer's latents are at pool layer num_layers, in the requests' own
pages, so they move with them in every switch) and returns the step's token vector with the
drafts by chain row in rows 2.. (step_programs.token_vector), which becomes the executor's
prev_tokens and is read back with the step's tokens. So a step is 2 launches (3 with a sampler
program), or one for a greedy step with the pass inside (below), and no hidden state crosses to
the host.

Overlapped scheduling: the next step is scheduled and dispatched before this step's tokens and
drafts reach the host. A request that samples in this step gets, in the next, a verify chunk
whose drafts are codes naming its chain row here (MtpDrafter.propose_after,
speculative_inputs.device_draft_code); the next step program reads them from prev_tokens. If this
step's chunk verifies drafts, the next chunk is an ahead chunk (engine/spec_scheduling.py): it
moves on the device by the drafts this step keeps, b, and the draft program after it chains from
s + b + a. The host replaces the codes by the drafts when this step's tokens are applied
(MtpDrafter.record), before the next step's. Unlike n-gram drafts, MTP drafts do not lag
a step: the device computes them once it knows what the step kept.

Why a separate program by default: the sampled token of a step's last row is the MTP layer's
input there, and `full` steps (random draws, logprobs, penalties) sample in a separate sampler
program after the step, as grammar steps do later still. One draft program serves every step
variant (greedy, full, moving, deferred), and the step programs stay as they were (plus one
output). But a second launch a step costs host time, which sets the pace where steps are short
(small models, small batches): so a greedy step that wants drafts (not moving pages, not
expanded, in a bucket of at most --mtp-drafts-in-step-max-tokens) runs a step program with the
same pass inside instead (`drafts_in_step`); the other steps keep the draft program after them.

The pass itself (acceptance, the MTP pass over the step's slots, the K-draft chain) is
engine/mtp_pass.py's `draft_pass`.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from splash_jax.attention.layouts import ShardedContext
from splash_jax.engine.mtp_pass import MtpShape, draft_pass, pack_mtp
from splash_jax.engine.step_packer import split_step_buffer, unpack_step
from splash_jax.engine.step_programs import program_name
from splash_jax.mesh.host_put import put
from splash_jax.mesh.layouts import AXIS, POOL_SPEC, Layout

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Armed:
    """A dispatched step whose draft program waits for its sampled tokens (a deferred sampler)."""

    layout: Layout
    key: tuple
    hidden: jax.Array
    prev: jax.Array  # the token vector the step read
    inputs: list
    mrep: np.ndarray
    mdev: np.ndarray | None  # None for the latents-only program (it reads no chain pages)
    chunks: list
    chain_rows: list[int]
    keep: bool  # its drafts are wanted (MTP speculation on); else it runs for the MTP latents only
    mshape: MtpShape


@dataclasses.dataclass
class _Pending:
    chunks: list
    chain_rows: list[int]
    vector: jax.Array  # the step's token vector with the drafts: [2 + K, max_rows], drafts by chain row in rows 2..


@dataclasses.dataclass(frozen=True)
class _InlineDraft:
    """The draft pass as a part of a greedy step program (StepExecutor._program's `draft`): its two
    inputs (the pack_mtp buffers) follow the packed step buffer."""

    mshape: MtpShape
    page_size: int
    in_specs: tuple
    abstract_args: tuple

    def __call__(self, model, kv, ctx, batch, sampling, rep, prev, tokens, hidden, mrep, mdev):
        return draft_pass(model, kv, ctx, self.mshape, batch, sampling, rep, prev, tokens, hidden, mrep, mdev[0],
                          self.page_size)


class MtpDraftRunner:
    """The draft programs of one engine and the drafts in flight. Each draft program writes its
    drafts into the step's token vector, which becomes the executor's prev_tokens: the next step,
    scheduled before they reach the host (overlapped scheduling), reads them there
    (speculative_inputs.device_drafts). Device state stays the executor's: the pool is replaced through
    StepExecutor.apply_to_pool."""

    def __init__(self, executor, k: int, page_size: int, dtype, in_step_max_tokens: int = 0):
        self.ex = executor
        self.k = k
        self.page_size = page_size
        # Greedy steps of buckets up to this size that want drafts run a step program with the draft
        # pass inside (one launch a step, EngineConfig.mtp_drafts_in_step_max_tokens; 0: none);
        # other steps keep the draft program after them.
        self.in_step_max_tokens = in_step_max_tokens
        self._in_step: dict[tuple[str, object], object] = {}  # (layout, bucket) -> its step program with drafts
        self.num_in_step = 0  # steps whose drafts their own step program computed
        self._inline_rows: list[int] = []  # the chain rows of the step drafts_in_step packed
        self.hidden_dtype = jnp.dtype(dtype)  # the step programs' hidden states: the model's dtype
        self._compiled: dict[tuple[str, object, bool, bool], object] = {}
        self._armed: _Armed | None = None
        self._pending: list[_Pending] = []  # steps whose drafts are not read back yet, oldest first
        self._rows: dict = {}  # request -> its chain row in the last step armed (chain_row)
        self._shapes: dict[tuple, MtpShape] = {}  # (layout, bucket, expanded) -> its MtpShape
        self._no_chains: dict[MtpShape, jax.Array] = {}  # the per-device buffer the latents-only program is given
        self.num_dispatched = 0
        self.num_skipped = 0  # steps whose drafts were not computed (a layout hand-off before a deferred sampler)

    # --- programs ---------------------------------------------------------------------------
    def _program(self, layout: Layout, bucket, expanded: bool, latents_only: bool = False):
        """The draft program; latents_only: only the MTP pass's latent writes (mtp.mtp_latents), for
        a step whose drafts nobody will read (speculation at level 0, off or n-gram), which returns
        the step's token vector as it is."""
        ex, k, page_size = self.ex, self.k, self.page_size
        shape = ex.shape(layout, bucket, expanded)
        mshape = MtpShape(shape, k)
        layout = ex.program_layout(layout)
        ctx = ShardedContext(layout, ex.n, ex.impl)
        graphdef, treedef = ex.graphdef, ex.treedef

        def per_device(params, kv, hidden, prev, tokens, buf, mrep, mdev):
            # the step's input as the step read it (prev: the token vector before it), so ahead
            # chunks move and device-fed tokens and drafts resolve as they did in the step
            rep, dev = split_step_buffer(shape, buf[0])
            batch, sampling, _, _ = unpack_step(shape, rep, dev, prev)
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, list(params)))
            return draft_pass(model, kv, ctx, mshape, batch, sampling, rep, prev, tokens, hidden, mrep, mdev[0],
                              page_size, latents_only)

        param_specs_ = tuple(layout.param_spec(p) for p in ex.paths)
        kv_specs = jax.tree.map(lambda _: POOL_SPEC, ex.kv_abstract(layout))
        in_specs = (param_specs_, kv_specs, P(), P(), P(), P(AXIS), P(), P(AXIS))
        mapped = jax.shard_map(per_device, mesh=ex.mesh, in_specs=in_specs, out_specs=(P(), kv_specs), check_vma=False)
        to_device = ex.device_step_buffer  # the step's packed input (executor.draft_step_input)

        def program(params, kv, hidden, prev, tokens, buf, mrep, mdev):
            return mapped(params, kv, hidden, prev, tokens, to_device(buf), mrep, mdev)

        return jax.jit(program, donate_argnums=(1,)), shape, mshape

    def lower(self, layout: Layout, bucket, expanded: bool = False, latents_only: bool = False):
        ex = self.ex
        fn, shape, mshape = self._program(layout, bucket, expanded, latents_only)
        hidden_size = self._hidden_size()
        rep_sharding, dev_sharding = ex.replicated, ex.per_device
        args = (
            ex.param_abstract(layout), ex.kv_abstract(layout),
            jax.ShapeDtypeStruct((shape.total_tokens, hidden_size), self.hidden_dtype, sharding=rep_sharding),
            jax.ShapeDtypeStruct(ex.token_vector_shape, jnp.int32, sharding=rep_sharding),  # what the step read
            jax.ShapeDtypeStruct(ex.token_vector_shape, jnp.int32, sharding=rep_sharding),  # the step's tokens
            ex.step_input_abstract(shape),
            jax.ShapeDtypeStruct((mshape.replicated_spec().size,), jnp.int32, sharding=rep_sharding),
            jax.ShapeDtypeStruct((ex.n, mshape.device_spec().size), jnp.int32, sharding=dev_sharding),
        )
        return fn.lower(*args)

    def _compile(self, layout: Layout, bucket, expanded: bool, latents_only: bool = False):
        """With the step programs' XLA options (executor.compiler_options; none on CPU): on GPUs a
        CUDA graph that keeps only data dependencies, so the chain's small independent kernels
        run side by side, cuBLAS GEMMs and no rematerialization pass, as every step program."""
        return self.ex._compile(self.lower(layout, bucket, expanded, latents_only))

    def _hidden_size(self) -> int:
        for path, x in zip(self.ex.paths, self.ex.params):
            if path[0] == "embed":
                return int(x.shape[-1])
        raise ValueError("the model has no embedding table")

    def keys(self, layouts: list[Layout]) -> list[tuple]:
        """(layout, bucket, expanded, latents_only) of the draft programs after every step program
        these layouts run (moving variants share one): drafting and latents-only each."""
        ex = self.ex
        layouts = list(dict.fromkeys(ex.program_layout(l) for l in layouts))
        return [(lay, b, e, lo) for lay in layouts for b in ex.buckets(lay)
                for e in ((False, True) if ex.expands(lay, b) else (False,)) for lo in (False, True)]

    def compile_all(self, layouts: list[Layout]) -> int:
        todo = [key for key in self.keys(layouts) if (key[0].name, *key[1:]) not in self._compiled]
        in_step = [(lay, b) for lay, b in self.in_step_keys(layouts) if (lay.name, b) not in self._in_step]
        with self.ex.compile_stats.track("mtp_drafts") as rec:
            for lay, b, e, lo in todo:
                self._compiled[(lay.name, b, e, lo)] = self._compile(lay, b, e, lo)
            for lay, b in in_step:
                self._in_step[(lay.name, b)] = self._compile_in_step(lay, b)
            rec["programs"] = len(todo) + len(in_step)
        self.ex.num_compiled += rec["programs"]
        self.ex.compile_seconds += rec["seconds"]
        log.info("compiled %d MTP draft programs and %d step programs with drafts inside in %.1fs",
                 len(todo), len(in_step), rec["seconds"])
        return rec["programs"]

    # --- the draft pass inside greedy step programs -----------------------------------------
    def takes_in_step(self, bucket) -> bool:
        """Whether a greedy step of this bucket that wants drafts computes them in its own program."""
        return bucket.tokens <= self.in_step_max_tokens

    def in_step_keys(self, layouts: list[Layout]) -> list[tuple]:
        """(layout, bucket) of the step programs with drafts inside."""
        ex = self.ex
        layouts = list(dict.fromkeys(ex.program_layout(l) for l in layouts))
        return [(lay, b) for lay in layouts for b in ex.buckets(lay) if self.takes_in_step(b)]

    def _inline_draft(self, layout: Layout, bucket) -> _InlineDraft:
        ex = self.ex
        mshape = MtpShape(ex.shape(layout, bucket), self.k)
        return _InlineDraft(mshape, self.page_size, (P(), P(AXIS)), (
            jax.ShapeDtypeStruct((mshape.replicated_spec().size,), jnp.int32, sharding=ex.replicated),
            jax.ShapeDtypeStruct((ex.n, mshape.device_spec().size), jnp.int32, sharding=ex.per_device)))

    def _compile_in_step(self, layout: Layout, bucket):
        """A greedy step program of (layout, bucket) with the draft pass inside, compiled as the
        step programs are (their options, unrolled as theirs are)."""
        ex = self.ex
        lowered = ex.lower(layout, bucket, draft=self._inline_draft(layout, bucket))
        return ex._compile(lowered, False, ex.unrolled(bucket), program_name(layout, bucket, False, False, False, None) + "+drafts")

    def in_step_program(self, layout: Layout, bucket):
        layout = self.ex.program_layout(layout)
        key = (layout.name, bucket)
        program = self._in_step.get(key)
        if program is None:  # only without warm-up
            program = self._in_step[key] = self._compile_in_step(layout, bucket)
            self.ex.num_compiled += 1
        return program

    def drafts_in_step(self, bucket, packed, chunks, tables) -> tuple:
        """For executor.run's `inline`: the step program of this greedy step with the draft pass
        inside and its two inputs (pack_mtp's buffers). `drafted_in_step` follows its dispatch.
        The buffers go to the call as host arrays, which it moves to device memory in C++ (as a
        step's own input without pinned memory: StepExecutor.step_input's place=False), not by a
        put each."""
        mrep, mdev, chain_rows = pack_mtp(self._mshape(bucket, False), chunks, packed, tables, self.page_size)
        self._armed, self._inline_rows = None, chain_rows
        return self.in_step_program(self.ex.layout, bucket), [mrep, mdev]

    def drafted_in_step(self, chunks, tokens: jax.Array) -> None:
        """After a step dispatched with drafts_in_step's program: its token vector (the executor's
        prev_tokens now) holds the drafts, read back with its tokens (`take`)."""
        chain_rows = self._inline_rows
        sampling = [c.request for c in chunks if c.samples]
        self._rows = dict(zip(sampling, chain_rows))
        self._pending = self._pending[-1:] + [_Pending(chunks, chain_rows, tokens)]
        self.num_in_step += 1

    def compiled(self, layout: Layout, bucket, expanded: bool, latents_only: bool = False):
        layout = self.ex.program_layout(layout)
        key = (layout.name, bucket, expanded, latents_only)
        program = self._compiled.get(key)
        if program is None:  # only without warm-up
            program = self._compiled[key] = self._compile(layout, bucket, expanded, latents_only)
            self.ex.num_compiled += 1
        return program

    # --- running ----------------------------------------------------------------------------
    def arm(self, bucket, expanded: bool, packed, chunks, tables, keep: bool = True) -> None:
        """After the step program of these chunks was dispatched (executor.run): pack the draft
        program's buffers and keep the step's device outputs until its tokens exist (`fire`).
        keep=False (no drafts wanted from this step: speculation off, n-gram, or the draft budget
        at level 0): its latents-only program runs instead, so every position computed still gets
        its MTP latent (a request or a cached page drafts from them later) at a fraction of the
        cost (no attention read, MoE, head or chain), and the next step gets no MTP drafts."""
        ex = self.ex
        mshape = self._mshape(bucket, expanded)
        mrep, mdev, chain_rows = pack_mtp(mshape, chunks, packed, tables, self.page_size, chains=keep)
        self._armed = _Armed(ex.layout, (bucket, expanded), ex.step_hidden, ex.step_prev_tokens, [ex.draft_step_input()],
                             mrep, mdev, chunks, chain_rows, keep, mshape)
        sampling = [c.request for c in chunks if c.samples]
        self._rows = dict(zip(sampling, chain_rows)) if keep else {}

    def _mshape(self, bucket, expanded: bool) -> MtpShape:
        """The MtpShape of this bucket in the current layout (one per key: built once)."""
        key = (self.ex.layout.name, bucket, expanded)
        mshape = self._shapes.get(key)
        if mshape is None:
            mshape = self._shapes[key] = MtpShape(self.ex.shape(self.ex.layout, bucket, expanded), self.k)
        return mshape

    def _device_buffer(self, armed: _Armed) -> jax.Array:
        """The armed step's per-device buffer on the device; for the latents-only program, which
        reads none of it, one zero buffer per shape kept on the device (no transfer per step)."""
        if armed.mdev is not None:
            return put(armed.mdev, self.ex.per_device)
        buf = self._no_chains.get(armed.mshape)
        if buf is None:
            size = armed.mshape.device_spec().size
            buf = self._no_chains[armed.mshape] = jax.device_put(np.zeros((self.ex.n, size), np.int32), self.ex.per_device)
        return buf

    def chain_row(self, request) -> int | None:
        """The chain row of `request` in the last step dispatched, whose draft program leaves its
        drafts on the device for the next step (device_draft_code); None if it has none there or
        they will not be computed (a layout hand-off came between that step and its deferred
        sampler: fire skips its draft program)."""
        armed = self._armed
        if armed is not None and armed.layout is not self.ex.layout:
            return None
        return self._rows.get(request)

    def skip(self) -> None:
        """A step with no draft program: no drafts wanted from it, and its step program, which
        sampled its own tokens, wrote its MTP latents (executor._program, StepShape.mtp_next)."""
        self._armed, self._rows = None, {}

    def fire(self, tokens: jax.Array) -> None:
        """Dispatch the armed step's draft program on its sampled tokens (device array). A layout
        hand-off since the step was dispatched (possible only for a deferred sampler) moved the
        pages its buffers name: then no drafts for that step."""
        armed, self._armed = self._armed, None
        if armed is None:
            return
        ex = self.ex
        if ex.layout is not armed.layout:
            self.num_skipped += 1
            self._rows = {}
            return
        program = self.compiled(armed.layout, *armed.key, latents_only=not armed.keep)
        mrep = put(armed.mrep, ex.replicated)
        mdev = self._device_buffer(armed)
        vector = None

        def run(kv):
            nonlocal vector
            vector, kv = program(tuple(ex.params), kv, armed.hidden, armed.prev, tokens, *armed.inputs, mrep, mdev)
            return kv

        ex.apply_to_pool(run)
        ex.prev_tokens = vector  # the step's tokens and counts, with its drafts
        self.num_dispatched += 1
        if armed.keep:
            vector.copy_to_host_async()
            self._pending = self._pending[-1:] + [_Pending(armed.chunks, armed.chain_rows, vector)]

    def take(self, chunks) -> list[tuple[object, np.ndarray]] | None:
        """The drafts of the step of these chunks, once its tokens are applied: (request, drafts [K])
        per sampling chunk, or None if that step has none."""
        for i, pending in enumerate(self._pending):
            if pending.chunks is chunks:
                del self._pending[: i + 1]
                break
        else:
            return None
        drafts = np.asarray(pending.vector)[2:]
        sampling = [c for c in chunks if c.samples]
        return [(c.request, drafts[:, row]) for c, row in zip(sampling, pending.chain_rows)]

    def drop(self) -> None:
        """Forget what is armed and in flight (a failed step: the pool is gone)."""
        self._armed, self._pending, self._rows = None, [], {}
