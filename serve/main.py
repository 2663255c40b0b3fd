"""`python -m serve.main`: the main job.

Until the HTTP server lands (issue 7) this runs a short offline generation on the bundled
default model, so a fresh machine shows the whole path: config, weights, tokenizer, paged
cache, prefill and decode.
"""

from __future__ import annotations

import argparse
import logging
import time

import jax

from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.simple_generate import SingleRequestRunner
from splash_jax.tokenizer import Tokenizer
from splash_jax.weights.loader import load_model

log = logging.getLogger("serve.main")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder")
    parser.add_argument("--prompt", default="Latent attention lets a serving engine")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on accelerators, float32 on CPU) | float32 | bfloat16")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy", "orbax"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)

    dtype = args.dtype if args.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    log.info("backend %s with %d device(s); dtype %s", jax.default_backend(), jax.device_count(), dtype)
    t0 = time.perf_counter()
    model = load_model(args.model, RuntimeOptions(dtype=dtype), load_format=args.load_format)
    tok = Tokenizer(args.model)
    log.info("loaded %s in %.1fs", args.model, time.perf_counter() - t0)
    prompt = tok.encode(args.prompt, add_bos=True)
    runner = SingleRequestRunner(model, page_size=64, max_len=len(prompt) + args.max_tokens + 1)
    t0 = time.perf_counter()
    ids = runner.greedy(prompt, args.max_tokens, eos_ids=(tok.eos_id,))
    log.info("generated %d tokens in %.2fs (includes compilation)", len(ids), time.perf_counter() - t0)
    log.info("prompt: %r", args.prompt)
    log.info("output: %r", tok.decode(ids))


if __name__ == "__main__":
    main()
