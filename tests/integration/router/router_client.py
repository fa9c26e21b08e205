"""Small client helpers for the router tests (a real gRPC client, no pdserve code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from router_harness import RouterCluster

GENERATE_METHOD = "/pdserve.v1.Generation/Generate"


@dataclass(frozen=True)
class Streamed:
    """Everything one Generate call streamed back."""

    messages: tuple[pb.GenerateResponse, ...]

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]

    @property
    def text(self) -> str:
        return "".join(m.text for m in self.messages)

    @property
    def final(self) -> pb.GenerateResponse:
        return self.messages[-1]


def generate(stub: pb_grpc.GenerationStub, timeout: float = 60.0, **fields: object) -> Streamed:
    req = pb.GenerateRequest(**fields)  # type: ignore[arg-type]
    return Streamed(tuple(stub.Generate(req, timeout=timeout)))


def greedy_request(token_ids: list[int], max_tokens: int, **fields: object) -> dict[str, object]:
    return dict(token_ids=token_ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                **fields)  # fmt: skip


def rpc_error(fn: object, *args: object, **kwargs: object) -> grpc.RpcError:
    """Call `fn` (consuming a stream) and return the RpcError it must raise."""
    try:
        result = fn(*args, **kwargs)  # type: ignore[operator]
        if hasattr(result, "__iter__"):
            list(result)
    except grpc.RpcError as e:
        return e
    raise AssertionError("expected an RpcError")


def raw_generate(channel: grpc.Channel, payload: bytes, timeout: float = 30.0) -> list[bytes]:
    """Send already-serialized request bytes (bypasses client-side UTF-8 checks)."""
    call = channel.unary_stream(
        GENERATE_METHOD,
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    return list(call(payload, timeout=timeout))


def trailing(err: grpc.RpcError) -> dict[str, str]:
    return {k: v for k, v in (err.trailing_metadata() or ())}  # type: ignore[attr-defined]


def http_url(rc: RouterCluster, router: int = 0) -> str:
    """The OpenAI HTTP API's base URL of router `router` (from its Status)."""
    url = rc.admin(router).Status(pb.StatusRequest(), timeout=10).http_url
    assert url.startswith("http://127.0.0.1:"), url
    return url
