"""What the HTTP door answers (router/http/responses.py, router/http/errors.py): response
objects and SSE chunks from hand-made deltas, usage over siblings and prompts, logprobs in
both endpoints' shapes, and every failure's HTTP status, OpenAI type, param and retry
headers. Exact answers, no cluster."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import grpc
import pytest

from admission.decision import AdmissionRejected, Reason
from router.errors import StageTimeout, StreamCut, to_grpc_failure
from router.http.errors import ApiError, failure, to_http_failure
from router.http.protocol import ChatCompletionRequest, CompletionRequest
from router.http.responses import ChoiceOutput, ResponseWriter
from router.http.translate import GenerationPlan, Translator
from router.placement import NoWorkerError
from router.progress import StreamDelta, Usage
from router.validation import InvalidRequest, ValidationLimits
from vocabulary.engine_io import FinishReason
from vocabulary.logprobs import NO_TOP, PromptLogprobs, TopLogprobs
from vocabulary.worker_api import RequestAborted, RequestDeadlineExceeded, WorkerOverloaded

LIMITS = ValidationLimits(max_model_len=64, vocab_size=100)


class Tokenizer:
    """Token t is the letter chr(97 + t % 26); token 0 is the special "<s>"."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 26 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("<s>" if t == 0 else chr(97 + t % 26) for t in ids)


class Template:
    def render(self, messages: list[dict[str, Any]], tools: Any = None) -> str:
        return "|".join(m["content"] for m in messages)


def plan(endpoint: str = "completions", **body: Any) -> GenerationPlan:
    t = Translator("m", Tokenizer(), Template(), lambda: LIMITS)  # type: ignore[arg-type]
    if endpoint == "chat":
        chat = {"messages": [{"role": "user", "content": "q"}], **body}
        return t.chat(ChatCompletionRequest.model_validate({"model": "m", **chat}), {})
    return t.completion(CompletionRequest.model_validate({"model": "m", "prompt": [3, 4],
                                                          **body}), {})  # fmt: skip


def writer(p: GenerationPlan) -> ResponseWriter:
    return ResponseWriter(p, "m", Tokenizer())


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt, completion, cached, 0)


def final(ids: tuple[int, ...], text: str, u: Usage, lps: tuple[float, ...] | None = None,
          reason: FinishReason = FinishReason.LENGTH) -> StreamDelta:  # fmt: skip
    return StreamDelta(ids, text, lps, reason, u)


def sse(event: bytes | None) -> dict[str, Any]:
    assert event is not None and event.startswith(b"data: ") and event.endswith(b"\n\n")
    return dict(json.loads(event[6:]))


def test_a_completion_response_with_token_ids_and_usage() -> None:
    p = plan(max_tokens=3, return_token_ids=True)
    out = ChoiceOutput(0, 0)
    out.add(StreamDelta((5,), "f"))
    out.add(final((6, 7), "gh", usage(2, 3, 0)))
    body = writer(p).response([out])
    assert body["object"] == "text_completion" and body["id"] == p.response_id
    assert body["choices"] == [{"index": 0, "text": "fgh", "logprobs": None,
                                "finish_reason": "length", "token_ids": [5, 6, 7],
                                "prompt_token_ids": [3, 4]}]  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def test_usage_counts_each_prompt_once_and_every_choices_tokens() -> None:
    p = plan(prompt=[[1, 2, 3], [4]], n=2)
    outs = [ChoiceOutput(c.index, c.prompt_index) for c in p.choices]
    for out, u in zip(outs, [usage(3, 4, 0), usage(3, 5, 3), usage(1, 2, 1), usage(1, 6, 0)],
                      strict=True):  # fmt: skip
        out.add(final((), "", u, reason=FinishReason.STOP))
    got = writer(p).response(outs)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "stop" for c in got["choices"])
    # prompts: 3 + 1 (their first siblings' counts, cached included); completions: all.
    assert got["usage"] == {"prompt_tokens": 4, "completion_tokens": 17, "total_tokens": 21,
                            "prompt_tokens_details": {"cached_tokens": 1}}  # fmt: skip


def test_completion_chunks_carry_text_and_skip_deltas_with_nothing_to_say() -> None:
    p = plan(stream=True, stream_options={"include_usage": True})
    w, out = writer(p), ChoiceOutput(0, 0)
    first = StreamDelta((5,), "f")
    out.add(first)
    assert sse(w.chunk(out, first))["choices"] == [
        {"index": 0, "text": "f", "logprobs": None, "finish_reason": None}
    ]
    assert sse(w.chunk(out, first))["usage"] is None  # include_usage: null until the last
    held = StreamDelta((200,), "")  # half a character: no text yet, nothing to send
    out.add(held)
    assert w.chunk(out, held) is None
    end = final((), "", usage(2, 2, 0))
    out.add(end)
    assert sse(w.chunk(out, end))["choices"][0]["finish_reason"] == "length"
    last = sse(w.usage_chunk([out]))
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2


def test_chat_chunks_open_with_the_role_and_end_with_an_empty_delta() -> None:
    p = plan("chat", stream=True)
    w, out = writer(p), ChoiceOutput(0, 0)
    deltas = [StreamDelta((5,), "f"), StreamDelta((6,), "g"), final((), "", usage(1, 2, 0))]
    chunks = []
    for d in deltas:
        out.add(d)
        chunks.append(sse(w.chunk(out, d)))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": "f"}, {"content": "g"}, {},
    ]  # fmt: skip
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    whole = w.response([out])
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "fg"}


def test_logprobs_are_of_the_sampled_token_in_each_endpoints_shape() -> None:
    out = ChoiceOutput(0, 0)
    out.add(StreamDelta((0, 1), "b", (-0.5, -1.0)))
    out.add(final((2,), "c", usage(2, 3, 0), (-2.0,)))
    completion = writer(plan(logprobs=0)).response([out])["choices"][0]["logprobs"]
    assert completion == {
        "tokens": ["<s>", "b", "c"],
        "token_logprobs": [-0.5, -1.0, -2.0],
        "top_logprobs": [{"<s>": -0.5}, {"b": -1.0}, {"c": -2.0}],
        "text_offset": [0, 3, 4],
    }
    chat = writer(plan("chat", logprobs=True)).response([out])["choices"][0]["logprobs"]
    assert chat["content"][1] == {"token": "b", "logprob": -1.0, "bytes": [98],
                                  "top_logprobs": []}  # fmt: skip
    # streamed: each chunk has its own tokens, offsets go on from the previous chunk's
    p = plan(logprobs=0, stream=True)
    w, streamed = writer(p), ChoiceOutput(0, 0)
    offsets = []
    for d in (StreamDelta((0, 1), "b", (-0.5, -1.0)), final((2,), "c", usage(2, 3, 0), (-2.0,))):
        streamed.add(d)
        offsets.append(sse(w.chunk(streamed, d))["choices"][0]["logprobs"]["text_offset"])
    assert offsets == [[0, 3], [4]]


def test_top_logprobs_list_the_alternatives_in_each_endpoints_shape() -> None:
    out = ChoiceOutput(0, 0)
    tops = (TopLogprobs((1, 2), (-0.1, -2.5)), TopLogprobs((3, 4), (-0.2, -1.9)))
    out.add(StreamDelta((1,), "b", (-0.1,), top_logprobs=tops[:1]))
    out.add(replace(final((5,), "f", usage(2, 2, 0), (-3.0,)), top_logprobs=tops[1:]))
    completion = writer(plan(logprobs=2)).response([out])["choices"][0]["logprobs"]
    # the sampled token is added when it is not among the alternatives (OpenAI, vLLM)
    assert completion["top_logprobs"] == [{"b": -0.1, "c": -2.5}, {"d": -0.2, "e": -1.9, "f": -3.0}]
    chat = writer(plan("chat", logprobs=True, top_logprobs=2)).response([out])
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert entry["top_logprobs"] == [
        {"token": "b", "logprob": -0.1, "bytes": [98]},
        {"token": "c", "logprob": -2.5, "bytes": [99]},
    ]


def test_echo_puts_the_prompt_and_its_logprobs_first() -> None:
    prompt = PromptLogprobs((None, -1.5), (NO_TOP, TopLogprobs((4, 5), (-1.5, -0.7))))
    first = StreamDelta((6,), "g", (-0.3,), top_logprobs=(TopLogprobs((6,), (-0.3,)),),
                        prompt_logprobs=prompt)  # fmt: skip
    out = ChoiceOutput(0, 0)
    out.add(first)
    out.add(final((), "", usage(2, 1, 0)))
    p = plan(prompt=[3, 4], logprobs=1, echo=True, max_tokens=1)
    choice = writer(p).response([out])["choices"][0]
    assert choice["text"] == "deg"
    assert choice["logprobs"] == {
        "tokens": ["d", "e", "g"],
        "token_logprobs": [None, -1.5, -0.3],
        "top_logprobs": [None, {"e": -1.5, "f": -0.7}, {"g": -0.3}],
        "text_offset": [0, 1, 2],
    }
    # max_tokens 0: the prompt alone, no completion tokens; streamed, the first event has it
    p0 = plan(prompt=[3, 4], logprobs=1, echo=True, max_tokens=0, stream=True)
    w, streamed = writer(p0), ChoiceOutput(0, 0)
    events = []
    for d in (first, final((), "", usage(2, 1, 0), reason=FinishReason.STOP)):  # (eos sampled)
        streamed.add(d)
        events.append(sse(w.chunk(streamed, d))["choices"][0])
    assert events[0]["text"] == "de" and events[0]["logprobs"]["tokens"] == ["d", "e"]
    assert events[1]["finish_reason"] == "length" and events[1]["text"] == ""
    whole = writer(replace(p0, stream=False)).response([out])
    assert whole["choices"][0]["text"] == "de" and whole["usage"]["completion_tokens"] == 0


def test_an_error_event_is_the_error_body() -> None:
    f = to_http_failure(WorkerOverloaded("full"))
    event = writer(plan()).error_event(f.body())
    assert sse(event) == {"error": {"message": "full", "type": "rate_limit_error",
                                    "param": None, "code": "rate_limit_exceeded"}}  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (InvalidRequest("max_tokens", "must be >= 1"), 400, "invalid_request_error", None),
        (AdmissionRejected(250.0, Reason.QUEUE_FULL, "queue full"), 429, "rate_limit_error",
         "rate_limit_exceeded"),
        (AdmissionRejected(None, Reason.NO_LIVE_WORKER, "no worker"), 503, "server_error",
         "service_unavailable"),
        (AdmissionRejected(None, Reason.REQUEST_TOO_LARGE, "too big"), 400, "invalid_request_error",
         None),
        (AdmissionRejected(None, Reason.DEADLINE_UNREACHABLE, "late"), 504, "server_error",
         "timeout"),
        (RequestDeadlineExceeded("past"), 504, "server_error", "timeout"),
        (RequestAborted("aborted"), 503, "server_error", "request_aborted"),
        (NoWorkerError("decode"), 503, "server_error", "service_unavailable"),
        (StageTimeout("stuck"), 503, "server_error", "service_unavailable"),
        (StreamCut(RequestDeadlineExceeded("past"), 3), 504, "server_error", "timeout"),
        (RuntimeError("bug"), 500, "server_error", "internal_error"),
    ],
)  # fmt: skip
def test_each_failure_gets_the_status_its_grpc_code_maps_to(
    exc: Exception, status: int, type_: str, code: str | None
) -> None:
    f = to_http_failure(exc)
    assert (f.status, f.type, f.code) == (status, type_, code)
    g = to_grpc_failure(exc)
    assert (f.message, f.outcome) == (g.message, g.outcome)
    assert (f.retry_after_ms is not None) == (g.code is grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_a_429_says_when_to_retry_in_seconds_and_milliseconds() -> None:
    f = to_http_failure(AdmissionRejected(1250.0, Reason.QUEUE_FULL, "queue full"))
    assert f.headers() == {"retry-after": "2", "retry-after-ms": "1250"}
    assert to_http_failure(WorkerOverloaded("x")).headers() == {
        "retry-after": "1", "retry-after-ms": "500",
    }  # fmt: skip
    assert to_http_failure(RuntimeError("x")).headers() == {}


def test_the_param_is_the_bodys_name_for_the_field() -> None:
    f = to_http_failure(InvalidRequest("token_ids", "id 7 is outside"), {"token_ids": "prompt"}.get)
    assert (f.param, f.message) == ("prompt", "prompt: id 7 is outside")
    door = ApiError(failure(404, "model: no such model", "model", "model_not_found"))
    assert to_http_failure(door) is door.failure
    assert json.loads(door.failure.body()) == {"error": {
        "message": "model: no such model", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}}  # fmt: skip


def test_the_load_clients_sse_reader_reads_what_the_door_writes() -> None:
    from loadtests.openai_client import SseStream, http_failure
    from loadtests.records import StreamTimer

    p = plan(stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    w, out = writer(p), ChoiceOutput(0, 0)
    stream = SseStream(StreamTimer(sent_at=0.0))
    deltas = [StreamDelta((5,), "f"), StreamDelta((6, 7), "gh"), final((8,), "", usage(2, 4, 0))]
    firsts = []
    for t, d in enumerate(deltas, start=1):
        out.add(d)
        firsts.append(stream.feed(w.chunk(out, d) or b"", now=t / 1000))
    stream.feed(w.usage_chunk([out]), now=0.004)
    stream.feed(b"data: [DONE]", now=0.005)
    assert firsts == [True, False, False]
    t = stream.timer
    assert (t.output_tokens, t.ttft_ms, t.tpot_ms) == (4, 1.0, pytest.approx(2 / 3))
    assert stream.usage is not None and stream.usage["completion_tokens"] == 4
    assert (stream.finish_reason, stream.done, stream.error) == ("length", True, None)
    refused = to_http_failure(AdmissionRejected(1250.0, Reason.QUEUE_FULL, "queue full"))
    got = http_failure(refused.status, refused.headers(), refused.body())
    assert (got.status, got.details, got.retry_after_ms) == ("HTTP_429", "queue full", 1250.0)
