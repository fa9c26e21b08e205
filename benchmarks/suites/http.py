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

Each send has a prompt of its own (random token ids), so no client gets prefix-cache hits. One
request is in flight at a time by default (`--concurrency`), so what differs is the door and the
client, not the queue. All are measured by this process as loadtests/records.py defines it
(benchmarks/harness/ab.py): TTFT from the send to the first message / SSE chunk carrying tokens,
TPOT the mean time per token after the first.

    door overhead (pXX) = pXX(http) - pXX(grpc); paired: p50 over rounds of (http - grpc)

    python -m benchmarks http                       # 200 rounds, prompt 64, 16 tokens
    python -m benchmarks http --rounds 400 --max-tokens 32 --markdown
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import httptools
import httpx2

from benchmarks.harness.ab import GenerateClient, Sample, closed_rounds, stream_sample, summarize
from benchmarks.harness.cluster import local_cluster, tiny_disaggregated
from benchmarks.harness.table import Table
from loadtests.openai_client import SseStream
from loadtests.records import StreamTimer
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

CLIENTS = ("grpc", "http", "httpx2")


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

    def __init__(self, grpc_target: str, http_url: str, model: str, max_tokens: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.http_url = http_url
        self.grpc = GenerateClient(grpc_target)
        host, port = http_url.removeprefix("http://").rsplit(":", 1)
        self.lean = LeanHttp(host, int(port))
        self.httpx2 = httpx2.AsyncClient(timeout=60)

    async def close(self) -> None:
        await self.grpc.close()
        await self.lean.close()
        await self.httpx2.aclose()

    def send(self, client: str, round_: int, prompt: list[int]) -> Awaitable[Sample]:
        if client == "grpc":
            return self.grpc.send(client, round_, prompt, self.max_tokens)
        return {"http": self.http, "httpx2": self.http_httpx2}[client](round_, prompt)

    def _body(self, prompt: list[int]) -> bytes:
        return json.dumps({"model": self.model, "prompt": prompt,
                           "max_tokens": self.max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True,
                           "return_token_ids": True}).encode()  # fmt: skip

    async def http(self, round_: int, prompt: list[int]) -> Sample:
        stream = SseStream(StreamTimer(sent_at=time.perf_counter()))
        status = await self.lean.post(
            "/v1/completions",
            self._body(prompt),
            lambda line: stream.feed(line, time.perf_counter()),
        )
        return self._streamed("http", round_, status, stream)

    async def http_httpx2(self, round_: int, prompt: list[int]) -> Sample:
        stream = SseStream(StreamTimer(sent_at=time.perf_counter()))
        url = self.http_url + "/v1/completions"
        headers = {"content-type": "application/json"}
        body = self._body(prompt)
        async with self.httpx2.stream("POST", url, content=body, headers=headers) as reply:
            async for line in reply.aiter_lines():
                stream.feed(line, time.perf_counter())
        return self._streamed("httpx2", round_, reply.status_code, stream)

    def _streamed(self, client: str, round_: int, status: int, stream: SseStream) -> Sample:
        ended_at = time.perf_counter()
        if status != 200 or stream.error is not None or not stream.done:
            raise RuntimeError(f"{client}: HTTP {status}, {stream.error}")
        return stream_sample(client, round_, stream.timer, ended_at, self.max_tokens)


def table(samples: list[Sample], names: list[str]) -> Table:
    """A line per client: TTFT and TPOT p50, p99, p50 - gRPC's and paired (the gRPC client's
    request of the same round as the baseline; without it, against the client itself)."""
    header = ["client", "TTFT p50", "TTFT p99", "TTFT p50 - gRPC", "paired", "TPOT p50",
              "TPOT p99", "TPOT p50 - gRPC", "paired"]  # fmt: skip
    base = "grpc" if "grpc" in names else None
    ttft, tpot = ({c: summarize(samples, names, base or c, m)[c] for c in names}
                  for m in ("ttft_ms", "tpot_ms"))  # fmt: skip
    rows = []
    for c in names:
        cells = [c]
        for s in (ttft[c], tpot[c]):
            cells += [f"{s.p50:.2f}", f"{s.p99:.2f}", f"{s.minus_base_p50:+.2f}",
                      f"{s.paired_p50:+.2f}"]  # fmt: skip
        rows.append(cells)
    return Table.of(header, rows, "r" * len(header))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200, help="measured rounds (a send per client)")
    ap.add_argument("--warmup", type=int, default=20, help="rounds before measuring")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1, help="rounds in flight at once")
    ap.add_argument("--clients", default=",".join(CLIENTS), help="of " + ", ".join(CLIENTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)
    names = args.clients.split(",")
    if not set(names) <= set(CLIENTS):
        ap.error(f"--clients: of {', '.join(CLIENTS)}")

    with local_cluster(tiny_disaggregated(http_port=0)) as cluster:
        assert cluster.endpoint is not None
        target = cluster.endpoint.target
        with grpc.insecure_channel(cluster.endpoint.admin[0]) as ch:  # the admin plane
            status = pb_grpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=10)

        async def run() -> list[Sample]:
            clients = Clients(target, status.http_url, status.model, args.max_tokens)

            async def rounds(n: int, seed: int, first: int = 0) -> list[Sample]:
                return await closed_rounds(names, clients.send, n, args.prompt_tokens, seed,
                                           first, args.concurrency)  # fmt: skip

            try:
                await rounds(args.warmup, args.seed + 999, first=-args.warmup)
                return await rounds(args.rounds, args.seed)
            finally:
                await clients.close()

        samples = asyncio.run(run())
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
          f"prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
          f"{args.rounds} rounds, concurrency {args.concurrency}; ms")  # fmt: skip
    print(table(samples, names).render(args.markdown))
