"""Decode step time against the memory roofline, and how long the device waits on the host.

    python -m benchmarks.decode_roofline --shape v2-lite --batches 1,32,128 --contexts 1024,4096

For each (batch, context) and each `--sampling` mode (greedy; random = temperature 1; top-p;
top-k-top-p; logprobs = top-p with 5 top logprobs): `batch` requests whose first `context` tokens are already "in the
cache" (pages allocated, contents random: the work per step is identical) decode through the
real engine loop (schedule, pack, dispatch, read back, stop checks), with overlapped scheduling
and without it, in the same run. Reported per step and mode:
  engine_ms   wall time of engine.step() (host + device, as served)
  gpu_busy_ms union of kernel intervals on the GPU streams, from a jax.profiler trace
  x_busy      engine_ms / gpu_busy_ms: 1.0 = the GPU never waits (launch gaps count as waiting)
  host_share  1 - gpu_busy_ms / engine_ms (not clamped: a negative value means the trace and
              the wall clock disagree, and is shown as it is)
  roofline_ms bytes that must be read (weights actually used + KV) / measured copy bandwidth
Weights "used" counts only experts a batch of this size is expected to touch (an ideal
engine); `dense_ms` is the roofline for this engine's dense-over-experts MoE, which reads all.
"""

from __future__ import annotations

import argparse
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import table, write_results
from benchmarks.harness import SAMPLING, clear, inject_decoding
from benchmarks.profiling import device_busy
from benchmarks.shapes import shape_with_tokenizer
from splash_jax.engine import Engine, EngineConfig

log = logging.getLogger("benchmarks.decode_roofline")


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes/s of a device copy (read + write), the practical HBM ceiling."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / float(np.median(times))


def weight_bytes(model, batch: int) -> tuple[float, float]:
    """(bytes an ideal engine reads per decode step, bytes this dense-MoE engine reads)."""
    cfg = model.cfg
    total = 0.0
    experts = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        n = var[...].nbytes
        total += n
        if str(path[-1]).startswith("experts_"):
            experts += n
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch) if e else 0
    ideal = total - experts + (experts * touched / e if e else 0)
    embed = cfg.vocab_size * cfg.hidden_size * 2  # only `batch` rows of the embedding are read
    return ideal - embed, total - embed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="v2-lite")
    parser.add_argument("--num-layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--tokenizer", default=None, help="a model folder whose tokenizer (and vocabulary size) the shape takes")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the engine's (default: the largest batch)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's (default: the largest batch)")
    parser.add_argument("--max-model-len", type=int, default=None, help="the engine's (default: the longest context + 128)")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--attention-impl", default="auto")
    parser.add_argument("--kv-memory-gb", type=float, default=24.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--min-token-bucket", type=int, default=8,
                        help="smallest step (the engine's default, 8); 1: batch-1 decode runs a 1-token step")
    parser.add_argument("--layout", default="tp")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--expert-weights", default="auto", help="auto | model | fp8 (routed experts in HBM)")
    parser.add_argument("--top-kernels", type=int, default=8, help="kernel names to report per row (by GPU time)")
    parser.add_argument("--graph-scheduling", default="concurrent",
                        help="concurrent | xla: how a GPU step's CUDA graph orders its kernels (EngineConfig)")
    parser.add_argument("--graph-update", default=EngineConfig.graph_update,
                        help="always | skip-temp: when a GPU step's CUDA graph is recorded again (EngineConfig)")
    parser.add_argument("--sampling", default="greedy",
                        help=f"comma list of the requests' sampling modes, each measured in the same run: {', '.join(SAMPLING)}")
    parser.add_argument("--no-sync", action="store_true", help="measure overlapped scheduling only")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="decoder layers under lax.scan (the engine's default) or unrolled")
    parser.add_argument("--unroll-max-tokens", type=int, default=EngineConfig.unroll_max_tokens,
                        help="buckets up to this many tokens get XLA's unrolled layer loop (EngineConfig)")
    parser.add_argument("--step-input-memory", default=EngineConfig.step_input_memory,
                        help="auto | pinned_host | device: where a step's packed input is put (EngineConfig)")
    parser.add_argument("--fused-sampler-max-tokens", type=int, default=EngineConfig.fused_sampler_max_tokens,
                        help="full steps of buckets up to this many tokens sample inside the step (EngineConfig; default: auto)")
    parser.add_argument("--compile-cache-dir", default="", help="persistent XLA cache ('': off, so compile times are cold)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)

    batches = [int(b) for b in args.batches.split(",")]
    samplings = args.sampling.split(",")
    for mode in samplings:
        if mode not in SAMPLING:
            parser.error(f"unknown --sampling {mode!r}; choose from {', '.join(SAMPLING)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    overrides = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
    folder = shape_with_tokenizer(args.shape, args.tokenizer, **overrides)
    bw = copy_bandwidth()
    log.info("copy bandwidth %.0f GB/s", bw / 1e9)
    engine = Engine(EngineConfig(
        model=str(folder), load_format="dummy", dtype=args.dtype, attention_impl=args.attention_impl,
        page_size=64, kv_memory_gb=args.kv_memory_gb, max_model_len=args.max_model_len or max(contexts) + 128,
        max_num_seqs=args.max_num_seqs or max(batches),
        max_num_batched_tokens=args.max_num_batched_tokens or max(max(batches), 8), warmup=False,
        layout=args.layout, num_devices=args.devices,
        min_token_bucket=args.min_token_bucket, scan_layers=args.scan_layers, expert_weights=args.expert_weights,
        graph_scheduling=args.graph_scheduling, graph_update=args.graph_update, unroll_max_tokens=args.unroll_max_tokens,
        step_input_memory=args.step_input_memory, compile_cache_dir=args.compile_cache_dir,
        fused_sampler_max_tokens=args.fused_sampler_max_tokens,
    ))
    cfg = engine.model_config
    rows = []
    for ctx, b, mode in ((c, b, m) for c in contexts for b in batches for m in samplings):
        reqs = inject_decoding(engine, b, ctx, sampling=mode)
        t = time.perf_counter()
        engine.step()  # compiles this bucket the first time
        first_step_s = time.perf_counter() - t
        log.info("batch %d ctx %d %s: first step %.1fs", b, ctx, mode, first_step_s)
        for overlap in (True,) if args.no_sync else (True, False):
            engine.set_overlap(overlap)
            for _ in range(3):
                engine.step()
            t, cpu, phases = time.perf_counter(), time.thread_time(), []
            for _ in range(args.steps):
                engine.step()
                phases.append(dict(engine.last_step_ms))
            engine_s = (time.perf_counter() - t) / args.steps
            host_cpu_ms = (time.thread_time() - cpu) / args.steps * 1e3
            prof = device_busy(engine.step, args.steps, sync=lambda: (engine.flush(), jax.block_until_ready(engine.executor.kv)),
                                top=args.top_kernels)
            ideal_w, dense_w = weight_bytes(engine.model, b)
            kv_bytes = b * (ctx + args.steps) * cfg.latent_dim * 2 * cfg.num_layers
            busy = prof.busy_ms
            row = {
                "batch": b, "context": ctx, "sampling": mode, "overlap": overlap, "first_step_s": first_step_s,
                "engine_ms": engine_s * 1e3, "gpu_busy_ms": busy, "profiled_step_ms": prof.window_ms,
                "x_busy": engine_s * 1e3 / busy if busy else None,
                # the engine thread's CPU time per step (any spinning while it waits on the device counts)
                "host_cpu_ms": host_cpu_ms, "cpu_over_busy": host_cpu_ms / busy if busy else None,
                "phase_ms_p50": {k: float(np.median([p.get(k, 0.0) for p in phases])) for k in phases[0]},
                "host_share": 1 - busy / (engine_s * 1e3) if busy else None,
                "kernels_per_step": prof.kernels, "tokens_per_s": b / engine_s,
                "roofline_ms": (ideal_w + kv_bytes) / bw * 1e3,
                "dense_ms": (dense_w + kv_bytes) / bw * 1e3,
                "top_kernels_us": prof.top,  # (name, us per step, launches per step)
            }
            row["x_roofline"] = row["engine_ms"] / row["roofline_ms"]
            row["hlo_conditionals"] = sum(
                text.count(" conditional(") for text in (p.as_text() for p in engine.executor._compiled.values())
            )
            rows.append(row)
            log.info("%s", {k: v for k, v in row.items() if k != "top_kernels_us"})
        engine.set_overlap(True)
        clear(engine, reqs)
        engine.flush()
    cols = ["batch", "context", "sampling", "overlap", "first_step_s", "engine_ms", "gpu_busy_ms", "x_busy", "host_cpu_ms", "cpu_over_busy", "host_share", "kernels_per_step",
            "tokens_per_s", "roofline_ms", "x_roofline"]
    print(table(rows, cols))
    write_results("decode_roofline", {
        "args": vars(args), "copy_bandwidth_GBps": bw / 1e9, "attention_impl": args.attention_impl,
        "resolved_attention": __import__("splash_jax.attention.dispatch", fromlist=["x"]).resolve_impl(args.attention_impl),
        "rows": rows,
    })


if __name__ == "__main__":
    main()
