"""POST /tokenize, POST /detokenize, GET /tokenizer_info on the server root, in vLLM's shapes.

Clients that must count tokens exactly as the engine does use them instead of a local copy of
the tokenizer: lm-evaluation-harness (`local-completions` with `tokenizer_backend=remote`)
tokenizes every context here and reads eos/bos from /tokenizer_info, so its token-id prompts and
the engine's agree by construction. Tokenizing runs on the tokenizer threads, never on the event
loop; text sizes are bounded by the same limits as prompts (checked before any tokenization).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from serve.chat import render_prompt
from serve.context import ServerContext
from serve.errors import APIError
from serve.params import check_chat, check_prompt_sizes
from serve.protocol import ChatCompletionRequest, ChatMessage

log = logging.getLogger(__name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields ignored, as the other routes do


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Body):
    """vLLM's two forms in one body: `prompt` (completion form) or `messages` (chat form)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for prompt (BOS, as completions add it), false for messages
    add_generation_prompt: bool = True  # chat form: end with the assistant's turn opener
    continue_final_message: bool = False  # chat form; not supported (400 when true)
    chat_template: str | None = None  # chat form; only the model's own template is served (400 when set)
    tools: list[dict] | None = None  # chat form; not supported (400 when non-empty)
    return_token_strs: bool = False  # add each token's text (as logprobs name tokens)


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, exclude_if=lambda v: v is None)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Out):
    prompt: str


def _tokenizer(ctx: ServerContext):
    tokenizer = ctx.engine.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer (no tokenizer.json), so the tokenizer endpoints are not available",
                       501, code="tokenizer_unavailable")
    return tokenizer


def _chat_body(body: TokenizeRequest) -> ChatCompletionRequest:
    """The chat form as the chat route sees it, so both render (and bound) messages the same way."""
    if body.continue_final_message:
        raise APIError("continue_final_message is not supported by this server", param="continue_final_message")
    if body.chat_template is not None:
        raise APIError("chat_template is not supported (the model's own template is used)", param="chat_template")
    if body.tools:
        raise APIError("tools are not supported by this server", param="tools")
    return ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)


def _tokenize_chat(ctx: ServerContext, chat: ChatCompletionRequest, add_bos: bool) -> list[int]:
    ids = render_prompt(ctx, chat)  # the template writes its own BOS; add_special_tokens adds one more (as vLLM)
    bos = ctx.engine.tokenizer.bos_id
    return [bos] + ids if add_bos and bos is not None else ids


def _token_strs(ctx: ServerContext, ids: list[int]) -> list[str]:
    return [ctx.token_text(t) for t in ids]


async def tokenize(ctx: ServerContext, body: TokenizeRequest) -> TokenizeResponse:
    ctx.resolve_model(body.model)
    tokenizer = _tokenizer(ctx)
    if body.messages is not None and body.prompt is not None:
        raise APIError("send either prompt or messages, not both", param="messages")
    if body.messages is not None:
        chat = _chat_body(body)
        check_chat(ctx, chat)
        add_bos = bool(body.add_special_tokens)
        ids = await ctx.run_blocking(_tokenize_chat, ctx, chat, add_bos)
    elif body.prompt is not None:
        check_prompt_sizes(ctx, "prompt", [body.prompt])
        add_bos = body.add_special_tokens is None or body.add_special_tokens
        ids = await ctx.run_blocking(tokenizer.encode, body.prompt, add_bos)  # Engine.make_request's encoding
    else:
        raise APIError("send prompt (a string) or messages", param="prompt")
    strs = await ctx.run_blocking(_token_strs, ctx, ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)


def _detokenize(ctx: ServerContext, ids: list[int]) -> str:
    vocab = ctx.vocab_size
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise APIError(f"tokens[{i}] = {t} is outside the vocabulary (size {vocab})", param="tokens")
    return ctx.engine.tokenizer.decode(ids, skip_special_tokens=False)  # special tokens kept, as vLLM


async def detokenize(ctx: ServerContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.resolve_model(body.model)
    _tokenizer(ctx)
    limit = ctx.limits.max_prompt_chars  # the prompt bound, counted in ids: decoding stays bounded work
    if len(body.tokens) > limit:
        raise APIError(f"at most {limit} tokens (--max-prompt-chars) per request, got {len(body.tokens)}", param="tokens")
    return DetokenizeResponse(prompt=await ctx.run_blocking(_detokenize, ctx, body.tokens))


@functools.lru_cache(maxsize=8)
def _tokenizer_config(folder: str) -> dict:
    """The model folder's tokenizer_config.json (read once: it does not change while serving)."""
    path = Path(folder) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as e:
        log.warning("could not read %s: %s", path, e)
        config = {}
    return config if isinstance(config, dict) else {}


def _content(token) -> str | None:
    """A special token as a string (tokenizer_config.json may write one as {"content": ...})."""
    return token.get("content") if isinstance(token, dict) else token


def _info(ctx: ServerContext) -> dict:
    tokenizer = ctx.engine.tokenizer
    config = {k: v for k, v in _tokenizer_config(ctx.model_root).items() if k != "added_tokens_decoder"}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if key in config:
            config[key] = _content(config[key])
    pad = config.get("pad_token")
    pad_ids = tokenizer.encode(pad) if pad else []
    return {
        **config,
        "tokenizer_class": config.get("tokenizer_class") or "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token, "bos_token_id": tokenizer.bos_id,
        "eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_id,
        "pad_token": pad, "pad_token_id": pad_ids[0] if len(pad_ids) == 1 else None,
        "add_bos_token": tokenizer.bos_id is not None,  # text prompts get BOS (/tokenize's add_special_tokens default)
        "chat_template": tokenizer.chat_template,
        "model_max_length": ctx.max_model_len,  # the server's limit (prompt + output), not the file's
        "max_model_len": ctx.max_model_len,
        "vocab_size": ctx.vocab_size,
    }


async def tokenizer_info(ctx: ServerContext) -> dict:
    """What a remote tokenizer needs: special tokens and ids, the chat template, the length limit,
    and the rest of tokenizer_config.json (its large added_tokens_decoder left out)."""
    _tokenizer(ctx)
    return await ctx.run_blocking(_info, ctx)
