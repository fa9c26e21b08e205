"""transformers float32 on the tiny checkpoint: the reference every exactness test compares
pdserve's greedy tokens with (the root conftest's `hf_greedy` and `hf_greedy_to_eos`), and its
log-probabilities with (`hf_logprobs`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Reference = Callable[[list[int], int], list[int]]
"""(prompt ids, max tokens) -> the reference's output ids."""


def greedy_reference(model_dir: Path, stop_at_eos: bool) -> Reference:
    """Memoized greedy continuations of transformers' float32 model in `model_dir`.

    `stop_at_eos` False: one forward pass per token over transformers' KV cache (no
    generation-config behaviour: eos ignored), as a request with `ignore_eos` runs. True:
    `generate`, which stops after eos, as a request without `ignore_eos` does. (A full
    recompute per token gives the same tokens on the corpus prompts, at several times the
    CPU.)"""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key in memo:
            return memo[key]
        if stop_at_eos:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
            )
            memo[key] = out[0, len(prompt) :].tolist()
        else:
            cache, step, ids = DynamicCache(), torch.tensor([prompt]), []
            for _ in range(max_tokens):
                ids.append(int(hf(step, cache=cache, use_cache=True).logits[0, -1].argmax()))
                step = torch.tensor([ids[-1:]])
            memo[key] = ids
        return memo[key]

    return greedy


LogitsReference = Callable[[list[int]], "torch.Tensor"]
"""(token ids) -> [len, vocab] float32 logits at every position."""


def logits_reference(model_dir: Path) -> LogitsReference:
    """transformers' float32 logits over a whole sequence (one forward pass): row p scores
    the token after position p (what pdserve's sampler penalizes and draws from)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.inference_mode()
    def logits(ids: list[int]) -> torch.Tensor:
        return hf(torch.tensor([ids])).logits[0].float()

    return logits


LogprobsReference = Callable[[list[int]], "torch.Tensor"]
"""(token ids) -> [len, vocab] float32 log-softmax of the logits at every position."""


def logprobs_reference(logits: LogitsReference) -> LogprobsReference:
    """The log-probabilities of `logits`' rows: row p is the distribution of the token after
    position p, the raw one pdserve's logprobs use."""
    import torch

    return lambda ids: torch.log_softmax(logits(ids), dim=-1)
