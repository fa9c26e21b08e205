"""What one request has done so far, and the values the client gets from it.

`RequestProgress` is written by four events, in the order a request lives them: `admitted`
(its queue time), `placed` (each attempt's workers), `prefilled` (a prefill worker's answer;
`first_token_out` when its token is the client's first) and `chunk` (each chunk a decode worker
streams). Everything computed from it is computed here, once: the last delta's `Usage` and
`Timings` (`final_delta`) and the router's per-request metrics (`record`). The orchestrator
reads the few counts the recovery policy and the error messages need; nothing else writes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from router.placement import Placement
from vocabulary.decode_api import TokenChunk
from vocabulary.engine_io import FinishReason, PriorOutput
from vocabulary.logprobs import PromptLogprobs, TopLogprobs
from vocabulary.prefill_api import PrefillResult


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    transferred_prompt_tokens: int


@dataclass(frozen=True)
class Timings:
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    prefill_worker: str
    decode_worker: str
    local_prefill: bool


@dataclass(frozen=True)
class StreamDelta:
    """New tokens for the client; the last one carries finish reason, usage and timings."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    """Each token's alternatives, when the request asked for them."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's logprobs, when asked for: on the client's first delta only."""


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the router's metrics see it (seconds; None: never happened)."""

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    first_token_worker: str
    """The worker that computed the first token (the decode worker for a local prefill)."""
    decode_worker: str
    cached_prompt_tokens: int
    transferred_prompt_tokens: int = 0
    prefill_worker: str = ""
    """The prefill worker of the first token ("" for a local prefill)."""


class RequestProgress:
    """What one request has done so far: for its timings, usage, metrics and recovery.

    The clock starts at construction (the request's arrival at the router).
    """

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._t0 = time.perf_counter()
        self._queue_ms = 0.0
        self._prefill_ms = 0.0
        self._transfer_ms = 0.0
        self._cached_prompt_tokens = 0
        self._transferred_prompt_tokens = 0
        self._prefill_worker = ""
        self._decode_worker = ""
        self._local_prefill = False
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._completion_tokens = 0
        self._decoded_tokens = 0
        self._sent_ids: list[int] = []
        self._sent_chars = 0
        self._last_logprob: float | None = None
        self.migrations = 0
        """Times the request moved to other workers after its decode worker failed."""

    # ---- what the orchestrator reads ---------------------------------------------------------

    @property
    def completion_tokens(self) -> int:
        """Tokens the client has been sent."""
        return self._completion_tokens

    @property
    def decoded_tokens(self) -> int:
        """Tokens a decode worker streamed after a prefill worker's first token."""
        return self._decoded_tokens

    @property
    def sent_any(self) -> bool:
        """The client has tokens (from a prefill worker's first token or a decode worker's
        stream, a local prefill's included): a retry continues after them."""
        return bool(self._sent_ids)

    @property
    def last_token(self) -> tuple[int, float | None]:
        """The last token the client has and its logprob (a hand-off continues after it)."""
        return self._sent_ids[-1], self._last_logprob

    def prior(self, with_last: bool) -> PriorOutput:
        """The tokens the client has (`with_last`: all of them; else all but the last, which a
        hand-off passes as the token it continues after) and how much of their text."""
        ids = self._sent_ids if with_last else self._sent_ids[:-1]
        return PriorOutput(tuple(ids), self._sent_chars)

    # ---- events ------------------------------------------------------------------------------

    def admitted(self, queued_ms: float) -> None:
        self._queue_ms = queued_ms

    def placed(self, placement: Placement) -> None:
        self._decode_worker = placement.decode_worker_id
        if placement.local_prefill and not self._sent_ids:
            # (a local placement after the first token is a resume: its prefill stats and
            # tokens count as decoded ones)
            self._local_prefill = True

    def prefilled(self, worker_id: str, result: PrefillResult) -> None:
        self._prefill_worker = worker_id
        self._prefill_ms = result.prefill_s * 1000

    def first_token_out(self, result: PrefillResult) -> StreamDelta:
        """The prefill result's first token becomes the client's first token (TTFT)."""
        self._cached_prompt_tokens = result.num_cached_prompt_tokens
        self._tokens_out((result.first_token_id,), result.first_text)
        self._last_logprob = result.first_logprob
        logprobs = (result.first_logprob,) if result.first_logprob is not None else None
        top = (result.first_top_logprobs,) if result.first_top_logprobs is not None else None
        return StreamDelta(
            (result.first_token_id,), result.first_text, logprobs,
            top_logprobs=top, prompt_logprobs=result.prompt_logprobs,
        )  # fmt: skip

    def chunk_delta(self, chunk: TokenChunk) -> StreamDelta:
        """What the client gets of a decode worker's chunk (after `chunk(chunk)`): its tokens,
        and the final delta's usage and timings when it is the last. A prompt's logprobs pass
        only before the client has anything (a local prefill's first chunk)."""
        if chunk.finish_reason is not None:
            delta = self.final_delta(chunk.finish_reason)
        else:
            delta = StreamDelta((), "")
        first = self._sent_ids == list(chunk.token_ids)
        return replace(
            delta, token_ids=chunk.token_ids, text=chunk.text, logprobs=chunk.logprobs,
            top_logprobs=chunk.top_logprobs,
            prompt_logprobs=chunk.prompt_logprobs if first else None,
        )  # fmt: skip

    def chunk(self, chunk: TokenChunk) -> None:
        """A chunk from the decode worker (the delta it becomes is the caller's)."""
        if chunk.transfer_s:
            self._transfer_ms = chunk.transfer_s * 1000
            self._transferred_prompt_tokens = chunk.num_transferred_tokens
        if self._local_prefill and self._first_token_at is None:
            self._prefill_ms = chunk.prefill_s * 1000
            self._cached_prompt_tokens = chunk.num_cached_prompt_tokens
        if chunk.token_ids:
            self._tokens_out(chunk.token_ids, chunk.text)
            if chunk.logprobs:
                self._last_logprob = chunk.logprobs[-1]
            if not self._local_prefill:
                self._decoded_tokens += len(chunk.token_ids)
        else:
            self._sent_chars += len(chunk.text)

    def _tokens_out(self, token_ids: tuple[int, ...], text: str) -> None:
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
        self._last_token_at = now
        self._completion_tokens += len(token_ids)
        self._sent_ids += token_ids
        self._sent_chars += len(text)

    # ---- what is computed from it ------------------------------------------------------------

    def final_delta(self, reason: FinishReason) -> StreamDelta:
        """The delta that ends the stream: no tokens, the finish reason, usage and timings."""
        now = time.perf_counter()
        first = self._first_token_at or now
        last = self._last_token_at or now
        n = self._completion_tokens
        timings = Timings(
            queue_ms=self._queue_ms,
            prefill_ms=self._prefill_ms,
            transfer_ms=self._transfer_ms,
            ttft_ms=(first - self._t0) * 1000,
            tpot_ms=(last - first) * 1000 / (n - 1) if n > 1 else 0.0,
            e2e_ms=(now - self._t0) * 1000,
            prefill_worker=self._prefill_worker,
            decode_worker=self._decode_worker,
            local_prefill=self._local_prefill,
        )
        usage = Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=n,
            cached_prompt_tokens=self._cached_prompt_tokens,
            transferred_prompt_tokens=self._transferred_prompt_tokens,
        )
        return StreamDelta((), "", None, reason, usage, timings)

    def record(self) -> RequestRecord:
        now = time.perf_counter()
        first, last, n = self._first_token_at, self._last_token_at, self._completion_tokens
        return RequestRecord(
            ttft_s=first - self._t0 if first else None,
            tpot_s=(last - first) / (n - 1) if first and last and n > 1 else None,
            e2e_s=now - self._t0,
            first_token_worker=self._decode_worker if self._local_prefill else self._prefill_worker,
            decode_worker=self._decode_worker,
            cached_prompt_tokens=self._cached_prompt_tokens,
            transferred_prompt_tokens=self._transferred_prompt_tokens,
            prefill_worker="" if self._local_prefill else self._prefill_worker,
        )
