"""The engine core: requests in, token ids out, one `step()` at a time.

A step is: schedule (host bookkeeping) -> pack two int32 buffers (engine/step_packer.py) ->
dispatch one precompiled device program (forward + sampling; pool and penalty state donated).
With overlapped scheduling (the default, as SGLang's overlap scheduler and vLLM's async
scheduling) the core then reads back the PREVIOUS step's tokens while this one runs on the
device: sampled tokens feed the next step on the device, and token-level stops apply one step
late (a token sampled past a stop is dropped, never shown). `overlap_scheduling=False` reads back
the step it just dispatched; both give identical outputs.

The core never sees text: it returns `CoreOutput`s (new token ids, logprobs, finish reasons).
Detokenization and stop strings are the front end's (engine/output_processor.py), in this
process (`Engine`, engine/engine.py) or in the API server's (serve/, engine/core_server.py).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import threading
import time
from pathlib import Path

import jax
from jax.sharding import NamedSharding

from splash_jax import distributed
from splash_jax.engine.config import EngineConfig
from splash_jax.engine.executor import StepExecutor, step_executor_args
from splash_jax.engine.engine_stats import engine_stats
from splash_jax.engine.inflight import GrammarMasks, InFlight
from splash_jax.engine.core_output import CoreOutput
from splash_jax.engine.device_steps import DeviceSteps
from splash_jax.engine.speculation_control import SpeculationControl
from splash_jax.engine.request import Request, RequestError, SamplingLimits
from splash_jax.engine.sampler import SamplerWidths
from splash_jax.engine.prefill_order import PrefillOrder
from splash_jax.engine.scheduler import Scheduler
from splash_jax.engine.speculative import MtpDrafter
from splash_jax.engine.step_packer import SlotSampling
from splash_jax.engine.step_timeline import StepTimeline
from splash_jax.engine.dispatch_timing import DispatchTiming
from splash_jax.engine.step_time_cap import StepTimeCap
from splash_jax.engine.dispatch_timing import resolved as resolve_late_dispatch
from splash_jax.engine.warmup import run_every_program_once
from splash_jax.kv.allocator import PageAllocator, pages_for_tokens
from splash_jax.kv.capacity import (
    bytes_per_page,
    extra_pages_per_device,
    head_sharded_weight_bytes,
    check_max_model_len,
    layout_capacities,
    layout_token_capacity,
)
from splash_jax.engine.pool_sizing import confirm_plan, plan_start_up_pool
from splash_jax.mesh.partitioner import use_partitioner
from splash_jax.mesh.layouts import AXIS, LAYOUT_NAMES, POOL_SPEC, get_layout, make_mesh, param_sharding_fn
from splash_jax.model import RuntimeOptions
from splash_jax.model_config import ModelConfig
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.switch.migration import in_step_chunk_pages
from splash_jax.structured.masks import MaskBuilder
from splash_jax.tokenizer import Tokenizer
from splash_jax.weights.loader import load_model

log = logging.getLogger(__name__)


def enable_compilation_cache(path: str | None) -> None:
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class EngineCore(DeviceSteps, SpeculationControl):
    """Schedules, dispatches steps, applies tokens, advances grammars, runs switches: nothing
    per request that can run elsewhere. step() returns token-level CoreOutputs."""

    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer: Tokenizer | None = None, **overrides):
        config = config or EngineConfig()
        for k, v in overrides.items():
            setattr(config, k, v)
        config.validate()
        self.config = config
        enable_compilation_cache(config.compile_cache_dir)
        backend = jax.default_backend()
        use_partitioner(config.resolved_partitioner(backend))
        self.layout = get_layout(config.layout)
        self.mesh = make_mesh(config.num_devices)
        self.n = self.mesh.shape[AXIS]
        devices = list(self.mesh.devices.flat)
        dtype = config.resolved_dtype(backend)
        self.page_dtype = dtype

        t0 = time.perf_counter()
        path = Path(config.model) if config.model else DEFAULT_MODEL
        self.model_path = path
        fp8_checkpoint = model is None and _checkpoint_is_fp8(path)
        expert_format = config.resolved_expert_weights(fp8_checkpoint, backend)
        if fp8_checkpoint and expert_format == "model":
            log.info("FP8 checkpoint: routed experts dequantized to %s; --expert-weights fp8 keeps them in FP8 "
                     "(half the expert memory)", dtype)
        # The MTP layer is loaded (and its latents pooled) only for --speculative-method mtp.
        mtp = config.speculative_method == "mtp"
        if config.speculative_method == "custom":
            raise ValueError('speculative method "custom" takes a drafter object: start with another method '
                             'and call set_speculative("custom", k, drafter)')
        if mtp:
            _check_mtp(model, path)
        options = RuntimeOptions(
            dtype=dtype, attention_impl=config.attention_impl, scan_layers=config.scan_layers,
            expert_format=expert_format, moe_impl=config.moe_impl, mtp=mtp,
        )
        self.model = model or load_model(
            path, options, sharding_for=param_sharding_fn(self.layout, self.mesh),
            load_format=config.load_format, seed=config.seed,
        )
        self.model_config = self.model.cfg
        self.num_mtp_layers = self.model.num_mtp_layers if mtp else 0
        if mtp and not self.num_mtp_layers:
            raise ValueError("--speculative-method mtp needs the model built with its MTP layer "
                             "(RuntimeOptions(mtp=True) from a checkpoint with num_nextn_predict_layers > 0)")
        if tokenizer is None and (path / "tokenizer.json").exists():
            tokenizer = Tokenizer(path)
        self.tokenizer = tokenizer
        log.info("model ready in %.1fs (%s, %s)", time.perf_counter() - t0, backend, dtype)

        cfg = self.model_config
        # The pool holds the model's layers and its MTP layers (pool layers num_layers..).
        self.pool_config = dataclasses.replace(cfg, num_layers=cfg.num_layers + self.model.num_mtp_layers)
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        # The base segment is what every layout has (the budget with attention weights replicated);
        # head-sharded layouts add an extra segment made of the weight memory they free.
        self.page_bytes = bytes_per_page(self.pool_config, config.page_size, dtype)
        self.head_sharded_bytes = head_sharded_weight_bytes(self.model)
        self.extra_pages = extra_pages_per_device(self.head_sharded_bytes, self.n, self.page_bytes)
        local = next(d for d in devices if d.process_index == jax.process_index())  # memory stats are local
        extra = self.extra_pages if self.layout.heads_sharded else 0
        self.eos_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_id is not None:
            self.eos_ids.add(tokenizer.eos_id)
        self.pages_per_request = pages_for_tokens(self.max_model_len, config.page_size)
        k = config.speculative_k
        self.max_logits_rows = config.max_logits_rows  # fixed at start-up: set_speculative changes the config
        self.limits = SamplingLimits(config.max_stop_token_ids, config.max_logit_bias)
        widths = SamplerWidths.of(self.limits, len(self.eos_ids))
        self.switch_chunk_pages = in_step_chunk_pages(config.switch_chunk_pages, self.n, self.page_bytes)
        executor_args = step_executor_args(config, backend, self.n, self.pages_per_request, widths,
                                           self.n * self.extra_pages, self.switch_chunk_pages)
        # Every layout's steps are compiled with switching (a switch must never compile): the
        # memory plan measures the largest of them before the pool takes the memory.
        layouts = [get_layout(n) for n in LAYOUT_NAMES] if config.enable_switching else [self.layout]
        per_device, self.pool_plan = plan_start_up_pool(
            config, self.model, self.mesh, self.layout, layouts, self.pool_config, dtype, self.page_bytes, extra,
            executor_args, local)
        per_device = distributed.agree_min("kv_pages_per_device", per_device)  # one pool shape on every host
        # A --max-model-len the pool cannot hold fails here; the model's own maximum is capped.
        self.max_model_len = check_max_model_len(
            self.max_model_len, config.max_model_len is not None and config.max_pages is None, per_device * config.page_size)
        self.pages_per_request = executor_args["pages_per_request"] = pages_for_tokens(self.max_model_len, config.page_size)
        self.allocator = PageAllocator(self.n, per_device, config.page_size, extra)
        if k:
            log.info("speculative decoding: %s, %d drafts per request per step (steps %s)", config.speculative_method, k,
                     "overlap" if config.speculative_variants else "run without overlap")
        self.scheduler = Scheduler(
            self.allocator, config.max_num_seqs, config.max_num_batched_tokens, self.layout.kv_placement,
            self.max_model_len, self.pages_per_request, self.eos_ids, config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            balance_pages=int(config.prefix_balance_fraction * per_device),
            max_logits_rows=self.max_logits_rows, prefill_order=PrefillOrder.of(config, executor_args["ladder"][3], backend),
        )
        self.mtp_drafter = MtpDrafter(k) if mtp else None  # drafts the device computed, by request
        self._custom_drafter = None  # set_speculative("custom", k, drafter)
        self.draft_budget = None  # drafts per step from measured costs (engine/draft_budget.py): after the executor
        self.slot_sampling = SlotSampling(config.max_num_seqs, widths, sorted(self.eos_ids))
        self._slot_request: list[Request | None] = [None] * config.max_num_seqs
        kv = self.model.new_cache(
            self.n * per_device, config.page_size, NamedSharding(self.mesh, POOL_SPEC), extra_pages=self.n * extra
        )
        log.info(
            "KV pool (%s on %d devices): %d base + %d extra pages of %d tokens per device, %d tokens capacity (%.2f GiB)",
            self.layout.name, self.n, per_device, extra, config.page_size, self.kv_capacity_tokens(), kv.nbytes() / 2**30,
        )
        self.executor = StepExecutor(self.model, kv, self.mesh, self.layout, **executor_args)
        self.scheduler.ahead_drafts = self.executor.spec_variants - 1
        self._set_speculation()
        self.mtp = None  # MTP draft programs (engine/mtp_draft.py): one per step program, run right after it
        if mtp:
            from splash_jax.engine.mtp_draft import MtpDraftRunner

            self.executor.mtp_hidden = True  # the step programs also return the hidden states
            self.mtp = MtpDraftRunner(self.executor, k, config.page_size, dtype, in_step_max_tokens=config.mtp_drafts_in_step_max_tokens)
            self.scheduler.share_last_cached_page = False  # its steps write an MTP latent there: copy on write
            self.mtp_drafter.runner = self.mtp  # drafts behind a step in flight stay on the device
        if config.warmup:  # with switching, every layout's steps: a switch must never compile
            self.executor.compile_all(layouts, moving=config.enable_switching, threads=config.compile_threads)
            confirm_plan(self.pool_plan, self.executor.memory_summary())
            if self.mtp is not None:
                self.mtp.compile_all(layouts)
        self.switcher = None
        if config.enable_switching:
            from splash_jax.switch.controller import SwitchController

            self.switcher = SwitchController(self, self.switch_chunk_pages, config.switch_plan_pages)  # compiles the migration programs
        self.policy = None
        if config.layout_policy == "auto":
            from splash_jax.policy import TransitionAwarePolicy

            self.policy = TransitionAwarePolicy(self, config.policy)

        self._grammars = None  # GrammarCompiler, built on the first structured request
        self._grammar_lock = threading.Lock()
        self.masks = MaskBuilder(cfg.vocab_size)  # host time it spent: masks.summary()
        self.grammar_masks = GrammarMasks(self.masks)
        self._requests: dict[str, Request] = {}
        self._inflight: InFlight | None = None
        self._drafts_in_sync = False  # this step drafts n-grams from the tokens of the one before it
        self.timeline = StepTimeline()  # step intervals by kind, for stats()["step_intervals"]
        self.dispatch_timing = self.new_dispatch_timing(*resolve_late_dispatch(config.late_dispatch, backend))
        self.set_max_step_ms_with_decodes(config.max_step_ms_with_decodes)
        self._completed_last_call = False
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)
        self._failed: list[CoreOutput] = []
        self.num_steps = 0
        self.num_step_failures = 0
        # Host time of the last step() by phase, ms (switch: a switch's stale plans and cancels;
        # handoff: the batch boundary after dispatch: a handoff, its deferred frees, the policy;
        # wait: blocked on the device for the completed step's tokens). Cheap enough to keep
        # always; benchmarks/switching.py reports it per step.
        self.last_step_ms: dict[str, float] = {}
        self._last_wait_s = 0.0
        self.host_phase_ms: dict[str, float] = {}  # last_step_ms summed over every step (stats, /metrics)
        self.device_wait_s = 0.0  # host time blocked on the device for tokens (CUDA may spin: it shows as CPU)
        if config.resolved_warmup_runs(backend):  # every process runs it itself, before mirroring starts
            self.run_every_program_once()
        if config.resolved_gc_freeze(backend):
            gc.collect()
            gc.freeze()  # per process: what start-up built is never scanned again
        distributed.attach(self)  # multi-process: process 0 streams its device calls to the others

    # --- requests ------------------------------------------------------------------------
    @property
    def grammars(self):
        """The structured-output compiler (structured/grammar.py: llguidance's tables of this
        tokenizer), built on the first structured request."""
        from splash_jax.structured.grammar import GrammarCompiler  # llguidance: imported only when used

        with self._grammar_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer (tokenizer.json)", "structured_outputs")
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.model_config.vocab_size, self.eos_ids,
                                                 self.config.structured_json_whitespace)
            return self._grammars

    def add_request(self, request: Request) -> str:
        """Queue a validated request (RequestFactory.make). One whose structured outputs have no
        matcher yet (it came from another process) gets one here: callers off the step loop
        build it first (CoreServer does, on its grammar thread)."""
        if request.request_id in self._requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        if request.grammar is None and request.params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(request.params.structured_outputs)
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now, freeing its pages (reason "stop": the front end found a stop string)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, reason)
        return True

    def has_work(self) -> bool:
        inflight = self._inflight is not None and any(not c.request.is_finished for c in self._inflight.chunks)
        switching = self.switcher is not None and (self.switcher.active is not None or self.switcher.has_deferred_work)
        return self.scheduler.has_work() or inflight or bool(self._failed) or switching

    def has_inflight(self) -> bool:
        """A dispatched step whose tokens are not read back yet (overlapped scheduling)."""
        return self._inflight is not None

    # --- one step ------------------------------------------------------------------------
    def run_every_program_once(self, full_sampler: bool = True) -> int:
        """Run each compiled program once on an all-padding step (engine/warmup.py)."""
        return run_every_program_once(self, full_sampler)

    def switch_layout(self, dst: str, preempt: bool = False):
        """Start a live switch to layout `dst` (non-blocking); returns a handle with progress.

        Refused (handle.state == REFUSED, handle.reason says why) when the destination cannot
        hold the running requests, unless `preempt` lets it recompute the newest ones later.
        """
        if self.switcher is None:
            raise RuntimeError("layout switching is off: build the engine with enable_switching=True")
        get_layout(dst)
        return self.switcher.start(dst, preempt)

    def switch_done(self) -> bool:
        """No switch in progress."""
        return self.switcher is None or self.switcher.active is None

    def last_switch(self) -> dict | None:
        """The last finished switch (done, refused or cancelled), as its handle's dict."""
        return self.switcher.history[-1].as_dict() if self.switcher is not None and self.switcher.history else None

    def step(self) -> list[CoreOutput]:
        """Schedule and dispatch one step; return the outputs of the step that completed."""
        cpu0, t0 = time.thread_time(), time.perf_counter()
        outputs = []
        if self.overlapped and self._reads_first_tokens_now():  # return its tokens before the next dispatch
            return self._complete_first_tokens(cpu0, t0)
        self._drafts_in_sync = self._drafts_after_the_step_in_flight()
        read_first_ms = 0.0
        if self._drafts_in_sync and self._inflight is not None:  # this step drafts from its tokens
            outputs += self._flush()
            t = time.perf_counter()
            read_first_ms, t0 = (t - t0) * 1e3, t
        if self.switcher is not None:
            self.switcher.before_step()  # drop finished requests' reservations; cancel
        t1 = time.perf_counter()
        if self.config.speculative_k:
            self._set_drafting()
        chunks = self.scheduler.schedule().chunks
        t2 = time.perf_counter()
        dispatched = self._dispatch(chunks) if chunks else None
        t3 = time.perf_counter()
        if dispatched is not None:
            self.dispatch_timing.dispatched(dispatched, t3 - t1)
        if self.switcher is not None:
            # Batch boundary: a finished migration hands off here, after this step (still in the
            # source layout) is queued, so its host work runs while the device computes; the
            # next step is the destination's first. The policy looks here too, for the same reason.
            self.switcher.hand_off_if_ready()
            self._consult_policy()
        t3h = time.perf_counter()
        if self.overlapped:
            done, self._inflight = self._inflight, dispatched
        else:
            done = dispatched
        back_to_back, self._completed_last_call = self._completed_last_call, done is not None
        self._last_wait_s = 0.0
        failures = self.num_step_failures
        if done is not None and done is not dispatched:
            outputs += self._complete(done, back_to_back)  # the previous step: its tokens advance the grammars
        if dispatched is not None and dispatched.logits is not None and self.num_step_failures == failures:
            # its masks fill on the grammar thread; it is sampled at the next dispatch (or at once
            # without overlap), before the forward pass that reads its tokens
            self.grammar_masks.start(dispatched, threaded=self.overlapped)
        if done is not None and done is dispatched:
            outputs += self._complete(done, back_to_back)
        t4 = time.perf_counter()
        phases = {"switch": (t1 - t0) * 1e3, "schedule": (t2 - t1) * 1e3, "dispatch": (t3 - t2) * 1e3,
                  "handoff": (t3h - t3) * 1e3, "wait": self._last_wait_s * 1e3, "complete": (t4 - t3h - self._last_wait_s) * 1e3}
        if read_first_ms:
            phases["read_first"] = read_first_ms  # the step before, read back for this step's n-gram drafts
        self._account(phases, cpu0)
        return outputs + self._failed_now()

    def _complete_first_tokens(self, cpu0: float, t0: float) -> list[CoreOutput]:
        """A step() that only reads back the step in flight (_reads_first_tokens_now); the next
        step() schedules and dispatches with nothing in flight."""
        done, self._inflight = self._inflight, None
        self._last_wait_s = 0.0
        outputs = self._complete(done, self._completed_last_call)
        self._completed_last_call = False  # the next completion's interval holds a dispatch: not back to back
        t = time.perf_counter()
        self._account({"switch": 0.0, "schedule": 0.0, "dispatch": 0.0, "handoff": 0.0, "wait": self._last_wait_s * 1e3,
                       "complete": (t - t0 - self._last_wait_s) * 1e3}, cpu0)
        return outputs + self._failed_now()

    def _account(self, phases: dict[str, float], cpu0: float) -> None:
        self.last_step_ms = phases
        for phase, ms in phases.items():
            self.host_phase_ms[phase] = self.host_phase_ms.get(phase, 0.0) + ms
        self.timeline.host_time(time.thread_time() - cpu0)

    def _reads_first_tokens_now(self) -> bool:
        """Whether the step in flight is read back before the next one is scheduled: it samples a
        request's first token and holds at most --first-token-wait-max-requests requests. Overlapped,
        that token would wait for the host to schedule and launch the next step (at batch 1 a launch
        costs the host about a GPU step), so a fully cached prompt's first token took 2.2-2.8 decode
        steps; read first, the running requests' next step starts one dispatch later, once per such
        step. Not with speculation (its scheduling ahead assumes the step in flight) nor while a
        layout switch runs."""
        step, limit = self._inflight, self.config.first_token_wait_max_requests
        if step is None or not limit or len(step.chunks) > limit or self.config.speculative_k:
            return False
        if self.switcher is not None and self.switcher.active is not None:
            return False
        return any(c.samples and not c.request.output_ids for c in step.chunks)  # (its token still on the device)

    def set_max_step_ms_with_decodes(self, ms: float) -> None:
        """--max-step-ms-with-decodes from the next step on (0: off); step times come from the
        dispatch timing's fit (whichever `dispatch_timing` is current), so it times steps from now."""
        cap = StepTimeCap(ms / 1e3, lambda: self.dispatch_timing.step_cost()) if ms else None
        self.config.max_step_ms_with_decodes = ms
        self.scheduler.step_time_cap = cap
        self.dispatch_timing.enabled = self.dispatch_timing.holds or bool(ms)

    def new_dispatch_timing(self, late: bool, rules=None) -> DispatchTiming:
        """Step timing for late dispatch (steps held when `late`, under `rules`), also on without it
        while --max-step-ms-with-decodes needs its fit of step times."""
        return DispatchTiming(late or bool(self.config.max_step_ms_with_decodes), rules, holds=late)

    def dispatch_delay_s(self) -> float:
        """How long the loop driving step() may still wait for new requests before calling it:
        > 0 only while a long prefill step runs (with --late-dispatch on: any step predicted to run
        10 ms or more; engine/dispatch_timing.py)."""
        if not self.overlapped or self._inflight is None or self.switcher is not None and self.switcher.active:
            return 0.0
        return self.dispatch_timing.delay_s(self._inflight)

    @property
    def overlapped(self) -> bool:
        """Whether steps overlap: asked for, speculation off or overlappable (speculates_ahead), and
        not a step that drafts n-grams from the tokens of the one before (_drafts_in_sync)."""
        return (self.config.overlap_scheduling and (not self.config.speculative_k or self.speculates_ahead)
                and not self._drafts_in_sync)

    def _consult_policy(self) -> None:
        """Let the layout policy start a switch (none in progress, its interval or an arrival due)."""
        if self.policy and self.switcher.active is None and self.policy.due(self.num_steps):
            dst = self.policy.decide(self.num_steps)
            if dst is not None:
                handle = self.switcher.start(dst)
                if handle.state.value == "refused":
                    self.policy.switch_refused(handle.reason)

    def flush(self) -> list[CoreOutput]:
        """Read back the step in flight (if any) and return its outputs; nothing new is dispatched."""
        return self._flush()

    def _flush(self) -> list[CoreOutput]:
        done, self._inflight = self._inflight, None
        self._completed_last_call = False
        return (self._complete(done, back_to_back=False) if done is not None else []) + self._failed_now()

    def set_overlap(self, enabled: bool) -> list[CoreOutput]:
        """Switch overlapped scheduling on or off between steps (returns the flushed outputs)."""
        outputs = self._flush()
        self.config.overlap_scheduling = enabled
        return outputs

    def _failed_now(self) -> list[CoreOutput]:
        failed, self._failed = self._failed, []
        return failed

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn automatic prefix caching on or off while idle (off forgets every cached page), so
        one engine can serve a workload both ways (benchmarks, A/B tests)."""
        if self.scheduler.has_work() or (self.switcher is not None and self.switcher.active is not None):
            raise RuntimeError("set_prefix_caching needs an idle engine (no request, no switch in progress)")
        self._flush()  # a last step whose requests all finished may still be in flight
        if self.switcher is not None:
            self.switcher.free_deferred()  # the last handoff's source pages, due at the next boundary
        self.scheduler.set_prefix_caching(enabled)
        self.config.enable_prefix_caching = enabled

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (as vLLM's reset_prefix_cache); running requests keep theirs."""
        cache = self.scheduler.cache
        if cache is not None:
            for r in self.scheduler.running:
                cache.release(r)  # their nodes go with the tree; they cache nothing more
            cache.clear()

    def kv_capacity_tokens(self, layout_name: str | None = None) -> int:
        """Tokens of distinct requests the pool holds under a layout (the current one by default)."""
        layout = get_layout(layout_name) if layout_name else self.layout
        extra = self.extra_pages if layout.heads_sharded else 0
        return layout_token_capacity(layout.kv_placement, self.n, self.allocator.pages_per_device, extra, self.config.page_size)

    def capacities(self) -> dict:
        """Every layout's capacity on this engine's devices, known before any switch."""
        return layout_capacities(
            self.pool_config, self.n, self.config.page_size, self.page_dtype, self.allocator.pages_per_device,
            self.head_sharded_bytes,
        )

    def stats(self) -> dict:
        """Counters and gauges for dashboards and notebooks (engine/engine_stats.py)."""
        return engine_stats(self)


def _check_mtp(model, path: Path) -> None:
    """--speculative-method mtp needs a checkpoint with an MTP layer: say so before loading."""
    if model is not None:
        cfg = model.cfg
    else:
        try:
            cfg = ModelConfig.from_json(path)
        except (OSError, ValueError):
            return  # the loader reports a missing or bad config.json with its own error
    if not cfg.num_mtp_layers:
        raise ValueError(
            f"--speculative-method mtp needs a checkpoint with a multi-token-prediction layer "
            f"(num_nextn_predict_layers > 0 in config.json, as DeepSeek-V3/R1 ship); "
            f"{path if model is None else 'this model'} has none: use --speculative-method ngram or off")
    if distributed.current() is not None:
        raise ValueError("--speculative-method mtp runs in one process for now (its draft programs are not mirrored)")


def _checkpoint_is_fp8(path: Path) -> bool:
    """Does the folder's config.json declare block-FP8 weights (DeepSeek-V3/R1 releases)?"""
    try:
        return ModelConfig.from_json(path).weight_quant is not None
    except (OSError, ValueError):
        return False  # the loader reports a missing or bad config.json with its own error
