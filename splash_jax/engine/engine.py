"""The synchronous engine: requests in, tokens out, one `step()` at a time.

    engine = Engine(EngineConfig(model="path/to/deepseek"))
    outs = engine.generate(["Hello", "Tell me"], SamplingParams(max_tokens=32))

A step is: schedule (pure host bookkeeping) -> pack fixed-shape inputs (numpy, per request
not per token) -> one precompiled device program (forward + sampling, cache donated) ->
read back the sampled tokens (a few bytes per request) -> stop checks and outputs.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from splash_jax.engine.config import EngineConfig
from splash_jax.engine.executor import StepExecutor
from splash_jax.engine.request import Request, RequestError, RequestOutput, SamplingParams, Status
from splash_jax.engine.sampler import SamplingInputs
from splash_jax.engine.scheduler import ScheduledChunk, Scheduler
from splash_jax.engine.stop import find_stop, stop_prefix_len
from splash_jax.kv.allocator import PageAllocator, pages_for_tokens
from splash_jax.kv.capacity import (
    bytes_per_page,
    extra_pages_per_device,
    head_sharded_weight_bytes,
    kv_budget_bytes,
    layout_capacities,
    layout_token_capacity,
    pages_per_device,
)
from splash_jax.kv.placement import LayoutChunk, build_layout_step
from splash_jax.mesh.layouts import AXIS, LAYOUT_NAMES, get_layout, make_mesh, param_sharding_fn
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.tokenizer import IncrementalDecoder, Tokenizer
from splash_jax.weights.loader import load_model

log = logging.getLogger(__name__)


def enable_compilation_cache(path: str | None) -> None:
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class Engine:
    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer: Tokenizer | None = None, **overrides):
        config = config or EngineConfig()
        for k, v in overrides.items():
            setattr(config, k, v)
        config.validate()
        self.config = config
        enable_compilation_cache(config.compile_cache_dir)
        backend = jax.default_backend()
        self.layout = get_layout(config.layout)
        self.mesh = make_mesh(config.num_devices)
        self.n = self.mesh.shape[AXIS]
        devices = list(self.mesh.devices.flat)
        dtype = config.resolved_dtype(backend)
        self.page_dtype = dtype

        t0 = time.perf_counter()
        path = Path(config.model) if config.model else DEFAULT_MODEL
        options = RuntimeOptions(dtype=dtype, attention_impl=config.attention_impl)
        self.model = model or load_model(
            path, options, sharding_for=param_sharding_fn(self.layout, self.mesh),
            load_format=config.load_format, seed=config.seed,
        )
        self.model_config = self.model.cfg
        if tokenizer is None and (path / "tokenizer.json").exists():
            tokenizer = Tokenizer(path)
        self.tokenizer = tokenizer
        log.info("model ready in %.1fs (%s, %s)", time.perf_counter() - t0, backend, dtype)

        cfg = self.model_config
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        # The base segment is what every layout has (the budget with attention weights replicated);
        # head-sharded layouts add an extra segment made of the weight memory they free.
        self.page_bytes = bytes_per_page(cfg, config.page_size, dtype)
        self.head_sharded_bytes = head_sharded_weight_bytes(self.model)
        self.extra_pages = extra_pages_per_device(self.head_sharded_bytes, self.n, self.page_bytes)
        budget = kv_budget_bytes(devices[0], config.kv_memory_gb, config.kv_memory_fraction)
        if config.kv_memory_gb is None and self.layout.heads_sharded:
            budget -= self.extra_pages * self.page_bytes  # free memory already includes the freed weights
        per_device = pages_per_device(cfg, config.page_size, dtype, budget, config.max_pages)
        pool_tokens = per_device * config.page_size
        if self.max_model_len > pool_tokens:
            log.warning("max_model_len %d exceeds the KV pool (%d tokens); capping", self.max_model_len, pool_tokens)
            self.max_model_len = pool_tokens
        extra = self.extra_pages if self.layout.heads_sharded else 0
        self.allocator = PageAllocator(self.n, per_device, config.page_size, extra)
        self.scheduler = Scheduler(
            self.allocator, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            self.layout.kv_placement,
        )
        kv = self.model.new_cache(
            self.n * per_device, config.page_size, NamedSharding(self.mesh, P(AXIS)), extra_pages=self.n * extra
        )
        log.info(
            "KV pool (%s on %d devices): %d base + %d extra pages of %d tokens per device, %d tokens capacity (%.2f GiB)",
            self.layout.name, self.n, per_device, extra, config.page_size, self.kv_capacity_tokens(), kv.nbytes() / 2**30,
        )
        self.pages_per_request = pages_for_tokens(self.max_model_len, config.page_size)
        self.executor = StepExecutor(
            self.model, kv, self.mesh, self.layout,
            (config.max_num_batched_tokens, config.max_num_seqs, config.min_token_bucket),
            self.pages_per_request, config.attention_impl, extra_pages_total=self.n * self.extra_pages,
        )
        if config.warmup:  # with switching, every layout's steps: a switch must never compile
            self.executor.compile_all([get_layout(n) for n in LAYOUT_NAMES] if config.enable_switching else None)
        self.switcher = None
        if config.enable_switching:
            from splash_jax.switch.controller import SwitchController

            self.switcher = SwitchController(self, config.switch_chunk_pages)  # compiles the migration programs
        self.policy = None
        if config.layout_policy == "auto":
            from splash_jax.policy import TransitionAwarePolicy

            self.policy = TransitionAwarePolicy(self, config.policy)

        self.eos_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_id is not None:
            self.eos_ids.add(tokenizer.eos_id)
        self._requests: dict[str, Request] = {}
        self._decoders: dict[str, IncrementalDecoder] = {}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)
        self.num_steps = 0

    # --- requests ------------------------------------------------------------------------
    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread)."""
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; pass prompt token ids")
            ids = self.tokenizer.encode(prompt, add_bos=True)
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; the maximum model length is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        rid = request_id or f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        return Request(rid, ids, params, prompt_text=text, sample_seed=seed)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        request = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id)
        if request.request_id in self._requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        if self.tokenizer is not None:
            self._decoders[request.request_id] = IncrementalDecoder(self.tokenizer)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove(request)
        request.finish_reason = "abort"
        self._decoders.pop(request_id, None)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.switcher and self.switcher.active)

    # --- one step ------------------------------------------------------------------------
    def switch_layout(self, dst: str, preempt: bool = False):
        """Start a live switch to layout `dst` (non-blocking); returns a handle with progress.

        Refused (handle.state == REFUSED, handle.reason says why) when the destination cannot
        hold the running requests, unless `preempt` lets it recompute the newest ones later.
        """
        if self.switcher is None:
            raise RuntimeError("layout switching is off: build the engine with enable_switching=True")
        get_layout(dst)
        return self.switcher.start(dst, preempt)

    def step(self) -> list[RequestOutput]:
        if self.switcher is not None:
            self.switcher.before_step()  # batch boundary: a finished migration hands off here
            if self.policy and self.switcher.active is None and self.num_steps % self.config.policy.interval_steps == 0:
                dst = self.policy.decide(self.num_steps)
                if dst is not None:
                    self.switcher.start(dst)
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.switcher is not None:
                self.switcher.after_step()
            return []
        batch, sampling, bucket = self._pack(chunks)
        out = self.executor.run(bucket, batch, sampling)
        want_logprobs = any(c.request.params.logprobs is not None for c in chunks)
        tokens = np.asarray(out.tokens)
        host = jax.device_get((out.logprob, out.top_ids, out.top_logprobs)) if want_logprobs else None
        self.num_steps += 1
        now = time.monotonic()
        outputs = []
        for i, chunk in enumerate(chunks):
            request = chunk.request
            request.num_computed += chunk.num_tokens
            if request.metrics.first_scheduled is None:
                request.metrics.first_scheduled = now
            if chunk.samples:
                outputs.append(self._append_token(request, int(tokens[i]), host, i, now))
        self._recent.append((now, sum(1 for c in chunks if c.samples)))
        if self.switcher is not None:
            self.switcher.after_step()  # a bounded chunk of page copies between steps
        return outputs

    def _pack(self, chunks: list[ScheduledChunk]):
        if self.layout.owner_rows:
            tokens, requests = [0] * self.n, [0] * self.n
            for c in chunks:
                tokens[c.request.owner] += c.num_tokens
                requests[c.request.owner] += 1
            bucket = self.executor.pick(max(tokens), max(requests))
            rows = self.n * bucket.requests
        else:
            bucket = self.executor.pick(sum(c.num_tokens for c in chunks), len(chunks))
            rows = bucket.requests
        batch = build_layout_step(
            self.layout, self.allocator,
            [LayoutChunk(c.tokens, c.start, c.request.device_pages, c.request.owner) for c in chunks],
            bucket.tokens, bucket.requests, self.pages_per_request,
        )
        s = SamplingInputs.host(rows)
        for i, c in enumerate(chunks):
            p = c.request.params
            s.temperature[i] = p.temperature
            s.top_k[i] = max(p.top_k, 0)
            s.top_p[i] = p.top_p
            s.seed[i] = c.request.sample_seed & 0xFFFFFFFF
            s.step[i] = len(c.request.output_ids)
        return batch, s, bucket

    def _append_token(self, request: Request, token: int, host, row: int, now: float) -> RequestOutput:
        p = request.params
        request.output_ids.append(token)
        if request.metrics.first_token is None:
            request.metrics.first_token = now
        if p.logprobs is not None and host is not None:
            chosen, top_ids, top_lp = host
            request.output_logprobs.append(float(chosen[row]))
            request.output_top_logprobs.append(
                {int(t): float(v) for t, v in zip(top_ids[row][: p.logprobs], top_lp[row][: p.logprobs])}
            )
        decoder = self._decoders.get(request.request_id)
        delta = decoder.push(token) if decoder else ""
        reason = None
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            reason = "stop"
        elif decoder and p.stop:
            hit = find_stop(decoder.text, p.stop, len(delta))
            if hit is not None:
                cut, request.stop_text = hit
                decoder.text = decoder.text[:cut]
                reason = "stop"
        if reason is None and (len(request.output_ids) >= p.max_tokens or request.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            request.finish_reason = reason
            request.metrics.finished = now
            self.scheduler.remove(request)
            self._requests.pop(request.request_id, None)
            self._decoders.pop(request.request_id, None)
        text = decoder.text if decoder else ""
        # Hold back a tail that may still grow into a stop string, so deltas never show part of one.
        visible = len(text) if reason is not None else len(text) - stop_prefix_len(text, p.stop)
        delta = text[request.text_sent : visible] if visible > request.text_sent else ""
        request.text_sent = max(request.text_sent, visible)
        return self._output(request, delta, [token], text)

    def _output(self, request: Request, delta: str, delta_ids: list[int], text: str) -> RequestOutput:
        finished = request.status == Status.FINISHED
        return RequestOutput(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=list(request.output_ids),
            text=text,
            delta_text=delta,
            delta_token_ids=delta_ids,
            finished=finished,
            finish_reason=request.finish_reason,
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            top_logprobs=list(request.output_top_logprobs) if request.params.logprobs is not None else None,
            ttft=request.metrics.ttft(),
            tpot=request.metrics.tpot(len(request.output_ids)) if finished else None,
        )

    # --- convenience ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; a bad prompt returns an output with `error` set, the rest run."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        results: dict[int, RequestOutput] = {}
        ids: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids[self.add_request(prompt, p)] = i
            except RequestError as e:
                results[i] = RequestOutput(f"invalid-{i}", [], [], "", "", [], True, "error", error=str(e))
        while len(results) < len(prompts):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    results[ids[out.request_id]] = out
        return [results[i] for i in range(len(prompts))]

    def kv_capacity_tokens(self, layout_name: str | None = None) -> int:
        """Tokens of distinct requests the pool holds under a layout (the current one by default)."""
        layout = get_layout(layout_name) if layout_name else self.layout
        extra = self.extra_pages if layout.heads_sharded else 0
        return layout_token_capacity(layout.kv_placement, self.n, self.allocator.pages_per_device, extra, self.config.page_size)

    def capacities(self) -> dict:
        """Every layout's capacity on this engine's devices, known before any switch."""
        return layout_capacities(
            self.model_config, self.n, self.config.page_size, self.page_dtype, self.allocator.pages_per_device,
            self.head_sharded_bytes,
        )

    def stats(self) -> dict:
        usage = self.allocator.usage()
        window = [t for t in self._recent if t[0] > time.monotonic() - 10]
        span = (window[-1][0] - window[0][0]) if len(window) > 1 else 0.0
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_total": sum(u.total_pages for u in usage),
            "pages_used": sum(u.used_pages for u in usage),
            "tokens_used": sum(u.used_pages for u in usage) * self.config.page_size,
            "kv_capacity_tokens": self.kv_capacity_tokens(),
            "per_device": [u.__dict__ for u in usage],
            "generation_tokens_per_s": (sum(n for _, n in window[1:]) / span) if span > 0 else 0.0,
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "layout": self.layout.name,
            "switch": self.switcher.active[0].as_dict() if self.switcher and self.switcher.active else None,
            "switches": len([h for h in self.switcher.history if h.state.value == "done"]) if self.switcher else 0,
            "switch_metrics": self.switcher.metrics() if self.switcher else None,
            "num_devices": self.n,
        }
