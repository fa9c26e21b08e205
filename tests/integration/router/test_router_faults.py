"""Faults a review found, on the shared real cluster (conftest.py): a bad-input battery over
gRPC leaves no INTERNAL, no hang and a healthy cluster (long prompts through the hand-off
after it); draining a decode worker lets its live streams finish token-exact; drain and
undrain never leave a worker in limbo; a decode worker stopped with SIGSTOP has its streams
migrate to another (token-exact), one whose engine thread blocks forever ends a request
that has nowhere to go with UNAVAILABLE; new requests go elsewhere, and the controller
replaces the worker (and purges its prefix-index entries).

A test that takes a spare decode worker gets the one the test before it left (the controller's
replacement of the spare that test broke) or a new one; after the last of them only the
cluster's own decode worker is left, ready, as the other modules expect."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
import ray
from references import LogitsReference, Reference
from router_client import generate, greedy_request, raw_generate, rpc_error
from router_harness import MAX_MODEL_LEN, RouterCluster
from sampling_ties import assert_same_or_near_tie

from pdserve.v1 import serving_pb2 as pb
from router.validation import ValidationLimits, validate
from vocabulary.tokenizer import Tokenizer
from vocabulary.worker_api import WorkerRole

pytestmark = pytest.mark.timeout(420)

LONG = 120  # prompt tokens: well past the local-prefill threshold, so every one is handed off


def _status(rc: RouterCluster, router: int = 0) -> pb.ClusterStatus:
    return rc.admin(router).Status(pb.StatusRequest(), timeout=10)


def _states(rc: RouterCluster) -> dict[str, int]:
    return {w.worker_id: w.state for w in _status(rc).workers}


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.1)


def _decode_ids(rc: RouterCluster) -> set[str]:
    return {w.worker_id for w in _status(rc).workers if w.role == "decode"}


def _next_test_takes_a_spare(request: pytest.FixtureRequest) -> bool:
    items = request.session.items
    at = items.index(request.node) + 1  # type: ignore[arg-type]
    return at < len(items) and "spare_decode" in getattr(items[at], "fixturenames", ())


@pytest.fixture()
def spare_decode(request: pytest.FixtureRequest, router_cluster: RouterCluster) -> Iterator[str]:
    """A second decode worker for the test: the one the test before left (the controller's
    replacement of the spare it broke), or a new one. Afterwards the cluster's own decode
    worker is ready again, and every other decode worker is drained and stopped unless the
    next test takes a spare too (then the one ready replacement stays for it)."""
    (own,) = router_cluster.worker_ids(WorkerRole.DECODE)
    controller = router_cluster.cluster.controller
    _wait(lambda: all(s != pb.WORKER_STATE_STARTING for s in _states(router_cluster).values()),
          "no worker is starting", 300)  # fmt: skip
    left = sorted(_decode_ids(router_cluster) - {own})
    if left:
        (spare,) = left
    else:
        spare = ray.get(controller.add_worker.remote("decode"), timeout=300).worker_id
    for router in range(len(router_cluster.channels)):
        _wait(
            lambda r=router: any(
                w.worker_id == spare and w.state == pb.WORKER_STATE_READY
                for w in _status(router_cluster, r).workers
            ),
            f"router {router} sees {spare} ready",
        )
    try:
        yield spare
    finally:
        admin = router_cluster.admin(0)
        if _states(router_cluster).get(own) != pb.WORKER_STATE_READY:
            admin.Undrain(pb.UndrainRequest(worker_id=own), timeout=30)
        # a replacement may still be starting: let it come up, then take it out too
        _wait(lambda: all(s != pb.WORKER_STATE_STARTING for s in _states(router_cluster).values()),
              "no worker is starting", 300)  # fmt: skip
        others = _decode_ids(router_cluster) - {own}
        states = _states(router_cluster)
        keep = (
            _next_test_takes_a_spare(request)
            and len(others) == 1
            and all(states[w] == pb.WORKER_STATE_READY for w in others)
        )
        if not keep:
            for wid in others:
                admin.Drain(pb.DrainRequest(worker_id=wid, stop=True, timeout_s=60), timeout=90)
            for router in range(len(router_cluster.channels)):
                _wait(lambda r=router: _decode_ids(router_cluster) == {own}, "only the own decode")
        router_cluster.wait_idle()


def _isolate(rc: RouterCluster, worker_id: str) -> str:
    """Drain the cluster's own decode worker (kept, not stopped): new requests go to
    `worker_id`. Returns the own worker's id (undrain it with `_undrain`)."""
    (own,) = rc.worker_ids(WorkerRole.DECODE)
    reply = rc.admin(0).Drain(pb.DrainRequest(worker_id=own, stop=False, timeout_s=30), timeout=60)
    assert reply.drained and not reply.stopped, reply.message
    _wait(lambda: _states(rc)[own] == pb.WORKER_STATE_DRAINED, f"{own} shows DRAINED")
    return own


def _undrain(rc: RouterCluster, worker_id: str) -> None:
    reply = rc.admin(0).Undrain(pb.UndrainRequest(worker_id=worker_id), timeout=30)
    assert "ready" in reply.message
    for router in range(len(rc.channels)):
        _wait(
            lambda r=router: any(
                w.worker_id == worker_id and w.state == pb.WORKER_STATE_READY
                for w in _status(rc, r).workers
            ),
            f"router {router} sees {worker_id} ready again",
        )


@dataclass
class Streams:
    """Greedy streams running in threads; tokens and the end of each kept."""

    rc: RouterCluster
    prompts: list[list[int]]
    max_tokens: int
    tokens: list[list[int]] = field(default_factory=list)
    finals: list[pb.GenerateResponse | None] = field(default_factory=list)
    errors: list[grpc.RpcError | None] = field(default_factory=list)
    ended_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        self.tokens = [[] for _ in range(n)]
        self.finals = [None] * n
        self.errors = [None] * n
        self.ended_at = [0.0] * n
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        req = pb.GenerateRequest(**greedy_request(self.prompts[i], self.max_tokens))  # type: ignore[arg-type]
        try:
            for msg in self.rc.generation(0).Generate(req, timeout=300):
                self.tokens[i].extend(msg.token_ids)
                if msg.HasField("usage"):
                    self.finals[i] = msg
        except grpc.RpcError as e:
            self.errors[i] = e
        self.ended_at[i] = time.monotonic()

    def wait_tokens(self, at_least: int, timeout_s: float = 120) -> None:
        _wait(lambda: all(len(t) >= at_least for t in self.tokens),
              f"every stream has {at_least} tokens", timeout_s)  # fmt: skip

    def join(self, timeout_s: float = 300) -> None:
        for t in self._threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a stream hung"


def _prompts(corpus_ids: list[int], n: int, offset: int) -> list[list[int]]:
    return [corpus_ids[offset + 37 * i : offset + 37 * i + LONG] for i in range(n)]


# ---- bad input --------------------------------------------------------------------------


def _fields_battery() -> list[tuple[str, dict[str, object]]]:
    values = {"ctl": "a\x1fb", "nul": "a\x00b", "esc": "\x1b[2J", "huge": "x" * (1 << 20)}
    cases: list[tuple[str, dict[str, object]]] = []
    for name, value in values.items():
        cases += [
            (f"request_id {name}", dict(request_id=value)),
            (f"tenant {name}", dict(tenant=value)),
            (f"cache_salt {name}", dict(cache_salt=value)),
            (f"stop {name}", dict(stop=["ok", value])),
        ]
    cases += [
        ("stop many", dict(stop=["s"] * 1000)),
        ("stop_token_ids many", dict(stop_token_ids=list(range(5000)))),
        ("stop_token_ids huge", dict(stop_token_ids=[2**32 - 1])),
        ("token_ids huge", dict(token_ids=[2**32 - 1], prompt="")),
        ("token_ids many", dict(token_ids=[5] * 200_000, prompt="")),
        ("prompt huge", dict(prompt="y" * (3 << 20))),
        ("max_tokens huge", dict(max_tokens=2**32 - 1)),
        ("seed huge", dict(seed=2**64 - 1)),
    ]
    return cases


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


def _non_utf8_payloads() -> list[tuple[str, bytes]]:
    """Serialized GenerateRequests with a bad UTF-8 string in each string field."""
    base = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString()
    bad = b"\xff\xfe\x80"
    out = []
    for number, name in ((1, "request_id"), (2, "prompt"), (13, "stop"), (17, "tenant"),
                         (19, "cache_salt")):  # fmt: skip
        out.append((name, base + _varint(number << 3 | 2) + _varint(len(bad)) + bad))
    return out


def test_a_bad_input_battery_gets_clear_errors_and_leaves_the_cluster_healthy(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    stub = router_cluster.generation(0)
    for label, fields in _fields_battery():
        req = {"prompt": "The river runs", "max_tokens": 4, **fields}
        t0 = time.monotonic()
        try:
            out = generate(stub, timeout=30, **req)
        except grpc.RpcError as e:
            code = e.code()
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
                label, code, e.details())  # fmt: skip
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                named = (next(iter(fields)), "prompt")  # token ids are the prompt
                assert e.details().split(": ", 1)[0] in named, (label, e.details())
        else:  # accepted: then it was served (a huge seed is a valid seed)
            assert out.final.usage.completion_tokens == 4, label
        assert time.monotonic() - t0 < 10, label
    for name, payload in _non_utf8_payloads():
        err = rpc_error(raw_generate, router_cluster.channel(0), payload)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.details())
        assert err.details().startswith(f"{name}: "), err.details()
    # the hand-off path still serves: 20 long prompts, token-exact, then everything idle
    prompts = _prompts(corpus_ids, 20, 300)
    for i, prompt in enumerate(prompts):
        out = generate(stub, timeout=60, **greedy_request(prompt, 4), request_id=f"after-{i}")
        assert out.token_ids == hf_greedy(prompt, 4), i
        assert not out.final.timings.local_prefill
    router_cluster.wait_idle()


def test_the_limits_are_shown_in_status(router_cluster: RouterCluster) -> None:
    limits = _status(router_cluster).limits
    assert limits.max_request_id_chars == 128 and limits.max_tenant_chars == 64
    assert limits.max_stop_token_ids == 64 and limits.max_message_bytes == 4 << 20
    assert limits.max_prompt_tokens > 0 and limits.token_gap_timeout_s > 0
    assert limits.default_request_timeout_s > 0


# ---- drain ------------------------------------------------------------------------------


def test_draining_a_decode_worker_lets_its_8_live_streams_finish_token_exact(
    router_cluster: RouterCluster, spare_decode: str, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    own = _isolate(router_cluster, spare_decode)
    streams = Streams(router_cluster, _prompts(corpus_ids, 8, 0), max_tokens=240)
    streams.wait_tokens(20)
    _undrain(router_cluster, own)  # somewhere for new requests to go
    admin = router_cluster.admin(0)
    reply = admin.Drain(pb.DrainRequest(worker_id=spare_decode, stop=True, timeout_s=240),
                        timeout=300)  # fmt: skip
    assert reply.drained and reply.stopped, reply.message
    assert reply.requests_at_start == 8 and reply.requests_cut == 0, reply
    streams.join()
    for i, prompt in enumerate(streams.prompts):
        assert streams.errors[i] is None, streams.errors[i].details()  # type: ignore[union-attr]
        assert streams.tokens[i] == hf_greedy(prompt, 240), i
        final = streams.finals[i]
        assert final is not None and final.timings.decode_worker == spare_decode
    out = generate(router_cluster.generation(0), **greedy_request(streams.prompts[0], 3))
    assert out.final.timings.decode_worker == own


def test_drain_refuses_bad_timeouts_and_the_last_ready_decode_worker_then_undrain_restores(
    router_cluster: RouterCluster,
) -> None:
    admin = router_cluster.admin(0)
    (own,) = router_cluster.worker_ids(WorkerRole.DECODE)
    for bad in (-5.0, float("nan"), float("inf")):
        err = rpc_error(admin.Drain, pb.DrainRequest(worker_id=own, timeout_s=bad), timeout=10)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().startswith("timeout_s: ")
    err = rpc_error(admin.Drain, pb.DrainRequest(worker_id=own, timeout_s=0), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no ready decode worker" in err.details()
    assert _states(router_cluster)[own] == pb.WORKER_STATE_READY  # nothing changed
    # forced, idle, not stopped: DRAINED in status, still there; undrain brings it back
    reply = admin.Drain(pb.DrainRequest(worker_id=own, timeout_s=0, force=True), timeout=30)
    try:
        assert reply.drained and not reply.stopped and "undrain" in reply.message, reply
        _wait(lambda: _states(router_cluster)[own] == pb.WORKER_STATE_DRAINED, "DRAINED")
        req = pb.GenerateRequest(prompt="The river", max_tokens=2)
        err = rpc_error(router_cluster.generation(0).Generate, req, timeout=30)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        _undrain(router_cluster, own)
    assert generate(router_cluster.generation(0), prompt="The river", max_tokens=2).token_ids
    err = rpc_error(admin.Undrain, pb.UndrainRequest(worker_id=own), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # it is ready: nothing to undo


# ---- stuck workers ----------------------------------------------------------------------


def _pid(handle: object) -> int:
    return int(ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30))  # type: ignore[attr-defined]


def _handle(rc: RouterCluster, worker_id: str) -> object:
    listed = ray.get(rc.cluster.controller.list_workers.remote(), timeout=30)
    return next(h for info, h in listed if info.worker_id == worker_id)


def _wait_replaced(rc: RouterCluster, gone: str, own: str) -> None:
    _wait(lambda: gone not in _states(rc), f"{gone} leaves status", 60)
    _wait(lambda: len(_decode_ids(rc) - {own}) == 1, "a replacement decode worker", 300)


def _index_holds(rc: RouterCluster, worker_id: str) -> bool:
    import redis

    r = redis.Redis.from_url(rc.redis_url)
    try:
        return any(worker_id.encode() in k or r.sismember(k, worker_id)
                   for k in r.scan_iter(match=f"{rc.name}:{rc.model_id}:*", count=1000)
                   if r.type(k) == b"set")  # fmt: skip
    finally:
        r.close()


def test_a_sigstopped_decode_worker_s_streams_migrate_token_exact_and_it_is_replaced(
    router_cluster: RouterCluster, spare_decode: str, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    own = _isolate(router_cluster, spare_decode)
    streams = Streams(router_cluster, _prompts(corpus_ids, 4, 600), max_tokens=300)
    streams.wait_tokens(10)
    _undrain(router_cluster, own)
    _wait(lambda: _index_holds(router_cluster, spare_decode), "its blocks are in the index")
    pid = _pid(_handle(router_cluster, spare_decode))
    os.kill(pid, signal.SIGSTOP)
    try:
        # past the token gap each stream moves to `own` and goes on: nothing lost or repeated
        streams.join(240)
        for i, prompt in enumerate(streams.prompts):
            assert streams.errors[i] is None, streams.errors[i].details()  # type: ignore[union-attr]
            assert streams.tokens[i] == hf_greedy(prompt, 300), i
            final = streams.finals[i]
            assert final is not None and final.timings.decode_worker == own
        out = generate(router_cluster.generation(0), **greedy_request(streams.prompts[0], 3))
        assert out.final.timings.decode_worker == own
        _wait_replaced(router_cluster, spare_decode, own)
        _wait(lambda: not _index_holds(router_cluster, spare_decode), "its index entries go", 30)
    finally:
        with pytest.raises(ProcessLookupError):  # the controller killed it
            for _ in range(100):
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.1)


def test_a_decode_worker_whose_engine_blocks_forever_is_replaced(
    router_cluster: RouterCluster, spare_decode: str, corpus_ids: list[int]
) -> None:
    own = _isolate(router_cluster, spare_decode)
    ray.get(  # a command that never returns: the engine thread blocks for ever
        _handle(router_cluster, spare_decode).__ray_call__.remote(  # type: ignore[attr-defined]
            lambda self: self.runtime.post(lambda engine: threading.Event().wait())
        ),
        timeout=30,
    )
    t0 = time.monotonic()
    err = rpc_error(router_cluster.generation(0).Generate,
                    pb.GenerateRequest(**greedy_request(_prompts(corpus_ids, 1, 900)[0], 8)),  # type: ignore[arg-type]
                    timeout=120)  # fmt: skip
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert time.monotonic() - t0 < 30
    _undrain(router_cluster, own)
    out = generate(router_cluster.generation(0), prompt="The river runs", max_tokens=3)
    assert out.final.timings.decode_worker == own
    _wait_replaced(router_cluster, spare_decode, own)


MID_JSON = {  # ~400 tokens of JSON: still open when the worker is killed
    "type": "object",
    "properties": {"log": {"type": "array", "minItems": 100, "maxItems": 100,
                           "items": {"type": "integer", "minimum": 0, "maximum": 999}}},
    "required": ["log"],
    "additionalProperties": False,
}  # fmt: skip


def test_streams_on_a_killed_decode_worker_migrate_greedy_and_seeded_exactly(
    router_cluster: RouterCluster,
    spare_decode: str,
    corpus_ids: list[int],
    hf_greedy: Reference,
    hf_logits: LogitsReference,
    tokenizer: Tokenizer,
) -> None:
    """ray.kill breaks the token channel at once: the streams move without waiting for the
    token gap. A greedy stream equals transformers; a seeded one with penalties equals the
    same request served undisturbed (its random stream goes on where it was), and so does a
    seeded one killed mid-JSON under a schema (its matcher resumes from the tokens so far on
    the new worker): its JSON validates. A seeded stream may part from the undisturbed one
    only at a near tie, which the migration's recomputed KV may flip (tests/sampling_ties.py;
    seen under load at token 133 of the first seeded stream, its two keys 4e-6 apart). The
    kill comes once every stream has tokens from the spare and the own worker is back (480
    tokens each leave the undrain's seconds to spare: every stream is still running then)."""
    import json

    import jsonschema

    stub = router_cluster.generation(0)
    prompts = _prompts(corpus_ids, 5, 1100)
    n = 480
    seeded = dict(temperature=0.9, top_k=50, seed=1234, repetition_penalty=1.2,
                  presence_penalty=0.3, ignore_eos=True)  # fmt: skip
    mid_json = dict(temperature=1.0, seed=99, structured_output=pb.StructuredOutput(
        json_schema=json.dumps(MID_JSON)))  # fmt: skip
    fields = [greedy_request(p, n) for p in prompts[:2]]
    fields += [dict(token_ids=p, max_tokens=n, **seeded) for p in prompts[2:4]]
    fields.append(dict(token_ids=prompts[4], max_tokens=800, **mid_json))
    limits = ValidationLimits(max_model_len=MAX_MODEL_LEN, vocab_size=tokenizer.vocab_size)
    with ThreadPoolExecutor(3) as pool:  # (seeded streams do not depend on their batch)
        undisturbed = list(pool.map(lambda f: generate(stub, **f).token_ids, fields[2:]))
    own = _isolate(router_cluster, spare_decode)
    results: list[list[int] | grpc.RpcError] = [[] for _ in prompts]
    finals: list[pb.GenerateResponse | None] = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            for msg in stub.Generate(pb.GenerateRequest(**fields[i]), timeout=240):  # type: ignore[arg-type]
                results[i].extend(msg.token_ids)  # type: ignore[union-attr]
                if msg.HasField("usage"):
                    finals[i] = msg
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # a second token comes from the spare (the first is the prefill worker's)
    _wait(lambda: all(isinstance(r, list) and len(r) > 1 for r in results), "two tokens each")
    _undrain(router_cluster, own)
    unfinished = [final is None for final in finals]
    ray.kill(_handle(router_cluster, spare_decode), no_restart=True)
    assert all(unfinished), "a stream ended on the spare before the kill: raise n"
    for t in threads:
        t.join(240)
    for i, prompt in enumerate(prompts):
        got = results[i]
        assert isinstance(got, list), got.details()  # type: ignore[union-attr]
        if i < 2:
            assert got == hf_greedy(prompt, n), i
        else:
            params = validate(pb.GenerateRequest(**fields[i]), tokenizer, limits).sampling  # type: ignore[arg-type]
            assert_same_or_near_tie(got, undisturbed[i - 2], prompt, params, hf_logits)
        final = finals[i]
        assert final is not None and final.timings.decode_worker == own
        assert final.usage.completion_tokens == len(got)
    assert finals[4] is not None and finals[4].finish_reason == pb.FINISH_REASON_STOP
    text = tokenizer.decode(results[4])  # type: ignore[arg-type]
    jsonschema.validate(json.loads(text), MID_JSON)
    _wait_replaced(router_cluster, spare_decode, own)


def test_an_http_stream_on_a_killed_decode_worker_migrates_and_its_text_is_whole(
    router_cluster: RouterCluster, spare_decode: str, corpus_ids: list[int]
) -> None:
    """The OpenAI HTTP API's streams go through the same orchestrator: an SSE completion
    whose decode worker dies ends with the same text and usage as an undisturbed one."""
    import http.client
    import json
    from urllib.parse import urlsplit

    url = urlsplit(_status(router_cluster).http_url)
    assert url.hostname and url.port
    prompt = _prompts(corpus_ids, 1, 1500)[0]
    body = {"model": router_cluster.model_id, "prompt": prompt, "max_tokens": 150,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    def events(on_event: Callable[[int], None] = lambda n: None) -> tuple[str, dict[str, int]]:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=240)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        r = conn.getresponse()
        assert r.status == 200
        text, usage, n = "", {}, 0
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                text += choice["text"]
                n += 1
                on_event(n)
        conn.close()
        return text, usage

    expected_text, expected_usage = events()
    own = _isolate(router_cluster, spare_decode)

    def kill_at_20(n: int) -> None:
        if n == 20:
            _undrain(router_cluster, own)
            ray.kill(_handle(router_cluster, spare_decode), no_restart=True)

    text, usage = events(kill_at_20)
    assert text == expected_text
    assert usage["completion_tokens"] == expected_usage["completion_tokens"] == 150
    _wait_replaced(router_cluster, spare_decode, own)
