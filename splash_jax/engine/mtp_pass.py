"""The MTP draft pass on the device (`draft_pass`) and the host's buffers for it (`MtpShape`,
`pack_mtp`): what runs after a step's sampling, in the draft program after the step
(engine/mtp_draft.py) or inside a greedy step program (--mtp-drafts-in-step-max-tokens).

What the pass computes (for a step whose chunk of request r covers positions s..e-1):
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

import jax
import jax.numpy as jnp
import numpy as np

from splash_jax.engine.speculative_inputs import row_shifts
from splash_jax.engine.step_packer import BufferSpec, Field, StepShape
from splash_jax.kv.cache import StepInput
from splash_jax.mesh.layouts import AXIS
from splash_jax.mtp import greedy_tokens, lm_head, mtp_latents, mtp_layer_output

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
        c = self.step.rows
        return BufferSpec((
            Field("c_row0", (c,), np.int32),  # chain row: the chunk's first logits row (its verify rows' first)
            Field("c_k", (c,), np.int32),  # drafts the chunk verifies (0: a plain sampling chunk)
            Field("c_pos", (c,), np.int32),  # position of its first logits row
            Field("c_valid", (c,), np.int32),
        ))

    def device_spec(self) -> BufferSpec:
        g, c, w = self.step.segments, self.step.requests, self.width
        return BufferSpec((Field("c_page", (g, c, w), np.int32), Field("c_lens", (g, c, w), np.int32)))


def slot_next_tokens(shape: StepShape, rep, sampled):
    """Inside a step's program: token q+1 of every token slot q, the MTP layer's input there, from
    the step's replicated buffer (StepShape.mtp_next: step_packer.next_tokens) and its sampled
    tokens by row."""
    m = shape.replicated_spec().unpack(rep)
    return jnp.where(m["m_src"] >= 0, sampled[jnp.clip(m["m_src"], 0, shape.rows - 1)], m["m_tokens"])


def pack_mtp(mshape: MtpShape, chunks, packed, tables, page_size: int,
             chains: bool = True) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
    """-> (replicated [X], per-device [N, Y] buffers, the chain row of each sampling chunk in chunk order).
    chains=False (the latents-only program, which reads only the step's own next-token fields): no
    chain rows, and None for the per-device buffer (the host work of the page lookups is skipped).
    Each slot's next token is not packed here: the step's buffer carries it (StepShape.mtp_next)."""
    shape = mshape.step
    n, g, rq, w = shape.devices, shape.segments, shape.requests, mshape.width
    c_total = shape.rows
    c_row0 = np.zeros(c_total, np.int32)
    c_k = np.zeros(c_total, np.int32)
    c_pos = np.zeros(c_total, np.int32)
    c_valid = np.zeros(c_total, np.int32)
    chain_rows: list[int] = []
    idx = [i for i, c in enumerate(chunks) if c.samples] if chains else []  # one chain row per sampling chunk
    if chains:
        c_page = np.full((n, g, rq, w), DROPPED, np.int32)
        c_lens = np.zeros((n, g, rq, w), np.int32)
    if idx:
        e = len(idx)
        kc = np.fromiter((len(chunks[i].drafts) for i in idx), np.int64, e)
        first = np.fromiter((chunks[i].end for i in idx), np.int64, e) - 1 - kc  # position of its first logits row
        slots = np.fromiter((chunks[i].request.slot for i in idx), np.int64, e)
        owners = np.fromiter((chunks[i].request.owner for i in idx), np.int64, e)
        lrows = packed.lrow[idx].astype(np.int64)
        cr = owners * rq + lrows if shape.owner_rows else lrows
        c_row0[cr], c_k[cr], c_pos[cr], c_valid[cr] = packed.last_rows[idx] - kc, kc, first, 1
        chain_rows = cr.tolist()
        if shape.owner_rows:  # each chain row on its owner only
            dev, slot, loc, start = owners, slots, lrows, first
        else:
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
    rep = mshape.replicated_spec().pack({"c_row0": c_row0, "c_k": c_k, "c_pos": c_pos, "c_valid": c_valid})
    dev_buf = mshape.device_spec().pack({"c_page": c_page, "c_lens": c_lens}, lead=(n,)) if chains else None
    return rep, dev_buf, chain_rows


def draft_pass(model, kv, ctx, mshape: MtpShape, batch, sampling, rep, prev, tokens, hidden, mrep, mdev, page_size: int,
               latents_only: bool = False):
    """Inside shard_map, after a step of shape mshape.step: the MTP pass over its token slots and
    the K-draft chain (the module docstring's 1-3), or (latents_only) the latents alone. batch,
    sampling and rep are the step's unpacked input as it read it (prev: the token vector it read),
    tokens the token vector it returns, hidden its final hidden states; mrep / mdev this device's
    pack_mtp buffers. -> (tokens with the drafts by chain row in rows 2.., pool). The draft program
    runs it after the step; a step program with drafts (StepExecutor._program's `draft`) inside."""
    shape, k = mshape.step, mshape.k
    rows, cq, owner_rows = shape.rows, shape.requests, shape.owner_rows
    m = mshape.replicated_spec().unpack(mrep)
    d = mshape.device_spec().unpack(mdev)
    norm, head, vocab = model.mtp[0].norm, lm_head(model), model.cfg.vocab_size
    sampled = tokens[0, :rows]  # the tokens by row (entries past `rows` are not this program's)
    nxt = slot_next_tokens(shape, rep, sampled)
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
