"""Engine configuration: one dataclass, each field also a CLI flag of the same name."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import os
import textwrap
import tokenize
import types
import typing

from splash_jax.policy import PolicyConfig

NGRAM_DRAFTS = ("late", "sync", "ahead")  # --speculative-ngram-drafts (engine/late_drafts.py)


@dataclasses.dataclass
class EngineConfig:
    """How the engine runs a model (the model itself is described by ModelConfig)."""

    model: str = ""  # HF-format folder (config.json, safetensors, tokenizer.json); empty = bundled model
    load_format: str = "auto"  # auto | safetensors | dummy | orbax
    dtype: str = "auto"  # auto (bfloat16 on accelerators, float32 on CPU) | float32 | bfloat16
    # Routed experts in HBM: model (the dtype above) | fp8 (e4m3 + 128x128 block scales, applied in the
    # MoE kernel; from an FP8 checkpoint as stored, from a bf16 one quantized on load) | auto (fp8 for
    # an FP8 checkpoint on a GPU, where the Pallas MoE kernel reads them: measured on an H200; else model).
    expert_weights: str = "auto"
    # SPMD partitioner for the engine's programs: shardy | gspmd | auto (gspmd on GPUs: with jax 0.11.2
    # Shardy's GPU compile segfaulted on owner-layout (dp/dop) steps of 64 tokens per device on 2 H200s,
    # GSPMD compiled the same program in 2.4 s; shardy elsewhere). A process-wide jax setting.
    partitioner: str = "auto"
    attention_impl: str = "auto"  # auto | xla | pallas (Triton) | mosaic (Hopper, >= 64 heads) | pallas_grouped | pallas_tpu
    # Routed experts: auto (the Pallas grouped kernel on GPUs, XLA elsewhere) | xla | pallas (interpret
    # mode off GPUs: tests) | ragged | mgpu (Hopper) | gathered | dense (splash_jax/moe.py; docs/kernels.md)
    moe_impl: str = "auto"
    # A prefill chunk's attention: expanded (the cached latents expanded per head, cuDNN's fused
    # attention on GPUs: 3.4x fewer FLOPs per pair; attention/expanded.py) | absorbed (the decode
    # kernel per token) | auto (expanded on GPUs, absorbed elsewhere). Expanded runs in tp and dp
    # (where a device holds the heads and pages it needs), for chunks with >= N/4 tokens and at least
    # the query-key pairs of an N-token prompt (tokens x context >= N^2), N the count below (one H200,
    # V2-Lite, one-chunk prompts: 512 tokens 10% slower expanded, 1024 4% faster, 4K 1.5x).
    prefill_attention: str = "auto"
    expanded_prefill_min_tokens: int = 1024  # N above: the smallest chunk worth the expanded form
    # Chunks worth the expanded form that one step runs expanded per device, at most (those with the
    # most query-key pairs; the rest absorbed). Fixed shapes: span i gathers and attends at most
    # T/i of the step's T token slots whether used or not (1 + 1/2 + 1/3 + 1/4 = 2.08 T for 4).
    expanded_prefill_spans: int = 4
    page_size: int = 64  # tokens per KV page (a power of two; the GPU kernels want a multiple of 64)
    kv_memory_gb: float | None = None  # per device (base segment); default: kv_memory_fraction of what is left
    kv_memory_fraction: float = 0.9  # of what each device has left after the weights and the largest step program, for the KV pool
    max_pages: int | None = None  # cap on pages per device (tests, benchmarks)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 64  # running requests at most (largest request bucket)
    max_num_batched_tokens: int = 512  # tokens per step at most (largest token bucket)
    min_token_bucket: int = 8  # smallest compiled step (token slots); buckets double up to max_num_batched_tokens
    # Buckets past this many tokens grow by this many instead of doubling (0: powers of two throughout), so a
    # step pads by less than this many tokens, for a few more compiled programs (step_programs.bucket_ladder).
    # Default (None): 1024 on GPUs (one H100, Mooncake-shaped trace, 8192-token steps: TTFT p50 -8%, TPOT p50 -4%,
    # docs/performance.md), 0 elsewhere (each bucket is more compile time; no accelerator measurement).
    token_bucket_gap: int | None = None
    enable_chunked_prefill: bool = True  # long prompts prefill in chunks that share steps with decodes
    # Order of prefill work (engine/prefill_order.py): fcfs (running prefills in admission order, then
    # waiting requests in arrival order) | srpf (running and waiting together: preempted requests first,
    # then those waiting past --max-prefill-wait-s since arrival, oldest first, then fewest prompt tokens
    # left less the aging below) | auto: srpf on GPUs (with the aging and finish-early defaults below and late
    # dispatch, a Mooncake-shaped trace on one H100 had TTFT p50 -13% and -16%, p99 +3% and -2%, the same
    # tok/s: docs/performance.md), fcfs elsewhere (not measured there)
    scheduling_policy: str = "auto"
    max_prefill_wait_s: float = 1.0  # srpf: the age bound above, seconds since the request arrived
    # srpf: prompt tokens a waiting request's rank gains per second waited (None: 7400 on GPUs, about 0.1 s
    # of an H100's V2-Lite prefill per second waited; 0 elsewhere)
    prefill_aging_tokens_per_s: float | None = None
    # A step in which prompts finish their prefill takes other prompts' chunks only up to the step bucket
    # that holds them and the decodes, so their first tokens wait for their own work, not a full budget
    # (auto: on GPUs, as srpf above; on | off)
    prefill_finish_early: str = "auto"
    # While any request decodes, a step's tokens stay within the largest step bucket of at most this many
    # prefill tokens plus the decodes' (no padding to the next bucket), so decodes never wait behind a full
    # --max-num-batched-tokens prefill chunk (0 = no cap); steps without decodes use the whole budget.
    max_prefill_tokens_with_decodes: int = 0
    # While any request decodes, a step's prompt chunks are cut so its predicted device time stays within
    # this many ms (deeper chunks get fewer tokens: they attend to more), bounding how long a decode waits
    # for its next token (a streaming client's stall); predicted from the engine's own timed steps, applied
    # once 16 long steps are timed (engine/step_time_cap.py). Costs TTFT and prefill throughput: on a
    # long-prompt trace (one H100) 80 ms halved the step p99 and raised TTFT and TPOT (docs/performance.md). 0 = off.
    max_step_ms_with_decodes: float = 0.0
    # Automatic prefix caching: full pages stay cached under the exact tokens of the prefix they end
    # and a new request reuses its longest cached prefix (every layout; kept across switches).
    enable_prefix_caching: bool = True
    # Cache-aware owners (dp, dop): among the devices whose pages in use after taking a request stay
    # within this fraction of a device's pages of the lightest, the one holding most of its prefix.
    prefix_balance_fraction: float = 0.125
    # JSON from structured outputs (response_format, structured_outputs.json): compact (", " and ": "
    # separators, no other whitespace: a small model cannot pad it with blank lines until max_tokens)
    # | flexible (any JSON whitespace, llguidance's default)
    structured_json_whitespace: str = "compact"
    layout: str = "tp"  # attention layout: tp | dp | dop | cp (all equal on one device)
    num_devices: int = 1  # devices in the mesh, in jax.devices() order
    enable_switching: bool = False  # precompile every layout and the migration programs
    layout_policy: str = "off"  # off | auto (the transition-aware policy picks layouts; needs switching)
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    # Pages copied per device pair inside each step during a switch, capped so the step's moved
    # pages (N x K pages, all layers) stay under 256 MB per device (migration.in_step_chunk_pages).
    # 2 H200s, V3 width: 64 moved 4x what 16 did per step at the same step overhead (median <= 3.5%).
    switch_chunk_pages: int = 64
    # Pages a switch plans per batch boundary (the start plans the first ones; the copies of
    # planned requests begin while the rest are planned): bounds the host time of any boundary.
    switch_plan_pages: int = 1024
    overlap_scheduling: bool = True  # dispatch step k+1 before step k's tokens reach the host
    # A step in flight that samples some request's first token, with at most this many requests, is
    # read back before the next step is scheduled (EngineCore._reads_first_tokens_now): the first
    # token skips one host dispatch of the next step, and the running requests wait that dispatch
    # once. 0: always overlapped.
    first_token_wait_max_requests: int = 8
    # While a long prefill step runs (engine/dispatch_timing.py), the next step is scheduled only shortly
    # before it is predicted to end (its host time to the launch, with a margin), so requests arriving
    # meanwhile join it instead of waiting for it too. prefill: long prefill steps only | on: decode
    # steps predicted to run 10 ms or more too (on the trace TTFT p50 0.224 s; at 64 steady streams
    # TPOT +2-5%) | off | auto: prefill on accelerators, off on CPU (the "device" shares the host's
    # cores). Step times are fits to tokens, depth and decodes; an idle device at a launch lengthens the
    # lead. With srpf, aging and finish-early it is part of the GPU default above (docs/performance.md).
    late_dispatch: str = "auto"
    # Speculative decoding: off | ngram (drafts from the request's own prompt and output, prompt
    # lookup; no model) | mtp (drafts from the checkpoint's multi-token-prediction layer, DeepSeek-V3's
    # num_nextn_predict_layers, chained K times; loaded only then, its latents in an extra pool layer:
    # engine/mtp_draft.py). Verified exactly in one step of the target model (engine/speculative.py):
    # greedy outputs are those of decoding one token per step, sampled ones follow the target
    # distribution. Steps still overlap (the next is scheduled behind a verify step in flight,
    # engine/spec_scheduling.py) when K fits the start-up's speculative_variants; else they run without.
    speculative_method: str = "off"
    speculative_tokens: int = 3  # K: drafts verified per request per step
    # Drafts per request per step from 0 to --speculative-tokens: the cap whose steps the engine
    # measured making the most tokens per second, none for requests whose drafts are rarely kept
    # (engine/draft_budget.py); off: K drafts whenever they fit.
    speculative_adaptive: bool = True
    speculative_ngram_min: int = 1  # ngram: shortest suffix n-gram matched
    speculative_ngram_max: int = 4  # ngram: longest suffix n-gram matched (tried first)
    # ngram: how a step that drafts follows the step in flight, whose tokens its drafts follow.
    # sync: it reads that step back first, then schedules (the device idles for the host's work);
    # late: scheduled and packed behind it with placeholder drafts that a lookup after its tokens
    # fills just before the launch (engine/late_drafts.py; only the lookups and the launch wait);
    # ahead: drafts after a guess of its tokens (they lag a step: 28-57% of the drafts kept were lost
    # on the bundled model). Level-0 steps overlap in every mode. Default late: on one H100 (bundled model,
    # 4 layers, two runs of 6 cells, 2026-12-07 13:13) it beat sync on its weakest cell (repeat at batch 8:
    # 1.28 / 1.31x against 1.17 / 1.01x) and on the mean of the 12, losing fresh at batch 8 and repeat at 1
    # by 2-7% (docs/speculative.md, "Late-bound n-gram drafts").
    speculative_ngram_drafts: str = "late"
    # mtp: a greedy step of at most this many tokens that wants drafts computes them inside its own
    # step program: one launch a step instead of the step's and its draft program's, and one more
    # step program per such bucket to compile (0: never). Steps with a sampler program, page moves
    # or expanded prefill keep the draft program after them. On one H100 (bundled model, 2026-12-07)
    # it beat the draft program in all 12 cells of two runs: 1.04-2.29x off against 0.83-1.72x.
    mtp_drafts_in_step_max_tokens: int = 512
    max_stop_token_ids: int = 16  # per request; fixes the sampler's suppress-id columns
    max_logit_bias: int = 64  # logit_bias entries per request; fixes the sampler's bias columns
    seed: int = 0  # seeds the dummy weights and the draw of a seed for each request that gives none
    compile_cache_dir: str | None = os.path.join(os.path.expanduser("~"), ".cache", "splash_jax", "xla")  # persistent XLA cache; '' = off
    warmup: bool = True  # compile every bucket at start-up
    # Run every compiled step program once on an all-padding step at start-up (with switching, in
    # every layout): a GPU program's first execution loads its kernels and sets up its collectives,
    # which otherwise lands on the first real step (a switch's handoff step, a benchmark's first
    # run). auto: on GPUs and TPUs with --warmup; off on CPU, where first runs cost little.
    warmup_runs: str = "auto"
    compile_threads: int = 0  # parallel ahead-of-time compiles; 0 = auto: one per CPU on GPU/TPU, 1 on CPU (measured: no gain)
    # Decoder layers under lax.scan (compile time independent of depth); off: unrolled. On GPUs the
    # scanned step gets cuBLAS GEMMs with dynamic-slice fusion (executor.SCANNED_GPU_OPTIONS) and the
    # MoE kernel reads the expert stacks in place; docs/startup.md has the H200 numbers.
    scan_layers: bool = True
    # Scanned GPU step programs of buckets with at most this many token slots get their layer loop
    # unrolled by XLA at compile time: one CUDA graph per step instead of a launch and a graph
    # update per layer, so the launch of a small step no longer decides its latency
    # (executor.UNROLLED_GPU_OPTIONS, docs/kernels.md). 64: at 64 streams on an H200 (V2-Lite) the
    # core's CPU per step fell from 0.78x to 0.49x the GPU step and output tok/s rose 4.6% (one
    # machine, one run: docs/performance.md). Programs that hand logits to a sampler program stay
    # scanned above the fused buckets (executor.unrolled). Bigger steps keep the loop. 0: never.
    unroll_max_tokens: int = 64
    # Full steps (random draws, logprobs, penalties) of buckets with at most this many token slots
    # sample inside the step program (one fused program per bucket and sampler mode) instead of
    # handing their logits to a sampler program: one launch per step, and no program between two
    # steps to move the step's CUDA-graph buffers, which made the host re-record the whole graph
    # every step (batch-1 random sampling on an H200: docs/kernels.md). Grammar-constrained steps
    # keep the sampler program (their masks are filled while the step runs). None: 8 on GPUs, 0
    # (never) elsewhere, where launches cost little and each fused program is 4 more compiles.
    fused_sampler_max_tokens: int | None = None
    # Where a step's packed inputs (one buffer per step, step_packer.step_buffer) are put:
    # pinned_host (the step program moves them to the device itself) | device | auto (pinned_host
    # on GPUs). A host-to-device transfer of a fresh buffer made the next launch wait for the step
    # in flight: batch-1 decode on an H200 left the GPU idle 0.8 ms per step, none from pinned
    # memory (executor.StepExecutor.step_input, benchmarks/probes/launch_cost.py). Steps sampled by
    # a sampler program (random draws, logprobs, penalties) keep device memory (input_sharding).
    step_input_memory: str = "auto"
    # GPU steps run as CUDA graphs: concurrent (the graph keeps only data dependencies, so independent
    # kernels overlap: V2-Lite batch-1 decode on an H200, GPU busy 3.41 -> 2.94 ms per step) | xla
    # (XLA's default: one chain). executor.CONCURRENT_GRAPH_OPTIONS.
    graph_scheduling: str = "concurrent"
    # When a step's CUDA graph is brought up to date with its buffers' addresses: always (XLA's
    # default: every command whose buffers moved since the last call is recorded again, before each
    # launch) | skip-temp (the program's temporaries live at fixed virtual addresses, remapped per
    # call, so the commands that touch only them are never recorded again). compile_options.GRAPH_UPDATE.
    # skip-temp made the program call 7-9% cheaper on an H100 (bundled model, batch 8, two processes;
    # docs/speculative.md); always stays the default until an A/B inside one process confirms it.
    graph_update: str = "always"
    # Move everything alive after start-up (model, compiled programs, jax's caches) out of the
    # garbage collector's reach (gc.freeze). A full collection otherwise walks all of it: 363 ms
    # measured on the CPU mesh with 64 requests running, a stall of whichever step it lands in.
    # auto: on GPUs and TPUs (serving); off on CPU, where tests and notebooks build and drop many
    # engines (frozen objects in reference cycles are never collected).
    gc_freeze: str = "auto"

    @property
    def speculative_variants(self) -> int:
        """Draft variants an ahead verify chunk carries (1 + K; engine/speculative.py): fixed at
        start-up with the step programs' shapes, so set_speculative overlaps K up to this less one."""
        return 1 + self.speculative_tokens if self.speculative_k else 0

    @property
    def speculative_k(self) -> int:
        """Drafts per request per step (0 with speculation off)."""
        return 0 if self.speculative_method == "off" else self.speculative_tokens

    @property
    def max_logits_rows(self) -> int:
        """Logits rows per step the programs are built with: a row per request, and with
        speculation a row per draft too (set_speculative later fits its drafts into these)."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.speculative_k))

    def resolved_gc_freeze(self, backend: str) -> bool:
        if self.gc_freeze not in ("auto", "on", "off"):
            raise ValueError(f"--gc-freeze must be auto, on or off, got {self.gc_freeze!r}")
        return backend != "cpu" if self.gc_freeze == "auto" else self.gc_freeze == "on"

    def resolved_dtype(self, backend: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if backend == "cpu" else "bfloat16"

    def resolved_expert_weights(self, fp8_checkpoint: bool, backend: str) -> str:
        """`auto` keeps an FP8 checkpoint's experts in FP8 on GPUs (the Pallas MoE kernel applies the
        block scales: V3-width MoE layer at batch 128, 5.67 vs 9.76 ms GPU busy on an H200) and
        dequantizes them elsewhere (XLA would dequantize per step); a bf16 checkpoint stays as is."""
        if self.expert_weights not in ("auto", "model", "fp8"):
            raise ValueError(f"--expert-weights must be auto, model or fp8, got {self.expert_weights!r}")
        if self.expert_weights == "auto":
            return "fp8" if fp8_checkpoint and backend == "gpu" else "model"
        return self.expert_weights

    def resolved_warmup_runs(self, backend: str) -> bool:
        if self.warmup_runs not in ("auto", "on", "off"):
            raise ValueError(f"--warmup-runs must be auto, on or off, got {self.warmup_runs!r}")
        if self.warmup_runs == "auto":
            return self.warmup and backend != "cpu"
        return self.warmup_runs == "on"

    def resolved_fused_sampler_max_tokens(self, platform: str) -> int:
        """None (auto): 8 token slots on GPUs, 0 elsewhere (see fused_sampler_max_tokens)."""
        if self.fused_sampler_max_tokens is None:
            return 8 if platform == "gpu" else 0
        return self.fused_sampler_max_tokens

    def resolved_prefill_order(self, platform: str) -> tuple[str, float, bool]:
        """(policy, aging tokens per second, finish early) with auto resolved: srpf, 7400, on on GPUs;
        fcfs, 0, off elsewhere (see scheduling_policy)."""
        if self.scheduling_policy not in ("auto", "fcfs", "srpf"):
            raise ValueError(f"--scheduling-policy must be auto, fcfs or srpf, got {self.scheduling_policy!r}")
        gpu = platform == "gpu"
        policy = ("srpf" if gpu else "fcfs") if self.scheduling_policy == "auto" else self.scheduling_policy
        aging = (7400.0 if gpu else 0.0) if self.prefill_aging_tokens_per_s is None else self.prefill_aging_tokens_per_s
        if self.prefill_finish_early not in ("auto", "on", "off"):
            raise ValueError(f"--prefill-finish-early must be auto, on or off, got {self.prefill_finish_early!r}")
        finish = gpu if self.prefill_finish_early == "auto" else self.prefill_finish_early == "on"
        return policy, aging, finish

    def resolved_token_bucket_gap(self, platform: str) -> int:
        """None (auto): 1024 tokens on GPUs, 0 (buckets double) elsewhere (see token_bucket_gap)."""
        if self.token_bucket_gap is None:
            return 1024 if platform == "gpu" else 0
        return self.token_bucket_gap

    def resolved_step_input_memory(self, platform: str) -> str:
        """auto: pinned host memory on GPUs (see step_input_memory), device memory elsewhere."""
        if self.step_input_memory == "auto":
            return "pinned_host" if platform == "gpu" else "device"
        return self.step_input_memory

    def resolved_expanded_min_tokens(self, backend: str) -> int:
        """N of attention/expanded.worth_expanding (which chunks run in the expanded form); 0: never."""
        if self.prefill_attention not in ("auto", "expanded", "absorbed"):
            raise ValueError(f"--prefill-attention must be auto, expanded or absorbed, got {self.prefill_attention!r}")
        if self.expanded_prefill_min_tokens < 1:
            raise ValueError(f"--expanded-prefill-min-tokens must be >= 1, got {self.expanded_prefill_min_tokens}")
        if not 1 <= self.expanded_prefill_spans <= 16:
            raise ValueError(f"--expanded-prefill-spans must be in [1, 16], got {self.expanded_prefill_spans}")
        on = self.prefill_attention == "expanded" or (self.prefill_attention == "auto" and backend == "gpu")
        return self.expanded_prefill_min_tokens if on else 0

    def resolved_partitioner(self, backend: str) -> str:
        if self.partitioner not in ("auto", "shardy", "gspmd"):
            raise ValueError(f"--partitioner must be auto, shardy or gspmd, got {self.partitioner!r}")
        if self.partitioner == "auto":
            return "gspmd" if backend == "gpu" else "shardy"
        return self.partitioner

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"--page-size must be a power of two, got {self.page_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("--max-num-batched-tokens must be >= --max-num-seqs >= 1")
        if self.first_token_wait_max_requests < 0:
            raise ValueError(f"--first-token-wait-max-requests must be >= 0 (0: off), got {self.first_token_wait_max_requests}")
        if self.token_bucket_gap is not None and self.token_bucket_gap < 0:
            raise ValueError(f"--token-bucket-gap must be >= 0 (0: buckets double), got {self.token_bucket_gap}")
        from splash_jax.moe import MOE_IMPLS

        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"--moe-impl must be one of {', '.join(MOE_IMPLS)}, got {self.moe_impl!r}")
        if self.structured_json_whitespace not in ("compact", "flexible"):
            raise ValueError(f"--structured-json-whitespace must be compact or flexible, got {self.structured_json_whitespace!r}")
        if self.graph_scheduling not in ("concurrent", "xla"):
            raise ValueError(f"--graph-scheduling must be concurrent or xla, got {self.graph_scheduling!r}")
        from splash_jax.engine.compile_options import GRAPH_UPDATE

        if self.graph_update not in GRAPH_UPDATE:
            raise ValueError(f"--graph-update must be one of {', '.join(GRAPH_UPDATE)}, got {self.graph_update!r}")
        if self.step_input_memory not in ("auto", "pinned_host", "device"):
            raise ValueError(f"--step-input-memory must be auto, pinned_host or device, got {self.step_input_memory!r}")
        if self.fused_sampler_max_tokens is not None and self.fused_sampler_max_tokens < 0:
            raise ValueError(f"--fused-sampler-max-tokens must be >= 0, got {self.fused_sampler_max_tokens}")
        if self.unroll_max_tokens < 0:
            raise ValueError(f"--unroll-max-tokens must be >= 0, got {self.unroll_max_tokens}")
        if self.layout_policy not in ("off", "auto"):
            raise ValueError(f"--layout-policy must be off or auto, got {self.layout_policy!r}")
        from splash_jax.engine.speculative import LIBRARY_METHODS, METHODS

        if self.speculative_method not in LIBRARY_METHODS:
            raise ValueError(f"--speculative-method must be one of {', '.join(METHODS)}, got {self.speculative_method!r}")
        if self.speculative_ngram_drafts not in NGRAM_DRAFTS:
            raise ValueError(f"--speculative-ngram-drafts must be one of {', '.join(NGRAM_DRAFTS)}, "
                             f"got {self.speculative_ngram_drafts!r}")
        if self.speculative_method != "off" and not 1 <= self.speculative_tokens <= 16:
            raise ValueError(f"--speculative-tokens must be in [1, 16], got {self.speculative_tokens}")
        if self.layout_policy == "auto" and not self.enable_switching:
            raise ValueError("--layout-policy auto needs --enable-switching")
        from splash_jax.engine.prefill_order import PrefillOrder

        PrefillOrder.of(self)  # raises on a bad policy, age bound or cap
        from splash_jax.engine.dispatch_timing import resolved

        resolved(self.late_dispatch, "cpu")  # raises on an unknown mode
        if not self.max_step_ms_with_decodes >= 0:
            raise ValueError(f"--max-step-ms-with-decodes must be >= 0, got {self.max_step_ms_with_decodes}")

    # --- CLI ---------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_args(parser.add_argument_group("engine"), cls)
        add_dataclass_args(parser.add_argument_group("layout policy"), PolicyConfig, prefix="policy_")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "policy"}
        policy = PolicyConfig(**{f.name: getattr(args, "policy_" + f.name) for f in dataclasses.fields(PolicyConfig)})
        return cls(**values, policy=policy)


def field_docs(cls) -> dict[str, str]:
    """Each field's comment in the class source (the comment lines right above it, then the one at
    the end of its line): the config's comments are its flags' --help, so they cannot drift apart."""
    names = {f.name for f in dataclasses.fields(cls)}
    docs, above, line_comment, field = {}, [], {}, {}
    source = textwrap.dedent(inspect.getsource(cls))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        row = tok.start[0]
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if row in field:
                line_comment[row] = text
            else:
                above.append(text)
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in names and row not in field:
            field[row] = tok.string
            docs[tok.string] = above
            above = []
        elif tok.type == tokenize.NL and tok.start[1] == 0 and row not in field:
            above = []  # a blank line ends a comment block
    for row, name in field.items():
        docs[name] = " ".join(docs[name] + ([line_comment[row]] if row in line_comment else []))
    return docs


def add_dataclass_args(group, cls, prefix: str = "") -> None:
    """One flag per field (`--field-name`, booleans as --x/--no-x), its help the field's comment;
    nested dataclasses are skipped."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        kind = _base_type(hints[f.name])
        if dataclasses.is_dataclass(kind):
            continue
        flag = "--" + (prefix + f.name).replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if kind is bool:  # BooleanOptionalAction appends the default itself
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=doc)
        else:
            group.add_argument(flag, type=kind, default=default, help=f"{doc} (default: %(default)s)".lstrip())


def _base_type(hint):
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint
