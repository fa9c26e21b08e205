"""LoRA adapters through the whole system (the shared cluster: 2 prefill + 1 decode workers,
tiny model, "tiny-sql" served from the start): greedy tokens equal `peft`'s own model in
transformers on the disaggregated path, the adapter is part of the prefix-cache identity, an
unknown adapter is NOT_FOUND, and adapters load and unload at run time through the admin API
(a request running on one finishes) and the OpenAI HTTP door's `model`."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from lora_reference import greedy, peft_model
from references import Reference
from router_client import Streamed, generate, greedy_request, rpc_error
from router_harness import SERVED_LORA, LoraAdapters, RouterCluster

from pdserve.v1 import serving_pb2 as pb
from vocabulary.worker_api import WorkerRole

MAX_TOKENS = 12
RUNTIME_LORA = "tiny-chat"
LONG = 400
"""Tokens of the request that runs while its adapter is unloaded (long enough to outlast
the unload's round trip through the controller)."""


@pytest.fixture(scope="module")
def peft_greedy(tiny_model_dir: Path, lora_adapters: LoraAdapters) -> dict[str, Any]:
    models = {SERVED_LORA: lora_adapters.sql, RUNTIME_LORA: lora_adapters.chat}
    return {name: peft_model(tiny_model_dir, path) for name, path in models.items()}


def _lora_generate(cluster: RouterCluster, prompt: list[int], lora: str, **fields: Any) -> Streamed:
    return generate(
        cluster.generation(0), **greedy_request(prompt, MAX_TOKENS, lora=lora, **fields)
    )


def _wait_until_decoding(cluster: RouterCluster, timeout_s: float = 30.0) -> None:
    (decode_id,) = cluster.worker_ids(WorkerRole.DECODE)
    end = time.monotonic() + timeout_s
    while not cluster.loads()[decode_id].engine.num_running:
        assert time.monotonic() < end, "the request never reached the decode worker"
        time.sleep(0.02)


def _adapters(cluster: RouterCluster) -> dict[str, pb.LoraAdapter]:
    status = cluster.admin(0).ListLoras(pb.ListLorasRequest(), timeout=30)
    return {a.name: a for a in status.adapters}


def test_a_lora_request_equals_peft_on_the_disaggregated_path(
    router_cluster: RouterCluster, corpus_ids: list[int], peft_greedy: dict[str, Any],
    hf_greedy: Reference,
) -> None:  # fmt: skip
    prompt = corpus_ids[100:150]
    out = _lora_generate(router_cluster, prompt, SERVED_LORA)
    assert out.token_ids == greedy(peft_greedy[SERVED_LORA], prompt, MAX_TOKENS)
    t = out.final.timings
    assert not t.local_prefill
    assert t.prefill_worker in router_cluster.worker_ids(WorkerRole.PREFILL)
    base = generate(router_cluster.generation(0), **greedy_request(prompt, MAX_TOKENS))
    assert base.token_ids == hf_greedy(prompt, MAX_TOKENS)
    assert base.token_ids != out.token_ids  # the adapter changes what the model says


def test_a_prefix_is_cached_per_adapter_never_across(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    prompt = corpus_ids[1200:1264]  # four full blocks
    first = _lora_generate(router_cluster, prompt, SERVED_LORA, cache_salt="per-adapter")
    assert first.final.usage.cached_prompt_tokens == 0
    base = generate(router_cluster.generation(0),
                    **greedy_request(prompt, MAX_TOKENS, cache_salt="per-adapter"))  # fmt: skip
    assert base.final.usage.cached_prompt_tokens == 0
    again = _lora_generate(router_cluster, prompt, SERVED_LORA, cache_salt="per-adapter")
    assert again.final.usage.cached_prompt_tokens >= 48
    assert again.token_ids == first.token_ids


def test_an_unknown_adapter_is_not_found_and_a_bad_name_invalid(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    stub = router_cluster.generation(0)
    err = rpc_error(
        stub.Generate, pb.GenerateRequest(**greedy_request(corpus_ids[:8], 4, lora="nope"))
    )
    assert err.code() is grpc.StatusCode.NOT_FOUND
    assert "lora: adapter 'nope' is not loaded" in err.details()
    err = rpc_error(
        stub.Generate, pb.GenerateRequest(**greedy_request(corpus_ids[:8], 4, lora="a b"))
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("lora:")
    router_cluster.wait_idle()


def test_adapters_load_and_unload_at_run_time_and_a_running_request_finishes(
    router_cluster: RouterCluster, corpus_ids: list[int], lora_adapters: LoraAdapters,
    peft_greedy: dict[str, Any], tmp_path: Path,
) -> None:  # fmt: skip
    admin = router_cluster.admin(0)
    assert list(_adapters(router_cluster)[SERVED_LORA].workers) == sorted(router_cluster.workers)
    bad = tmp_path / "not-an-adapter"
    bad.mkdir()
    err = rpc_error(
        admin.LoadLora, pb.LoadLoraRequest(name=RUNTIME_LORA, path=str(bad)), timeout=60
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter_config.json" in err.details()
    assert RUNTIME_LORA not in _adapters(router_cluster)

    path = str(lora_adapters.chat)
    status = admin.LoadLora(pb.LoadLoraRequest(name=RUNTIME_LORA, path=path), timeout=60)
    assert {a.name: a.path for a in status.adapters}[RUNTIME_LORA] == path
    prompt = corpus_ids[300:340]
    want = greedy(peft_greedy[RUNTIME_LORA], prompt, LONG)
    out = _lora_generate(router_cluster, prompt, RUNTIME_LORA)
    assert out.token_ids == want[:MAX_TOKENS]
    assert _adapters(router_cluster)[RUNTIME_LORA].loaded_on  # its weights are held now

    # a long request on it runs while the adapter is unloaded: it finishes, token-exact
    got: list[Streamed] = []
    stub = router_cluster.generation(0)
    req = greedy_request(prompt, LONG, lora=RUNTIME_LORA)
    running = threading.Thread(target=lambda: got.append(generate(stub, **req)))
    running.start()
    _wait_until_decoding(router_cluster)
    admin.UnloadLora(pb.UnloadLoraRequest(name=RUNTIME_LORA), timeout=60)
    assert not got, "the request ended before the unload: nothing was checked"
    running.join(timeout=60)
    assert got and got[0].token_ids == want
    assert RUNTIME_LORA not in _adapters(router_cluster)
    err = rpc_error(stub.Generate, pb.GenerateRequest(**req))
    assert err.code() is grpc.StatusCode.NOT_FOUND
    err = rpc_error(admin.UnloadLora, pb.UnloadLoraRequest(name=RUNTIME_LORA), timeout=60)
    assert err.code() is grpc.StatusCode.NOT_FOUND
    router_cluster.wait_idle()


def test_the_http_door_serves_an_adapter_as_a_model(
    router_cluster: RouterCluster, corpus_ids: list[int], tokenizer: Any,
    peft_greedy: dict[str, Any],
) -> None:  # fmt: skip
    import openai

    url = router_cluster.admin(0).Status(pb.StatusRequest(), timeout=10).http_url
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert SERVED_LORA in [m.id for m in client.models.list()]
    prompt = corpus_ids[500:530]
    done = client.completions.create(
        model=SERVED_LORA, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert done.model == SERVED_LORA
    want = greedy(peft_greedy[SERVED_LORA], prompt, MAX_TOKENS)
    assert done.choices[0].text == tokenizer.decode(want)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
