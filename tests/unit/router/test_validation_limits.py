"""Every string and list that travels past the router is checked at the edge: documented
character sets and lengths, no control characters, capped lists, and prompts no worker's KV
pool can hold (each refused with INVALID_ARGUMENT naming the field, before any work)."""

from __future__ import annotations

import grpc
import pytest

from admission.config import TenantLimit
from admission.rate_limit import TenantRateLimiter
from kv_transfer.protocol import encode_done
from pdserve.v1 import serving_pb2 as pb
from router.errors import StreamCut, WorkerLost, to_grpc_failure
from router.validation import (
    MAX_STOP_TOKEN_IDS,
    InvalidRequest,
    ValidationLimits,
    ValidRequest,
    validate,
)
from vocabulary.worker_api import StepFailed, WorkerStopped

LIMITS = ValidationLimits(
    max_model_len=512, vocab_size=100, max_prompt_tokens=64, max_sequence_tokens=80
)


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def _validate(**fields: object) -> ValidRequest:
    fields.setdefault("token_ids", [1, 2, 3])
    fields.setdefault("max_tokens", 4)
    return validate(pb.GenerateRequest(**fields), _Tokenizer(), LIMITS)  # type: ignore[arg-type]


def _refused(field: str, **fields: object) -> str:
    with pytest.raises(InvalidRequest) as e:
        _validate(**fields)
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(f"{field}: ")
    assert to_grpc_failure(e.value).code is grpc.StatusCode.INVALID_ARGUMENT
    return str(e.value)


@pytest.mark.parametrize("bad", ["a\x1fb", "a\x00b", "a b", "caf\u00e9", "a\nb", "x" * 129, "a;b"])
def test_request_ids_outside_the_documented_set_are_refused(bad: str) -> None:
    _refused("request_id", request_id=bad)


@pytest.mark.parametrize("good", ["r1", "3f2a-uuid_9.x", "gw:tenant/42", "a+b=c@d~e"])
def test_request_ids_of_the_documented_set_pass_and_encode_into_a_notice(good: str) -> None:
    rid = _validate(request_id=good).request_id
    encode_done(f"{rid}@router.0~1")  # what the hand-off notice carries: never raises


def test_a_1mb_tenant_name_and_control_characters_in_it_are_refused() -> None:
    assert "at most 64" in _refused("tenant", tenant="t" * (1 << 20))
    _refused("tenant", tenant="acme\x00")
    assert _validate(tenant="acme-corp.eu").tenant == "acme-corp.eu"


def test_cache_salt_and_stop_strings_refuse_control_characters_but_keep_newlines() -> None:
    assert "'\\x00'" in _refused("cache_salt", cache_salt="salt\x00")
    _refused("cache_salt", cache_salt="s" * 257)
    _refused("stop", stop=["ok", "bad\x1b[31m"])
    assert _validate(stop=["\n\n", "\tend"]).sampling.stop == ("\n\n", "\tend")


def test_stop_token_ids_are_capped() -> None:
    _refused("stop_token_ids", stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert len(_validate(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))).sampling.stop_token_ids)


def test_a_prompt_larger_than_any_kv_pool_is_refused_naming_the_limit() -> None:
    assert "(64 tokens)" in _refused("prompt", token_ids=[1] * 65, max_tokens=1)
    assert "(80 tokens)" in _refused("max_tokens", token_ids=[1] * 60, max_tokens=21)
    assert _validate(token_ids=[1] * 60, max_tokens=20).sampling.max_tokens == 20


def test_known_worker_failures_are_unavailable_not_internal() -> None:
    for e in (WorkerStopped("worker stopped"), StepFailed("engine step failed: X")):
        assert to_grpc_failure(e).code is grpc.StatusCode.UNAVAILABLE
    cut = to_grpc_failure(StreamCut(WorkerLost("decode worker decode-1 left the cluster"), 240))
    assert cut.code is grpc.StatusCode.UNAVAILABLE
    assert cut.message == "decode worker decode-1 left the cluster (240 tokens delivered)"


def test_tenant_buckets_stay_bounded_under_a_flood_of_names() -> None:
    limiter = TenantRateLimiter(default=TenantLimit("", 10.0, 100.0), max_tracked=50)
    for i in range(1000):
        limiter.charge(f"t{i}", 10)
    assert limiter.num_tracked_tenants == 50
