"""The orchestrator's deltas → OpenAI response objects and SSE chunks.

`ChoiceOutput` gathers one choice (text, token ids, logprobs, finish reason, usage);
`ResponseWriter` turns them into what a client reads: the whole `text_completion` /
`chat.completion` object, or per delta one `data: {...}` event of the stream's chunk object,
the usage chunk (`stream_options.include_usage`) and `data: [DONE]`.

Usage follows OpenAI's rules for several choices: a prompt counts once however many
siblings it has (its first sibling's counts, prefix-cache hits included), completion tokens
add up over every choice.

Log-probabilities are of the sampled token only (what the engine computes):
completions get `tokens`, `token_logprobs`, `top_logprobs` (the sampled token alone, which
OpenAI's definition allows for `logprobs: 0`) and `text_offset`; chat gets `content` entries
with empty `top_logprobs`. A token's text is its own decoding, special tokens included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.http.translate import Endpoint, GenerationPlan
from router.progress import StreamDelta, Usage
from vocabulary.engine_io import FinishReason

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
    finish_reason: str | None = None
    usage: Usage | None = None
    text_chars: int = 0
    """Characters of text so far (where the next token's text starts)."""
    streamed: bool = False
    """A chunk of it went out (the first one carries the role and the prompt's ids)."""

    def add(self, delta: StreamDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
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
        shows_tokens = self.plan.logprobs or self.plan.return_token_ids
        if not delta.text and delta.finish_reason is None and not (
            shows_tokens and delta.token_ids
        ):  # fmt: skip
            return None
        first, out.streamed = not out.streamed, True
        choice: dict[str, Any] = {"index": out.index}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta.text or first:
                message["content"] = delta.text
            choice["delta"] = message
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self._logprobs(out, delta) if self.plan.logprobs else None
        choice["finish_reason"] = out.finish_reason if delta.finish_reason is not None else None
        if self.plan.return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
            if first:
                choice["prompt_token_ids"] = self._prompt_ids(out)
        body: dict[str, Any] = {**self._head, "choices": [choice]}
        if self.plan.include_usage:
            body["usage"] = None
        return _event(body)

    def usage_chunk(self, outputs: Sequence[ChoiceOutput]) -> bytes:
        return _event({**self._head, "choices": [], "usage": self.usage(outputs)})

    def error_event(self, error_body: bytes) -> bytes:
        return b"data: " + error_body + b"\n\n"

    # ---- the whole response -------------------------------------------------------------------

    def response(self, outputs: Sequence[ChoiceOutput]) -> dict[str, Any]:
        choices = []
        for out in outputs:
            text = "".join(out.text)
            choice: dict[str, Any] = {"index": out.index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(out, None) if self.plan.logprobs else None
            choice["finish_reason"] = out.finish_reason
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
            completion += u.completion_tokens
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

    def _logprobs(self, out: ChoiceOutput, delta: StreamDelta | None) -> dict[str, Any]:
        """Of the delta's tokens (streaming, after `out.add(delta)`), or of all of them."""
        if delta is None:
            ids, lps, start = out.token_ids, out.logprobs, 0
        else:
            k = len(delta.token_ids)
            ids = out.token_ids[len(out.token_ids) - k :]
            lps = out.logprobs[len(out.logprobs) - k :]
            start = out.text_chars
        texts = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        out.text_chars = start + sum(len(t) for t in texts)
        if self.chat:
            content = [
                {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                for s, lp in zip(texts, lps, strict=False)
            ]
            return {"content": content, "refusal": None}
        offsets, at = [], start
        for s in texts:
            offsets.append(at)
            at += len(s)
        return {
            "tokens": texts,
            "token_logprobs": list(lps),
            "top_logprobs": [{s: lp} for s, lp in zip(texts, lps, strict=False)],
            "text_offset": offsets,
        }


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
