"""OpenAI tool calling on /v1/chat/completions: the request's `tools`, `tool_choice` and
`parallel_tool_calls` → a `ToolCalling`; the generated text → tool calls.

The format. The model calls tools by answering with a JSON array of calls and nothing else:

    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ..., ...}]

(the tiny model's chat template renders past calls the same way and lists the tools in a
preamble, deploy/checkpoints/make_model.py). The response carries each call as OpenAI's
`{"id": "call_...", "type": "function", "function": {"name", "arguments": <JSON text>}}`.

    tool_choice   the output                                        parsed afterwards
    none          free text (the tools are still rendered)          no
    auto          free text (default with tools)                    yes: tool calls if the
                                                                    whole text is calls of
                                                                    declared tools, else text
    required      constrained: an array of 1 to 8 calls of           yes (always parses, unless
                  declared tools (one with parallel_tool_calls      max_tokens cuts it)
                  false), each `arguments` that tool's parameters
    {"type": "function", "function": {"name": N}}
                  constrained: exactly one call of N                yes

The constraint is a JSON schema (strict) the workers compile like any `response_format`; it
cannot be combined with another constraint (400 naming tool_choice). With `auto` and a
`response_format` the output follows the format and is not parsed for calls.

A streamed choice whose text may be tool calls is held back (`ToolCallStream`): all of it
with required or a named function, and with auto while the text so far (leading whitespace
aside) is empty or starts with `[` or `{`; at the end it leaves as `delta.tool_calls` (per
call: index, id, type and name, then the arguments) or, when it did not parse, as content.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.v1 import serving_pb2 as pb
from router.validation import InvalidRequest

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function's name."""
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_CALLS = 8
"""The most calls one answer makes. A bound, so that a constrained answer ends: a model that
repeats itself (the tiny one does, at temperature 1) would fill max_tokens with calls."""


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"
    """One call of the function `ToolCalling.named`."""


@dataclass(frozen=True)
class Tool:
    """A declared function: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class ToolCalling:
    """A chat request's tools as the door serves them."""

    tools: tuple[Tool, ...]
    definitions: tuple[dict[str, Any], ...]
    """The body's tool objects, as the chat template takes them (`tools=`)."""
    choice: ToolChoice
    named: str = ""
    parallel: bool = True
    parses: bool = True
    """Whether the output is read as tool calls (not with none, nor auto beside a
    response_format)."""

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def max_calls(self) -> int:
        """The most calls one answer may make."""
        if self.choice is ToolChoice.NAMED or not self.parallel:
            return 1
        return MAX_CALLS

    def constraint(self) -> pb.StructuredOutput | None:
        """The output's constraint: with required or a named function, the calls' schema."""
        if self.choice not in (ToolChoice.REQUIRED, ToolChoice.NAMED):
            return None
        return pb.StructuredOutput(json_schema=json.dumps(self.schema()), strict=True)

    def schema(self) -> dict[str, Any]:
        """The JSON schema of an answer of calls (an array of {"name", "arguments"})."""
        tools = self.tools
        if self.choice is ToolChoice.NAMED:
            tools = tuple(t for t in tools if t.name == self.named)
        calls = [_call_schema(t) for t in tools]
        schema: dict[str, Any] = {
            "type": "array",
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "minItems": 1,
            "maxItems": self.max_calls,
        }
        return schema


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# ---- the request ------------------------------------------------------------------------------


def tool_calling(
    tools: Any, tool_choice: Any, parallel_tool_calls: Any, other_constraint: str = ""
) -> ToolCalling | None:
    """The body's tool fields (None: no tools). `other_constraint`: the body's field that
    constrains the output otherwise ("": none). InvalidRequest names the field."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls", "must be true or false")
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice", "needs tools (none are declared)")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools", "must be a list of function tools")
    declared = tuple(_tool(i, t) for i, t in enumerate(tools))
    seen: set[str] = set()
    for i, tool in enumerate(declared):
        if tool.name in seen:
            raise InvalidRequest(f"tools[{i}].function.name", f"{tool.name!r} is declared twice")
        seen.add(tool.name)
    choice, named = _choice(tool_choice, seen)
    constrains = choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)
    if constrains and other_constraint:
        raise InvalidRequest(
            "tool_choice", f"{_choice_words(choice, named)} constrains the output; it cannot be "
            f"combined with {other_constraint}",
        )  # fmt: skip
    return ToolCalling(
        tools=declared,
        definitions=tuple(tools),
        choice=choice,
        named=named,
        parallel=True if parallel_tool_calls is None else parallel_tool_calls,
        parses=choice is not ToolChoice.NONE and (constrains or not other_constraint),
    )


def _tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidRequest(where, 'must be an object {"type": "function", "function": {...}}')
    if tool.get("type") != "function":
        raise InvalidRequest(f"{where}.type", f'only "function" tools, got {tool.get("type")!r}')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(f"{where}.function", 'must be an object with a "name"')
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"{where}.function.name", f"1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters", _NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.function.parameters", "must be a JSON schema (an object)")
    if parameters.get("type", "object") != "object":
        raise InvalidRequest(
            f"{where}.function.parameters", f'type must be "object", got {parameters["type"]!r}'
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{where}.function.strict", "must be true or false")
    return Tool(name, parameters)


def _choice(value: Any, names: set[str]) -> tuple[ToolChoice, str]:
    if value is None:
        return ToolChoice.AUTO, ""
    if value in ("none", "auto", "required"):
        return ToolChoice(value), ""
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(
        function, dict
    ):  # fmt: skip
        raise InvalidRequest(
            "tool_choice",
            '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        )
    name = function.get("name")
    if name not in names:
        raise InvalidRequest(
            "tool_choice", f"names {name!r}, not a declared tool ({', '.join(sorted(names))})"
        )
    return ToolChoice.NAMED, name


def _choice_words(choice: ToolChoice, named: str) -> str:
    return f"function {named!r}" if choice is ToolChoice.NAMED else '"required"'


def assistant_tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as the chat template takes them: each
    {"id", "type": "function", "function": {"name", "arguments"}}, the arguments an object
    when their text is JSON of one (else the text as sent)."""
    if not isinstance(calls, list):
        raise InvalidRequest(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidRequest(f"{at}.function", 'must be an object {"name", "arguments"}')
        if call.get("type", "function") != "function":
            raise InvalidRequest(f"{at}.type", f'must be "function", got {call.get("type")!r}')
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{at}.function.name", "must be a non-empty string")
        if not isinstance(arguments, str):
            raise InvalidRequest(f"{at}.function.arguments", "must be a string (JSON text)")
        try:
            parsed: Any = json.loads(arguments)
        except ValueError:
            parsed = arguments
        args = parsed if isinstance(parsed, dict) else arguments
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequest(f"{at}.id", "must be a string")
        out.append({"id": call_id or "", "type": "function",
                    "function": {"name": name, "arguments": args}})  # fmt: skip
    return out


# ---- the output -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call the model made, as the response carries it."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        call: dict[str, Any] = {"id": self.id, "type": "function", "function": function}
        return call if index is None else {"index": index, **call}


def parse_tool_calls(text: str, calling: ToolCalling) -> tuple[ToolCall, ...] | None:
    """The calls `text` makes in the format (a JSON array of {"name", "arguments"}, or one
    such object alone), of declared tools and within `max_calls`; None when it is not that.
    The arguments are not checked against the tool's parameters (with auto the model may
    call a tool wrongly, and the client hears it as it was said)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    limit = calling.max_calls
    if not items or len(items) > limit:
        return None
    names = {calling.named} if calling.choice is ToolChoice.NAMED else calling.names
    calls = []
    for item in items:
        if not isinstance(item, dict) or set(item) != {"name", "arguments"}:
            return None
        if item["name"] not in names or not isinstance(item["arguments"], dict):
            return None
        arguments = json.dumps(item["arguments"], ensure_ascii=False)
        calls.append(ToolCall(new_call_id(), item["name"], arguments))
    return tuple(calls)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallStream:
    """One streamed choice's text: what to send as content now, and at its end the calls.

    Holding → (auto: the text shows it is not calls) passing, or → (the end) done: the text
    parsed as calls, or it leaves as content."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.holding = calling.parses
        self._held: list[str] = []

    def feed(self, text: str, finish: str | None) -> tuple[str, tuple[ToolCall, ...]]:
        """(content to send now, the calls: only at the end); `finish`: the choice's finish
        reason when this is its last text (calls only parse when it stopped)."""
        if not self.holding:
            return text, ()
        self._held.append(text)
        held = "".join(self._held)
        start = held.lstrip()[:1]
        if self.calling.choice is ToolChoice.AUTO and start and start not in "[{":
            self.holding = False
            return held, ()
        if finish is None:
            return "", ()
        self.holding = False
        calls = parse_tool_calls(held, self.calling) if finish == "stop" else None
        return ("", calls) if calls else (held, ())
