"""Small factories for runner/attention tests: chunks, batches, block tables, pools, runners."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.kv.kv_cache import KVCache
from engine.kv.kv_sizing import kv_cache_spec
from engine.modeling.llama import LlamaModel
from vocabulary.numeric import cdiv

BLOCK_SIZE = 16


def chunk(
    request_id: str,
    tokens: list[int],
    start: int,
    blocks: tuple[int, ...],
    sample: bool = True,
) -> SeqChunk:
    return SeqChunk(request_id, tuple(tokens), start, blocks, sample)


def batch(*chunks: SeqChunk) -> ScheduledBatch:
    return ScheduledBatch(tuple(chunks))


def sequential_blocks(first: int, num_tokens: int, block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
    """Contiguous block ids covering num_tokens, starting at `first`."""
    return tuple(range(first, first + cdiv(num_tokens, block_size)))


def scattered_blocks(seed: int, num_tokens: int, num_blocks: int, block_size: int = BLOCK_SIZE):
    """Distinct, non-contiguous, unordered block ids covering num_tokens."""
    gen = torch.Generator().manual_seed(seed)
    need = cdiv(num_tokens, block_size)
    return tuple(torch.randperm(num_blocks, generator=gen)[:need].tolist())


def make_pool(model: LlamaModel, num_blocks: int = 64, block_size: int = BLOCK_SIZE) -> KVCache:
    return KVCache(kv_cache_spec(model.cfg, block_size, model.dtype, num_blocks), model.device)


def make_runner(model: LlamaModel, model_dir: Path, num_blocks: int = 64) -> ModelRunner:
    config = EngineConfig(model_dir=str(model_dir), block_size=BLOCK_SIZE, cuda_graphs=False)
    return ModelRunner(model, make_pool(model, num_blocks), config)


def corpus_tokens(model_dir: Path) -> list[int]:
    """The bundled corpus tokenized with the model's tokenizer (text-like prompts)."""
    from tokenizers import Tokenizer

    from deploy.checkpoints.checkpoint_files import CORPUS

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(CORPUS.read_text()).ids


def prompt_tokens(corpus: list[int], seed: int, n: int) -> list[int]:
    """n consecutive corpus tokens starting at a seed-chosen place."""
    gen = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, len(corpus) - n, (1,), generator=gen))
    return corpus[start : start + n]
