"""What the prefill call carries to and from a prefill worker (frozen, tensor-free): the
request and its first token with the KV handle. Shared worker types live in
vocabulary/worker_api.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from vocabulary.engine_io import FinishReason
from vocabulary.kv_handle import KVHandle
from vocabulary.logprobs import PromptLogprobs, TopLogprobs
from vocabulary.sampling import SamplingParams
from vocabulary.tracing import TraceContext


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str = ""
    lora: str = ""
    """The LoRA adapter it runs with ("": the base model)."""
    arrival_time: float = 0.0
    deadline: float | None = None
    """Wall-clock time after which the worker gives up on the request."""
    trace: TraceContext | None = None
    """The router's span of this call (the worker's span is its child); None: untraced."""


@dataclass(frozen=True)
class PrefillResult:
    """The first token, and where the prompt's KV waits for a decode worker.

    `handle` is None when the request already ended with its first token (`finish_reason`
    set: eos, a stop token, max_tokens=1); then no blocks are held.
    """

    request_id: str
    first_token_id: int
    first_text: str
    first_logprob: float | None
    finish_reason: FinishReason | None
    handle: KVHandle | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    queue_s: float
    prefill_s: float
    worker_id: str
    first_top_logprobs: TopLogprobs | None = None
    """The first token's alternatives, when the request asked for them (top_logprobs)."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's logprobs, when the request asked for them (prompt_logprobs)."""
