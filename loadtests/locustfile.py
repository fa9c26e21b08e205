"""Locust users for pdserve's streaming `Generate` (gevent-compatible gRPC).

`OpenLoopUser` (run it with `-u 1`): sends the workload of `RunSpec` (env var
PDSERVE_BENCH_SPEC, set by `loadtests.bench`) open-loop: every request starts in its own
greenlet at its scheduled time, whatever the completions do (a conversation's next turn waits
for the previous turn). When the last request has finished the run stops by itself.
`ClosedLoopUser`: each user sends the workload's requests one after another (`-u N` users).

Per request, separate Locust request events (type "grpc"): TTFT, TPOT, ITL (per gap between
streamed messages), E2E (response_length = output tokens) and `tokens/output` and
`tokens/prompt` (their "response time" column is the token count), so Locust's stats, CSV and
HTML report show them. A failure is one E2E failure whose error is the gRPC status code.
Records go to the RunSpec's JSONL file as well.

    PDSERVE_BENCH_SPEC=... locust -f loadtests/locustfile.py --headless -u 1 --host HOST:PORT \
        OpenLoopUser
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import gevent
import grpc
import grpc.experimental.gevent as grpc_gevent
from gevent.event import Event
from gevent.pool import Group
from locust import User, constant, task

from loadtests.grpc_request import RpcFailure, finish_record, rpc_failure, to_proto
from loadtests.records import RecordSink, RequestRecord, StreamTimer
from loadtests.runspec import RunSpec
from loadtests.workload import PlannedRequest
from pdserve.v1 import serving_pb2_grpc

# Required before any channel exists: otherwise every gRPC stream deadlocks under gevent and
# Locust's `-t` never stops the run.
grpc_gevent.init_gevent()


class GrpcStatusError(Exception):
    """A failed call, named by its gRPC status code (Locust groups failures by message)."""


class _GrpcUser(User):
    abstract = True

    def on_start(self) -> None:
        self.spec = RunSpec.from_env()
        self.planned = self.spec.plan()
        self.channel = grpc.insecure_channel(self.host)
        self.stub = serving_pb2_grpc.GenerationStub(self.channel)
        self.sink = RecordSink(self.spec.records)

    def on_stop(self) -> None:
        self.channel.close()
        self.sink.close()

    def _fire(self, name: str, value: float, length: int = 0, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type="grpc",
            name=name,
            response_time=value,
            response_length=length,
            exception=exc,
            context={},
        )

    def send(self, planned: PlannedRequest, run_start: float) -> RequestRecord:
        """One streaming call, measured, reported to Locust and to the records file."""
        timer = StreamTimer(sent_at=time.perf_counter())
        last: Any = None
        failure: RpcFailure | None = None
        try:
            stream = self.stub.Generate(to_proto(planned), timeout=self.spec.request_timeout_s)
            for response in stream:
                if timer.on_message(time.perf_counter(), len(response.token_ids)):
                    self._fire("TTFT", timer.ttft_ms or 0.0)
                last = response
        except grpc.RpcError as e:
            failure = rpc_failure(e)
        except Exception as e:  # a client-side fault still yields a record, never a lost request
            failure = RpcFailure("CLIENT_ERROR", repr(e))
        record = finish_record(
            planned,
            timer,
            run_start=run_start,
            ended_at=time.perf_counter(),
            offered_rate=self.spec.rate,
            last=last,
            failure=failure,
        )
        self._report(record)
        self.sink.write(record)
        return record

    def _report(self, record: RequestRecord) -> None:
        if not record.ok:
            error = GrpcStatusError(record.status)
            self._fire("E2E", record.e2e_ms, record.output_tokens, error)
            return
        if record.tpot_ms is not None:
            self._fire("TPOT", record.tpot_ms)
        if self.spec.itl_events:
            for gap in record.itl_ms:
                self._fire("ITL", gap)
        self._fire("E2E", record.e2e_ms, record.output_tokens)
        self._fire("tokens/output", record.output_tokens, record.output_tokens)
        self._fire("tokens/prompt", record.prompt_tokens, record.prompt_tokens)


class OpenLoopUser(_GrpcUser):
    """Sends the whole workload at its scheduled times, then stops the run."""

    fixed_count = 1
    wait_time = constant(0)

    @task
    def run_workload(self) -> None:
        if getattr(self, "finished", False):
            gevent.sleep(1.0)  # the runner is quitting
            return
        run_start = time.perf_counter()
        done = {p.index: Event() for p in self.planned}
        done_at: dict[int, float] = {}

        def send_one(planned: PlannedRequest) -> None:
            try:
                if planned.after is not None:
                    done[planned.after].wait()
                    ready = max(planned.send_at_s, done_at[planned.after] + planned.think_s)
                    gevent.sleep(max(0.0, run_start + ready - time.perf_counter()))
                self.send(planned, run_start)
            finally:
                done_at[planned.index] = time.perf_counter() - run_start
                done[planned.index].set()

        in_flight = Group()
        for planned in self.planned:
            delay = run_start + planned.send_at_s - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            in_flight.spawn(send_one, planned)
        in_flight.join()
        self.finished = True
        runner = self.environment.runner
        if runner is not None:
            gevent.spawn_later(0.1, runner.quit)


_next_request = itertools.count()
_closed_loop_start: list[float] = []


class ClosedLoopUser(_GrpcUser):
    """Each user sends the next request of the workload as soon as its previous one is done
    (send times are ignored; stop the run with `-t`)."""

    wait_time = constant(0)

    @task
    def next_request(self) -> None:
        if not _closed_loop_start:
            _closed_loop_start.append(time.perf_counter())
        index = next(_next_request)
        if index >= len(self.planned):
            gevent.sleep(1.0)
            return
        self.send(self.planned[index], _closed_loop_start[0])
