"""Validate a GenerateRequest (lifecycle step 1) into a frozen `ValidRequest`.

Every error is an `InvalidRequest` whose message starts with the offending field
("max_tokens: must be >= 1, got 0"); nothing is queued or sent to a worker before validation
passes. Prompt text is tokenized here (the router owns the tokenizer for hashing).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.tokenizer import Tokenizer
from pdserve.v1 import serving_pb2 as pb

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_PROMPT_BYTES_PER_TOKEN = 64  # text far beyond this is refused before tokenizing it
PRIORITY_RANGE = (-10, 10)


class InvalidRequest(ValueError):
    """Bad input; maps to INVALID_ARGUMENT. The message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation; what the orchestrator works on."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str
    priority: int
    cache_salt: str


@dataclass(frozen=True)
class ValidationLimits:
    max_model_len: int
    vocab_size: int
    tenants: frozenset[str] = frozenset()
    """Known tenants; empty means any tenant name is accepted."""


def validate(
    req: pb.GenerateRequest, tokenizer: Tokenizer, limits: ValidationLimits
) -> ValidRequest:
    """Check every field of `req`; raise InvalidRequest naming the first bad one."""
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > 128:
        raise InvalidRequest("request_id", f"must be at most 128 characters, got {len(request_id)}")
    prompt_ids = _prompt_ids(req, tokenizer, limits)
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequest(
            "prompt",
            f"{len(prompt_ids)} tokens leave no room to generate within the context length "
            f"of {limits.max_model_len} tokens",
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
    stops = tuple(req.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise InvalidRequest("stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} chars")
    bad_stop_ids = [t for t in req.stop_token_ids if t >= limits.vocab_size]
    if bad_stop_ids:
        raise InvalidRequest(
            "stop_token_ids",
            f"id {bad_stop_ids[0]} is outside the vocabulary [0, {limits.vocab_size})",
        )
    if not PRIORITY_RANGE[0] <= req.priority <= PRIORITY_RANGE[1]:
        raise InvalidRequest("priority", f"must be in [-10, 10], got {req.priority}")
    if limits.tenants and req.tenant not in limits.tenants:
        raise InvalidRequest("tenant", f"unknown tenant {req.tenant!r}")
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
        )
    except SamplingParamsError as e:
        raise InvalidRequest(e.field, str(e).split(": ", 1)[1]) from e
    return ValidRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        tenant=req.tenant,
        priority=int(req.priority),
        cache_salt=req.cache_salt,
    )


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
_STRING_FIELDS = {1: "request_id", 2: "prompt", 13: "stop", 17: "tenant", 19: "cache_salt"}


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
