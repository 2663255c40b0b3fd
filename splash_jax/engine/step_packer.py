"""The one step packer: scheduled chunks -> two int32 buffers a step program unpacks on device.

N = 1 is the degenerate case of N devices, and every layout packs through the same code:
  replicated buffer  [X]     tokens, positions, src_row (device-fed tokens), token_slot,
                             prompt_len, logits_index, and every SamplingInputs field
  per-device buffer  [N, Y]  token_request, write_offset, write_page [G, Tq], kv_lens [G, Tq],
                             page_table [G, Rq, M] with page ids local to the device's pool
One transfer each per step (floats travel bit-cast), instead of a dozen small copies.

Token slots: layouts with owner rows lay tokens out device-major (device d's requests fill
segment d of Tq slots, page-table rows 0.. of device d); the others put every token in every
device's view. Sampled rows are in chunk order for every layout (logits are replicated).
Page facts come from the scheduler's persistent PageTables, gathered by slot (no per-request
Python work beyond reading a few integers). A token whose value is still on the device (sampled
by the previous step, overlapped scheduling) gets src_row >= 0: the program reads it from the
previous step's sampled tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from splash_jax.attention.expanded import DEFAULT_SPANS, span_capacities, worth_expanding
from splash_jax.engine.speculative_inputs import device_drafts, pack_ahead, shift_ahead
from splash_jax.engine.admission import leader_chunk
from splash_jax.engine.sampler import SamplerWidths, SamplingInputs
from splash_jax.kv.cache import StepInput
from splash_jax.kv.page_table import PageTables


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """Named fixed-shape fields laid end to end in one int32 buffer (4-byte dtypes only)."""

    fields: tuple[Field, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.fields)

    def pack(self, arrays: dict[str, np.ndarray], lead: tuple[int, ...] = ()) -> np.ndarray:
        parts = [np.ascontiguousarray(arrays[f.name], f.dtype).view(np.int32).reshape(lead + (-1,)) for f in self.fields]
        return np.concatenate(parts, axis=-1)

    def offset(self, name: str) -> int:
        """Where field `name` starts in the buffer (host-side patches of a packed step)."""
        return self._offsets[name]

    @functools.cached_property
    def _offsets(self) -> dict[str, int]:
        starts = itertools.accumulate((f.size for f in self.fields), initial=0)
        return {f.name: at for f, at in zip(self.fields, starts)}

    def unpack(self, buf: jax.Array) -> dict[str, jax.Array]:
        """Inside a program: static slices of a 1-D int32 buffer, bit-cast back to each dtype."""
        out, at = {}, 0
        for f in self.fields:
            x = buf[at : at + f.size].reshape(f.shape)
            if f.dtype != np.int32:
                x = x.view(f.dtype) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, jnp.dtype(f.dtype))
            out[f.name], at = x, at + f.size
        return out


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Shapes of one compiled step: per query-device tokens/requests, devices, segments, pages."""

    tokens: int  # Tq: token slots per query device
    requests: int  # Rq: request rows per query device
    devices: int
    segments: int
    pages: int  # M: page-table width (pages a request may hold on one device)
    owner_rows: bool
    widths: SamplerWidths
    expanded: bool = False  # the program runs up to `spans` prefill chunks per device in the expanded form
    spans: int = DEFAULT_SPANS  # rows of an expanded program's prefill_span (EngineConfig.expanded_prefill_spans)
    # Draft variants of a verify chunk scheduled behind another still on the device (1 + K, one
    # per count the earlier chunk may keep; 0: none) and the pool's page size they address with.
    variants: int = 0
    page_size: int = 0
    # The engine runs an MTP layer: the step carries each token slot's next token (next_tokens) and
    # a step that samples its own tokens writes the MTP latents itself (executor._program)
    mtp_next: bool = False

    @property
    def total_tokens(self) -> int:
        return self.devices * self.tokens if self.owner_rows else self.tokens

    @property
    def rows(self) -> int:
        return self.devices * self.requests if self.owner_rows else self.requests

    def replicated_spec(self) -> BufferSpec:
        return _replicated_spec(self)  # (built once per shape: packing asks every step)

    def device_spec(self) -> BufferSpec:
        return _device_spec(self)


@functools.cache
def _replicated_spec(shape: StepShape) -> BufferSpec:
    t, r = shape.total_tokens, shape.rows
    sampling = SamplingInputs.host(r, shape.widths)
    fields = [Field(n, (t,), np.int32) for n in ("tokens", "positions", "src_row", "token_slot", "prompt_len")]
    fields.append(Field("logits_index", (r,), np.int32))
    for f in dataclasses.fields(SamplingInputs):
        a = getattr(sampling, f.name)
        fields.append(Field("s_" + f.name, a.shape, a.dtype))
    if shape.variants:  # ahead verify chunks (pack_ahead): each token's logits row, each row's shift
        fields += [Field("tok_row", (t,), np.int32), Field("row_shift", (r,), np.int32),
                   Field("var_draft", (shape.variants, r), np.int32)]
    if shape.mtp_next:  # next_tokens
        fields += [Field("m_tokens", (t,), np.int32), Field("m_src", (t,), np.int32)]
    return BufferSpec(tuple(fields))


def next_tokens(chunks: Sequence, base: np.ndarray, last_row: np.ndarray, t_total: int) -> tuple[np.ndarray, np.ndarray]:
    """Token q+1 of every token slot q, the MTP layer's input there (mtp_draft's module docstring):
    (m_tokens, m_src) [t_total] int32, the token where the host knows it (the next prompt or known
    token, also past a prefill chunk's end), else in m_src the logits row whose sampled token it is
    (-1: m_tokens): a sampling chunk's last slot, and every slot of a verify chunk. base: each
    chunk's first slot; last_row: each chunk's last logits row."""
    m_tokens = np.zeros(t_total, np.int32)
    m_src = np.full(t_total, -1, np.int32)
    for i, c in enumerate(chunks):
        req, b, length = c.request, int(base[i]), c.num_slots
        if not length:
            continue
        kc = len(c.drafts)
        if kc:  # a verify chunk: every row's next token is the token sampled there
            row0 = int(last_row[i]) - kc
            m_src[b : b + length] = np.arange(row0, row0 + length)
        else:
            nxt = req.token_slice(c.start + 1, min(c.end + 1, req.num_known))
            m_tokens[b : b + len(nxt)] = nxt
            if c.samples:
                m_src[b + length - 1] = int(last_row[i])
    return m_tokens, m_src


@functools.cache
def _device_spec(shape: StepShape) -> BufferSpec:
    t, g = shape.tokens, shape.segments
    return BufferSpec((
        Field("token_request", (t,), np.int32), Field("write_offset", (t,), np.int32),
        Field("write_page", (g, t), np.int32), Field("kv_lens", (g, t), np.int32),
        Field("page_table", (g, shape.requests, shape.pages), np.int32),
    ) + ((Field("prefill_span", (shape.spans, 2), np.int32),) if shape.expanded else ())
      + ((Field("var_page", (g, 2, shape.rows), np.int32), Field("var_before", (g, 2, shape.rows), np.int32))
         if shape.variants else ()))


def offsets_in_runs(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each run of c items, concatenated ([2, 3] -> [0, 1, 0, 1, 2])."""
    counts = np.asarray(counts, np.int64)
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def step_buffer(rep: np.ndarray, dev: np.ndarray) -> np.ndarray:
    """A step's packed buffers as the one [N, R + D] int32 buffer the step program takes: row i is
    the replicated part followed by device i's. One transfer per step instead of two (each costs
    the host ~0.2 ms on a GPU), and one buffer to place in pinned host memory (executor.step_input)."""
    return np.concatenate([np.broadcast_to(rep, (dev.shape[0], rep.shape[0])), dev], axis=1)


def split_step_buffer(shape: StepShape, row: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inside the step program (per device): this device's [R + D] row -> (rep, dev) as packed."""
    r = shape.replicated_spec().size
    return row[:r], row[r:]


def unpack_step(shape: StepShape, rep: jax.Array, dev: jax.Array, prev_tokens: jax.Array):
    """Inside the step program (per device): -> (StepInput, SamplingInputs, token_slot, prompt_len)."""
    r = shape.replicated_spec().unpack(rep)
    d = shape.device_spec().unpack(dev)
    sampling = SamplingInputs(**{f.name: r["s_" + f.name] for f in dataclasses.fields(SamplingInputs)})
    if shape.variants:
        r, d, sampling = shift_ahead(shape, r, d, sampling, prev_tokens)
    src = r["src_row"]
    tokens = jnp.where(src >= 0, prev_tokens[0, jnp.clip(src, 0, prev_tokens.shape[1] - 1)], r["tokens"])
    if prev_tokens.shape[0] > 2:  # MTP drafts the previous step's draft program left on the device
        tokens = device_drafts(tokens, prev_tokens)
        sampling = dataclasses.replace(sampling, draft=device_drafts(sampling.draft, prev_tokens))
    batch = StepInput(
        tokens, r["positions"], d["token_request"], d["write_page"], d["write_offset"], d["kv_lens"],
        d["page_table"], r["logits_index"], d.get("prefill_span"), r["token_slot"] >= 0,
    )
    return batch, sampling, r["token_slot"], r["prompt_len"]


def host_step_input(shape: StepShape, packed: "PackedStep") -> StepInput:
    """The packed buffers as a numpy StepInput with [N, ...] per-device fields (tests, benchmarks;
    tokens fed from the device are not resolved here)."""
    r = shape.replicated_spec().unpack(packed.rep)
    per = [shape.device_spec().unpack(row) for row in packed.dev]
    d = {k: np.stack([p[k] for p in per]) for k in per[0]}
    return StepInput(r["tokens"], r["positions"], d["token_request"], d["write_page"], d["write_offset"],
                     d["kv_lens"], d["page_table"], r["logits_index"], d.get("prefill_span"))


class SlotSampling:
    """Per-slot sampling rows, written once when a request takes a slot and gathered every step.

    Consecutive decode steps gather the same slots into the same rows, so `gather` keeps its last
    gather and only copies it while neither the mapping nor the table changed (the 15 fields'
    allocation and fancy indexing were a third of pack_step's host time at batch 1). `assign` is
    the only writer of `table`."""

    def __init__(self, num_slots: int, widths: SamplerWidths, eos_ids: Sequence[int]):
        self.table = SamplingInputs.host(num_slots, widths)
        self.min_tokens = np.zeros(num_slots, np.int64)
        self.eos_ids = tuple(eos_ids)
        self._version = 0  # bumped by every assign
        self._last: tuple[tuple, SamplingInputs] | None = None  # (key, gathered rows before step/suppress)

    def assign(self, slot: int, params, seed: int) -> None:
        self.table.set_row(slot, params, seed, 0, slot, self.eos_ids)
        self.min_tokens[slot] = params.min_tokens
        self._version += 1

    def gather(self, num_rows: int, widths: SamplerWidths, rows: np.ndarray, slots: np.ndarray,
               generated: np.ndarray) -> SamplingInputs:
        """A step's SamplingInputs of num_rows rows: row rows[i] is slot slots[i]'s at output
        position generated[i]; the other rows neutral. The caller owns (and may write) the result."""
        key = (num_rows, widths, self._version, rows.tobytes(), slots.tobytes())
        if self._last is None or self._last[0] != key:
            base = SamplingInputs.host(num_rows, widths)
            self._copy_rows(base, rows, slots)
            self._last = (key, base)
        base = self._last[1]
        out = SamplingInputs(*(getattr(base, f.name).copy() for f in dataclasses.fields(SamplingInputs)))
        self._set_position(out, rows, slots, generated)
        return out

    def _copy_rows(self, out: SamplingInputs, rows: np.ndarray, slots: np.ndarray) -> None:
        for f in dataclasses.fields(SamplingInputs):
            getattr(out, f.name)[rows] = getattr(self.table, f.name)[slots]

    def _set_position(self, out: SamplingInputs, rows: np.ndarray, slots: np.ndarray, generated: np.ndarray) -> None:
        """What depends on the output position: the step, and no suppressed ids once min_tokens is met."""
        out.step[rows] = generated
        out.suppress_ids[rows[generated >= self.min_tokens[slots]]] = -1


@dataclasses.dataclass
class PackedStep:
    rep: np.ndarray  # [X] int32
    dev: np.ndarray  # [N, Y] int32
    rows: list[int]  # output row of each sampling chunk, in chunk order
    prompt_rows: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (chunk, first row, count): prompt logprobs
    base: np.ndarray | None = None  # [chunks] the step slot of each chunk's first token
    lrow: np.ndarray | None = None  # [chunks] each chunk's page-table row on its devices
    last_rows: np.ndarray | None = None  # [chunks] each chunk's last logits row (engine/late_drafts.py)


def pack_step(
    shape: StepShape, chunks: Sequence, tables: PageTables, slot_sampling: SlotSampling, page_size: int,
    all_logits: bool = False, span_min_tokens: int = 1,
) -> PackedStep:
    """Pack scheduled chunks (scheduler.ScheduledChunk) into one step's buffers.

    all_logits: every token slot gets a logits row (the reference runner's prefill checks).
    span_min_tokens: with shape.expanded, each device's shape.spans chunks with the most query-key
    pairs among those worth expanding (attention/expanded.worth_expanding) become its prefill_span
    rows (prefill_spans); the rest run absorbed.
    """
    n, tq, rq, g = shape.devices, shape.tokens, shape.requests, shape.segments
    num = len(chunks)
    lengths = np.fromiter((c.num_slots for c in chunks), np.int64, num)  # a follower's last token: none
    starts = np.fromiter((c.start for c in chunks), np.int64, num)
    owners = np.fromiter((c.request.owner for c in chunks), np.int64, num)
    slots = np.fromiter((c.request.slot for c in chunks), np.int64, num)

    # Slots in the step: device-major segments for owner rows, one sequence otherwise.
    if shape.owner_rows:
        order = np.argsort(owners, kind="stable")
        lrow = np.zeros(num, np.int64)
        lslot = np.zeros(num, np.int64)
        for d in range(n):
            mine = order[owners[order] == d]
            lrow[mine] = np.arange(len(mine))
            lslot[mine] = np.concatenate([[0], np.cumsum(lengths[mine])[:-1]]) if len(mine) else []
        if num and ((lrow.max() >= rq) or np.max(lslot + lengths) > tq):
            raise ValueError(f"a device overflows its bucket ({tq} tokens, {rq} requests)")
        base = owners * tq + lslot
    else:
        if lengths.sum() > tq or num > rq:
            raise ValueError(f"step overflows its bucket ({tq} tokens, {rq} requests)")
        lrow = np.arange(num)
        lslot = base = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if num else np.zeros(0, np.int64)
    # Logits rows in chunk order: one per chunk (its last position), or one per position from
    # lp_start for a chunk that returns prompt logprobs.
    nrows = np.fromiter((c.num_rows for c in chunks), np.int64, num)
    row = np.cumsum(nrows) - 1 if num else np.zeros(0, np.int64)  # each chunk's last (sampling) row
    if num and row[-1] >= shape.rows:
        raise ValueError(f"step needs {row[-1] + 1} logits rows; its bucket has {shape.rows}")

    chunk_of = np.repeat(np.arange(num), lengths)
    offset = offsets_in_runs(lengths)
    pos = starts[chunk_of] + offset
    gslot = base[chunk_of] + offset  # slot in the step's token arrays
    t_total, rows_total = shape.total_tokens, shape.rows

    tokens = np.zeros(t_total, np.int32)
    src_row = np.full(t_total, -1, np.int32)
    followers = []  # chunks of a follower's last token: no slot, their leader's (ScheduledChunk.num_slots)
    if num:
        values, sources = [], []
        for i, c in enumerate(chunks):
            req = c.request
            if not lengths[i]:
                followers.append(i)
                continue
            known = min(c.end, req.num_known)
            if c.drafts or c.shift_k:  # a verify chunk: its last token (known, or sampled by the step before), then the drafts
                fed = c.start >= req.num_known
                values.append(([0] if fed else req.token_slice(c.start, c.start + 1)) + list(c.drafts))
                sources.append([req.pending_row - c.shift_k if fed else -1] + [-1] * len(c.drafts))
                continue
            vals = req.token_slice(c.start, known)
            pad = c.end - max(known, c.start)  # positions whose token is still on the device
            values.append(vals + [0] * pad)
            sources.append([-1] * len(vals) + [req.pending_row] * pad)
        if values:
            tokens[gslot] = np.concatenate(values)
            src_row[gslot] = np.concatenate(sources)
    positions = np.zeros(t_total, np.int32)
    positions[gslot] = pos
    token_slot = np.full(t_total, -1, np.int32)
    token_slot[gslot] = slots[chunk_of]
    prompt_len = np.zeros(t_total, np.int32)
    prompt_len[gslot] = np.fromiter((len(c.request.prompt_ids) for c in chunks), np.int64, num)[chunk_of]
    logits_index = np.zeros(rows_total, np.int32)
    samples = np.fromiter((c.samples for c in chunks), bool, num)
    generated = np.fromiter((c.request.num_generated - c.samples for c in chunks), np.int64, num)
    verify = [i for i, c in enumerate(chunks) if c.drafts]
    if verify:  # verify rows, all at once: row j of a chunk of k drafts draws output token j
        vi = np.asarray(verify)
        counts = nrows[vi]  # k + 1
        of, at = np.repeat(vi, counts), offsets_in_runs(counts)  # each verify row's chunk, its index in it
        k_of = np.repeat(counts - 1, counts)
        vrows = row[of] - k_of + at
        plain = np.ones(num, bool)
        plain[vi] = False
        # one gather for the plain chunks' rows and the verify rows (its cache holds while the
        # step's layout of rows repeats, as it does from one decode step to the next)
        sampling = slot_sampling.gather(rows_total, shape.widths, np.concatenate([row[plain], vrows]),
                                        np.concatenate([slots[plain], slots[of]]),
                                        np.concatenate([generated[plain], generated[of] + at]))
        sampling.draft[vrows[at < k_of]] = np.concatenate([chunks[i].drafts for i in verify])
    else:
        sampling = slot_sampling.gather(rows_total, shape.widths, row, slots, generated)
    prompt_rows = []
    if all_logits:
        logits_index[: len(gslot)] = gslot
    else:
        logits_index[row] = base + lengths - 1
        for i in followers:  # a follower's last token: its leader's slot at that position
            c = chunks[i]
            j = leader_chunk(chunks, c.leader, c.start)
            if j is None:
                raise ValueError(f"request {c.request.request_id}: its leader computes none of its prompt in this step")
            logits_index[row[i]] = base[j] + c.start - chunks[j].start
        if verify:
            logits_index[vrows] = base[of] + at
        lp_start = np.fromiter((c.lp_start for c in chunks), np.int64, num)
        for i in np.flatnonzero(lp_start >= 0):  # prompt logprobs: row r of position p scores prompt token p + 1
            c = chunks[i]
            first = row[i] - nrows[i] + 1
            logits_index[first : row[i] + 1] = base[i] + (c.lp_start - c.start) + np.arange(nrows[i])
            prompt = c.request.prompt_ids
            count = max(0, min(c.end, len(prompt) - 1) - c.lp_start)  # positions <= P - 2
            sampling.target[first : first + count] = prompt[c.lp_start + 1 : c.lp_start + 1 + count]
            prompt_rows.append((i, int(first), count))

    # Per-device fields from the persistent page tables.
    if shape.owner_rows:
        dev_of, tok = owners[chunk_of], np.arange(len(chunk_of))  # each token on its owner only
    else:
        dev_of = np.repeat(np.arange(n), len(chunk_of))
        tok = np.tile(np.arange(len(chunk_of)), n)
    c_of = chunk_of[tok]
    s_of, p_of, ls_of = slots[c_of], pos[tok], lslot[c_of] + offset[tok]
    j = p_of // page_size
    token_request = np.zeros((n, tq), np.int32)
    write_offset = np.zeros((n, tq), np.int32)
    write_page = np.full((n, g, tq), np.iinfo(np.int32).max, np.int32)  # beyond the pool: dropped
    kv_lens = np.zeros((n, g, tq), np.int32)
    page_table = np.zeros((n, g, rq, shape.pages), np.int32)
    token_request[dev_of, ls_of] = lrow[c_of]
    write_offset[dev_of, ls_of] = p_of % page_size
    m = min(shape.pages, tables.m)
    writes = np.fromiter((c.writes for c in chunks), bool, num)  # a follower's last token (its leader writes it), a cached one
    for seg in range(g):
        local = tables.local_of[dev_of, seg, s_of, j]
        held = local >= 0
        write_page[dev_of, seg, ls_of] = np.where(held & writes[c_of], local, np.iinfo(np.int32).max)
        kv_lens[dev_of, seg, ls_of] = tables.before[dev_of, seg, s_of, j] * page_size + np.where(held, p_of % page_size + 1, 0)
        if shape.owner_rows:
            page_table[owners, seg, lrow, :m] = tables.compact[owners, seg, slots, :m]
        else:
            for d in range(n):
                page_table[d, seg, lrow, :m] = tables.compact[d, seg, slots, :m]

    per_device = {"token_request": token_request, "write_offset": write_offset, "write_page": write_page,
                  "kv_lens": kv_lens, "page_table": page_table}
    ahead = {}
    if shape.variants:
        ahead, var_pages = pack_ahead(shape, chunks, tables, row, nrows, base, owners)
        per_device.update(var_pages)
    if shape.expanded:
        # A chunk that writes no latent (its token's is already in a shared page) stays absorbed:
        # the expanded form takes a chunk's own keys from the step, not the pool.
        per_device["prefill_span"] = prefill_spans(n, np.where(writes, lengths, 0), starts, lslot,
                                                   owners if shape.owner_rows else None, span_min_tokens, shape.spans, tq)
    if shape.mtp_next:
        ahead["m_tokens"], ahead["m_src"] = next_tokens(chunks, base, row, t_total)
    rep = shape.replicated_spec().pack({
        "tokens": tokens, "positions": positions, "src_row": src_row, "token_slot": token_slot,
        "prompt_len": prompt_len, "logits_index": logits_index,
        **{"s_" + f.name: getattr(sampling, f.name) for f in dataclasses.fields(SamplingInputs)}, **ahead,
    })
    dev = shape.device_spec().pack(per_device, lead=(n,))
    return PackedStep(rep, dev, row[samples].tolist(), prompt_rows, base, lrow, row)


def prefill_spans(n: int, lengths: np.ndarray, starts: np.ndarray, lslot: np.ndarray, owners: np.ndarray | None,
                  min_tokens: int, spans: int = DEFAULT_SPANS, tokens: int | None = None) -> np.ndarray:
    """[N, spans, 2] (first slot, length) of each device's chunks worth expanding: the `spans` with
    the most query-key pairs, longest first (the capacity of a span row, attention/expanded.
    span_capacities, holds the i-th longest of disjoint chunks), then (0, 0) rows. owners None:
    every device sees every chunk (tp, cp); else a chunk is on its owner only. tokens: the step's
    slots per device (checks the capacities)."""
    out = np.zeros((n, spans, 2), np.int32)
    pairs = lengths * (starts + lengths)
    ok = worth_expanding(lengths, starts + lengths, min_tokens)
    caps = span_capacities(tokens, spans) if tokens else None
    for d in range(n):
        mine = np.flatnonzero(ok & (True if owners is None else owners == d))
        best = mine[np.argsort(-pairs[mine], kind="stable")[:spans]]
        best = best[np.argsort(-lengths[best], kind="stable")]
        if caps is not None and np.any(lengths[best] > caps[: len(best)]):
            raise ValueError(f"chunks of {lengths[best].tolist()} tokens overlap in {tokens} slots")
        out[d, : len(best)] = np.stack([lslot[best], lengths[best]], axis=-1)
    return out
