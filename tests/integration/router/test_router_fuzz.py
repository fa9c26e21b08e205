"""The gRPC request message fuzzed against the shared real cluster (hypothesis): any field
values, sizes, unicode, token ids and repeated stops. Every call ends in time with a status a
client can act on (served, INVALID_ARGUMENT naming a field, RESOURCE_EXHAUSTED), never
INTERNAL or UNKNOWN; afterwards every worker is back at its idle baseline and a long prompt
is still served token-exact through the hand-off."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references import Reference
from router_client import greedy_request, rpc_error
from router_harness import RouterCluster

from pdserve.v1 import serving_pb2 as pb

pytestmark = pytest.mark.timeout(600)

U32 = 2**32 - 1
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CALL_S = 30.0

texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=300),
    st.sampled_from(["", "a\x1fb", "a\x00b", "\x1b[2J", "x" * 5000, "The river runs", "é" * 70]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]),
)
token_ids = st.one_of(
    st.lists(st.integers(0, 600), max_size=200),
    st.lists(st.integers(0, U32), max_size=20),
    st.just([5] * 3000),
)
printable = st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"])
"""Text a client may well send: no control characters (refused by validation) or surrogates."""
prompt_or_ids = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(alphabet=printable, min_size=1, max_size=200)}),
    st.fixed_dictionaries({"token_ids": st.lists(st.integers(0, 500), min_size=1, max_size=150)}),
)
valid = st.builds(
    lambda source, rest: {**source, **rest},
    prompt_or_ids,
    st.fixed_dictionaries(
        {"max_tokens": st.integers(1, 12)},
        optional={
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.05, 1),
            "top_k": st.integers(0, 100),
            "min_p": st.floats(0, 1),
            "repetition_penalty": st.floats(0.5, 2),
            "presence_penalty": st.floats(-2, 2),
            "frequency_penalty": st.floats(-2, 2),
            "seed": st.integers(0, 2**63),
            "stop": st.lists(st.text(alphabet=printable, min_size=1, max_size=8), max_size=4),
            "stop_token_ids": st.lists(st.integers(0, 500), max_size=8),
            "ignore_eos": st.booleans(),
            "logprobs": st.booleans(),
            "priority": st.integers(-5, 5),
            "cache_salt": st.text(alphabet="abcdef0123", max_size=16),
        },
    ),
)  # fmt: skip
"""Requests a client may well send: most are served."""
wild = st.fixed_dictionaries(
    {},
    optional={
        "request_id": texts,
        "prompt": texts,
        "token_ids": token_ids,
        "max_tokens": st.one_of(st.integers(0, 24), st.sampled_from([U32, 100_000])),
        "temperature": floats,
        "top_p": floats,
        "top_k": st.integers(0, U32),
        "min_p": floats,
        "repetition_penalty": floats,
        "presence_penalty": floats,
        "frequency_penalty": floats,
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.lists(texts, max_size=40),
        "stop_token_ids": st.lists(st.integers(0, U32), max_size=100),
        "ignore_eos": st.booleans(),
        "logprobs": st.booleans(),
        "tenant": texts,
        "priority": st.integers(-(2**31), 2**31 - 1),
        "cache_salt": texts,
    },
)
"""Anything the message can carry."""
requests = st.one_of(valid, wild)


def test_fuzzed_requests_get_clear_statuses_in_time_and_leave_the_cluster_healthy(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    stub = router_cluster.generation(0)
    seen: dict[str, int] = {}

    @settings(
        max_examples=120, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )  # fmt: skip
    @given(fields=requests)
    def one(fields: dict[str, object]) -> None:
        t0 = time.monotonic()
        code = grpc.StatusCode.OK
        details = ""
        try:
            for _ in stub.Generate(pb.GenerateRequest(**fields), timeout=CALL_S):  # type: ignore[arg-type]
                pass
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        assert code in ACCEPTABLE, (code, details, fields)
        assert time.monotonic() - t0 < CALL_S - 1, fields  # ended on its own, not by timeout
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            field = details.split(":", 1)[0]
            assert field and " " not in field, (details, fields)  # names the field
        seen[code.name] = seen.get(code.name, 0) + 1

    one()
    assert seen.get("OK", 0) > 5 and seen.get("INVALID_ARGUMENT", 0) > 5, seen
    router_cluster.wait_idle()
    prompt = corpus_ids[200:320]
    stream = list(stub.Generate(pb.GenerateRequest(**greedy_request(prompt, 6)), timeout=60))  # type: ignore[arg-type]
    assert [t for m in stream for t in m.token_ids] == hf_greedy(prompt, 6)
    assert not stream[-1].timings.local_prefill
    # a message that is not a GenerateRequest at all
    err = rpc_error(
        router_cluster.channel(0).unary_stream(
            "/pdserve.v1.Generation/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        ),
        b"\xff\xff\xff\xff",
        timeout=10,
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    router_cluster.wait_idle()


names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
leaf_schemas = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])},
        optional={
            "minimum": st.integers(-100, 100),
            "maximum": st.integers(-100, 100),
            "minLength": st.integers(0, 5),
            "maxLength": st.integers(0, 8),
            "pattern": st.sampled_from(["^[a-z]+$", "[0-9]{2}", "(", "a|b", ".*"]),
            "format": st.sampled_from(["date", "email", "uuid", "nonsense"]),
        },
    ),
    st.fixed_dictionaries(
        {"enum": st.lists(st.one_of(names, st.integers(), st.none()), max_size=4)}
    ),
    st.fixed_dictionaries({"const": st.one_of(names, st.integers(), st.booleans())}),
    st.dictionaries(names, st.one_of(names, st.integers(), st.booleans()), max_size=3),
)
schemas = st.recursive(
    leaf_schemas,
    lambda inner: st.one_of(
        st.builds(
            lambda props, required, extra: {
                "type": "object", "properties": props,
                "required": [k for k in props if k in required], "additionalProperties": extra,
            },
            st.dictionaries(names, inner, max_size=4), st.sets(names), st.booleans(),
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": inner},
            optional={"minItems": st.integers(0, 3), "maxItems": st.integers(0, 4)},
        ),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#/nowhere", "#"])}),
    ),
    max_leaves=8,
)  # fmt: skip
constraints = st.one_of(
    schemas.map(lambda s: pb.StructuredOutput(json_schema=json.dumps(s))),
    st.text(alphabet=printable, max_size=60).map(lambda t: pb.StructuredOutput(json_schema=t)),
    st.sampled_from(["[a-c]{1,4}", "(yes|no)", "[", "a{2,1}", "\\d+", "(?=a)b", ".{0,5}"]).map(
        lambda r: pb.StructuredOutput(regex=r)
    ),
    st.text(alphabet=printable, max_size=40).map(lambda r: pb.StructuredOutput(regex=r)),
    st.sampled_from(['root ::= "a" | "b"', "root ::= ", 'root ::= x\nx ::= "1"+', "nope"]).map(
        lambda g: pb.StructuredOutput(grammar=g)
    ),
    st.lists(st.text(alphabet=printable, max_size=6), max_size=5).map(
        lambda c: pb.StructuredOutput(choice=pb.Choices(choices=c))
    ),
    st.just(pb.StructuredOutput()),
    st.just(pb.StructuredOutput(json_object=True)),
)


def test_fuzzed_constraints_compile_or_get_invalid_argument_never_internal(
    router_cluster: RouterCluster,
) -> None:
    """Generated JSON schemas (nested, contradictory, with unsupported keywords), regexes,
    grammars and choices: each request is served or refused with INVALID_ARGUMENT naming
    structured_output, in time; the cluster is idle afterwards."""
    seen: dict[str, int] = {}

    @settings(
        max_examples=60, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )  # fmt: skip
    @given(constraint=constraints, router=st.sampled_from([0, 1]))
    def one(constraint: pb.StructuredOutput, router: int) -> None:
        t0 = time.monotonic()
        code, details = grpc.StatusCode.OK, ""
        req = pb.GenerateRequest(prompt="The baker", max_tokens=8, temperature=1.0, seed=3,
                                 structured_output=constraint)  # fmt: skip
        try:
            for _ in router_cluster.generation(router).Generate(req, timeout=CALL_S):
                pass
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        assert code in ACCEPTABLE, (code, details, constraint)
        assert time.monotonic() - t0 < CALL_S - 1, constraint
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            assert details.startswith("structured_output: "), details
        seen[code.name] = seen.get(code.name, 0) + 1

    one()
    assert seen.get("OK", 0) > 5 and seen.get("INVALID_ARGUMENT", 0) > 5, seen
    router_cluster.wait_idle()
