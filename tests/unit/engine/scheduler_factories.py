"""Small factories for scheduler tests: requests over a 4-token block size, a scheduler, a
fake step that "runs" a batch by appending a fixed token to every sampled request, and LoRA
slots whose adapters become resident when a test says so."""

from __future__ import annotations

from collections import Counter

from engine.core.request import Request
from engine.core.scheduler import AdapterSlots, Scheduler, SchedulerOutput
from engine.kv.block_pool import BlockPool
from vocabulary.block_hash import hash_extra
from vocabulary.sampling import SamplingParams

BLOCK_SIZE = 4
EXTRA = hash_extra("tiny")


def make_request(
    request_id: str = "r1",
    prompt_len: int = 6,
    *,
    first_token: int = 100,
    max_tokens: int = 16,
    lora_name: str = "",
) -> Request:
    """A request whose prompt is first_token, first_token + 1, ... (distinct per request
    when first_token differs by more than the prompt length), on adapter `lora_name`."""
    prompt = tuple(range(first_token, first_token + prompt_len))
    params = SamplingParams(max_tokens=max_tokens)
    extra = hash_extra("tiny", "", lora_name)
    return Request(request_id, prompt, params, BLOCK_SIZE, extra, lora_name=lora_name)


def make_scheduler(
    num_blocks: int = 16,
    *,
    max_num_seqs: int = 8,
    budget: int = 64,
    chunked: bool = True,
    keep: bool = False,
    caching: bool = True,
    adapters: AdapterSlots | None = None,
) -> Scheduler:
    return Scheduler(
        BlockPool(num_blocks, enable_caching=caching),
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        keep_blocks_on_prefill_finish=keep,
        adapters=adapters,
    )


class FakeSlots:
    """`AdapterSlots` over a fixed name → slot table: an adapter is resident once the test
    puts it in `resident`; `errors` make its acquire raise. Counts acquires and holders."""

    def __init__(self, slots: dict[str, int]) -> None:
        self.slots = slots
        self.resident: set[str] = set()
        self.errors: dict[str, Exception] = {}
        self.num_acquires: Counter[str] = Counter()
        self.refs: Counter[str] = Counter()

    def acquire(self, name: str) -> int | None:
        if name in self.errors:
            raise self.errors[name]
        self.num_acquires[name] += 1
        if name not in self.resident:
            return None
        self.refs[name] += 1
        return self.slots[name]

    def release(self, name: str) -> None:
        assert self.refs[name] > 0, f"{name} released more often than acquired"
        self.refs[name] -= 1

    def held(self) -> dict[str, int]:
        return {name: n for name, n in self.refs.items() if n}


def run_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """schedule(), then what the engine does after the model ran: cache the computed full
    blocks and append `token` to every request whose chunk was sampled."""
    out = scheduler.schedule()
    for chunk in out.batch.chunks:
        request = scheduler.requests[chunk.request_id]
        scheduler.cache_computed_blocks(request)
        if chunk.sample:
            request.append_output(token, None)
    return out


def chunk_view(out: SchedulerOutput) -> list[tuple[str, int, int, tuple[int, ...], bool]]:
    """(request id, start_pos, num_tokens, block_ids, sample) per chunk, in batch order."""
    return [
        (c.request_id, c.start_pos, c.num_tokens, c.block_ids, c.sample) for c in out.batch.chunks
    ]
