"""Detokenize one request's output and decide when it stops.

Rules, checked after every sampled token, first match wins:
1. the token is in `stop_token_ids`, or is an eos id and `ignore_eos` is off → STOPPED; the
   token stays in the token ids but adds no text (stop_reason = the id; None for eos);
2. the text now contains a stop string → STOPPED; the text is cut where the earliest stop
   string begins (the stop string and anything after it are never returned);
3. `max_tokens` outputs, or `max_model_len` tokens in all → LENGTH.

Text is released with a hold-back: while a request runs, the last (longest stop string - 1)
characters are kept back, so a client never receives the beginning of a stop string that
then completes. Multi-byte characters are held back by the detokenizer itself.
"""

from __future__ import annotations

from typing import Protocol

from engine.core.request import Request, RequestStatus


class TextStream(Protocol):
    """What the checker needs of a detokenizer (vocabulary.tokenizer.IncrementalDetokenizer)."""

    def push(self, token_id: int) -> str: ...


class StopChecker:
    """Per-request text state: the detokenized output and how much of it has been released."""

    def __init__(
        self,
        detokenizer: TextStream,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        text: str = "",
    ) -> None:
        self._detokenizer = detokenizer
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self.text = text
        """Output text so far (already cut at a stop string)."""
        self._num_released = len(text)

    def update(self, request: Request, token_id: int) -> RequestStatus | None:
        """Account for `token_id` (already appended to the request); the finish status or None."""
        params = request.sampling_params
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self._eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        delta = self._detokenizer.push(token_id)
        if delta:
            start = max(0, len(self.text) - params.max_stop_len + 1)
            self.text += delta
            if params.stop:
                match = _earliest_stop(self.text, params.stop, start)
                if match is not None:
                    position, stop = match
                    self.text = self.text[:position]
                    request.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self._max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def replay(self, token_ids: tuple[int, ...]) -> None:
        """Detokenize output another engine produced (a migrated request's) without checking
        it: it did not stop the request there."""
        for token_id in token_ids:
            self.text += self._detokenizer.push(token_id)

    def mark_released(self, text_chars: int) -> None:
        """The client has the first `text_chars` characters (a migrated request: what the
        engine before sent); the rest is released as if held back here."""
        self._num_released = min(text_chars, len(self.text))

    def take_text_delta(self, request: Request, finished: bool) -> str:
        """Text not yet released; all of it when finished, else minus the stop hold-back."""
        end = len(self.text)
        if not finished:
            end -= max(0, request.sampling_params.max_stop_len - 1)
        if end <= self._num_released:
            return ""
        delta = self.text[self._num_released : end]
        self._num_released = end
        return delta


def _earliest_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        position = text.find(stop, start)
        if position >= 0 and (best is None or position < best[0]):
            best = (position, stop)
    return best
