"""Grammars for structured outputs, compiled with llguidance (no torch: it reads tokenizer.json).

One `GrammarCompiler` per engine holds the llguidance tokenizer (built once, sized to the model's
vocabulary so masks match the logits) and a bounded cache of validated grammars keyed by
`StructuredOutputs.key()`: requests with the same schema compile it once. Compiling happens in
`Engine.make_request`, which the server runs on its tokenizer threads, so a slow schema never
stalls the event loop or the engine loop. Each request gets its own `LLMatcher` (the grammar
state), advanced by the scheduler as tokens reach the host.
"""

from __future__ import annotations

import collections
import json
import logging
import tempfile
import threading
from collections.abc import Iterable

import llguidance

from splash_jax.engine.request import RequestError
from splash_jax.structured.spec import StructuredOutputs

log = logging.getLogger(__name__)

CACHE_SIZE = 1024  # compiled grammars kept (each is a string of the grammar's definition)


WHITESPACE = {  # llguidance's JSON options per EngineConfig.structured_json_whitespace
    "compact": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "flexible": {},
}


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int], whitespace: str = "compact"):
        """tokenizer_json: the tokenizer.json text (Tokenizer.to_json())."""
        eos = sorted(eos_ids)
        self.json_options = WHITESPACE[whitespace]
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # llguidance reads a path
            f.write(tokenizer_json)
            f.flush()
            self.tokenizer = llguidance.LLTokenizer(f.name, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self._cache: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def grammar(self, spec: StructuredOutputs) -> str:
        """The validated llguidance grammar of `spec` (cached by its kind and text); RequestError
        naming `structured_outputs` when it does not compile."""
        try:
            key = spec.key()
        except ValueError as e:
            raise RequestError(str(e), "structured_outputs") from None
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = self._compile(*key)
        with self._lock:
            self._cache[key] = grammar
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, kind: str, text: str) -> str:
        where = f"structured_outputs.{kind}" if kind != "json_object" else "response_format"
        try:
            if kind == "json":
                try:
                    schema = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=self.json_options or None)
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=self.json_options or None)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            elif kind == "choice":
                choices = json.loads(text)
                if not choices or not all(isinstance(c, str) and c for c in choices):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
                grammar = llguidance.grammar_from("choice", choices)
            elif kind == "grammar":
                grammar = llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
            else:
                raise ValueError(f"unknown structured output kind {kind!r}")
        except ValueError as e:
            raise RequestError(f"{where} does not compile: {e}", "structured_outputs") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise RequestError(f"{where} does not compile: {_first_lines(error)}", "structured_outputs")
        return grammar

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh grammar state for one request (RequestError if the grammar does not compile)."""
        m = llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if m.is_error():
            raise RequestError(f"structured_outputs does not compile: {_first_lines(m.get_error())}", "structured_outputs")
        return m


def _first_lines(text: str, lines: int = 4) -> str:
    return "\n".join(text.strip().splitlines()[:lines])[:500]
