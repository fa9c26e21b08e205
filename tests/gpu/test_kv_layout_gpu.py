"""The head-major KV pool on the GPU: flashinfer reads its strided per-layer view and gives
bit-identical attention (so logits) to the block-major pool, eagerly and in CUDA-graph decode.

The model and steps are those of test_flashinfer_backend.py (tiny recipe in bf16, head_dim
64, mixed prefill chunks and decodes over scattered blocks). One GPU.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_flashinfer_backend import BS, NUM_BLOCKS, greedy, mixed_steps

from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.kv.kv_cache import BLOCK_MAJOR, HEAD_MAJOR, KVCache
from engine.kv.kv_sizing import kv_cache_spec
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deploy.checkpoints.make_model import make_model

    out = tmp_path_factory.mktemp("tiny-bf16-layout") / "model"
    return make_model(out, preset="tiny", num_layers=2, torch_dtype="bfloat16", hidden_size=256)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> LlamaModel:
    return load_model(model_dir, torch.bfloat16, "cuda")


@pytest.fixture(scope="module")
def corpus(model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    from deploy.checkpoints.checkpoint_files import CORPUS

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(CORPUS.read_text()).ids


def runner(model: LlamaModel, layout: str, graphs: bool = False) -> ModelRunner:
    config = EngineConfig(
        model_dir="tiny-bf16", block_size=BS, attention_backend="flashinfer",
        cuda_graphs=graphs, cuda_graph_max_batch=8, max_num_seqs=8, max_model_len=1024,
    )  # fmt: skip
    spec = replace(kv_cache_spec(model.cfg, BS, torch.bfloat16, NUM_BLOCKS), layout=layout)
    return ModelRunner(model, KVCache(spec, "cuda"), config)


def test_flashinfer_on_head_major_pool_is_bit_identical_to_block_major(
    model: LlamaModel, corpus: list[int]
) -> None:
    hm, bm = runner(model, HEAD_MAJOR), runner(model, BLOCK_MAJOR)
    assert hm.attention_backend == bm.attention_backend == "flashinfer"
    assert hm.kv_cache.tensor.shape[1] == model.cfg.num_kv_heads  # heads first in a block
    for batch in mixed_steps(corpus):
        got, want = hm.execute(batch), bm.execute(batch)
        assert torch.equal(got, want), [c.request_id for c in batch.chunks]
    for layer in range(model.cfg.num_layers):
        assert torch.equal(hm.kv_cache.layer(layer), bm.kv_cache.layer(layer))


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_cuda_graph_decode_on_head_major_pool_is_bit_identical_to_block_major(
    model: LlamaModel, corpus: list[int], num_seqs: int
) -> None:
    hm, bm = runner(model, HEAD_MAJOR, graphs=True), runner(model, BLOCK_MAJOR, graphs=True)
    assert hm.graphs is not None
    prompts = [corpus[100 * i : 100 * i + 10 + 7 * i] for i in range(num_seqs)]
    replays = hm.graphs.num_replays
    h_tokens, h_logits = greedy(hm, prompts, 16)
    b_tokens, b_logits = greedy(bm, prompts, 16)
    assert hm.graphs.num_replays - replays == 16
    assert h_tokens == b_tokens
    for a, b in zip(h_logits, b_logits, strict=True):
        assert torch.equal(a, b)
