"""One device step of the engine core, from chunks to CoreOutputs: pack the step's input, pick
the bucket and program, dispatch it (sampling deferred while grammar masks fill), read the tokens
back and apply them, and start again from an empty pool when a device step fails.

`DeviceSteps` is a part of `EngineCore` (engine/engine_core.py), which owns the state these
methods use (scheduler, executor, slot sampling, MTP drafts); it holds no state of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from splash_jax.attention.expanded import min_chunk_tokens, worth_expanding
from splash_jax.engine.core_output import CoreOutput
from splash_jax.engine.draft_budget import step_yields
from splash_jax.engine.inflight import InFlight, collect_prompt_logprobs
from splash_jax.engine.late_drafts import bind_late_drafts
from splash_jax.engine.request import Request, Status
from splash_jax.engine.sampler import FULL_MODE, SamplerMode, needs_full
from splash_jax.engine.scheduler import ScheduledChunk
from splash_jax.engine.step_packer import pack_step
from splash_jax.kv.page_copy import pack_copies
from splash_jax.structured.reasoning_gate import needs_masks

log = logging.getLogger("splash_jax.engine.engine_core")


def start_host_copies(result, want_logprobs: bool) -> None:
    """Start the device-to-host copies of what _complete reads back, at dispatch: the tokens, and
    the logprob arrays of a step that returns logprobs (read without it, each is a transfer the
    host waits for after the step: batch-1 decode with logprobs, docs/kernels.md)."""
    result.tokens.copy_to_host_async()
    if want_logprobs:
        for x in (result.logprob, result.top_ids, result.top_logprobs):
            x.copy_to_host_async()


class DeviceSteps:
    """The step machinery of EngineCore (see the module docstring)."""

    def _bucket(self, chunks: list[ScheduledChunk]):
        """The smallest bucket holding the chunks' tokens, requests and logits rows (a chunk with
        prompt logprobs takes a row per position)."""
        rows = sum(c.num_rows for c in chunks)
        if self.layout.owner_rows:
            tokens, requests = [0] * self.n, [0] * self.n
            for c in chunks:
                tokens[c.request.owner] += c.num_slots
                requests[c.request.owner] += 1
            return self.executor.pick(max(tokens), max(max(requests), -(-rows // self.n)))
        return self.executor.pick(sum(c.num_slots for c in chunks), max(len(chunks), rows))

    def _pack(self, chunks: list[ScheduledChunk], expand: bool = True):
        """-> (bucket, expanded, packed). expand=False: never the expanded-prefill program."""
        for c in chunks:  # a request that just took a slot: write its sampling row once
            r = c.request
            if self._slot_request[r.slot] is not r:
                self.slot_sampling.assign(r.slot, r.params, r.sample_seed)
                self._slot_request[r.slot] = r
        bucket = self._bucket(chunks)
        ex = self.executor
        floor = min_chunk_tokens(ex.expanded_min_tokens)  # decode chunks (1 token) stop at this compare
        expanded = expand and ex.expands(self.layout, bucket) and any(
            c.num_tokens >= floor and worth_expanding(c.num_tokens, c.start + c.num_tokens, ex.expanded_min_tokens)
            for c in chunks
        )
        shape = ex.shape(self.layout, bucket, expanded)
        packed = pack_step(shape, chunks, self.scheduler.tables, self.slot_sampling, self.config.page_size,
                           span_min_tokens=ex.expanded_min_tokens)
        return bucket, expanded, packed

    def _dispatch(self, chunks: list[ScheduledChunk]) -> InFlight | None:
        try:  # copy-on-write pages of this step's admissions, before anything that reads them
            for buf in pack_copies(self.scheduler.take_page_copies(), self.scheduler.allocator):
                self.executor.copy_pages(buf)
        except Exception as e:  # noqa: BLE001 - a device failure: its pool is gone
            self._recover(e, chunks)
            return None
        try:
            bucket, expanded, packed = self._pack(chunks)
        except Exception as e:  # noqa: BLE001 - host-side: find the requests that cause it, fail only them
            chunks = self._isolate(chunks, e)
            if not chunks:
                return None
            bucket, expanded, packed = self._pack(chunks)
        previous = self._inflight
        if previous is not None and previous.logits is not None:
            self._sample_deferred(previous)  # its tokens feed this step (its masks filled meanwhile)
            if previous.result is None:
                return None  # its sampling failed: _recover requeued every running request
        move = self.switcher.step_moves() if self.switcher is not None else None
        if expanded and move is not None:  # moving programs have no expanded variant
            bucket, expanded, packed = self._pack(chunks, expand=False)
        sampling = [c for c in chunks if c.samples]
        lp_chunks = [c for c in chunks if c.lp_start >= 0]
        # num_generated - 1: the output position this step samples (one token: masked requests get no drafts)
        constrained = any(needs_masks(c.request, c.request.num_generated - 1) for c in sampling)
        try:
            # a masked step samples in the full sampler (the mask input), even if its rows are greedy
            full = bool(lp_chunks) or constrained or any(needs_full(c.request.params) for c in chunks)
            mode = FULL_MODE
            if full:
                mode = SamplerMode.serving(c.request.params for c in chunks)
                if any(c.request.params.prompt_logprobs for c in lp_chunks):
                    mode = dataclasses.replace(mode, top_logprobs=True)
            # A step with grammar rows runs its forward pass now and its sampling once the host
            # has advanced each grammar by the previous step's token (_sample_deferred).
            # the MTP pass and draft chain, once the step's tokens exist: drafts (keep), or the
            # latents alone after a step that hands its logits to a sampler program
            keep = self.mtp is not None and self._mtp_keeps(chunks)
            drafted = self.mtp is not None and (
                keep or self.executor.returns_logits(bucket, full, move is not None, expanded, constrained))
            if previous is not None and self._binds_late_drafts(chunks):  # n-gram drafts after the tokens it returns
                self._bind_late(previous, chunks, bucket, expanded, packed)
            # a greedy step that wants drafts may compute them in its own program (mtp.takes_in_step)
            in_step = keep and self.mtp.takes_in_step(bucket) and not (full or expanded or move is not None)
            inline = self.mtp.drafts_in_step(bucket, packed, chunks, self.scheduler.tables) if in_step else None
            self.dispatch_timing.launching(previous)  # (late dispatch: host time to the launch; an idle device)
            out = self.executor.run(bucket, packed.rep, packed.dev, move, full, expanded, mode, defer=constrained,
                                    drafted=drafted and not in_step, inline=inline)
            if self.mtp is not None:
                if in_step:
                    self.mtp.drafted_in_step(chunks, out.tokens)
                elif drafted:
                    self.mtp.arm(bucket, expanded, packed, chunks, self.scheduler.tables, keep=keep)
                    if not constrained:
                        self.mtp.fire(out.tokens)
                else:  # no drafts wanted, and the step program sampled and wrote its MTP latents itself
                    self.mtp.skip()
        except Exception as e:  # noqa: BLE001 - the device step failed: its pool is gone
            self._recover(e, chunks)
            return None
        want = bool(lp_chunks) or any(c.request.params.logprobs is not None for c in sampling)
        if not constrained:
            start_host_copies(out, want)
        self.scheduler.dispatched(chunks)  # the pages these chunks completed may be cached now
        for c, row in zip(sampling, packed.rows):
            c.request.pending_row = row
        now = time.monotonic()
        for c in chunks:
            if c.request.metrics.first_scheduled is None:
                c.request.metrics.first_scheduled = now
        key = self.draft_budget.take_key() if self.draft_budget is not None else None
        if constrained:
            return InFlight(chunks, packed.rows, None, want, packed.prompt_rows, out, mode, draft_key=key)
        return InFlight(chunks, packed.rows, out, want, packed.prompt_rows, draft_key=key)

    def _bind_late(self, previous: InFlight, chunks, bucket, expanded: bool, packed) -> None:
        """Read the step in flight back and write the n-gram drafts that follow its tokens over the
        placeholders (engine/late_drafts.py). A failed read binds nothing: _complete meets it."""
        try:
            tokens = self._read_tokens(previous)
        except Exception:  # noqa: BLE001 - the step failed on the device: _complete recovers
            return
        shape = self.executor.shape(self.layout, bucket, expanded)
        self.scheduler.spec_stats.late_bound += bind_late_drafts(shape, chunks, packed, tokens, self.scheduler.drafter)

    def _read_tokens(self, step: InFlight) -> np.ndarray:
        """The step's token vector on the host (read once: a late-bound dispatch reads it first)."""
        if step.host_tokens is None:
            self.dispatch_timing.reading(step)  # (late dispatch: a step done before this read is not timed)
            t = time.perf_counter()
            step.host_tokens = np.asarray(step.result.tokens)
            step.read_wait_s = time.perf_counter() - t
        return step.host_tokens

    def _sample_deferred(self, step: InFlight) -> None:
        """Dispatch the sampler program of a step whose forward pass went ahead of its grammar
        masks; before the next step's forward pass, which reads its tokens."""
        mask = self.grammar_masks.take(step)
        logits, step.logits = step.logits, None
        try:
            step.result = self.executor.sample(logits, step.mode, mask)
            if self.mtp is not None:
                self.mtp.fire(step.result.tokens)  # its draft program, if it was armed
        except Exception as e:  # noqa: BLE001 - the sampler failed on the device
            self._recover(e, step.chunks)
            return
        start_host_copies(step.result, step.want_logprobs)

    def _complete(self, step: InFlight, back_to_back: bool = False) -> list[CoreOutput]:
        """Read back a dispatched step and apply its tokens (stops, finishes, output deltas).
        back_to_back: the previous step() completed a step too (its interval is a cadence)."""
        if step.logits is not None:
            self._sample_deferred(step)
        if step.result is None:  # its deferred sampling failed: _recover already requeued its requests
            return []
        try:
            tokens = self._read_tokens(step)[0]  # by logits row (token_vector's row 0)
            self._last_wait_s = step.read_wait_s
            self.device_wait_s += self._last_wait_s
            self.dispatch_timing.completed(step, self._last_wait_s)
            r = step.result
            logprobs = jax.device_get((r.logprob, r.top_ids, r.top_logprobs)) if step.want_logprobs else None
        except Exception as e:  # noqa: BLE001 - the step failed on the device
            self._recover(e, step.chunks)
            return []
        self.num_steps += 1
        record = self.timeline.completed(time.perf_counter(), step.chunks, back_to_back)
        now = time.monotonic()
        for i, first, count in step.prompt_rows:
            collect_prompt_logprobs(step.chunks[i].request, logprobs, first, count)
        outputs: dict[str, CoreOutput] = {}  # one per request (a verify chunk applies several tokens)
        for update in self.scheduler.apply_tokens(step.chunks, step.rows, tokens):
            r = update.request
            out = outputs.get(r.request_id)
            if out is None:
                out = outputs[r.request_id] = _new_output(r, logprobs is not None)
            out.new_token_ids.append(update.token)
            if out.logprobs is not None:
                chosen, top_ids, top_lp = logprobs
                k, row = r.params.logprobs, update.row
                out.logprobs.append(float(chosen[row]))
                out.top_logprobs.append(dict(zip(top_ids[row, :k].tolist(), top_lp[row, :k].tolist())))
            if update.finish_reason is not None:
                out.finish_reason, out.stop_token, out.stop_reason, out.error = (
                    update.finish_reason, update.stop_token, r.stop_reason if isinstance(r.stop_reason, int) else None, r.error)
                self._requests.pop(r.request_id, None)
        counts = [len(o.new_token_ids) for o in outputs.values()]
        self._recent.append((now, sum(counts)))
        if record is not None and not record.prefill_tokens and self.draft_budget is not None and step.draft_key is not None:
            self.draft_budget.observe(step.draft_key, step_yields(counts, step.draft_key[1]), record.interval_s)
        if self.mtp is not None:
            self._record_drafts(step)
        return list(outputs.values())

    def _record_drafts(self, step: InFlight) -> None:
        """The MTP drafts the device computed after this step: each request that sampled in it
        continues from them in its next step (speculative.MtpDrafter). A next step already
        dispatched (overlapped scheduling) read them on the device; its chunk learns them here,
        before its own tokens are applied."""
        try:
            drafts = self.mtp.take(step.chunks)
        except Exception as e:  # noqa: BLE001 - its draft program failed: no drafts (the next step fails and recovers)
            log.warning("reading the MTP drafts failed (%s: %s)", type(e).__name__, e)
            drafts = None
        for request, d in drafts or ():
            if not request.is_finished:
                self.mtp_drafter.record(request, d)  # (and a chunk dispatched with them still on the device)
        self.mtp_drafter.prune()

    def _fail(self, request: Request, message: str) -> None:
        log.warning("request %s failed: %s", request.request_id, message)
        self.scheduler.finish(request, "error")
        self._requests.pop(request.request_id, None)
        self._failed.append(CoreOutput(request.request_id, [], "error", num_cached_tokens=request.num_cached_tokens,
                                       error=message))

    def _isolate(self, chunks: list[ScheduledChunk], error: Exception) -> list[ScheduledChunk]:
        """Packing failed: pack each request alone, fail those that still fail, keep the rest."""
        log.warning("packing a step failed (%s: %s); isolating the requests that cause it", type(error).__name__, error)
        good, kept = [], {}  # kept: leader request id -> its chunk that packs
        for c in chunks:  # a follower's last token packs with its leader's chunk (it reads its slot)
            if c.leader is not None and id(c.leader) not in kept:  # its leader failed: compute it again
                c.request.num_pending -= c.samples  # the token this chunk would have sampled
                self.scheduler.preempt(c.request)
                continue
            try:
                self._pack([c] if c.leader is None else [kept[id(c.leader)], c])
                good.append(c)
                if c.leader is None:
                    kept[id(c.request)] = c
            except Exception as e:  # noqa: BLE001
                self._fail(c.request, f"the request could not be run: {type(e).__name__}: {e}")
        return good

    def _recover(self, error: Exception, chunks: list[ScheduledChunk]) -> None:
        """A device step failed, so the donated pool is lost: start from an empty pool and recompute
        every running request (outputs unchanged). A request in two failed steps is failed."""
        self.num_step_failures += 1
        self.scheduler.take_page_copies()  # into the lost pool
        log.error("engine step failed on the device (%s: %s); recomputing the running requests", type(error).__name__, error)
        self._inflight = None
        if self.mtp is not None:
            self.mtp.drop()
            self.mtp_drafter.forget()
        for c in chunks:
            c.request.metrics.num_step_failures += 1
            if c.request.metrics.num_step_failures >= 2 and c.request.status != Status.FINISHED:
                self._fail(c.request, f"the engine step failed twice with this request in it: {type(error).__name__}: {error}")
        for request in list(self.scheduler.running):
            self.scheduler.preempt(request)
        if self.switcher is not None and self.switcher.active is not None:
            self.switcher.active[0].cancel()  # its plans name pages of the lost pool: start again if wanted
        for request in self.scheduler.waiting:
            request.num_pending, request.pending_row = 0, -1  # tokens of the lost steps are sampled again
            request.unapplied.clear()
            request.prompt_lp_next = len(request.prompt_lps)  # and their prompt logprobs computed again
        self._slot_request = [None] * len(self._slot_request)
        if self.scheduler.cache is not None:
            self.scheduler.cache.clear()  # the cached pages' contents went with the pool
        self.executor.reset_device_state()

    # --- convenience ---------------------------------------------------------------------


def _new_output(request: Request, have_logprobs: bool) -> CoreOutput:
    """A request's CoreOutput for this step: its prompt logprobs the first time (vLLM's shape:
    None for the first prompt token), logprob lists if it asked for them."""
    out = CoreOutput(request.request_id, [], num_cached_tokens=request.num_cached_tokens)
    if request.params.logprobs is not None and have_logprobs:
        out.logprobs, out.top_logprobs = [], []
    if request.params.prompt_logprobs is not None and not request.prompt_lps_sent:
        request.prompt_lps_sent = True
        out.prompt_logprobs = [None] + request.prompt_lps
        out.prompt_top_logprobs = [None] + (request.prompt_tops if request.params.prompt_logprobs
                                            else [{}] * len(request.prompt_lps))
    return out
