"""One request inside an engine: its tokens, blocks, progress and lifecycle state.

Lifecycle (`RequestStatus`; the scheduler makes every transition):

    WAITING   ──schedule──►  RUNNING      blocks allocated (prefix-cache hits reused)
    RUNNING   ──preempt───►  PREEMPTED    blocks freed, KV to be recomputed; head of waiting
    PREEMPTED ──schedule──►  RUNNING      prompt + outputs so far are prefilled again
    RUNNING   ──finish────►  FINISHED_STOPPED   eos, stop token or stop string
                             FINISHED_LENGTH    max_tokens, max_model_len or the whole pool
                             FINISHED_PREFILLED prefill-only: first token sampled, blocks kept
                                                for hand-off until released
    any unfinished ─abort─►  FINISHED_ABORTED   everything it held is freed

A transferred request (decode-only hand-off) is created RUNNING with its prompt KV present.

A request on a LoRA adapter (`lora_name`) holds the adapter's device slot (`lora_slot`) while
it computes: from admission (WAITING/PREEMPTED → RUNNING; until the adapter is resident it
waits, without holding up the requests behind it) to its finish or preemption. A transferred
one may sit RUNNING without a slot, unscheduled, until the scheduler gets one.

Progress uses one counter for prefill, recompute and decode alike (as vLLM v1 does): the
tokens are `prompt + outputs`, `num_computed_tokens` of them have KV in the cache, and a step
computes the next `num_tokens - num_computed_tokens` (capped by the token budget). When that
reaches the end, the last token's logits are sampled and the new token is appended.

Overlap scheduling (engine/core/engine.py): a sampled token is known to the host one step after it
was scheduled. Until then it is a placeholder (`num_output_placeholders`): it counts as a
token of the request, so the next step can already compute its KV (its value comes from the
previous step's sampled ids, on the device), and `append_output` resolves it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vocabulary.block_hash import BlockHash, hash_chain
from vocabulary.engine_io import FinishReason, KVHandoff, RequestOutput, RequestTimings
from vocabulary.logprobs import NO_TOP, PromptLogprobs, TopLogprobs
from vocabulary.sampling import SamplingParams

if TYPE_CHECKING:  # vocabulary.engine_io imports this module
    from vocabulary.engine_io import LoraLoadError, LoraNotFound


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_PREFILLED = "finished_prefilled"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_PREFILLED,
        RequestStatus.FINISHED_ABORTED,
    }
)


FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_PREFILLED: FinishReason.HANDOFF,
}


@dataclass(eq=False)
class Request:
    """Mutable engine-side state of one request (never crosses a module boundary)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_size: int
    hash_extra: bytes
    """`extra` bytes of this request's block hashes (model id and cache salt)."""
    arrival_time: float = field(default_factory=time.time)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, TopLogprobs]] = field(default_factory=list)
    """With `sampling_params.prompt_logprobs`: prompt tokens 1, 2, ... as computed so far
    (their logprob and top alternatives; the first token has none)."""
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Hashes of every full block of `all_token_ids` (grows as outputs fill blocks)."""
    num_computed_tokens: int = 0
    """Tokens scheduled for KV computation (a step in flight included)."""
    num_output_placeholders: int = 0
    """Sampled tokens scheduled whose value the host has not read yet (0, 1 or, while the
    next step is being scheduled, 2); they count in `num_pending_tokens`."""
    num_cached_blocks: int = 0
    """Leading blocks registered in the prefix cache (or reused from it)."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache or a transfer at first schedule."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request, if one did."""
    lora_name: str = ""
    """The LoRA adapter it runs with ("": the base model); part of `hash_extra`."""
    lora_slot: int = -1
    """The adapter's device slot while the request holds it (the scheduler acquires it at
    admission and releases it when the request stops computing); -1: none held."""
    abort_error: LoraNotFound | LoraLoadError | None = None
    """Why the engine itself aborted the request (its adapter was unloaded before it got a
    slot, or could not be loaded); None otherwise."""

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if not self.block_hashes:
            self.block_hashes = hash_chain(self.all_token_ids, self.block_size, self.hash_extra)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is still to be computed before the next sample (placeholders
        included)."""
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are not computed yet: its prompt is computed
        from position 0, without prefix-cache hits (those positions would have no logits)."""
        p = self.sampling_params.prompt_logprobs
        return p is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def wants_prompt_logits(self, start: int) -> bool:
        """A chunk from `start` must return the logits of all its positions (it covers prompt
        positions whose next token's logprob is not computed yet)."""
        return self.needs_prompt_logprobs and start <= self.num_prompt_tokens - 2

    def append_output(
        self, token_id: int, logprob: float | None, top: TopLogprobs | None = None
    ) -> None:
        """Add a sampled token (resolving the oldest placeholder, if any); hash the block it
        completes, if any."""
        if self.num_output_placeholders:
            self.num_output_placeholders -= 1
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
        if self.num_tokens % self.block_size == 0:
            start = self.num_tokens - self.block_size
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes += hash_chain(
                self.all_token_ids[start:], self.block_size, self.hash_extra, parent
            )

    def timings(self) -> RequestTimings:
        return RequestTimings(
            arrival=self.arrival_time,
            first_scheduled=self.first_scheduled_time,
            first_token=self.first_token_time,
            finished=self.finished_time,
        )

    def output(self, num_new: int, text: str, handoff: KVHandoff | None) -> RequestOutput:
        """What the engine reports of this request now: its last `num_new` tokens (with
        their logprobs and alternatives when asked for), `text` (the new text), its finish and
        timings; the output with the first token carries the prompt logprobs, when asked."""
        new_ids = tuple(self.output_token_ids[len(self.output_token_ids) - num_new :])
        params = self.sampling_params
        logprobs = top = prompt = None
        if params.wants_logprobs:
            logprobs = tuple(self.output_logprobs[len(self.output_logprobs) - num_new :])
        if params.top_logprobs:
            top = tuple(self.output_top_logprobs[len(self.output_top_logprobs) - num_new :])
        if params.prompt_logprobs is not None and num_new and num_new == self.num_output_tokens:
            prompt = PromptLogprobs(
                (None, *(lp for lp, _ in self.prompt_logprobs)),
                (NO_TOP, *(t for _, t in self.prompt_logprobs)),
            )
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            text_delta=text,
            logprobs=logprobs,
            top_logprobs=top,
            prompt_logprobs=prompt,
            finish_reason=FINISH_REASONS.get(self.status),
            stop_reason=self.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            timings=self.timings(),
            kv_handoff=handoff,
            abort_error=self.abort_error,
        )
