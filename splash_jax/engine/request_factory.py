"""Requests as a front end builds them: validated, tokenized, seeded, before the core sees them.

`EngineFacts` is what a front end must know about the core it talks to (read once when the core
is ready: in-process from the engine, across processes from the core's ready message);
`RequestFactory` turns a prompt and SamplingParams into a `Request`, raising `RequestError`
(naming the field) for anything the core could not run. Both the notebook `Engine` and the API
server's processes use it, so a request is checked the same way whichever path it takes.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence

import numpy as np

from splash_jax.engine.request import Request, RequestError, SamplingLimits, SamplingParams


@dataclasses.dataclass
class EngineFacts:
    """What a front end needs to know about its engine core (plain data: it crosses processes)."""

    vocab_size: int
    max_model_len: int
    max_stop_token_ids: int
    max_logit_bias: int
    eos_ids: list[int]
    model: str  # the model folder
    platform: str = "cpu"
    device_kind: str = "cpu"
    num_devices: int = 1
    layout: str = "tp"
    enable_switching: bool = False
    structured_json_whitespace: str = "compact"
    seed: int = 0

    @property
    def sampling_limits(self) -> SamplingLimits:
        return SamplingLimits(self.max_stop_token_ids, self.max_logit_bias)

    @classmethod
    def of(cls, engine) -> "EngineFacts":
        """The facts of an EngineCore in this process."""
        device = engine.mesh.devices.flat[0]
        c = engine.config
        return cls(
            vocab_size=int(engine.model_config.vocab_size), max_model_len=int(engine.max_model_len),
            max_stop_token_ids=engine.limits.max_stop_token_ids, max_logit_bias=engine.limits.max_logit_bias,
            eos_ids=sorted(int(t) for t in engine.eos_ids), model=str(engine.model_path),
            platform=device.platform, device_kind=device.device_kind, num_devices=int(engine.mesh.devices.size),
            layout=engine.layout.name, enable_switching=bool(c.enable_switching),
            structured_json_whitespace=c.structured_json_whitespace, seed=int(c.seed),
        )


def _integer_ids(values: list, vocab_size: int) -> np.ndarray:
    """Token ids numpy did not read as integers: raise naming the first that is not one (a float is
    never truncated, a string never parsed), or the first outside the vocabulary (past int64)."""
    for t in values:
        if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)):
            raise RequestError(f"prompt token ids must be integers, got {type(t).__name__} {t!r}", "prompt")
    bad = next((t for t in values if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is outside the vocabulary (size {vocab_size})", "prompt")
    return np.asarray(values, np.int64)


class RequestFactory:
    """Builds validated Requests (thread-safe: the server calls it from its tokenizer threads)."""

    def __init__(self, facts: EngineFacts, tokenizer, grammars: Callable[[], object] | None = None, stream: int = 0):
        """grammars: returns the GrammarCompiler that checks structured outputs (built lazily).
        stream: this front end's index; each draws its own seeds for unseeded requests (front end
        0 the engine's own sequence), so two API servers never hand out the same seeds."""
        self.facts = facts
        self.tokenizer = tokenizer
        self._grammars = grammars
        self._compiler = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(facts.seed if stream == 0 else [facts.seed, stream])

    def grammars(self):
        if self._grammars is not None:
            return self._grammars()
        from splash_jax.structured.grammar import GrammarCompiler  # llguidance: imported only when used

        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer (tokenizer.json)", "structured_outputs")
                f = self.facts
                self._compiler = GrammarCompiler(self.tokenizer.to_json(), f.vocab_size, f.eos_ids, f.structured_json_whitespace)
            return self._compiler

    def make(self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
             cache_salt: str | None = None, with_matcher: bool = True) -> Request:
        """Validate and tokenize. with_matcher: give the request its grammar matcher here (the
        in-process path); across processes the core builds its own from the spec, which this
        compiles once to check it (a schema that does not compile fails here, not in the core)."""
        f = self.facts
        params = params or SamplingParams()
        params.validate(f.vocab_size, f.sampling_limits)
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty", "prompt")
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; pass prompt token ids", "prompt")
            ids = self.tokenizer.encode(prompt, add_bos=True)
            text = prompt
        else:  # token ids, checked as one array (a 4K prompt: ~0.2 ms against ~0.9 ms token by token)
            try:
                arr = np.asarray(prompt)  # no dtype asked: 1.5 or "3" must not become 1 or 3
            except (TypeError, ValueError) as e:
                raise RequestError(f"prompt token ids must be a flat list of integers ({e})", "prompt") from None
            if arr.ndim != 1:
                raise RequestError(f"prompt token ids must be a flat list, got shape {arr.shape}", "prompt")
            if arr.size and arr.dtype.kind not in "iu":
                arr = _integer_ids(list(prompt), f.vocab_size)
            if arr.size and (arr.min() < 0 or arr.max() >= f.vocab_size):
                bad = int(arr[(arr < 0) | (arr >= f.vocab_size)][0])
                raise RequestError(f"prompt token id {bad} is outside the vocabulary (size {f.vocab_size})", "prompt")
            ids, text = arr.tolist(), None
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(ids) >= f.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; the maximum model length is {f.max_model_len} "
                "(prompt plus at least one generated token)", "prompt",
            )
        rid = request_id or f"req-{next(self._ids)}"
        with self._lock:
            seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError(f"cache_salt must be a string, got {type(cache_salt).__name__}", "cache_salt")
        grammar = None
        if params.structured_outputs is not None:
            compiler = self.grammars()
            if with_matcher:
                grammar = compiler.matcher(params.structured_outputs)
            else:
                compiler.grammar(params.structured_outputs)  # raises if it does not compile; the core builds the matcher
        return Request(rid, ids, params, prompt_text=text, sample_seed=seed, cache_salt=cache_salt or None, grammar=grammar)
