"""Tokenizer from a model folder's `tokenizer.json` (HF `tokenizers`, no transformers needed).

Adds what serving needs on top: special-token ids, the chat template from
`tokenizer_config.json` (rendered with jinja2, as transformers does), and incremental
detokenization for streaming that never emits half of a multi-byte character.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import jinja2.meta
from tokenizers import Tokenizer as HFTokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte: how byte-level BPE vocabularies spell tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte tokens


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = cfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.chat_template)
        # what the template reads: a template without `tools` gets tool descriptions some other way
        self.template_variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(self.chat_template)))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (llguidance builds its token tables from it)."""
        return self._tok.to_str()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`. Through `encode_batch`, which releases the GIL while it works
        (measured in the server: `encode` of 1 MB held it for 0.8 s, stalling the event loop)."""
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return ([self.bos_id] + ids) if (add_bos and self.bos_id is not None) else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes a token stands for (byte-level BPE or SentencePiece byte tokens), if knowable."""
        piece = self._tok.id_to_token(token_id)
        if not piece:
            return None
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                            **template_kwargs) -> str:
        """tools (OpenAI's tool objects) reach the template as `tools`, as transformers passes them;
        template_kwargs as further variables (DeepSeek-V3.1's `thinking`, Qwen3's `enable_thinking`)."""
        extra = {} if tools is None else {"tools": tools}
        return self._template.render(
            **template_kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
        )


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas (for streaming and stop strings).

    Decodes only a short window (from the last emitted boundary), so each new token costs
    O(1) host work however long the output gets.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: ids before it are already in self.text
        self._read = 0  # ids[:read] are fully emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self.tokenizer.decode(self.ids[self._prefix : self._read])
        full = self.tokenizer.decode(self.ids[self._prefix :])
        if len(full) <= len(done) or full.endswith("\ufffd"):  # unfinished multi-byte character
            return ""
        delta = full[len(done) :]
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise(message):
    raise jinja2.TemplateError(message)
