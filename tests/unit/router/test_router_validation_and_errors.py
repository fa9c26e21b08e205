"""Request validation, the wire-level UTF-8 check, the error → status mapping and the
reflection pool: exact answers on hand-made inputs (no cluster)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool

from admission.decision import AdmissionRejected, Reason
from pdserve.v1 import serving_pb2 as pb
from router.errors import WorkerLost, to_grpc_failure
from router.placement import NoWorkerError
from router.router_server import _ReflectionPool
from router.validation import (
    InvalidRequest,
    UnknownLora,
    ValidationLimits,
    ValidRequest,
    find_invalid_utf8_field,
    validate,
)
from vocabulary.block_hash import scoped_salt
from vocabulary.worker_api import RequestAborted, RequestDeadlineExceeded, WorkerOverloaded

LIMITS = ValidationLimits(max_model_len=64, vocab_size=100, tenants=frozenset({"", "acme"}))


class _NoTokenizer:
    """Requests here carry token ids; encoding text would be a test bug."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def _validate(**fields: object) -> ValidRequest:
    return validate(pb.GenerateRequest(**fields), _NoTokenizer(), LIMITS)  # type: ignore[arg-type]


def test_valid_request_keeps_every_field() -> None:
    v = _validate(
        token_ids=[1, 2, 3], max_tokens=5, temperature=0.0, top_p=0.5, seed=7, stop=["x"],
        tenant="acme", priority=-3, cache_salt="s", request_id="r1",
    )  # fmt: skip
    assert v.request_id == "r1"
    assert v.prompt_token_ids == (1, 2, 3)
    s = v.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (5, 0.0, 0.5, 7, ("x",))
    assert (v.tenant, v.priority) == ("acme", -3)
    assert v.cache_salt == scoped_salt("acme", "s")  # the tenant scopes its cache entries


def test_logit_bias_reaches_the_sampling_params() -> None:
    s = _validate(token_ids=[1], max_tokens=1, logit_bias={9: -100.0, 2: 0.5}).sampling
    assert s.logit_bias == ((2, 0.5), (9, -100.0))


def test_unset_sampling_fields_get_their_documented_defaults() -> None:
    s = _validate(token_ids=[1], max_tokens=1).sampling
    assert (s.temperature, s.top_p, s.repetition_penalty, s.seed) == (1.0, 1.0, 1.0, None)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(token_ids=[1], max_tokens=1, temperature=float("inf")), "temperature"),
        (dict(token_ids=[1], max_tokens=1, top_p=float("nan")), "top_p"),
        (dict(token_ids=[1], max_tokens=1, frequency_penalty=float("-inf")), "frequency_penalty"),
        (dict(token_ids=[1] * 64, max_tokens=1), "prompt"),
        (dict(token_ids=[1] * 60, max_tokens=5), "max_tokens"),
        (dict(token_ids=[1], max_tokens=1, tenant="other"), "tenant"),
        (dict(token_ids=[1], max_tokens=1, logit_bias={100: 1.0}), "logit_bias"),  # vocab 100
        (dict(token_ids=[1], max_tokens=1, logit_bias={5: 100.5}), "logit_bias"),
        (dict(token_ids=[1], max_tokens=1, logit_bias={5: float("nan")}), "logit_bias"),
    ],
)
def test_invalid_request_names_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        _validate(**fields)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def _raw(number: int, payload: bytes) -> bytes:
    base = pb.GenerateRequest(token_ids=[1], max_tokens=1).SerializeToString()
    key = (number << 3) | 2
    tag = bytes([key]) if key < 128 else bytes([(key & 0x7F) | 0x80, key >> 7])
    return base + tag + bytes([len(payload)]) + payload


@pytest.mark.parametrize(
    ("number", "field"), [(1, "request_id"), (2, "prompt"), (13, "stop"), (17, "tenant"),
                          (19, "cache_salt"), (20, "lora")],
)  # fmt: skip
def test_invalid_utf8_is_found_in_its_field(number: int, field: str) -> None:
    assert find_invalid_utf8_field(_raw(number, b"ok\xff")) == field


def test_valid_utf8_and_garbage_find_no_field() -> None:
    assert find_invalid_utf8_field(_raw(13, "é".encode())) is None
    assert find_invalid_utf8_field(b"\x0f") is None  # wire type 7: not a message


@pytest.mark.parametrize(
    ("exc", "code", "retry"),
    [
        (InvalidRequest("prompt", "bad"), grpc.StatusCode.INVALID_ARGUMENT, False),
        (AdmissionRejected(250.0, Reason.INFLIGHT_LIMIT, "busy"),
         grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        (AdmissionRejected(None, Reason.NO_LIVE_WORKER, "none"), grpc.StatusCode.UNAVAILABLE,
         False),
        (AdmissionRejected(None, Reason.REQUEST_TOO_LARGE, "big"),
         grpc.StatusCode.INVALID_ARGUMENT, False),
        (AdmissionRejected(None, Reason.DEADLINE_UNREACHABLE, "late"),
         grpc.StatusCode.DEADLINE_EXCEEDED, False),
        (RequestDeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED, False),
        (RequestAborted("aborted"), grpc.StatusCode.CANCELLED, False),
        (WorkerOverloaded("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        (NoWorkerError("decode"), grpc.StatusCode.UNAVAILABLE, False),
        (WorkerLost("gone"), grpc.StatusCode.UNAVAILABLE, False),
        (RuntimeError("bug"), grpc.StatusCode.INTERNAL, False),
    ],
)  # fmt: skip
def test_errors_map_to_one_status_each(exc: Exception, code: grpc.StatusCode, retry: bool) -> None:
    failure = to_grpc_failure(exc)
    assert failure.code == code
    assert (dict(failure.trailing_metadata).get("retry-after-ms") is not None) == retry


def test_rejection_carries_its_retry_after() -> None:
    failure = to_grpc_failure(AdmissionRejected(250.0, Reason.INFLIGHT_LIMIT, "busy"))
    assert dict(failure.trailing_metadata) == {"retry-after-ms": "250"}


def test_reflection_pool_resolves_method_symbols_to_their_file() -> None:
    pool = _ReflectionPool(descriptor_pool.Default())
    want = pb.DESCRIPTOR.name
    assert pool.FindFileContainingSymbol("pdserve.v1.Generation.Generate").name == want
    assert pool.FindFileContainingSymbol("pdserve.v1.Admin.Drain").name == want
    assert pool.FindFileContainingSymbol("pdserve.v1.GenerateRequest").name == want
    for missing in ("pdserve.v1.Generation.Nope", "no.Such.Method", "nothing"):
        with pytest.raises(KeyError):
            pool.FindFileContainingSymbol(missing)
    assert pool.FindFileByName(want).name == want  # everything else passes through


def test_a_lora_name_is_checked_and_an_unknown_adapter_is_not_found() -> None:
    assert _validate(token_ids=[1], max_tokens=1, lora="acme/sql-v2").lora == "acme/sql-v2"
    assert _validate(token_ids=[1], max_tokens=1).lora == ""
    with pytest.raises(InvalidRequest, match="lora: character ' ' is not allowed"):
        _validate(token_ids=[1], max_tokens=1, lora="a b")
    with pytest.raises(InvalidRequest, match="lora: must be at most 128 characters"):
        _validate(token_ids=[1], max_tokens=1, lora="x" * 129)
    f = to_grpc_failure(UnknownLora("sql"))
    assert f.code is grpc.StatusCode.NOT_FOUND
    assert f.message.startswith("lora: adapter 'sql' is not loaded")
    # a worker's own refusals (an adapter unloaded between placement and the call)
    from vocabulary.engine_io import LoraLoadError, LoraNotFound

    f = to_grpc_failure(LoraNotFound("lora adapter 'sql' is not loaded on this worker"))
    assert (f.code, f.message) == (
        grpc.StatusCode.NOT_FOUND, "lora adapter 'sql' is not loaded on this worker"
    )  # fmt: skip
    f = to_grpc_failure(LoraLoadError("LoRA adapter 'sql' (/x): holds non-finite values"))
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION and "'sql'" in f.message
