"""Values that cross the engine's boundary: why a request ended and when, output a migrated
request already produced, per-step request outputs, hand-off descriptions, the load snapshot
and the LoRA errors. All frozen; none holds a tensor (workers ship them over Ray as they are,
and the router reads them without the engine)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vocabulary.block_hash import BlockHash
from vocabulary.kv_events import KVTier
from vocabulary.logprobs import PromptLogprobs, TopLogprobs
from vocabulary.step_stats import StepStats


class FinishReason(enum.Enum):
    """Why a request's output ended (what the API reports)."""

    STOP = "stop"  # eos, stop token or stop string
    LENGTH = "length"  # max_tokens, max_model_len, or more KV than the whole pool
    ABORT = "abort"  # aborted by the caller
    HANDOFF = "handoff"  # prefill-only: the first token is out; decode continues elsewhere


@dataclass(frozen=True)
class RequestTimings:
    """Wall-clock times (time.time(), seconds) of one request on this engine; None = not yet."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class PriorOutput:
    """Output a request already produced on another engine, whose client has it: a request
    that migrated after its worker failed. The tokens follow the prompt and their KV is
    computed here as the prompt's is, but they count as output (max_tokens, penalties, the
    draws of a seeded generator, stop strings over the text); the first `text_chars`
    characters of their text were sent (the rest was held back for a stop string)."""

    token_ids: tuple[int, ...] = ()
    text_chars: int = 0

    def __post_init__(self) -> None:
        if self.text_chars < 0:
            raise ValueError(f"text_chars: {self.text_chars} is negative")


NO_PRIOR = PriorOutput()
"""A request that starts here (nothing produced elsewhere)."""


@dataclass(frozen=True)
class KVHandoff:
    """A prefill-only request's finished KV, held on this engine until released.

    The blocks hold the KV of the first `num_tokens` tokens (the prompt; the first sampled
    token's KV is computed by the decode side). `block_hashes` are the hashes of its full
    blocks (len == num_tokens // block_size); the trailing partial block has none.
    """

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    num_tokens: int
    first_token_id: int
    block_tiers: tuple[KVTier, ...] = ()
    """Per block, the tier whose id `block_ids` holds (a device block, or a host-tier slot
    lent instead: EngineConfig.host_kv_handoff); empty: every block is a device block."""


@dataclass(frozen=True)
class TransferAllocation:
    """Blocks a decode-side engine reserved for a request's incoming KV.

    `block_ids[:num_cached_blocks]` already hold this prefix locally (prefix-cache hits):
    transfer only `block_ids[num_cached_blocks:]`.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_blocks: int

    @property
    def blocks_to_transfer(self) -> tuple[int, ...]:
        return self.block_ids[self.num_cached_blocks :]


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (new tokens since the previous output)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    """UTF-8-safe text of the new tokens (stop strings and partial characters held back)."""
    logprobs: tuple[float, ...] | None
    """Raw log-probability of each new token, when the request asked for them."""
    finish_reason: FinishReason | None
    """None while the request runs."""
    stop_reason: str | int | None
    """The stop string or stop token id that ended it (None for eos or other reasons)."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int
    """Prompt tokens whose KV was reused (prefix cache or transfer) rather than computed."""
    timings: RequestTimings
    kv_handoff: KVHandoff | None = None
    """Prefill-only: set on the finishing output when the blocks are held for hand-off."""
    abort_error: LoraNotFound | LoraLoadError | None = None
    """With finish_reason ABORT: why the engine itself ended the request (its LoRA adapter
    was unloaded before it ran, or could not be loaded); None for a caller's abort. A worker
    hands it to the request's reader as the request's error (worker_runtime/runtime.py), so
    the caller gets NOT_FOUND / FAILED_PRECONDITION naming the adapter."""
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    """Each new token's most likely alternatives, when the request asked for them."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's logprobs, when asked for: on the output with the first token only."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def abort_reason(self) -> str:
        """`abort_error`'s message ("" when there is none)."""
        return "" if self.abort_error is None else str(self.abort_error)


@dataclass(frozen=True)
class TierMoveStats:
    """One direction of a host tier's copies as the in-flight budget saw them
    (kv_transfer/budget.py; gauges `queued_blocks` and `inflight_blocks`, the rest monotonic)."""

    queued_blocks: int = 0
    """Waiting for budget: an onboard's blocks (the request waits in the queue), or blocks
    offered for offload and not copied yet."""
    inflight_blocks: int = 0
    """Copies queued on the device and not known complete (their budget is held)."""
    done_blocks: int = 0
    done_bytes: int = 0
    wait_s: float = 0.0
    """Seconds moves waited before they started (onboard: a request's wait for budget;
    offload: from the offer to the copy), summed."""
    deferred: int = 0
    """Onboards the budget held back at least once (requests); offload flushes it refused."""


@dataclass(frozen=True)
class HostTierStats:
    """Counters of one host tier (monotonic, except the gauges `num_cached`/`num_blocks`)."""

    num_blocks: int
    num_cached: int
    num_offloaded: int
    """Blocks copied device → host."""
    num_onboarded: int
    """Blocks copied host → device for a prefix hit."""
    num_evicted: int
    """Host slots reused for a newer block (LRU)."""
    num_fenced: int
    """Steps that waited on the device for an offload still in flight (an evicted block)."""
    offload_bytes: int
    onboard_bytes: int
    num_pinned: int = 0
    """Slots pinned now (hand-offs lending them, onboards under way): the LRU skips them."""
    num_lent: int = 0
    """Blocks hand-offs lent from here (read by a decode worker from host memory)."""
    onboard: TierMoveStats = TierMoveStats()
    offload: TierMoveStats = TierMoveStats()


@dataclass(frozen=True)
class SplitStatus:
    """A split engine's two loops on one device (engine/core/sm_split.py): how its SMs are
    shared between the prefill and the decode partition, and its in-worker hand-offs."""

    partitioned: bool
    """The loops run in SM partitions of their own (CUDA green contexts); False: both run on
    the whole device, beside each other (CPU, a driver without green contexts)."""
    reason: str
    """Why it is not partitioned ("" when it is)."""
    total_sms: int = 0
    decode_sms: int = 0
    """SMs the decode partition was granted (the driver may grant fewer than asked)."""
    prefill_sms: int = 0
    resizes: int = 0
    """Times the split changed since start."""
    handoffs: int = 0
    """Requests handed from the prefill loop to the decode loop since start."""
    handoff_us_mean: float = 0.0
    handoff_us_max: float = 0.0
    """Host time of one hand-off (a change of block ownership: nothing is copied)."""
    decode_slowdown: float = 1.0
    """The adaptive split's measured decode step time over its prediction from the bandwidth
    curve (measured alone) while the prefill loop runs beside: the contention it sizes the
    decode partition for (vocabulary/split_policy.py `StepCorrection`); 1.0 when unmeasured."""


@dataclass(frozen=True)
class EngineLoad:
    """Snapshot of one engine's load (admission and placement read it)."""

    num_waiting: int
    num_running: int
    num_waiting_prefill_tokens: int
    """Prompt (and recompute) tokens not yet computed, over waiting and running requests."""
    num_free_blocks: int
    num_total_blocks: int
    num_handoff_blocks: int
    """Blocks held for prefill-only hand-offs that are not yet released."""
    num_transfer_blocks: int
    """Blocks reserved for incoming transfers (decode side) not yet turned into requests."""
    num_cache_query_tokens: int
    """Prompt tokens looked up in the prefix cache since start."""
    num_cache_hit_tokens: int
    """Of those, tokens found cached since start."""
    num_preemptions: int
    num_host_hit_tokens: int = 0
    """Of the cache hits, tokens onboarded from the host tier since start."""
    host_tier: HostTierStats | None = None
    """The host KV tier's counters (None: no tier)."""
    steps: StepStats = field(default_factory=StepStats)
    """Step time and batch shape since start (vocabulary/step_stats.py)."""
    loras: tuple[str, ...] = ()
    """Registered LoRA adapters whose weights this engine holds (a device slot or the host
    cache): a request on one starts without a disk read."""
    split: SplitStatus | None = None
    """A split engine's partitions and hand-offs (None: not a split engine)."""


@dataclass(frozen=True)
class LoraInfo:
    """One LoRA adapter registered on an engine (`LLMEngine.list_loras`)."""

    name: str
    path: str
    """The PEFT folder it was registered from."""
    rank: int
    state: str
    """Where its weights are: a value of engine.lora.lora_cache.AdapterState (registered,
    loading, host, uploading, resident, failed)."""


class LoraNotFound(LookupError):
    """The adapter is not registered (or is being unregistered). Here, torch-free, so that
    the router can map it (to NOT_FOUND) when a worker raises it."""


class LoraLoadError(RuntimeError):
    """Reading the adapter from disk failed; it stays failed until unregistered and
    registered again."""
