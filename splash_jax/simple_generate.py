"""Single-request generation with the model alone: prefill, then decode one token at a time.

This is the independent reference the engine is tested against (no scheduler, no batching,
no buckets beyond one), and a minimal way to run a model from a notebook.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from splash_jax.kv.step_builder import Chunk, build_step_input


@dataclasses.dataclass
class SingleRequestRunner:
    model: object
    page_size: int = 16
    max_len: int = 256

    def __post_init__(self):
        self.num_pages = -(-self.max_len // self.page_size)
        self.pages = list(range(self.num_pages))
        graphdef, state = nnx.split(self.model)

        def step(state, kv, batch):
            return nnx.merge(graphdef, state)(kv, batch)

        self._state = state
        self._step = jax.jit(step, donate_argnums=(1,))

    def new_cache(self):
        return self.model.new_cache(self.num_pages, self.page_size)

    def run(self, kv, tokens, start: int, want: str = "last"):
        """Feed `tokens` at positions start.. ; returns (logits [n, V] numpy, kv)."""
        n = len(tokens)
        bucket = max(8, 1 << (n - 1).bit_length())
        batch, counts = build_step_input(
            [Chunk(np.asarray(tokens), start, self.pages, want)],
            self.page_size, self.num_pages, bucket, 1, self.num_pages, logits_bucket=bucket,
        )
        logits, kv = self._step(self._state, kv, jax.tree.map(jnp.asarray, batch))
        return np.asarray(logits[: int(counts[0])]), kv

    def greedy(self, prompt, max_new_tokens: int, eos_ids=()) -> list[int]:
        kv = self.new_cache()
        logits, kv = self.run(kv, prompt, 0)
        out = [int(logits[-1].argmax())]
        pos = len(prompt)
        while len(out) < max_new_tokens and out[-1] not in eos_ids:
            logits, kv = self.run(kv, [out[-1]], pos)
            pos += 1
            out.append(int(logits[-1].argmax()))
        return out
