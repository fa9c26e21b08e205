"""LLMEngine on the GPU (tiny model, float32): greedy tokens equal transformers on the GPU
through chunked prefill, preemption and the prefill-only → decode-only hand-off, with overlap
scheduling (the default) and without; seeded sampling with CUDA generators is reproducible
whatever the batch.

Seen passing on an H200 (torch 2.11, transformers 5.17) with the torch attention backend.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, EngineMode
from engine.core.engine import LLMEngine
from vocabulary.sampling import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = [
    "The river runs past the old mill and under the stone bridge. In the morning the water is cold",
    "The river runs past the old mill and under the stone bridge. In the morning the water is warm",
    "The baker opens his shop before the sun is up.",
    "Hello",
    "The",
    "Children walk to school",
]


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_dir=str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=256
    )


@pytest.fixture(scope="module")
def engine(base: EngineConfig) -> LLMEngine:
    return LLMEngine(base)


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def want(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    hf = hf.cuda().eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(GREEDY.max_tokens):
                ids.append(int(hf(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"block_size": 4, "max_num_batched_tokens": 7},
        {"block_size": 4, "num_kv_blocks": 16},
        {"cuda_graphs": False},
        {"block_size": 4, "max_num_batched_tokens": 7, "overlap_scheduling": False},
        {"mode": EngineMode.SPLIT},
        {"mode": EngineMode.SPLIT, "block_size": 4, "max_num_batched_tokens": 7},
        {"mode": EngineMode.SPLIT, "block_size": 4, "num_kv_blocks": 24},
        {"mode": EngineMode.SPLIT, "split_resize_interval_s": 0.0},
        {"mode": EngineMode.SPLIT, "split_decode_sms": 32},
    ],
    ids=[
        "colocated",
        "chunked",
        "preempting",
        "eager",
        "chunked-no-overlap",
        "split",
        "split-chunked",
        "split-tight-pool",
        "split-resizing-every-step",
        "split-fixed",
    ],
)
def test_greedy_matches_transformers_on_gpu(
    engine: LLMEngine,
    base: EngineConfig,
    prompts: list[list[int]],
    want: list[list[int]],
    overrides: dict[str, object],
) -> None:
    e = LLMEngine(replace(base, **overrides), model=engine.model, tokenizer=engine.tokenizer)
    assert e.generate(prompts, GREEDY) == want
    assert e.block_pool.num_free == e.block_pool.num_blocks
    split = e.load().split
    if overrides.get("mode") is EngineMode.SPLIT:  # partitions where the driver has them
        assert split is not None and split.handoffs == len(prompts)
        assert split.partitioned or split.reason, split
        if split.partitioned:
            assert 0 < split.decode_sms <= split.total_sms
            if split.decode_sms < split.total_sms:  # (the whole device: both loops on it)
                assert split.decode_sms + split.prefill_sms == split.total_sms  # disjoint
            # one set of decode graphs per share the split may move to, each replayed (when
            # the backend captures graphs at all: float32 runs torch attention, eager)
            lane, graphs = e.prefill_lane, e.runner.graphs
            assert lane is not None and (graphs is not None) == (engine.runner.graphs is not None)
            if graphs is not None:
                adaptive = not overrides.get("split_decode_sms")
                assert graphs.num_sets == (len(lane.streams.all_shares()) if adaptive else 1)
            if overrides.get("split_resize_interval_s") == 0.0:
                assert split.resizes > 0, split
    if "num_kv_blocks" in overrides:
        assert e.load().num_preemptions > 0 or overrides.get("mode") is EngineMode.SPLIT


def test_handoff_on_gpu_matches_transformers(
    engine: LLMEngine, base: EngineConfig, prompts: list[list[int]], want: list[list[int]]
) -> None:
    model, tokenizer = engine.model, engine.tokenizer
    p = LLMEngine(replace(base, mode=EngineMode.PREFILL_ONLY), model, tokenizer)
    d = LLMEngine(replace(base, mode=EngineMode.DECODE_ONLY), model, tokenizer)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        p.add_request(rid, prompt, GREEDY)
        [out] = p.step()
        h = out.kv_handoff
        assert h is not None
        alloc = d.allocate_for_transfer(rid, prompt, h.block_hashes)
        d.kv_cache.copy_blocks_from(
            p.kv_cache, list(h.block_ids[alloc.num_cached_blocks :]), list(alloc.blocks_to_transfer)
        )
        assert p.release_request_blocks(rid)
        d.add_transferred_request(rid, h.first_token_id, GREEDY)
        tokens = [h.first_token_id]
        while d.has_unfinished():
            for o in d.step():
                tokens += o.new_token_ids
        assert tokens == want[i]
    assert p.block_pool.num_free == p.block_pool.num_blocks
    assert d.block_pool.num_free == d.block_pool.num_blocks


def test_seeded_sampling_on_gpu_is_reproducible_whatever_the_batch(
    engine: LLMEngine, base: EngineConfig, prompts: list[list[int]]
) -> None:
    params = SamplingParams(
        temperature=2.0, top_p=0.9, top_k=40, min_p=0.01, repetition_penalty=1.1,
        max_tokens=16, seed=5, logprobs=True,
    )  # fmt: skip
    model, tokenizer = engine.model, engine.tokenizer
    alone = LLMEngine(base, model, tokenizer).generate([prompts[0]], params)
    crowd = LLMEngine(replace(base, seed=3), model, tokenizer).generate(
        [prompts[1], prompts[0], prompts[2]], params
    )
    assert alone[0] == crowd[1]


def test_engines_sharing_the_card_size_their_pools_from_their_share(base: EngineConfig) -> None:
    """Two engines at a quarter of the card each (as two workers placed at num_gpus 0.25 get):
    each pool within its quarter less what the engine holds, the second as large as the first
    (not what the first left over); a configured pool larger than the free memory is refused
    with the figures before any allocation (issue 49)."""
    total = torch.cuda.mem_get_info()[1]
    shared = replace(base, num_kv_blocks=0, gpu_memory_share=0.25, host_kv_gb=0)
    first = LLMEngine(shared)
    second = LLMEngine(shared)
    try:
        pools = [e.kv_cache.spec.num_blocks * e.kv_cache.spec.block_nbytes for e in (first, second)]
        assert all(0 < p <= 0.25 * total for p in pools), (pools, total)
        assert pools[1] >= 0.95 * pools[0], pools
        free = torch.cuda.mem_get_info()[0]
        too_many = free // first.kv_cache.spec.block_nbytes + 1
        with pytest.raises(ValueError, match=rf"num_kv_blocks: {too_many} blocks need"):
            LLMEngine(replace(base, num_kv_blocks=int(too_many), host_kv_gb=0))
    finally:
        first.close()
        second.close()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def llama_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json and tokenizer of a 2-layer Llama-3-8B-shaped model (head_dim 128, which
    flashinfer takes; the tiny model's 32 it does not), for dummy weights."""
    from deploy.checkpoints.make_model import make_model

    out = tmp_path_factory.mktemp("llama-shaped")
    return make_model(out / "model", preset="llama3-8b", config_only=True, num_layers=2)


@pytest.mark.parametrize("decode_sms", [0, 32])
def test_split_with_cuda_graphs_decodes_as_the_colocated_engine(
    llama_shaped: Path, prompts: list[list[int]], decode_sms: int
) -> None:
    """bf16 with flashinfer and CUDA graphs (dummy weights): the split engine's decode runs
    graphs captured per SM share (adaptive: every share it may move to; fixed: one) and
    gives the colocated engine's greedy tokens."""
    bf16 = EngineConfig(
        model_dir=str(llama_shaped), device="cuda", dtype="bfloat16", load_format="dummy",
        attention_backend="flashinfer", num_kv_blocks=256, max_num_seqs=8,
        cuda_graph_max_batch=8, max_model_len=512,
    )  # fmt: skip
    colocated = LLMEngine(bf16)
    want = colocated.generate(prompts, GREEDY)
    assert colocated.runner.graphs is not None
    split = LLMEngine(
        replace(bf16, mode=EngineMode.SPLIT, split_decode_sms=decode_sms,
                split_resize_interval_s=0.0),
        model=colocated.model, tokenizer=colocated.tokenizer,
    )  # fmt: skip
    got = split.generate(prompts, GREEDY)
    status = split.load().split
    assert status is not None and status.handoffs == len(prompts)
    graphs, lane = split.runner.graphs, split.prefill_lane
    assert graphs is not None and lane is not None
    if status.partitioned:
        assert graphs.num_sets == (len(lane.streams.all_shares()) if not decode_sms else 1)
    assert got == want
    assert split.block_pool.num_free == split.block_pool.num_blocks
