"""Probe for speculative decoding: what a verification step of K drafted tokens per request costs
against a plain decode step, and the draft acceptance rate at which it breaks even.

    python -m benchmarks.probes.verify_cost --shape v2-lite --dtype bfloat16 --kv-memory-gb 20 \\
        --max-num-seqs 32 --max-num-batched-tokens 256
    JAX_PLATFORMS=cpu python -m benchmarks.probes.verify_cost --shape "" --model models/splash-tiny \\
        --dtype float32 --speculative-method mtp --batches 1,2 --drafts 0,3 --context 64 --repeats 2

A verification step runs K + 1 query tokens per request (the last accepted token and K drafts)
against the request's cache: the work of a prefill chunk of K + 1 tokens at the end of a
`context`-token sequence. So each measurement admits B requests whose first `context` tokens
count as cached (benchmarks/harness.py) and whose last K + 1 prompt tokens the next step computes
in one chunk per request, times that one step (GPU busy from a profiler trace; the step alone,
overlapped scheduling off), and aborts them. K = 0 is the plain decode step. With per-token
acceptance a, a step of K drafts yields (1 - a^(K+1)) / (1 - a) tokens, so it pays off when that
exceeds its cost ratio: the break-even a is printed. Writes JSON to benchmarks/results/.

With `--speculative-method mtp` (and `--mtp-layers 1` for a shape without one) every step also
runs the MTP draft program (the MTP pass over the step's tokens and the K-draft chain), which the
profiled window includes: run once without and once with it for what MTP adds to a step. Each
row then also times the draft program alone (`draft_program_ms`: GPU busy per dispatch, None off
GPUs; `draft_window_ms`: wall time per dispatch, dispatched back to back): one more such step
keeps its draft program's inputs, and that program is dispatched again `repeats` times on them
(it writes the same MTP latents again, in pages of requests already aborted).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from benchmarks.common import parse_engine_and_bench, table, write_results
from benchmarks.profiling import device_busy
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, SamplingParams

log = logging.getLogger("benchmarks.probes.verify_cost")


@dataclasses.dataclass
class ProbeConfig:
    shape: str = "v2-lite"  # v2-lite | v3 (dummy weights); "": the engine's --model, its own weights
    num_layers: int = 0  # layers of the slice (0 = the full model)
    mtp_layers: int = -1  # num_nextn_predict_layers of the dummy checkpoint (-1: the shape's own)
    batches: str = "1,8,32"
    drafts: str = "0,1,2,4"  # K; 0 = the plain decode step
    context: int = 1024  # cached tokens before the K + 1 verified ones
    repeats: int = 8  # steps profiled per (batch, K)


def break_even(ratio: float, k: int) -> float | None:
    """Per-token acceptance a at which (1 - a^(k+1)) / (1 - a) tokens per step equal `ratio`."""
    if k == 0:
        return None
    if ratio >= k + 1:
        return 1.0  # not even accepting every draft pays
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < ratio else (lo, mid)
    return lo


def one_step(engine: Engine, batch: int, k: int, context: int, rng) -> None:
    reqs = []
    for i in range(batch):
        prompt = rng.integers(2, engine.model_config.vocab_size, context + k + 1).tolist()
        r = engine.make_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), f"v{batch}-{k}-{i}-{rng.integers(1 << 30)}")
        engine.add_request(r)
        if not engine.scheduler.admit_cached(r, context, reserve=k + 2):
            raise MemoryError(f"{batch} x {context} tokens do not fit")
        reqs.append(r)
    engine.step()  # the K + 1 tokens of every request in one chunk each (overlap off: completes here)
    for r in reqs:
        engine.abort(r.request_id)


def draft_alone(engine: Engine, batch: int, k: int, context: int, rng, repeats: int):
    """The MTP draft program of one such step, alone (see the module docstring): a BusyProfile."""
    runner, kept = engine.mtp, {}

    def keep(tokens):  # runner.fire, keeping what it dispatches on
        kept["armed"], kept["tokens"] = runner._armed, tokens
        type(runner).fire(runner, tokens)

    runner.fire = keep
    try:
        one_step(engine, batch, k, context, rng)
    finally:
        del runner.fire

    def again():
        runner._armed = kept["armed"]
        runner.fire(kept["tokens"])

    again()  # warm
    return device_busy(again, repeats, sync=lambda: jax.block_until_ready(engine.executor.pool))


def main(argv=None):
    c, config = parse_engine_and_bench(__doc__, ProbeConfig, argv, "probe")
    if c.shape:
        overrides = {"num_hidden_layers": c.num_layers} if c.num_layers else {}
        if c.mtp_layers >= 0:
            overrides["num_nextn_predict_layers"] = c.mtp_layers
        config.model, config.load_format = str(shape_folder(c.shape, **overrides)), "dummy"
    config.overlap_scheduling = False
    config.mtp_drafts_in_step_max_tokens = 0  # the draft program after the step, which draft_alone times alone
    engine = Engine(config)
    rng = np.random.default_rng(0)
    rows = []
    for b in [int(x) for x in c.batches.split(",")]:
        base = None
        for k in [int(x) for x in c.drafts.split(",")]:
            one_step(engine, b, k, c.context, rng)  # warm: any first-run cost of this bucket
            busy = device_busy(lambda: one_step(engine, b, k, c.context, rng), c.repeats)
            base = busy.busy_ms if k == 0 else base
            ratio = busy.busy_ms / base if base else None
            rows.append({"batch": b, "drafts": k, "tokens_per_step": b * (k + 1), "busy_ms": busy.busy_ms,
                         "ratio_vs_plain": ratio, "break_even_acceptance": break_even(ratio, k) if ratio else None,
                         "kernels_per_step": busy.kernels})
            rows[-1]["window_ms"] = busy.window_ms  # wall per repeat, admission and abort included
            if engine.mtp is not None:
                draft = draft_alone(engine, b, k, c.context, rng, c.repeats)
                rows[-1].update(draft_program_ms=draft.busy_ms, draft_window_ms=draft.window_ms,
                                draft_kernels=draft.kernels, draft_top_kernels=draft.top)
            log.info("batch %d, K %d: %s ms GPU busy", b, k, busy.busy_ms)
    columns = ["batch", "drafts", "tokens_per_step", "busy_ms", "ratio_vs_plain", "break_even_acceptance"]
    if engine.mtp is not None:
        columns += ["draft_program_ms", "draft_window_ms"]
    print(table(rows, columns))
    write_results("verify_cost", {"config": dataclasses.asdict(c), "engine": dataclasses.asdict(config), "rows": rows})


if __name__ == "__main__":
    main()
