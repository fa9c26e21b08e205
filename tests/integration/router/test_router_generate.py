"""Generate through a real gRPC client against the real cluster: exact greedy agreement with
transformers on both paths (disaggregated and local prefill), the bad-input table (each
INVALID_ARGUMENT names its field), raw bytes that are not UTF-8, and two router replicas."""

from __future__ import annotations

import time

import grpc
import pytest
from references import Reference
from router_client import (
    Streamed,
    generate,
    greedy_request,
    raw_generate,
    rpc_error,
    trailing,
)
from router_harness import MAX_MESSAGE_BYTES, MAX_MODEL_LEN, RouterCluster

from pdserve.v1 import serving_pb2 as pb
from vocabulary.tokenizer import Tokenizer
from vocabulary.worker_api import WorkerRole

MAX_TOKENS = 16


def _prompts(corpus_ids: list[int]) -> list[list[int]]:
    """A short, a medium and a long (multi-block, > 200 tokens) text-like prompt."""
    return [corpus_ids[40:51], corpus_ids[400:470], corpus_ids[700:950]]


def test_streamed_greedy_output_equals_transformers_when_disaggregated(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    stub = router_cluster.generation(0)
    prefill_ids = router_cluster.worker_ids(WorkerRole.PREFILL)
    (decode_id,) = router_cluster.worker_ids(WorkerRole.DECODE)
    for prompt in _prompts(corpus_ids):
        out = generate(stub, **greedy_request(prompt, MAX_TOKENS))
        assert out.token_ids == hf_greedy(prompt, MAX_TOKENS)
        # Streamed: the prefill worker's first token goes out alone, before any decode.
        assert len(out.messages) >= 2
        assert len(out.messages[0].token_ids) == 1
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in out.messages[:-1])
        final = out.final
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == MAX_TOKENS
        assert final.usage.transferred_prompt_tokens > 0
        t = final.timings
        assert not t.local_prefill
        assert t.prefill_worker in prefill_ids
        assert t.decode_worker == decode_id
        assert 0 < t.ttft_ms <= t.e2e_ms
        assert t.prefill_ms > 0 and t.transfer_ms > 0
        assert {m.request_id for m in out.messages} == {final.request_id} != {""}


def test_streamed_greedy_output_equals_transformers_when_prefilled_locally(
    router_cluster: RouterCluster,
    corpus_ids: list[int],
    hf_greedy: Reference,
    tokenizer: Tokenizer,
) -> None:
    with router_cluster.restored_thresholds(1):
        router_cluster.admin(1).SetThresholds(
            pb.AdmissionThresholds(local_prefill_threshold_tokens=MAX_MODEL_LEN), timeout=10
        )
        stub = router_cluster.generation(1)
        for prompt in _prompts(corpus_ids[1:]):
            out = generate(stub, **greedy_request(prompt, MAX_TOKENS))
            assert out.token_ids == hf_greedy(prompt, MAX_TOKENS)
            assert len(out.messages) >= 2
            t = out.final.timings
            assert t.local_prefill and t.prefill_worker == ""
            assert out.final.usage.transferred_prompt_tokens == 0
            assert out.text == tokenizer.decode(out.token_ids)


def test_text_prompt_and_stop_string_end_the_stream(
    router_cluster: RouterCluster, tokenizer: Tokenizer, hf_greedy: Reference
) -> None:
    prompt = "The river runs past the old mill and under the stone bridge."
    ids = tokenizer.encode(prompt)
    expected = tokenizer.decode(hf_greedy(ids, 24))
    stop = expected[6:9]
    assert stop and stop not in expected[:6]
    out = generate(
        router_cluster.generation(0), prompt=prompt, max_tokens=24, temperature=0.0,
        ignore_eos=True, stop=[stop],
    )  # fmt: skip
    assert out.final.finish_reason == pb.FINISH_REASON_STOP
    assert out.text == expected[: expected.index(stop)]


def test_same_seed_gives_same_sampled_tokens(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    req = dict(token_ids=corpus_ids[100:180], max_tokens=12, temperature=1.0, top_p=0.9,
               seed=1234, ignore_eos=True)  # fmt: skip
    first = generate(router_cluster.generation(0), **req)
    again = generate(router_cluster.generation(0), **req)
    assert first.token_ids == again.token_ids
    assert len(first.token_ids) == 12


LONG = [7] * (MAX_MODEL_LEN - 10)


def _bad(name: str, field: str, **fields: object) -> object:
    return pytest.param(fields, field, id=name)


BAD_INPUTS = [
    _bad("empty prompt", "prompt", prompt="", max_tokens=4),
    _bad("prompt and token_ids", "prompt", prompt="hi", token_ids=[5], max_tokens=4),
    _bad("prompt at the context length", "prompt", token_ids=[7] * MAX_MODEL_LEN, max_tokens=1),
    _bad(
        "prompt text far over the context",
        "prompt",
        prompt="a" * (MAX_MODEL_LEN * 64 + 1),
        max_tokens=1,
    ),
    _bad("token id outside the vocabulary", "token_ids", token_ids=[5, 100_000], max_tokens=4),
    _bad("max_tokens 0", "max_tokens", prompt="hi", max_tokens=0),
    _bad("max_tokens huge", "max_tokens", prompt="hi", max_tokens=2**31),
    _bad("prompt + max_tokens over the context", "max_tokens", token_ids=LONG, max_tokens=11),
    _bad("temperature < 0", "temperature", prompt="hi", max_tokens=4, temperature=-0.5),
    _bad("temperature NaN", "temperature", prompt="hi", max_tokens=4, temperature=float("nan")),
    _bad("temperature inf", "temperature", prompt="hi", max_tokens=4, temperature=float("inf")),
    _bad("top_p 0", "top_p", prompt="hi", max_tokens=4, top_p=0.0),
    _bad("top_p > 1", "top_p", prompt="hi", max_tokens=4, top_p=1.5),
    _bad("min_p > 1", "min_p", prompt="hi", max_tokens=4, min_p=1.5),
    _bad(
        "repetition_penalty 0",
        "repetition_penalty",
        prompt="hi",
        max_tokens=4,
        repetition_penalty=0.0,
    ),
    _bad(
        "presence_penalty > 2", "presence_penalty", prompt="hi", max_tokens=4, presence_penalty=3.0
    ),
    _bad("unknown tenant", "tenant", prompt="hi", max_tokens=4, tenant="nobody"),
    _bad("empty stop string", "stop", prompt="hi", max_tokens=4, stop=[""]),
    _bad("too many stop strings", "stop", prompt="hi", max_tokens=4, stop=["x"] * 17),
    _bad(
        "stop token outside the vocabulary",
        "stop_token_ids",
        prompt="hi",
        max_tokens=4,
        stop_token_ids=[100_000],
    ),
    _bad("priority out of range", "priority", prompt="hi", max_tokens=4, priority=11),
    _bad("request_id too long", "request_id", prompt="hi", max_tokens=4, request_id="r" * 129),
]


@pytest.mark.parametrize(("fields", "field"), BAD_INPUTS)
def test_bad_input_is_invalid_argument_naming_the_field(
    router_cluster: RouterCluster, fields: dict[str, object], field: str
) -> None:
    t0 = time.perf_counter()
    err = rpc_error(router_cluster.generation(0).Generate, pb.GenerateRequest(**fields),
                    timeout=30)  # fmt: skip
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"{field}: "), err.details()
    assert time.perf_counter() - t0 < 5  # decided before any model work


def test_known_tenant_is_served(router_cluster: RouterCluster) -> None:
    out = generate(router_cluster.generation(0), prompt="The baker", max_tokens=3, tenant="acme")
    assert out.final.usage.completion_tokens == 3


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _with_raw_string(field_number: int, raw: bytes) -> bytes:
    """A valid request plus one length-delimited field carrying `raw` (protobuf merges it)."""
    base = pb.GenerateRequest(prompt="hi", max_tokens=4).SerializeToString()
    return base + _varint((field_number << 3) | 2) + _varint(len(raw)) + raw


@pytest.mark.parametrize(
    ("number", "field"),
    [(13, "stop"), (2, "prompt"), (17, "tenant"), (19, "cache_salt"), (1, "request_id")],
)
def test_string_field_that_is_not_utf8_is_invalid_argument_naming_it(
    router_cluster: RouterCluster, number: int, field: str
) -> None:
    payload = _with_raw_string(number, b"\xff\xfe")
    err = rpc_error(raw_generate, router_cluster.channel(0), payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"{field}: "), err.details()


def test_raw_bytes_that_are_valid_are_served(router_cluster: RouterCluster) -> None:
    payload = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString()
    messages = [pb.GenerateResponse.FromString(b) for b in
                raw_generate(router_cluster.channel(0), payload)]  # fmt: skip
    assert sum(len(m.token_ids) for m in messages) == 2


def test_message_over_the_size_limit_is_refused_by_the_transport(
    router_cluster: RouterCluster,
) -> None:
    err = rpc_error(router_cluster.generation(0).Generate,
                    pb.GenerateRequest(prompt="a" * (MAX_MESSAGE_BYTES + 1), max_tokens=1),
                    timeout=30)  # fmt: skip
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "retry-after-ms" not in trailing(err)  # retrying the same bytes cannot help


def test_both_router_replicas_serve_the_same_cluster(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    prompt = corpus_ids[1200:1300]
    outs = [generate(router_cluster.generation(i), **greedy_request(prompt, 8)) for i in (0, 1)]
    assert outs[0].token_ids == outs[1].token_ids
    assert len(outs[0].token_ids) == 8
    for i in (0, 1):
        status = router_cluster.admin(i).Status(pb.StatusRequest(), timeout=10)
        assert {w.worker_id for w in status.workers} == set(router_cluster.workers)


def test_reused_request_id_is_served_on_one_router_and_across_replicas(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    """Clients reuse ids; the same id in flight twice on one router and on both replicas at
    once must not collide on the workers (nor abort each other)."""
    prompt = corpus_ids[1300:1400]
    req = pb.GenerateRequest(**greedy_request(prompt, 12, request_id="same-id"))
    calls = [router_cluster.generation(i).Generate(req, timeout=60) for i in (0, 0, 1)]
    for call in calls:
        out = Streamed(tuple(call))
        assert out.token_ids == hf_greedy(prompt, 12)
        assert {m.request_id for m in out.messages} == {"same-id"}
