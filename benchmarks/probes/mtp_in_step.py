"""Probe: MTP steps with the draft pass inside the step program against the draft program after
it, on one engine, at a few batch sizes (docs/speculative.md, "Drafts inside the step program").

    python -m benchmarks.probes.mtp_in_step --shape v2-lite --num-layers 27 --dtype bfloat16 \\
        --kv-memory-gb 20 --max-num-seqs 32 --max-num-batched-tokens 512 --batches 1,8,32
    JAX_PLATFORMS=cpu python -m benchmarks.probes.mtp_in_step --shape= --model models/splash-tiny \\
        --batches 1,2 --max-tokens 16 --repeats 1

With dummy weights (a --shape with one MTP layer) the drafts are random and rarely kept, so this
times what drafting costs, not what it buys: the draft budget is off (K drafts every step) and each
row is output tokens per second of `batch` requests decoding `--max-tokens` tokens after a
`--context`-token random prompt, the two paths alternated `--repeats` times (`in_step` with
--mtp-drafts-in-step-max-tokens 512, `apart` with 0; programs of the path not compiled at start-up
compile during the unmeasured first round). Greedy outputs of the two paths are checked equal
(`outputs_equal`; bf16 near-ties can flip a token). Prints a table and writes JSON to
benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from benchmarks.common import parse_engine_and_bench, table, write_results
from benchmarks.shapes import shape_folder
from splash_jax.engine import Engine, SamplingParams

log = logging.getLogger("benchmarks.probes.mtp_in_step")


@dataclasses.dataclass
class ProbeConfig:
    shape: str = "v2-lite"  # v2-lite | v3 (dummy weights, one MTP layer); "": the engine's --model
    num_layers: int = 0  # with --shape: layers of the slice (0 = the full model)
    batches: str = "1,8,32"
    context: int = 256  # prompt tokens per request
    max_tokens: int = 64  # tokens decoded per request
    repeats: int = 3  # (in_step, apart) rounds per batch, alternated; medians reported


def decode(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds from every request's first token to the last token, outputs) of one closed batch."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    ids = [engine.add_request(p, params) for p in prompts]
    out = {i: [] for i in ids}
    first = None
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.delta_token_ids
        if first is None and all(out[i] for i in ids):
            first = time.perf_counter()
    return time.perf_counter() - first, [out[i] for i in ids]


def main(argv=None):
    c, config = parse_engine_and_bench(__doc__, ProbeConfig, argv, "probe")
    if c.shape:
        overrides = {"num_nextn_predict_layers": 1}
        if c.num_layers:
            overrides["num_hidden_layers"] = c.num_layers
        config.model, config.load_format = str(shape_folder(c.shape, **overrides)), "dummy"
    config.speculative_method, config.speculative_adaptive = "mtp", False
    config.mtp_drafts_in_step_max_tokens = config.mtp_drafts_in_step_max_tokens or 512
    engine = Engine(config)
    limit = config.mtp_drafts_in_step_max_tokens
    rng = np.random.default_rng(0)
    rows = []
    for batch in [int(x) for x in c.batches.split(",")]:
        prompts = [rng.integers(2, engine.model_config.vocab_size, c.context).tolist() for _ in range(batch)]
        times, outs = {"in_step": [], "apart": []}, {}
        for rnd in range(c.repeats + 1):  # round 0 unmeasured (first runs, compiles)
            for path in ("in_step", "apart") if rnd % 2 == 0 else ("apart", "in_step"):
                engine.mtp.in_step_max_tokens = limit if path == "in_step" else 0
                before = engine.stats()["speculative"]["mtp_launches"]
                seconds, outs[path] = decode(engine, prompts, c.max_tokens)
                after = engine.stats()["speculative"]["mtp_launches"]
                if rnd:
                    times[path].append(seconds)
                log.info("batch %d %s: %.3f s (%s)", batch, path, seconds,
                         {k: after[k] - before[k] for k in after})
        engine.mtp.in_step_max_tokens = limit
        tokens = batch * (c.max_tokens - 1)
        t_in, t_apart = float(np.median(times["in_step"])), float(np.median(times["apart"]))
        rows.append({"batch": batch, "in_step_tok_s": tokens / t_in, "apart_tok_s": tokens / t_apart,
                     "in_step_over_apart": t_apart / t_in, "outputs_equal": outs["in_step"] == outs["apart"],
                     "in_step_s": times["in_step"], "apart_s": times["apart"]})
    print(table(rows, ["batch", "in_step_tok_s", "apart_tok_s", "in_step_over_apart", "outputs_equal"]))
    write_results("mtp_in_step", {"config": dataclasses.asdict(c), "engine": dataclasses.asdict(config), "rows": rows})


if __name__ == "__main__":
    main()
