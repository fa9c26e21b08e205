"""The orchestrator's deltas → OpenAI response objects and SSE chunks.

`ChoiceOutput` gathers one choice (text, token ids, logprobs, finish reason, usage);
`ResponseWriter` turns them into what a client reads: the whole `text_completion` /
`chat.completion` object, or per delta one `data: {...}` event of the stream's chunk object,
the usage chunk (`stream_options.include_usage`) and `data: [DONE]`.

Usage follows OpenAI's rules for several choices: a prompt counts once however many
siblings it has (its first sibling's counts, prefix-cache hits included), completion tokens
add up over every choice.

Log-probabilities: completions get `tokens`, `token_logprobs`, `top_logprobs` (per token a
{text: logprob} dict of the `logprobs: N` most likely tokens plus the sampled one, as OpenAI's
legacy API and vLLM give it; the sampled token alone for `logprobs: 0`) and `text_offset`;
chat gets `content` entries whose `top_logprobs` list the `top_logprobs: N` most likely tokens.
A token's text is its own decoding, special tokens included.

Tool calls (chat with tools, router/http/tools.py): a choice whose text parses as calls of
declared tools gets `message.tool_calls` (content null) and finish reason "tool_calls"; a
stream holds such text back and sends the calls at the end as `delta.tool_calls`: per call
one delta with its index, id, type and name (arguments "") and one with its arguments, then
the finish reason in a delta of its own.

`echo` (completions): the text starts with the prompt (its string as sent, or its ids
decoded), and with `logprobs` the prompt's tokens come first in every list, the first one
with a null logprob and null top entries; a stream's first event carries it. With
`max_tokens: 0` (echo only) the one token the engine samples is not shown: the choice is the
prompt, finish reason "length", no completion tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from router.http.tools import ToolCall, ToolCallStream, parse_tool_calls
from router.http.translate import Endpoint, GenerationPlan
from router.progress import StreamDelta, Usage
from vocabulary.engine_io import FinishReason
from vocabulary.logprobs import NO_TOP, PromptLogprobs, TopLogprobs

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "stop"}
DONE = b"data: [DONE]\n\n"


@dataclass
class ChoiceOutput:
    """One choice so far."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    text_chars: int = 0
    """Characters of text so far (where the next token's text starts)."""
    streamed: bool = False
    """A chunk of it went out (the first one carries the role and the prompt's ids)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls its text made (chat with tools, once it ended)."""
    tool_stream: ToolCallStream | None = None
    """Streamed chat with tools: what of the text is held back."""

    def add(self, delta: StreamDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        self.top_logprobs.extend(delta.top_logprobs or ())
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = _FINISH[delta.finish_reason]
            self.usage = delta.usage


class ResponseWriter:
    """Response objects and stream chunks of one request."""

    def __init__(self, plan: GenerationPlan, model_id: str, tokenizer: Any) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.chat = plan.endpoint is Endpoint.CHAT
        self._head = {
            "id": plan.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model_id,
        }

    # ---- the stream ---------------------------------------------------------------------------

    def chunk(self, out: ChoiceOutput, delta: StreamDelta) -> bytes | None:
        """The event for `delta` of choice `out` (after `out.add(delta)`); None when it has
        nothing to say (no text and no tokens to report, not the end)."""
        if self.plan.discard_output:  # max_tokens 0: the sampled token is not shown
            delta = replace(delta, token_ids=(), text="", logprobs=None, top_logprobs=None)
        echo = self.plan.echo and not out.streamed
        text = delta.text
        calls: tuple[ToolCall, ...] = ()
        if self.chat and self.plan.tools is not None and self.plan.tools.parses:
            if out.tool_stream is None:
                out.tool_stream = ToolCallStream(self.plan.tools)
            ended = out.finish_reason if delta.finish_reason is not None else None
            text, calls = out.tool_stream.feed(delta.text, ended)
            out.tool_calls = calls
        shows_tokens = self.plan.logprobs or self.plan.return_token_ids
        if not text and delta.finish_reason is None and not echo and not (
            shows_tokens and delta.token_ids
        ):  # fmt: skip
            return None
        first, out.streamed = not out.streamed, True
        choice: dict[str, Any] = {"index": out.index}
        calls_events = self._call_events(out, calls, first) if calls else b""
        if self.chat:
            says_role = first and not calls  # (else the calls' first delta said it)
            message: dict[str, Any] = {"role": "assistant"} if says_role else {}
            if text or says_role:
                message["content"] = text
            choice["delta"] = message
        else:
            choice["text"] = self._echo_text(out) + delta.text if echo else delta.text
        choice["logprobs"] = self._logprobs(out, delta, echo) if self.plan.logprobs else None
        choice["finish_reason"] = self._finish(out) if delta.finish_reason is not None else None
        if self.plan.return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
            if first:
                choice["prompt_token_ids"] = self._prompt_ids(out)
        return calls_events + self._chunk_event(choice)

    def _chunk_event(self, choice: dict[str, Any]) -> bytes:
        body: dict[str, Any] = {**self._head, "choices": [choice]}
        if self.plan.include_usage:
            body["usage"] = None
        return _event(body)

    def _call_events(self, out: ChoiceOutput, calls: Sequence[ToolCall], first: bool) -> bytes:
        """The deltas that carry `calls` (the first of the choice carries the role)."""
        events = []
        for i, call in enumerate(calls):
            head = call.as_json(i)
            head["function"] = {"name": call.name, "arguments": ""}
            args = {"index": i, "function": {"arguments": call.arguments}}
            for part in (head, args):
                message: dict[str, Any] = {"tool_calls": [part]}
                if first:
                    message = {"role": "assistant", "content": None, **message}
                    first = False
                delta = {"index": out.index, "delta": message, "logprobs": None,
                         "finish_reason": None}  # fmt: skip
                events.append(self._chunk_event(delta))
        return b"".join(events)

    def usage_chunk(self, outputs: Sequence[ChoiceOutput]) -> bytes:
        return _event({**self._head, "choices": [], "usage": self.usage(outputs)})

    def error_event(self, error_body: bytes) -> bytes:
        return b"data: " + error_body + b"\n\n"

    # ---- the whole response -------------------------------------------------------------------

    def response(self, outputs: Sequence[ChoiceOutput]) -> dict[str, Any]:
        choices = []
        for out in outputs:
            text = "" if self.plan.discard_output else "".join(out.text)
            choice: dict[str, Any] = {"index": out.index}
            if self.chat:
                choice["message"] = self._message(out, text)
            else:
                choice["text"] = self._echo_text(out) + text if self.plan.echo else text
            logprobs = self._logprobs(out, None, self.plan.echo) if self.plan.logprobs else None
            choice["logprobs"] = logprobs
            choice["finish_reason"] = self._finish(out)
            if self.plan.return_token_ids:
                choice["token_ids"] = out.token_ids
                choice["prompt_token_ids"] = self._prompt_ids(out)
            choices.append(choice)
        return {
            **self._head,
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": choices,
            "usage": self.usage(outputs),
        }

    def usage(self, outputs: Sequence[ChoiceOutput]) -> dict[str, Any]:
        prompt = cached = completion = 0
        for out in outputs:
            u = out.usage
            if u is None:
                continue
            completion += 0 if self.plan.discard_output else u.completion_tokens
            if out.index % self.plan.n == 0:  # the prompt's first sibling
                prompt += u.prompt_tokens
                cached += u.cached_prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ---- parts --------------------------------------------------------------------------------

    def _prompt_ids(self, out: ChoiceOutput) -> list[int]:
        return list(self.plan.choices[out.index].request.prompt_token_ids)

    def _message(self, out: ChoiceOutput, text: str) -> dict[str, Any]:
        """A whole chat choice's message: its text, or the tool calls the text makes."""
        tools = self.plan.tools
        if tools is not None and tools.parses and out.finish_reason == "stop":
            out.tool_calls = parse_tool_calls(text, tools) or ()
        if not out.tool_calls:
            return {"role": "assistant", "content": text}
        calls = [call.as_json() for call in out.tool_calls]
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def _finish(self, out: ChoiceOutput) -> str | None:
        """The choice's finish reason ("length" for max_tokens 0: nothing was generated,
        whatever ended the one token the engine sampled; "tool_calls" when it made calls)."""
        if self.plan.discard_output and out.finish_reason is not None:
            return "length"
        if out.tool_calls:
            return "tool_calls"
        return out.finish_reason

    def _echo_text(self, out: ChoiceOutput) -> str:
        return self.plan.echo_texts[out.prompt_index]

    def _logprobs(
        self, out: ChoiceOutput, delta: StreamDelta | None, echo: bool = False
    ) -> dict[str, Any]:
        """Of the delta's tokens (streaming, after `out.add(delta)`), or of all of them; with
        `echo`, the prompt's tokens first."""
        if delta is None:
            k = 0 if self.plan.discard_output else len(out.token_ids)
            start = len(self._echo_text(out)) if echo else 0
        else:
            k = len(delta.token_ids)
            start = len(self._echo_text(out)) if echo else out.text_chars
        ids = out.token_ids[len(out.token_ids) - k :]
        lps: list[float | None] = list(out.logprobs[len(out.logprobs) - k :])
        tops: list[TopLogprobs | None] = list(out.top_logprobs[len(out.top_logprobs) - k :])
        if len(tops) != len(ids):  # no alternatives asked for
            tops = [None] * len(ids)
        texts = [self._text(t) for t in ids]
        out.text_chars = start + sum(len(t) for t in texts)
        offsets = _offsets(texts, start)
        if echo:
            prompt = out.prompt_logprobs
            prompt_ids = self._prompt_ids(out)
            prompt_texts = [self._text(t) for t in prompt_ids]
            texts = prompt_texts + texts
            ids = prompt_ids + ids
            offsets = _offsets(prompt_texts, 0) + offsets
            if prompt is None:  # (validation asks for them whenever echo has logprobs)
                prompt = PromptLogprobs((None,) * len(prompt_ids), (NO_TOP,) * len(prompt_ids))
            lps = [*prompt.logprobs, *lps]
            tops = [None, *prompt.top[1:], *tops]
        if self.chat:
            content = [
                {
                    "token": s, "logprob": lp, "bytes": list(s.encode()),
                    "top_logprobs": self._chat_top(top),
                }
                for s, lp, top in zip(texts, lps, tops, strict=False)
            ]  # fmt: skip
            return {"content": content, "refusal": None}
        return {
            "tokens": texts,
            "token_logprobs": lps,
            "top_logprobs": [
                None if lp is None else self._completion_top(s, lp, top)
                for s, lp, top in zip(texts, lps, tops, strict=False)
            ],
            "text_offset": offsets,
        }

    def _text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _chat_top(self, top: TopLogprobs | None) -> list[dict[str, Any]]:
        if top is None:
            return []
        return [
            {"token": s, "logprob": lp, "bytes": list(s.encode())}
            for s, lp in zip(map(self._text, top.token_ids), top.logprobs, strict=True)
        ]

    def _completion_top(
        self, text: str, logprob: float, top: TopLogprobs | None
    ) -> dict[str, float]:
        """The {text: logprob} of a position: its top alternatives and the token itself."""
        entries: dict[str, float] = {}
        if top is not None:
            entries = dict(zip(map(self._text, top.token_ids), top.logprobs, strict=True))
        entries.setdefault(text, logprob)
        return entries


def _offsets(texts: Sequence[str], start: int) -> list[int]:
    offsets, at = [], start
    for s in texts:
        offsets.append(at)
        at += len(s)
    return offsets


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
