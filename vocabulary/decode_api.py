"""What crosses the Ray boundary to and from a decode worker: the request, its token chunks,
and the items of a token channel (frozen, tensor-free, torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from vocabulary.engine_io import NO_PRIOR, FinishReason, PriorOutput
from vocabulary.kv_handle import KVHandle
from vocabulary.logprobs import PromptLogprobs, TopLogprobs
from vocabulary.sampling import SamplingParams
from vocabulary.tracing import TraceContext


@dataclass(frozen=True)
class DecodeRequest:
    """Decode a request whose KV waits on a prefill worker (`handle`), or prefill it here.

    With a handle, `first_token_id` is the token the prefill worker sampled (already sent to
    the client). Without one (conditional disaggregation, colocated serving) the decode
    worker computes the prompt itself and streams the first token too.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str = ""
    lora: str = ""
    """The LoRA adapter it runs with ("": the base model); the KV in `handle` was computed
    with it."""
    handle: KVHandle | None = None
    first_token_id: int | None = None
    first_logprob: float | None = None
    arrival_time: float = 0.0
    deadline: float | None = None
    prior: PriorOutput = NO_PRIOR
    """A migrated request: the tokens the client already has from the worker that failed
    (with a handle, those before `first_token_id`; their KV follows the prompt's in it).
    They count as output: sampling goes on after them as in one undisturbed run."""
    trace: TraceContext | None = None
    """The router's span of this decode call (the worker's spans are its children); None:
    untraced."""

    @property
    def kv_token_ids(self) -> tuple[int, ...]:
        """The tokens whose KV the handle holds, or this worker computes before sampling."""
        return (*self.prompt_token_ids, *self.prior.token_ids)


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of one request since the previous chunk.

    The first chunk of a pulled request reports the transfer; the last (finish_reason set)
    carries the usage counts.
    """

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    """Each token's alternatives, when the request asked for them."""
    prompt_logprobs: PromptLogprobs | None = None
    """Local prefill: the prompt's logprobs, on the chunk with the first token, when asked."""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_transferred_tokens: int = 0
    transfer_s: float = 0.0
    queue_s: float = 0.0
    """Local prefill: time from arrival to first scheduled on this worker."""
    prefill_s: float = 0.0
    """Local prefill: time from first scheduled to the first token."""


@dataclass(frozen=True)
class ChunkError:
    """A request on a token channel ended with this error (its last item on the channel).

    `error` is the worker's typed exception as raised there (a `TransferError` subclass,
    `RequestDeadlineExceeded`, `WorkerOverloaded`, ...), so callers map it like a raised one.
    """

    request_id: str
    error: BaseException


ChannelItem = tuple[str, TokenChunk] | ChunkError
"""One entry of a channel batch: a request's new tokens, or its terminal error."""


@dataclass(frozen=True)
class ChannelInfo:
    """A token channel as the decode worker holds it (`DecodeWorker.channels()`)."""

    channel_id: str
    subscribed: bool
    open_requests: int
    """Requests submitted on it whose last item has not been taken by a subscriber yet."""
