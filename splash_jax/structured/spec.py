"""What a request's output must match, as vLLM's `structured_outputs` request field names it.

Exactly one constraint per request. `key()` is what compiled grammars are cached by, so two
requests with the same schema text share one compilation.
"""

from __future__ import annotations

import dataclasses
import json as _json
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    json: str | dict | None = None  # a JSON schema (an object, or its text)
    regex: str | None = None  # the whole output matches this regular expression
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or GBNF
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The one constraint that is set (ValueError if none or several are)."""
        set_ = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {set_ or 'none'}")
        return set_[0]

    def key(self) -> tuple[str, str]:
        """(kind, text): the cache key of its compiled grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = _json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            value = _json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value
