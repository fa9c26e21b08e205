"""Tool calling at the HTTP door (router/http/tools.py, its use in translate.py and
responses.py): the request's tools and tool_choice and the 400s naming the field, the schema
of an answer of calls (and that xgrammar takes it and accepts exactly the format), the
parsing of an output as calls, the stream's holding back, and the response and chunks that
carry the calls. Exact answers on hand-made inputs (no cluster)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.http.protocol import ChatCompletionRequest
from router.http.responses import ChoiceOutput, ResponseWriter
from router.http.tools import (
    MAX_CALLS,
    ToolCalling,
    ToolCallStream,
    ToolChoice,
    parse_tool_calls,
    tool_calling,
)
from router.http.translate import GenerationPlan, Translator
from router.progress import StreamDelta, Usage
from router.validation import InvalidRequest, ValidationLimits
from vocabulary.engine_io import FinishReason

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"]}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]  # fmt: skip
LIMITS = ValidationLimits(max_model_len=4096, vocab_size=128)


def calling(tool_choice: Any = None, parallel: Any = None, other: str = "") -> ToolCalling:
    made = tool_calling(TOOLS, tool_choice, parallel, other)
    assert made is not None
    return made


def refused(*args: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        tool_calling(*args)
    return err.value


# ---- the request ------------------------------------------------------------------------------


def test_tools_default_to_auto_and_parallel_and_no_tools_is_none() -> None:
    auto = calling()
    assert (auto.choice, auto.parallel, auto.parses, auto.max_calls) == (
        ToolChoice.AUTO, True, True, MAX_CALLS,
    )  # fmt: skip
    assert auto.names == {"get_weather", "add"} and auto.constraint() is None
    assert auto.definitions == tuple(TOOLS)
    assert tool_calling(None, None, None) is None
    assert tool_calling([], "none", True) is None
    none = calling("none")
    assert (none.choice, none.parses, none.constraint()) == (ToolChoice.NONE, False, None)
    named = calling({"type": "function", "function": {"name": "add"}}, False)
    assert (named.choice, named.named, named.parallel, named.max_calls) == (
        ToolChoice.NAMED, "add", False, 1,
    )  # fmt: skip
    # auto beside response_format: the output is the format's, not read as calls
    assert calling("auto", other="response_format").parses is False


def test_bad_tools_and_tool_choice_are_400s_naming_the_field() -> None:
    fn = {"type": "function", "function": {"name": "f"}}
    cases: list[tuple[tuple[Any, ...], str, str]] = [
        ((None, "auto", None), "tool_choice", "needs tools"),
        (([], "required", None), "tool_choice", "needs tools"),
        ((TOOLS, {"type": "function", "function": {"name": "nope"}}, None), "tool_choice",
         "'nope', not a declared tool (add, get_weather)"),
        ((TOOLS, "sometimes", None), "tool_choice", '"none", "auto", "required" or'),
        ((TOOLS, {"type": "function"}, None), "tool_choice", '"none", "auto", "required" or'),
        (([{"type": "function", "function": {"description": "x"}}], None, None),
         "tools[0].function.name", "got None"),
        (([fn, {"type": "function", "function": {"name": "a b"}}], None, None),
         "tools[1].function.name", "a-z"),
        (([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, None),
         "tools[0].function.parameters", "must be a JSON schema (an object)"),
        (([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
          None, None), "tools[0].function.parameters", 'type must be "object"'),
        (([fn, fn], None, None), "tools[1].function.name", "'f' is declared twice"),
        (([{"type": "retrieval"}], None, None), "tools[0].type", 'only "function" tools'),
        (([{"type": "function"}], None, None), "tools[0].function", "must be an object"),
        (({"type": "function"}, None, None), "tools", "must be a list"),
        (([3], None, None), "tools[0]", "must be an object"),
        (([fn], None, "yes"), "parallel_tool_calls", "must be true or false"),
        (([fn], "required", None, "response_format"), "tool_choice",
         '"required" constrains the output; it cannot be combined with response_format'),
        (([fn], {"type": "function", "function": {"name": "f"}}, None, "guided_regex"),
         "tool_choice", "function 'f' constrains the output"),
    ]  # fmt: skip
    for args, field, words in cases:
        err = refused(*args)
        assert err.field == field and words in str(err), (args, str(err))


class Template:
    def __init__(self) -> None:
        self.tools: list[Any] = []

    def render(self, messages: list[dict[str, Any]], tools: Any = None) -> str:
        self.tools.append(tools)
        return "|".join(str(m["content"]) for m in messages)


class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in ids)


def chat_plan(template: Template | None = None, **body: Any) -> GenerationPlan:
    t = Translator("m", Tokenizer(), template or Template(), lambda: LIMITS)  # type: ignore[arg-type]
    messages = [{"role": "user", "content": "q"}]
    return t.chat(ChatCompletionRequest.model_validate({"model": "m", "messages": messages,
                                                        **body}), {})  # fmt: skip


def test_required_constrains_the_request_and_tools_reach_the_template() -> None:
    template = Template()
    plan = chat_plan(template, tools=TOOLS, tool_choice="required")
    constraint = plan.choices[0].request.sampling.structured
    assert constraint is not None and constraint.kind == "json_schema" and constraint.strict
    assert json.loads(constraint.spec) == calling("required").schema()
    assert plan.constraint_field == "tools" and plan.param_name("structured_output") == "tools"
    assert template.tools == [tuple(TOOLS)]
    auto = chat_plan(tools=TOOLS)
    assert auto.choices[0].request.sampling.structured is None
    assert auto.tools is not None and auto.tools.choice is ToolChoice.AUTO
    assert chat_plan().tools is None
    # auto beside a response format: the format constrains; the field stays the body's
    fmt = chat_plan(tools=TOOLS, response_format={"type": "json_object"})
    assert fmt.constraint_field == "response_format" and fmt.tools is not None
    assert not fmt.tools.parses


# ---- the schema -------------------------------------------------------------------------------


def _call(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def test_the_schema_is_an_array_of_calls_of_the_allowed_tools() -> None:
    both = {"anyOf": [_call("get_weather", WEATHER), _call("add", ADD)]}
    assert calling("required").schema() == {
        "type": "array", "items": both, "minItems": 1, "maxItems": 8,
    }  # fmt: skip
    assert calling("required", False).schema() == {
        "type": "array", "items": both, "minItems": 1, "maxItems": 1,
    }  # fmt: skip
    assert calling({"type": "function", "function": {"name": "add"}}).schema() == {
        "type": "array", "items": _call("add", ADD), "minItems": 1, "maxItems": 1,
    }  # fmt: skip
    assert MAX_CALLS == 8
    bare = tool_calling([{"type": "function", "function": {"name": "now"}}], "required", None)
    assert bare is not None
    assert bare.schema()["items"] == _call("now", {"type": "object", "properties": {}})


def test_xgrammar_accepts_exactly_the_calls_format() -> None:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    def grammar(c: ToolCalling) -> Any:
        constraint = c.constraint()
        assert constraint is not None
        return xgr.Grammar.from_json_schema(
            constraint.json_schema, any_whitespace=False, strict_mode=constraint.strict
        )

    required = grammar(calling("required"))
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    two = '{"name": "add", "arguments": {"a": 1, "b": -2}}'
    for text in (f"[{one}]", f"[{one}, {two}]"):
        assert _is_grammar_accept_string(required, text), text
    for text in ("[]", one, f'[{one.replace("get_weather", "get_time")}]',
                 '[{"name": "add", "arguments": {"a": 1}}]',
                 '[{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}]',
                 '[{"arguments": {"a": 1, "b": 2}, "name": "add"}]'):  # fmt: skip
        assert not _is_grammar_accept_string(required, text), text
    single = grammar(calling("required", False))
    assert _is_grammar_accept_string(single, f"[{two}]")
    assert not _is_grammar_accept_string(single, f"[{one}, {two}]")
    named = grammar(calling({"type": "function", "function": {"name": "add"}}))
    assert _is_grammar_accept_string(named, f"[{two}]")
    assert not _is_grammar_accept_string(named, f"[{one}]")


# ---- the output -------------------------------------------------------------------------------


def test_parsing_reads_calls_of_declared_tools_and_nothing_else() -> None:
    auto = calling()
    calls = parse_tool_calls(
        ' [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_weather", "arguments": {"city": "Köln"}}]\n', auto,
    )  # fmt: skip
    assert calls is not None
    assert [(c.name, c.arguments) for c in calls] == [
        ("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Köln"}'),
    ]  # fmt: skip
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].id != calls[1].id
    lone = parse_tool_calls('{"name": "add", "arguments": {}}', auto)
    assert lone is not None and [c.name for c in lone] == ["add"]
    for text in ("Sunny.", "", "[]", "{}", '[{"name": "mul", "arguments": {}}]',
                 '[{"name": "add", "arguments": "{}"}]',
                 '[{"name": "add", "arguments": {}, "why": 1}]',
                 '[{"name": "add", "arguments": {}}] and more', "[1]"):  # fmt: skip
        assert parse_tool_calls(text, auto) is None, text
    pair = '[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {}}]'
    assert parse_tool_calls(pair, auto) is not None
    many = json.dumps([{"name": "add", "arguments": {}}] * (MAX_CALLS + 1))
    assert parse_tool_calls(many, auto) is None
    assert parse_tool_calls(pair, calling("auto", False)) is None
    named = calling({"type": "function", "function": {"name": "get_weather"}})
    assert parse_tool_calls('[{"name": "add", "arguments": {}}]', named) is None


def test_the_stream_holds_back_what_may_be_calls() -> None:
    call = '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    auto = ToolCallStream(calling())
    assert auto.feed(" ", None) == ("", ())
    assert auto.feed("Hel", None) == (" Hel", ())  # not calls: the held text, then as it comes
    assert auto.feed("lo", None) == ("lo", ()) and auto.feed("", "stop") == ("", ())
    held = ToolCallStream(calling())
    assert held.feed(call[:10], None) == ("", ())
    text, calls = held.feed(call[10:], "stop")
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}')]
    not_calls = ToolCallStream(calling())
    assert not_calls.feed("[1, 2", None) == ("", ())
    assert not_calls.feed("]", "stop") == ("[1, 2]", ())
    cut = ToolCallStream(calling("required"))
    assert cut.feed("Hello", None) == ("", ())  # required: all of it
    assert cut.feed(call[:-1], "length") == ("Hello" + call[:-1], ())
    off = ToolCallStream(calling("none"))
    assert off.feed(call, "stop") == (call, ())


def _usage() -> Usage:
    return Usage(3, 4, 0, 0)


def sse_events(data: bytes | None) -> list[dict[str, Any]]:
    assert data is not None
    parts = data.split(b"\n\n")
    assert parts[-1] == b""
    return [json.loads(p.removeprefix(b"data: ")) for p in parts[:-1]]


def test_a_whole_response_carries_the_calls_and_finish_reason_tool_calls() -> None:
    plan = chat_plan(tools=TOOLS, tool_choice="required")
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    out = ChoiceOutput(0, 0)
    out.add(StreamDelta((1,), call[:9]))
    out.add(StreamDelta((2, 3), call[9:], None, FinishReason.STOP, _usage()))
    (choice,) = ResponseWriter(plan, "m", Tokenizer()).response([out])["choices"]
    (made,) = choice["message"]["tool_calls"]
    assert made["id"].startswith("call_")
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert made == {"id": made["id"], "type": "function", "function": function}
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    # cut by max_tokens: the text, as it is
    cut = ChoiceOutput(0, 0)
    cut.add(StreamDelta((1,), call[:9], None, FinishReason.LENGTH, _usage()))
    (choice,) = ResponseWriter(plan, "m", Tokenizer()).response([cut])["choices"]
    assert choice["message"] == {"role": "assistant", "content": call[:9]}
    assert choice["finish_reason"] == "length"
    # auto: text that is not calls is content
    auto = chat_plan(tools=TOOLS)
    text = ChoiceOutput(0, 0)
    text.add(StreamDelta((1,), "Sunny.", None, FinishReason.STOP, _usage()))
    (choice,) = ResponseWriter(auto, "m", Tokenizer()).response([text])["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Sunny.", "stop")


def test_streamed_calls_are_deltas_the_sdk_assembles() -> None:
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    plan = chat_plan(tools=TOOLS, tool_choice="required", stream=True)
    w = ResponseWriter(plan, "m", Tokenizer())
    text = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "add", "arguments": {"a": 1, "b": 2}}]')  # fmt: skip
    out = ChoiceOutput(0, 0)
    events: list[dict[str, Any]] = []
    deltas = [StreamDelta((1,), text[:20]), StreamDelta((2,), text[20:40]),
              StreamDelta((3,), text[40:], None, FinishReason.STOP, _usage())]  # fmt: skip
    for i, delta in enumerate(deltas):
        out.add(delta)
        event = w.chunk(out, delta)
        if i < 2:
            assert event is None  # held back
        else:
            events = sse_events(event)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": events[0]["choices"][0]["delta"]["tool_calls"][0]["id"],
             "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
    ]  # fmt: skip
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "tool_calls"}  # fmt: skip
    assert len(events) == 5
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    done = state.get_final_completion().choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in done.message.tool_calls or ()] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2}),
    ]  # fmt: skip


def test_a_stream_with_auto_passes_text_on_once_it_is_not_calls() -> None:
    plan = chat_plan(tools=TOOLS, stream=True)
    w = ResponseWriter(plan, "m", Tokenizer())
    out = ChoiceOutput(0, 0)
    deltas = [StreamDelta((1,), " "), StreamDelta((2,), "Hi"),
              StreamDelta((3,), "!", None, FinishReason.STOP, _usage())]  # fmt: skip
    got = []
    for d in deltas:
        out.add(d)
        event = w.chunk(out, d)
        got.append(None if event is None else sse_events(event))
    assert got[0] is None
    assert [e["choices"][0]["delta"] for e in got[1] or ()] == [
        {"role": "assistant", "content": " Hi"}
    ]
    last = (got[2] or [{}])[0]["choices"][0]
    assert (last["delta"], last["finish_reason"]) == ({"content": "!"}, "stop")
