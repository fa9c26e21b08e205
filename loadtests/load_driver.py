"""The headless load driver: the same workload and records as the Locust users, on asyncio +
grpc.aio (or httpx2 for the OpenAI HTTP API), for machines without Locust/gevent (the GPU
benchmark) and for quick runs.

Open loop: each request is started as its own task at its scheduled time, whatever the
completions do; a conversation's next turn waits for its previous turn (plus think time).

    python -m loadtests.driver --target HOST:PORT --profile synthetic --rate 4 \
        --duration 30 --out records.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from loadtests.grpc_request import RpcFailure, finish_record, rpc_failure, to_proto
from loadtests.records import RecordSink, RequestRecord, StreamTimer
from loadtests.runspec import RunSpec
from loadtests.workload import PlannedRequest
from pdserve.v1 import serving_pb2, serving_pb2_grpc


async def _send(
    stub: serving_pb2_grpc.GenerationStub,
    planned: PlannedRequest,
    *,
    run_start: float,
    offered_rate: float | None,
    timeout_s: float,
) -> RequestRecord:
    timer = StreamTimer(sent_at=time.perf_counter())
    last: serving_pb2.GenerateResponse | None = None
    failure: RpcFailure | None = None
    try:
        call = stub.Generate(to_proto(planned), timeout=timeout_s)
        async for response in call:
            timer.on_message(time.perf_counter(), len(response.token_ids))
            last = response
    except grpc.RpcError as e:
        failure = rpc_failure(e)
    except Exception as e:  # a client-side fault still yields a record, never a lost request
        failure = RpcFailure("CLIENT_ERROR", repr(e))
    return finish_record(
        planned,
        timer,
        run_start=run_start,
        ended_at=time.perf_counter(),
        offered_rate=offered_rate,
        last=last,
        failure=failure,
    )


Sender = Callable[[PlannedRequest, float], Awaitable[RequestRecord]]
"""Sends one planned request (given the run's start on the perf_counter clock) and returns
its record."""


async def open_loop(
    planned: Sequence[PlannedRequest], send: Sender, sink: RecordSink | None = None
) -> list[RequestRecord]:
    """Start each request at its scheduled time (a conversation's next turn once its previous
    turn completed, plus think time); one record per request, in completion order."""
    records: list[RequestRecord] = []
    done = {p.index: asyncio.Event() for p in planned}
    done_at: dict[int, float] = {}
    run_start = time.perf_counter()

    async def sleep_until(offset_s: float) -> None:
        delay = run_start + offset_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def send_one(p: PlannedRequest) -> None:
        try:
            if p.after is not None:
                await done[p.after].wait()
                await sleep_until(max(p.send_at_s, done_at[p.after] + p.think_s))
            record = await send(p, run_start)
            records.append(record)
            if sink is not None:
                sink.write(record)
        finally:
            done_at[p.index] = time.perf_counter() - run_start
            done[p.index].set()

    tasks = []
    for p in planned:
        await sleep_until(p.send_at_s)
        tasks.append(asyncio.create_task(send_one(p)))
    await asyncio.gather(*tasks)
    return records


async def run_planned(
    target: str,
    planned: Sequence[PlannedRequest],
    *,
    offered_rate: float | None = None,
    timeout_s: float = 300.0,
    sink: RecordSink | None = None,
    api: str = "grpc",
) -> list[RequestRecord]:
    """Send `planned` to `target` open-loop: a gRPC host:port, or with `api="openai"` the base
    URL of an OpenAI-compatible HTTP API (loadtests/openai_driver.py)."""
    if api == "openai":
        from loadtests.openai_driver import OpenAISender

        async with OpenAISender(target, offered_rate, timeout_s) as send_http:
            return await open_loop(planned, send_http, sink)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = serving_pb2_grpc.GenerationStub(channel)

        async def send(p: PlannedRequest, run_start: float) -> RequestRecord:
            return await _send(
                stub, p, run_start=run_start, offered_rate=offered_rate, timeout_s=timeout_s
            )

        return await open_loop(planned, send, sink)


def run_spec(target: str, spec: RunSpec, api: str = "grpc") -> list[RequestRecord]:
    """Run one RunSpec to completion (blocking); records also go to `spec.records_path`."""
    sink = RecordSink(spec.records)
    try:
        return asyncio.run(
            run_planned(
                target,
                spec.plan(),
                offered_rate=spec.rate,
                timeout_s=spec.request_timeout_s,
                sink=sink,
                api=api,
            )
        )
    finally:
        sink.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Send a workload profile to pdserve (asyncio).")
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--profile", default="synthetic")
    parser.add_argument("--rate", type=float, required=True, help="requests/s")
    parser.add_argument("--duration", type=float, default=30.0, help="arrival window, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request deadline, s")
    parser.add_argument("--out", type=Path, required=True, help="records JSONL (appended)")
    args = parser.parse_args(argv)
    spec = RunSpec(
        profile=args.profile,
        rate=args.rate,
        duration_s=args.duration,
        seed=args.seed,
        num_requests=args.num_requests,
        records_path=str(args.out),
        request_timeout_s=args.timeout,
    )
    records = run_spec(args.target, spec)
    failed = sum(1 for r in records if not r.ok)
    print(f"{len(records)} requests ({failed} failed) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
