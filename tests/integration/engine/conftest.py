"""Fixtures for end-to-end engine tests: one loaded tiny model shared by every engine, the
transformers float32 reference, and text-like prompts with shared prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel
from vocabulary.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tiny model gains nothing from intra-op threads, and on a loaded 2-core machine a
    descheduled second OpenMP thread stalls every small op at its barrier (docs/benchmarks.md,
    "Engine (CPU)")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LlamaModel:
    return load_model(tiny_model_dir, torch.float32)


@pytest.fixture(scope="session")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """Eight prompts of 2 to 58 tokens; several share long prefixes (the first three share
    a 2-block prefix at block size 16, the next two a 1-block prefix)."""
    river = "The river runs past the old mill and under the stone bridge. In the morning the water"
    baker = "The baker opens his shop before the sun is up. He lights the oven"
    texts = [
        river + " is cold and clear",
        river + " is warm",
        river + " is cold and clear, and the fish rest in the shadow of the reeds. Children",
        baker,
        baker + ", mixes flour and water and salt",
        "Hello",
        "The",
        "Children walk to school along the bank.",
    ]
    return [tokenizer.encode(t) for t in texts]
