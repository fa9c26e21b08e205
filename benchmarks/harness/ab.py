"""The A/B harness of the router suites (router, http, auth_tls, tracing): a timed gRPC
Generate client, the order in which the arms take turns, a closed-loop rounds driver and an
open-loop one, and each arm's figures against a baseline arm.

A round sends one request per arm, each with a prompt of its own (random token ids, so no
prefix-cache hits; greedy; ignore_eos, so every request makes exactly max_tokens tokens), in
an order that rotates from round to round (`rotation`), so every arm sees the machine in the
same states on average. Figures are measured by this process as loadtests/records.py defines
them: TTFT from the send to the first message carrying tokens, TPOT the mean time per token
after the first.

    overhead = p50(arm) - p50(baseline); paired: p50 over rounds of (arm - baseline)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import grpc

from loadtests.records import StreamTimer
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from vocabulary.numeric import percentile

Metric = Literal["ttft_ms", "tpot_ms", "e2e_ms", "server_ttft_ms"]
Metadata = Callable[[], Sequence[tuple[str, str]]]


@dataclass(frozen=True)
class Sample:
    """One request of one arm, as this process timed it (ms)."""

    arm: str
    round: int
    ttft_ms: float
    tpot_ms: float
    """0 for a one-token request."""
    e2e_ms: float
    tokens: int
    server_ttft_ms: float = 0.0
    """The router's own view (`Timings.ttft_ms`: the request entering its orchestrator to the
    first token), where the stream reports it; 0 elsewhere."""
    local_prefill: bool = False
    """The router prefilled the request on its decode worker (`Timings.local_prefill`)."""


def stream_sample(
    arm: str,
    round_: int,
    timer: StreamTimer,
    ended_at: float,
    expected_tokens: int,
    server_ttft_ms: float = 0.0,
    local_prefill: bool = False,
) -> Sample:
    """The sample of one finished stream; RuntimeError unless it made `expected_tokens`."""
    if timer.output_tokens != expected_tokens or timer.ttft_ms is None:
        raise RuntimeError(f"{arm}: {timer.output_tokens} tokens, expected {expected_tokens}")
    return Sample(
        arm,
        round_,
        timer.ttft_ms,
        timer.tpot_ms or 0.0,
        timer.e2e_ms(ended_at),
        timer.output_tokens,
        server_ttft_ms,
        local_prefill,
    )


class GenerateClient:
    """One grpc.aio channel to a router's Generation service, kept open (a TLS handshake
    happens once per connection, as for a gateway's pooled connections)."""

    def __init__(
        self,
        target: str,
        root_certificates: bytes | None = None,
        metadata: Metadata | None = None,
    ) -> None:
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.aio.secure_channel(target, creds)
        else:
            self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = metadata
        """Called before each request: the metadata it carries (keys, a traceparent)."""

    async def send(
        self, arm: str, round_: int, prompt: list[int], max_tokens: int, cache_salt: str = ""
    ) -> Sample:
        """One greedy Generate stream of `max_tokens` tokens (eos ignored), read to its end."""
        req = pb.GenerateRequest(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
            cache_salt=cache_salt,
        )  # fmt: skip
        metadata = tuple(self.metadata()) if self.metadata is not None else None
        timer = StreamTimer(sent_at=time.perf_counter())
        last = None
        async for msg in self.stub.Generate(req, metadata=metadata, timeout=60):
            timer.on_message(time.perf_counter(), len(msg.token_ids))
            last = msg
        ended_at = time.perf_counter()
        if last is None or not last.finish_reason:
            raise RuntimeError(f"{arm}: the stream ended without a finish reason")
        return stream_sample(
            arm, round_, timer, ended_at, max_tokens, last.timings.ttft_ms,
            last.timings.local_prefill,
        )  # fmt: skip

    async def close(self) -> None:
        await self.channel.close()


Send = Callable[[str, int, list[int]], Awaitable[Sample]]
"""(arm, round, prompt) -> the sample of that request."""


def rotation(arms: Sequence[str], round_: int) -> list[str]:
    """The order of the arms in round `round_`: `arms` rotated left by the round number."""
    k = round_ % len(arms)
    return [*arms[k:], *arms[:k]]


def random_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(tokens)]


async def closed_rounds(
    arms: Sequence[str],
    send: Send,
    rounds: int,
    prompt_tokens: int,
    seed: int,
    first_round: int = 0,
    concurrency: int = 1,
    before: Callable[[str], Awaitable[object]] | None = None,
    gap_s: float = 0.0,
) -> list[Sample]:
    """`rounds` rounds (numbered from `first_round`) over `concurrency` workers; a worker
    sends its round's requests one after another in the round's `rotation`. `before(arm)` is
    awaited before each request, outside its timed window, and `gap_s` waited after it."""
    rng = random.Random(seed)
    prompts = [[random_prompt(rng, prompt_tokens) for _ in arms] for _ in range(rounds)]
    queue = deque(range(rounds))
    samples: list[Sample] = []

    async def worker() -> None:
        while queue:
            i = queue.popleft()
            for arm in rotation(arms, i):
                if before is not None:
                    await before(arm)
                samples.append(await send(arm, first_round + i, prompts[i][arms.index(arm)]))
                if gap_s:
                    await asyncio.sleep(gap_s)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def open_loop(
    arms: Sequence[str], send: Send, requests: int, rate: float, prompt_tokens: int, seed: int
) -> list[Sample]:
    """`requests` arrivals, Poisson at `rate` per second, none waiting for another: arrival i
    is request i % len(arms) of round i // len(arms), in the round's `rotation`."""
    rng = random.Random(seed)
    tasks: list[asyncio.Future[Sample]] = []
    for i in range(requests):
        round_, k = divmod(i, len(arms))
        arm = rotation(arms, round_)[k]
        tasks.append(asyncio.ensure_future(send(arm, round_, random_prompt(rng, prompt_tokens))))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


@dataclass(frozen=True)
class ArmSummary:
    """One arm's figures of one metric (ms), against the baseline arm's."""

    arm: str
    n: int
    p50: float
    p90: float
    p99: float
    minus_base_p50: float
    """p50 - the baseline's p50."""
    minus_base_p99: float
    ratio_p50: float
    """p50 / the baseline's p50."""
    paired_p50: float
    """p50 over the rounds both sent in of (this arm's request - the baseline's)."""


def summarize(
    samples: Sequence[Sample], arms: Sequence[str], baseline: str, metric: Metric = "ttft_ms"
) -> dict[str, ArmSummary]:
    """arm -> its summary of `metric`, in the order of `arms`."""
    values = {arm: [s for s in samples if s.arm == arm] for arm in arms}
    base = {s.round: getattr(s, metric) for s in values[baseline]}
    base_p50 = percentile(list(base.values()), 50)
    base_p99 = percentile(list(base.values()), 99)
    out = {}
    for arm, got in values.items():
        xs = [getattr(s, metric) for s in got]
        paired = [getattr(s, metric) - base[s.round] for s in got if s.round in base]
        p50 = percentile(xs, 50)
        out[arm] = ArmSummary(
            arm,
            len(xs),
            p50,
            percentile(xs, 90),
            percentile(xs, 99),
            p50 - base_p50,
            percentile(xs, 99) - base_p99,
            p50 / base_p50 if base_p50 else float("nan"),
            percentile(paired, 50) if paired else float("nan"),
        )
    return out
