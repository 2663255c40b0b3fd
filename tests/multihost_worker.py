"""One process of a multi-process engine on CPU, for tests/test_multihost.py.

    python tests/multihost_worker.py --process-id 0 --num-processes 2 --coordinator-address 127.0.0.1:PORT \
        --model DIR --layout dp --switches tp,dop --out result.json

Process 0 runs the workload (workload() below, shared with the single-process reference) and writes
the generated token ids to --out; the others follow its command stream. Sets its own device count
and CPU collectives, so it must run as a fresh interpreter.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"


def engine_kwargs(model: str, layout: str, switching: bool) -> dict:
    return dict(
        model=model, layout=layout, num_devices=8, page_size=8, max_num_seqs=4, max_num_batched_tokens=16,
        max_pages=24, compile_cache_dir=None, warmup=False, enable_switching=switching, switch_chunk_pages=1,
        prefill_attention="expanded", expanded_prefill_min_tokens=8,  # the follower mirrors expanded steps too
    )


def prompts(vocab: int = 256) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(3)
    out = [[int(t) for t in rng.integers(1, vocab, n)] for n in (11, 3, 17, 6, 9, 16)]
    return out + [out[-1]]  # page-aligned and again once cached: its last page is copied on every process


ARRIVALS = [0, 0, 2, 5, 8, 0, 6]
MAX_TOKENS = [14, 18, 10, 16, 12, 6, 6]


def workload(engine, switches: list[str], max_tokens_scale: int = 1, on_step=None) -> tuple[dict, list]:
    """Staggered greedy requests; each switch in `switches` starts as soon as the previous one is done."""
    from splash_jax.engine import SamplingParams
    from splash_jax.engine.request import accumulate

    acc, ids, done, handles, step = {}, {}, {}, [], 0
    pending = sorted(zip(ARRIVALS, range(len(ARRIVALS))))
    queue = list(switches)
    while pending or engine.has_work() or queue:
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            params = SamplingParams(max_tokens=MAX_TOKENS[i] * max_tokens_scale, temperature=0.0, ignore_eos=True)
            ids[engine.add_request(prompts()[i], params)] = i
        if queue and engine.switcher.active is None and step >= 3:
            handles.append(engine.switch_layout(queue.pop(0)))
        for out in accumulate(acc, engine.step()):
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        step += 1
        if on_step:
            on_step(step)
        if step > 5000:
            raise RuntimeError("workload did not finish")
    return {i: done[i] for i in sorted(done)}, [(h.src, h.dst, h.state.value) for h in handles]


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--coordinator-address", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--layout", default="tp")
    p.add_argument("--switches", default="")
    p.add_argument("--out", default="")
    p.add_argument("--long", type=int, default=1, help="scale max_tokens (the kill test runs long)")
    p.add_argument("--ready-file", default="", help="written after 5 steps (the kill test waits for it)")
    p.add_argument("--peer-timeout-s", type=float, default=10.0)
    p.add_argument("--save-snapshot", default="", help="every process saves the loaded weights here (Orbax), then stops")
    args = p.parse_args(argv)
    devices = 8 // args.num_processes
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    logging.basicConfig(level="INFO", format=f"%(asctime)s p{args.process_id} %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)

    from splash_jax import distributed
    from splash_jax.engine import Engine, EngineConfig

    runtime = distributed.initialize(distributed.DistributedConfig(
        args.coordinator_address, args.num_processes, args.process_id, peer_timeout_s=args.peer_timeout_s, init_timeout_s=120,
    ))
    switches = [s for s in args.switches.split(",") if s]
    config = EngineConfig(**engine_kwargs(args.model, args.layout, bool(switches))) if runtime.is_leader else None
    config = runtime.share_config(config)
    t0 = time.perf_counter()
    engine = Engine(config)
    if args.save_snapshot:  # a collective save: every process writes the shards it holds
        from splash_jax.weights.snapshot import save_snapshot

        save_snapshot(engine.model, args.save_snapshot)
        if runtime.is_leader:
            runtime.shutdown()
        else:
            distributed.follow(engine, runtime)
        return
    if not runtime.is_leader:
        distributed.follow(engine, runtime)
        return
    build_s = time.perf_counter() - t0
    # A fully cached page-aligned prompt copies its last page on write, as an MTP engine does (the
    # default shares it): the copy is a mirrored command. The reference run shares it.
    engine.scheduler.share_last_cached_page = False

    def on_step(step):
        if args.ready_file and step == 5:
            open(args.ready_file, "w").write("ready")

    t0 = time.perf_counter()
    outputs, handles = workload(engine, switches, args.long, on_step)
    run_s = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"outputs": outputs, "switches": handles, "build_s": build_s, "run_s": run_s,
                       "steps": engine.num_steps, "commands": engine.executor._channel.num_sent,
                       "copied_pages": engine.stats()["prefix_cache"]["copied_pages"]}, f)
    runtime.shutdown()


if __name__ == "__main__":
    main()
