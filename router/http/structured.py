"""Structured output as OpenAI and vLLM clients send it → the gRPC request's
`structured_output` (one constraint: a JSON schema, any JSON object, a regex, an EBNF grammar
or a choice of strings; engine/structured compiles and enforces it).

    response_format     {"type": "text"}                    nothing
                        {"type": "json_object"}             any JSON object
                        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
                         "strict": bool}}                   the schema; `strict` (default
                                                            true here: the output always
                                                            validates) forbids properties
                                                            the schema does not declare
    structured_outputs  vLLM's: exactly one of `json` (a schema, as an object or its JSON
                        text), `json_object: true`, `regex`, `choice` (a list of strings),
                        `grammar` (EBNF)
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names

At most one of the three ways per request. A wrong shape is a 400 naming the body's field;
what the router can check of the constraint itself (its size, a schema that is JSON) is
checked by `router.validation.structured_output`, and a worker compiles it (a constraint that
does not compile: 400 with the compiler's words).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.v1 import serving_pb2 as pb
from router.http.protocol import GenerationBody
from router.validation import InvalidRequest

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_VLLM_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_output(body: GenerationBody) -> tuple[str, pb.StructuredOutput | None]:
    """(the body's field that carries the constraint, the constraint; None: free text)."""
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED)
             if getattr(body, name) is not None]  # fmt: skip
    if len(given) > 1:
        raise InvalidRequest(given[1], f"give one of {', '.join(given)}, not several")
    if not given:
        return "", None
    name = given[0]
    value = getattr(body, name)
    if name == "response_format":
        return name, _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise InvalidRequest(name, "an object with one of " + ", ".join(_VLLM_KEYS))
        keys = [k for k in _VLLM_KEYS if value.get(k) not in (None, False)]
        if len(keys) != 1:
            raise InvalidRequest(name, "exactly one of " + ", ".join(_VLLM_KEYS))
        return name, _vllm(name, keys[0], value[keys[0]])
    return name, _vllm(name, name.removeprefix("guided_"), value)


def _response_format(value: Any) -> pb.StructuredOutput | None:
    name = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise InvalidRequest(name, 'type: one of "text", "json_object", "json_schema"')
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidRequest(name, 'json_schema: an object with "name" and "schema" (an object)')
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(name, "json_schema.strict: true or false")
    return pb.StructuredOutput(
        json_schema=json.dumps(spec["schema"]), strict=True if strict is None else strict
    )


def _vllm(name: str, key: str, value: Any) -> pb.StructuredOutput:
    if key == "json":
        if isinstance(value, dict):
            return pb.StructuredOutput(json_schema=json.dumps(value))
        if isinstance(value, str):
            return pb.StructuredOutput(json_schema=value)
        raise InvalidRequest(name, "json: a schema (an object, or its JSON text)")
    if key == "json_object":
        if value is not True:
            raise InvalidRequest(name, "json_object: true")
        return pb.StructuredOutput(json_object=True)
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(name, "choice: a list of strings")
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    if not isinstance(value, str):
        raise InvalidRequest(name, f"{key}: a string")
    if key == "regex":
        return pb.StructuredOutput(regex=value)
    return pb.StructuredOutput(grammar=value)
