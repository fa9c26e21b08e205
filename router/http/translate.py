"""An OpenAI request body → the requests the orchestrator serves (a `GenerationPlan`).

The HTTP door speaks to validation in the gRPC request's own terms: each prompt becomes a
`GenerateRequest` that `router.validation.validate` checks, exactly as it checks one that
came over gRPC, so both doors accept and refuse the same values with the same words. Only
the names differ: an error names the body's field (`prompt`, `messages`,
`max_completion_tokens`, `prompt[2]`) or header (`x-request-id`), not the gRPC field.

Before that, this module checks what only the HTTP door has: the model name (404), fields
pdserve cannot honour (`audio`, `suffix`, `functions`, ...: 400
naming the field, never a silent ignore), the JSON shapes of `prompt`, `stop` and
`messages`, integers that a protobuf field cannot hold, chat's tools (router/http/tools.py:
with `tool_choice` required or a named function they become the output's constraint), and
renders chat messages and tools with the checkpoint's template (router/http/chat.py).

`n` choices of one prompt are siblings: one request validated and tokenized once, then
copied with seeds `seed`, `seed + 1`, ... (so they differ and each stays reproducible).
Choice `i * n + j` is sibling `j` of prompt `i`, as in OpenAI's API.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pdserve.v1 import serving_pb2 as pb
from router.http.chat import ChatTemplate, template_messages
from router.http.errors import ApiError, failure
from router.http.protocol import ChatCompletionRequest, CompletionRequest, GenerationBody
from router.http.structured import structured_output
from router.http.tools import ToolCalling, tool_calling
from router.request_spans import http_caller_context
from router.validation import (
    MAX_PROMPT_BYTES_PER_TOKEN,
    InvalidRequest,
    ValidationLimits,
    ValidRequest,
    validate,
)
from vocabulary.logprobs import MAX_TOP_LOGPROBS
from vocabulary.tracing import TraceContext

MAX_CHOICES = 64
"""The most choices one request may ask for (prompts times n)."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat defaults to what the context leaves."""

REQUEST_ID_HEADER = "x-request-id"
TENANT_HEADER = "x-pdserve-tenant"
"""Set by the gateway in front (like the gRPC field `tenant`); the default tenant without.
Ignored with API keys on: the tenant is the key's."""
TIMEOUT_HEADER = "x-request-timeout"
"""Seconds the request may take (like a gRPC deadline); the router's default without."""

_UINT32 = 2**32


def _off(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_off([]), "tool calling is on /v1/chat/completions"),
    "tool_choice": (_off("none"), "tool calling is on /v1/chat/completions"),
    "functions": (_off([]), "function calling is not supported"),
    "function_call": (_off("none"), "function calling is not supported"),
    "audio": (_off(), "audio output is not supported"),
    "modalities": (_off(["text"]), 'only ["text"] output is supported'),
    "prediction": (_off(), "predicted outputs are not supported"),
    "web_search_options": (_off(), "web search is not supported"),
    "reasoning_effort": (_off(), "this model does not reason"),
    "store": (_off(False), "pdserve does not store completions"),
    "suffix": (_off(""), "suffixes (insertion) are not supported"),
    "best_of": (_off(1), "best_of is not supported (n is)"),
}  # fmt: skip
"""Fields OpenAI (or vLLM) defines that pdserve cannot honour, with the values that ask for
nothing (those pass)."""


class Endpoint(enum.Enum):
    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_index: int
    request: ValidRequest


@dataclass(frozen=True)
class GenerationPlan:
    """One HTTP request as the orchestrator serves it: a request per choice."""

    endpoint: Endpoint
    choices: tuple[Choice, ...]
    n: int
    """Siblings per prompt: choices `i * n` .. `i * n + n - 1` share prompt `i`."""
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool
    timeout_s: float | None
    """From the timeout header; None: the router's default request deadline."""
    model: str = ""
    """The body's `model`: the served model's id, or a LoRA adapter's name."""
    constraint_field: str = ""
    """The body's field that carries the structured-output constraint ("": none)."""
    tools: ToolCalling | None = None
    """Chat's tools (None: none declared); the output is read as calls when they parse."""

    def param_name(self, field: str) -> str:
        """A request field as the body names it (a worker's error on the constraint names
        structured_output; the client sent response_format, structured_outputs, ...)."""
        if field == "structured_output" and self.constraint_field:
            return self.constraint_field
        return field

    echo: bool = False
    """Completions: the text (and logprobs) start with the prompt's."""
    echo_texts: tuple[str, ...] = ()
    """With `echo`: per prompt, the text it is echoed as."""
    discard_output: bool = False
    """`max_tokens: 0` (with echo): the one token the engine samples is not shown."""

    @property
    def response_id(self) -> str:
        prefix = "chatcmpl-" if self.endpoint is Endpoint.CHAT else "cmpl-"
        return prefix + self.choices[0].request.request_id


class Translator:
    """Turns bodies into plans for one model (its id, tokenizer, template and limits)."""

    def __init__(
        self,
        model_id: str,
        tokenizer: Any,
        chat_template: ChatTemplate | None,
        limits: Callable[[], ValidationLimits],
        loras: Callable[[], Collection[str]] = tuple,
    ) -> None:
        """`loras`: the LoRA adapters the cluster serves now (each a `model` of its own)."""
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.limits = limits
        self.loras = loras

    def completion(
        self, body: CompletionRequest, headers: Mapping[str, str], tenant: str | None = None
    ) -> GenerationPlan:
        """`tenant`: the caller's API key's (None: auth off, the tenant header counts)."""
        self._common(body)
        top = _top_logprobs("logprobs", body.logprobs)
        echo = bool(body.echo)
        prompts = _prompts(body.prompt)
        n = _n(body, len(prompts))
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not echo:
            raise InvalidRequest("max_tokens", "must be >= 1 (0 only with echo: true), got 0")
        discard = max_tokens == 0
        logprobs = body.logprobs is not None
        requests, texts = [], []
        trace = http_caller_context(headers)
        constraint = structured_output(body)
        sampled = 1 if discard else max_tokens
        for name, prompt in prompts:
            req = self._proto(body, headers, "max_tokens", sampled, logprobs, constraint[1])
            req.top_logprobs = top
            if echo and logprobs:
                req.prompt_logprobs = top
            if isinstance(prompt, str):
                req.prompt = prompt
            else:
                req.token_ids.extend(prompt)
            requests.append(self._validate(req, constraint[0], name, "max_tokens", tenant, trace))
            if echo:
                texts.append(prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt))
        plan = self._plan(Endpoint.COMPLETIONS, body, headers, requests, n, logprobs)
        return replace(plan, echo=echo, echo_texts=tuple(texts), discard_output=discard,
                       constraint_field=constraint[0])  # fmt: skip

    def chat(
        self, body: ChatCompletionRequest, headers: Mapping[str, str], tenant: str | None = None
    ) -> GenerationPlan:
        self._common(body)
        top = _top_logprobs("top_logprobs", body.top_logprobs)
        if (body.model_extra or {}).get("echo"):
            raise InvalidRequest("echo", "only /v1/completions echoes the prompt")
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        if self.chat_template is None:
            raise InvalidRequest(
                "messages", f"model {self.model_id!r} has no chat template (no chat_template in "
                "its tokenizer_config.json): use /v1/completions",
            )  # fmt: skip
        field, constraint = structured_output(body)
        tools = tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls, field)
        calls = tools.constraint() if tools is not None else None
        if calls is not None:
            field, constraint = "tools", calls
        messages = template_messages(body.messages)
        text = self.chat_template.render(messages, tools.definitions if tools else None)
        limits = self.limits()
        if len(text) > limits.max_model_len * MAX_PROMPT_BYTES_PER_TOKEN:
            raise InvalidRequest(
                "messages", f"{len(text)} characters is far over the context length of "
                f"{limits.max_model_len} tokens",
            )  # fmt: skip
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if body.max_completion_tokens is not None:
            name, max_tokens = "max_completion_tokens", body.max_completion_tokens
        elif body.max_tokens is not None:
            name, max_tokens = "max_tokens", body.max_tokens
        else:  # what the context and the smallest decode KV pool leave
            room = min(limits.max_model_len, limits.max_sequence_tokens or limits.max_model_len)
            name, max_tokens = "max_completion_tokens", max(room - len(ids), 1)
        logprobs = bool(body.logprobs)
        req = self._proto(body, headers, name, max_tokens, logprobs, constraint)
        req.top_logprobs = top
        req.token_ids.extend(ids)
        trace = http_caller_context(headers)
        valid = self._validate(req, field, "messages", name, tenant, trace)
        plan = self._plan(Endpoint.CHAT, body, headers, [valid], _n(body, 1), logprobs)
        return replace(plan, constraint_field=field, tools=tools)

    # ---- shared ------------------------------------------------------------------------------

    def _common(self, body: GenerationBody) -> None:
        """The model, and the fields no value of which pdserve can honour."""
        if body.model != self.model_id and body.model not in self.loras():
            raise ApiError(failure(
                404, f"model: the model {body.model!r} does not exist; this server serves "
                f"{self.model_id!r} and its LoRA adapters (GET /v1/models)", "model",
                "model_not_found",
            ))  # fmt: skip
        for name, value in (body.model_extra or {}).items():
            refused = _REFUSED.get(name)
            if refused is not None and not refused[0](value):
                raise InvalidRequest(name, refused[1])
        if body.stream_options is not None and not body.stream:
            raise InvalidRequest("stream_options", "only allowed when stream is true")

    def _proto(
        self,
        body: GenerationBody,
        headers: Mapping[str, str],
        max_name: str,
        max_tokens: int,
        logprobs: bool,
        constraint: pb.StructuredOutput | None,
    ) -> pb.GenerateRequest:
        """The body's sampling fields and `constraint` as a GenerateRequest (the prompt is
        the caller's)."""
        req = pb.GenerateRequest(
            request_id=headers.get(REQUEST_ID_HEADER, ""),
            tenant=headers.get(TENANT_HEADER, ""),
            max_tokens=_uint(max_name, max_tokens),
            top_k=0 if body.top_k == -1 else _uint("top_k", body.top_k or 0),
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            stop=_stops(body.stop),
            stop_token_ids=[_uint("stop_token_ids", t) for t in body.stop_token_ids or ()],
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            cache_salt=body.cache_salt or "",
            lora="" if body.model == self.model_id else body.model,
        )  # fmt: skip
        if body.priority is not None:
            if not -10 <= body.priority <= 10:
                raise InvalidRequest("priority", f"must be in [-10, 10], got {body.priority}")
            req.priority = body.priority
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(body, name)
            if value is not None:
                setattr(req, name, value)
        if body.seed is not None:
            if not 0 <= body.seed < 2**64:
                raise InvalidRequest("seed", f"must be in [0, 2**64), got {body.seed}")
            req.seed = body.seed
        for key, bias in (body.logit_bias or {}).items():
            digits = key.isascii() and key.isdigit() and len(key) <= 10  # no sign, no spaces
            token = int(key) if digits else -1
            if not 0 <= token < _UINT32:
                raise InvalidRequest("logit_bias", f"keys are token ids, got {key!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise InvalidRequest("logit_bias", f"token {key}: bias must be a number")
            req.logit_bias[token] = bias
        if constraint is not None:
            req.structured_output.CopyFrom(constraint)
        return req

    def _validate(
        self,
        req: pb.GenerateRequest,
        constraint_field: str,
        prompt_name: str,
        max_name: str,
        tenant: str | None,
        trace: TraceContext | None,
    ) -> ValidRequest:
        """`validate`, with its field names turned into the body's (`constraint_field`:
        the one that carries the constraint)."""
        try:
            return validate(req, self.tokenizer, self.limits(), tenant, trace)
        except InvalidRequest as e:
            names = {"prompt": prompt_name, "token_ids": prompt_name, "max_tokens": max_name,
                     "request_id": REQUEST_ID_HEADER, "tenant": TENANT_HEADER,
                     "structured_output": constraint_field}  # fmt: skip
            param = names.get(e.field, e.field)
            raise InvalidRequest(param, str(e)[len(e.field) + 2 :]) from e

    def _plan(
        self,
        endpoint: Endpoint,
        body: GenerationBody,
        headers: Mapping[str, str],
        prompts: list[ValidRequest],
        n: int,
        logprobs: bool,
    ) -> GenerationPlan:
        choices = []
        for i, first in enumerate(prompts):
            for j in range(n):
                choices.append(Choice(i * n + j, i, _sibling(first, j)))
        options = body.stream_options
        return GenerationPlan(
            endpoint=endpoint,
            choices=tuple(choices),
            n=n,
            stream=bool(body.stream),
            include_usage=bool(options is not None and options.include_usage),
            logprobs=logprobs,
            return_token_ids=bool(body.return_token_ids),
            timeout_s=_timeout(headers.get(TIMEOUT_HEADER)),
            model=body.model,
        )


def _n(body: GenerationBody, num_prompts: int) -> int:
    n = 1 if body.n is None else body.n
    if n < 1:
        raise InvalidRequest("n", f"must be >= 1, got {n}")
    if n * num_prompts > MAX_CHOICES:
        raise InvalidRequest(
            "n", f"{n} choices of {num_prompts} prompts is more than {MAX_CHOICES} per request"
        )
    return n


def _top_logprobs(name: str, value: int | None) -> int:
    """Completions' `logprobs: N` or chat's `top_logprobs: N`: alternatives per token."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value or 0


def _sibling(first: ValidRequest, j: int) -> ValidRequest:
    seed = first.sampling.seed
    if j == 0 or seed is None:
        return first
    return replace(first, sampling=replace(first.sampling, seed=(seed + j) % 2**64))


def _uint(name: str, value: int) -> int:
    if not 0 <= value < _UINT32:
        if name in ("max_tokens", "max_completion_tokens") and value < 1:
            raise InvalidRequest(name, f"must be >= 1, got {value}")
        raise InvalidRequest(name, f"must be in [0, {_UINT32 - 1}], got {value}")
    return value


def _timeout(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequest(TIMEOUT_HEADER, f"must be a number of seconds > 0, got {raw!r}")
    return seconds


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequest("stop", "must be a string or a list of strings")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(prompt: Any) -> list[tuple[str, str | list[int]]]:
    """The prompts of a completion body, each with the name errors call it by: one string,
    strings, token ids or lists of token ids."""
    shape = "must be a string, a list of strings, a list of token ids or a list of lists of ids"
    if isinstance(prompt, str):
        return [("prompt", prompt)]
    if not isinstance(prompt, list):
        raise InvalidRequest("prompt", shape if prompt is not None else "is required")
    if not prompt:
        raise InvalidRequest("prompt", "must not be empty")
    if _is_ids(prompt):
        return [("prompt", _token_ids("prompt", prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(f"prompt[{i}]", p) for i, p in enumerate(prompt)]
    if all(_is_ids(p) for p in prompt):
        return [(f"prompt[{i}]", _token_ids(f"prompt[{i}]", p)) for i, p in enumerate(prompt)]
    raise InvalidRequest("prompt", shape)


def _token_ids(name: str, ids: list[int]) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < _UINT32), None)
    if bad is not None:
        raise InvalidRequest(name, f"id {bad} is not a token id")
    return ids
