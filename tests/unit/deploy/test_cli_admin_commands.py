"""drain, undrain, rebalance, switch and status through the CLI against a scripted Admin server on
loopback (no cluster): what each sends, what it prints and its exit code; bad values refused
before any RPC; the server's refusals printed as one line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from deploy.cli.app import app
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

Reply = Callable[[Any, grpc.ServicerContext], Any]


class ScriptedAdmin(pb_grpc.AdminServicer):
    """Records every request; answers with the reply set for its method (an exception-free
    default otherwise). A reply may abort the call with a status code."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.replies: dict[str, Reply] = {}

    def _answer(
        self, method: str, request: Any, context: grpc.ServicerContext, default: Any
    ) -> Any:
        self.requests.append((method, request))
        reply = self.replies.get(method)
        return reply(request, context) if reply else default

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._answer("Status", request, context, pb.ClusterStatus(model="tiny"))

    def Drain(self, request: Any, context: grpc.ServicerContext) -> Any:
        default = pb.DrainResponse(
            worker_id=request.worker_id, drained=True, message=f"{request.worker_id} drained"
        )
        return self._answer("Drain", request, context, default)

    def Undrain(self, request: Any, context: grpc.ServicerContext) -> Any:
        default = pb.UndrainResponse(
            worker_id=request.worker_id, message=f"{request.worker_id} is admitting again"
        )
        return self._answer("Undrain", request, context, default)

    def Rebalance(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._answer("Rebalance", request, context, pb.RebalanceResponse(message="ok"))

    def Switch(self, request: Any, context: grpc.ServicerContext) -> Any:
        default = pb.SwitchResponse(
            worker_id=request.worker_id, switched=True, role=request.role,
            message=f"{request.worker_id} switched to {request.role}",
        )  # fmt: skip
        return self._answer("Switch", request, context, default)

    def LoadLora(self, request: Any, context: grpc.ServicerContext) -> Any:
        adapter = pb.LoraAdapter(name=request.name, path=request.path, rank=8,
                                 workers=["d0", "p0"], loaded_on=["p0"])  # fmt: skip
        default = pb.LoraStatus(adapters=[adapter], message=f"loaded {request.name!r}")
        return self._answer("LoadLora", request, context, default)

    def UnloadLora(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._answer("UnloadLora", request, context, pb.LoraStatus(message="unloaded"))

    def ListLoras(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._answer("ListLoras", request, context, pb.LoraStatus())


def abort(code: grpc.StatusCode, details: str) -> Reply:
    def reply(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    return reply


@pytest.fixture
def admin() -> Iterator[tuple[ScriptedAdmin, str]]:
    servicer = ScriptedAdmin()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def cli(target: str, *args: str) -> Any:
    return CliRunner().invoke(app, [*args, "--target", target], env={"COLUMNS": "200"})


# ---- drain / undrain ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"), [("-5", "-5.0"), ("nan", "nan"), ("inf", "inf"), ("-inf", "-inf")]
)
def test_drain_refuses_a_timeout_that_is_negative_or_not_finite_before_any_rpc(
    admin: tuple[ScriptedAdmin, str], value: str, shown: str
) -> None:
    servicer, target = admin
    result = cli(target, "drain", "decode-0", "--timeout", value)
    assert result.exit_code == 2
    assert result.output == f"error: --timeout: must be a finite number >= 0, got {shown}\n"
    assert servicer.requests == []


def test_drain_without_a_timeout_leaves_the_servers_default(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    result = cli(target, "drain", "decode-0")
    assert (result.exit_code, result.output) == (0, "decode-0 drained\n")
    ((method, request),) = servicer.requests
    assert method == "Drain" and request.worker_id == "decode-0"
    assert not request.HasField("timeout_s")
    assert (request.stop, request.force) == (True, False)


def test_drain_sends_timeout_zero_force_and_no_stop(admin: tuple[ScriptedAdmin, str]) -> None:
    servicer, target = admin
    result = cli(target, "drain", "prefill-1", "--timeout", "0", "--force", "--no-stop")
    assert result.exit_code == 0, result.output
    ((_, request),) = servicer.requests
    assert request.HasField("timeout_s") and request.timeout_s == 0.0
    assert (request.stop, request.force) == (False, True)


def test_drain_that_did_not_finish_prints_the_servers_message_and_exits_1(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    message = "decode-0 not drained after 5s: 2 of 3 requests cut; stopped"
    servicer.replies["Drain"] = lambda request, context: pb.DrainResponse(
        worker_id="decode-0", drained=False, message=message, requests_at_start=3,
        requests_cut=2, stopped=True,
    )  # fmt: skip
    result = cli(target, "drain", "decode-0", "--timeout", "5")
    assert (result.exit_code, result.output) == (1, message + "\n")


@pytest.mark.parametrize(
    ("command", "method"), [(["drain", "decode-9"], "Drain"), (["undrain", "decode-9"], "Undrain")]
)
@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION])
def test_the_servers_refusal_is_one_line_and_exit_1(
    admin: tuple[ScriptedAdmin, str], command: list[str], method: str, code: grpc.StatusCode
) -> None:
    servicer, target = admin
    servicer.replies[method] = abort(code, "decode-9: no such worker\n(see `pdserve status`)")
    result = cli(target, *command)
    assert result.exit_code == 1
    assert result.output == (
        f"error: {code.name}: decode-9: no such worker (see `pdserve status`)\n"
    )


def test_undrain_sends_the_worker_and_prints_the_answer(admin: tuple[ScriptedAdmin, str]) -> None:
    servicer, target = admin
    result = cli(target, "undrain", "decode-2")
    assert (result.exit_code, result.output) == (0, "decode-2 is admitting again\n")
    ((method, request),) = servicer.requests
    assert (method, request.worker_id) == ("Undrain", "decode-2")


def test_undrain_and_drain_force_are_in_the_help() -> None:
    undrain = CliRunner().invoke(app, ["undrain", "--help"], env={"COLUMNS": "200"})
    assert undrain.exit_code == 0 and "back into service" in undrain.output
    drain = CliRunner().invoke(app, ["drain", "--help"], env={"COLUMNS": "200"})
    assert "--force" in drain.output and "--timeout" in drain.output
    assert "undrain" in CliRunner().invoke(app, ["--help"]).output


# ---- rebalance ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--prefill", "-1", "--decode", "1"], "--prefill: must be >= 0, got -1"),
        (["--prefill", "1", "--decode", "0"], "--decode: must be >= 1, got 0"),
        (["--prefill", "1", "--decode", "1", "--timeout", "-1"],
         "--timeout: must be a finite number >= 0, got -1.0"),
        (["--prefill", "1", "--decode", "1", "--timeout", "nan"],
         "--timeout: must be a finite number >= 0, got nan"),
    ],
)  # fmt: skip
def test_rebalance_refuses_bad_counts_and_timeouts_before_any_rpc(
    admin: tuple[ScriptedAdmin, str], args: list[str], line: str
) -> None:
    servicer, target = admin
    result = cli(target, "rebalance", *args)
    assert (result.exit_code, result.output) == (2, f"error: {line}\n")
    assert servicer.requests == []


def test_rebalance_to_no_prefill_workers_is_sent(admin: tuple[ScriptedAdmin, str]) -> None:
    servicer, target = admin
    result = cli(target, "rebalance", "--prefill", "0", "--decode", "2", "--timeout", "0")
    assert result.exit_code == 0, result.output
    ((_, request),) = servicer.requests
    assert (request.prefill, request.decode, request.timeout_s) == (0, 2, 0.0)


def test_rebalance_restart_is_sent_and_what_it_did_is_printed(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    servicer.replies["Rebalance"] = lambda r, c: pb.RebalanceResponse(
        started=["decode-4"], stopped=["prefill-1"], message="now 1 prefill + 2 decode (...)"
    )
    result = cli(target, "rebalance", "--prefill", "1", "--decode", "2", "--restart")
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()) == (  # rich wraps at the console's width
        "now 1 prefill + 2 decode (...); switched [], started ['decode-4'], stopped ['prefill-1']"
    )
    ((_, request),) = servicer.requests
    assert request.restart


# ---- switch ---------------------------------------------------------------------------------


def test_switch_sends_the_worker_and_role_and_prints_what_it_did(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    result = cli(target, "switch", "prefill-1", "decode", "--timeout", "30")
    assert (result.exit_code, result.output) == (0, "prefill-1 switched to decode\n")
    ((method, request),) = servicer.requests
    assert method == "Switch"
    assert (request.worker_id, request.role, request.timeout_s, request.force) == (
        "prefill-1", "decode", 30.0, False
    )  # fmt: skip
    cli(target, "switch", "decode-0", "prefill", "--force")
    request = servicer.requests[-1][1]
    assert request.force and not request.HasField("timeout_s")  # the server's default


def test_a_switch_that_timed_out_exits_1_and_a_bad_timeout_sends_nothing(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    servicer.replies["Switch"] = lambda r, c: pb.SwitchResponse(
        worker_id=r.worker_id, switched=False, role="prefill",
        message="prefill-1 still held 3 requests after 0s; it stays prefill, admitting again",
    )  # fmt: skip
    result = cli(target, "switch", "prefill-1", "decode", "--timeout", "0")
    assert result.exit_code == 1
    assert result.output.startswith("prefill-1 still held 3 requests after 0s")
    result = cli(target, "switch", "prefill-1", "decode", "--timeout", "-2")
    assert (result.exit_code, result.output) == (
        2, "error: --timeout: must be a finite number >= 0, got -2.0\n"
    )  # fmt: skip
    assert len(servicer.requests) == 1


def test_a_refused_switch_is_one_line_and_exit_1(admin: tuple[ScriptedAdmin, str]) -> None:
    servicer, target = admin
    servicer.replies["Switch"] = abort(
        grpc.StatusCode.FAILED_PRECONDITION,
        "prefill-0 is draining: only a ready worker switches (`pdserve undrain prefill-0` first)",
    )
    result = cli(target, "switch", "prefill-0", "decode")
    assert result.exit_code == 1
    assert result.output == (
        "error: FAILED_PRECONDITION: prefill-0 is draining: only a ready worker switches "
        "(`pdserve undrain prefill-0` first)\n"
    )
    assert "Traceback" not in result.output


# ---- status ---------------------------------------------------------------------------------


def worker(worker_id: str, state: int, inflight: int) -> pb.WorkerStatus:
    role = worker_id.split("-")[0]
    return pb.WorkerStatus(worker_id=worker_id, role=role, node="0123456789abcdef",
                           device="cpu", state=state, kv_blocks_total=96, kv_blocks_used=8,
                           inflight_requests=inflight)  # fmt: skip


LIMITS = pb.RequestLimits(
    max_request_id_chars=128, max_tenant_chars=64, max_cache_salt_chars=64, max_stop_strings=16,
    max_stop_string_chars=256, max_stop_token_ids=64, max_message_bytes=4 << 20,
    max_concurrent_requests=256, max_concurrent_streams=100, max_model_len=512,
    max_prompt_tokens=1536, default_request_timeout_s=120, prefill_timeout_s=60,
    handoff_timeout_s=30, token_gap_timeout_s=30.5, max_tenants=1024,
)  # fmt: skip


def cluster_status(limits: pb.RequestLimits | None) -> pb.ClusterStatus:
    st = pb.ClusterStatus(
        model="tiny",
        redis_ok=True,
        workers=[
            worker("prefill-0", pb.WORKER_STATE_READY, 3),
            worker("decode-1", pb.WORKER_STATE_DRAINING, 2),
            worker("decode-2", pb.WORKER_STATE_DRAINED, 0),
        ],
    )
    if limits is not None:
        st.limits.CopyFrom(limits)
    return st


def test_status_table_shows_draining_drained_in_flight_and_the_limits(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    servicer.replies["Status"] = lambda request, context: cluster_status(LIMITS)
    result = cli(target, "status")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line for line in lines if "worker" in line and "health" in line)
    assert "in-flight" in header
    column = header.index("in-flight") + len("in-flight")  # right-aligned
    rows = {
        line.split()[0]: line for line in lines if line.strip().startswith(("prefill-", "decode-"))
    }
    assert {worker_id: row.split()[2] for worker_id, row in rows.items()} == {
        "prefill-0": "ready", "decode-1": "draining", "decode-2": "drained",
    }  # fmt: skip
    assert {worker_id: row[column - 1] for worker_id, row in rows.items()} == {
        "prefill-0": "3", "decode-1": "2", "decode-2": "0",
    }  # fmt: skip
    tail = lines[lines.index(next(line for line in lines if "limits:" in line)) :]
    assert tail[:3] == [
        "  limits:   context <= 512 tok · prompt <= 1536 tok · 256 requests per router · "
        "100 streams per connection · messages <= 4 MiB · 1024 tenants",
        "  request:  stop <= 16 strings · stop string <= 256 chars · stop token ids <= 64 · "
        "request id <= 128 chars · tenant <= 64 chars · cache salt <= 64 chars",
        "  timeouts: request 120 s (when the client sets none) · prefill 60 s · hand-off 30 s "
        "· between tokens 30.5 s",
    ]


def test_status_shows_no_limits_when_the_router_sends_none(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    servicer.replies["Status"] = lambda request, context: cluster_status(None)
    table = cli(target, "status")
    assert table.exit_code == 0 and "limits" not in table.output
    as_json = json.loads(cli(target, "status", "--json").output)
    assert "limits" not in as_json


def test_status_json_has_states_in_flight_and_limits(admin: tuple[ScriptedAdmin, str]) -> None:
    servicer, target = admin
    servicer.replies["Status"] = lambda request, context: cluster_status(LIMITS)
    result = cli(target, "status", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [(w["worker_id"], w["state"], w["inflight_requests"]) for w in data["workers"]] == [
        ("prefill-0", "WORKER_STATE_READY", 3),
        ("decode-1", "WORKER_STATE_DRAINING", 2),
        ("decode-2", "WORKER_STATE_DRAINED", 0),
    ]
    assert data["limits"]["max_prompt_tokens"] == 1536
    assert data["limits"]["token_gap_timeout_s"] == 30.5


def test_status_shows_each_workers_weights_and_kv_pool_dtype_and_bytes(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    st = cluster_status(None)
    fp8 = {"weights_dtype": "bfloat16", "quantization": "fp8", "weight_bytes": 74_700_000_000,
           "kv_cache_dtype": "float8_e4m3fn", "kv_cache_bytes": 48 << 30}  # fmt: skip
    for field, value in fp8.items():
        setattr(st.workers[0], field, value)
    dense = {"weights_dtype": "float32", "quantization": "none", "weight_bytes": 3 << 20,
             "kv_cache_dtype": "float32", "kv_cache_bytes": 1536 << 10}  # fmt: skip
    for field, value in dense.items():
        setattr(st.workers[1], field, value)
    servicer.replies["Status"] = lambda request, context: st
    result = cli(target, "status")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line for line in lines if "weights" in line and "KV pool" in line)
    workers = ("prefill-", "decode-")
    rows = {line.split()[0]: line for line in lines if line.strip().startswith(workers)}
    start, end = header.index("weights"), header.index("KV used")
    shown = {w: " ".join(row[start:end].split()) for w, row in rows.items()}
    assert shown == {
        "prefill-0": "fp8 69.6 GiB fp8 48 GiB",
        "decode-1": "float32 3 MiB float32 1.5 MiB",
        "decode-2": "- -",  # a worker that reports none (an older one)
    }
    data = json.loads(cli(target, "status", "--json").output)
    as_json = {**fp8, "weight_bytes": "74700000000", "kv_cache_bytes": str(48 << 30)}
    assert {k: data["workers"][0][k] for k in fp8} == as_json  # proto3 JSON: uint64 as a string


def test_an_unavailable_the_router_sends_is_its_own_not_no_router(
    admin: tuple[ScriptedAdmin, str],
) -> None:
    servicer, target = admin
    servicer.replies["Status"] = abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is ready")
    result = cli(target, "status")
    assert (result.exit_code, result.output) == (
        1,
        "error: UNAVAILABLE: no decode worker is ready\n",
    )


def test_lora_load_list_and_unload_send_what_they_say(
    admin: tuple[ScriptedAdmin, str], tmp_path: Any
) -> None:
    servicer, target = admin
    result = cli(target, "lora", "load", "sql", str(tmp_path))
    assert result.exit_code == 0, result.output
    method, request = servicer.requests[-1]
    assert (method, request.name, request.path) == ("LoadLora", "sql", str(tmp_path))
    assert "loaded 'sql'" in result.output and "d0, p0" in result.output
    servicer.replies["ListLoras"] = lambda request, context: pb.LoraStatus(
        adapters=[pb.LoraAdapter(name="sql", path="/a", rank=8, workers=["p0"])]
    )
    listed = cli(target, "lora", "list", "--json")
    assert json.loads(listed.output) == [
        {"name": "sql", "path": "/a", "rank": 8, "workers": ["p0"], "loaded_on": []}
    ]
    servicer.replies["UnloadLora"] = abort(grpc.StatusCode.NOT_FOUND, "name: no adapter 'x'")
    gone = cli(target, "lora", "unload", "x")
    assert gone.exit_code == 1
    assert "no adapter 'x'" in gone.output


def test_status_shows_a_split_workers_share_and_its_decode_slowdown() -> None:
    from deploy.cli.cluster_client import split_lines
    from pdserve.v1 import serving_pb2 as pb

    st = pb.ClusterStatus(workers=[
        pb.WorkerStatus(worker_id="split-0", split=pb.SplitStatus(
            partitioned=True, total_sms=132, decode_sms=32, prefill_sms=100, resizes=3,
            handoffs=9, handoff_us_mean=2.0, handoff_us_max=7.0, decode_slowdown=1.38)),
        pb.WorkerStatus(worker_id="split-1", split=pb.SplitStatus(
            partitioned=False, reason="no green contexts on CPU", handoffs=1)),
        pb.WorkerStatus(worker_id="decode-0"),
    ])  # fmt: skip
    lines = split_lines(st)
    assert len(lines) == 2
    assert "decode 32/132 SMs, prefill 100 (3 resizes)" in lines[0]
    assert "decode steps 1.38x slower beside prefill" in lines[0]
    assert "9 hand-offs, 2 µs mean, 7 µs max" in lines[0]
    assert "unpartitioned: no green contexts on CPU" in lines[1] and "slower" not in lines[1]
