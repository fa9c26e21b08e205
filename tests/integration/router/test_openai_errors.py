"""The OpenAI HTTP API's failures against the real cluster, over plain HTTP (http.client):
the bad-input battery (each the right 4xx in OpenAI's error shape, naming the field, the
server healthy after), 429 + Retry-After under overload, 504 past the request's deadline, a
client that disconnects mid-stream or mid-request freeing every KV block; and, on a router
of its own with no worker and a checkpoint without a chat template, 503, the 400 that says
there is no template, and responses that go out without waiting on Nagle's algorithm."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from router_harness import MAX_MESSAGE_BYTES, MAX_MODEL_LEN, RouterCluster

from kv_transfer.config import KVTransferConfig
from pdserve.v1 import serving_pb2 as pb
from vocabulary.worker_api import WorkerRole

LEASE_S = KVTransferConfig().lease_s


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: Any


def _address(rc: RouterCluster, router: int = 0) -> tuple[str, int]:
    url = urlsplit(rc.admin(router).Status(pb.StatusRequest(), timeout=10).http_url)
    assert url.hostname and url.port, url
    return url.hostname, url.port


def post(address: tuple[str, int], path: str, body: Any, headers: dict[str, str] | None = None,
         timeout: float = 60) -> Reply:  # fmt: skip
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw or b"{}"))
    finally:
        conn.close()


@pytest.fixture(scope="module")
def address(router_cluster: RouterCluster) -> tuple[str, int]:
    return _address(router_cluster)


def _bad_inputs(model: str) -> list[tuple[str, dict[str, Any], int, str]]:
    ok = {"model": model, "prompt": "The river", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    c, cc = "/v1/completions", "/v1/chat/completions"
    fn = {"type": "function", "function": {"name": "f"}}

    def named(name: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name}}

    return [
        (c, {**ok, "model": "gpt-4o"}, 404, "model"),
        (c, {k: v for k, v in ok.items() if k != "model"}, 400, "model"),
        (c, {k: v for k, v in ok.items() if k != "prompt"}, 400, "prompt"),
        (c, {**ok, "prompt": ""}, 400, "prompt"),
        (c, {**ok, "prompt": [1, "x"]}, 400, "prompt"),
        (c, {**ok, "prompt": [[1, 2], [3, 600]]}, 400, "prompt[1]"),
        (c, {**ok, "prompt": [7] * (MAX_MODEL_LEN + 5)}, 400, "prompt"),
        (c, {**ok, "max_tokens": 0}, 400, "max_tokens"),
        (c, {**ok, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        (c, {**ok, "max_tokens": "many"}, 400, "max_tokens"),
        (c, {**ok, "temperature": -1}, 400, "temperature"),
        (c, {**ok, "top_p": 0}, 400, "top_p"),
        (c, {**ok, "top_k": -5}, 400, "top_k"),
        (c, {**ok, "presence_penalty": 3}, 400, "presence_penalty"),
        (c, {**ok, "seed": -1}, 400, "seed"),
        (c, {**ok, "stop": 5}, 400, "stop"),
        (c, {**ok, "stop": ["s"] * 17}, 400, "stop"),
        (c, {**ok, "n": 0}, 400, "n"),
        (c, {**ok, "n": 65}, 400, "n"),
        (c, {**ok, "logprobs": 21}, 400, "logprobs"),
        (cc, {**chat, "echo": True}, 400, "echo"),
        (c, {**ok, "best_of": 3}, 400, "best_of"),
        (c, {**ok, "suffix": "end"}, 400, "suffix"),
        (c, {**ok, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (c, {**ok, "stop_token_ids": [9999]}, 400, "stop_token_ids"),
        (c, {**ok, "priority": 11}, 400, "priority"),
        (cc, {**chat, "messages": []}, 400, "messages"),
        (cc, {**chat, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        (cc, {**chat, "messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
        (
            cc,
            {**chat, "messages": [{"role": "tool", "content": "x"}]},
            400,
            "messages[0].tool_call_id",
        ),
        (cc, {**chat, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
        (
            cc,
            {
                **chat,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ],
            },
            400,
            "messages[0].content[0].type",
        ),
        (c, {**ok, "tools": [fn]}, 400, "tools"),
        (cc, {**chat, "tool_choice": "required"}, 400, "tool_choice"),
        (cc, {**chat, "tools": [fn], "tool_choice": named("g")}, 400, "tool_choice"),
        (cc, {**chat, "tools": [fn, fn]}, 400, "tools[1].function.name"),
        (
            cc,
            {**chat, "tools": [{"type": "function", "function": {}}]},
            400,
            "tools[0].function.name",
        ),
        (
            cc,
            {**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            400,
            "tools[0].function.parameters",
        ),
        (
            cc,
            {
                **chat,
                "tools": [fn],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            400,
            "tool_choice",
        ),
        (
            cc,
            {
                **chat,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "nonsense"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            400,
            "tools",
        ),  # a worker's compiler
        (cc, {**chat, "response_format": {"type": "json_schema"}}, 400, "response_format"),
        (
            cc,
            {
                **chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                },
            },
            400,
            "response_format",
        ),  # a worker's compiler
        (cc, {**chat, "structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs"),
        (cc, {**chat, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (cc, {**chat, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ]


def test_bad_input_is_the_right_4xx_naming_the_field_and_the_server_stays_healthy(
    router_cluster: RouterCluster, address: tuple[str, int]
) -> None:
    for path, body, status, param in _bad_inputs(router_cluster.model_id):
        got = post(address, path, body)
        assert got.status == status, (body, got)
        error = got.body["error"]
        assert error["param"] == param, (body, error)
        assert error["message"].startswith(f"{param}: "), (body, error)
        assert error["type"] == "invalid_request_error", error
    not_json = post(address, "/v1/completions", b"{not json")
    assert (not_json.status, not_json.body["error"]["param"]) == (400, "body")
    too_big = post(address, "/v1/completions", b"x" * (MAX_MESSAGE_BYTES + 1))
    assert (too_big.status, too_big.body["error"]["param"]) == (413, "body")
    bad_timeout = post(address, "/v1/completions",
                       {"model": router_cluster.model_id, "prompt": "x"},
                       {"x-request-timeout": "soon"})  # fmt: skip
    assert bad_timeout.body["error"]["param"] == "x-request-timeout"
    # Healthy after all that: it serves, and nothing was left behind on any worker.
    ok = post(address, "/v1/completions", {"model": router_cluster.model_id,
                                           "prompt": "The river", "max_tokens": 3})  # fmt: skip
    assert ok.status == 200 and ok.body["usage"]["completion_tokens"] >= 1, ok
    router_cluster.wait_idle()


def test_overload_is_429_with_retry_after_and_every_admitted_request_completes(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    host, port = _address(router_cluster)
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0)

    def call(i: int) -> tuple[str, float, Any]:
        t0 = time.perf_counter()
        try:
            r = client.completions.create(
                model=router_cluster.model_id, prompt=corpus_ids[i * 20 : i * 20 + 40],
                max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return "ok", time.perf_counter() - t0, r
        except openai.RateLimitError as e:
            return "429", time.perf_counter() - t0, e.response.headers

    with router_cluster.restored_thresholds(0):
        router_cluster.admin(0).SetThresholds(
            pb.AdmissionThresholds(max_inflight_requests=2, max_queue_wait_ms=1), timeout=10
        )
        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(call, range(16)))
    client.close()
    admitted = [o for o in outcomes if o[0] == "ok"]
    rejected = [o for o in outcomes if o[0] == "429"]
    assert len(admitted) >= 2 and len(rejected) >= 8, [o[:2] for o in outcomes]
    assert len(admitted) + len(rejected) == 16
    for _, seconds, headers in rejected:
        assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) > 0
        assert seconds < 1.0  # decided before any model work
    for _, _, r in admitted:
        assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    router_cluster.wait_idle()


def test_past_its_deadline_a_request_is_504_and_frees_its_blocks(
    router_cluster: RouterCluster, address: tuple[str, int], corpus_ids: list[int]
) -> None:
    body = {"model": router_cluster.model_id, "prompt": corpus_ids[300:700], "max_tokens": 600,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    got = post(address, "/v1/completions", body, {"x-request-timeout": "0.5"})
    assert got.status == 504, got
    assert got.body["error"]["code"] == "timeout"
    assert time.perf_counter() - t0 < 5
    router_cluster.wait_idle()


def test_a_stream_past_its_deadline_ends_with_an_error_event_and_frees_its_blocks(
    router_cluster: RouterCluster, address: tuple[str, int], corpus_ids: list[int]
) -> None:
    body = {"model": router_cluster.model_id, "prompt": corpus_ids[100:200], "max_tokens": 800,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection(*address, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                 {"content-type": "application/json", "x-request-timeout": "1.5"})  # fmt: skip
    r = conn.getresponse()
    assert r.status == 200  # the first token came in time
    events = [line[6:] for line in r.read().splitlines() if line.startswith(b"data: ")]
    conn.close()
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "timeout" and "tokens delivered" in error["message"], error
    tokens = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert 1 <= len(tokens) < 800
    router_cluster.wait_idle()


class _Stream:
    """A streaming request read event by event over a raw connection, to be cut off."""

    def __init__(self, address: tuple[str, int], body: dict[str, Any]) -> None:
        self.conn = http.client.HTTPConnection(*address, timeout=60)
        self.conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                          {"content-type": "application/json"})  # fmt: skip
        self.response = self.conn.getresponse()
        assert self.response.status == 200

    def event(self) -> dict[str, Any]:
        while True:
            line = self.response.readline()
            assert line, "stream ended"
            if line.startswith(b"data: "):
                return dict(json.loads(line[6:]))

    def cut(self) -> None:
        assert self.conn.sock is not None
        self.conn.sock.shutdown(2)
        self.conn.close()


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "mid-request"])
def test_client_disconnect_aborts_the_request_and_frees_its_kv_blocks(
    router_cluster: RouterCluster, address: tuple[str, int], corpus_ids: list[int], stream: bool
) -> None:
    router_cluster.wait_idle()
    (decode_id,) = router_cluster.worker_ids(WorkerRole.DECODE)
    # ~10 s of decoding on the CI machine: only an abort frees its blocks within the wait.
    body = {"model": router_cluster.model_id, "prompt": corpus_ids[900:1000], "max_tokens": 900,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        s = _Stream(address, body)
        for _ in range(4):
            assert s.event()["choices"][0]["finish_reason"] is None
    else:
        conn = http.client.HTTPConnection(*address, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {"content-type": "application/json"})  # fmt: skip
        _wait_decoding(router_cluster, decode_id)
    used = _kv_used(router_cluster, decode_id)
    assert used >= 100 // 16, used  # the prompt's blocks are held while it decodes
    if stream:
        s.cut()
    else:
        assert conn.sock is not None
        conn.sock.shutdown(2)
        conn.close()
    # Freed by the abort: well before the request could finish or the prefill lease expire;
    # every block counted.
    loads = router_cluster.wait_idle(timeout_s=min(LEASE_S - 3, 4.0))
    for load in loads.values():
        assert load.engine.num_free_blocks == load.engine.num_total_blocks
    ok = post(
        address,
        "/v1/completions",
        {"model": router_cluster.model_id, "prompt": "The baker", "max_tokens": 2},
    )
    assert ok.status == 200


def _kv_used(rc: RouterCluster, worker_id: str) -> int:
    e = rc.loads()[worker_id].engine
    return e.num_total_blocks - e.num_free_blocks


def _wait_decoding(rc: RouterCluster, worker_id: str, timeout_s: float = 30) -> None:
    end = time.monotonic() + timeout_s
    while rc.loads()[worker_id].engine.num_running == 0:
        assert time.monotonic() < end, "the request never reached the decode worker"
        time.sleep(0.05)
    time.sleep(0.2)  # a few tokens in


# ---- a router of its own: no worker, a checkpoint without a chat template -----------------


@pytest.fixture(scope="module")
def lone_router(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A RouterServer with no worker registered, on a copy of the tiny checkpoint's config
    and tokenizer whose tokenizer_config.json has no chat template, run in a thread."""
    from router.cluster_view import StaticDirectory
    from router.router_server import RouterConfig, RouterServer

    folder = tmp_path_factory.mktemp("no-template") / "tiny-no-template"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    server = RouterServer(RouterConfig(model_dir=str(folder), grpc_port=0, http_port=0),
                          StaticDirectory([]))  # fmt: skip
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_no_worker_is_503_and_not_ready_a_model_without_template_refuses_chat(
    lone_router: Any,
) -> None:
    address = ("127.0.0.1", lone_router.http_port)
    model = lone_router.config.resolved_model_id
    got = post(address, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2})
    assert got.status == 503 and got.body["error"]["code"] == "service_unavailable", got
    chat = post(
        address,
        "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert chat.status == 400, chat
    assert chat.body["error"]["param"] == "messages"
    assert "no chat template" in chat.body["error"]["message"]
    conn = http.client.HTTPConnection(*address, timeout=10)
    conn.request("GET", "/ready")
    r = conn.getresponse()
    assert (r.status, json.loads(r.read())["status"]) == (503, "not ready")
    conn.close()


def test_small_responses_are_not_held_back_by_nagle(lone_router: Any) -> None:
    """Without TCP_NODELAY on the server's connections each response waits for the client's
    delayed ACK: ~40 ms a round trip on a kept-alive connection instead of ~1 ms."""
    conn = http.client.HTTPConnection("127.0.0.1", lone_router.http_port, timeout=10)
    took = []
    for _ in range(10):
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status": "ok"}'
        took.append(time.perf_counter() - t0)
    conn.close()
    assert sorted(took)[5] < 0.02, took
