"""The bundled model (models/splash-tiny) is trained: it predicts held-out Python, through the
engine's own model code, at the perplexity its training measured (a numerics regression that
keeps every shape right moves this number; a random model scores ~4096, the vocabulary)."""

import math
from pathlib import Path

import numpy as np
import pytest

from splash_jax.model import RuntimeOptions
from splash_jax.simple_generate import SingleRequestRunner
from splash_jax.tokenizer import Tokenizer
from splash_jax.weights.loader import load_model

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "splash-tiny"

# Written for this test (not in any training corpus): ordinary Python the model should find plain.
HELD_OUT = '''import os
import sys


def read_lines(path, encoding="utf-8"):
    """Return the lines of a text file without their line endings."""
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, value=1):
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]

    def most_common(self, n=None):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items if n is None else items[:n]


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(name, len(read_lines(os.path.abspath(name))))
'''

# Measured when the model was committed (float32, XLA attention, CPU); see models/splash-tiny/README.md.
GOLDEN_NLL = 1.6443  # nats per token (perplexity 5.18)
PPL_CEILING = 12.0  # the held-out perplexity of training was 5.4 on unseen library files


@pytest.fixture(scope="module")
def nll():
    model = load_model(BUNDLED, RuntimeOptions(dtype="float32", attention_impl="xla"))
    ids = Tokenizer(BUNDLED).encode(HELD_OUT, add_bos=True)
    runner = SingleRequestRunner(model, page_size=16, max_len=512)
    logits, _ = runner.run(runner.new_cache(), ids[:-1], 0, want="all")
    logits = logits.astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(ids) - 1), ids[1:]]))


def test_bundled_model_predicts_held_out_python(nll):
    assert math.exp(nll) < PPL_CEILING, f"perplexity {math.exp(nll):.2f}"


def test_bundled_model_perplexity_unchanged(nll):
    assert abs(nll - GOLDEN_NLL) < 0.01, f"mean NLL {nll:.4f} nats/token, committed {GOLDEN_NLL:.4f}"
