"""What a given draft acceptance buys at each batch size: speculative decoding with a drafter whose
acceptance is set (engine/set_acceptance.py), on a real-size model with dummy weights, whose own
drafts (n-grams, an untrained MTP layer) would say nothing about a trained model's.

    python -m benchmarks.speculative_scaling --shape v2-lite --num-layers 27 --dtype bfloat16
    python -m benchmarks.speculative_scaling --batches 1,4 --max-tokens 16 --context 64 \\
        --max-num-seqs 4 --max-num-batched-tokens 64          # bundled model, quick (CPU)

For each batch: B requests of `context` random prompt tokens (distinct per request), greedy,
ignore_eos, `max_tokens` output tokens; `--seed` (the engine's) also seeds the prompts and the
drafter's decisions. Speculation off runs first (overlapped scheduling, the
engine's default): its outputs are the recorded continuations the drafter replays and its time
the baseline. Then, for each acceptance p and each K, the same requests with the drafter (adaptive
K: after one unmeasured run that trains the engine's draft budget, as a server's has been), in
--repeats pairs (off, on) run back to back; a cell's speedup is the median of its pairs' ratios
(run to run a cell moved by up to 25% at batch 128, and drift between pairs cancels). Prompts
are prefilled once before the runs (a short warm-up run), so the prefix cache serves them to every
measured run; `tok_per_s` is the decode phase (from the step where every request has its first
token to the end), `e2e_tok_per_s` all of it. `full_batch_speedup` compares only the steps in
which all B requests decode: with drafts kept unevenly the requests finish at different steps,
and the drain of the last few (small steps, near the cost of full ones) is in `speedup` but not
in what a server at that concurrency, whose finished requests are replaced, sees. With K drafts per step the engine's acceptance rate
(`measured_acceptance`) is expected at (p + ... + p^K) / K and accepted drafts per step at
p + ... + p^K (`expected_accepted`). `mean_k` is recorded when the engine reports one (adaptive K).

In bfloat16 a verify step's wider matrices round differently, so a near-tie may flip a greedy
token (`requests_differing`, reported; the drafter stops drafting a request that left its
recording); in float32 any difference fails the run. Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from benchmarks.common import build_engine, parse_engine_and_bench, table, write_results
from benchmarks.speculative import check_identical, divergence
from benchmarks.step_trace import StepTrace, full_batch_rate
from splash_jax.engine import Engine, SamplingParams
from splash_jax.engine.set_acceptance import SetAcceptanceDrafter, expected_accepted

log = logging.getLogger("benchmarks.speculative_scaling")


@dataclasses.dataclass
class ScalingBench:
    shape: str = ""  # v2-lite | v3 (dummy weights); empty: the engine's --model (the bundled one)
    num_layers: int = 0  # layers of the shape (0 = all)
    batches: str = "1,8,32,64,128"
    acceptance: str = "0.8,0.3"  # set per-draft acceptance probabilities p
    drafts: str = "3"  # K values (comma-separated) run for each p
    context: int = 1024  # prompt tokens per request
    max_tokens: int = 128  # output tokens per request
    modes: str = "adaptive,fixed"  # adaptive: the engine picks K per step (--speculative-adaptive); fixed: K always
    repeats: int = 3  # (off, on) run pairs per cell; the speedup is the median of their ratios
    profile_steps: int = 0  # >0 (GPU): trace this many decode steps per run; GPU busy vs wall per step
    # Dummy weights only: scale the residual branches' output projections (attention o_proj, MLP
    # and expert down) by this. A random-weight model is chaotic (a rounding difference flips an
    # expert choice, then the next token): in bf16 a verify step's other shapes changed greedy
    # tokens within 1-4 tokens for every request at batch >= 8, and at 0.05 still for half of
    # them, so the drafter's recording stopped predicting the target. At 0 the next token is a
    # function of the current one (a bigram of the embedding and LM head) and no longer flips;
    # every layer still runs, with the same shapes, routing and bytes. 1: off.
    damp: float = 0.0
    trace: bool = False  # keep each timed run's steps (interval, tokens, draft level): where a loss goes


@dataclasses.dataclass
class Outputs:
    token_ids: list[int]


@dataclasses.dataclass
class Run:
    seconds: float  # all of it, prefill included
    decode_seconds: float  # from the step where every request has a token to the end
    decode_tokens: int  # tokens output in that time
    decode_steps: int  # engine steps in that time
    outs: list[Outputs]
    prompts: list[tuple[int, ...]]  # as the requests hold them (the drafter's keys)
    steps: list[tuple] = dataclasses.field(default_factory=list)  # --trace: (ms since the last, tokens, rows, level)
    host: dict = dataclasses.field(default_factory=dict)  # StepTrace.host(): CPU per step, garbage collections


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, trace: StepTrace | None = None) -> Run:
    """The requests to completion, step by step, timing the decode phase apart."""
    if trace is not None:
        trace.start()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.make_request(p, params) for p in prompts]
    tokens = {r.request_id: [] for r in requests}
    t0 = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    left, waiting_first = len(requests), len(requests)
    t1, n1, steps = None, 0, 0
    while left:
        steps += t1 is not None
        for out in engine.step():
            got = tokens.get(out.request_id)
            if got is None:
                continue
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.delta_token_ids and not got:
                waiting_first -= 1
            got += out.delta_token_ids
            left -= out.finished
        if t1 is None and waiting_first == 0:
            t1, n1 = time.perf_counter(), sum(map(len, tokens.values()))
    end = time.perf_counter()
    total = sum(map(len, tokens.values()))
    steps_seen, host = [], {}
    if trace is not None:
        steps_seen, host = trace.stop(), trace.host()
    return Run(end - t0, end - t1, total - n1, steps, [Outputs(tokens[r.request_id]) for r in requests],
               [tuple(r.prompt_ids) for r in requests], steps_seen, host)


def profile(engine: Engine, prompts: list[list[int]], steps: int) -> dict:
    """GPU busy and wall time per engine step in the decode phase of these requests (a profiler
    trace of `steps` steps once every request has its first token); the requests are then aborted."""
    from benchmarks.profiling import device_busy

    params = SamplingParams(max_tokens=10 * steps + 64, ignore_eos=True)
    requests = [engine.make_request(p, params) for p in prompts]
    for r in requests:
        engine.add_request(r)
    firsts: set[str] = set()
    for _ in range(1000):
        firsts |= {o.request_id for o in engine.step() if o.delta_token_ids}
        if len(firsts) == len(requests):
            break
    for _ in range(4):
        engine.step()
    prof = device_busy(engine.step, steps, sync=lambda: engine.flush() and None)
    for r in requests:
        engine.abort(r.request_id)
    while engine.has_work():
        engine.step()
    engine.flush()
    if prof.busy_ms is None:
        return {"step_wall_ms": prof.window_ms}
    return {"gpu_busy_ms": prof.busy_ms, "step_wall_ms": prof.window_ms}  # (the profiler adds host time to the wall)


def rate(r: Run) -> float:
    """Decode-phase output tokens per second."""
    return r.decode_tokens / r.decode_seconds


def damp_residual_branches(engine: Engine, factor: float) -> None:
    """Scale the dummy model's attention o_proj and MLP / expert down projections (see ScalingBench.damp)."""
    ex = engine.executor
    for i, path in enumerate(ex.paths):
        if path[-1] in ("o_proj", "down", "experts_down"):
            ex.params[i] = (ex.params[i] * factor).astype(ex.params[i].dtype)


def random_prompts(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts, distinct per request (no two share a cached page: a shared prefix would
    make the batch's prefill cheaper than real traffic's), avoiding ids 0 and 1 (BOS/EOS of some)."""
    rng = np.random.default_rng([seed, batch])
    out = rng.integers(2, vocab, (batch, context)).tolist()
    if len({tuple(p[:8]) for p in out}) < batch:
        raise ValueError("random prompts share their first tokens: use a longer --context or another --seed")
    return out


def check_room(engine: Engine, batches: list[int], k_max: int) -> None:
    c = engine.config
    for b in batches:
        if b > c.max_num_seqs:
            log.warning("batch %d > --max-num-seqs %d: it runs in waves", b, c.max_num_seqs)
        elif b * (1 + k_max) > min(c.max_num_batched_tokens, engine.max_logits_rows):
            log.warning("batch %d x (1 + K=%d) tokens exceed a step's %d: some requests verify fewer drafts",
                        b, k_max, min(c.max_num_batched_tokens, engine.max_logits_rows))


def main(argv=None):
    bench, config = parse_engine_and_bench(__doc__, ScalingBench, argv,
                                           defaults={"max_num_seqs": 128, "max_num_batched_tokens": 512})
    batches = [int(x) for x in bench.batches.split(",")]
    ps = [float(x) for x in bench.acceptance.split(",")]
    ks = [int(x) for x in bench.drafts.split(",")]
    # logits rows for the largest K: an engine started with speculation (set_speculative fits drafts into them)
    config = dataclasses.replace(config, speculative_method="ngram", speculative_tokens=max(ks))
    engine = build_engine(config, bench.shape, bench.num_layers)
    if bench.shape and bench.damp != 1.0:
        damp_residual_branches(engine, bench.damp)
    check_room(engine, batches, max(ks))
    vocab = engine.model_config.vocab_size
    dtype = str(engine.page_dtype)
    rows, traces = [], []
    tracer = StepTrace(engine)  # each timed run's steps (kept in the JSON with --trace)
    for batch in batches:
        prompts = random_prompts(batch, bench.context, vocab, config.seed)
        engine.config.speculative_adaptive = True
        engine.set_speculative("off")
        run(engine, prompts, 4)  # prefills the prompts into the prefix cache; first runs of the buckets
        base = run(engine, prompts, bench.max_tokens)
        recorded = {p: o.token_ids for p, o in zip(base.prompts, base.outs)}
        base_prof = profile(engine, prompts, bench.profile_steps) if bench.profile_steps else {}
        runs = [(None, 0, None, base, {}, None, base_prof)]
        engine.config.speculative_adaptive = False
        engine.set_speculative("custom", max(ks), drafter=SetAcceptanceDrafter(recorded, 1.0, vocab_size=vocab))
        run(engine, prompts, 8)  # first runs of the verify steps' buckets
        log.info("batch %d off: %.1f tok/s decode", batch, base.decode_tokens / base.decode_seconds)
        for mode in bench.modes.split(","):
            for p in ps:
                for k in ks:
                    drafter = SetAcceptanceDrafter(recorded, p, seed=config.seed, vocab_size=vocab)
                    offs, ons, fulls = [], [], []
                    for pair in range(bench.repeats):  # pairs (off, on) back to back: drift between pairs cancels
                        engine.set_speculative("off")
                        off = run(engine, prompts, bench.max_tokens, tracer)
                        offs.append(rate(off))
                        engine.config.speculative_adaptive = mode == "adaptive"
                        engine.set_speculative("custom", k, drafter=drafter)
                        if mode == "adaptive":  # a server's draft budget has measured its levels long before:
                            run(engine, prompts, bench.max_tokens)  # this run trains it (its first steps try each level)
                        r = run(engine, prompts, bench.max_tokens, tracer)
                        ons.append(rate(r))
                        full_off, full_on = full_batch_rate(off.steps, batch), full_batch_rate(r.steps, batch)
                        if full_off and full_on:
                            fulls.append(full_on / full_off)
                        if bench.trace:
                            budget = (engine.stats()["speculative"] or {}).get("adaptive")
                            traces.append({"batch": batch, "mode": mode, "acceptance": p, "K": k, "pair": pair,
                                           "off": off.steps, "on": r.steps, "budget": budget,
                                           "off_host": off.host, "on_host": r.host})
                    spec = engine.stats()["speculative"] or {}
                    prof = profile(engine, prompts, bench.profile_steps) if bench.profile_steps else {}
                    ratio = float(np.median([b / a for a, b in zip(offs, ons)]))
                    runs.append((p, k, mode, r, spec, drafter, prof | {"pair_speedups": [b / a for a, b in zip(offs, ons)],
                                                                      "speedup": ratio,
                                                                      "full_batch_speedup": float(np.median(fulls)) if fulls else None}))
                    log.info("batch %d %s p=%.2f K=%d: %.1f tok/s decode, %.3fx (median of %d pairs), acceptance %.3f",
                             batch, mode, p, k, rate(r), ratio, bench.repeats, spec.get("acceptance_rate", 0.0))
        for p, k, mode, r, spec, drafter, prof in runs:
            differ, first = divergence(r.outs, base.outs)
            tok_s = r.decode_tokens / r.decode_seconds
            row = {
                "batch": batch, "mode": mode or "off", "acceptance": p, "K": k,
                "measured_acceptance": spec.get("acceptance_rate"), "ahead_chunks": spec.get("ahead_chunks"),
                "accepted_per_step": spec.get("mean_accepted_per_step"),
                "expected_accepted": expected_accepted(p, k) if k else None,
                "tok_per_s": tok_s, "speedup": tok_s / (base.decode_tokens / base.decode_seconds),
                "e2e_tok_per_s": sum(len(o.token_ids) for o in r.outs) / r.seconds,
                "tokens": sum(len(o.token_ids) for o in r.outs), "decode_tokens": r.decode_tokens,
                "seconds": r.seconds, "decode_seconds": r.decode_seconds,
                "histogram": spec.get("accepted_histogram"),
                "requests_differing": None if not k else differ, "first_difference_at": None if not k else first,
                "requests_diverged": drafter.num_diverged if drafter else None,
            }
            adaptive = spec.get("adaptive") or {}
            if adaptive:  # per-step K chosen by the engine (engine/draft_budget.py)
                row["mean_k"] = adaptive["mean_k"]
                row["steps_without_drafts"] = adaptive["steps_without_drafts"]
                row["budget"] = adaptive  # its level and tokens per second by level
            row.update(prof)  # (a speculative row's speedup: the median of its pairs' ratios)
            row["step_ms"] = r.decode_seconds / max(r.decode_steps, 1) * 1e3  # the timed run's (no profiler)
            if prof.get("gpu_busy_ms"):
                row["step_over_busy"] = row["step_ms"] / prof["gpu_busy_ms"]
            rows.append(row)
    engine.set_speculative("off")
    columns = ["batch", "mode", "acceptance", "K", "measured_acceptance", "accepted_per_step", "expected_accepted",
               "tok_per_s", "speedup", "full_batch_speedup", "requests_differing"]
    if any("mean_k" in r for r in rows):
        columns.insert(4, "mean_k")
    columns.append("step_ms")
    if any("step_over_busy" in r for r in rows):
        columns += ["gpu_busy_ms", "step_over_busy"]
    print(table(rows, columns))
    write_results("speculative_scaling", {
        "config": dataclasses.asdict(bench), "dtype": dtype,
        "engine": {k: v for k, v in dataclasses.asdict(config).items() if k != "policy"}, "rows": rows}
        | ({"traces": traces} if traces else {}))
    check_identical(any(r["requests_differing"] for r in rows), dtype, "near-ties round differently in a verify step's shapes")


if __name__ == "__main__":
    main()
