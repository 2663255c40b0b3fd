"""Tool calling on /v1/chat/completions: the DeepSeek-V3 call parser (whole and streamed, split
anywhere), the prompt rendering of tools, calls and results, the tool_choice grammar, 400s naming
the field, and the bundled model through the app in-process (a named function streamed and not
gives the same calls; "required" at temperature 1 gives calls whose arguments match the schemas)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import jsonschema
import llguidance
import openai
import pytest

from app_client import run_client
from serve.app import build_app
from serve.config import ServerConfig
from serve.protocol import ChatCompletionRequest
from serve.tool_parser import (
    CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, OUTPUT_BEGIN, OUTPUTS_BEGIN, SEP, ToolCallParser, parse_tool_calls,
)
from serve.tools import ToolSetup, template_messages, tool_grammar
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.tokenizer import Tokenizer

MODEL = "models/splash-tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}


def call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


ONE = CALLS_BEGIN + call("get_weather", '{"city": "Tokyo", "unit": "c"}') + CALLS_END
TWO = CALLS_BEGIN + call("get_weather", '{"city": "Oslo"}') + "\n" + call("get_time", '{"zone": 1}') + CALLS_END
TEXTS = [
    "no calls at all, but a < and a <｜ here",
    ONE,
    TWO,
    "Let me look that up. " + ONE,
    ONE + " and some text after",
    CALLS_BEGIN + call("f", '{"s": "``` inside", "t": "a\\n```"}') + CALLS_END,
    CALLS_BEGIN + "not a call" + CALLS_END,  # malformed: all content
    CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}bad name!\n```json\n{{}}\n```{CALL_END}" + CALLS_END,
    CALLS_BEGIN + call("f", "{}") + " trailing junk",  # a good call, then content
    CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}get_weather\n```json\n" + '{"city": ',  # cut off mid-arguments
    "text then a cut-off marker <｜tool▁calls▁be",
]


def calls_of(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def streamed(pieces: list[str], max_calls: int | None = None) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Content, calls rebuilt from the deltas as an OpenAI client does, and the ids announced."""
    parser = ToolCallParser(max_calls)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content, calls, ids = "", {}, []
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            entry = calls.setdefault(tc["index"], ["", ""])
            if "id" in tc:
                assert tc["type"] == "function" and tc["function"]["arguments"] == "" and tc["id"].startswith("call_")
                entry[0] = tc["function"]["name"]
                ids.append(tc["id"])
            entry[1] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    assert [c.id for c in parser.calls] == ids
    return content, [tuple(calls[i]) for i in sorted(calls)], ids


# --- the parser -------------------------------------------------------------------------
def test_parser_one_call_two_calls_and_text_before():
    assert parse_tool_calls("just text") == ("just text", [])
    content, calls = parse_tool_calls(ONE)
    assert content == "" and calls_of(calls) == [("get_weather", '{"city": "Tokyo", "unit": "c"}')]
    assert calls[0].id.startswith("call_") and json.loads(calls[0].arguments) == {"city": "Tokyo", "unit": "c"}
    content, calls = parse_tool_calls(TWO)
    assert content == "" and calls_of(calls) == [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": 1}')]
    assert len({c.id for c in calls}) == 2
    content, calls = parse_tool_calls("Let me look that up. " + ONE)
    assert content == "Let me look that up. " and len(calls) == 1


def test_parser_malformed_text_is_content():
    for text in (CALLS_BEGIN + "not a call" + CALLS_END, CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "x y\n```json\n{}",
                 CALLS_BEGIN + CALL_BEGIN + "python" + SEP + "f\n```json\n{}\n```" + CALL_END + CALLS_END,
                 "a cut-off marker at the end <｜tool▁calls▁beg", CALLS_BEGIN):
        assert parse_tool_calls(text) == (text, []), text
    content, calls = parse_tool_calls(CALLS_BEGIN + call("f", "{}") + " trailing junk")
    assert content == " trailing junk" and calls_of(calls) == [("f", "{}")]
    content, calls = parse_tool_calls(TEXTS[9])  # cut off (max_tokens): the call stays, its arguments cut
    assert content == "" and calls_of(calls) == [("get_weather", '{"city":')]


def test_parser_keeps_argument_text_as_written():
    _, calls = parse_tool_calls(TEXTS[5])
    assert calls_of(calls) == [("f", '{"s": "``` inside", "t": "a\\n```"}')]
    text = CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n```json\n{{\n  \"a\": 1\n}}```{CALL_END}{CALLS_END}"
    assert calls_of(parse_tool_calls(text)[1]) == [("f", '{\n  "a": 1\n}')]


def test_parser_max_calls_drops_later_calls():
    content, calls = parse_tool_calls(TWO, max_calls=1)
    assert content == "" and calls_of(calls) == [("get_weather", '{"city": "Oslo"}')]
    assert streamed(list(TWO), max_calls=1)[1] == [("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_split_anywhere_equals_the_whole_text(text):
    content, calls = parse_tool_calls(text)
    whole = (content, calls_of(calls))
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]])[:2] == whole, i
    assert streamed(list(text))[:2] == whole
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 6)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(pieces)[:2] == whole


FRAGMENTS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, "function", "get_x", "a b", "\n", " ", "```json\n",
             "```", "`", "{", '"k": 1', "}", "x", "<", "<｜tool", "\r"]


def test_random_marker_soup_streams_as_it_parses_and_loses_no_text():
    """Strings of marker fragments, split at random: the stream equals the whole; without calls
    the content is the text itself."""
    rng = random.Random(1)
    for _ in range(2000):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25)))
        if rng.random() < 0.3:  # inside a call's arguments
            text = CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f\n```json\n" + text
        content, calls = parse_tool_calls(text)
        whole = (content, calls_of(calls))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 8))))
        assert streamed([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])[:2] == whole, text
        assert calls or content == text


def test_streaming_announces_a_call_before_its_arguments():
    parser = ToolCallParser()
    head = CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}get_time\n```json\n"
    assert parser.feed(head[:-3]).tool_calls == []  # the header is not complete yet
    first = parser.feed(head[-3:] + '{"zone"')
    assert first.content == "" and first.tool_calls[0]["function"] == {"name": "get_time", "arguments": ""}
    assert first.tool_calls[1] == {"index": 0, "function": {"arguments": '{"zone"'}}
    later = parser.feed(": 3}\n``")  # a possible end of the arguments is held back
    assert later.tool_calls == [{"index": 0, "function": {"arguments": ": 3}"}}]
    rest = parser.feed("`" + CALL_END + CALLS_END + "ok")
    assert rest.content == "ok" and rest.tool_calls == []


# --- rendering --------------------------------------------------------------------------
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "10:00"},
]


def _render(tokenizer, history, setup):
    body = ChatCompletionRequest.model_validate({"messages": history})
    texts = [m.content or "" for m in body.messages]
    messages, tools = template_messages(tokenizer, body.messages, texts, setup)
    return messages, tools, tokenizer.apply_chat_template(messages, tools=tools)


def test_a_template_without_tools_gets_a_tool_block_and_deepseek_markers():
    tokenizer = Tokenizer(MODEL)
    messages, tools, text = _render(tokenizer, HISTORY, ToolSetup(tuple(TOOLS), "auto"))
    assert tools is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n## Tools") and CALLS_BEGIN in system and '"name": "get_weather"' in system
    assert json.dumps(WEATHER) in system
    calls = CALLS_BEGIN + call("get_weather", '{"city": "Oslo"}') + "\n" + call("get_time", '{"zone": 1}') + CALLS_END
    assert messages[2] == {"role": "assistant", "content": calls}
    assert messages[3] == {"role": "user", "content": f"{OUTPUTS_BEGIN}{OUTPUT_BEGIN}-3 C<｜tool▁output▁end｜>"
                                                      f"{OUTPUT_BEGIN}10:00<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"}
    assert len(messages) == 4 and "<|assistant|>" + calls in text and text.endswith("<|assistant|>")
    # a parsed call of the rendered history is the call sent
    assert calls_of(parse_tool_calls(calls)[1]) == [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": 1}')]
    # no system message: one is added; tool_choice "none": no tools described
    messages, _, _ = _render(tokenizer, HISTORY[1:2], ToolSetup(tuple(TOOLS), "required", parallel=False))
    assert messages[0]["role"] == "system" and "must call at least one" in messages[0]["content"]
    assert "at most one function" in messages[0]["content"]
    messages, _, _ = _render(tokenizer, HISTORY[1:2], ToolSetup(tuple(TOOLS), "none"))
    assert messages == [{"role": "user", "content": "Weather in Oslo, and the time?"}]


def test_a_template_that_handles_tools_gets_them_as_they_are(tmp_path):
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}[result {{ m['tool_call_id'] }}: {{ m['content'] }}]"
        "{% elif m['tool_calls'] %}[calls{% for c in m['tool_calls'] %} {{ c['function']['name'] }}"
        "{{ c['function']['arguments'] }}{% endfor %}]{% else %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}{% endfor %}"
    )
    shutil.copy(f"{MODEL}/tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = Tokenizer(tmp_path)
    messages, tools, text = _render(tokenizer, HISTORY, ToolSetup(tuple(TOOLS), "auto"))
    assert tools == TOOLS and messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[2]["content"] is None and messages[2]["tool_calls"][1]["function"]["arguments"] == '{"zone": 1}'
    assert text == ('TOOLS:get_weather;get_time;<system>Be brief.<user>Weather in Oslo, and the time?'
                    '[calls get_weather{"city": "Oslo"} get_time{"zone": 1}][result call_1: -3 C][result call_2: 10:00]')


# --- the grammar ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lltokenizer():
    return llguidance.LLTokenizer(f"{MODEL}/tokenizer.json")


def _accepts(lltok, tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("grammar", grammar), log_level=0)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


def test_tool_grammar_compiles_and_accepts_only_the_calls_it_should(lltokenizer):
    tokenizer = Tokenizer(MODEL)
    required, single = tool_grammar(TOOLS, "required", True), tool_grammar(TOOLS, "required", False)
    named = tool_grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    assert tool_grammar(TOOLS, "auto") is None and tool_grammar(TOOLS, "none") is None
    for grammar in (required, single, named):
        assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar), lltokenizer) == ""
    good = CALLS_BEGIN + call("get_weather", '{"city": "Oslo", "unit": "c"}') + CALLS_END
    two = CALLS_BEGIN + call("get_weather", '{"city": "Oslo", "unit": "c"}') + "\n" + call("get_time", '{"zone": 2}') + CALLS_END
    assert _accepts(lltokenizer, tokenizer, required, good) and _accepts(lltokenizer, tokenizer, required, two)
    assert _accepts(lltokenizer, tokenizer, single, good) and not _accepts(lltokenizer, tokenizer, single, two)
    assert not _accepts(lltokenizer, tokenizer, required, good.replace('"c"', '"k"'))  # not in the enum
    assert not _accepts(lltokenizer, tokenizer, required, "Sure. " + good)
    assert not _accepts(lltokenizer, tokenizer, named, good)
    assert _accepts(lltokenizer, tokenizer, named, CALLS_BEGIN + call("get_time", '{"zone": -3}') + CALLS_END)
    no_params = tool_grammar([{"type": "function", "function": {"name": "ping"}}], "required")
    assert _accepts(lltokenizer, tokenizer, no_params, CALLS_BEGIN + call("ping", "{}") + CALLS_END)


# --- through the app (bundled model, in-process) ----------------------------------------
ENGINE_ARGS = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "page_size": 16, "max_pages": 256, "max_model_len": 1024}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def app():
    aengine = AsyncEngine(Engine(EngineConfig(**ENGINE_ARGS, warmup=False, compile_cache_dir=None)))
    yield build_app(aengine, ServerConfig(served_model_name=["splash-tiny"]), shutdown_engine=False)
    aengine.shutdown()


def run(app, fn):
    """fn(openai client) run against the app in-process."""
    return run_client(app, fn)


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_tool_fields_are_400_naming_the_field(app, change, param):
    async def ask(client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(**{"model": "splash-tiny", "messages": ASK, "max_tokens": 4, **change})
        return e.value.body

    error = run(app, ask)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.fixture(scope="module")
def generated(app):
    """Every generation the tests below judge, sent at once: one batch, so the engine compiles
    and steps once for all of them (the bundled model on CPU costs ~30 ms a step)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    base = dict(model="splash-tiny", messages=ASK, tools=TOOLS)

    async def ask(client):
        async def stream(**kw):
            return [c async for c in await client.chat.completions.create(**kw, stream=True)]

        named_kw = dict(base, tool_choice=named, temperature=0, max_tokens=120)
        required_kw = dict(base, tool_choice="required", temperature=1, seed=7)
        out = await asyncio.gather(
            client.chat.completions.create(**named_kw), stream(**named_kw),
            client.chat.completions.create(**required_kw, n=2, max_tokens=300),
            client.chat.completions.create(**required_kw, n=2, max_tokens=120, parallel_tool_calls=False),
            client.chat.completions.create(**base, max_tokens=4, seed=1),
        )
        return dict(zip(("named", "named_stream", "required", "required_single", "auto"), out))

    return run(app, ask)


def test_named_function_streamed_and_not_give_the_same_call(generated):
    whole, chunks = generated["named"], generated["named_stream"]
    choice0 = whole.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    [tool_call] = choice0.message.tool_calls
    assert tool_call.function.name == "get_weather" and tool_call.id.startswith("call_")
    jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER)
    names, arguments, content = [], "", ""
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            assert tc.index == 0
            names += [tc.function.name] if tc.function.name else []
            arguments += tc.function.arguments or ""
        content += c.choices[0].delta.content or ""
    assert names == ["get_weather"] and arguments == tool_call.function.arguments and content == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_match_the_schemas_at_temperature_1(generated):
    """Enforced by the engine's grammar masks: every call of every choice is one of the tools
    with arguments its schema accepts, sampling freely (temperature 1)."""
    for choice in generated["required_single"].choices:
        assert choice.finish_reason == "tool_calls", choice
        [c] = choice.message.tool_calls
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    parallel = generated["required"].choices
    for choice in parallel:  # calls until the model closes them: one cut off by max_tokens is not judged
        assert choice.finish_reason in ("tool_calls", "length"), choice
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None
        for c in calls if choice.finish_reason == "tool_calls" else calls[:-1]:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert any(c.finish_reason == "tool_calls" for c in parallel)


def test_auto_answers_text_or_calls(generated):
    choice = generated["auto"].choices[0]
    assert choice.finish_reason in ("length", "stop", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls
