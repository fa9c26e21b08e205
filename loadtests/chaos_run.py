"""The chaos run: open-loop load on a live cluster while workers are killed, Redis restarts
and clients cancel, then a check that nothing was lost, wrong, hung or leaked.

    calibrate    closed-loop requests measure what the cluster completes per second
    reference    each prompt once, undisturbed (greedy): the tokens every later run must give
    load         Poisson arrivals at `load_multiple` x capacity for `duration_s`; a share of
                 the requests is cancelled after a few tokens, a share gets a short deadline
    faults       every `kill_every_s` a random worker is killed, a decode worker first and
                 then a prefill worker by turns (the controller replaces it; the time until
                 the role is back is measured), and
                 Redis is restarted every `redis_restart_every_s`
    settle       every request has ended; the workers' block pools, transfers and lease
                 tables are read from the workers until they are back at their idle baseline

What the cluster is asked for goes through its gRPC API only; the faults and the idle check
go through a `ChaosTarget` (deploy/cli/chaos_command.py implements it over a local `Cluster`).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import grpc

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

EXPECTED_STATUSES = frozenset(
    {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
)
"""How a request may end under chaos: served, cancelled by its client, past its deadline,
refused by admission, or cut after its migrations ran out. Anything else is a finding."""


class ChaosTarget(Protocol):
    """The faults a chaos run injects and what it reads back from the cluster."""

    def worker_ids(self, role: str) -> list[str]:
        """Ready workers of `role` ("prefill" or "decode")."""
        ...

    def kill_worker(self, worker_id: str) -> None: ...

    def restart_redis(self) -> None: ...

    def busy_workers(self) -> dict[str, str]:
        """Workers not at their idle baseline, each with what it still holds."""
        ...

    def migrations(self) -> float:
        """Migrations the routers counted so far."""
        ...

    def unindexed_workers(self) -> list[str]:
        """Ready workers the Redis prefix index holds no state of (not resynced yet)."""
        ...


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 60.0
    load_multiple: float = 2.0
    """Arrival rate as a multiple of the calibrated capacity (requests/s)."""
    kill_every_s: float = 30.0
    """0: no kills."""
    redis_restart_every_s: float = 0.0
    """0: never."""
    cancel_share: float = 0.1
    deadline_share: float = 0.05
    short_deadline_s: float = 0.5
    num_prompts: int = 16
    prompt_tokens: int = 96
    max_tokens: int = 48
    request_timeout_s: float = 120.0
    """Every other request's deadline; one still running past it (+ grace) is hung."""
    recover_timeout_s: float = 300.0
    settle_timeout_s: float = 120.0
    vocab: tuple[int, int] = (10, 500)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("duration_s", "load_multiple", "request_timeout_s", "short_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("kill_every_s", "redis_restart_every_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.cancel_share + self.deadline_share <= 1:
            raise ValueError("cancel_share + deadline_share: must be within [0, 1]")


@dataclass
class Outcome:
    """One request as its client saw it."""

    prompt: int
    kind: str  # "normal", "cancel" or "deadline"
    sent_s: float
    status: str = ""
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    ended_s: float = 0.0
    deadline_s: float = 0.0
    details: str = ""
    """The error's message, if it ended with one."""


@dataclass(frozen=True)
class Kill:
    role: str
    worker_id: str
    at_s: float
    recovered_s: float | None
    """Seconds until the role had as many ready workers as before (None: never)."""


@dataclass
class ChaosReport:
    capacity_rps: float
    rate_rps: float
    sent: int
    completed: int
    statuses: dict[str, int]
    status_samples: dict[str, list[str]]
    """A few messages of each status but OK: why requests ended as they did."""
    unexpected: dict[str, int]
    """Statuses outside EXPECTED_STATUSES (INTERNAL, UNKNOWN, ...): each a finding."""
    token_mismatches: int
    """Completed requests whose tokens differ from the undisturbed run, plus ended ones
    whose tokens so far are not a prefix of it."""
    mismatch_samples: list[dict[str, Any]]
    """The first few: where each differs from the undisturbed run."""
    hung: int
    """Requests that never ended, ended past their deadline + grace, or ran into the long
    deadline every request without a short one has (it is there only to catch a hang)."""
    migrations: float
    kills: list[Kill]
    redis_restarts: int
    leaked: dict[str, str]
    """Workers still holding blocks, transfers or leases once everything ended."""
    unindexed: list[str]
    """Ready workers whose prefix-index state Redis still lacks at the end (after a restart
    every publisher must resync)."""
    tpot_p50_ms: float
    migration_gap_p50_ms: float | None
    migration_gap_p99_ms: float | None
    """The gap a client saw around a decode-worker kill (the token before it to the next)."""

    @property
    def clean(self) -> bool:
        found = self.unexpected or self.token_mismatches or self.hung or self.leaked
        return not (found or self.unindexed) and all(k.recovered_s is not None for k in self.kills)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "clean": self.clean}


GRACE_S = 5.0


class ChaosRun:
    def __init__(self, target_addr: str, chaos: ChaosTarget, config: ChaosConfig) -> None:
        self.addr = target_addr
        self.target = chaos
        self.config = config
        self.rng = random.Random(config.seed)
        low, high = config.vocab
        self.prompts = [
            [self.rng.randrange(low, high) for _ in range(config.prompt_tokens)]
            for _ in range(config.num_prompts)
        ]
        self.reference: list[list[int]] = []
        self.outcomes: list[Outcome] = []
        self.kills: list[Kill] = []
        self.redis_restarts = 0
        self._t0 = 0.0

    def run(self) -> ChaosReport:
        return asyncio.run(self._run())

    async def _run(self) -> ChaosReport:
        async with grpc.aio.insecure_channel(self.addr) as channel:
            stub = pb_grpc.GenerationStub(channel)
            self.reference = [await self._reference(stub, i) for i in range(len(self.prompts))]
            capacity = await self._calibrate(stub)
            rate = capacity * self.config.load_multiple
            migrations_before = self.target.migrations()
            self._t0 = time.monotonic()
            faults = asyncio.create_task(self._faults())
            try:
                await self._load(stub, rate)
            finally:
                faults.cancel()
                await asyncio.gather(faults, return_exceptions=True)
            await self._await_recovered()
        leaked, unindexed = await self._settle()
        migrations = self.target.migrations() - migrations_before
        return self._report(capacity, rate, migrations, leaked, unindexed)

    # ---- phases -------------------------------------------------------------------------

    async def _reference(self, stub: Any, i: int) -> list[int]:
        out = Outcome(i, "normal", 0.0)
        await self._generate(stub, out, self.config.request_timeout_s, cancel_after=None)
        if out.status != "OK" or len(out.tokens) != self.config.max_tokens:
            raise RuntimeError(f"the undisturbed run of prompt {i} ended {out.status}")
        return out.tokens

    async def _calibrate(self, stub: Any, concurrency: int = 8, seconds: float = 8.0) -> float:
        """Requests/s the cluster completes with `concurrency` clients back to back."""
        done = 0
        end = time.monotonic() + seconds

        async def client(k: int) -> None:
            nonlocal done
            while time.monotonic() < end:
                out = Outcome(k % len(self.prompts), "normal", 0.0)
                await self._generate(stub, out, self.config.request_timeout_s, None)
                done += out.status == "OK"

        t0 = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        return max(done / (time.monotonic() - t0), 0.1)

    async def _load(self, stub: Any, rate: float) -> None:
        cfg = self.config
        tasks: list[asyncio.Task[None]] = []
        end = self._t0 + cfg.duration_s
        while time.monotonic() < end:
            await asyncio.sleep(self.rng.expovariate(rate))
            roll = self.rng.random()
            kind = "cancel" if roll < cfg.cancel_share else (
                "deadline" if roll < cfg.cancel_share + cfg.deadline_share else "normal"
            )  # fmt: skip
            out = Outcome(self.rng.randrange(len(self.prompts)), kind, self._now())
            self.outcomes.append(out)
            timeout = cfg.short_deadline_s if kind == "deadline" else cfg.request_timeout_s
            cancel_after = self.rng.randrange(1, cfg.max_tokens) if kind == "cancel" else None
            tasks.append(asyncio.create_task(self._generate(stub, out, timeout, cancel_after)))
        await asyncio.gather(*tasks)

    async def _faults(self) -> None:
        cfg = self.config
        next_kill = cfg.kill_every_s or float("inf")
        next_redis = cfg.redis_restart_every_s or float("inf")
        while True:
            now = self._now()
            if now >= next_kill:
                next_kill += cfg.kill_every_s
                await self._kill_one()
            if now >= next_redis:
                next_redis += cfg.redis_restart_every_s
                await asyncio.to_thread(self.target.restart_redis)
                self.redis_restarts += 1
            await asyncio.sleep(0.2)

    async def _kill_one(self) -> None:
        role = ("decode", "prefill")[len(self.kills) % 2]  # both roles, decode first
        ready = await asyncio.to_thread(self.target.worker_ids, role)
        if not ready:
            return
        victim = self.rng.choice(ready)
        at = self._now()
        await asyncio.to_thread(self.target.kill_worker, victim)
        self.kills.append(Kill(role, victim, at, None))
        asyncio.get_running_loop().create_task(self._time_recovery(len(self.kills) - 1, ready))

    async def _time_recovery(self, index: int, before: list[str]) -> None:
        kill = self.kills[index]
        end = time.monotonic() + self.config.recover_timeout_s
        while time.monotonic() < end:
            now_ready = await asyncio.to_thread(self.target.worker_ids, kill.role)
            if len(now_ready) >= len(before) and kill.worker_id not in now_ready:
                self.kills[index] = Kill(
                    kill.role, kill.worker_id, kill.at_s, self._now() - kill.at_s
                )
                return
            await asyncio.sleep(0.5)

    async def _await_recovered(self) -> None:
        end = time.monotonic() + self.config.recover_timeout_s
        while time.monotonic() < end and any(k.recovered_s is None for k in self.kills):
            await asyncio.sleep(0.5)

    async def _settle(self) -> tuple[dict[str, str], list[str]]:
        """Wait until no worker holds anything and the index knows every ready worker."""
        end = time.monotonic() + self.config.settle_timeout_s
        while True:
            busy = await asyncio.to_thread(self.target.busy_workers)
            unindexed = await asyncio.to_thread(self.target.unindexed_workers)
            if not (busy or unindexed) or time.monotonic() > end:
                return busy, unindexed
            await asyncio.sleep(0.5)

    # ---- one request --------------------------------------------------------------------

    async def _generate(
        self, stub: Any, out: Outcome, timeout_s: float, cancel_after: int | None
    ) -> None:
        out.deadline_s = out.sent_s + timeout_s
        req = pb.GenerateRequest(
            token_ids=self.prompts[out.prompt], max_tokens=self.config.max_tokens,
            temperature=0.0, ignore_eos=True,
        )  # fmt: skip
        call = stub.Generate(req, timeout=timeout_s)
        try:
            async for msg in call:
                out.tokens.extend(msg.token_ids)
                out.token_times.extend([self._now()] * len(msg.token_ids))
                if cancel_after is not None and len(out.tokens) >= cancel_after:
                    call.cancel()
            out.status = "OK"
        except asyncio.CancelledError:
            out.status = "CANCELLED"
        except grpc.aio.AioRpcError as e:
            out.status, out.details = e.code().name, e.details() or ""
        out.ended_s = self._now()

    def _now(self) -> float:
        return time.monotonic() - self._t0

    # ---- the report ---------------------------------------------------------------------

    def _report(
        self,
        capacity: float,
        rate: float,
        migrations: float,
        leaked: dict[str, str],
        unindexed: list[str] | None = None,
    ) -> ChaosReport:
        statuses = Counter(o.status for o in self.outcomes)
        samples: dict[str, list[str]] = {}
        for o in self.outcomes:
            seen = samples.setdefault(o.status, []) if o.status != "OK" else None
            if seen is not None and len(seen) < 3 and o.details and o.details not in seen:
                seen.append(o.details)
        wrong = [o for o in self.outcomes if _mismatch(o, self.reference[o.prompt])]
        hung = sum(_hung(o) for o in self.outcomes)
        gaps = [
            (b - a) * 1000
            for o in self.outcomes
            for a, b in itertools.pairwise(o.token_times)
            if b > a
        ]
        around_kills = self._migration_gaps()
        return ChaosReport(
            capacity_rps=round(capacity, 3),
            rate_rps=round(rate, 3),
            sent=len(self.outcomes),
            completed=statuses.get("OK", 0),
            statuses=dict(statuses),
            status_samples={k: v for k, v in samples.items() if v},
            unexpected={s: n for s, n in statuses.items() if s not in EXPECTED_STATUSES},
            token_mismatches=len(wrong),
            mismatch_samples=[_difference(o, self.reference[o.prompt]) for o in wrong[:5]],
            hung=hung,
            migrations=migrations,
            kills=self.kills,
            redis_restarts=self.redis_restarts,
            leaked=leaked,
            unindexed=unindexed or [],
            tpot_p50_ms=round(statistics.median(gaps), 2) if gaps else 0.0,
            migration_gap_p50_ms=_percentile(around_kills, 50),
            migration_gap_p99_ms=_percentile(around_kills, 99),
        )

    def _migration_gaps(self) -> list[float]:
        """For each decode kill, the gap each stream running across it saw (ms)."""
        out = []
        for kill in (k for k in self.kills if k.role == "decode"):
            for o in self.outcomes:
                for a, b in itertools.pairwise(o.token_times):
                    if a <= kill.at_s < b:
                        out.append((b - a) * 1000)
        return out


def _mismatch(o: Outcome, ref: list[int]) -> bool:
    """Served: every token of the undisturbed run; ended early: a prefix of it."""
    if o.status == "OK" and o.kind != "cancel":
        return o.tokens != ref
    return o.tokens != ref[: len(o.tokens)]


def _difference(o: Outcome, ref: list[int]) -> dict[str, Any]:
    at = next((i for i, (a, b) in enumerate(zip(o.tokens, ref, strict=False)) if a != b), None)
    if at is None:
        at = min(len(o.tokens), len(ref))
    return {
        "prompt": o.prompt, "kind": o.kind, "status": o.status, "sent_s": round(o.sent_s, 3),
        "first_difference": at, "tokens": len(o.tokens), "expected": len(ref),
        "at_s": round(o.token_times[at], 3) if at < len(o.token_times) else None,
    }  # fmt: skip


def _hung(o: Outcome) -> bool:
    if not o.status or o.ended_s > o.deadline_s + GRACE_S:
        return True
    return o.status == "DEADLINE_EXCEEDED" and o.kind != "deadline"


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))], 1)
