"""Overlap scheduling on the GPU path it exists for: flashinfer attention, fused layer ops and
CUDA-graph decode (the tiny recipe in bf16, 2 layers, hidden 256: head_dim 64, which
flashinfer takes). Tokens are the same with overlap on and off (greedy and seeded sampling
with penalties), and a steady decode step makes no synchronizing CUDA call: its one wait is
the event of the previous step's token copy (`torch.cuda.set_sync_debug_mode("error")` raises
on `.item()`, `.tolist()` of a device tensor, blocking host↔device copies, stream or device
synchronizes; an event wait is not one of them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=1.2, top_k=50, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.3,
    max_tokens=24, ignore_eos=True, seed=11, logprobs=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deploy.checkpoints.make_model import make_model

    out = tmp_path_factory.mktemp("tiny-bf16-overlap") / "model"
    return make_model(out, preset="tiny", num_layers=2, torch_dtype="bfloat16", hidden_size=256)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> LlamaModel:
    return load_model(model_dir, torch.bfloat16, "cuda")


@pytest.fixture(scope="module")
def base(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_dir=str(model_dir),
        device="cuda",
        dtype="bfloat16",
        attention_backend="flashinfer",
        num_kv_blocks=256,
        max_num_seqs=8,
        cuda_graph_max_batch=8,
        max_model_len=1024,
    )


def make_engine(base: EngineConfig, model: LlamaModel, model_dir: Path, **overrides: object):  # type: ignore[no-untyped-def]
    engine = LLMEngine(replace(base, **overrides), model, Tokenizer.from_model_dir(model_dir))
    assert engine.runner.attention_backend == "flashinfer" and engine.runner.graphs is not None
    return engine


def add_prompts(engine: LLMEngine) -> None:
    texts = ["The river runs past the old mill", "Hello", "The baker opens his shop", "The"]
    for i, text in enumerate(texts):
        engine.add_request(f"g{i}", engine.tokenizer.encode(text), GREEDY)
    engine.add_request("s", engine.tokenizer.encode("Children walk to school"), SEEDED)


def run(engine: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens += o.new_token_ids
            logprobs += o.logprobs or ()
    return out


def test_cuda_graph_decode_gives_the_same_tokens_with_overlap_on_and_off(
    base: EngineConfig, model: LlamaModel, model_dir: Path
) -> None:
    results = []
    for overlap in (True, False):
        engine = make_engine(base, model, model_dir, overlap_scheduling=overlap)
        add_prompts(engine)  # all at once, same lengths out: the same batches either way
        replays = engine.runner.graphs.num_replays
        results.append(run(engine))
        assert engine.runner.graphs.num_replays - replays == GREEDY.max_tokens - 1
        assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert results[0] == results[1]
    assert all(len(tokens) == 24 for tokens, _ in results[0].values())


def test_a_steady_decode_step_makes_no_synchronizing_cuda_call(
    base: EngineConfig, model: LlamaModel, model_dir: Path
) -> None:
    engine = make_engine(base, model, model_dir)
    add_prompts(engine)
    for _ in range(4):  # prefill, then decodes: pinned buffers and graph plans warmed up
        engine.step()
    assert all(r.num_output_placeholders for r in engine.scheduler.running)
    replays = engine.runner.graphs.num_replays
    tokens = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            tokens += sum(len(o.new_token_ids) for o in engine.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.runner.graphs.num_replays - replays == 8
    assert tokens == 8 * 5  # one token per request per step, read one step late
