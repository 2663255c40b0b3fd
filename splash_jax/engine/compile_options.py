"""XLA options for the step programs, passed per compile (a notebook's other programs keep their
own): what each buys on GPUs is measured where it is defined (docs/kernels.md, docs/startup.md)."""

from __future__ import annotations

# Scanned layers on GPUs: a layer's weights are slices of the stacks, and XLA copies a slice whole
# before a Triton GEMM fusion reads it (~62 MB per V2-Lite layer, 1.15 ms per step at 27 layers
# on an H200). cuBLAS GEMMs with dynamic-slice fusion read the slice in place: with these options
# the scanned step measured 5.46 / 11.06 / 12.92 ms at batch 1 / 32 / 128 (unrolled default
# 6.00 / 10.73 / 12.95; docs/startup.md). The Pallas kernels are not affected.
SCANNED_GPU_OPTIONS = {
    "xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True,
    # XLA merges dots that share an input (gate|up of the shared experts, q|kv_a) by concatenating
    # their weights, which for weights sliced from the layer stacks is a copy every layer of every
    # step: 11.5 + 9.5 us per layer at 8 tokens on an H200 (V2-Lite decode, --top-kernels). Off.
    "xla_gpu_dot_merger_threshold_mb": 0,
}
# XLA's rematerialization pass, off for GPU step programs. Its memory model counts each layer's
# weight slices of an XLA-unrolled scan (the small buckets, UNROLLED_GPU_OPTIONS) as new buffers:
# V2-Lite 27 layers on an H200 estimated 115.6 GiB against a 73.8 GiB limit ("Can't reduce memory
# use below ..."), and its attempt left the program with 6.35 GiB of temporaries (about 200 cuBLAS
# workspaces of 32 MiB that buffer assignment could no longer share) where the same program without
# the pass needs 0.078 GiB (benchmarks/probes/compile_memory.py, docs/startup.md). The engine reads
# every program's real need from memory_analysis() (StepExecutor.program_temp_bytes) instead.
NO_REMAT_GPU_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}
# Options a different XLA may not know or may spell differently: a compile that refuses one runs
# without it (logged once), instead of failing the engine.
OPTIONAL_OPTIONS = ("xla_gpu_enable_command_buffer", "xla_gpu_command_buffer_update_mode", "xla_gpu_dot_merger_threshold_mb",
                    "xla_gpu_command_buffer_scheduling_mode", "xla_gpu_graph_enable_concurrent_region",
                    "xla_gpu_enable_while_loop_unrolling", "xla_disable_hlo_passes")

# Small scanned steps get their layer loop unrolled by XLA at compile time (after JAX traced one
# layer, so tracing stays independent of depth). A scanned loop is launched from the host one
# iteration at a time, and each iteration's CUDA graph is updated for the next layer's weight
# slices: the launch of a V2-Lite 27-layer decode step cost the host 3.4-3.6 ms for 1.8 ms of GPU
# work; unrolled by XLA, one graph, 0.66-0.72 ms (benchmarks/probes/launch_cost.py, one H200).
UNROLLED_GPU_OPTIONS = {"xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_FULL_UNROLL"}

# A step is captured in CUDA graphs (XLA command buffers). By default XLA records its kernels as one
# chain; with these options the graph keeps only the data dependencies, so independent kernels run
# side by side (the shared experts beside the router and routed experts, q_proj beside kv_a, ...).
# At batch 1 most kernels are a few microseconds and fill a fraction of the GPU. V2-Lite 27 layers,
# one H200: GPU busy 3.41 -> 2.94 ms at batch 1 x 1K, 11.85 -> 11.16 ms at batch 128 x 1K
# (benchmarks/decode_roofline, --graph-scheduling concurrent vs xla).
CONCURRENT_GRAPH_OPTIONS = {
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    "xla_gpu_graph_enable_concurrent_region": True,
}
GRAPH_SCHEDULING = ("concurrent", "xla")

# A CUDA graph records its kernels' buffer addresses. Before each launch XLA compares them with the
# call's buffers and records again every command whose buffers moved (`command_buffer::update`:
# 0.35 ms of host time per V2-Lite batch-1 decode step on an H200, docs/kernels.md). With SKIP_TEMP
# the program's temporaries are mapped at the same virtual addresses every call, so only commands
# that read the inputs or write the outputs are recorded again. --graph-update.
GRAPH_UPDATE = {"always": "ALWAYS_UPDATE", "skip-temp": "SKIP_TEMP"}


# Expanded-prefill programs loop over the prefix in blocks (attention/expanded.py): a while loop
# whose trip count XLA reads back on the host each iteration, stalling the stream every layer.
# Captured in a CUDA graph (command buffer, conditional nodes) the loop runs on the device alone:
# V2-Lite 27 layers, one H200, one-chunk prefills of 256 / 1024 / 4096 tokens 18.1 / 30.4 / 82.8 ->
# 16.1 / 28.0 / 74.8 ms (benchmarks/prefill.py, XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL).
# Per-compile options take no +/- modifiers: XLA's default command types, plus the two.
EXPANDED_GPU_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
}


def step_compiler_options(backend: str, scan_layers: bool, expanded: bool = False,
                          graph_scheduling: str = "concurrent", unrolled: bool = False,
                          graph_update: str = "always") -> dict:
    """XLA options for the step programs (per compile, so a notebook's other programs keep theirs).
    unrolled: XLA unrolls the scanned layer loop (UNROLLED_GPU_OPTIONS)."""
    if graph_scheduling not in GRAPH_SCHEDULING:
        raise ValueError(f"--graph-scheduling must be one of {GRAPH_SCHEDULING}, got {graph_scheduling!r}")
    if graph_update not in GRAPH_UPDATE:
        raise ValueError(f"--graph-update must be one of {tuple(GRAPH_UPDATE)}, got {graph_update!r}")
    options = dict(SCANNED_GPU_OPTIONS) if backend == "gpu" and scan_layers else {}
    if backend == "gpu":
        options.update(NO_REMAT_GPU_OPTIONS)
    if backend == "gpu" and scan_layers and unrolled:
        options.update(UNROLLED_GPU_OPTIONS)
    if backend == "gpu" and expanded:
        options.update(EXPANDED_GPU_OPTIONS)
    if backend == "gpu" and graph_scheduling == "concurrent":
        options.update(CONCURRENT_GRAPH_OPTIONS)
    if backend == "gpu" and graph_update != "always":
        options["xla_gpu_command_buffer_update_mode"] = GRAPH_UPDATE[graph_update]
    return options
