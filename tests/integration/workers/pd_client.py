"""Drive worker actors the way the router does (prefill → hand-off → decode stream), with a
timeout on every wait, and read their load until it is back at the idle baseline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ray

from vocabulary.decode_api import DecodeRequest, TokenChunk
from vocabulary.prefill_api import PrefillRequest, PrefillResult
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import WorkerLoad

NUM_KV_BLOCKS = 256
CALL_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 20.0
"""Below the fixture's lease_s (30 s): a lease that only ends by expiring fails the wait."""

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def greedy(max_tokens: int = 16, **overrides: Any) -> SamplingParams:
    return replace(GREEDY, max_tokens=max_tokens, **overrides)


@dataclass
class Served:
    """What a caller saw of one request: the prefill result (None for local prefill) and
    every chunk of the decode stream."""

    prefill: PrefillResult | None
    chunks: list[TokenChunk]

    @property
    def token_ids(self) -> list[int]:
        first = [self.prefill.first_token_id] if self.prefill is not None else []
        return first + [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        first = self.prefill.first_text if self.prefill is not None else ""
        return first + "".join(c.text for c in self.chunks)


async def prefill(
    p: Any,
    rid: str,
    prompt: list[int],
    sampling: SamplingParams,
    cache_salt: str = "",
    lora: str = "",
) -> PrefillResult:
    req = PrefillRequest(rid, tuple(prompt), sampling, cache_salt=cache_salt, lora=lora)
    return await asyncio.wait_for(p.prefill.remote(req), CALL_TIMEOUT_S)


def decode_request(
    rid: str,
    prompt: list[int],
    sampling: SamplingParams,
    result: PrefillResult | None = None,
    cache_salt: str = "",
    lora: str = "",
) -> DecodeRequest:
    return DecodeRequest(
        rid,
        tuple(prompt),
        sampling,
        cache_salt=cache_salt,
        lora=lora,
        handle=result.handle if result is not None else None,
        first_token_id=result.first_token_id if result is not None else None,
        first_logprob=result.first_logprob if result is not None else None,
    )


def open_stream(d: Any, req: DecodeRequest) -> Any:
    return d.generate.options(num_returns="streaming").remote(req)


async def next_chunk(gen: Any, timeout_s: float = CALL_TIMEOUT_S) -> TokenChunk | None:
    """The stream's next chunk, None at its end; raises the worker's error."""

    async def one() -> TokenChunk | None:
        try:
            ref = await gen.__anext__()
        except StopAsyncIteration:
            return None
        return await ref

    return await asyncio.wait_for(one(), timeout_s)


async def consume(gen: Any, timeout_s: float = CALL_TIMEOUT_S) -> list[TokenChunk]:
    chunks: list[TokenChunk] = []
    while (chunk := await next_chunk(gen, timeout_s)) is not None:
        chunks.append(chunk)
    return chunks


async def serve(
    p: Any | None,
    d: Any,
    rid: str,
    prompt: list[int],
    sampling: SamplingParams,
    cache_salt: str = "",
    lora: str = "",
) -> Served:
    """Prefill on `p` and decode on `d` (or prefill locally on `d` when `p` is None), on
    LoRA adapter `lora` ("": the base model)."""
    result = None
    if p is not None:
        result = await prefill(p, rid, prompt, sampling, cache_salt, lora)
        if result.handle is None:  # ended on its first token
            return Served(result, [])
    gen = open_stream(d, decode_request(rid, prompt, sampling, result, cache_salt, lora))
    return Served(result, await consume(gen))


def load(actor: Any) -> WorkerLoad:
    return ray.get(actor.load.remote(), timeout=CALL_TIMEOUT_S)


def is_idle(w: WorkerLoad) -> bool:
    """Nothing held: every block allocatable (free or evictable cache entries), no lease, no
    transfer, no request."""
    e = w.engine
    return (
        e.num_free_blocks == e.num_total_blocks == NUM_KV_BLOCKS
        and e.num_handoff_blocks == 0
        and e.num_transfer_blocks == 0
        and e.num_running == 0
        and e.num_waiting == 0
        and w.inflight_requests == 0
        and w.leases_held == 0
        and w.leased_blocks == 0
        and w.transfer.pending_blocks == 0
        and w.transfer.queued_transfers == 0
    )


def wait_until(
    actor: Any, predicate: Callable[[WorkerLoad], bool], timeout_s: float, what: str
) -> WorkerLoad:
    deadline = time.monotonic() + timeout_s
    while True:
        w = load(actor)
        if predicate(w):
            return w
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s: {w}")
        time.sleep(0.05)


def wait_idle(*actors: Any, timeout_s: float = IDLE_TIMEOUT_S) -> list[WorkerLoad]:
    """Poll each actor's load until it is back at the idle baseline (AssertionError if not)."""
    return [wait_until(a, is_idle, timeout_s, "idle baseline") for a in actors]


async def wait_idle_async(*actors: Any, timeout_s: float = IDLE_TIMEOUT_S) -> list[WorkerLoad]:
    return await asyncio.to_thread(wait_idle, *actors, timeout_s=timeout_s)
