"""The OpenAI HTTP door vs the gRPC door: TTFT and TPOT through each, side by side in one run
on one cluster and one request stream, on this machine.

A 1P1D cluster (tiny model, CPU) is started in-script with local_prefill_threshold_tokens=0,
so every request takes the disaggregated path (router → prefill actor → decode actor). The
request stream is a sequence of rounds: the same shape (prompt length, max_tokens, greedy,
ignore_eos) sent once through each client, in an order that rotates from round to round:

    grpc    grpc.aio, the Generate stream (gRPC's C core on both ends)
    http    a streaming /v1/completions with return_token_ids, over a lean client: one
            kept-alive connection, one write per request, the response parsed by httptools
            (the C parser uvicorn itself uses), so the client costs about what grpc.aio does
            and the difference is the server's door
    httpx2  the same request over httpx2, the openai SDK's transport (pure-Python HTTP/1.1 on
            anyio): what an SDK user pays on top, client side

Each send has a prompt of its own (random token ids), so no client gets prefix-cache hits.
One request is in flight at a time by default (`--concurrency`), so what differs is the door
and the client, not the queue. All are measured by this process as loadtests/records.py
defines it: TTFT from the send to the first message / SSE chunk carrying tokens, TPOT the
mean time per token after the first.

    door overhead (pXX) = pXX(http) - pXX(grpc); paired: p50 over rounds of (http - grpc)

    python benchmarks/bench_http.py                       # 200 rounds, prompt 64, 16 tokens
    python benchmarks/bench_http.py --rounds 400 --max-tokens 32 --markdown
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import httptools
import httpx2

from loadtests.openai_client import SseStream
from loadtests.records import StreamTimer
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from vocabulary.numeric import percentile

CLIENTS = ("grpc", "http", "httpx2")


@dataclass(frozen=True)
class Sample:
    client: str
    round: int
    ttft_ms: float
    tpot_ms: float
    tokens: int


class LeanHttp:
    """Kept-alive HTTP/1.1 connections (one per request in flight): a request is one write,
    its streamed response is parsed by httptools as it arrives, each body line going to
    `on_line`."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._all: list[asyncio.StreamWriter] = []

    async def post(self, path: str, body: bytes, on_line: Callable[[bytes], object]) -> int:
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._all.append(writer)
        head = (f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json"
                f"\r\ncontent-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        writer.write(head + body)
        response = _Response(on_line)
        parser = httptools.HttpResponseParser(response)
        while not response.complete:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            parser.feed_data(data)
        self._idle.append((reader, writer))
        return parser.get_status_code()

    async def close(self) -> None:
        for writer in self._all:
            writer.close()
            await writer.wait_closed()


class _Response:
    """httptools callbacks: body bytes split into lines as they arrive."""

    def __init__(self, on_line: Callable[[bytes], object]) -> None:
        self.on_line = on_line
        self.pending = b""
        self.complete = False

    def on_body(self, data: bytes) -> None:
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            self.on_line(line)

    def on_message_complete(self) -> None:
        if self.pending:
            self.on_line(self.pending)
        self.complete = True


class Clients:
    """The three clients, to one router."""

    def __init__(self, grpc_target: str, http_url: str, model: str, args: argparse.Namespace):
        self.args = args
        self.model = model
        self.http_url = http_url
        self.channel = grpc.aio.insecure_channel(grpc_target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        host, port = http_url.removeprefix("http://").rsplit(":", 1)
        self.lean = LeanHttp(host, int(port))
        self.httpx2 = httpx2.AsyncClient(timeout=60)

    async def close(self) -> None:
        await self.channel.close()
        await self.lean.close()
        await self.httpx2.aclose()

    def send(self, client: str) -> Callable[[list[int], int], Awaitable[Sample]]:
        return {"grpc": self.grpc, "http": self.http, "httpx2": self.http_httpx2}[client]

    async def grpc(self, prompt: list[int], round_: int) -> Sample:
        req = pb.GenerateRequest(token_ids=prompt, max_tokens=self.args.max_tokens,
                                 temperature=0.0, ignore_eos=True)  # fmt: skip
        timer = StreamTimer(sent_at=time.perf_counter())
        async for msg in self.stub.Generate(req, timeout=60):
            timer.on_message(time.perf_counter(), len(msg.token_ids))
        return _sample("grpc", round_, timer, self.args.max_tokens)

    def _body(self, prompt: list[int]) -> bytes:
        return json.dumps({"model": self.model, "prompt": prompt,
                           "max_tokens": self.args.max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True,
                           "return_token_ids": True}).encode()  # fmt: skip

    async def http(self, prompt: list[int], round_: int) -> Sample:
        stream = SseStream(StreamTimer(sent_at=time.perf_counter()))
        status = await self.lean.post(
            "/v1/completions",
            self._body(prompt),
            lambda line: stream.feed(line, time.perf_counter()),
        )
        return _streamed("http", round_, status, stream, self.args.max_tokens)

    async def http_httpx2(self, prompt: list[int], round_: int) -> Sample:
        stream = SseStream(StreamTimer(sent_at=time.perf_counter()))
        url = self.http_url + "/v1/completions"
        headers = {"content-type": "application/json"}
        body = self._body(prompt)
        async with self.httpx2.stream("POST", url, content=body, headers=headers) as reply:
            async for line in reply.aiter_lines():
                stream.feed(line, time.perf_counter())
        return _streamed("httpx2", round_, reply.status_code, stream, self.args.max_tokens)


def _streamed(client: str, round_: int, status: int, stream: SseStream, expected: int) -> Sample:
    if status != 200 or stream.error is not None or not stream.done:
        raise RuntimeError(f"{client}: HTTP {status}, {stream.error}")
    return _sample(client, round_, stream.timer, expected)


def _sample(client: str, round_: int, timer: StreamTimer, expected: int) -> Sample:
    if timer.output_tokens != expected or timer.ttft_ms is None or timer.tpot_ms is None:
        raise RuntimeError(f"{client}: {timer.output_tokens} tokens, expected {expected}")
    return Sample(client, round_, timer.ttft_ms, timer.tpot_ms, timer.output_tokens)


async def run_rounds(clients: Clients, first: int, rounds: int, seed: int) -> list[Sample]:
    """`rounds` rounds over `--concurrency` workers; each worker sends its rounds one after
    another, a round's sends back to back (the client that goes first rotating)."""
    rng = random.Random(seed)
    names = clients.args.clients
    prompts = [
        [[rng.randrange(3, 500) for _ in range(clients.args.prompt_tokens)] for _ in names]
        for _ in range(rounds)
    ]
    queue = list(range(rounds))
    samples: list[Sample] = []

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            for k in range(len(names)):
                j = (i + k) % len(names)
                samples.append(await clients.send(names[j])(prompts[i][j], first + i))

    await asyncio.gather(*(worker() for _ in range(clients.args.concurrency)))
    return samples


def summarize(samples: list[Sample], names: list[str]) -> dict[str, float]:
    by = {c: [s for s in samples if s.client == c] for c in names}
    row: dict[str, float] = {"rounds": float(len(by[names[0]]))}
    for metric in ("ttft_ms", "tpot_ms"):
        base = {s.round: getattr(s, metric) for s in by.get("grpc", [])}
        for client, got in by.items():
            values = [getattr(s, metric) for s in got]
            row[f"{client}_{metric}_p50"] = percentile(values, 50)
            row[f"{client}_{metric}_p99"] = percentile(values, 99)
            if base:
                paired = [getattr(s, metric) - base[s.round] for s in got]
                row[f"{client}_{metric}_paired"] = percentile(paired, 50)
    return row


def print_table(row: dict[str, float], names: list[str], markdown: bool) -> None:
    header = ["client", "TTFT p50", "TTFT p99", "TTFT p50 - gRPC", "paired", "TPOT p50",
              "TPOT p99", "TPOT p50 - gRPC", "paired"]  # fmt: skip
    lines = []
    for c in names:
        cells = [c]
        for m in ("ttft_ms", "tpot_ms"):
            p50, p99 = row[f"{c}_{m}_p50"], row[f"{c}_{m}_p99"]
            diff = p50 - row.get(f"grpc_{m}_p50", p50)
            paired = row.get(f"{c}_{m}_paired", 0.0)
            cells += [f"{p50:.2f}", f"{p99:.2f}", f"{diff:+.2f}", f"{paired:+.2f}"]
        lines.append(cells)
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(header)]
    for r in (header, *lines):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200, help="measured rounds (a send per client)")
    ap.add_argument("--warmup", type=int, default=20, help="rounds before measuring")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1, help="rounds in flight at once")
    ap.add_argument("--clients", default=",".join(CLIENTS), help="of " + ", ".join(CLIENTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args()
    args.clients = args.clients.split(",")
    if not set(args.clients) <= set(CLIENTS):
        ap.error(f"--clients: of {', '.join(CLIENTS)}")

    from bench_cluster import tiny_disaggregated

    from deploy.control.launch import Cluster, loopback_env

    loopback_env()
    options = tiny_disaggregated(http_port=0)
    with Cluster(options) as cluster:
        assert cluster.endpoint is not None
        target = cluster.endpoint.target
        with grpc.insecure_channel(cluster.endpoint.admin[0]) as ch:  # the admin plane
            status = pb_grpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=10)

        async def run() -> list[Sample]:
            clients = Clients(target, status.http_url, status.model, args)
            try:
                await run_rounds(clients, -args.warmup, args.warmup, seed=args.seed + 999)
                return await run_rounds(clients, 0, args.rounds, seed=args.seed)
            finally:
                await clients.close()

        samples = asyncio.run(run())
    row = summarize(samples, args.clients)
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
          f"prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
          f"{args.rounds} rounds, concurrency {args.concurrency}; ms")  # fmt: skip
    print_table(row, args.clients, args.markdown)


if __name__ == "__main__":
    main()
