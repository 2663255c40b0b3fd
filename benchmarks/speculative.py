"""Speculative decoding end to end: output tokens per second with n-gram drafts against decoding
one token per step (overlapped), on workloads whose outputs copy from their prompts and on one
whose outputs do not, at low concurrency.

    python -m benchmarks.speculative                                   # bundled model, CPU or GPU
    python -m benchmarks.speculative --batches 1,8 --drafts 0,2,3,4 --max-tokens 160
    python -m benchmarks.speculative --methods ngram,mtp --drafts 0,1,2,3   # the bundled MTP head too
    python -m benchmarks.speculative --methods mtp,mtp-sync --drafts 0,3   # MTP steps overlapped or not

Workloads (greedy, held-out Python standard library files the bundled model never trained on):
  copy   a file's opening, a marker, then its first third again: the model continues by copying
         the rest (what code edits and quotes of retrieved passages look like to a drafter)
  fresh  a file's opening alone: continuations rarely repeat the prompt (drafts mostly miss)
  repeat a file's first four lines, four times: a periodic prompt, which a small model continues
         by repeating (the easiest case for prompt lookup; the bundled model, trained for minutes,
         does not copy code it saw once, so `copy` measures few accepted drafts with it)
Each (workload, batch, K) runs the same requests to completion; K = 0 is speculation off with
overlapped scheduling (the engine's default). Every speculative run's tokens are checked equal
to K = 0's. A cell is --repeats pairs of runs, speculation off then on, back to back; its
speedup is the median of the pairs' ratios (a short run on a small model moves by 30% from run
to run, and drift between pairs cancels). With --speculative-adaptive (the default) each
speculative run follows an unmeasured one of the same requests that trains the engine's draft
budget, as a server's has been trained long before. `speedup` is the whole closed batch, which
ends when its slowest request does: drafts kept unevenly leave a drain of a few requests in
small steps. `full_batch_speedup` is tokens per second over the steps in which every request
decoded (the steady state a server at that concurrency sees), and `tpot_speedup` the median
request's time per output token (after its first) with speculation off over on: what a stream
sees, as benchmarks/speculative_server.py's client measures it. `step_bound` is off's engine steps
over the speculative run's: the run lasts as many steps as its slowest request needs, so a closed
batch gains at most that much even if a speculative step cost what an off step does (1.0: the
slowest request kept no drafts, and no step cost can be made up). --trace keeps each timed run's
steps. Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import logging
import sysconfig
import time
from pathlib import Path

import numpy as np

from benchmarks.common import parse_engine_and_bench, table, write_results
from benchmarks.step_trace import StepTrace, full_batch_rate
from splash_jax.engine import Engine, SamplingParams

log = logging.getLogger("benchmarks.speculative")
HELD_OUT_EVERY = 50  # scripts/train_bundled_model.py holds out every 50th stdlib file


@dataclasses.dataclass
class SpecBench:
    batches: str = "1,8"
    drafts: str = "0,1,2,3,4"  # K per run; 0 = speculation off (overlapped)
    # draft sources to run: ngram and/or mtp (mtp needs a checkpoint with an MTP layer); a -sync suffix
    # (ngram-sync, mtp-sync) runs that method's steps without overlapped scheduling (set_overlap(False));
    # ngram/late, ngram/sync, ngram/ahead run n-gram with that --speculative-ngram-drafts mode;
    # mtp/in-step runs MTP with the draft pass inside greedy step programs (of buckets up to
    # --mtp-drafts-in-step-max-tokens, 512 if that is 0), mtp/apart with the draft program after
    # each step
    methods: str = "ngram"
    workloads: str = "copy,fresh,repeat"
    max_tokens: int = 128
    prompt_chars: int = 1200  # characters of each file's opening
    repeats: int = 3  # (off, on) pairs per cell; the speedup is their median ratio
    trace: bool = False  # keep each timed run's steps (interval, tokens, requests, draft level)


def held_out_files(count: int) -> list[str]:
    """Texts of held-out stdlib files with enough code to copy from."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    out = []
    for path in files[::HELD_OUT_EVERY]:
        text = path.read_text(errors="ignore")
        if len(text) > 3000:
            out.append(text)
        if len(out) == count:
            break
    return out


def prompts(workload: str, count: int, chars: int) -> list[str]:
    texts = [t[:chars] for t in held_out_files(count)]
    if workload == "copy":
        return [t + "\n\n# ---- the same module, reformatted ----\n" + t[: len(t) // 3] for t in texts]
    if workload == "fresh":
        return texts
    if workload == "repeat":
        return ["\n".join([line for line in t.splitlines() if line.strip()][:4] * 4) + "\n" for t in texts]
    raise ValueError(f"unknown workload {workload!r} (copy, fresh, repeat)")


def divergence(outs, refs) -> tuple[int, int | None]:
    """(requests whose tokens differ from the reference, the earliest position where one differs)."""
    firsts = []
    for a, b in zip(outs, refs):
        if a.token_ids != b.token_ids:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                               min(len(a.token_ids), len(b.token_ids))))
    return len(firsts), (min(firsts) if firsts else None)


TRACES: dict[int, StepTrace] = {}  # every engine's step trace, by id(engine)
STEPS: list[dict] = []  # each timed run's steps (in the JSON with --trace)


@dataclasses.dataclass
class Run:
    """One run of the prompts to completion."""

    seconds: float
    outs: list
    full: float | None  # tok/s over the steps in which every request decoded (with a trace)
    tpot: float | None  # the median request's time per output token after its first, seconds
    steps: int = 0  # engine steps the run took (a closed batch lasts as many as its slowest request needs)


@dataclasses.dataclass
class Cell:
    """--repeats pairs (off, then a method at K): medians over the pairs."""

    ratio: float  # output tok/s over off's (the whole closed batch)
    seconds: float
    outs: list
    spec: dict  # the engine's speculative stats after the last run
    offs: list[float]  # off seconds per pair
    ons: list[float]  # on seconds per pair
    full: float | None  # ratio of the full-batch rates
    tpot: float | None  # off's median request TPOT over this method's
    tpot_off: float | None = None  # off's median request TPOT (median over the pairs), seconds
    tpot_on: float | None = None  # this method's
    steps_off: float | None = None  # engine steps per run (median over the pairs)
    steps_on: float | None = None


def median_tpot(outs) -> float | None:
    """The median over requests of (finish - first token) / (tokens - 1): what each stream sees,
    as a server's client measures it (benchmarks/speculative_server.py)."""
    tpots = [o.tpot for o in outs if o.tpot is not None]
    return float(np.median(tpots)) if tpots else None


def run(engine: Engine, texts: list[str], max_tokens: int, timed: str | None = None) -> Run:
    """The prompts to completion; `timed` names a measured run (its steps are kept with --trace)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    trace = TRACES.get(id(engine)) if timed else None
    if trace is not None:
        trace.start()
    steps0 = engine.stats()["num_steps"]
    t = time.perf_counter()
    outs = engine.generate(texts, params)
    seconds = time.perf_counter() - t
    num_steps = engine.stats()["num_steps"] - steps0
    host = trace.host() if trace is not None else None  # (the engine thread's CPU per step, GC pauses)
    steps = trace.stop() if trace is not None else []
    if steps:
        STEPS.append({"run": timed, "batch": len(texts), "seconds": seconds, "host": host, "steps": steps})
    return Run(seconds, outs, full_batch_rate(steps, len(texts)), median_tpot(outs), num_steps)


def split_method(method: str) -> tuple[str, bool, str | None]:
    """'ngram/late-sync' -> (drafter 'ngram', overlapped False, n-gram drafts mode 'late')."""
    name = method.removesuffix("-sync")
    drafter, _, mode = name.partition("/")
    return drafter, name == method, mode or None


def measure(engine: Engine, method: str, k: int, texts: list[str], max_tokens: int) -> tuple[Run, dict]:
    """One timed run (after an unmeasured one when an adaptive draft budget has to learn) ->
    (the run, speculative stats)."""
    drafter, overlapped, mode = split_method(method)
    engine.set_overlap(overlapped)
    default_mode = engine.config.speculative_ngram_drafts  # (the engine's own, for methods that name none)
    engine.config.speculative_ngram_drafts = mode if drafter == "ngram" and mode else default_mode
    in_step = engine.mtp.in_step_max_tokens if engine.mtp is not None else None
    if drafter == "mtp" and mode:  # (the programs compiled at start-up: main's engine)
        engine.mtp.in_step_max_tokens = (engine.config.mtp_drafts_in_step_max_tokens or 512) if mode == "in-step" else 0
    try:
        engine.set_speculative(drafter if k else "off", k or None)
        if k and engine.config.speculative_adaptive:
            engine.reset_prefix_cache()
            run(engine, texts, max_tokens)  # trains the budget (its first steps try each level)
        engine.reset_prefix_cache()  # every run prefills its prompts
        timed = run(engine, texts, max_tokens, timed=f"{method} K={k}")
    finally:
        engine.config.speculative_ngram_drafts = default_mode
        if in_step is not None:
            engine.mtp.in_step_max_tokens = in_step
    return timed, engine.stats()["speculative"] or {}


def _median_ratio(pairs) -> float | None:
    ratios = [a / b for a, b in pairs if a and b]
    return float(np.median(ratios)) if ratios else None


def pair(engine: Engine, base_engine: Engine, method: str, k: int, texts: list[str], max_tokens: int) -> tuple[Run, Run, dict]:
    """One pair: off on base_engine, then `method` at K on engine, back to back -> (off, on, the
    speculative stats after it)."""
    off, _ = measure(base_engine, "off", 0, texts, max_tokens)
    on, spec = measure(engine, method, k, texts, max_tokens)
    return off, on, spec


def cell(engine: Engine, base_engine: Engine, method: str, k: int, texts: list[str], bench: SpecBench) -> Cell:
    """--repeats pairs: off on base_engine, then `method` at K on engine, back to back."""
    return cell_of([pair(engine, base_engine, method, k, texts, bench.max_tokens) for _ in range(bench.repeats)])


def cell_of(pairs: list[tuple[Run, Run, dict]]) -> Cell:
    """Medians over pairs of runs (`pair`); outputs and stats of the last."""
    offs, ons = [a for a, _, _ in pairs], [b for _, b, _ in pairs]
    spec = pairs[-1][2]
    return Cell(_median_ratio((a.seconds, b.seconds) for a, b in zip(offs, ons)) or 0.0,
                float(np.median([r.seconds for r in ons])), ons[-1].outs, spec,
                [r.seconds for r in offs], [r.seconds for r in ons],
                _median_ratio((b.full, a.full) for a, b in zip(offs, ons)),
                _median_ratio((a.tpot, b.tpot) for a, b in zip(offs, ons)),
                _median([r.tpot for r in offs]), _median([r.tpot for r in ons]),
                _median([r.steps for r in offs]), _median([r.steps for r in ons]))


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def main(argv=None):
    bench, config = parse_engine_and_bench(__doc__, SpecBench, argv)
    drafts = [int(x) for x in bench.drafts.split(",")]
    methods = bench.methods.split(",")
    k_max = max(max(drafts), 1)  # logits rows for the largest K
    # K = 0 (and n-gram) on an engine without an MTP layer: an MTP engine runs its MTP pass on every
    # step, speculating or not, so its own K = 0 would understate the baseline.
    engines = {"ngram": Engine(dataclasses.replace(config, speculative_method="ngram", speculative_tokens=k_max))}
    if any(m.startswith("mtp") for m in methods):
        in_step = config.mtp_drafts_in_step_max_tokens or (512 if "mtp/in-step" in methods else 0)
        engines["mtp"] = Engine(dataclasses.replace(config, speculative_method="mtp", speculative_tokens=k_max,
                                                    mtp_drafts_in_step_max_tokens=in_step))
    base_engine = engines["ngram"]
    TRACES.update({id(e): StepTrace(e) for e in engines.values()})
    rows = []
    for workload in bench.workloads.split(","):
        first_base = None  # K = 0 outputs at the first batch: the same prompts lead every larger batch
        for batch in [int(x) for x in bench.batches.split(",")]:
            texts = prompts(workload, batch, bench.prompt_chars)
            for engine in engines.values():
                engine.set_speculative("off")
                run(engine, texts, 8)  # first runs of this batch's buckets
            base_run, _ = measure(base_engine, "off", 0, texts, bench.max_tokens)
            base = base_run.outs
            # the noise floor: one token per step, only the batch around these prompts changed
            differ, first_diff = divergence(base, first_base) if first_base is not None else (None, None)
            first_base = first_base if first_base is not None else base
            runs = [("off", 0, Cell(1.0, base_run.seconds, base, {}, [base_run.seconds], [], 1.0, 1.0, steps_off=base_run.steps,
                                    steps_on=base_run.steps), differ, first_diff)]
            for method in methods:
                for k in (k for k in drafts if k):
                    engine = engines[split_method(method)[0]]
                    c = cell(engine, base_engine, method, k, texts, bench)
                    runs.append((method, k, c, *divergence(c.outs, base)))
            for s in STEPS:
                s.setdefault("workload", workload)
            for method, k, c, differ, first_diff in runs:
                tokens = sum(len(o.token_ids) for o in c.outs)
                spec = c.spec
                adaptive = spec.get("adaptive") or {}
                rows.append({
                    "workload": workload, "batch": batch, "method": method, "K": k, "tok_per_s": tokens / c.seconds,
                    "speedup": c.ratio, "full_batch_speedup": c.full, "tpot_speedup": c.tpot, "tokens": tokens,
                    # steps: a closed batch runs until its slowest request is done, so off's steps over
                    # these are the most it could gain if a speculative step cost what an off step does
                    "steps": c.steps_on, "off_steps": c.steps_off,
                    "step_bound": c.steps_off / c.steps_on if c.steps_on else None,
                    "acceptance": spec.get("acceptance_rate"), "accepted_per_step": spec.get("mean_accepted_per_step"),
                    "histogram": spec.get("accepted_histogram"),
                    "mean_k": adaptive.get("mean_k"), "budget": adaptive or None,
                    "off_seconds": c.offs, "on_seconds": c.ons,
                    "identical": None if k == 0 else differ == 0,
                    # K > 0: against K = 0 in this batch; K = 0: against K = 0 at the first batch
                    "requests_differing": differ, "first_difference_at": first_diff,
                })
                log.info("%s batch %d %s K=%d: %.1f tok/s, %.3fx", workload, batch, method, k, tokens / c.seconds, c.ratio)
    print(table(rows, ["workload", "batch", "method", "K", "tok_per_s", "speedup", "full_batch_speedup", "tpot_speedup", "step_bound",
                       "acceptance", "accepted_per_step", "mean_k", "requests_differing", "first_difference_at"]))
    dtype = str(base_engine.page_dtype)
    write_results("speculative", {"config": dataclasses.asdict(bench), "dtype": dtype, "engine": {
        k: v for k, v in dataclasses.asdict(config).items() if k != "policy"}, "rows": rows}
        | ({"traces": STEPS} if bench.trace else {}))
    check_identical(any(r["identical"] is False for r in rows), dtype, "compare the K = 0 rows, where only the batch changed")


def check_identical(differ: bool, dtype: str, hint: str) -> None:
    """In float32 a speculative output that differs from decoding one token per step is a bug
    (exit); in bfloat16 a verify step's other shapes round differently and a near-tie can flip a
    greedy token, as changing the batch does (a warning)."""
    if not differ:
        return
    message = "a speculative run's tokens differ from decoding one token per step"
    if "float32" in dtype:
        raise SystemExit(message)
    log.warning("%s (%s: %s)", message, dtype, hint)


if __name__ == "__main__":
    main()
