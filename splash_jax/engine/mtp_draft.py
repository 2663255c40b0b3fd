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
program) and no hidden state crosses to the host.

Overlapped scheduling: the next step is scheduled and dispatched before this step's tokens and
drafts reach the host. A request that samples in this step gets, in the next, a verify chunk
whose drafts are codes naming its chain row here (MtpDrafter.propose_after,
speculative_inputs.device_draft_code); the next step program reads them from prev_tokens. If this
step's chunk verifies drafts, the next chunk is an ahead chunk (engine/spec_scheduling.py): it
moves on the device by the drafts this step keeps, b, and the draft program after it chains from
s + b + a. The host replaces the codes by the drafts when this step's tokens are applied
(MtpDrafter.record), before the next step's. Unlike n-gram drafts, MTP drafts do not lag
a step: the device computes them once it knows what the step kept.

Why a separate program, not fused into the step program: the sampled token of a step's last row
is the MTP layer's input there, and `full` steps (random draws, logprobs, penalties) sample in a
separate sampler program after the step, as grammar steps do later still; a fused pass would
need a second path for those. One draft program serves every step variant (greedy, full,
moving, deferred), the step programs stay as they were (plus one output), and the MTP pass is
one program for the whole chain.

What the program computes (for a step whose chunk of request r covers positions s..e-1):
  1. The acceptance of each verify chunk, as the host computes it (speculative.accepted):
     a = the leading rows whose sampled token equals their draft (0 for a plain sampling chunk).
  2. The MTP pass over every token slot of the step: at position q, hidden h_q (the main model's
     final hidden state, the LM head's input) and the embedding of token q+1, writing the MTP
     latent at q. Token q+1 is the next prompt (or known) token inside a chunk and for a prefill
     chunk's last position (the first token of its next chunk, known on the host), and the
     sampled token of the row for a sampling chunk's last row and for every row of a verify chunk.
     (For accepted positions of a verify chunk that is the next draft; rows past the first
     rejection write slots the next step writes again before any query reads them: kv_lens
     bound every read.) Every step of an engine started with MTP writes these latents, with
     speculation switched off, at the draft budget's level 0 or n-gram too: so every computed
     position, a cached prefix page's too, has its MTP latent when drafting resumes. When no
     drafts are wanted from a step (MtpDraftRunner.arm's keep) only the latents are written (the
     layer's input and latent projections and the write, mtp.mtp_latents): by the step program
     itself when it samples its own tokens (greedy and fused steps; StepShape.mtp_next packs each
     slot's next-token source with the step), so no draft program is launched, else by a
     latents-only variant of the draft program after the sampler program.
     Its head (norm, LM head, argmax) runs only at the last accepted position of each sampling
     chunk (s + a, or e - 1), one row per chain row: draft 1.
  3. Drafts 2..K chain the MTP layer on its own output hidden state and the previous draft, one
     row per chain row, at positions s+a+1, ... These chain latents are temporary: the next
     step's pass 1 writes those positions again. Their pages are addressed from a table of the
     2K positions after s that the host packs (`c_page`, `c_lens`), picked on the device once a
     is known; the scheduler gives requests pages for these positions when it can
     (MtpDrafter.lookahead), else the writes are dropped and only the drafts suffer.
Each draft is one LM-head product (the head is read K times a step, the floor for K dependent
drafts), and its argmax is taken per vocabulary shard (mtp.greedy_tokens): no float32 logits
are gathered. The chain's positions, rope rows and pages are computed for all its steps at once,
so each chain step is the embedding, the layer and the head. The chain is unrolled in the
program, not a lax.scan: on GPUs XLA launches a while loop's iterations from the host one at a
time (about 0.1 ms of host time per layer of a scanned step, engine/compile_options.py) unless it
unrolls the loop again; K - 1 copies of one layer cost compile time only (bundled model on CPU:
1.8 s vs 1.6 s scanned at K = 3, 4.2 s vs 2.2 s at K = 8).
Drafts are argmax of the MTP logits: a deterministic draft, which the verify step's rule (greedy
equality, or speculative sampling's accept-with-p(d)) keeps exact whatever it is. A request whose
drafts are missing (first step after admission or preemption, a step that skipped the draft
program) decodes one token that step and has drafts again after it.
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
from splash_jax.engine.speculative_inputs import row_shifts
from splash_jax.engine.step_packer import BufferSpec, Field, StepShape, next_tokens, split_step_buffer, unpack_step
from splash_jax.kv.cache import StepInput
from splash_jax.mesh.host_put import put
from splash_jax.mesh.layouts import AXIS, POOL_SPEC, Layout
from splash_jax.mtp import greedy_tokens, lm_head, mtp_latents, mtp_layer_output

log = logging.getLogger(__name__)

DROPPED = np.iinfo(np.int32).max  # a write page beyond the pool: the write is dropped


@dataclasses.dataclass(frozen=True)
class MtpShape:
    """The draft program's own buffers for one step shape and K drafts."""

    step: StepShape
    k: int

    @property
    def width(self) -> int:
        """Candidate positions per chain row: s + o for o < 3K. Chain j writes at s + b + a + j: a <= K
        the drafts the chunk kept, b <= K the shift of an ahead chunk (the drafts its verify chunk
        before it kept, known on the device only), j < K."""
        return 3 * self.k

    def replicated_spec(self) -> BufferSpec:
        t, c = self.step.total_tokens, self.step.rows
        return BufferSpec((
            Field("m_tokens", (t,), np.int32),  # token q+1 of each slot when the host knows it
            Field("m_src", (t,), np.int32),  # else the logits row whose sampled token it is (-1: m_tokens)
            Field("c_row0", (c,), np.int32),  # chain row: the chunk's first logits row (its verify rows' first)
            Field("c_k", (c,), np.int32),  # drafts the chunk verifies (0: a plain sampling chunk)
            Field("c_pos", (c,), np.int32),  # position of its first logits row
            Field("c_valid", (c,), np.int32),
        ))

    def device_spec(self) -> BufferSpec:
        g, c, w = self.step.segments, self.step.requests, self.width
        return BufferSpec((Field("c_page", (g, c, w), np.int32), Field("c_lens", (g, c, w), np.int32)))


def pack_mtp(mshape: MtpShape, chunks, packed, tables, page_size: int,
             chains: bool = True) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
    """-> (replicated [X], per-device [N, Y] buffers, the chain row of each sampling chunk in chunk order).
    chains=False (the latents-only program, which reads m_tokens and m_src only): no chain rows,
    and None for the per-device buffer (the host work of the page lookups is skipped)."""
    shape = mshape.step
    n, g, rq, w = shape.devices, shape.segments, shape.requests, mshape.width
    t_total, c_total = shape.total_tokens, shape.rows
    nrows = np.fromiter((c.num_rows for c in chunks), np.int64, len(chunks))
    last_row = np.cumsum(nrows) - 1
    m_tokens, m_src = next_tokens(chunks, packed.base, last_row, t_total)
    c_row0 = np.zeros(c_total, np.int32)
    c_k = np.zeros(c_total, np.int32)
    c_pos = np.zeros(c_total, np.int32)
    c_valid = np.zeros(c_total, np.int32)
    if chains:
        c_page = np.full((n, g, rq, w), DROPPED, np.int32)
        c_lens = np.zeros((n, g, rq, w), np.int32)
    chain_rows, chain = [], []  # chain: (chunk index, chain row, first position)
    for i, c in enumerate(chunks):
        if not (c.samples and chains):
            continue
        req, kc = c.request, len(c.drafts)
        row0 = int(last_row[i]) - kc
        lrow = int(packed.lrow[i])
        cr = req.owner * rq + lrow if shape.owner_rows else lrow
        c_row0[cr], c_k[cr], c_pos[cr], c_valid[cr] = row0, kc, c.end - 1 - kc, 1
        chain_rows.append(cr)
        chain.append((req.slot, lrow, c.end - 1 - kc, req.owner))
    if chain:
        slots, lrows, first, owners = (np.asarray(x, np.int64) for x in zip(*chain))
        if shape.owner_rows:  # each chain row on its owner only
            dev, slot, loc, start = owners, slots, lrows, first
        else:
            e = len(chain)
            dev = np.repeat(np.arange(n), e)
            slot, loc, start = np.tile(slots, n), np.tile(lrows, n), np.tile(first, n)
        pos = start[:, None] + np.arange(w)[None]  # [E, W]
        j = pos // page_size
        inside = j < tables.m
        jc = np.minimum(j, tables.m - 1)
        d2, s2 = dev[:, None], slot[:, None]
        for seg in range(g):
            local = tables.local_of[d2, seg, s2, jc]
            held = inside & (local >= 0)
            c_page[dev, seg, loc] = np.where(held, local, DROPPED)
            c_lens[dev, seg, loc] = np.where(inside, tables.before[d2, seg, s2, jc] * page_size
                                             + np.where(held, pos % page_size + 1, 0), 0)
    rep = mshape.replicated_spec().pack({"m_tokens": m_tokens, "m_src": m_src, "c_row0": c_row0, "c_k": c_k,
                                         "c_pos": c_pos, "c_valid": c_valid})
    dev_buf = mshape.device_spec().pack({"c_page": c_page, "c_lens": c_lens}, lead=(n,)) if chains else None
    return rep, dev_buf, chain_rows


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


class MtpDraftRunner:
    """The draft programs of one engine and the drafts in flight. Each draft program writes its
    drafts into the step's token vector, which becomes the executor's prev_tokens: the next step,
    scheduled before they reach the host (overlapped scheduling), reads them there
    (speculative_inputs.device_drafts). Device state stays the executor's: the pool is replaced through
    StepExecutor.apply_to_pool."""

    def __init__(self, executor, k: int, page_size: int, dtype):
        self.ex = executor
        self.k = k
        self.page_size = page_size
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
        rows, cq, owner_rows = shape.rows, shape.requests, shape.owner_rows

        def per_device(params, kv, hidden, prev, tokens, buf, mrep, mdev):
            # the step's input as the step read it (prev: the token vector before it), so ahead
            # chunks move and device-fed tokens and drafts resolve as they did in the step
            rep, dev = split_step_buffer(shape, buf[0])
            batch, sampling, _, _ = unpack_step(shape, rep, dev, prev)
            m = mshape.replicated_spec().unpack(mrep)
            d = mshape.device_spec().unpack(mdev[0])
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, list(params)))
            norm, head, vocab = model.mtp[0].norm, lm_head(model), model.cfg.vocab_size
            sampled = tokens[0, :rows]  # the tokens by row (entries past `rows` are not this program's)
            src = m["m_src"]
            nxt = jnp.where(src >= 0, sampled[jnp.clip(src, 0, rows - 1)], m["m_tokens"])
            if latents_only:
                return tokens, mtp_latents(model, kv, dataclasses.replace(batch, tokens=nxt, prefill_span=None), hidden, ctx)
            # 1. each verify chunk's accepted drafts, as speculative.accepted counts them: known
            #    before the MTP pass, so its head runs at each chain row's last accepted row only
            i = jnp.arange(k, dtype=jnp.int32)
            idx = jnp.clip(m["c_row0"][:, None] + i[None], 0, rows - 1)
            match = (sampled[idx] == sampling.draft[idx]) & (i[None] < m["c_k"][:, None])
            a = jnp.cumprod(match.astype(jnp.int32), axis=1).sum(axis=1)  # [C]
            at = batch.logits_index[jnp.clip(m["c_row0"] + a, 0, rows - 1)]  # token slot of position s + a
            # an ahead chunk's shift b (its positions moved on the device: speculative_inputs.shift_ahead)
            b = row_shifts(shape.replicated_spec().unpack(rep), prev)[jnp.clip(m["c_row0"], 0, rows - 1)] \
                if shape.variants else jnp.zeros_like(a)
            # 2. the MTP pass over every token slot (its latents; absorbed attention even for an
            #    expanded chunk), then the head at the C chain rows: draft 1
            x, kv = mtp_layer_output(model, kv, dataclasses.replace(batch, tokens=nxt, prefill_span=None), hidden, ctx)
            h = norm(x[at])
            token = greedy_tokens(h, head, vocab, AXIS)
            drafts = [token]
            if k == 1:
                return tokens.at[2, :rows].set(token), kv
            # 3. the chain: one row per chain row at positions s + a + j, j = 1..K-1. Everything
            #    but the layer and the head (positions, rope rows, write pages, key lengths) depends
            #    on `a` only: computed once for all chain steps, off the chain's dependent path.
            valid = m["c_valid"] > 0
            if owner_rows:
                mine = jax.lax.axis_index(AXIS) * cq + jnp.arange(cq, dtype=jnp.int32)
            else:
                mine = jnp.arange(cq, dtype=jnp.int32)
            offset = (b + a)[None] + jnp.arange(1, k, dtype=jnp.int32)[:, None]  # [K-1, C]
            pos = m["c_pos"][None] + offset
            cos_sin = model.rope_cos_sin(pos.reshape(-1)).reshape(k - 1, rows, -1)
            o = jnp.clip(offset[:, mine], 0, mshape.width - 1).T  # [cq, K-1]
            o = jnp.broadcast_to(o[None], d["c_page"].shape[:2] + (k - 1,))
            held = valid[mine][None, :, None]
            write_page = jnp.where(held, jnp.take_along_axis(d["c_page"], o, axis=2), DROPPED)  # [G, cq, K-1]
            kv_lens = jnp.where(held, jnp.take_along_axis(d["c_lens"], o, axis=2), 0)
            write_offset = pos[:, mine] % page_size
            local_rows, every_row = jnp.arange(cq, dtype=jnp.int32), jnp.arange(rows, dtype=jnp.int32)
            for j in range(k - 1):  # unrolled: see the module docstring
                chain = StepInput(token, pos[j], local_rows, write_page[..., j], write_offset[j], kv_lens[..., j],
                                  batch.page_table, every_row, None, valid)
                x, kv = mtp_layer_output(model, kv, chain, h, ctx, cos_sin=cos_sin[j])
                h = norm(x)
                token = greedy_tokens(h, head, vocab, AXIS)
                drafts.append(token)
            # the step's token vector with the drafts by chain row: the next step reads them there
            return tokens.at[2 : 2 + k, :rows].set(jnp.stack(drafts)), kv

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
        with self.ex.compile_stats.track("mtp_drafts") as rec:
            for lay, b, e, lo in todo:
                self._compiled[(lay.name, b, e, lo)] = self._compile(lay, b, e, lo)
            rec["programs"] = len(todo)
        self.ex.num_compiled += len(todo)
        self.ex.compile_seconds += rec["seconds"]
        log.info("compiled %d MTP draft programs in %.1fs", len(todo), rec["seconds"])
        return len(todo)

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
