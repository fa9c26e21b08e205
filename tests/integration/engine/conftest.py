"""Fixtures for end-to-end engine tests: one loaded tiny model shared by every engine, the
transformers float32 reference, and text-like prompts with shared prefixes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel
from vocabulary.tokenizer import Tokenizer

Reference = Callable[[list[int], int], list[int]]


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
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path) -> Reference:
    """transformers float32 greedy continuation of a prompt (through eos), memoized."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            ids = list(prompt)
            for _ in range(max_tokens):  # full recompute: no generation-config behaviour
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            memo[key] = ids[len(prompt) :]
        return memo[key]

    return greedy


@pytest.fixture(scope="session")
def prompts(tiny_tokenizer: Tokenizer) -> list[list[int]]:
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
    return [tiny_tokenizer.encode(t) for t in texts]
