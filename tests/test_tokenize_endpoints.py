"""/tokenize, /detokenize and /tokenizer_info on the app around the bundled model (in-process):
the ids /tokenize gives are the prompt ids a completion runs on, /detokenize inverts them,
/tokenizer_info answers what lm-eval's remote tokenizer reads, the work runs on the tokenizer
threads, and every bad value is a 400 naming its field."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from serve.app import build_app
from serve.config import ServerConfig, ServerLimits
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.async_engine import AsyncEngine

ENGINE_ARGS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "page_size": 16, "max_pages": 128, "max_model_len": 256}
PROMPT = "Latent attention caches one compressed vector per token"
LIMITS = ServerLimits(max_prompt_chars=2000)


@pytest.fixture(scope="module")
def served():
    aengine = AsyncEngine(Engine(EngineConfig(**ENGINE_ARGS, warmup=False, compile_cache_dir=None)))
    app = build_app(aengine, ServerConfig(served_model_name=["splash-tiny"], limits=LIMITS), shutdown_engine=False)
    yield app, aengine
    aengine.shutdown()


def ask(app, *calls):
    """(method, path, json body) calls against the app in-process, in order; their responses."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            out = []
            for method, path, body in calls:  # json.dumps keeps ASCII escapes (a lone surrogate survives)
                content = None if body is None else json.dumps(body).encode()
                out.append(await client.request(method, path, content=content, headers={"content-type": "application/json"}))
            return out

    return asyncio.run(main())


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_gives_the_prompt_ids_a_completion_runs_on(served):
    app, aengine = served
    tok, plain, by_text = ask(
        app, ("POST", "/tokenize", {"prompt": PROMPT}), ("POST", "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}),
        ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}),
    )
    tok, plain, by_text = ok(tok), ok(plain), ok(by_text)
    tokenizer = aengine.tokenizer
    assert tok["tokens"] == aengine.engine.make_request(PROMPT).prompt_ids == [tokenizer.bos_id] + plain["tokens"]
    assert tok["count"] == len(tok["tokens"]) == by_text["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == ENGINE_ARGS["max_model_len"] and "token_strs" not in tok
    (by_ids,) = ask(app, ("POST", "/v1/completions", {"prompt": tok["tokens"], "max_tokens": 4, "temperature": 0,
                                                       "return_token_ids": True}))
    by_ids = ok(by_ids)
    assert by_ids["usage"]["prompt_tokens"] == tok["count"]
    assert by_ids["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]


def test_chat_form_counts_the_chat_prompt(served):
    app, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is MLA?"}]
    tok, chat, open_turn, extra_bos = ask(
        app, ("POST", "/tokenize", {"messages": messages}),
        ("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0}),
        ("POST", "/tokenize", {"messages": messages, "add_generation_prompt": False}),
        ("POST", "/tokenize", {"messages": messages, "add_special_tokens": True}),
    )
    tok, chat, open_turn, extra_bos = ok(tok), ok(chat), ok(open_turn), ok(extra_bos)
    assert tok["count"] == chat["usage"]["prompt_tokens"]
    assert open_turn["count"] < tok["count"] and tok["tokens"][: open_turn["count"]] == open_turn["tokens"]
    assert extra_bos["tokens"] == [tok["tokens"][0]] + tok["tokens"]  # the template wrote one BOS already


def test_detokenize_round_trips_and_token_strs(served):
    app, aengine = served
    text = "Hello, wörld: ünïcode and  two spaces"
    (tok,) = ask(app, ("POST", "/tokenize", {"prompt": text, "add_special_tokens": False}))
    tok = ok(tok)
    back, with_bos, empty = ask(
        app, ("POST", "/detokenize", {"tokens": tok["tokens"]}),
        ("POST", "/detokenize", {"tokens": [aengine.tokenizer.bos_id] + tok["tokens"], "model": "splash-tiny"}),
        ("POST", "/detokenize", {"tokens": []}),
    )
    assert ok(back) == {"prompt": text}
    assert ok(with_bos)["prompt"] == aengine.tokenizer.bos_token + text  # special tokens kept, as vLLM
    assert ok(empty) == {"prompt": ""}
    # each token's text as logprobs name it: for ASCII text they concatenate to the text
    (strs,) = ask(app, ("POST", "/tokenize", {"prompt": PROMPT, "return_token_strs": True}))
    strs = ok(strs)
    assert len(strs["token_strs"]) == strs["count"] and "".join(strs["token_strs"]) == aengine.tokenizer.bos_token + PROMPT


def test_tokenizer_info_has_what_a_remote_tokenizer_reads(served):
    app, aengine = served
    (info,) = ask(app, ("GET", "/tokenizer_info", None))
    info = ok(info)
    tokenizer = aengine.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["pad_token"] == "<|pad|>"
    assert info["tokenizer_class"] and info["model_max_length"] == info["max_model_len"] == ENGINE_ARGS["max_model_len"]
    assert (info["eos_token_id"], info["bos_token_id"]) == (tokenizer.eos_id, tokenizer.bos_id)
    # lm-eval's RemoteTokenizer takes a special token's id as /tokenize of its text without special tokens
    eos, bos = ask(app, *[("POST", "/tokenize", {"prompt": info[k], "add_special_tokens": False}) for k in ("eos_token", "bos_token")])
    assert ok(eos)["tokens"] == [tokenizer.eos_id] and ok(bos)["tokens"] == [tokenizer.bos_id]


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [5, 4096]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": list(range(10)) * 201}, "tokens"),  # over max_prompt_chars ids
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": "a\ud800"}, "prompt"),
    ("/tokenize", {"prompt": "x" * 2001}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "maybe"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "y" * 2001}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "chat_template": "{{ 1 }}"}, "chat_template"),
])
def test_bad_values_are_400_naming_the_field(served, path, body, param):
    app, _ = served
    (r,) = ask(app, ("POST", path, body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_model_is_404_and_no_tokenizer_is_501(served, monkeypatch):
    app, aengine = served
    (unknown,) = ask(app, ("POST", "/tokenize", {"prompt": "a", "model": "gpt-9"}))
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    monkeypatch.setattr(aengine.engine, "tokenizer", None)
    for r in ask(app, ("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/tokenizer_info", None)):
        assert r.status_code == 501 and r.json()["error"]["code"] == "tokenizer_unavailable", r.text


def test_tokenizing_runs_on_the_tokenizer_threads(served, monkeypatch):
    app, aengine = served
    tokenizer = aengine.tokenizer
    threads: set[str] = set()

    def recorded(fn):
        def call(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return call

    for name in ("encode", "decode", "apply_chat_template"):
        monkeypatch.setattr(tokenizer, name, recorded(getattr(tokenizer, name)))
    responses = ask(app, ("POST", "/tokenize", {"prompt": "abc"}), ("POST", "/detokenize", {"tokens": [7, 8]}),
                    ("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}), ("GET", "/tokenizer_info", None))
    assert all(r.status_code == 200 for r in responses)
    assert threads and all(t.startswith("splash-tokenize") for t in threads), threads
