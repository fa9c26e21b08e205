"""Structured output through the real cluster: the `openai` SDK's `response_format` (JSON
schema, JSON object) and vLLM's `structured_outputs` over HTTP, and the gRPC
`structured_output` field, sampled at temperature 1 over many seeds, short prompts and long
ones, streamed and not, disaggregated (router 0: the prefill worker samples the first token
under the constraint, the decode worker resumes it from the tokens so far) and prefilled on
the decode worker (router 1, short prompts): every output that stops is in its constraint's
language and validates against its schema. A constraint no worker can compile is refused
naming the field, with nothing held after it."""

from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from router_client import generate, rpc_error
from router_harness import RouterCluster

from pdserve.v1 import serving_pb2 as pb

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "rivers": {"type": "array", "items": {"enum": ["north", "south"]}, "maxItems": 2},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


def _salt() -> dict[str, Any]:
    return {"cache_salt": uuid.uuid4().hex}


def test_json_schema_outputs_validate_over_seeds_streamed_or_not_pd_and_local(
    router_cluster: RouterCluster, clients: list[openai.OpenAI]
) -> None:
    from deploy.checkpoints.checkpoint_files import CORPUS

    long_prompt = CORPUS.read_text()[:1200]  # hundreds of tokens: a hand-off on router 1 too

    def answer(seed: int) -> tuple[str, str | None]:
        router, stream = seed % 2, seed % 3 == 0
        content = long_prompt if router == 0 else "Describe a city as JSON."
        kwargs: dict[str, Any] = dict(
            model=router_cluster.model_id, messages=[{"role": "user", "content": content}],
            response_format=RESPONSE_FORMAT, temperature=1.0, seed=seed, max_tokens=100,
            extra_body=_salt(),
        )  # fmt: skip
        # on a loaded machine a request can be refused early (429, the router's estimated TTFT
        # past its limit): retried as the SDK's users do, with its backoff
        client = clients[router].with_options(max_retries=6)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        out = client.chat.completions.create(**kwargs)
        return out.choices[0].message.content or "", out.choices[0].finish_reason

    seeds = range(12)
    with ThreadPoolExecutor(2) as pool:  # two at a time, each request its own seed
        answers = list(pool.map(answer, seeds))
    stopped = 0
    for seed, (text, reason) in zip(seeds, answers, strict=True):
        if reason == "length":
            continue  # max_tokens cut it: the text is then a prefix of a valid one
        assert reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)
        stopped += 1
    assert stopped >= 9
    router_cluster.wait_idle()


def test_json_object_and_vllm_structured_outputs_over_http(
    router_cluster: RouterCluster, clients: list[openai.OpenAI]
) -> None:
    client = clients[0]
    for seed in range(4):
        out = client.completions.create(
            model=router_cluster.model_id, prompt="Colours:", temperature=1.0, seed=seed,
            max_tokens=40, extra_body={"structured_outputs": {"choice": ["red", "green"]}},
        )  # fmt: skip
        assert out.choices[0].text in ("red", "green")
        assert out.choices[0].finish_reason == "stop"
        out = client.completions.create(
            model=router_cluster.model_id, prompt="Code:", temperature=1.0, seed=seed,
            max_tokens=40, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"},
        )  # fmt: skip
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", out.choices[0].text)
    stopped = 0
    for seed in range(6):
        chat = client.chat.completions.create(
            model=router_cluster.model_id, messages=[{"role": "user", "content": "JSON!"}],
            response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=150,
        )  # fmt: skip
        if chat.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
            stopped += 1
    assert stopped >= 1


def test_grpc_structured_output_through_the_hand_off(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    grammar = 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9] [0-9]?'
    for seed, so in enumerate([
        pb.StructuredOutput(regex="(yes|no)!"),
        pb.StructuredOutput(choice=pb.Choices(choices=["alpha", "beta", "gamma"])),
        pb.StructuredOutput(grammar=grammar),
        pb.StructuredOutput(json_schema=json.dumps(SCHEMA), strict=True),
    ]):  # fmt: skip
        out = generate(
            router_cluster.generation(0), token_ids=corpus_ids[100 + 50 * seed : 400],
            max_tokens=80, temperature=1.0, seed=seed, structured_output=so,
        )  # fmt: skip
        assert out.final.usage.transferred_prompt_tokens > 0  # the constraint crossed over
        if out.final.finish_reason != pb.FINISH_REASON_STOP:
            continue
        kind = so.WhichOneof("kind")
        if kind == "regex":
            assert re.fullmatch("(yes|no)!", out.text)
        elif kind == "choice":
            assert out.text in ("alpha", "beta", "gamma")
        elif kind == "grammar":
            assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})?\)", out.text), out.text
        else:
            jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize(
    ("so", "words"),
    [
        (pb.StructuredOutput(json_schema='{"type": "nonsense"}'), "does not compile"),
        (pb.StructuredOutput(regex="[a-"), "does not compile"),
        (pb.StructuredOutput(json_schema="{nope"), "not JSON"),
        (pb.StructuredOutput(), "set one of"),
        (pb.StructuredOutput(regex="a", strict=True), "strict is for json_schema"),
        (pb.StructuredOutput(choice=pb.Choices()), "1 to 1024"),
    ],
)
def test_a_bad_constraint_is_invalid_argument_naming_the_field(
    router_cluster: RouterCluster, so: pb.StructuredOutput, words: str
) -> None:
    for router in (0, 1):  # disaggregated (the prefill worker compiles) and local
        err = rpc_error(
            generate, router_cluster.generation(router), prompt="The baker", max_tokens=4,
            structured_output=so,
        )  # fmt: skip
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("structured_output: ") and words in err.details()
    router_cluster.wait_idle()
