"""What a pipeline-parallel engine serves beside plain greedy decoding, on CPU over gloo (the
tiny model cut into 2 stages, real processes; one pair of processes builds one engine after
another, `PPRanks.then`):

- the last stage samples: seeded and unseeded random sampling, penalties, logprobs with top
  alternatives, prompt logprobs and a structured-output mask (filled on rank 0, applied on
  the last stage) give exactly what a one-rank engine gives;
- FP8 weights quantized at load with an e4m3 KV pool (each stage calibrating its layers on
  the calibration pass run through the stages) give a one-rank FP8 engine's tokens, each
  stage's pool holding its layers' scales and rank 0 the model's; an FP8 checkpoint with
  dynamic per-token activations gives transformers + compressed-tensors' tokens (the
  near-tie rule of tests/integration/engine/test_engine_fp8_per_token.py) and a one-rank
  engine's; INT8 W8A8 and INT4 W4A16 checkpoints give a one-rank engine's;
- LoRA with one slot for two adapters (rank 0 decides the slot, stage 1 refills it from the
  adapter's folder, then from its host copies) gives peft's tokens;
- the host KV tier: a prefix the 8-block pool evicted is onboarded on every stage from its
  host blocks, with transformers' tokens and no prompt block recomputed.

4 stages give transformers' tokens on the plain model (test_engine_pp.py's greedy rounds) and,
on the same ranks, an engine with an e4m3 pool, LoRA and the host tier at once gives a
one-rank engine's tokens. Tokens are compared exactly: the stages compute the whole model's
arithmetic.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from engine_factories import greedy
from fp8_reference import hf_on, parted_at, reference_greedy
from lora_reference import ATTENTION, MLP, make_adapter, peft_model
from lora_reference import greedy as peft_greedy
from pp_ranks import Job, PPRanks, serve, serve_rounds
from references import Reference
from test_engine_pp import check_greedy_rounds, pp_config
from tp_ranks import generate_rounds

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.loading.int_checkpoint import IntScheme
from engine.modeling.llama import LlamaModel
from vocabulary.sampling import SamplingParams, StructuredOutput
from vocabulary.tokenizer import Tokenizer

MAX_TOKENS = 10
NEAR_TIE = 0.01
REGEX = StructuredOutput("regex", r"(The|A) [a-z]+ [a-z]+\.")


# ---- scenarios (run by rank 0 of the pipeline, and by one-rank engines here) --------------


def onboard_after_eviction(prompts: list[list[int]], engine: Any, conn: Any) -> dict[str, Any]:
    """A 58-token prompt, four others that cycle the 8-block pool, the first again: its tokens
    both times, its cached prompt tokens the second time, and rank 0's tier counters."""
    runs = []
    for i, p in enumerate([prompts[2], prompts[3], prompts[4], prompts[7], prompts[0]]):
        runs.append(serve([(f"r{i}", p, greedy(MAX_TOKENS), "")], engine, conn)["requests"])
    again = serve([("again", prompts[2], greedy(MAX_TOKENS), "")], engine, conn)["requests"]
    tier = engine.host_tier.stats()
    return {
        "first": runs[0]["r0"]["tokens"],
        "again": again["again"],
        "offloaded": tier.num_offloaded,
        "onboarded": tier.num_onboarded,
        "free_at_end": engine.block_pool.num_free == engine.block_pool.num_blocks,
    }


def one_rank(config: EngineConfig, jobs: list[Job]) -> dict[str, Any]:
    """`serve` on a one-rank engine of `config` (its model loaded from its folder)."""
    return serve(jobs, LLMEngine(replace(config, pipeline_parallel_size=1)), None)


# ---- checkpoints and adapters -------------------------------------------------------------


def int_checkpoint(src: Path, out: Path, scheme: IntScheme) -> Path:
    """`src` (dense) with its decoder projections in an INT compressed-tensors `scheme`."""
    from safetensors.torch import load_file, save_file

    from deploy.checkpoints.int_writer import quantize_int_tensors

    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        save_file(quantize_int_tensors(load_file(f), scheme), f, metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = scheme.quantization_config()
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from deploy.checkpoints.fp8_writer import quantize_checkpoint
    from engine.loading.fp8_checkpoint import Fp8Scheme

    root = tmp_path_factory.mktemp("pp-checkpoints")
    return {
        "fp8": quantize_checkpoint(tiny_model_dir, root / "fp8", Fp8Scheme()),
        "int8": int_checkpoint(tiny_model_dir, root / "int8", IntScheme(8)),
        "int4": int_checkpoint(tiny_model_dir, root / "int4", IntScheme(4, 128)),
    }


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp-lora")
    return {
        "qv8": make_adapter(tiny_model_dir, root / "qv8", 10, r=8, lora_alpha=16,
                            target_modules=["q_proj", "v_proj"]),
        "all16": make_adapter(tiny_model_dir, root / "all16", 12, r=16, lora_alpha=32,
                              target_modules=ATTENTION + MLP),
    }  # fmt: skip


# ---- the 2-stage engines ------------------------------------------------------------------


def sampling_jobs(prompts: list[list[int]]) -> list[Job]:
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=MAX_TOKENS,
                            ignore_eos=True, logprobs=True, top_logprobs=3)  # fmt: skip
    penalized = replace(seeded, seed=9, repetition_penalty=1.3, frequency_penalty=0.4,
                        presence_penalty=0.3, top_logprobs=0)  # fmt: skip
    return [
        ("seeded", prompts[0], seeded, ""),
        ("penalties", prompts[1], penalized, ""),
        ("unseeded", prompts[2], replace(seeded, seed=None, logprobs=False, top_logprobs=0), ""),
        ("prompt", prompts[3], greedy(MAX_TOKENS, prompt_logprobs=2, logprobs=True), ""),
        ("regex", prompts[4], SamplingParams(temperature=0.0, max_tokens=24, structured=REGEX), ""),
        ("greedy", prompts[5], greedy(MAX_TOKENS), ""),
    ]


def lora_rounds(prompts: list[list[int]]) -> list[list[Job]]:
    """Both adapters and the base model, then the first adapter again (its slot refilled)."""
    return [
        [
            ("qv8", prompts[0], greedy(MAX_TOKENS), "qv8"),
            ("all16", prompts[1], greedy(MAX_TOKENS), "all16"),
            ("base", prompts[2], greedy(MAX_TOKENS), ""),
        ],
        [("qv8-again", prompts[3], greedy(MAX_TOKENS), "qv8")],
    ]


def plain_jobs(prompts: list[list[int]]) -> list[Job]:
    return [(f"p{i}", p, greedy(MAX_TOKENS), "") for i, p in enumerate(prompts[:6])]


def host_gb(config: EngineConfig, blocks: int) -> float:
    """host_kv_gb holding `blocks` blocks of the whole model of `config` (float32)."""
    from vocabulary.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(config.model_dir)
    block = cfg.num_layers * 2 * config.block_size * cfg.num_kv_heads * cfg.head_dim * 4
    return blocks * block / 2**30


@pytest.fixture(scope="module")
def configs(
    tiny_model_dir: Path, checkpoints: dict[str, Path], adapters: dict[str, Path]
) -> dict[str, EngineConfig]:
    base = pp_config(tiny_model_dir, 2)
    loras = tuple((name, str(path)) for name, path in adapters.items())
    small = replace(base, num_kv_blocks=8)
    return {
        "sampling": base,
        "fp8": replace(base, quantization="fp8", kv_cache_dtype="fp8"),
        "fp8_checkpoint": replace(base, model_dir=str(checkpoints["fp8"])),
        "int8": replace(base, model_dir=str(checkpoints["int8"])),
        "int4": replace(base, model_dir=str(checkpoints["int4"])),
        "lora": replace(base, loras=loras, max_loras=1),
        "host": replace(small, host_kv_gb=host_gb(small, 64), host_kv_max_blocks_per_step=64),
    }


@pytest.fixture(scope="module")
def pp2(configs: dict[str, EngineConfig], prompts: list[list[int]]) -> dict[str, Any]:
    """Every 2-stage engine's result (rank 0's, and stage 1's pool spec and counters)."""
    scenarios = {
        "sampling": functools.partial(serve, sampling_jobs(prompts)),
        "fp8": functools.partial(serve, plain_jobs(prompts)),
        "fp8_checkpoint": functools.partial(serve, plain_jobs(prompts)),
        "int8": functools.partial(serve, plain_jobs(prompts)),
        "int4": functools.partial(serve, plain_jobs(prompts)),
        "lora": functools.partial(serve_rounds, lora_rounds(prompts)),
        "host": functools.partial(onboard_after_eviction, prompts),
    }
    runs = [(configs[name], scenario) for name, scenario in scenarios.items()]
    ranks = PPRanks(2, runs[0][0], runs[0][1], then=tuple(runs[1:]))
    try:
        leader, follower = ranks.start().results(timeout_s=600)
    finally:
        ranks.stop()
    assert leader[0] == "ok" and follower[0] == "ok", (leader, follower)
    return {
        name: {"rank0": leader[1][i][0], "stage1": follower[1][i]}
        for i, name in enumerate(scenarios)
    }


def test_the_last_stage_samples_as_one_rank_does(
    pp2: dict[str, Any], configs: dict[str, EngineConfig], prompts: list[list[int]]
) -> None:
    got = pp2["sampling"]["rank0"]["requests"]
    want = one_rank(configs["sampling"], sampling_jobs(prompts))["requests"]
    for rid, w in want.items():
        g = got[rid]
        assert g["tokens"] == w["tokens"], rid
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5), rid
        assert [ids for ids, _ in g["top"]] == [ids for ids, _ in w["top"]], rid
    assert len(got["seeded"]["top"]) == MAX_TOKENS and got["seeded"]["top"][0][0]
    assert got["seeded"]["tokens"] != got["greedy"]["tokens"]
    prompt, ref = got["prompt"]["prompt"], want["prompt"]["prompt"]
    assert prompt is not None and len(prompt.logprobs) == len(prompts[3])
    assert prompt.logprobs[0] is None and ref.logprobs[0] is None
    assert prompt.logprobs[1:] == pytest.approx(ref.logprobs[1:], abs=1e-5)
    assert [t.token_ids for t in prompt.top] == [t.token_ids for t in ref.top]
    import re

    from vocabulary.tokenizer import Tokenizer

    text = Tokenizer.from_model_dir(configs["sampling"].model_dir).decode(got["regex"]["tokens"])
    assert re.fullmatch(REGEX.spec, text), text


def test_fp8_weights_and_an_e4m3_pool_equal_one_rank_with_each_stage_holding_its_scales(
    pp2: dict[str, Any], configs: dict[str, EngineConfig], prompts: list[list[int]]
) -> None:
    got, stage1 = pp2["fp8"]["rank0"], pp2["fp8"]["stage1"]
    want = one_rank(configs["fp8"], plain_jobs(prompts))
    assert got["weights"] == want["weights"] == "fp8"
    assert {r: g["tokens"] for r, g in got["requests"].items()} == {
        r: w["tokens"] for r, w in want["requests"].items()
    }
    (whole, _), (own, model) = want["scales"], got["scales"]
    assert len(whole) == 8 and model == whole  # k, v of 4 layers: rank 0 has every stage's
    assert own == whole[:4] and stage1[2].scales == whole[4:]  # each stage its layers'
    assert stage1[2].dtype == "float8_e4m3fn"


def test_an_fp8_per_token_checkpoint_gives_transformers_compressed_tensors_tokens(
    pp2: dict[str, Any], configs: dict[str, EngineConfig], checkpoints: dict[str, Path],
    prompts: list[list[int]],
) -> None:  # fmt: skip
    got = pp2["fp8_checkpoint"]["rank0"]
    want = one_rank(configs["fp8_checkpoint"], plain_jobs(prompts))["requests"]
    assert got["weights"] == "fp8"
    hf = hf_on(checkpoints["fp8"])
    for rid, prompt, *_ in plain_jobs(prompts):
        tokens = got["requests"][rid]["tokens"]
        assert tokens == want[rid]["tokens"], rid
        ref, gaps = reference_greedy(hf, prompt, MAX_TOKENS)
        k = parted_at(ref, tokens)
        assert k is None or gaps[k] < NEAR_TIE, f"{rid} parted at step {k}, gap {gaps[k]:.4f}"


@pytest.mark.parametrize("which", ["int8", "int4"])
def test_int_checkpoints_on_a_pipeline_equal_one_rank(
    pp2: dict[str, Any], configs: dict[str, EngineConfig], prompts: list[list[int]], which: str
) -> None:
    got = pp2[which]["rank0"]
    want = one_rank(configs[which], plain_jobs(prompts))
    assert got["weights"] == want["weights"] == which
    assert pp2[which]["stage1"][2].weights == which
    for rid, w in want["requests"].items():
        assert got["requests"][rid]["tokens"] == w["tokens"], rid


def test_lora_slots_agree_over_the_stages_and_give_peft_tokens(
    pp2: dict[str, Any], adapters: dict[str, Path], tiny_model_dir: Path,
    prompts: list[list[int]], hf_greedy: Reference,
) -> None:  # fmt: skip
    got = pp2["lora"]["rank0"]
    for rid, prompt, _, name in [job for jobs in lora_rounds(prompts) for job in jobs]:
        if name:
            want = peft_greedy(peft_model(tiny_model_dir, adapters[name]), prompt, MAX_TOKENS)
        else:
            want = hf_greedy(prompt, MAX_TOKENS)
        assert got["requests"][rid]["tokens"] == want, rid
    # one slot for two adapters: the first's was refilled from rank 0's host copy, and stage 1
    # read each folder once (its refill came from its own host copy)
    assert got["lora_host_loads"] >= 1
    assert pp2["lora"]["stage1"][3]["lora_disk_loads"] == 2


def test_an_evicted_prefix_is_onboarded_on_every_stage_token_exact(
    pp2: dict[str, Any], prompts: list[list[int]], hf_greedy: Reference
) -> None:
    got, kept = pp2["host"]["rank0"], pp2["host"]["stage1"][3]
    assert got["first"] == got["again"]["tokens"] == hf_greedy(prompts[2], MAX_TOKENS)
    assert got["again"]["cached"] == 48  # all 3 full blocks onboarded, none recomputed
    assert got["onboarded"] > 0 and got["offloaded"] > 0
    assert (kept["host_onboarded"], kept["host_offloaded"]) == (got["onboarded"], got["offloaded"])
    assert got["free_at_end"]


# ---- 4 stages -----------------------------------------------------------------------------


def test_four_stages_give_one_ranks_tokens_plain_and_with_an_e4m3_pool_lora_and_the_host_tier(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer,
    adapters: dict[str, Path], prompts: list[list[int]], hf_greedy: Reference,
) -> None:  # fmt: skip
    """The same 4 ranks run test_engine_pp.py's greedy rounds (transformers' tokens, each
    stage's pool) on the plain model, then an engine with every per-stage feature at once."""
    plain = pp_config(tiny_model_dir, 4)
    loras = tuple((name, str(path)) for name, path in adapters.items())
    config = replace(plain, kv_cache_dtype="fp8", loras=loras, max_loras=1)
    config = replace(config, host_kv_gb=host_gb(config, 64))
    rounds = lora_rounds(prompts)
    ranks = PPRanks(
        4, plain, functools.partial(generate_rounds, prompts, greedy(10), 2),
        then=((config, functools.partial(serve_rounds, rounds)),),
    )  # fmt: skip
    try:
        results = ranks.start().results(timeout_s=300)
    finally:
        ranks.stop()
    assert all(status == "ok" for status, _ in results), results
    first = [("ok", runs[0]) for _, runs in results]
    check_greedy_rounds(first, plain, prompts, hf_greedy, tiny_model, tokenizer)
    got = results[0][1][1][0]
    want = serve_rounds(rounds, LLMEngine(replace(config, pipeline_parallel_size=1)), None)
    for rid, w in want["requests"].items():
        assert got["requests"][rid]["tokens"] == w["tokens"], rid
    assert got["scales"][1] == want["scales"][0]
    assert [runs[1][2].scales for _, runs in results[1:]] == [
        want["scales"][0][2 * s : 2 * s + 2] for s in (1, 2, 3)
    ]
