"""Validate a GenerateRequest (lifecycle step 1) into a frozen `ValidRequest`.

Every error is an `InvalidRequest` whose message starts with the offending field
("max_tokens: must be >= 1, got 0"); nothing is queued or sent to a worker before validation
passes. Prompt text is tokenized here (the router owns the tokenizer for hashing).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass

from pdserve.v1 import serving_pb2 as pb
from vocabulary.block_hash import scoped_salt
from vocabulary.lora_names import MAX_LORA_NAME_CHARS
from vocabulary.sampling import (
    MAX_STRUCTURED_SPEC_CHARS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutput,
)
from vocabulary.tokenizer import Tokenizer
from vocabulary.tracing import TraceContext

MAX_REQUEST_ID_CHARS = 128
MAX_TENANT_CHARS = 64
MAX_CACHE_SALT_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPT_BYTES_PER_TOKEN = 64  # text far beyond this is refused before tokenizing it
PRIORITY_RANGE = (-10, 10)

ID_CHARS = "A-Z a-z 0-9 and . _ - : / + = @ ~"
"""What a request id and a tenant name may contain (documented in docs/operations.md):
they travel in worker-facing ids, NIXL notices (joined with \\x1f), Redis keys and logs."""
_ID_RE = re.compile(r"[A-Za-z0-9._\-:/+=@~]+")
# Text that travels on (cache salt, stop strings): no C0/C1 control characters but tab and
# newlines (a stop string of "\n" is common), no NUL.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class InvalidRequest(ValueError):
    """Bad input; maps to INVALID_ARGUMENT. The message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnknownLora(LookupError):
    """A request names a LoRA adapter no serving worker has loaded; maps to NOT_FOUND."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"lora: adapter {name!r} is not loaded (load it with `pdserve lora load {name} "
            "PATH`; `pdserve lora list` shows what is)"
        )
        self.name = name


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation; what the orchestrator works on."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str
    """The caller's API key's tenant (with auth off: the request's `tenant` field)."""
    priority: int
    cache_salt: str
    """The salt that scopes its prefix-cache entries: the tenant and the request's own
    `cache_salt` (`vocabulary.block_hash.scoped_salt`), so no two tenants share a cached block."""
    lora: str = ""
    """The LoRA adapter to generate with ("": the base model); part of its prefix-cache
    identity (`vocabulary.block_hash.hash_extra`)."""
    trace: TraceContext | None = None
    """The caller's W3C trace context (a `traceparent` in the call's metadata or headers),
    which the request's trace continues; None: none given, or this router does not trace."""


@dataclass(frozen=True)
class ValidationLimits:
    max_model_len: int
    vocab_size: int
    tenants: frozenset[str] = frozenset()
    """Known tenants; empty means any tenant name is accepted."""
    max_prompt_tokens: int | None = None
    """The most prompt tokens the smallest prefill-capable KV pool can hold (None: unknown)."""
    max_sequence_tokens: int | None = None
    """The most prompt + generated tokens the smallest decode KV pool can hold."""
    max_structured_chars: int = MAX_STRUCTURED_SPEC_CHARS
    """Longest structured-output constraint (RouterLimits.max_structured_chars)."""


def validate(
    req: pb.GenerateRequest,
    tokenizer: Tokenizer,
    limits: ValidationLimits,
    tenant: str | None = None,
    trace: TraceContext | None = None,
) -> ValidRequest:
    """Check every field of `req`; raise InvalidRequest naming the first bad one.

    `tenant` is the caller's, from its API key: it replaces whatever the request's `tenant`
    field says (that field is then ignored). None (auth off): the field is the tenant.
    `trace`: the caller's trace context, from the call's metadata (router/request_spans.py).
    """
    request_id = req.request_id or uuid.uuid4().hex
    check_name("request_id", request_id, MAX_REQUEST_ID_CHARS)
    if tenant is None:
        tenant = req.tenant
        if tenant:
            check_name("tenant", tenant, MAX_TENANT_CHARS)
        if limits.tenants and tenant not in limits.tenants:
            raise InvalidRequest("tenant", f"unknown tenant {tenant!r}")
    _check_text("cache_salt", req.cache_salt, MAX_CACHE_SALT_CHARS)
    if req.lora:
        check_name("lora", req.lora, MAX_LORA_NAME_CHARS)
    stops = tuple(req.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for stop in stops:
        _check_text("stop", stop, MAX_STOP_STRING_CHARS)
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(req.stop_token_ids)}",
        )
    prompt_ids = _prompt_ids(req, tokenizer, limits)
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequest(
            "prompt",
            f"{len(prompt_ids)} tokens leave no room to generate within the context length "
            f"of {limits.max_model_len} tokens",
        )
    if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(
            "prompt",
            f"{len(prompt_ids)} tokens are more than a worker's KV cache can ever hold "
            f"({limits.max_prompt_tokens} tokens)",
        )
    max_tokens = int(req.max_tokens)
    if max_tokens < 1:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {max_tokens}")
    if len(prompt_ids) + max_tokens > limits.max_model_len:
        raise InvalidRequest(
            "max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context length of {limits.max_model_len} tokens",
        )
    if (
        limits.max_sequence_tokens is not None
        and len(prompt_ids) + max_tokens > limits.max_sequence_tokens
    ):
        raise InvalidRequest(
            "max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) is more than a "
            f"decode worker's KV cache can ever hold ({limits.max_sequence_tokens} tokens)",
        )
    bad_stop_ids = [t for t in req.stop_token_ids if t >= limits.vocab_size]
    if bad_stop_ids:
        raise InvalidRequest(
            "stop_token_ids",
            f"id {bad_stop_ids[0]} is outside the vocabulary [0, {limits.vocab_size})",
        )
    biased = sorted(t for t in req.logit_bias if t >= limits.vocab_size)
    if biased:
        raise InvalidRequest(
            "logit_bias", f"token id {biased[0]} is outside the vocabulary [0, {limits.vocab_size})"
        )
    if not PRIORITY_RANGE[0] <= req.priority <= PRIORITY_RANGE[1]:
        raise InvalidRequest("priority", f"must be in [-10, 10], got {req.priority}")
    for name in _FLOAT_FIELDS:
        value = getattr(req, name)
        if not math.isfinite(value):  # inf passes the range checks below (inf >= 0)
            raise InvalidRequest(name, f"must be a finite number, got {value}")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature if req.HasField("temperature") else 1.0,
            top_p=req.top_p if req.HasField("top_p") else 1.0,
            top_k=int(req.top_k),
            min_p=req.min_p,
            repetition_penalty=(
                req.repetition_penalty if req.HasField("repetition_penalty") else 1.0
            ),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed if req.HasField("seed") else None,
            stop=stops,
            stop_token_ids=tuple(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=req.logprobs,
            logit_bias=tuple(req.logit_bias.items()),
            structured=structured_output(req, limits.max_structured_chars),
            top_logprobs=int(req.top_logprobs),
            prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
        )
    except SamplingParamsError as e:
        raise InvalidRequest(e.field, str(e).split(": ", 1)[1]) from e
    return ValidRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        tenant=tenant,
        priority=int(req.priority),
        cache_salt=scoped_salt(tenant, req.cache_salt),
        lora=req.lora,
        trace=trace,
    )


def structured_output(req: pb.GenerateRequest, max_chars: int) -> StructuredOutput | None:
    """The request's constraint (None: free text), checked as far as the router can: its
    kind, its size, a schema that is JSON. Whether it compiles the worker says (its
    compiler's words, INVALID_ARGUMENT naming structured_output, before any model work)."""
    if not req.HasField("structured_output"):
        return None
    field = "structured_output"
    so = req.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(field, "set one of json_schema, json_object, regex, grammar, choice")
    if so.HasField("strict") and kind != "json_schema":
        raise InvalidRequest(field, "strict is for json_schema")
    spec = getattr(so, kind) if kind in ("json_schema", "regex", "grammar") else ""
    choices = tuple(so.choice.choices) if kind == "choice" else ()
    if kind == "json_object" and not so.json_object:
        raise InvalidRequest(
            field, "json_object: set it to true (unset the constraint for free text)"
        )
    size = len(spec) + sum(len(c) for c in choices)
    if size > max_chars:
        raise InvalidRequest(field, f"{kind}: {size} characters, at most {max_chars}")
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidRequest(field, f"json_schema: not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise InvalidRequest(field, "json_schema: a schema is a JSON object")
    strict = so.strict if so.HasField("strict") else True
    return StructuredOutput(kind, spec, strict, choices)  # SamplingParamsError: the caller's


def check_name(field: str, value: str, max_chars: int) -> None:
    """An id-like string: 1..max_chars characters of `ID_CHARS`."""
    if len(value) > max_chars:
        raise InvalidRequest(field, f"must be at most {max_chars} characters, got {len(value)}")
    if not _ID_RE.fullmatch(value):
        bad = next((c for c in value if not _ID_RE.fullmatch(c)), "")
        raise InvalidRequest(
            field, f"character {bad!r} is not allowed (use {ID_CHARS}; at most {max_chars})"
        )


def _check_text(field: str, value: str, max_chars: int) -> None:
    """Free text that travels past the router: bounded, no control characters but tab and
    newlines."""
    if len(value) > max_chars:
        raise InvalidRequest(field, f"must be at most {max_chars} characters, got {len(value)}")
    bad = _CONTROL_RE.search(value)
    if bad is not None:
        raise InvalidRequest(field, f"control character {bad.group()!r} is not allowed")


def _prompt_ids(
    req: pb.GenerateRequest, tokenizer: Tokenizer, limits: ValidationLimits
) -> tuple[int, ...]:
    if req.prompt and req.token_ids:
        raise InvalidRequest("prompt", "set either prompt or token_ids, not both")
    if req.token_ids:
        bad = [t for t in req.token_ids if t >= limits.vocab_size]
        if bad:
            raise InvalidRequest(
                "token_ids", f"id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})"
            )
        return tuple(req.token_ids)
    if not req.prompt:
        raise InvalidRequest("prompt", "must not be empty (set prompt or token_ids)")
    max_bytes = limits.max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
    if len(req.prompt) > max_bytes:
        raise InvalidRequest(
            "prompt",
            f"{len(req.prompt)} characters is far over the context length "
            f"of {limits.max_model_len} tokens",
        )
    return tuple(tokenizer.encode(req.prompt))


_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)  # fmt: skip

# Top-level string fields of GenerateRequest, by field number (for the UTF-8 check below).
_STRING_FIELDS = {
    1: "request_id", 2: "prompt", 13: "stop", 17: "tenant", 19: "cache_salt", 20: "lora",
}  # fmt: skip


def find_invalid_utf8_field(data: bytes) -> str | None:
    """Name of the first string field of a serialized GenerateRequest that is not UTF-8.

    Protobuf refuses to parse such a message at all; this scan of the wire format lets the
    servicer answer INVALID_ARGUMENT naming the field instead of a generic parse error.
    Returns None when no string field is bad (or the bytes are not a parseable message).
    """
    pos, n = 0, len(data)
    try:
        while pos < n:
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + length], pos + length
                if number in _STRING_FIELDS:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return _STRING_FIELDS[number]
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
